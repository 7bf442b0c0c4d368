"""`fsdp train --compile`: compiled blocks train to the same losses as eager ones (with and
without activation checkpointing), the engine's hooks stay outside the compiled region (no
graph break), and a bad backend or a missing C++ compiler is a clean CLI error."""

from __future__ import annotations

import json

import pytest

from fsdp._cli import main as fsdp_main

from ..forkserver_preload import warm_forkserver
from ._corpus import write_corpus

STEPS = 3
RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """``--data`` for every run here: not the default corpus, read by walking the whole
    standard library on every rank (see ``_corpus.py``)."""
    return write_corpus(tmp_path_factory.mktemp("corpus") / "stdlib.txt")


def _losses(tmp_path, corpus: str, name: str, *extra: str) -> list[float]:
    metrics = tmp_path / f"{name}.jsonl"
    assert (
        fsdp_main(
            [
                "train",
                "--model",
                "tiny",
                "--steps",
                str(STEPS),
                "--world-size",
                "2",
                "--no-progress",
                "--threads-per-rank",
                "1",
                "--metrics",
                str(metrics),
                "--data",
                corpus,
                *extra,
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return [r["loss"] for r in rows]


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory, corpus: str) -> list[float]:
    """The eager reference, over threads in this process, without starting two ranks: its
    losses equal those over processes (bit for bit on CPU, well within RTOL). The compiled
    runs below use both backends, processes for ``test_compiled_blocks_match_eager``."""
    return _losses(tmp_path_factory.mktemp("eager"), corpus, "eager", "--backend", "threads")


def _assert_close(compiled: list[float], eager: list[float]) -> None:
    assert len(compiled) == len(eager) == STEPS
    for c, e in zip(compiled, eager):
        assert abs(c - e) <= RTOL * abs(e), (compiled, eager)


@pytest.mark.slow
def test_compiled_blocks_match_eager(tmp_path, eager_losses, corpus: str) -> None:
    warm_forkserver()  # ranks forked with fsdp_engine imported (tests/forkserver_preload.py)
    _assert_close(_losses(tmp_path, corpus, "compiled", "--compile", "aot_eager"), eager_losses)


@pytest.mark.slow
def test_compiled_blocks_with_activation_checkpointing(tmp_path, eager_losses, corpus: str) -> None:
    """Threads backend: the ranks run in this process, so dynamo's counters show that the
    blocks were compiled and that nothing (the engine's hooks included) broke a graph."""
    import torch._dynamo

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    losses = _losses(
        tmp_path,
        corpus,
        "ac",
        "--backend",
        "threads",
        "--activation-checkpointing",
        "--compile",
        "aot_eager",
    )
    _assert_close(losses, eager_losses)  # checkpointing recomputes, it does not change a loss
    assert counters["stats"].get("unique_graphs", 0) >= 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_compile_flag_parses() -> None:
    from fsdp.train._cli import build_parser

    parse = build_parser().parse_args
    assert parse([]).compile is None
    assert parse(["--compile", "--steps", "2"]).compile == "inductor"  # bare: inductor
    assert parse(["--compile", "eager"]).compile == "eager"


def test_bad_compile_backend_is_named(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", "--model", "tiny", "--compile", "fast"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "argument --compile: invalid choice: 'fast' (choose from 'inductor', 'aot_eager', 'eager')"
    ) in err
    assert "Traceback" not in err


def test_missing_cxx_compiler_is_a_clean_error(monkeypatch, capsys) -> None:
    """A bare --compile means inductor; without a working C++ compiler it stops before any
    rank starts, naming the problem and the way out."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/no/such/c++",))
    with pytest.raises(SystemExit) as info:
        fsdp_main(["train", "--model", "tiny", "--steps", "1", "--compile"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--compile inductor: inductor cannot build C++ kernels here" in err
    assert "/no/such/c++" in err and "--compile aot_eager needs no compiler" in err
    assert "Traceback" not in err


def test_inductor_probe_passes_where_a_compiler_works() -> None:
    from torch._inductor.cpp_builder import get_cpp_compiler

    from fsdp.train._train import inductor_problem

    try:
        get_cpp_compiler()
    except Exception as exc:  # no compiler here: the probe must say so (checked above)
        pytest.skip(f"no C++ compiler for inductor: {exc}")
    assert inductor_problem() is None
