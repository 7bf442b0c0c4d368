"""Strict loads report every missing and unexpected key and every shape mismatch by FQN before
changing anything; non-strict loads load what matches and warn with the same report."""

from __future__ import annotations

from pathlib import Path

import fsdp_ckpt as ck
import pytest
import torch
from torch import nn

from . import ranks


class _Changed(nn.Module):
    """TinyGPT's checkpoint seen by a model that renamed, reshaped, added and dropped things."""

    def __init__(self) -> None:
        super().__init__()
        base = ranks.build(1)
        self.tok = base.tok
        self.pos = nn.Parameter(torch.zeros(12, 22))  # shape differs: (9, 22) saved
        self.blocks = base.blocks
        self.ln_f = base.ln_f
        self.adapter = nn.Linear(22, 22)  # new
        # base.frozen and base.head (tied) are gone: frozen.* are unexpected


@pytest.fixture()
def saved(tmp_path: Path) -> str:
    model = ranks.build(0)
    opt = ranks.optimizer(model)
    ranks.plain_train(model, opt, 1, range(1))
    ck.save(tmp_path / "c", model, opt)
    return str(tmp_path / "c")


def test_strict_reports_every_mismatch_by_fqn_and_changes_nothing(saved: str) -> None:
    model = _Changed()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ck.CheckpointMismatchError) as info:
        ck.load(saved, model)
    report = info.value.report
    assert report.missing == ("adapter.bias", "adapter.weight")
    assert report.unexpected == ("frozen.bias", "frozen.weight")
    assert [(m.fqn, m.saved, m.expected) for m in report.shape_mismatches] == [
        ("pos", (9, 22), (12, 22))
    ]
    for fqn in ("adapter.weight", "frozen.bias", "pos"):
        assert fqn in str(info.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_non_strict_loads_what_matches_and_warns(saved: str) -> None:
    model = _Changed()
    adapter = model.adapter.weight.detach().clone()
    with pytest.warns(ck.CheckpointMismatchWarning) as caught:
        ck.load(saved, model, strict=False)
    report = caught[0].message.report
    assert report.missing == ("adapter.bias", "adapter.weight")
    assert torch.equal(model.adapter.weight, adapter)
    reference = ranks.build(0)
    ck.load(saved, reference)
    assert torch.equal(model.blocks[0].mlp[0].weight, reference.blocks[0].mlp[0].weight)
    assert torch.equal(model.pos, torch.zeros(12, 22))  # mismatched: left alone


def test_optimizer_state_mismatches_are_reported(saved: str, tmp_path: Path) -> None:
    model = ranks.build(1)
    opt = torch.optim.AdamW([model.pos], lr=1e-2)  # state saved for every parameter
    with pytest.raises(
        ck.CheckpointMismatchError,
        match="unexpected in the checkpoint .*: optimizer state of blocks.0",
    ):
        ck.load(saved, model, opt)
    ck.save(tmp_path / "no_opt", ranks.build(0))
    with pytest.raises(ck.CheckpointMismatchError, match="saved without an optimizer"):
        ck.load(tmp_path / "no_opt", model, opt)


def test_optimizer_hyperparameters_restored(saved: str) -> None:
    model = ranks.build(1)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=0.5, betas=(0.1, 0.2)
    )
    ck.load(saved, model, opt)
    group = opt.param_groups[0]
    assert group["lr"] == 1e-2 and group["betas"] == (0.9, 0.999) and group["eps"] == 1e-5


def test_argument_errors_name_the_argument(saved: str) -> None:
    with pytest.raises(TypeError, match="strict must be a bool"):
        ck.load(saved, ranks.build(1), strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        ck.load(saved, object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_last must be an int >= 1, got 0"):
        ck.save(saved, ranks.build(1), keep_last=0)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        ck.load(saved, ranks.build(1), "adam")  # type: ignore[arg-type]
    foreign = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the model"):
        ck.save(saved, ranks.build(1), foreign)
    # Nothing above left a half-made version behind.
    assert ck.inspect_checkpoint(saved).versions == ("v000001",)
