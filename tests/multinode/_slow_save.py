"""``fsdp train`` whose ranks named in ``SLOW_SAVE_RANKS`` stop in the middle of a save.

torchrun runs this file instead of ``-m fsdp``. From the ``SLOW_SAVE_FROM``-th save on (1 is
the first), each of those ranks writes its shard file into the save's staging directory, then
creates ``SLOW_SAVE_MARKER`` and sleeps, before it votes: the save is in progress, and the test
kills the host there. Nothing in fsdp-ckpt is changed; its file writer is wrapped.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _install() -> None:
    import fsdp_ckpt._save as save_module

    ranks = {int(r) for r in os.environ.get("SLOW_SAVE_RANKS", "").split(",") if r}
    if int(os.environ.get("RANK", "-1")) not in ranks:
        return
    first = int(os.environ.get("SLOW_SAVE_FROM", "2"))
    marker = Path(os.environ["SLOW_SAVE_MARKER"])
    write = save_module.write_tensors
    saves: set[str] = set()

    def slow_write(storage, path, tensors, **kwargs):  # type: ignore[no-untyped-def]
        digest = write(storage, path, tensors, **kwargs)
        saves.add(os.path.dirname(str(path)))  # one staging directory per save
        if len(saves) >= first:
            marker.write_text(f"{os.environ['RANK']} {path}\n")
            time.sleep(600)  # killed here
        return digest

    save_module.write_tensors = slow_write


if __name__ == "__main__":
    _install()
    from fsdp._cli import main

    sys.exit(main(sys.argv[1:]))
