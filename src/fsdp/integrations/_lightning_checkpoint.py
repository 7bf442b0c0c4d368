"""What `FSDPStrategy` stores of a Lightning checkpoint besides the model and optimizer.

Note [Lightning checkpoint contents]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A Lightning checkpoint is a dict: ``state_dict`` and ``optimizer_states`` (the strategy saves
the model and optimizer themselves, sharded, through ``fsdp_ckpt.save``), and the rest: epoch,
global step, loop progress, callback states, LR schedulers, precision plugin, hyperparameters,
whatever ``on_save_checkpoint`` added. fsdp_ckpt's ``extra`` holds JSON values and tensors
(str-keyed dicts, lists, tuples, str, int, float, bool, None, tensors), written into the same
version as the weights and committed with them, checksummed, never unpickled.

Almost everything Lightning writes is such a value. Each top-level entry that is goes into
``extra["lightning"]`` as it is. An entry that is not (an ``argparse.Namespace`` among the
hyperparameters, an OmegaConf type, a dict keyed by ints) is pickled with ``torch.save``; the
bytes go into ``extra["lightning_pickled"]`` as a uint8 tensor, so they too are committed with
the weights and CRC-checked, and there is no side file to fall out of step with a version.
Loading them is ``torch.load`` with the ``weights_only`` Lightning passes (torch's default,
True, when it passes None): the same rule, and the same allow-list, as Lightning's own
checkpoint files. A checkpoint of plain values has no pickle in it at all.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["JSON_KEY", "PICKLED_KEY", "TAKEN_BY_STRATEGY", "from_extra", "to_extra"]

JSON_KEY = "lightning"
PICKLED_KEY = "lightning_pickled"
TAKEN_BY_STRATEGY = ("state_dict", "optimizer_states")
_MAX_DEPTH = 48  # fsdp_ckpt refuses values nested deeper than 64 levels; keep a margin
_TENSOR_DTYPES = {
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


def _storable(obj: Any, depth: int = 0) -> bool:
    """Whether fsdp_ckpt's ``extra`` holds ``obj`` exactly (and gives back the same types)."""
    if obj is None or isinstance(obj, (bool, str)):
        return True
    if type(obj) is int:
        return True
    if type(obj) is float:
        return math.isfinite(obj)  # JSON has no inf or nan
    if isinstance(obj, torch.Tensor):
        return (
            (type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter)
            and obj.layout == torch.strided
            and obj.dtype in _TENSOR_DTYPES
            and not obj.is_meta
        )
    if depth >= _MAX_DEPTH:
        return False
    if type(obj) in (list, tuple):
        return all(_storable(v, depth + 1) for v in obj)
    if type(obj) is dict:  # subclasses (AttributeDict, OrderedDict) would come back as dict
        return all(isinstance(k, str) and _storable(v, depth + 1) for k, v in obj.items())
    return False


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def to_extra(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The ``extra`` for fsdp_ckpt.save holding ``checkpoint`` less what the strategy saves
    itself (Note [Lightning checkpoint contents])."""
    plain: dict[str, Any] = {}
    pickled: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in TAKEN_BY_STRATEGY:
            continue
        if not isinstance(key, str):
            pickled[key] = value
        elif _storable(value, 1):
            plain[key] = _to_cpu(value)
        else:
            pickled[key] = value
    extra: dict[str, Any] = {JSON_KEY: plain}
    if pickled:
        buffer = io.BytesIO()
        torch.save(_to_cpu(pickled), buffer)
        extra[PICKLED_KEY] = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    return extra


def from_extra(
    extra: Mapping[str, Any], *, weights_only: bool | None = None, source: str = "checkpoint"
) -> dict[str, Any]:
    """Inverse of `to_extra`: the Lightning checkpoint dict, less model and optimizer."""
    if JSON_KEY not in extra:
        raise ValueError(
            f"{source} was not written by fsdp.integrations.lightning.FSDPStrategy "
            f"(its extra has no {JSON_KEY!r} entry); load it with fsdp_ckpt.load"
        )
    checkpoint = dict(extra[JSON_KEY])
    blob = extra.get(PICKLED_KEY)
    if blob is not None:
        data = io.BytesIO(blob.numpy().tobytes())
        kwargs = {} if weights_only is None else {"weights_only": weights_only}
        checkpoint.update(torch.load(data, map_location="cpu", **kwargs))
    return checkpoint
