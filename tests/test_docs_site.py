"""The documentation site (mkdocs.yml, issue #29): the command reference is current, every
error class is on the troubleshooting page, and ``mkdocs build --strict`` passes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _gen_cli_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_cli_docs", ROOT / "scripts" / "gen_cli_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_generated_from_the_current_parsers() -> None:
    gen = _gen_cli_docs()
    if sys.version_info[:2] != gen.CLI_DOCS_PYTHON:
        pytest.skip(f"docs/cli.md holds Python {gen.CLI_DOCS_PYTHON}'s argparse layout")
    text = gen.render()
    assert gen.CLI_MD.read_text(encoding="utf-8") == text, (
        "docs/cli.md is stale (a flag or help text changed): run python scripts/gen_cli_docs.py"
    )
    for command in (
        "fsdp train",
        "fsdp plan",
        "fsdp ckpt verify",
        "fsdp export-hf",
        "fsdp compare",
        "fsdp comm-bench",
    ):
        assert f"## `{command}`" in text


def test_cli_reference_names_every_subcommand_of_fsdp() -> None:
    from fsdp._cli import _build_parser

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    sub = next(a for a in _build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"## `fsdp {name}`" in text, name


def test_troubleshooting_covers_every_exported_error_class() -> None:
    import fsdp_ckpt
    import fsdp_comm
    import fsdp_engine
    import fsdp_memory

    page = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    for module in (fsdp_comm, fsdp_memory, fsdp_engine, fsdp_ckpt):
        for name in module.__all__:
            obj = getattr(module, name)
            if isinstance(obj, type) and issubclass(obj, (Exception, Warning)):
                assert f"`{name}`" in page, f"{module.__name__}.{name} not in troubleshooting.md"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="the docs tools: pip install -r requirements-docs.txt")
    pytest.importorskip("material", reason="mkdocs-material: pip install -r requirements-docs.txt")
    pytest.importorskip(
        "mkdocstrings_handlers.python",
        reason="mkdocstrings[python]: pip install -r requirements-docs.txt",
    )
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--quiet",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "api" / "fsdp-engine" / "index.html").is_file()
