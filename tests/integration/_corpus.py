"""A small training text for the `fsdp train` tests: the standard library's top-level modules.

`fsdp train`'s default corpus (``fsdp.train._data.default_corpus_root``) is the whole standard
library, which every rank of every run reads: 32 MiB of ~1900 files, after a walk of the tree
(it no longer enters ``site-packages``, 2.6 GB here, which made it 5-10 s per rank). The tests
pass ``--data`` a file of the same kind of text (Python source, the first ``max_bytes`` of
the top-level modules in sorted order) instead; ``test_train.py::test_loss_falls[1]`` still
trains on the default corpus.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path


def write_corpus(path: Path, max_bytes: int = 1 << 20) -> str:
    """Write the text to ``path`` (a file ``--data`` takes) and return the path as a string."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for f in sorted(root.glob("*.py")):
        blob = f.read_bytes()
        chunks.append(blob)
        total += len(blob)
        if total >= max_bytes:
            break
    path.write_bytes(b"\n".join(chunks)[:max_bytes])
    return str(path)
