"""examples/accelerate_fsdp.py: this engine inside a Hugging Face Accelerate loop, 2 processes.

The example runs under torchrun (2 CPU processes, gloo), each run a subprocess with a timeout:

- its losses and gradient norms equal those of one plain model on one process that takes, at
  every step, the union of both ranks' micro-batches (the sample ids the run logged), within
  1e-5. This checks the loader's per-rank split, ``accelerator.accumulate`` (the engine's
  ``no_sync``), ``accelerator.backward``, ``accelerator.clip_grad_norm_`` on DTensor
  gradients and the prepared optimizer. Every sample is used once per epoch;
- a run stopped after step 4 and resumed with ``fsdp_ckpt.load`` logs the same samples and
  the same losses as the uninterrupted run, bit for bit, and ends with the same weights;
- the final checkpoint, loaded into a plain model on one process, equals the reference.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("accelerate")
import fsdp_ckpt  # noqa: E402

# Three 2-process runs in the fixture (each up to TIMEOUT): more than the default 180 s.
pytestmark = [pytest.mark.frameworks, pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "accelerate_fsdp.py"
TIMEOUT = 120
STEPS = 12  # 2 epochs of 6 optimizer steps (96 samples, 2 ranks x 4 samples x 2 micro-batches)
STOP = 4  # mid-epoch
LR, MAX_NORM = 0.05, 0.3


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("accelerate_fsdp_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Job:
    """A command started in the background, its output in files ``stem.stdout`` and
    ``stem.stderr`` (not pipes: jobs run at once, and a pipe nobody reads meanwhile would fill
    and stall its job); `finish` waits for it."""

    def __init__(self, cmd: list[str], stem: Path, **env: str) -> None:
        self.stem = stem
        with open(f"{stem}.stdout", "w") as out, open(f"{stem}.stderr", "w") as err:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=err,
                text=True,
                cwd=str(ROOT),
                env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            )

    def finish(self) -> str:
        """Wait (killed past TIMEOUT); its stdout, after checking that it succeeded."""
        try:
            self.proc.wait(timeout=TIMEOUT)
        finally:
            self.kill()
        stdout = Path(f"{self.stem}.stdout").read_text()
        stderr = Path(f"{self.stem}.stderr").read_text()
        assert self.proc.returncode == 0, stdout[-4000:] + stderr[-4000:]
        return stdout

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _start(out: Path, log: Path, *extra: str) -> _Job:
    """The example under torchrun (2 processes). ``--standalone`` picks a free rendezvous
    port, so runs started together do not collide."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EXAMPLE),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--lr",
        str(LR),
        "--max-grad-norm",
        str(MAX_NORM),
        "--log-file",
        str(log),
        *extra,
    ]
    return _Job(cmd, log.with_suffix(""), PYTHONUNBUFFERED="1")


def _run(out: Path, log: Path, *extra: str) -> str:
    return _start(out, log, *extra).finish()


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def claims(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """accelerate_claims.py on 2 ranks, started in the background before the example's runs
    (``runs`` asks for it) so that it overlaps them: the job, and where each rank's facts go."""
    where = tmp_path_factory.mktemp("accelerate_claims")
    script = Path(__file__).with_name("accelerate_claims.py")
    job = _Job(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(where),
        ],
        where / "torchrun",
    )
    yield job, where
    job.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, claims: Any) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("accelerate")
    # The uninterrupted run and the first half of the resumed one are independent: run them at
    # once. Each spends seconds importing torch serially in torchrun's agent, and the two
    # overlap those; the second half needs the first's checkpoint.
    jobs = [
        _start_in(tmp / name, extra)
        for name, extra in (("full", ()), ("resumed", ("--stop-after", str(STOP))))
    ]
    try:
        for job in jobs:
            job.finish()
    finally:
        for job in jobs:
            job.kill()
    full, first = _log(tmp / "full" / "log.jsonl"), _log(tmp / "resumed" / "log.jsonl")
    out = _run(tmp / "resumed" / "ck", tmp / "resumed" / "log2.jsonl")
    assert f"resumed from {tmp / 'resumed' / 'ck'} at step {STOP}" in out, out
    second = _log(tmp / "resumed" / "log2.jsonl")
    return {"full": full, "resumed": first + second, "first": first, "tmp": tmp}


def _start_in(where: Path, extra: tuple[str, ...]) -> _Job:
    where.mkdir()
    return _start(where / "ck", where / "log.jsonl", *extra)


def _reference(log: list[dict[str, Any]]) -> tuple[list[float], list[float], Any]:
    """One plain model on one process, the union of the ranks' micro-batches per step."""
    ex = _example()
    data = ex.Samples()
    model = ex.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for entry in log:
        ids = torch.tensor([i for micro in entry["samples"] for i in micro])
        loss = F.cross_entropy(model(data.x[ids]), data.y[ids])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def test_losses_match_one_process_on_the_union_of_the_ranks_batches(runs: dict[str, Any]) -> None:
    log = runs["full"]
    assert [e["step"] for e in log] == list(range(1, STEPS + 1))
    for epoch in range(2):  # each epoch uses every sample once, split over the ranks
        ids = [i for e in log[6 * epoch : 6 * epoch + 6] for m in e["samples"] for i in m]
        assert sorted(ids) == list(range(96)), epoch
    assert all(len(e["samples"]) == 2 and all(len(m) == 8 for m in e["samples"]) for e in log)
    assert log[0]["samples"] != log[6]["samples"]  # reshuffled at the second epoch
    losses, norms, _ = _reference(log)
    for entry, loss, norm in zip(log, losses, norms):
        assert abs(entry["loss"] - loss) <= 1e-5, (entry["step"], entry["loss"], loss)
        assert abs(entry["grad_norm"] - norm) <= 1e-5, (entry["step"], entry["grad_norm"], norm)
    assert sum(n > MAX_NORM for n in norms) >= 3  # clipping was exercised


def test_resumed_run_continues_like_the_uninterrupted_one(runs: dict[str, Any]) -> None:
    full, resumed = runs["full"], runs["resumed"]
    assert [e["step"] for e in runs["first"]] == list(range(1, STOP + 1))
    assert [e["step"] for e in resumed] == [e["step"] for e in full]
    for a, b in zip(full, resumed):  # bit for bit: the same samples, the same arithmetic
        assert a["samples"] == b["samples"], a["step"]  # the data position was restored
        assert a["loss"] == b["loss"], (a["step"], a["loss"], b["loss"])
        assert a["grad_norm"] == b["grad_norm"], a["step"]
    ex = _example()
    final = {}
    for name in ("full", "resumed"):
        final[name] = ex.build_model(seed=1)
        fsdp_ckpt.load(str(runs["tmp"] / name / "ck"), final[name])
    for fqn, p in final["full"].named_parameters():
        assert torch.equal(p, final["resumed"].get_parameter(fqn)), fqn


def test_final_checkpoint_loads_into_a_plain_model(runs: dict[str, Any]) -> None:
    _, _, reference = _reference(runs["full"])
    for name in ("full", "resumed"):
        model = _example().build_model(seed=1)
        extra = fsdp_ckpt.load(str(runs["tmp"] / name / "ck"), model)
        assert extra == {"step": STEPS}
        for fqn, p in reference.named_parameters():
            torch.testing.assert_close(
                model.get_parameter(fqn), p, rtol=0, atol=1e-5, msg=f"{name}: {fqn}"
            )


def test_what_accelerate_does_with_a_sharded_model(claims: Any) -> None:
    """The claims of docs/drafts/accelerate.md, "What does not apply", checked on 2 ranks."""
    job, where = claims
    job.finish()
    facts = [json.loads((where / f"rank{r}.json").read_text()) for r in range(2)]
    for f in facts:
        if not torch.cuda.is_available():  # torchrun without cpu=True: every rank alone
            assert f["type_without_cpu_flag"] == "DistributedType.NO"
        assert f["type"] == "DistributedType.MULTI_CPU"
        assert f["prepare_plain_model"] == "DistributedDataParallel"
        assert f["prepare_sharded_model"].startswith("RuntimeError: Cannot flatten unevenly")
        assert f["bf16_unprepared_output"] == "torch.float32"  # mixed_precision= ignored
        assert f["bf16_autocast_output"] == "torch.bfloat16"  # autocast() is torch.autocast
        assert f["bf16_autocast_backward"] == "no error"
        assert f["get_state_dict_types"] == ["DTensor"]  # this rank's shards, not a full dict
        assert f["accumulate_sync_calls"] == [False, True]  # the engine's no_sync, then sync
        assert f["save_state_files"] == [
            "optimizer.bin",
            "random_states_0.pkl",
            "random_states_1.pkl",
        ]  # no model
        assert f["load_state"] == "no error"
        assert f["save_model"].startswith("RuntimeError")
    # one optimizer file, written by rank 0: rank 1 gets wrong state back, silently
    assert facts[0]["load_state_restored_optimizer"] is True
    assert facts[1]["load_state_restored_optimizer"] is False
    assert facts[1]["load_state_left_zeros"] is False
