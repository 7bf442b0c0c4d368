"""A checkpoint path on disk, and the atomic commit of a new version into it.

Layout of a checkpoint path ``P``::

    P/CURRENT                  {"version": "v000007", "index": {"size": .., "crc32": ..}}
    P/v000007/index.json       the index (names files relative to this directory)
    P/v000007/shard-00000.safetensors, ..., common.safetensors
    P/.staging-v000008/        a save in progress (or a crashed one): never read by load

Commit (rank 0, after every rank voted that its files are written and fsynced): merge the ranks'
partial indexes, check every tensor is tiled and every file has its recorded size, write
``index.json``, fsync the staging directory, rename it to ``v000008``, then write
``CURRENT.tmp`` and rename it over ``CURRENT`` (POSIX ``rename(2)`` replaces a file atomically:
readers see the old pointer or the new one, never neither) and fsync ``P``. Until that last
rename the old pointer names the old version, whole; after it, the new one. Only then are
versions beyond ``keep_last`` and leftovers of crashed saves (staging directories, versions
renamed but never pointed to) deleted, by a background thread (`wait_for_cleanup`). A
version directory alone (``P/v000007``) is itself a loadable, relocatable checkpoint: its
index names files relative to itself.
"""

from __future__ import annotations

import json
import os
import re
import threading
import zlib
from dataclasses import dataclass

from ._errors import CheckpointCorruptError, CheckpointError
from ._index import Index, merge_indexes
from ._storage import Storage
from ._tensor_file import FileDigest

__all__ = ["POINTER_FILE", "INDEX_FILE", "CheckpointDir", "OpenCheckpoint", "open_checkpoint",
           "manifest_name", "write_small", "read_small", "wait_for_cleanup"]

POINTER_FILE = "CURRENT"
INDEX_FILE = "index.json"
_POINTER_TMP = ".CURRENT.tmp"
_STAGING = ".staging-"
_VERSION = re.compile(r"^v(\d{6,})$")


def manifest_name(rank: int) -> str:
    """The file in which a rank records what it wrote (its part of the index)."""
    return f"rank-{rank:05d}.json"


def write_small(storage: Storage, path: str, data: bytes, *, durable: bool = True) -> FileDigest:
    """Write a small file (durably unless told otherwise); its digest."""
    with storage.open_write(path, durable=durable) as f:
        f.write(data)
    return FileDigest(len(data), f"{zlib.crc32(data):08x}")


def read_small(storage: Storage, path: str) -> bytes:
    """A small file's bytes; CheckpointCorruptError when it is missing."""
    try:
        with storage.open_read(path) as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointCorruptError("missing", path=path) from None


# Deleting a superseded version (freeing its blocks and page cache) took a quarter of a
# 500 MB save here; it needs no other rank, so rank 0 does it in a thread after the commit.
# One thread per checkpoint path at a time; the next commit to the path waits for it first.
_CLEANERS: dict[str, threading.Thread] = {}
_CLEANERS_LOCK = threading.Lock()


def wait_for_cleanup(path: str | os.PathLike[str] | None = None) -> None:
    """Wait until superseded versions at ``path`` (every path: None) are deleted.

    `save` deletes versions beyond ``keep_last`` and leftovers of crashed saves in a
    background thread on rank 0 once the new version is committed; nothing reads them, so
    waiting is only needed to see the directory tidy (tests, disk-space accounting).
    """
    with _CLEANERS_LOCK:
        threads = [t for root, t in _CLEANERS.items()
                   if path is None or root == os.fspath(path)]
    for thread in threads:
        thread.join()
    with _CLEANERS_LOCK:
        for root in [r for r, t in _CLEANERS.items() if not t.is_alive()]:
            del _CLEANERS[root]


def _clean_later(storage: Storage, root: str, doomed: list[str]) -> None:
    wait_for_cleanup(root)

    def run() -> None:
        for path in doomed:
            storage.remove(path)

    # Not a daemon: an interpreter exiting right after a save finishes the deletion.
    thread = threading.Thread(target=run, name=f"fsdp-ckpt-cleanup:{root}")
    with _CLEANERS_LOCK:
        _CLEANERS[root] = thread
    thread.start()


def _version_number(name: str) -> int | None:
    m = _VERSION.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class _Pointer:
    version: str
    index: FileDigest

    def to_bytes(self) -> bytes:
        return json.dumps({"version": self.version, "index": {
            "size": self.index.size, "crc32": self.index.crc32}}).encode() + b"\n"

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


def _read_index(storage: Storage, path: str, digest: FileDigest | None) -> Index:
    data = read_small(storage, path)
    if digest is not None:
        crc = f"{zlib.crc32(data):08x}"
        if len(data) != digest.size or crc != digest.crc32:
            raise CheckpointCorruptError(
                f"{len(data)} bytes with crc32 {crc}; the pointer records {digest.size} bytes "
                f"with crc32 {digest.crc32} (the index was altered or damaged)", path=path)
    index = Index.from_json(data, source=path)
    index.check_complete(source=path)
    return index


def open_checkpoint(storage: Storage, path: str) -> OpenCheckpoint:
    """Find the committed version at ``path`` (a checkpoint path or a version directory)."""
    pointer_path = storage.join(path, POINTER_FILE)
    if storage.exists(pointer_path):
        pointer = _Pointer.parse(read_small(storage, pointer_path), pointer_path)
        directory = storage.join(path, pointer.version)
        return OpenCheckpoint(directory, _read_index(
            storage, storage.join(directory, INDEX_FILE), pointer.index))
    if storage.exists(storage.join(path, INDEX_FILE)):
        return OpenCheckpoint(path, _read_index(storage, storage.join(path, INDEX_FILE), None))
    raise CheckpointError(f"no checkpoint at {path}: it holds neither {POINTER_FILE} nor "
                          f"{INDEX_FILE}")


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

    def staging(self, version: str) -> str:
        """Where the ranks write ``version`` before it is committed."""
        return self.storage.join(self.root, _STAGING + version)

    def commit(self, version: str, world_size: int, keep_last: int) -> str:
        """Rank 0: merge, check, index, rename, point, clean up. Returns the version dir."""
        wait_for_cleanup(self.root)
        staging, previous = self.staging(version), self.current()
        index = self._merged(staging, world_size)
        self._drop_unreferenced(staging, index)
        digest = write_small(self.storage, self.storage.join(staging, INDEX_FILE),
                             index.to_json().encode())
        self.storage.sync_dir(staging)
        target = self.storage.join(self.root, version)
        self.storage.rename(staging, target)
        self.storage.sync_dir(self.root)
        self._point(_Pointer(version, digest))
        _clean_later(self.storage, self.root, self._doomed(version, previous, keep_last))
        return target

    def _merged(self, staging: str, world_size: int) -> Index:
        parts = []
        for rank in range(world_size):
            path = self.storage.join(staging, manifest_name(rank))
            part = Index.from_json(read_small(self.storage, path), source=path)
            if part.world_size != world_size:
                raise CheckpointError(f"{path}: written for world size {part.world_size}, "
                                      f"this save has {world_size} ranks")
            parts.append(part)
        index = merge_indexes(parts, source=staging)
        index.check_complete(source=staging)
        for name, digest in index.files.items():
            size = self.storage.size(self.storage.join(staging, name))
            if size != digest.size:
                raise CheckpointCorruptError(f"{size} bytes, its rank recorded {digest.size}",
                                             path=self.storage.join(staging, name))
        return index

    def _drop_unreferenced(self, staging: str, index: Index) -> None:
        # Manifests are merged into the index; anything else is left from a crashed attempt.
        for name in self.storage.listdir(staging):
            if name not in index.files:
                self.storage.remove(self.storage.join(staging, name))

    def _point(self, pointer: _Pointer) -> None:
        tmp = self.storage.join(self.root, _POINTER_TMP)
        write_small(self.storage, tmp, pointer.to_bytes())
        self.storage.rename(tmp, self.storage.join(self.root, POINTER_FILE))
        self.storage.sync_dir(self.root)

    def _doomed(self, current: str, previous: str | None, keep_last: int) -> list[str]:
        """What the commit of ``current`` supersedes: versions beyond ``keep_last``, versions
        renamed but never pointed to, staging directories of crashed saves."""
        floor = (_version_number(previous) or 0) if previous else 0
        # The next save writes into this name, maybe while the cleaner still runs: spare it.
        upcoming = _STAGING + f"v{(_version_number(current) or 0) + 1:06d}"
        kept, doomed = [current], []
        names = sorted(self.storage.listdir(self.root), key=lambda n: -(_version_number(n) or 0))
        for name in names:
            number = _version_number(name)
            if (name.startswith(_STAGING) and name != upcoming) or name == _POINTER_TMP:
                doomed.append(name)
            elif number is not None and name != current:
                if number > floor or len(kept) >= keep_last:  # never committed, or too old
                    doomed.append(name)
                else:
                    kept.append(name)
        return [self.storage.join(self.root, name) for name in doomed]
