"""One rank of test_fault_tolerant_engine.py: `fully_shard` hybrid sharding whose replicate
dimension is `fsdp_comm.FaultTolerantReplicate` (FT_MODE=ft: each replica group its own torch
world), or the ordinary 2-D mesh over one world of 4 ranks (FT_MODE=hsdp), same model and data.

Writes each committed step's membership to FT_OUT (JSON lines) and, at the end, this rank's
parameter and optimizer-state shards to FT_DIR/<mode>_<replica>_<shard>.pt.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from fsdp_comm import FaultTolerantReplicate, get_backend, init_mesh
from fsdp_engine import fully_shard
from torch import nn
from torch.distributed.tensor import DTensor


def make_model() -> nn.Module:
    """Uneven shapes, and a frozen layer in the root unit beside trained ones: its flat
    buffer mixes parameters with and without gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(10, 17), nn.Tanh(), nn.Linear(17, 7), nn.Tanh(), nn.Linear(7, 5)
    )
    model[2].requires_grad_(False)
    return model


def batch(step: int, replica: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * replica + shard)
    return torch.randn(4, 10, generator=gen), torch.randn(4, 5, generator=gen)


def local(t: Any) -> Any:
    return t.to_local().clone() if isinstance(t, DTensor) else t


def main() -> None:
    mode, steps = os.environ["FT_MODE"], int(os.environ["FT_STEPS"])
    out = open(os.environ["FT_OUT"], "a", buffering=1)  # noqa: SIM115 - for the whole run
    hold_at = int(os.environ.get("FT_HOLD_AT", "-1"))
    world = get_backend("torch")
    model = make_model()
    position = [0]
    opt: torch.optim.Optimizer | None = None

    def state() -> dict[str, Any]:
        assert opt is not None
        return {"model": model.state_dict(), "optim": opt.state_dict(), "position": position[0]}

    def load_state(got: dict[str, Any]) -> None:
        assert opt is not None
        model.load_state_dict(got["model"])
        opt.load_state_dict(got["optim"])
        position[0] = got["position"]

    ft: FaultTolerantReplicate | None = None
    if mode == "ft":
        ft = FaultTolerantReplicate(world, state=state, load_state=load_state)
        mesh = ft.mesh()
        replica, shard = ft.replica, world.rank
    else:
        mesh = init_mesh((2, world.world_size // 2), backend=world)
        replica, shard = mesh.coordinate
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out.write(json.dumps({"replica": replica, "shard": shard, "ready": time.time()}) + "\n")
    step = 0
    while step < steps:
        if step == hold_at:
            until = time.monotonic() + 60
            while not os.path.exists(os.environ["FT_HOLD_FILE"]) and time.monotonic() < until:
                time.sleep(0.05)
        if ft is not None:
            ft.start_step()
            step = ft.step
        x, y = batch(step, replica, shard)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        members = list(ft.ranks) if ft is not None else [0, 1]
        if ft is None or ft.commit():
            opt.step()
            step += 1
            position[0] += 1
            row = {"replica": replica, "shard": shard, "step": step, "members": members}
            out.write(json.dumps({**row, "t": time.time()}) + "\n")
        opt.zero_grad(set_to_none=True)
    saved = {
        "params": {k: local(v) for k, v in model.state_dict().items()},
        "optim": {i: {k: local(v) for k, v in s.items()} for i, s in enumerate(opt.state.values())},
        "position": position[0],
        "rng": torch.get_rng_state(),
    }
    torch.save(saved, Path(os.environ["FT_DIR"]) / f"{mode}_{replica}_{shard}.pt")
    out.close()
    if ft is not None:
        ft.close()
    os._exit(0)  # a replica group's peer may be dead: skip process-group teardown


if __name__ == "__main__":
    main()
