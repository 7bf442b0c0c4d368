"""`fsdp.integrations.lightning.FSDPStrategy` under Lightning's own Trainer, on CPU (gloo).

A tiny LightningModule (two Blocks, 7 -> 13 -> 5, and a head on the root; AdamW with a StepLR
schedule stepped per batch, gradient clipping, a validation loop) trains on a fixed dataset at 2
processes (``lightning_ranks.py``). Checked: per-step losses (the mean over ranks) and validation
losses equal Lightning's own DDP strategy's within 1e-5, with and without activation
checkpointing, and under the registered name ``strategy="fsdp_engine"``; parameters are
DTensors with unchanged names; a run saving ``trainer.save_checkpoint`` after 4 steps and a
fresh Trainer resuming from it with ``fit(ckpt_path=...)`` reproduce steps 5-8 of an
uninterrupted 8-step run, at 2 devices and at 1 (the global batch is 8 samples either way); a
meta-device ``configure_model`` trains; the checkpoint holds Lightning's state without pickles;
the docs' example (docs/frameworks-examples.md) runs. With ``tensor_parallel_size=2`` (the
tiny GPT cut by `fsdp.models._tp_plan` in ``configure_model``, dp 1) the losses equal the tiny GPT's
without tensor parallelism, and a checkpoint after one epoch resumes exactly.

Needs ``lightning`` (``pip install "fsdp[lightning]"``); skipped without it. The test process
itself does not import lightning (a 10 s import on this machine); the ranks do. About 60 s on
2 idle cores, most of it five interpreters importing torch and lightning.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Frameworks' own loops (their legs in .ci/run: python -m pytest -m frameworks).
pytestmark = pytest.mark.frameworks

if importlib.util.find_spec("lightning") is None:
    pytest.skip("needs lightning: pip install 'fsdp[lightning]'", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
RANKS = Path(__file__).with_name("lightning_ranks.py")
EXAMPLE = REPO / "examples" / "lightning_fsdp.py"
TOL = 1e-5
# Variables a launcher (torchrun, Slurm, an outer Lightning) may have set: not for our ranks.
_LAUNCHER_VARS = (
    "LOCAL_RANK",
    "RANK",
    "GLOBAL_RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
)


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS and not k.startswith("SLURM_")
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Job:
    """A process started in the background, its output in ``log``; `finish` waits for it."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str], what: str) -> None:
        self.log, self.what = log, what
        with log.open("w") as f:
            self.proc = subprocess.Popen(
                args, cwd=log.parent, stdout=f, stderr=subprocess.STDOUT, env=env
            )

    def finish(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        text = self.log.read_text()
        assert self.proc.returncode == 0, (
            f"{self.what} failed (exit {self.proc.returncode}):\n{text[-6000:]}"
        )
        return text

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory):
    """examples/lightning_fsdp.py as a user runs it (Lightning's own launcher starts rank 1),
    started before the other runs so that it overlaps them."""
    where = tmp_path_factory.mktemp("lightning_example")
    job = _Job(
        [sys.executable, str(EXAMPLE), str(where / "checkpoints")],
        where / "example.log",
        _env(),
        "examples/lightning_fsdp.py",
    )
    yield job
    job.kill()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, example: _Job):
    """``lightning_ranks.py suite`` on 2 ranks started here, as torchrun would (Lightning then
    does not re-run the script, and both ranks import at once); with them, in the background,
    the resume on one device (``runs.resume1``): it imports Lightning meanwhile and waits for
    the suite's checkpoint, instead of importing alone after the suite (~10 s)."""
    out = tmp_path_factory.mktemp("lightning")
    env = dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", NODE_RANK="0"
    )
    ranks = [
        _Job(
            [sys.executable, str(RANKS), "suite", str(out)],
            out / f"rank{r}.log",
            _env(LOCAL_RANK=str(r), **env),
            f"rank {r} of the 2-process suite",
        )
        for r in range(2)
    ]
    resume1 = _Job(
        [sys.executable, str(RANKS), "resume1", str(out)],
        out / "resume1.log",
        _env(),
        "resuming on one device",
    )
    try:
        for job in ranks:
            job.finish(timeout=150)
    except BaseException:
        resume1.kill()  # it would wait for a checkpoint that may never come
        raise
    finally:
        for job in ranks:
            job.kill()
    yield argparse.Namespace(out=out, resume1=resume1)
    resume1.kill()


def _run(out: Path, name: str) -> tuple[dict[int, float], dict]:
    data = json.loads((out / f"{name}.json").read_text())
    return {int(k): v for k, v in data["losses"].items()}, data["facts"]


def _val(out: Path, name: str) -> dict[int, float]:
    data = json.loads((out / f"{name}.json").read_text())
    return {int(k): v for k, v in data["val"].items()}


def _assert_losses(got: dict[int, float], want: dict[int, float], tol: float, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(got), sorted(want))
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= tol, f"{what}: max |difference| {worst:.3g} > {tol}\n{got}\n{want}"


@pytest.mark.slow
def test_losses_equal_lightning_ddp(runs: argparse.Namespace) -> None:
    ddp, ddp_facts = _run(runs.out, "ddp")
    ddp_val = _val(runs.out, "ddp")
    assert sorted(ddp) == list(range(1, 9)) and sorted(ddp_val) == [0, 4, 8]
    for name in ("fsdp", "fsdp_ac"):
        losses, facts = _run(runs.out, name)
        _assert_losses(losses, ddp, TOL, f"{name} vs Lightning's DDP")
        _assert_losses(_val(runs.out, name), ddp_val, TOL, f"{name} validation vs DDP's")
        # sharded by this engine: DTensor parameters, one unit per Block plus the root, and
        # the parameter names Lightning (and DDP) use, with activation checkpointing too
        assert facts["dtensor"] and not ddp_facts["dtensor"]
        assert facts["units"] == ["", "blocks.0", "blocks.1"], facts["units"]
        assert facts["names"] == ddp_facts["names"]
        assert facts["lr"] == ddp_facts["lr"]
    # Trainer(strategy="fsdp_engine"): the registered name, defaults (the root is the one unit)
    losses, facts = _run(runs.out, "registered")
    _assert_losses(losses, {1: ddp[1], 2: ddp[2]}, TOL, "strategy='fsdp_engine' vs DDP")
    assert facts["units"] == [""] and facts["dtensor"]
    # accumulate_grad_batches=2: each micro-batch's gradients are reduced and added up
    want, _ = _run(runs.out, "ddp_accumulate")
    losses, _ = _run(runs.out, "fsdp_accumulate")
    _assert_losses(losses, want, TOL, "accumulate_grad_batches=2 vs DDP")


@pytest.mark.slow
def test_resumed_run_continues_exactly(runs: argparse.Namespace) -> None:
    full, full_facts = _run(runs.out, "fsdp")
    first, _ = _run(runs.out, "first")
    resumed, facts = _run(runs.out, "resumed")
    _assert_losses(first, {s: full[s] for s in range(1, 5)}, 0.0, "the first 4 steps")
    # weights, AdamW moments and step, the LR schedule and the loops all came back
    _assert_losses(resumed, {s: full[s] for s in range(5, 9)}, 1e-6, "resumed steps 5-8")
    assert facts["lr"] == full_facts["lr"]
    # trainer.validate(ckpt_path=...) loads the weights alone into a fresh module
    _assert_losses(
        _val(runs.out, "validated"),
        {4: _val(runs.out, "fsdp")[4]},
        TOL,
        "validate(ckpt_path=...) vs the validation after step 4",
    )


@pytest.mark.slow
def test_resume_at_another_device_count(runs: argparse.Namespace) -> None:
    """The 2-rank checkpoint resumes on 1 device (global batch 8 either way)."""
    runs.resume1.finish(timeout=150)
    full, _ = _run(runs.out, "fsdp")
    resumed, facts = _run(runs.out, "resumed1")
    assert facts["world"] == 1 and facts["dtensor"]
    _assert_losses(resumed, {s: full[s] for s in range(5, 9)}, TOL, "resumed on 1 device")


@pytest.mark.slow
def test_mixed_precision_policy(runs: argparse.Namespace) -> None:
    """torch's MixedPrecisionPolicy(param_dtype=bfloat16) is applied: close to fp32, not equal."""
    ddp, _ = _run(runs.out, "ddp")
    losses, facts = _run(runs.out, "bf16")
    assert sorted(losses) == [1, 2, 3, 4] and facts["dtensor"]
    for step, loss in losses.items():
        assert loss != ddp[step] and abs(loss - ddp[step]) <= 0.03 * ddp[step], (step, loss)


@pytest.mark.slow
def test_meta_device_configure_model(runs: argparse.Namespace) -> None:
    losses, facts = _run(runs.out, "meta")
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(math.isfinite(v) for v in losses.values()), losses
    assert facts["dtensor"] and facts["units"] == ["", "blocks.0", "blocks.1"]
    assert 0 < facts["max_abs"] < 10, facts  # reset_parameters ran: no uninitialized memory


@pytest.mark.slow
def test_tensor_parallel_size(runs: argparse.Namespace) -> None:
    """``FSDPStrategy(tensor_parallel_size=2)``: configure_model cuts the GPT over the strategy's
    ``tensor_parallel`` mesh dimension, the strategy shards over ``data_parallel``; both ranks
    of the tp group see the same batches. fp32: only the order of additions differs."""
    plain, plain_facts = _run(runs.out, "gpt")
    tp, facts = _run(runs.out, "gpt_tp")
    _assert_losses(tp, plain, TOL, "tensor_parallel_size=2 vs plain FSDP")
    assert facts["dtensor"] and facts["names"] == plain_facts["names"]
    assert facts["mesh_dims"] == [["data_parallel", "tensor_parallel"]], facts["mesh_dims"]
    assert plain_facts["mesh_dims"] == [[]], plain_facts["mesh_dims"]  # a 1-D unnamed mesh
    first, _ = _run(runs.out, "gpt_tp_first")
    resumed, _ = _run(runs.out, "gpt_tp_resumed")
    _assert_losses(first, {s: tp[s] for s in (1, 2)}, 0.0, "the first 2 steps")
    _assert_losses(resumed, {s: tp[s] for s in (3, 4)}, 1e-6, "resumed steps 3-4 (tp 2)")


@pytest.mark.slow
def test_checkpoint_holds_lightning_state_without_pickle(runs: argparse.Namespace) -> None:
    import fsdp_ckpt

    path = runs.out / "ckpt"
    info = fsdp_ckpt.inspect_checkpoint(path)
    assert info.world_size == 2 and info.optimizer == "torch.optim.adamw.AdamW"
    assert info.extra_keys == ("lightning",), info.extra_keys  # no pickled remainder
    # a plain module with the same names loads it at world size 1, no Lightning needed
    model = torch.nn.Module()
    model.blocks = torch.nn.Sequential(torch.nn.Module(), torch.nn.Module())
    model.blocks[0].linear = torch.nn.Linear(7, 13)
    model.blocks[1].linear = torch.nn.Linear(13, 5)
    model.head = torch.nn.Linear(5, 5)
    state = fsdp_ckpt.load(path, model)["lightning"]
    assert state["global_step"] == 4 and state["epoch"] == 0
    assert state["hyper_parameters"] == {"lr": 0.05, "on_meta": False}
    assert state["lr_schedulers"][0]["last_epoch"] == 4
    assert "fit_loop" in state["loops"] and "state_dict" not in state
    assert "optimizer_states" not in state


@pytest.mark.slow
def test_readme_example_runs(example: _Job) -> None:
    output = example.finish(timeout=170)
    assert "Restored all states from the checkpoint" in output
    ckpt = example.log.parent / "checkpoints"
    assert (ckpt / "last.ckpt" / "CURRENT").is_file()
    import fsdp_ckpt

    assert fsdp_ckpt.inspect_checkpoint(ckpt / "last.ckpt").world_size == 2


# ---- no processes: the pieces that do not need Lightning ---------------------------------------
def test_checkpoint_extra_keeps_plain_values_and_pickles_only_the_rest(tmp_path: Path) -> None:
    import fsdp_ckpt

    from fsdp.integrations._lightning_checkpoint import from_extra, to_extra

    checkpoint = {
        "epoch": 3,
        "global_step": 12,
        "loops": {"fit_loop": {"n": (1, 2)}},
        "callbacks": {
            "ModelCheckpoint{}": {
                "kth_value": torch.tensor(float("inf")),
                "best": torch.arange(100.0),
            }
        },
        "state_dict": {"w": torch.ones(2)},
        "optimizer_states": [{}],
        "hyper_parameters": {"args": argparse.Namespace(lr=0.1)},
    }
    extra = to_extra(checkpoint)
    assert set(extra) == {"lightning", "lightning_pickled"}
    assert set(extra["lightning"]) == {"epoch", "global_step", "loops", "callbacks"}
    fsdp_ckpt.save(tmp_path / "c", torch.nn.Linear(2, 2), extra=extra)
    back = fsdp_ckpt.load(tmp_path / "c", torch.nn.Linear(2, 2))
    with pytest.raises(Exception, match="[Ww]eights only"):
        from_extra(back)  # torch.load's default (weights_only=True) refuses a Namespace
    restored = from_extra(back, weights_only=False)
    assert restored["hyper_parameters"] == {"args": argparse.Namespace(lr=0.1)}
    assert restored["loops"] == {"fit_loop": {"n": (1, 2)}}
    cb = restored["callbacks"]["ModelCheckpoint{}"]
    assert torch.equal(cb["best"], torch.arange(100.0)) and cb["kth_value"].item() == math.inf
    assert "state_dict" not in restored and "optimizer_states" not in restored
    with pytest.raises(ValueError, match="not written by"):
        from_extra({"something": 1})


def test_tensor_parallel_arguments_are_checked() -> None:
    from fsdp.integrations._lightning_wrap import tp_size  # FSDPStrategy's check

    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 1 .*got 0"):
        tp_size(0, "auto", None)
    with pytest.raises(ValueError, match=r"data_parallel_size must be 'auto' or an int"):
        tp_size(2, "all", None)
    with pytest.raises(ValueError, match=r"device_mesh must be None or \(replicate, shard\)"):
        tp_size(2, "auto", "mesh")
    assert tp_size(2, "auto", (1, 2)) == 2 and tp_size(1, 4, object()) == 1


def test_policies() -> None:
    from fsdp.integrations._lightning_wrap import as_predicate

    is_linear = as_predicate({torch.nn.Linear}, "auto_wrap_policy")
    assert is_linear(torch.nn.Linear(1, 1)) and not is_linear(torch.nn.ReLU())
    assert as_predicate(torch.nn.ReLU, "p")(torch.nn.ReLU())
    assert as_predicate(None, "p") is None
    with pytest.raises(TypeError, match="nn.Module subclass"):
        as_predicate({"Block"}, "auto_wrap_policy")
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        as_predicate(3, "auto_wrap_policy")
