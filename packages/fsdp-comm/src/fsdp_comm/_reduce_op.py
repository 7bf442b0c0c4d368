"""Reduction operators shared by every backend."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

__all__ = ["ReduceOp", "ReduceKind"]


class ReduceKind(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    PREMUL_SUM = "premul_sum"


@dataclass(frozen=True)
class ReduceOp:
    """A reduction: ``ReduceOp.SUM``, ``.AVG``, ``.MAX`` or ``ReduceOp.premul_sum(f)``.

    The pre-multiplied sum multiplies every rank's input by ``factor`` before summing, so a
    gradient reduce-scatter can divide by the world size (or any factor) without a second pass
    and without overflowing low-precision sums.
    """

    kind: ReduceKind
    factor: float | None = None

    SUM: ClassVar[ReduceOp]
    AVG: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, ReduceKind):
            raise TypeError(f"kind must be a ReduceKind, got {self.kind!r}")
        if (self.kind is ReduceKind.PREMUL_SUM) != (self.factor is not None):
            raise ValueError(
                f"factor is required for PREMUL_SUM and only for it, got kind={self.kind.name} "
                f"factor={self.factor!r}"
            )

    @classmethod
    def premul_sum(cls, factor: float) -> ReduceOp:
        """Sum of every rank's input multiplied by ``factor`` (a finite number)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"factor must be a real number, got {type(factor).__name__}")
        if not math.isfinite(factor):
            raise ValueError(f"factor must be finite, got {factor!r}")
        return cls(ReduceKind.PREMUL_SUM, float(factor))

    def reduce(self, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Reference reduction of ``inputs`` (in rank order) into ``out``.

        Used by the in-process backends; summing in rank order on every rank keeps results
        bitwise identical across ranks.
        """
        if self.kind is ReduceKind.MAX:
            out.copy_(inputs[0])
            for t in inputs[1:]:
                torch.maximum(out, t, out=out)
            return out
        if self.kind is ReduceKind.PREMUL_SUM:
            assert self.factor is not None  # PREMUL_SUM always has one (__post_init__)
            torch.mul(inputs[0], self.factor, out=out)
            for t in inputs[1:]:
                out.add_(t, alpha=self.factor)
            return out
        out.copy_(inputs[0])
        for t in inputs[1:]:
            out.add_(t)
        if self.kind is ReduceKind.AVG:
            out.div_(len(inputs))
        return out

    def __repr__(self) -> str:
        if self.kind is ReduceKind.PREMUL_SUM:
            return f"ReduceOp.premul_sum({self.factor})"
        return f"ReduceOp.{self.kind.name}"


ReduceOp.SUM = ReduceOp(ReduceKind.SUM)
ReduceOp.AVG = ReduceOp(ReduceKind.AVG)
ReduceOp.MAX = ReduceOp(ReduceKind.MAX)
