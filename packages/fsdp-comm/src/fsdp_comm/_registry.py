"""Finding backends by name: built-ins, `register_backend`, and entry points.

Installed packages add backends through the entry-point group ``fsdp_comm.backends``.
"""

from __future__ import annotations

import importlib
import logging
import threading
import warnings
from collections.abc import Callable
from importlib import metadata
from typing import Any

from ._backend import Backend
from ._errors import BackendUnavailableError

__all__ = ["get_backend", "register_backend", "available_backends", "ENTRY_POINT_GROUP"]

#: Entry-point group through which installed packages add backends.
ENTRY_POINT_GROUP = "fsdp_comm.backends"

BackendFactory = Callable[..., Backend]
_log = logging.getLogger("fsdp.comm")

_BUILTINS: dict[str, str] = {
    "torch": "fsdp_comm._torch_backend:TorchBackend.from_options",
    "threads": "fsdp_comm._threads_backend:ThreadsBackend.from_options",
    "fake": "fsdp_comm._fake_backend:FakeBackend.from_options",
    "cupy-nccl": "fsdp_comm._cupy_backend:CupyNcclBackend.from_options",
}
_registered: dict[str, BackendFactory] = {}
_lock = threading.Lock()


def register_backend(name: str, factory: BackendFactory, *, override: bool = False) -> None:
    """Make ``get_backend(name, **options)`` call ``factory(**options)``.

    Registering a name that exists raises `ValueError` unless ``override=True``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory must be callable, got {type(factory).__name__}")
    with _lock:
        if not override and (name in _registered or name in _BUILTINS):
            raise ValueError(
                f"backend {name!r} is already registered; pass override=True to replace it"
            )
        _registered[name] = factory


def available_backends() -> list[str]:
    """Names ``get_backend`` knows: built-ins, registered ones and installed entry points.

    A known backend may still be unusable here (``cupy-nccl`` without a GPU): `get_backend`
    then raises `BackendUnavailableError` saying why.
    """
    with _lock:
        names = set(_BUILTINS) | set(_registered)
    names |= {ep.name for ep in _entry_points()}
    return sorted(names)


def get_backend(name: str, **options: Any) -> Backend:
    """Create the backend called ``name`` with ``options`` (see each backend's constructor)."""
    factory = _find_factory(name)
    backend = factory(**options)
    if not isinstance(backend, Backend):
        raise TypeError(
            f"the factory of backend {name!r} returned {type(backend).__name__}, not a Backend"
        )
    _log.info(
        "backend %s: rank %d of %d on %s", name, backend.rank, backend.world_size, backend.device
    )
    return backend


def _find_factory(name: str) -> BackendFactory:
    with _lock:
        if name in _registered:
            return _registered[name]
    if name in _BUILTINS:
        return _load(_BUILTINS[name])
    for ep in _entry_points():
        if ep.name == name:
            return ep.load()  # type: ignore[no-any-return]
    raise BackendUnavailableError(
        f"no backend named {name!r}; known backends: {', '.join(available_backends())}"
    )


def _load(target: str) -> BackendFactory:
    module_name, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _entry_points() -> list[metadata.EntryPoint]:
    try:
        eps = metadata.entry_points()
        if hasattr(eps, "select"):
            return list(eps.select(group=ENTRY_POINT_GROUP))
        # Python 3.12+ stubs have no .get (3.10 and 3.11 do): unused there, hence unused-ignore.
        return list(eps.get(ENTRY_POINT_GROUP, []))  # type: ignore[attr-defined, unused-ignore]
    except Exception as exc:  # a broken distribution must not break every lookup
        warnings.warn(f"fsdp_comm: reading entry points failed: {exc}", stacklevel=3)
        return []
