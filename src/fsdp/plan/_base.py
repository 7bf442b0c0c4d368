"""What every part of `fsdp plan` shares: its error, the engine's constants, dtypes, and the
readers and writers of counts and sizes.

The layout rule and the in-flight limits are the engine's own (imported, never copied): a
change there changes the plan, and ``tests/integration/test_plan_model.py`` checks the padded
sizes against a real `FlatLayout`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from fsdp_comm import parse_size
from fsdp_engine import ALIGN_BYTES, MAX_REDUCTIONS_IN_FLIGHT, STRATEGY_NAMES, flat_padded_numel
from fsdp_memory import DEFAULT_MAX_INFLIGHT_ALL_GATHERS

__all__ = [
    "ACTIVATION_VALUES_PER_TOKEN",
    "ALIGN_BYTES",
    "GATHERS_IN_FLIGHT",
    "HOST_USABLE_FRACTION",
    "REDUCTIONS_IN_FLIGHT",
    "STRATEGIES",
    "USABLE_FRACTION",
    "PlanError",
    "Shape",
    "dtype_bytes",
    "dtype_name",
    "format_bytes",
    "human_count",
    "padded_numel",
    "parse_count",
    "as_shape",
    "parse_memory",
    "positive",
]

#: Strategy names, the engine's (`fsdp_engine.ShardingStrategy`).
STRATEGIES: tuple[str, ...] = STRATEGY_NAMES
#: Gathered units in flight at once besides the root: the memory manager's default limit.
GATHERS_IN_FLIGHT = DEFAULT_MAX_INFLIGHT_ALL_GATHERS
#: Reduce-scatter outputs alive at once: the one being issued plus the reductions the engine
#: lets drain (`fsdp_engine.MAX_REDUCTIONS_IN_FLIGHT`).
REDUCTIONS_IN_FLIGHT = MAX_REDUCTIONS_IN_FLIGHT + 1
#: Values saved per token per transformer block, in units of d_model (see `_memory`).
ACTIVATION_VALUES_PER_TOKEN = 16
#: Share of a GPU's memory a plan may use (the rest: CUDA context, NCCL buffers, fragmentation).
USABLE_FRACTION = 0.9
#: Share of a node's host memory CPU offload may pin (the rest: the OS, data loading,
#: checkpoint staging).
HOST_USABLE_FRACTION = 0.8

#: A parameter's shape; a bare count stands for a 1-D parameter of that many elements.
Shape = tuple[int, ...]

_DTYPES = {
    "fp64": 8,
    "float64": 8,
    "double": 8,
    "fp32": 4,
    "float32": 4,
    "float": 4,
    "tf32": 4,
    "bf16": 2,
    "bfloat16": 2,
    "fp16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "float8": 1,
}
_SHORT = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float64": "fp64",
    "double": "fp64",
    "float8": "fp8",
}
_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)


class PlanError(ValueError):
    """A bad planner input; ``argument`` names it (the keyword of `plan`)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument
        self.message = message


def positive(value: Any, argument: str) -> int:
    """``value`` if it is an int >= 1, else a `PlanError` naming ``argument``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlanError(argument, f"must be an int >= 1, got {value!r}")
    return value


def dtype_bytes(dtype: object, *, argument: str = "dtype") -> int:
    """Bytes per element of a dtype given as ``"bf16"``, ``"float32"`` or a ``torch.dtype``."""
    name = str(dtype).lower().removeprefix("torch.")
    if name not in _DTYPES:
        raise PlanError(
            argument, f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16, fp64, fp8"
        )
    return _DTYPES[name]


def dtype_name(dtype: object) -> str:
    """The short name of a dtype (``torch.bfloat16`` -> ``"bf16"``)."""
    name = str(dtype).lower().removeprefix("torch.")
    return _SHORT.get(name, name)


def parse_count(text: str | int | float, *, argument: str = "params") -> int:
    """A parameter count: ``7000000000``, ``7e9``, ``7B``, ``350M``, ``1.5k`` (a count, not a
    size: B is billions here)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _COUNT.match(str(text))
        if not match:
            raise PlanError(argument, f"not a count: {text!r} (examples: 7e9, 7B, 350M)")
        scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
        value = float(match.group(1)) * scale
    if not math.isfinite(value) or value < 1:
        raise PlanError(argument, f"must be a positive count, got {text!r}")
    return int(round(value))


def parse_memory(text: str | int | float, *, argument: str = "gpu_memory") -> int:
    """Bytes from ``80``, ``"80GB"``, ``"80GiB"`` or ``"81920MiB"``: `fsdp_comm.parse_size`
    (every size flag's rule, powers of 1024) with GiB for a bare number."""
    try:
        return parse_size(text, argument=argument, default_unit="g")
    except ValueError as exc:
        raise PlanError(argument, str(exc).removeprefix(f"{argument}: ")) from None


def padded_numel(params: Sequence[int | Sequence[int]], *, shard_count: int, itemsize: int) -> int:
    """Elements of one unit's FlatParameter, padding included (Section 3.2.1, Fig. 3): the
    engine's own rule (`fsdp_engine.flat_padded_numel`). ``params`` are shapes in flattening
    order; a bare count is a 1-D parameter."""
    return flat_padded_numel([as_shape(p) for p in params], shard_count, itemsize)


def as_shape(param: int | Sequence[int]) -> Shape:
    """A parameter's shape from a shape or a bare count."""
    return (param,) if isinstance(param, int) else tuple(param)


def format_bytes(n: float) -> str:
    """``n`` bytes for people: ``"32.56 GiB"``, ``"6.34 MiB"``."""
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"


def human_count(n: int) -> str:
    """``n`` with three significant digits and a suffix: ``"7B"``, ``"124M"``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
