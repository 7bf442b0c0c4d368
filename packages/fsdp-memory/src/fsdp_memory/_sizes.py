"""Argument checks for sizes and dtypes, and the pool's size classes."""

from __future__ import annotations

import operator

import torch

__all__ = ["check_numel", "check_nbytes", "check_dtype", "bucket_nbytes", "format_bytes"]

#: Smallest size class; also the CUDA caching allocator's rounding, so buffers stay aligned
#: for every dtype (the largest element, complex128, is 16 bytes).
MIN_BUCKET_BYTES = 512
#: Size classes per doubling of size: 16 classes bound the padding to under 1/16 (6.25 %).
CLASSES_PER_DOUBLING = 16

_dtype_ok: dict[torch.dtype, int] = {}
_QUANTIZED = frozenset(
    getattr(torch, name)
    for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
    if hasattr(torch, name)
)


def _positive_int(value: object, *, name: str, where: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{where}: {name} must be an int, got bool {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"{where}: {name} must be an int, got {type(value).__name__} {value!r}"
        ) from None
    if number <= 0:
        raise ValueError(f"{where}: {name} must be a positive integer (> 0), got {number}")
    return number


def check_numel(numel: object, *, where: str) -> int:
    """``numel`` as an int; `ValueError` when it is not positive, `TypeError` when not an int."""
    if type(numel) is int and numel > 0:  # the common case, without the general checks
        return numel
    return _positive_int(numel, name="numel", where=where)


def check_nbytes(nbytes: object, *, where: str) -> int:
    """``nbytes`` as an int; `ValueError` when it is not positive, `TypeError` when not an int."""
    if type(nbytes) is int and nbytes > 0:
        return nbytes
    return _positive_int(nbytes, name="nbytes", where=where)


def check_dtype(dtype: object, *, where: str) -> int:
    """The element size of ``dtype``; `TypeError` for anything but a usable `torch.dtype`."""
    # Any object may be looked up: only checked dtypes are keys, so a miss is checked below.
    size: int | None = _dtype_ok.get(dtype)  # type: ignore[call-overload]
    if size is not None:
        return size
    if not isinstance(dtype, torch.dtype):
        raise TypeError(
            f"{where}: dtype must be a torch.dtype such as torch.float32, "
            f"got {type(dtype).__name__} {dtype!r}"
        )
    if dtype in _QUANTIZED:
        # A quantized tensor carries a scale and zero point that a flat buffer has no room for.
        raise TypeError(
            f"{where}: dtype {dtype} is quantized and not supported; pool its integer "
            "representation (for example torch.int8) instead"
        )
    try:
        # Pool buffers are bytes reinterpreted as `dtype`.
        torch.empty(16, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError) as exc:
        raise TypeError(f"{where}: dtype {dtype} is not supported by the pool ({exc})") from None
    _dtype_ok[dtype] = dtype.itemsize
    return dtype.itemsize


def bucket_nbytes(nbytes: int) -> int:
    """The size class of a request of ``nbytes``: what the pool allocates and reuses.

    Requests are rounded up to a multiple of 512 bytes (the CUDA allocator's granule) and, above
    8 KiB, to a multiple of 1/16 of the power of two just below them: 16 classes per doubling,
    so padding stays under 6.25 % while buffers of nearly equal size (FSDP units of one model)
    share one class and hence memory.
    """
    if nbytes <= MIN_BUCKET_BYTES:
        return MIN_BUCKET_BYTES
    granule = max(MIN_BUCKET_BYTES, (1 << (nbytes.bit_length() - 1)) // CLASSES_PER_DOUBLING)
    return -(-nbytes // granule) * granule


def format_bytes(nbytes: int) -> str:
    """``nbytes`` for messages: exact bytes plus a readable MiB figure."""
    return f"{nbytes} bytes ({nbytes / 2**20:.2f} MiB)"
