"""Debug-mode poisoning: freed (and fresh) buffers are filled so a use after free shows."""

from __future__ import annotations

import torch

__all__ = ["POISON_BYTE", "poison_"]

#: Byte written into every byte of a poisoned buffer of a non-floating dtype.
POISON_BYTE = 0xA5


def poison_(tensor: torch.Tensor) -> None:
    """Fill ``tensor`` with NaN (floating and complex dtypes) or bytes of `POISON_BYTE`."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        try:
            tensor.fill_(float("nan"))
            return
        except RuntimeError:
            pass  # some 8-bit float types have no fill kernel: fall back to the byte pattern
    tensor.view(torch.uint8).fill_(POISON_BYTE)
