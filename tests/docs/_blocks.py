"""The fenced code blocks of the README and the docs, and what each one's directive asks.

A block is run as written unless the HTML comment on the line above it says otherwise
(invisible on GitHub and on the site)::

    <!-- docs-test: setup=tp ranks=4 cpu -->
    ```python

Keys:

- ``setup=NAME``: code of `_setups.SETUPS` put around the block.
- ``ranks=N``: the block runs inside a function on N local ranks, ``backend`` in scope.
- ``main``: the block runs under ``if __name__ == "__main__"`` (after a setup that starts
  ranks, whose processes import the program again).
- ``cpu``: "cuda" read as "cpu". ``sub=A->B``: text A read as B (an S3 URL as a local one).
- ``file=PATH``: the block is that file, word for word (a test runs the file).
- ``excerpt=PATH``: its lines appear in that file in order (``...`` lines elide).
- ``output``: a console block; its ``$`` commands are run and their output must match, a
  ``...`` line standing for any lines.
- ``train-options``: every command is an ``fsdp train`` line, checked by
  ``--print-config``. ``train-config``: a TOML file checked by ``fsdp train --config``.
- ``commands``: each line of a shell block runs from a scratch directory after ``setup``.
- ``no-run: REASON``: a shell block that cannot run here (a launcher across hosts, an
  install, a benchmark of minutes); the reason is required, and what it names is still
  checked to exist (``python -m`` modules, repository files, ``fsdp`` sub-commands).

Blocks without a language, ``text`` or ``json`` are output, not code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_LANGS = {"python", "bash", "console", "toml", "sh", "shell"}
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
_KEYS = {
    "setup",
    "ranks",
    "cpu",
    "sub",
    "file",
    "excerpt",
    "output",
    "train-options",
    "train-config",
    "commands",
    "main",
}


@dataclass
class Block:
    path: str
    line: int
    lang: str
    body: str
    options: dict[str, list[str]] = field(default_factory=dict)
    no_run: str | None = None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def one(self, key: str) -> str | None:
        values = self.options.get(key)
        return values[-1] if values else None


def doc_files() -> list[Path]:
    """The README, every page of the site and every package README (the site includes them)."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += sorted((ROOT / "packages").glob("*/README.md"))
    # docs/cli.md is generated from the parsers and checked by tests/test_docs_site.py.
    return [f for f in files if f != ROOT / "docs" / "cli.md"]


def _parse_directive(text: str, where: str) -> tuple[dict[str, list[str]], str | None]:
    if text.startswith("no-run:"):
        reason = text[len("no-run:") :].strip()
        if not reason:
            raise ValueError(f"{where}: 'docs-test: no-run:' needs a reason")
        return {}, reason
    options: dict[str, list[str]] = {}
    for token in text.split():
        key, _, value = token.partition("=")
        if key not in _KEYS:
            raise ValueError(f"{where}: unknown docs-test key {key!r} (known: {sorted(_KEYS)})")
        options.setdefault(key, []).append(value)
    return options, None


def blocks() -> list[Block]:
    found: list[Block] = []
    for path in doc_files():
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            d = _DIRECTIVE.search(before)
            options, no_run = _parse_directive(d.group(1), f"{rel}:{line}") if d else ({}, None)
            found.append(Block(rel, line, m.group(1), m.group(2), options, no_run))
    return found


def code_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in CODE_LANGS]
