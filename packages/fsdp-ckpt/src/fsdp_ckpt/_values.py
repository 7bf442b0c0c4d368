"""Small user values as JSON: ``extra`` and optimizer hyperparameters.

JSON types pass through; tuples and tensors get a tag so they come back as they went in. Small
tensors (at most 64 elements: a step counter, a learning rate) are written inline, exactly (every
float16/bfloat16/float32/float64 value has an exact decimal form in JSON); larger ones (an RNG
state) go to a tensor file through ``external`` and the JSON names the key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ._errors import CheckpointCorruptError
from ._schema import MAX_DEPTH
from ._tensor_file import dtype_from_name, dtype_name

__all__ = [
    "INLINE_MAX_NUMEL",
    "encode_value",
    "decode_value",
    "inline_tensor",
    "tensor_from_inline",
]

INLINE_MAX_NUMEL = 64
_INLINE_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}
_TAGS = ("__tensor__", "__tuple__", "__dict__")

External = Callable[[torch.Tensor], Mapping[str, Any]]


def inline_tensor(t: torch.Tensor) -> dict[str, Any]:
    """``t`` as JSON (dtype, shape, values); for small tensors of inlinable dtypes."""
    t = t.detach().to("cpu")
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "values": t.reshape(-1).tolist()}


def tensor_from_inline(obj: Mapping[str, Any], *, source: str) -> torch.Tensor:
    """Inverse of `inline_tensor`."""
    try:
        dtype = dtype_from_name(obj["dtype"], source=source)
        values = torch.tensor(obj["values"], dtype=dtype)
        return values.reshape([int(d) for d in obj["shape"]])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, CheckpointCorruptError):
            raise
        raise CheckpointCorruptError(f"bad inline tensor ({exc})", path=source) from None


def can_inline(t: torch.Tensor) -> bool:
    """Small enough and of a dtype whose values JSON holds exactly."""
    return t.numel() <= INLINE_MAX_NUMEL and t.dtype in _INLINE_DTYPES


def encode_value(obj: Any, *, where: str, external: External | None, _depth: int = 0) -> Any:
    """``obj`` as JSON. TypeError naming ``where`` for what JSON cannot hold, and for
    containers nested more than MAX_DEPTH levels deep (readers refuse those)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _encode_tensor(obj, where, external)}
    if _depth >= MAX_DEPTH:
        raise TypeError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(obj, tuple):
        return {
            "__tuple__": [
                encode_value(v, where=f"{where}[{i}]", external=external, _depth=_depth + 1)
                for i, v in enumerate(obj)
            ]
        }
    if isinstance(obj, list):
        return [
            encode_value(v, where=f"{where}[{i}]", external=external, _depth=_depth + 1)
            for i, v in enumerate(obj)
        ]
    if isinstance(obj, Mapping):
        return _encode_mapping(obj, where, external, _depth)
    raise TypeError(
        f"{where}: cannot store a {type(obj).__name__}; checkpoints hold dict (str "
        "keys), list, tuple, str, int, float, bool, None and torch.Tensor values"
    )


def _encode_tensor(t: torch.Tensor, where: str, external: External | None) -> dict[str, Any]:
    if can_inline(t):
        return inline_tensor(t)
    if external is None:
        raise TypeError(
            f"{where}: tensor of {t.numel()} elements ({t.dtype}) is too large to "
            f"store inline (at most {INLINE_MAX_NUMEL} elements of a float, int or "
            "bool dtype)"
        )
    return dict(external(t))


def _encode_mapping(
    obj: Mapping[Any, Any], where: str, external: External | None, depth: int
) -> Any:
    out = {}
    for key, value in obj.items():
        if not isinstance(key, str):
            raise TypeError(f"{where}: dict keys must be str, got {key!r} ({type(key).__name__})")
        out[key] = encode_value(
            value, where=f"{where}[{key!r}]", external=external, _depth=depth + 1
        )
    if len(out) == 1 and next(iter(out)) in _TAGS:
        return {"__dict__": out}  # a user key that looks like our tag stays a plain dict
    return out


def decode_value(
    obj: Any, *, tensors: Callable[[Mapping[str, Any]], torch.Tensor], source: str
) -> Any:
    """Inverse of `encode_value`; ``tensors`` turns a stored tensor record into a tensor."""
    if isinstance(obj, list):
        return [decode_value(v, tensors=tensors, source=source) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, inner),) = obj.items()
        if tag == "__tensor__":
            return tensors(inner) if "key" in inner else tensor_from_inline(inner, source=source)
        if tag == "__tuple__":
            return tuple(decode_value(v, tensors=tensors, source=source) for v in inner)
        if tag == "__dict__":
            obj = inner
    return {k: decode_value(v, tensors=tensors, source=source) for k, v in obj.items()}


def tensor_records(obj: Any) -> list[Mapping[str, Any]]:
    """Every external tensor record inside an encoded value (what a load must read)."""
    if isinstance(obj, list):
        return [r for v in obj for r in tensor_records(v)]
    if not isinstance(obj, dict):
        return []
    if len(obj) == 1:  # the tags, read exactly as `decode_value` reads them
        ((tag, inner),) = obj.items()
        if tag == "__tensor__":
            return [inner] if isinstance(inner, dict) and "key" in inner else []
        if tag == "__dict__" and isinstance(inner, dict):
            obj = inner  # a user dict whose one key looked like a tag: not a tag itself
    return [r for v in obj.values() for r in tensor_records(v)]
