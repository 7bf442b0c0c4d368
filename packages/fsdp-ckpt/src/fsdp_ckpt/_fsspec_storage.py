"""`FsspecStorage`: checkpoints on any fsspec file system (S3, GCS, Azure, memory, local, ...).

Note [fsspec guarantees]
~~~~~~~~~~~~~~~~~~~~~~~~
The commit protocol (``_directory.py``) needs three things from a store. Here is what each
one becomes on fsspec:

- **Durable writes.** A file is durable once ``close()`` returns. On object stores (s3fs,
  gcsfs, adlfs) ``close()`` uploads the object, and the object exists, whole, only once the
  store has acknowledged it. On fsspec's local file system (``file://``) the file is flushed
  and fsynced before it closes, and `sync_dir` fsyncs the directory, as `LocalStorage` does.
  Everywhere else `sync_dir` does nothing: object stores have no directory entries.
- **Atomic replacement of ``CURRENT``.** Renaming the new pointer over ``CURRENT`` is the
  commit point. On the local file system this is ``os.replace``, atomic. On object stores
  fsspec's ``mv`` is a copy then a delete. That is still safe for the pointer: the copy
  writes the ``CURRENT`` object in one PUT (or server-side copy), so a reader sees the old
  pointer or the new one, never a mix. A crash between the copy and the delete leaves a
  ``.CURRENT.tmp-*`` object, which the next save deletes. The staging directory's rename to
  ``vNNNNNN`` copies every object and then deletes the originals. It is neither atomic nor
  cheap: the store copies the whole checkpoint, server-side. It is safe anyway. ``CURRENT``
  only moves after that rename has finished, so a crash halfway leaves a partial ``vNNNNNN``
  that nothing points to. The next save numbers its version above it and deletes it.
  Loading that directory by name fails with a `CheckpointCorruptError` naming a missing
  file (or a `CheckpointError`: no index). It never loads a mixed model.
- **Exclusive creation** (the save lock ``.lock``, and every file a rank claims). It opens
  the file with mode ``"xb"`` (*create, fail if it exists*). Where the file system
  implements that mode with a conditional write, a second creator gets ``FileExistsError``
  from the store, and that is atomic. s3fs does this with ``If-None-Match: *`` (fsspec/s3fs
  #917; releases before the mid-2025 fix #974 ignored it for small files), gcsfs with
  ``if_generation_match=0`` and adlfs with ``overwrite=False``. fsspec itself calls the mode
  "a trial". fsspec's memory file system checks and then creates, which is atomic enough
  between threads of one process. A file system that rejects ``"xb"`` falls back to a check,
  then a write, which is not atomic. `exclusive_create` says which of the two you have. It
  cannot tell whether a back-end that accepted ``"xb"`` really checks. Without an atomic
  create, two saves that start in the same instant can both write ``.lock``. Each still
  writes only its own staging directory (its name carries a random token), and the one
  whose lock was overwritten finds out in `SaveLock.check` before it commits. On the local
  file system the file is written aside and hard-linked into place, as `LocalStorage` does,
  so it appears whole or not at all.

The protocol also assumes that a reader sees an object once its write has returned, in
reads and in listings. S3 (since December 2020), GCS and Azure Blob Storage are strongly
consistent in this sense. fsspec can cache listings (s3fs's ``dircache``), so every
`listdir`, `exists` and `size` drops the cache for that path first, and rank 0 sees what the
other ranks wrote. Before it commits, rank 0 reads every file back to check its CRC-32. On
an object store that means downloading the whole checkpoint once.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
from typing import Any

import torch

from ._paths import check_regular
from ._storage import LocalStorage, ReadableFile, Storage, WritableFile

__all__ = ["FsspecStorage", "is_url"]

_INSTALL = "pip install 'fsdp-ckpt[fsspec]'"
# "s3://bucket/x", "memory://x", "gs://b", "file:///tmp/x", "simplecache::s3://b" (a
# Windows drive letter, "C:\\x", has no "//" after its colon and stays local).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(://|::)")
_LOCAL = LocalStorage()


def is_url(path: str) -> bool:
    """Whether ``path`` names an fsspec URL (has a ``scheme://`` prefix) rather than a local
    path."""
    return bool(_URL.match(path))


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError as exc:  # torch depends on fsspec, so this is rare
        raise ImportError(
            f"FsspecStorage (and checkpoint paths given as URLs) need fsspec: {_INSTALL}"
        ) from exc
    return fsspec


class _SyncedFile:
    """A local fsspec file that is flushed and fsynced before it closes."""

    def __init__(self, f: Any) -> None:
        self._f = f

    def write(self, data: Any, /) -> int | None:
        written: int | None = self._f.write(data)  # fsspec is untyped: its files are Any
        return written

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()

    def __enter__(self) -> _SyncedFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class FsspecStorage(Storage):
    """`Storage` on an fsspec file system: ``FsspecStorage("s3://bucket")``,
    ``FsspecStorage("memory")``, ``FsspecStorage(fs)`` with any ``AbstractFileSystem``.

    ``fs_or_url``: a file system object, a protocol name (``"s3"``), or a URL whose protocol
    picks the file system; its path part is ignored, since every call names full paths.
    Chained URLs (``"simplecache::s3://..."``) are not supported as paths.
    ``storage_options`` go to fsspec when it builds the file system (credentials, endpoints).
    Paths passed to the storage may be URLs of this file system's protocol
    (``"s3://bucket/run/CURRENT"``) or its bare paths (``"bucket/run"``).

    Needs ``pip install 'fsdp-ckpt[fsspec]'``. What is durable and what is atomic on each
    kind of file system: Note [fsspec guarantees] above, and the fsdp-ckpt README.
    """

    def __init__(self, fs_or_url: Any, **storage_options: Any) -> None:
        fsspec = _fsspec()
        if isinstance(fs_or_url, fsspec.AbstractFileSystem):
            if storage_options:
                raise TypeError(
                    "storage_options apply only when FsspecStorage builds the file "
                    "system from a URL or protocol name"
                )
            self.fs = fs_or_url
        elif isinstance(fs_or_url, (str, os.PathLike)):
            url = os.fspath(fs_or_url)
            if is_url(url):
                self.fs, _ = fsspec.core.url_to_fs(url, **storage_options)
            else:
                self.fs = fsspec.filesystem(url, **storage_options)
        else:
            raise TypeError(
                "fs_or_url must be an fsspec AbstractFileSystem, a protocol name or "
                f"a URL, got {type(fs_or_url).__name__}"
            )
        from fsspec.implementations.local import LocalFileSystem

        protocol = self.fs.protocol
        self._protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        self.local = isinstance(self.fs, LocalFileSystem)
        # None until the first exclusive create tells: "xb" taken by the file system, or not.
        self._xb: bool | None = True if self.local else None

    # ---- paths -------------------------------------------------------------------------------
    def _p(self, path: str) -> str:
        path = os.fspath(path)
        if is_url(path) and not path.startswith(tuple(f"{p}://" for p in self._protocols)):
            raise ValueError(
                f"{path} is not a path of this storage's file system ({'/'.join(self._protocols)})"
            )
        stripped: str = self.fs._strip_protocol(path)  # fsspec is untyped
        return stripped

    def _drop_cache(self, path: str) -> None:
        try:
            self.fs.invalidate_cache(path)
        except Exception:  # noqa: S110 - a cache we could not drop is only a slower path
            pass

    @property
    def exclusive_create(self) -> str:
        """How `create_exclusive` works here: ``"atomic"`` (hard link on the local file system,
        or the file system's own ``"xb"`` mode), ``"check-then-write"`` (the file system
        rejected ``"xb"``: not atomic), or ``"unknown"`` before the first call."""
        if self.local or self._xb:
            return "atomic"
        return "unknown" if self._xb is None else "check-then-write"

    # ---- Storage -----------------------------------------------------------------------------
    def open_write(self, path: str, *, durable: bool = True) -> WritableFile:
        f = self.fs.open(self._p(path), "wb")
        # Object stores: close() uploads and returns once the store holds the object (durable
        # either way). Local: fsync before close, as LocalStorage.
        return _SyncedFile(f) if self.local and durable else f

    def _check_local(self, path: str) -> None:
        # A FIFO or device in a checkpoint directory would block or never end; a symbolic link
        # must stay in its directory. Same rule as LocalStorage (`check_regular`).
        if self.local:
            check_regular(_LOCAL, path, missing_ok=True)

    def open_read(self, path: str) -> ReadableFile:
        p = self._p(path)
        self._check_local(p)
        f: ReadableFile = self.fs.open(p, "rb")  # fsspec is untyped: a binary file
        return f

    def read_all(self, path: str, size: int) -> torch.Tensor:
        if self.local:  # mapped, as LocalStorage
            p = self._p(path)
            self._check_local(p)
            return _LOCAL.read_all(p, size)
        return super().read_all(path, size)

    def size(self, path: str) -> int:
        p = self._p(path)
        self._drop_cache(p)
        return int(self.fs.size(p))

    def exists(self, path: str) -> bool:
        p = self._p(path)
        self._drop_cache(p)
        return bool(self.fs.exists(p))

    def listdir(self, path: str) -> list[str]:
        p = self._p(path).rstrip("/") or "/"
        self._drop_cache(p)
        try:
            entries = self.fs.ls(p, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = []
        for entry in entries:
            name = entry["name"].rstrip("/")
            if name == p:  # ls of a file lists the file itself: not a directory
                return []
            names.append(posixpath.basename(name))
        return sorted(names)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(self._p(path), exist_ok=True)

    def make_dir(self, path: str) -> None:
        if self.local:
            os.mkdir(self._p(path))  # atomic: mkdir(2)
        else:
            super().make_dir(path)  # names with random tokens: the check suffices

    def rename(self, src: str, dst: str) -> None:
        s, d = self._p(src), self._p(dst)
        if self.local:
            os.replace(s, d)  # rename(2): atomic
            return
        # Object stores: copy, then delete (Note [fsspec guarantees]). A file replacing a file
        # is one PUT/copy of the destination: readers see the old or the new object.
        if not self.fs.exists(s):
            raise FileNotFoundError(errno.ENOENT, "no such file or directory", src)
        recursive = self.fs.isdir(s)
        self.fs.mv(s, d, recursive=recursive)

    def remove(self, path: str) -> None:
        p = self._p(path)
        try:
            if self.local and os.path.islink(p):
                os.remove(p)
            elif self.fs.exists(p):
                self.fs.rm(p, recursive=self.fs.isdir(p))
        except FileNotFoundError:
            pass

    def sync_dir(self, path: str) -> None:
        if self.local:
            _LOCAL.sync_dir(self._p(path))

    def create_exclusive(self, path: str, data: bytes = b"") -> None:
        p = self._p(path)
        if self.local:  # written aside and hard-linked into place (or O_EXCL)
            _LOCAL.create_exclusive(p, data)
            return
        if self._xb is not False:
            try:
                # s3fs/gcsfs/adlfs: a conditional write, checked by the store when the object
                # is committed at close(); FileExistsError when another writer got there first.
                with self.fs.open(p, "xb") as f:
                    f.write(data)
            except (ValueError, NotImplementedError):  # "unsupported file mode" (or another)
                if self._xb:  # "xb" worked before: this is another error
                    raise
                self._xb = False  # the file system does not take "xb": check, then write
            else:
                self._xb = True
                return
        if self.exists(p):
            raise FileExistsError(errno.EEXIST, "already exists", path)
        with self.fs.open(p, "wb") as f:
            f.write(data)

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def __repr__(self) -> str:
        return f"FsspecStorage({type(self.fs).__name__}, protocol={self._protocols[0]!r})"
