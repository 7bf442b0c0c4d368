"""Every code block of the README, the docs site and the package READMEs runs here (issue #29).

Python blocks run in a fresh interpreter from a scratch directory, on local ranks where the
block's directive says so (`_blocks.py` explains the directives, `_setups.py` holds what a
block assumes is already there); ``fsdp plan`` sessions are re-run and their output compared;
``fsdp train`` command lines and TOML files are checked by the parser itself
(``--print-config``); other shell lines run where they can, and the rest say in the page why
not (a launcher across hosts, an install, a benchmark that takes minutes). About 3 minutes on
2 cores, so this is its own CI leg: ``python -m pytest -m docs tests/docs`` (``.ci/run``).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ._blocks import ROOT, Block, blocks, code_blocks
from ._setups import SETUPS

pytestmark = pytest.mark.docs

_TIMEOUT = 170


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        FSDP_COMM_TIMEOUT="60",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        NO_COLOR="1",
        COLUMNS="200",
    )
    return env


def _run(cmd: list[str] | str, cwd: Path, what: str) -> str:
    proc = subprocess.run(
        cmd,
        cwd=cwd,
        env=_env(),
        shell=isinstance(cmd, str),
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )
    if proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-6000:]).strip()
        pytest.fail(f"{what} exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def _substituted(block: Block, text: str, tmp: Path) -> str:
    if "cpu" in block.options:
        text = text.replace('"cuda"', '"cpu"')
    for sub in block.options.get("sub", []):
        old, sep, new = sub.partition("->")
        if not sep:
            raise ValueError(f"{block.id}: sub={sub!r} must read OLD->NEW")
        assert old in text, f"{block.id}: sub={sub!r}: {old!r} is not in the block"
        text = text.replace(old, new.replace("{tmp}", str(tmp)))
    return text


def _setup(block: Block) -> tuple[str, str, str]:
    name = block.one("setup")
    if name is None:
        return "", "", ""
    if name not in SETUPS:
        raise ValueError(f"{block.id}: unknown setup {name!r} (known: {sorted(SETUPS)})")
    return SETUPS[name]


def python_script(block: Block, tmp: Path) -> str:
    """The program a Python block becomes: setup, the block (maybe inside every rank), checks."""
    module, before, after = _setup(block)
    body = _substituted(block, block.body, tmp)
    ranks = block.one("ranks")
    if ranks is None:
        if "main" in block.options:
            inner = textwrap.indent("\n".join([before, body, after]), "    ")
            return "\n".join([module, 'if __name__ == "__main__":', inner])
        return "\n".join([module, before, body, after])
    inner = textwrap.indent("\n".join([before, body, after]), "    ")
    return "\n".join(
        [
            module,
            "def _docs_block(backend):",
            inner,
            "",
            'if __name__ == "__main__":',
            "    from fsdp_comm import launch",
            f"    launch(_docs_block, {int(ranks)})",
        ]
    )


def _commands(body: str) -> list[str]:
    """Shell lines of a block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def _train_args(command: str, where: str) -> list[str]:
    words = shlex.split(command, comments=True)
    for i in range(len(words) - 1):
        if words[i : i + 2] == ["fsdp", "train"] or words[i : i + 3] == ["-m", "fsdp", "train"]:
            start = i + 2 if words[i] == "fsdp" else i + 3
            return words[start:]
    raise AssertionError(f"{where}: not an `fsdp train` command: {command}")


def _match_output(expected: list[str], got: list[str], where: str) -> None:
    """Every expected line in order, ``...`` (alone, maybe indented) standing for any lines."""
    pos = 0
    gap = False
    for want in expected:
        if want.strip() == "...":
            gap = True
            continue
        while pos < len(got) and got[pos].rstrip() != want.rstrip():
            if not gap:
                break
            pos += 1
        if pos >= len(got) or got[pos].rstrip() != want.rstrip():
            shown = "\n".join(got)
            pytest.fail(f"{where}: the page says\n  {want}\nthe command printed\n{shown}")
        pos += 1
        gap = False


def run_block(block: Block, tmp: Path) -> None:
    opts = block.options
    module, before, _after = _setup(block)
    if "file" in opts:
        wanted = (ROOT / block.one("file")).read_text().rstrip("\n")  # type: ignore[operator]
        assert block.body.rstrip("\n") == wanted, f"{block.id} differs from {block.one('file')}"
        return
    if "excerpt" in opts:
        source = [s.strip() for s in (ROOT / block.one("excerpt")).read_text().splitlines()]  # type: ignore[operator]
        pos = 0
        for line in (s.strip() for s in block.body.splitlines()):
            if not line or line == "...":  # an elision
                continue
            while pos < len(source) and source[pos] != line:
                pos += 1
            assert pos < len(source), f"{block.id}: {line!r} is not in {block.one('excerpt')}"
            pos += 1
        return
    if module and block.lang != "python":  # a Python setup that shell commands rely on
        (tmp / "_setup.py").write_text(module + "\n" + before)
        _run([sys.executable, "_setup.py"], tmp, f"{block.id} setup")
    if block.lang == "python":
        (tmp / "block.py").write_text(python_script(block, tmp))
        _run([sys.executable, "block.py"], tmp, block.id)
    elif "train-config" in opts:
        (tmp / "run.toml").write_text(block.body)
        _run(
            [sys.executable, "-m", "fsdp", "train", "--config", "run.toml", "--print-config"],
            tmp,
            block.id,
        )
    elif "train-options" in opts:
        for command in _commands(_substituted(block, block.body, tmp)):
            args = _train_args(command, block.id)
            _run(
                [sys.executable, "-m", "fsdp", "train", *args, "--print-config"],
                tmp,
                f"{block.id}: {command}",
            )
    elif "output" in opts:
        chunks = re.split(r"^\$ ", block.body, flags=re.M)[1:]
        assert chunks, f"{block.id}: an output block holds `$ command` lines"
        for chunk in chunks:
            command, *expected = chunk.rstrip("\n").split("\n")
            got = _run(command, tmp, f"{block.id}: {command}").rstrip("\n").split("\n")
            _match_output(expected, got, f"{block.id}: {command}")
    elif "commands" in opts:
        for command in _commands(_substituted(block, block.body, tmp)):
            _run(command, tmp, f"{block.id}: {command}")
    else:
        pytest.fail(
            f"{block.id}: a {block.lang} block needs a directive on the line above it "
            "(<!-- docs-test: commands|train-options|train-config|output|skip: why -->)"
        )


_SUBCOMMANDS = {"train", "plan", "ckpt", "export-hf", "compare", "comm-bench"}


def check_names(block: Block) -> None:
    """A block that cannot run here still names only things that exist: the modules of its
    ``python -m`` lines, the repository files it runs, the ``fsdp`` sub-commands."""
    for command in _commands(block.body):
        words = shlex.split(command, comments=True)
        for i, word in enumerate(words):
            if word == "-m" and i + 1 < len(words) and words[i - 1].startswith("python"):
                module = words[i + 1]
                assert importlib.util.find_spec(module) is not None, f"{block.id}: no {module}"
            if re.match(r"(scripts|examples|\.ci)/", word):
                assert (ROOT / word).exists(), f"{block.id}: no {word} in the repository"
            if word == "fsdp" and i + 1 < len(words) and not words[i + 1].startswith("-"):
                sub = words[i + 1]
                assert sub in _SUBCOMMANDS, f"{block.id}: fsdp has no sub-command {sub!r}"


_ALL = code_blocks()


def test_the_pages_have_code_blocks_and_every_directive_is_well_formed() -> None:
    assert len(_ALL) > 30, [b.id for b in _ALL]
    for block in blocks():
        if block.lang not in {"python", "bash", "console", "toml", "sh", "shell"}:
            assert not block.options and block.no_run is None, (
                f"{block.id}: a directive on a {block.lang or 'plain'} block (output, not code)"
            )


@pytest.mark.parametrize("block", _ALL, ids=[b.id for b in _ALL])
def test_code_block(block: Block, tmp_path: Path) -> None:
    if block.no_run is not None:
        assert block.lang != "python", f"{block.id}: Python blocks always run ({block.no_run})"
        check_names(block)
    else:
        run_block(block, tmp_path)
