"""Whether peer processes of this host are still alive, for waits that no socket watches.

Note [a local peer's death]
    Ranks that exchange data through shared memory (Note [shared-memory collectives without
    gloo] in ``_shm_collectives.py``) wait for each other by reading flags, not sockets, so a
    peer that died was only noticed when ``FSDP_COMM_TIMEOUT`` ran out (30 s and more), although
    the death of a process on this host is knowable at once (issue #30). So each rank writes
    its pid, and the inode of its pid namespace, next to the flags; a rank whose wait is not
    over at once looks, every `CHECK_INTERVAL_S` while it waits, whether the ranks it waits for
    still run, and raises `CommError` naming the dead rank, its pid and, when the kernel still
    knows it, how it ended.

    How: a pidfd (``os.pidfd_open``, Linux 5.3+), opened at the first look and kept, becomes
    readable when its process ends, zombies included, and stays bound to that process if the
    pid is reused. Without pidfds, ``os.kill(pid, 0)`` failing with ``ESRCH``, or the process
    being a zombie in ``/proc/<pid>/stat``, says the same. How it ended is the zombie's exit
    code in ``/proc/<pid>/stat`` while its parent has not reaped it (only the parent can
    ``waitpid``). A peer in another pid namespace (another container sharing /dev/shm) has a
    pid that means nothing here: it is not looked at, and its death is still found by the
    timeout.
"""

from __future__ import annotations

import os
import select
import signal
import time
import weakref
from typing import Any

__all__ = ["CHECK_INTERVAL_S", "PeerWatch", "pid_namespace"]

#: Seconds between looks at the peers' processes while a wait lasts.
CHECK_INTERVAL_S = 0.1


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 when /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class PeerWatch:
    """Looks at the processes of a group's ranks whose pids sit in ``ids`` (a ``[2, world]``
    int64 array in shared memory: pids, then pid-namespace inodes; 0 while unknown)."""

    def __init__(self, ids: Any, rank: int) -> None:
        self._ids = ids
        self._rank = rank
        self._namespace = pid_namespace()
        self._fds: dict[int, int] = {}  # rank -> pidfd
        self._next = 0.0
        # Closes the pidfds when the watch is dropped (the backend holds it for its life).
        weakref.finalize(self, _close_all, self._fds)

    def publish(self) -> None:
        """Write this process's pid and namespace into its column."""
        self._ids[1, self._rank] = self._namespace
        self._ids[0, self._rank] = os.getpid()

    def due(self) -> bool:
        """True at most once per `CHECK_INTERVAL_S`: time to look again."""
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + CHECK_INTERVAL_S
        return True

    def first_dead(self, ranks: list[int]) -> tuple[int, int, str] | None:
        """The first of ``ranks`` whose process has ended: (rank, pid, how it ended)."""
        for r in ranks:
            if r == self._rank:
                continue
            pid, namespace = int(self._ids[0, r]), int(self._ids[1, r])
            if pid <= 0 or namespace != self._namespace or self._namespace == 0:
                continue  # not published yet, or a pid of another namespace
            if not self._alive(r, pid):
                return r, pid, _how_it_ended(pid)
        return None

    def _alive(self, rank: int, pid: int) -> bool:
        fd = self._fds.get(rank)
        if fd is None and hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return False
            except OSError:  # no pidfds here (old kernel, seccomp): look by pid below
                fd = -1
            self._fds[rank] = fd
        if fd is not None and fd >= 0:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)
        return _alive_by_pid(pid)


def _alive_by_pid(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, under another user
    return _stat_fields(pid)[:1] not in (["Z"], ["X"])


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text[text.rfind(")") + 2 :].split()


def _how_it_ended(pid: int) -> str:
    fields = _stat_fields(pid)
    # exit_code is field 52 of stat (Linux 3.5+), the 50th after the name: waitpid's format.
    if len(fields) >= 50 and fields[0] in ("Z", "X") and fields[49].lstrip("-").isdigit():
        status = int(fields[49])
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                name = signal.Signals(sig).name
            except ValueError:
                name = f"signal {sig}"
            return f"was killed by {name}"
        return f"exited with status {os.WEXITSTATUS(status)}"
    return "exited"


def _close_all(fds: dict[int, int]) -> None:
    for fd in fds.values():
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    fds.clear()
