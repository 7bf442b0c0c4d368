"""Training text every machine has: the source files of Python's standard library, as bytes.

`ByteCorpus` reads a directory tree or a file (``--data PATH``), or by default the standard
library, into one uint8 tensor; `ByteCorpus.batch` cuts a rank's share of a global batch of
random windows chosen by a generator seeded with (seed, step), so a resumed run sees exactly
the batches an uninterrupted one would.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteCorpus", "default_corpus_root"]

_SUFFIXES = (".py", ".txt", ".md", ".rst")


def default_corpus_root() -> Path:
    """The standard library's source directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(
        p
        for p in _walk(root)
        if p.suffix in _SUFFIXES and p.is_file() and "site-packages" not in p.parts
    )


def _walk(root: Path) -> list[Path]:
    """Every file under ``root``, without entering ``site-packages`` directories: their files
    are left out anyway, and walking them (gigabytes of installed packages) cost seconds per
    rank. Like ``rglob``, symlinked directories are not entered."""
    out = []
    for parent, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        out += [Path(parent, n) for n in names]
    return out


@dataclass(frozen=True)
class ByteCorpus:
    """Bytes of a text corpus; the vocabulary is the 256 byte values."""

    data: torch.Tensor
    source: str

    @classmethod
    def load(cls, path: str | Path | None = None, *, max_bytes: int = 32 << 20) -> ByteCorpus:
        root = default_corpus_root() if path is None else Path(path)
        if not root.exists():
            raise ValueError(f"--data: no such file or directory: {root}")
        chunks, total = [], 0
        for f in _files(root):
            blob = f.read_bytes()
            chunks.append(blob)
            total += len(blob)
            if total >= max_bytes:
                break
        raw = b"\n".join(chunks)[:max_bytes]
        if len(raw) < 1024:
            raise ValueError(
                f"--data: {root} holds only {len(raw)} bytes of text; need at least 1024"
            )
        return cls(torch.frombuffer(bytearray(raw), dtype=torch.uint8), str(root))

    def batch(
        self, *, step: int, seed: int, global_batch: int, seq_len: int, rank: int, world_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and targets (int64, ``global_batch // world_size`` rows)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, self.data.numel() - seq_len - 1, (global_batch,), generator=g)
        per = global_batch // world_size
        mine = starts[rank * per : (rank + 1) * per]
        windows = torch.stack([self.data[s : s + seq_len + 1] for s in mine.tolist()]).long()
        return windows[:, :-1], windows[:, 1:]
