"""Checks of the public functions' arguments, before anything is read, written or agreed on.

Each refusal names the argument, the rule and the value given: ``TypeError`` for a value of
the wrong type, ``ValueError`` for one of the right type outside the rule.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from fsdp_comm import Backend
from torch import nn

from ._paths import show
from ._storage import Storage

__all__ = [
    "check_path",
    "check_bool",
    "check_keep_last",
    "check_storage",
    "check_backend",
    "check_key",
    "check_model",
    "check_names",
]


def check_path(value: Any, name: str = "path") -> str:
    """``value`` as a str path: a str or os.PathLike naming something (not empty, no NUL)."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(
            f"{name} must be a str or os.PathLike, got {type(value).__name__} {show(value)}"
        )
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a str path, got {type(text).__name__} {show(text)}")
    if not text:
        raise ValueError(f"{name} must be a non-empty path, got ''")
    if "\0" in text:
        raise ValueError(f"{name} must not contain a NUL character, got {show(text)}")
    return text


def check_bool(value: Any, name: str) -> None:
    """``value`` is True or False (1 and 0 are refused: a flag passed positionally by mistake)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {show(value)}")


def check_keep_last(value: Any) -> None:
    """``keep_last``: how many committed versions a checkpoint path keeps, an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"keep_last must be an int >= 1, got {type(value).__name__} {show(value)}")
    if value < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {value!r}")


def check_storage(value: Any) -> None:
    """``storage``: None (chosen from the path) or an `fsdp_ckpt.Storage`."""
    if value is not None and not isinstance(value, Storage):
        raise TypeError(
            f"storage must be an fsdp_ckpt.Storage or None, got {type(value).__name__} "
            f"{show(value)}"
        )


def check_backend(value: Any) -> None:
    """``backend``: None (found in a sharded model, or one process) or an fsdp_comm.Backend."""
    if value is not None and not isinstance(value, Backend):
        raise TypeError(
            "backend must be an fsdp_comm.Backend spanning every rank, or None, got "
            f"{type(value).__name__} {show(value)}"
        )


def check_key(value: Any, name: str) -> None:
    """A top-level key of a DCP state dict: a non-empty str."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {show(value)}")
    if not value:
        raise ValueError(f"{name} must be a non-empty str, got ''")


def check_model(value: Any) -> None:
    """``model``: a torch.nn.Module (sharded or not)."""
    if not isinstance(value, nn.Module):
        raise TypeError(
            f"model must be a torch.nn.Module, got {type(value).__name__} {show(value)}"
        )


def check_names(value: Any) -> list[str] | None:
    """``names``: None (every tensor) or names of tensors (any iterable of str); as a list."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"names must be a list of str (or another iterable of them) or None, got "
            f"{type(value).__name__} {show(value)}"
        )
    names = list(value)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"names must hold only str, got {type(bad[0]).__name__} {show(bad[0])}")
    return names
