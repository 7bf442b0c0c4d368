"""The framework examples the docs show (docs/frameworks-examples.md, moved there from the
README) are the files the tests run, word for word."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "docs" / "frameworks-examples.md").read_text()


def test_the_lightning_example_in_the_readme_is_the_tested_file() -> None:
    example = (ROOT / "examples" / "lightning_fsdp.py").read_text().rstrip("\n")
    assert f"```python\n{example}\n```" in README


def test_every_example_the_readme_names_exists_and_a_test_runs_it() -> None:
    named = set(re.findall(r"examples/([\w.]+\.py)", README))
    assert named, "the README names no example"
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for name in sorted(named):
        assert (ROOT / "examples" / name).is_file(), name
        assert name in tests, f"no test runs examples/{name}"
