"""Where checkpoint files live: a small `Storage` interface and the local file system.

The save protocol needs only what an object store also offers: write a whole file durably,
read a file or a byte range of it, list, stat, rename and remove, plus (on file systems) making
directory entries durable. Commit correctness rests on one operation, `Storage.rename` of a
small file over an existing one being atomic (POSIX ``rename(2)``; a single PUT on an object
store), so an fsspec-backed store fits in a few lines.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import posixpath
import secrets
import shutil
from abc import ABC, abstractmethod
from typing import Any, Protocol, TypeVar

import torch

__all__ = ["Storage", "LocalStorage", "ReadableFile", "WritableFile", "storage_for"]

# errno values of file systems without hard links (then `create_exclusive` uses O_EXCL).
_NO_LINK = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK}


_W = TypeVar("_W", bound="WritableFile")
_R = TypeVar("_R", bound="ReadableFile")


class WritableFile(Protocol):
    """What `Storage.open_write` returns: a binary file, usable in ``with``."""

    def write(self, data: Any, /) -> int | None: ...
    def close(self) -> None: ...
    def __enter__(self: _W) -> _W: ...
    def __exit__(self, *exc: Any) -> Any: ...


class ReadableFile(Protocol):
    """What `Storage.open_read` returns: a binary file, usable in ``with``."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readinto(self, buffer: Any, /) -> int | None: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...
    def __enter__(self: _R) -> _R: ...
    def __exit__(self, *exc: Any) -> Any: ...


class Storage(ABC):
    """A place to keep checkpoint files. Paths are strings joined with `join`.

    Implementations must make `open_write` files durable when closed and `rename` atomic for a
    file replacing a file (readers see the old or the new file, never neither).
    """

    @abstractmethod
    def open_write(self, path: str, *, durable: bool = True) -> WritableFile:
        """A new (or truncated) file. ``durable``: its bytes are on stable storage once
        ``close()`` returns (fsync); otherwise only visible to readers after ``close()``."""

    @abstractmethod
    def open_read(self, path: str) -> ReadableFile:
        """An existing file for reading (FileNotFoundError when there is none)."""

    @abstractmethod
    def size(self, path: str) -> int:
        """Bytes in the file (FileNotFoundError when there is none)."""

    @abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a file or directory is there."""

    @abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Names in a directory; [] when it does not exist."""

    @abstractmethod
    def makedirs(self, path: str) -> None:
        """Create a directory and its parents (no error when it exists)."""

    @abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Move ``src`` to ``dst`` atomically; a file ``dst`` is replaced."""

    @abstractmethod
    def remove(self, path: str) -> None:
        """Delete a file or a directory tree; nothing happens when it is not there."""

    def read_all(self, path: str, size: int) -> torch.Tensor:
        """The first ``size`` bytes of a file as a uint8 tensor (loads read whole files to
        checksum them). The default reads through `open_read`; local files are mapped."""
        data = torch.empty(size, dtype=torch.uint8)
        view = data.numpy().data if size else memoryview(bytearray())
        got = 0
        with self.open_read(path) as f:
            while got < size:
                n = f.readinto(view[got:])
                if not n:
                    raise EOFError(f"{path}: {got} of {size} bytes")
                got += n
        return data

    def sync_dir(self, path: str) -> None:  # noqa: B027 - optional, not abstract
        """Make the entries of a directory (creations, renames) durable. No-op by default
        (object stores have no directory entries to flush)."""

    def create_exclusive(self, path: str, data: bytes = b"") -> None:
        """Create the file ``path`` holding ``data``; FileExistsError when anything is there.

        Saves claim every name they write with it, and take a path's lock with it, so two
        writers can never share a file. The default checks, then writes: not atomic. Override
        it where the store can do better (an S3 PUT with ``If-None-Match: *``, a GCS upload
        with ``if_generation_match=0``); `LocalStorage` is atomic.
        """
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "already exists", path)
        with self.open_write(path, durable=False) as f:
            f.write(data)

    def make_dir(self, path: str) -> None:
        """Create one directory (its parent exists); FileExistsError when ``path`` exists.
        The default checks, then creates: not atomic (`LocalStorage` is: ``mkdir(2)``)."""
        if self.exists(path):
            raise FileExistsError(errno.EEXIST, "already exists", path)
        self.makedirs(path)

    def join(self, *parts: str) -> str:
        """Join path parts."""
        return posixpath.join(*parts)


def _write_exclusive(path: str, data: bytes) -> None:
    """Create ``path`` with O_EXCL and write ``data``; a failed write removes the file it
    created (never another's: O_EXCL made it ours)."""
    with open(path, "xb") as f:
        try:
            f.write(data)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            raise


class _DurableFile(io.BufferedWriter):
    """A buffered file that is flushed and fsynced before it closes."""

    def close(self) -> None:
        if self.closed:
            return
        try:
            self.flush()
            os.fsync(self.fileno())
        finally:
            super().close()


class LocalStorage(Storage):
    """Local or shared POSIX file system: fsync on close, ``os.replace`` for renames."""

    def __init__(self, *, buffer_size: int = 1 << 20) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self._buffer_size = buffer_size

    def open_write(self, path: str, *, durable: bool = True) -> io.BufferedWriter:
        raw = io.FileIO(path, "w")
        if not durable:
            return io.BufferedWriter(raw, buffer_size=self._buffer_size)
        return _DurableFile(raw, buffer_size=self._buffer_size)

    def open_read(self, path: str) -> ReadableFile:
        return open(path, "rb")

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def read_all(self, path: str, size: int) -> torch.Tensor:
        # Mapping the file (copy-on-write, never written) reads it straight from the page
        # cache: half the time of copying it into a buffer, and no private memory. Checkpoint
        # files are immutable once committed; a file truncated while mapped would fault.
        if size == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(path, shared=False, size=size, dtype=torch.uint8)

    def create_exclusive(self, path: str, data: bytes = b"") -> None:
        if not data:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return
        # Written aside, then hard-linked into place: link(2) fails when the name exists, so
        # the file appears exclusively and already whole (a reader never sees it half written).
        tmp = f"{path}.{secrets.token_hex(6)}.tmp"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
            try:
                os.link(tmp, path)
            except OSError as exc:
                if exc.errno not in _NO_LINK:
                    raise
                _write_exclusive(path, data)  # no hard links here (some FUSE/SMB mounts)
        finally:
            # Also when the write failed (a full disk): the temporary name is ours alone.
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)

    def make_dir(self, path: str) -> None:
        os.mkdir(path)

    def sync_dir(self, path: str) -> None:
        # Renames and creations are durable only once the directory itself is fsynced.
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def __repr__(self) -> str:
        return "LocalStorage()"


def storage_for(path: str | os.PathLike[str], storage: Storage | None) -> Storage:
    """The storage a call uses for ``path``: ``storage`` when given; for a URL
    (``"s3://bucket/run"``, ``"memory://run"``, ``"file:///tmp/run"``) an `FsspecStorage` on
    its file system; otherwise `LocalStorage`. Local paths are never reinterpreted."""
    if storage is not None:
        return storage
    from ._fsspec_storage import FsspecStorage, is_url  # lazy: fsspec is an optional extra

    if is_url(os.fspath(path)):
        return FsspecStorage(os.fspath(path))
    return LocalStorage()
