"""The rank side of ``test_accelerate.py::test_what_accelerate_does_with_a_sharded_model``.

``torchrun --standalone --nproc-per-node 2 accelerate_claims.py OUT_DIR`` checks on CPU, with
gloo, what docs/drafts/accelerate.md says about the Accelerate features that do not apply to
a model sharded by this engine. Each rank writes ``OUT_DIR/rank<N>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from fsdp_engine import fully_shard
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import accelerate_fsdp as ex  # noqa: E402


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]
    return "no error"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def main(out: Path) -> None:
    facts: dict[str, Any] = {}
    # Which distributed type a torchrun job gets on a machine without GPUs, without cpu=True
    # (Accelerate's own decision function; the state itself is a singleton, set below).
    facts["type_without_cpu_flag"] = str(PartialState._prepare_backend(None, cpu=False)[1])
    # Torch's FSDP as Accelerate's plugin: on CPU it is ignored (prepare still gives DDP).
    acc = Accelerator(
        cpu=True,
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
    )
    facts["type"] = str(acc.distributed_type)
    facts["prepare_plain_model"] = type(acc.prepare(ex.build_model())).__name__

    mesh = init_device_mesh("cpu", (acc.num_processes,))
    model = ex.build_model()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(acc.process_index))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(acc.process_index))
    facts["bf16_unprepared_output"] = str(model(x).dtype)
    with acc.autocast():
        facts["bf16_autocast_output"] = str(model(x).dtype)
        facts["bf16_autocast_backward"] = _error(lambda: model(x).float().sum().backward())
    facts["get_state_dict_types"] = sorted(
        {type(v).__name__ for v in acc.get_state_dict(model).values()}
    )
    facts["prepare_sharded_model"] = _error(lambda: acc.prepare(model))

    # A second Accelerator: the first one kept the models it was asked to prepare (even the
    # one that failed), and its save_state would try to save them.
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    # accumulate(model) turns gradient sync off for all but the last micro-batch
    calls: list[bool] = []
    original = model.set_requires_gradient_sync
    model.set_requires_gradient_sync = lambda flag, **kw: (
        calls.append(flag),  # type: ignore
        original(flag, **kw),
    )
    raw = torch.optim.AdamW(model.parameters(), lr=0.05)
    opt = acc.prepare(raw)
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    facts["accumulate_sync_calls"] = calls
    model.set_requires_gradient_sync = original  # type: ignore[method-assign]

    # save_state / load_state: the model is not saved; the optimizer only from rank 0
    want_opt = {
        i: _local(raw.state[p]["exp_avg"]).clone() for i, p in enumerate(model.parameters())
    }
    state_dir = out / "state"
    acc.save_state(str(state_dir))
    acc.wait_for_everyone()
    facts["save_state_files"] = sorted(os.listdir(state_dir))
    for st in raw.state.values():
        _local(st["exp_avg"]).zero_()
    facts["load_state"] = _error(lambda: acc.load_state(str(state_dir)))
    facts["load_state_restored_optimizer"] = all(
        torch.equal(_local(raw.state[p]["exp_avg"]), want_opt[i])
        for i, p in enumerate(model.parameters())
    )
    facts["load_state_left_zeros"] = all(
        not _local(raw.state[p]["exp_avg"]).any() for p in model.parameters()
    )
    facts["save_model"] = _error(lambda: acc.save_model(model, str(out / "model")))
    acc.wait_for_everyone()
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(facts))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
