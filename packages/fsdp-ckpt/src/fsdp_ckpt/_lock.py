"""Exclusive saves: one save at a time per checkpoint path, across processes, jobs and hosts.

Note [save lock]
~~~~~~~~~~~~~~~~
Two writers on one path used to destroy each other: both chose the same staging directory,
and the second one's truncating writes landed in files the first had already committed. So
rank 0 of every save takes ``P/.lock`` before anything is written and keeps it until the
commit is on disk. The lock file is created exclusively (`Storage.create_exclusive`: on a
POSIX file system written aside and hard-linked into place, so it appears whole or not at
all) and names its holder: host, boot id, pid namespace, pid, the process's own start time,
when it was taken, a random token and a lease. A second save reads it and refuses with a
`CheckpointError` naming the holder, unless the holder is provably gone:

- on the same machine (same host name, boot id and pid namespace, so pids are comparable):
  its pid is not running, is a zombie, or is a newer process that reused the pid (its start
  time differs); or it is this very process and no save here holds that token any more;
- anywhere else: its lease ran out. The holder renews the lease (rewrites the file with a
  new time, renaming it over the old one) every quarter lease from a background thread, so a
  live holder is only taken over when it stalls for a whole lease (default 60 s; the
  ``FSDP_CKPT_LOCK_LEASE`` environment variable, in seconds, changes it).

Taking over a stale lock renames it aside first (only one contender's rename can succeed)
and deletes it only if the file moved is the one judged stale; otherwise a new holder won
the race and its lock is put back. A holder that lost its lock anyway (its lease ran out while
it was stalled) finds out before it commits (`SaveLock.check`) and does not commit.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import asdict, dataclass, replace

from ._errors import CheckpointError
from ._storage import Storage

__all__ = [
    "LOCK_FILE",
    "Holder",
    "Machine",
    "SaveLock",
    "lease_seconds",
    "stale_reason",
    "this_machine",
    "is_lock_leftover",
    "read_holder",
]

LOCK_FILE = ".lock"
LEASE_ENV = "FSDP_CKPT_LOCK_LEASE"
DEFAULT_LEASE_S = 60.0
_ACQUIRE_ATTEMPTS = 4  # each failed attempt means the lock changed hands meanwhile
_RECHECK_S = 0.2  # a takeover moves a live lock aside for a moment; look twice before giving up

_HELD: dict[str, SaveLock] = {}  # token -> lock, for every lock this process holds
_HELD_LOCK = threading.Lock()


@dataclass(frozen=True)
class Machine:
    """Where pids mean the same thing: one host, one boot, one pid namespace."""

    host: str
    boot: str
    pidns: str


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)
def this_machine() -> Machine:
    """This process's `Machine` (boot id and pid namespace are empty where Linux's /proc is
    missing: then only the host name is compared)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return Machine(socket.gethostname(), _read_text("/proc/sys/kernel/random/boot_id"), pidns)


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks since boot) of a Linux process; None if there is
    no such process."""
    text = _read_text(f"/proc/{pid}/stat")
    if not text:
        return None
    fields = text.rsplit(")", 1)[-1].split()  # the command name (in parentheses) may hold spaces
    return fields[0], fields[19]


def _running(pid: int, start: str) -> bool:
    if os.path.isdir("/proc/self"):
        stat = _proc_stat(pid)
        return stat is not None and stat[0] not in ("Z", "X") and (not start or stat[1] == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@dataclass(frozen=True)
class Holder:
    """Who holds a checkpoint path's lock (the contents of ``P/.lock``)."""

    machine: Machine
    pid: int
    proc_start: str  # the process's start time in ticks since boot (Linux); "" elsewhere
    token: str
    started: float  # wall-clock seconds when the lock was taken
    renewed: float  # ... and when it was last renewed
    lease: float  # seconds after ``renewed`` when another host may take it over

    def describe(self, now: float | None = None) -> str:
        """ "host H, pid N, saving since <UTC time>, lease renewed S s ago"."""
        age = (time.time() if now is None else now) - self.renewed
        return (
            f"host {self.machine.host}, pid {self.pid}, saving since {_when(self.started)}, "
            f"lease renewed {age:.0f} s ago"
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder in a lock file; None when the file is damaged or empty."""
        try:
            obj = json.loads(data)
            return cls(
                Machine(**obj["machine"]),
                int(obj["pid"]),
                str(obj["proc_start"]),
                str(obj["token"]),
                float(obj["started"]),
                float(obj["renewed"]),
                float(obj["lease"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def lease_seconds() -> float:
    """The lease a new lock gets: ``FSDP_CKPT_LOCK_LEASE`` seconds, else 60."""
    raw = os.environ.get(LEASE_ENV)
    if raw is None or raw == "":
        return DEFAULT_LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{LEASE_ENV} must be a number of seconds > 0, got {raw!r}")
    return value


def stale_reason(holder: Holder | None, now: float, here: Machine) -> str | None:
    """Why ``holder``'s lock may be taken over (see Note [save lock]); None while it holds."""
    if holder is None:
        return "the lock file is empty or damaged"
    with _HELD_LOCK:
        if holder.token in _HELD:
            return None
    if holder.machine == here:
        if holder.pid == os.getpid():
            return "it was left by this process, which no longer holds it"
        if not _running(holder.pid, holder.proc_start):
            return f"pid {holder.pid} is no longer running on {holder.machine.host}"
        return None
    age = now - holder.renewed
    if age > holder.lease:
        return f"its lease ran out: last renewed {age:.0f} s ago, lease {holder.lease:.0f} s"
    return None


def _read(storage: Storage, path: str) -> bytes | None:
    try:
        with storage.open_read(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _holder_now() -> Holder:
    now, pid = time.time(), os.getpid()
    stat = _proc_stat(pid)
    return Holder(
        this_machine(),
        pid,
        stat[1] if stat else "",
        secrets.token_hex(8),
        now,
        now,
        lease_seconds(),
    )


def is_lock_leftover(name: str, keep_token: str | None) -> bool:
    """Whether ``name`` in a checkpoint path is a temporary file of some lock (never the lock
    itself) that a crash left behind; names holding ``keep_token`` belong to the live lock."""
    return name.startswith(LOCK_FILE + ".") and (keep_token is None or keep_token not in name)


class SaveLock:
    """The lock of one checkpoint path, held by this process (rank 0 of a save)."""

    def __init__(self, storage: Storage, root: str, holder: Holder) -> None:
        self.storage = storage
        self.root = root
        self.path = storage.join(root, LOCK_FILE)
        self.holder = holder
        self._lost: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._renew_loop, daemon=True, name=f"fsdp-ckpt-lease:{root}"
        )

    @property
    def token(self) -> str:
        """The random token naming this holding of the lock."""
        return self.holder.token

    @classmethod
    def acquire(cls, storage: Storage, root: str) -> SaveLock:
        """Take the lock of ``root`` (which exists), or raise `CheckpointError` naming the
        live holder. A stale holder's lock is taken over (Note [save lock])."""
        me = _holder_now()
        path = storage.join(root, LOCK_FILE)
        for _ in range(_ACQUIRE_ATTEMPTS):
            try:
                storage.create_exclusive(path, me.to_bytes())
            except FileExistsError:
                _take_over_or_refuse(storage, root, path, me)
                continue
            return cls(storage, root, me)._started()
        raise CheckpointError(
            f"save to {root}: could not take the lock {path}: it changed "
            f"hands {_ACQUIRE_ATTEMPTS} times while this save tried"
        )

    def _started(self) -> SaveLock:
        with _HELD_LOCK:
            _HELD[self.token] = self
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise `CheckpointError` unless this process still holds the lock (before a
        commit: a holder whose lease ran out while it stalled must not commit)."""
        if self._lost is None:
            found = self._whose()
            if found is not None:
                time.sleep(_RECHECK_S)  # a contender's takeover may have it aside right now
                found = self._whose()
            if found is not None:
                self._lost = found
        if self._lost is not None:
            raise CheckpointError(
                f"save to {self.root}: this save lost the lock {self.path} "
                f"({self._lost}); it did not commit"
            )

    def _whose(self) -> str | None:
        """None when the lock file names this holder; else what it says instead."""
        data = _read(self.storage, self.path)
        if data is None:
            return "the lock file was deleted"
        holder = Holder.parse(data)
        if holder is None:
            return "the lock file is damaged"
        if holder.token != self.token:
            return f"it now names {holder.describe()}"
        return None

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.holder.lease / 4):
            try:
                self._renew()
            except Exception:  # noqa: S112 - a storage hiccup: the next renewal tries again
                continue

    def _renew(self) -> None:
        lost = self._whose()
        if lost is not None:
            self._lost = lost
            self._stop.set()
            return
        tmp = f"{self.path}.{self.token}.renew"
        renewed = replace(self.holder, renewed=time.time())
        with self.storage.open_write(tmp, durable=False) as f:
            f.write(renewed.to_bytes())
        self.storage.rename(tmp, self.path)

    def release(self) -> None:
        """Give the lock up (idempotent). A failure to delete the lock file is a warning: the
        next save takes the lock over (its holder is gone), so nothing is lost."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.holder.lease)
        with _HELD_LOCK:
            if _HELD.pop(self.token, None) is None:
                return
        try:
            if self._whose() is None:
                self.storage.remove(self.path)
        except Exception as exc:
            warnings.warn(
                f"could not delete the lock {self.path} ({exc}); the next save to "
                f"{self.root} takes it over",
                RuntimeWarning,
                stacklevel=2,
            )


def _take_over_or_refuse(storage: Storage, root: str, path: str, me: Holder) -> None:
    """The lock exists: refuse naming its live holder, or move a stale one out of the way."""
    seen = _read(storage, path)
    if seen is None:
        return  # released meanwhile: try again
    holder = Holder.parse(seen)
    reason = stale_reason(holder, time.time(), me.machine)
    if reason is None:
        assert holder is not None
        raise CheckpointError(
            f"save to {root} refused: another save holds the lock {path} ({holder.describe()}). "
            "One save at a time per checkpoint path: wait for it, or save elsewhere. The lock "
            f"is taken over once its holder is gone (pid not running on {holder.machine.host}, "
            f"or its {holder.lease:.0f} s lease not renewed)"
        )
    aside = f"{path}.{me.token}.stale"
    try:
        storage.rename(path, aside)
    except FileNotFoundError:
        return  # another contender moved it first
    moved = _read(storage, aside)
    if moved != seen and moved is not None:  # a new holder won the race: give its lock back
        _put_back(storage, path, moved)
    storage.remove(aside)


def _put_back(storage: Storage, path: str, data: bytes) -> None:
    try:
        storage.create_exclusive(path, data)
    except FileExistsError:
        pass  # a third contender got in: that holder finds out in SaveLock.check


def read_holder(storage: Storage, root: str) -> Holder | None:
    """The holder named by ``root``'s lock file; None when there is none (or it is damaged)."""
    data = _read(storage, storage.join(root, LOCK_FILE))
    return None if data is None else Holder.parse(data)
