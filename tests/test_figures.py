"""Figures as data (issue #29): every benchmark record in docs/records is valid, docs/figures.md
and the README's headline block are what scripts/gen_figures.py makes of them, and a
benchmark run with ``--record DIR`` writes a valid record."""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fsdp.bench import RECORD_KINDS, read_record, read_records, validate_record, write_record
from fsdp.bench._record import make_record, run_recorded

ROOT = Path(__file__).resolve().parent.parent
RECORDS = sorted((ROOT / "docs" / "records").glob("*.json"))
STALE = "run python scripts/gen_figures.py"


def _gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_figures", ROOT / "scripts" / "gen_figures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", RECORDS, ids=[p.name for p in RECORDS])
def test_every_record_in_the_repository_validates(path: Path) -> None:
    record = read_record(path)
    assert path.name.startswith(record["date"].replace("-", "").replace(":", "")[:8])
    if record["source"] != "measured":  # a transcribed figure names its page and command
        page = record["source"].removeprefix("transcribed from ").split()[0]
        assert (ROOT / page).is_file(), page


def test_the_records_cover_what_the_docs_quote() -> None:
    kinds = {read_record(p)["kind"] for p in RECORDS}
    assert {"engines", "gpu-speed", "conformance"} <= kinds


def test_figures_page_is_generated_from_the_records() -> None:
    gen = _gen()
    text = gen.render_figures(gen.load())
    assert gen.FIGURES_MD.read_text(encoding="utf-8") == text, f"docs/figures.md is stale: {STALE}"
    for path in RECORDS:  # every record has its row, linking its file
        assert f"(records/{path.name})" in text and f'id="{gen.anchor(path)}"' in text


def test_readme_headline_block_is_generated_from_the_records() -> None:
    gen = _gen()
    readme = gen.README.read_text(encoding="utf-8")
    if gen.BEGIN not in readme or gen.END not in readme:
        pytest.skip("README.md has no <!-- figures:begin --> ... <!-- figures:end --> block")
    entries = gen.load()
    assert gen.update_readme(readme, gen.render_readme_block(entries)) == readme, (
        f"README.md's figures block is stale: {STALE}"
    )
    rows = gen.headlines(entries)
    assert 1 <= len(rows) <= 6
    for *_, (path, _) in rows:
        assert f"docs/figures.md#{gen.anchor(path)}" in readme


def test_generator_leaves_a_readme_without_markers_alone() -> None:
    gen = _gen()
    assert gen.update_readme("# fsdp\n\nno block here\n", "| x |") is None
    text = f"a\n{gen.BEGIN}\nold\n{gen.END}\nb\n"
    assert gen.update_readme(text, "new\n") == f"a\n{gen.BEGIN}\nnew\n{gen.END}\nb\n"


def test_generator_knows_every_kind() -> None:
    gen = _gen()
    assert set(gen._TITLES) == set(RECORD_KINDS) == set(gen._FIGURES)


def _valid() -> dict[str, Any]:
    return make_record(
        "engines", {"model": "tiny"}, {"engines": {"ours": {"step_s": 1.0}}}, prog="t"
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.update(kind="speed"), "kind"),
        (lambda r: r.update(date="2026-11-27 15:00:00"), "date"),
        (lambda r: r.update(date="2026-11-27"), "date"),  # a measured record has its time
        (lambda r: r.update(schema=2), "schema"),
        (lambda r: r.update(source="from memory"), "source"),
        (lambda r: r.pop("command"), "record"),
        (lambda r: r.update(extra=1), "record"),
        (lambda r: r["machine"].update(gpu={"name": "H100"}), "machine.gpu"),
        (lambda r: r["versions"].pop("torch"), "versions"),
        (lambda r: r.update(git={"commit": "HEAD", "dirty": False}), "git"),
        (lambda r: r.update(figures={}), "figures"),
        (lambda r: r["figures"].update(bad=float("nan")), "figures.bad"),
    ],
)
def test_a_bad_record_is_refused_naming_the_field(change: Any, field: str) -> None:
    record = copy.deepcopy(_valid())
    change(record)
    with pytest.raises(ValueError, match=f"record field '{field}'"):
        validate_record(record)


def test_write_record_never_overwrites(tmp_path: Path) -> None:
    record = make_record("conformance", {"suite": "x"}, {"passed": 1, "total": 2}, prog="t")
    first, second = write_record(record, tmp_path), write_record(record, tmp_path)
    assert first != second and [p for p, _ in read_records(tmp_path)] == [second, first]


def test_param_dtype_bf16_refuses_ddp_naming_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp.bench import engines

    with pytest.raises(SystemExit) as exc:
        engines.main(["--param-dtype", "bf16", "--engines", "ours,ddp"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--param-dtype bf16" in err and "DDP" in err and "ours,ddp" in err
    with pytest.raises(SystemExit):  # the per-unit figure has --overhead-config instead
        engines.main(["--unit-overhead", "--param-dtype", "bf16"])
    assert "--overhead-config" in capsys.readouterr().err


def test_engines_record_of_a_small_real_run(tmp_path: Path) -> None:
    """``--record`` writes what the run measured and how it ran (two ranks, one step)."""
    from fsdp.bench import engines

    argv = [
        "--world-size",
        "2",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--engines",
        "ours,fsdp2",
        "--param-dtype",
        "bf16",
        "--record",
        str(tmp_path),
    ]
    assert engines.main(argv) == 0
    [(path, record)] = read_records(tmp_path)
    assert record["kind"] == "engines" and record["source"] == "measured"
    assert record["command"] == "python -m fsdp.bench.engines " + " ".join(argv)
    config = record["config"]
    assert (config["param_dtype"], config["reduce_dtype"], config["world_size"]) == (
        "bf16",
        "fp32",
        2,
    )
    ours, fsdp2 = (record["figures"]["engines"][e] for e in ("ours", "fsdp2"))
    assert ours["first_losses"] == pytest.approx(fsdp2["first_losses"], rel=1e-3)
    assert ours["step_ratio_to_fsdp2"] == pytest.approx(ours["step_s"] / fsdp2["step_s"])
    assert record["versions"]["torch"] and record["machine"]["cores"]
    assert "**ours**" in _gen().figures(record)


def test_gpu_overhead_record_without_running_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU command's record path, its per-engine runs replaced (no GPU here)."""
    from fsdp.bench import gpu

    times = {"ours": 70.0, "fsdp2": 1000.0}
    monkeypatch.setattr(gpu, "_overhead_in_fresh_process", lambda engine: times[engine])
    args = argparse.Namespace(repeats=2, out=None, record=str(tmp_path), argv=["overhead"])
    assert gpu.overhead(args) == 0
    [(_, record)] = read_records(tmp_path)
    assert (
        record["kind"] == "gpu-overhead"
        and record["command"] == "python -m fsdp.bench.gpu overhead"
    )
    assert "0.07x" in _gen().figures(record)


def test_lower_package_command_recorded_through_the_umbrella(tmp_path: Path) -> None:
    """``fsdp comm-bench --record DIR``'s way: the package's command writes its --out JSON,
    the umbrella makes the record (the package never imports the umbrella)."""
    calls: list[list[str]] = []

    def parser_of(prog: str) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=prog)
        p.add_argument("--size", type=int, default=1)
        p.add_argument("--out")
        return p

    def main(argv: list[str], prog: str) -> int:
        calls.append(argv)
        args = parser_of(prog).parse_args(argv)
        Path(args.out).write_text(json.dumps([{"collective": "all_gather", "time_us": 5.0}]))
        return 0

    def figures_of(doc: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        return {}, {"results": doc}

    argv = ["--size", "4", "--record", str(tmp_path)]
    assert run_recorded(main, parser_of, figures_of, argv, prog="fsdp x", kind="comm-bench") == 0
    assert calls[0][:2] == ["--size", "4"] and "--record" not in calls[0]
    [(_, record)] = read_records(tmp_path)
    assert record["config"] == {"size": 4} and record["command"] == "fsdp x " + " ".join(argv)
    assert record["figures"]["results"][0]["time_us"] == 5.0
    calls.clear()  # without --record: the command alone, as typed
    out = str(tmp_path.parent / f"{tmp_path.name}-out.json")
    assert (
        run_recorded(
            main,
            parser_of,
            figures_of,
            ["--out", out],
            prog="fsdp x",
            kind="comm-bench",
        )
        == 0
    )
    assert calls == [["--out", out]] and len(read_records(tmp_path)) == 1
