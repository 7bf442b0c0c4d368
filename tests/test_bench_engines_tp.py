"""`python -m fsdp.bench.engines --tp N`: FSDP x TP, this engine against torch's FSDP2 on the
same cut model; both train to the same losses (the benchmark compares like with like)."""

from __future__ import annotations

import pytest
import torch

from fsdp.bench.engines import EngineBenchConfig, main, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
        reason="the sequence-parallel plan needs torch >= 2.13",
    ),
]


def test_tp_runs_both_engines_to_the_same_losses() -> None:
    got = {
        e: run_engine(EngineBenchConfig(engine=e, model="tiny", steps=1, warmup=1, tp=2), 2)
        for e in ("ours", "fsdp2")
    }
    torch.testing.assert_close(
        torch.tensor(got["ours"].losses), torch.tensor(got["fsdp2"].losses), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("argv", [["--tp", "3"], ["--tp", "2", "--engines", "ours,ddp"]])
def test_bad_tp_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--world-size", "2", *argv])
    assert "--tp" in capsys.readouterr().err
