"""A checkpoint path on disk, and the atomic commit of a new version into it.

Layout of a checkpoint path ``P``::

    P/CURRENT                  {"version": "v000007", "index": {"size": .., "crc32": ..}}
    P/v000007/index.json       the index (names files relative to this directory)
    P/v000007/shard-00000.safetensors, ..., common.safetensors
    P/.staging-v000008-<token>/  a save in progress (or a crashed one): never read by load
    P/.lock                    held by rank 0 of the save in progress (`_lock`)

Begin (rank 0, holding the lock): create ``P`` (fsyncing its parent on the first save), choose
the version (one above every version seen) and create its staging directory exclusively, under
a name with a random token, so no two saves ever share a file. Commit (rank 0, after every rank
voted that its files are written and fsynced): merge the ranks' partial indexes, check every
tensor is tiled and every file has its recorded size and CRC-32, write ``index.json``, fsync
the staging directory, rename it to ``v000008``, then write a ``.CURRENT.tmp-<token>`` and
rename it over ``CURRENT`` (POSIX ``rename(2)`` replaces a file atomically: readers see the
old pointer or the new one, never neither) and fsync ``P``. Until that last rename the old
pointer names the old version, whole; after it, the new one. Only then are versions beyond
``keep_last`` and leftovers of interrupted saves (staging directories, versions renamed but
never pointed to, temporary files) deleted: the leftovers before the save returns, the version
this commit superseded by a background thread (Note [who removes leftovers] in ``_cleanup.py``).
A save that fails before its commit point removes its own staging directory (`abandon`). A version
directory alone (``P/v000007``) is itself a loadable, relocatable checkpoint: its index names
files relative to itself.

Readers resolve ``CURRENT`` and then read the version it names; a save committing meanwhile
may delete that version (``keep_last=1``). So a reader that finds a file missing and
``CURRENT`` changed resolves again (`read_committed`, `still_current`) instead of calling a
healthy checkpoint corrupt.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ._cleanup import remove_later, remove_now, wait_for_cleanup
from ._errors import CheckpointCorruptError, CheckpointError, naming
from ._index import Index, merge_indexes
from ._lock import SaveLock, is_lock_leftover
from ._storage import LocalStorage, Storage
from ._tensor_file import FileDigest, read_verified, verify_file

__all__ = [
    "POINTER_FILE",
    "INDEX_FILE",
    "CheckpointDir",
    "OpenCheckpoint",
    "SaveStart",
    "open_checkpoint",
    "read_committed",
    "parse_index",
    "pointer_version",
    "still_current",
    "replaced_error",
    "claim",
    "manifest_name",
    "write_small",
    "read_small",
]

POINTER_FILE = "CURRENT"
INDEX_FILE = "index.json"
_POINTER_TMP = ".CURRENT.tmp"
_STAGING = ".staging-"
_VERSION = re.compile(r"^v(\d{6,})$")
_RESOLVE_ATTEMPTS = 3  # resolutions of CURRENT per read, when a commit replaces it meanwhile
_CRC_THREADS = 4  # files checksummed at once before a commit (zlib and reads release the GIL)


def manifest_name(rank: int) -> str:
    """The file in which a rank records what it wrote (its part of the index)."""
    return f"rank-{rank:05d}.json"


def write_small(storage: Storage, path: str, data: bytes, *, durable: bool = True) -> FileDigest:
    """Write a small file (durably unless told otherwise); its digest."""
    with naming(path), storage.open_write(path, durable=durable) as f:
        f.write(data)
    return FileDigest(len(data), f"{zlib.crc32(data):08x}")


def claim(storage: Storage, path: str) -> None:
    """Create ``path`` empty and exclusively before writing it: a save never writes into a file
    that another writer created (Note [save lock] in ``_lock.py``)."""
    try:
        storage.create_exclusive(path)
    except FileExistsError:
        raise CheckpointError(
            f"{path} already exists: another writer is using this save's "
            "staging directory (two processes with the same rank?)"
        ) from None


def read_small(storage: Storage, path: str) -> bytes:
    """A small file's bytes; CheckpointCorruptError when it is missing."""
    try:
        with storage.open_read(path) as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError("missing", path=path) from None


def _version_number(name: str) -> int | None:
    m = _VERSION.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class _Pointer:
    version: str
    index: FileDigest

    def to_bytes(self) -> bytes:
        return (
            json.dumps(
                {
                    "version": self.version,
                    "index": {"size": self.index.size, "crc32": self.index.crc32},
                }
            ).encode()
            + b"\n"
        )

    @classmethod
    def parse(cls, data: bytes, source: str) -> _Pointer:
        try:
            obj = json.loads(data)
            version, index = str(obj["version"]), obj["index"]
            digest = FileDigest(int(index["size"]), str(index["crc32"]))
        except (ValueError, KeyError, TypeError):
            raise CheckpointCorruptError("malformed pointer file", path=source) from None
        if _version_number(version) is None:
            raise CheckpointCorruptError(f"points at {version!r}, not a version", path=source)
        return cls(version, digest)


@dataclass(frozen=True)
class OpenCheckpoint:
    """A resolved checkpoint: the version directory and its checked index."""

    directory: str
    index: Index


def _index_bytes(storage: Storage, path: str, digest: FileDigest | None) -> bytes:
    data = read_small(storage, path)
    if digest is not None:
        crc = f"{zlib.crc32(data):08x}"
        if len(data) != digest.size or crc != digest.crc32:
            raise CheckpointCorruptError(
                f"{len(data)} bytes with crc32 {crc}; the pointer records {digest.size} bytes "
                f"with crc32 {digest.crc32} (the index was altered or damaged)",
                path=path,
            )
    return data


def parse_index(data: bytes, source: str) -> Index:
    """The index in ``data`` (read from ``source``), checked to be complete."""
    index = Index.from_json(data, source=source)
    index.check_complete(source=source)
    return index


def _pointer_at(storage: Storage, path: str) -> _Pointer | None:
    pointer_path = storage.join(path, POINTER_FILE)
    if isinstance(storage, LocalStorage):
        _refuse_special(pointer_path)
    try:
        with storage.open_read(pointer_path) as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return _Pointer.parse(data, pointer_path)


def _refuse_special(path: str) -> None:
    # Opening a FIFO named CURRENT would block the reader for good; a device never ends.
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        raise CheckpointCorruptError("not a regular file", path=path)


def read_committed(storage: Storage, path: str) -> tuple[str, bytes]:
    """The committed version directory at ``path`` (a checkpoint path or a version directory)
    and its index's bytes, checked against the pointer. Resolves again when a commit replaced
    the pointer and deleted the version while it was being read."""
    pointer = _pointer_at(storage, path)
    if pointer is None:
        if storage.exists(storage.join(path, INDEX_FILE)):
            return path, _index_bytes(storage, storage.join(path, INDEX_FILE), None)
        raise CheckpointError(
            f"no checkpoint at {path}: it holds neither {POINTER_FILE} nor {INDEX_FILE}"
        )
    for _ in range(_RESOLVE_ATTEMPTS):
        directory = storage.join(path, pointer.version)
        try:
            return directory, _index_bytes(
                storage, storage.join(directory, INDEX_FILE), pointer.index
            )
        except CheckpointCorruptError:
            newer = _pointer_at(storage, path)
            if newer is None or newer == pointer:
                raise  # nothing moved on: the damage is real
            pointer = newer
    raise replaced_error(path, _RESOLVE_ATTEMPTS)


def replaced_error(path: str, times: int) -> CheckpointError:
    """A read that saves kept overtaking: not corruption, and worth saying so."""
    return CheckpointError(
        f"{path}: the checkpoint was replaced {times} times while being read (each commit "
        "deletes versions beyond keep_last, the one being read included); nothing is damaged: "
        "read again, or save with keep_last >= 2 so a reader has a whole save's time"
    )


def pointer_version(storage: Storage, path: str) -> str | None:
    """The version ``path``'s pointer names; None when there is no readable pointer."""
    try:
        pointer = _pointer_at(storage, path)
    except CheckpointError:
        return None
    return None if pointer is None else pointer.version


def still_current(storage: Storage, path: str, directory: str) -> bool:
    """Whether ``path``'s pointer still names ``directory`` (True for a version directory, or
    when the pointer cannot be read: then nothing says a commit overtook the reader)."""
    try:
        pointer = _pointer_at(storage, path)
    except CheckpointError:
        return True
    return pointer is None or storage.join(path, pointer.version) == directory


def open_checkpoint(storage: Storage, path: str) -> OpenCheckpoint:
    """Find the committed version at ``path`` (a checkpoint path or a version directory)."""
    directory, data = read_committed(storage, path)
    return OpenCheckpoint(directory, parse_index(data, storage.join(directory, INDEX_FILE)))


@dataclass(frozen=True)
class SaveStart:
    """What rank 0 chose for a save, sent to every rank: the version, its staging directory,
    and the version ``CURRENT`` named when the save began (None before the first commit)."""

    version: str
    staging: str
    previous: str | None

    def to_bytes(self) -> bytes:
        return json.dumps([self.version, self.staging, self.previous]).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> SaveStart:
        version, staging, previous = json.loads(data)
        return cls(version, staging, previous)


def _make_root(storage: Storage, root: str) -> None:
    """Create ``root`` and its missing parents, making each new entry durable: a power loss
    right after the first commit must not lose the checkpoint directory itself."""
    created, path = [], root
    while path and not storage.exists(path):
        created.append(path)
        parent = os.path.dirname(path.rstrip("/")) or "."
        if parent == path:
            break
        path = parent
    if not created:
        return
    storage.makedirs(root)
    for path in reversed(created):  # outermost first: each entry lives in its parent
        storage.sync_dir(os.path.dirname(path.rstrip("/")) or ".")


@dataclass(frozen=True)
class CheckpointDir:
    """A checkpoint path being saved to."""

    storage: Storage
    root: str

    def current(self) -> str | None:
        """The committed version's name, or None before the first commit."""
        path = self.storage.join(self.root, POINTER_FILE)
        if not self.storage.exists(path):
            return None
        return _Pointer.parse(read_small(self.storage, path), path).version

    def next_version(self) -> str:
        """One above every version seen. Ranks agree: only a commit changes what is read."""
        current = self.current()
        numbers = [_version_number(n) for n in self.storage.listdir(self.root)]
        numbers.append(_version_number(current) if current else 0)
        return f"v{max(n for n in numbers if n is not None) + 1:06d}"

    def staging(self, version: str, token: str = "") -> str:
        """Where the ranks write ``version`` before it is committed (``token`` makes the name
        unique to one save)."""
        return self.storage.join(self.root, _STAGING + version + (f"-{token}" if token else ""))

    def make_root(self) -> None:
        """Create the checkpoint path (durably, on the first save)."""
        _make_root(self.storage, self.root)

    def begin(self, token: str) -> SaveStart:
        """Rank 0, holding the path's lock: choose the version, create its staging directory
        exclusively."""
        previous, version = self.current(), self.next_version()
        staging = self.staging(version, token)
        try:
            self.storage.make_dir(staging)
        except FileExistsError:
            raise CheckpointError(
                f"{staging} already exists: another save chose the same staging directory"
            ) from None
        return SaveStart(version, staging, previous)

    def commit(
        self,
        version: str,
        world_size: int,
        keep_last: int,
        *,
        staging: str | None = None,
        lock: SaveLock | None = None,
    ) -> str:
        """Rank 0: merge, verify, index, rename, point, clean up. Returns the version dir.
        ``lock``: checked before anything becomes visible (a lost lock commits nothing)."""
        wait_for_cleanup(self.root)
        staging = staging or self.staging(version)
        previous = self.current()
        index = self._merged(staging, world_size)
        self._drop_unreferenced(staging, index)
        self._verify_files(staging, index, version)
        index_path = self.storage.join(staging, INDEX_FILE)
        claim(self.storage, index_path)
        digest = write_small(self.storage, index_path, index.to_json().encode())
        self.storage.sync_dir(staging)
        target = self._publish(staging, version, lock)
        self._point(_Pointer(version, digest), lock)
        now, later = self._superseded(version, previous, keep_last, lock.token if lock else None)
        assert target not in now and target not in later, (target, now, later)
        remove_now(self.storage, now)
        remove_later(self.storage, self.root, later, self._current_dir)
        return target

    def _current_dir(self) -> str | None:
        current = self.current()
        return None if current is None else self.storage.join(self.root, current)

    def abandon(self, start: SaveStart, lock: SaveLock | None) -> None:
        """Rank 0, once its save will not commit: remove what it wrote, so a failed save
        leaves no partial version behind. Its staging directory is its own (a random token in
        its name); the version it may have renamed it to is removed only while this save still
        holds the lock and ``CURRENT`` does not name it. A failure to remove is a warning: the
        next save that commits removes it (Note [who removes leftovers] in ``_cleanup.py``)."""
        doomed = [start.staging]
        published = self.storage.join(self.root, start.version)
        try:
            if self.current() != start.version and self.storage.exists(published):
                if lock is not None:
                    lock.check()
                doomed.append(published)
        except Exception:  # noqa: BLE001 - CURRENT unreadable, the lock lost: leave the version
            pass
        remove_now(self.storage, doomed)  # Storage.remove: nothing happens when it is not there

    def _publish(self, staging: str, version: str, lock: SaveLock | None) -> str:
        target = self.storage.join(self.root, version)
        if self.storage.exists(target):  # a directory renamed onto an empty one would vanish
            raise CheckpointError(
                f"{target} already exists: another save committed this "
                "version (was the lock of this path deleted by hand?)"
            )
        if lock is not None:
            lock.check()
        self.storage.rename(staging, target)
        self.storage.sync_dir(self.root)
        return target

    def _verify_files(self, staging: str, index: Index, version: str) -> None:
        """Every file's size and CRC-32 as its rank recorded them: what is committed is what
        the ranks wrote, byte for byte (a second writer's bytes are caught here)."""
        paths = {name: self.storage.join(staging, name) for name in index.files}
        workers = max(1, min(_CRC_THREADS, len(paths)))
        with ThreadPoolExecutor(workers, thread_name_prefix="fsdp-ckpt-crc") as pool:
            jobs = [
                pool.submit(self._check_file, path, index.files[name])
                for name, path in sorted(paths.items())
            ]
        for job in jobs:
            try:
                job.result()
            except CheckpointCorruptError as exc:
                raise CheckpointCorruptError(
                    f"{exc.args[0].removeprefix(exc.path + ': ')}; changed after its rank wrote "
                    f"it, so {version} was not committed",
                    path=exc.path,
                ) from None

    def _check_file(self, path: str, digest: FileDigest) -> None:
        if isinstance(self.storage, LocalStorage):  # mapped: from the page cache, no copy
            read_verified(self.storage, path, digest)
        else:  # in blocks: a store's read_all may copy the whole file into memory
            verify_file(self.storage, path, digest)

    def _merged(self, staging: str, world_size: int) -> Index:
        parts = []
        for rank in range(world_size):
            path = self.storage.join(staging, manifest_name(rank))
            part = Index.from_json(read_small(self.storage, path), source=path)
            if part.world_size != world_size:
                raise CheckpointError(
                    f"{path}: written for world size {part.world_size}, "
                    f"this save has {world_size} ranks"
                )
            parts.append(part)
        index = merge_indexes(parts, source=staging)
        index.check_complete(source=staging)
        return index

    def _drop_unreferenced(self, staging: str, index: Index) -> None:
        # Manifests are merged into the index; anything else is left from a crashed attempt.
        for name in self.storage.listdir(staging):
            if name not in index.files:
                self.storage.remove(self.storage.join(staging, name))

    def _point(self, pointer: _Pointer, lock: SaveLock | None) -> None:
        tmp = self.storage.join(self.root, f"{_POINTER_TMP}-{secrets.token_hex(6)}")
        claim(self.storage, tmp)
        try:
            write_small(self.storage, tmp, pointer.to_bytes())
            if lock is not None:
                lock.check()  # the commit point: only the lock's holder may move the pointer
            self.storage.rename(tmp, self.storage.join(self.root, POINTER_FILE))
        except BaseException:
            remove_now(self.storage, [tmp])  # a full disk, a lost lock: leave no temporary
            raise
        self.storage.sync_dir(self.root)

    def _superseded(
        self, current: str, previous: str | None, keep_last: int, lock_token: str | None = None
    ) -> tuple[list[str], list[str]]:
        """What the commit of ``current`` supersedes, as (delete now, delete later). Later: the
        version this commit pushed beyond ``keep_last`` (the newest one beyond it). Now: the
        leftovers of interrupted saves: staging directories, temporary pointer and lock files,
        versions renamed but never pointed to (above ``previous``), and older versions beyond
        ``keep_last`` whose deletion an earlier commit did not finish. Under the lock every
        other save is gone (or was abandoned), so whatever staging directory is listed here is
        a leftover; the next save creates a new one, unlisted."""
        floor = (_version_number(previous) or 0) if previous else 0
        kept: list[str] = [current]
        now: list[str] = []
        later: list[str] = []
        names = sorted(self.storage.listdir(self.root), key=lambda n: -(_version_number(n) or 0))
        for name in names:
            number = _version_number(name)
            if name.startswith((_STAGING, _POINTER_TMP)) or is_lock_leftover(name, lock_token):
                now.append(name)
            elif number is None or name == current:
                continue
            elif number > floor:  # renamed but never pointed to
                now.append(name)
            elif len(kept) < keep_last:
                kept.append(name)
            elif not later:  # the one this commit pushed out, in the normal course
                later.append(name)
            else:  # should have gone with an earlier commit
                now.append(name)
        join = self.storage.join
        return [join(self.root, n) for n in now], [join(self.root, n) for n in later]
