"""Deleting what a commit superseded: leftovers at once, the version it replaced in a thread.

Note [who removes leftovers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A commit supersedes the version that falls beyond ``keep_last``; a crash or a failure can
leave more: a staging directory (the save was killed before it committed, or failed and could
not delete it), a ``.CURRENT.tmp-*`` file (killed while moving the pointer), a version renamed
but never pointed to, and versions beyond ``keep_last`` that an earlier commit's deletion did
not finish (its process ended first). The commit that follows, holding the path's lock (so
every other save is gone or abandoned), lists them all once ``CURRENT`` names its version.

It used to delete all of them in a background thread after the save returned, and a process
that ended right after its last save lost the thread with whatever it had not yet deleted:
`fsdp_comm.launch` ends rank processes once they returned their result, a scheduler ends a job
with SIGTERM. The next successful save then tidied nothing that mattered for a while. Now the
leftovers are deleted before the save returns (`remove_now`), so what a crash left is gone once
the next save that commits returns; only the version this commit pushed beyond ``keep_last``,
whose deletion took a quarter of a 500 MB save (freeing its blocks and page cache), is deleted
in a thread (`remove_later`; `wait_for_cleanup` waits for it). If that thread is cut short, its
version is a leftover for the next commit, deleted before that one returns.

Neither ever deletes the version ``CURRENT`` names (the thread reads ``CURRENT`` again before
each deletion: it runs after the lock was released).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence

from ._args import check_path
from ._storage import Storage

__all__ = ["wait_for_cleanup", "remove_now", "remove_later"]

# One thread per checkpoint path at a time; the next commit to the path waits for it first.
_CLEANERS: dict[str, threading.Thread] = {}
_CLEANERS_LOCK = threading.Lock()


def wait_for_cleanup(path: str | os.PathLike[str] | None = None) -> None:
    """Wait until superseded versions at ``path`` (every path: None) are deleted.

    `save` deletes what interrupted saves left behind before it returns; the version it
    pushes beyond ``keep_last`` is deleted by a background thread on rank 0. Nothing reads
    that version, so waiting is only needed to see the directory tidy: in tests, for
    disk-space accounting, or before a process that just saved is ended from outside (a
    launcher that kills ranks once they returned, a job's last step): call it on rank 0
    after the last save.
    """
    root_given = None if path is None else check_path(path)
    with _CLEANERS_LOCK:
        threads = [t for root, t in _CLEANERS.items() if root_given in (None, root)]
    for thread in threads:
        thread.join()
    with _CLEANERS_LOCK:
        for root in [r for r, t in _CLEANERS.items() if not t.is_alive()]:
            del _CLEANERS[root]


def _remove(storage: Storage, path: str) -> None:
    try:
        storage.remove(path)
    except OSError as exc:  # the next commit lists it again
        warnings.warn(
            f"could not delete {path} ({exc}); the next save to this checkpoint "
            "that commits deletes it",
            RuntimeWarning,
            stacklevel=3,
        )


def remove_now(storage: Storage, paths: Sequence[str]) -> None:
    """Delete ``paths`` before returning; a failure is a warning (the next commit retries)."""
    for path in paths:
        _remove(storage, path)


def remove_later(
    storage: Storage, root: str, paths: Sequence[str], current: Callable[[], str | None]
) -> None:
    """Delete ``paths`` in a background thread (one per ``root``), skipping any path that
    ``current()`` (the version directory ``CURRENT`` names then) returns; when ``CURRENT``
    cannot be read, nothing more is deleted (the next commit lists it all again)."""
    wait_for_cleanup(root)
    if not paths:
        return

    def run() -> None:
        for path in paths:
            try:
                keep = current()
            except Exception:  # noqa: BLE001 - unreadable: the next commit deletes the rest
                return
            if path != keep:
                _remove(storage, path)

    # Not a daemon: an interpreter exiting normally right after a save finishes the deletion.
    thread = threading.Thread(target=run, name=f"fsdp-ckpt-cleanup:{root}")
    with _CLEANERS_LOCK:
        _CLEANERS[root] = thread
    thread.start()
