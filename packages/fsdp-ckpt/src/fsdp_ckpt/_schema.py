"""Typed, bounded reading of parsed JSON (indexes, safetensors headers).

A checkpoint's JSON is input like any other: every field is checked for its type and range
before it is used, and shapes, offsets and nesting are bounded before anything is allocated
from them. Every failure is a `CheckpointCorruptError` naming the file, the field (as a path:
``params['w'].chunks[0].length``) and the value received.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from ._errors import CheckpointCorruptError
from ._paths import check_file_name, show

__all__ = ["MAX_NDIM", "MAX_DEPTH", "MAX_BYTES", "Fields", "shape_numel", "check_encoded"]

MAX_NDIM = 64  # dimensions of a tensor (torch's own limit for most operations)
MAX_DEPTH = 64  # nesting of a stored value (extra, hyperparameters)
MAX_BYTES = 1 << 62  # bytes of one tensor or file: far beyond any disk, far below overflow
_TAGS = ("__tensor__", "__tuple__", "__dict__")


class Fields:
    """Checked access to the JSON of one file (``source``)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, what: str, value: Any) -> NoReturn:
        """Raise CheckpointCorruptError naming the file, the field and the value."""
        raise CheckpointCorruptError(f"{where}: {what}, got {show(value)}", path=self.source)

    def get(self, obj: Mapping[str, Any], key: str, where: str) -> Any:
        """``obj[key]``; a missing field is an error naming it."""
        if key not in obj:
            self.fail(f"{where}.{key}" if where else key, "missing", None)
        return obj[key]

    def as_dict(self, obj: Any, where: str) -> dict[str, Any]:
        if not isinstance(obj, dict):
            self.fail(where, "expected a JSON object", obj)
        return obj

    def as_list(self, obj: Any, where: str) -> list[Any]:
        if not isinstance(obj, list):
            self.fail(where, "expected a JSON array", obj)
        return obj

    def as_str(self, obj: Any, where: str, *, max_len: int = 1 << 16) -> str:
        if not isinstance(obj, str) or len(obj) > max_len:
            self.fail(where, f"expected a string of at most {max_len} characters", obj)
        return obj

    def as_bool(self, obj: Any, where: str) -> bool:
        if not isinstance(obj, bool):
            self.fail(where, "expected true or false", obj)
        return obj

    def as_int(self, obj: Any, where: str, *, lo: int = 0, hi: int = MAX_BYTES) -> int:
        # bool is an int in Python, and 3.0 is not a count: both are refused.
        if isinstance(obj, bool) or not isinstance(obj, int) or not lo <= obj <= hi:
            self.fail(where, f"expected an integer in [{lo}, {hi}]", obj)
        return obj

    def file_name(self, obj: Any, where: str) -> str:
        return check_file_name(obj, field=where, source=self.source)

    def shape(self, obj: Any, where: str) -> tuple[int, ...]:
        """A list of at most MAX_NDIM non-negative integers whose product is bounded."""
        dims = self.as_list(obj, where)
        if len(dims) > MAX_NDIM:
            self.fail(where, f"more than {MAX_NDIM} dimensions", len(dims))
        shape = tuple(self.as_int(d, f"{where}[{i}]") for i, d in enumerate(dims))
        if shape_numel(shape) > MAX_BYTES:
            self.fail(where, f"more than {MAX_BYTES} elements", list(shape))
        return shape


def shape_numel(shape: tuple[int, ...]) -> int:
    """Elements of ``shape`` (the exact product: Python integers do not overflow)."""
    n = 1
    for d in shape:
        n *= d
    return n


def check_encoded(f: Fields, obj: Any, where: str, *, depth: int = 0, tensor: Any = None) -> None:
    """Check a value stored by `encode_value` (JSON with ``__tensor__``/``__tuple__``/
    ``__dict__`` tags): its nesting is bounded and every tag holds what decoding expects.
    ``tensor(record, where)`` checks each ``__tensor__`` record."""
    if depth > MAX_DEPTH:
        f.fail(where, f"nested more than {MAX_DEPTH} levels deep", "...")
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            check_encoded(f, v, f"{where}[{i}]", depth=depth + 1, tensor=tensor)
    elif isinstance(obj, dict):
        _check_tagged(f, obj, where, depth, tensor)


def _check_tagged(f: Fields, obj: dict[str, Any], where: str, depth: int, tensor: Any) -> None:
    items = obj
    if len(obj) == 1 and next(iter(obj)) in _TAGS:
        tag, inner = next(iter(obj.items()))
        here = f"{where}.{tag}"
        if tag == "__tensor__":
            if tensor is not None:
                tensor(f.as_dict(inner, here), here)
            return
        if tag == "__tuple__":  # one level, as the tuple was when it was stored
            for i, v in enumerate(f.as_list(inner, here)):
                check_encoded(f, v, f"{here}[{i}]", depth=depth + 1, tensor=tensor)
            return
        items = f.as_dict(inner, here)  # a user dict whose one key looked like a tag
    for k, v in items.items():
        check_encoded(f, v, f"{where}[{k!r}]", depth=depth + 1, tensor=tensor)
