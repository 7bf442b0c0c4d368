"""Which devices the memory layer serves: the CPU, and CUDA devices when torch has one."""

from __future__ import annotations

from typing import Union

import torch

__all__ = ["DeviceLike", "as_device"]

DeviceLike = Union[str, int, torch.device]


def as_device(device: object, *, where: str) -> torch.device:
    """``device`` as a `torch.device` with an index on CUDA; errors name what is wrong."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"{where}: device must be a torch.device, a string such as 'cuda:0' or an int, "
            f"got {type(device).__name__}"
        )
    try:
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"{where}: device {device!r} is not a device name ({exc})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"{where}: device must be 'cpu' or a CUDA device, got {str(dev)!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"{where}: device {str(dev)!r} asked for, but CUDA is not available")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    return torch.device("cuda", index)
