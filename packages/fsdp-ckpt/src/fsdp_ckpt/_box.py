"""Boxes of a tensor: what a rank holds, what a chunk stores, and copying between them.

Note [boxes]
    A box of a tensor of shape ``S`` is, per dimension ``d``, an offset ``o[d]`` and a size
    ``s[d]`` (``o[d] + s[d] <= S[d]``); its data is ``prod(s)`` elements in row-major order of
    the box, contiguous in memory. Every kind of piece is one:

    - a dim-0 FSDP shard: ``o = (d * r, 0, ...)``, ``s = (rows, S[1], ...)``;
    - a tensor-parallel piece, and a dp chunk of one (``fsdp_engine.sharded_layout``, Note
      [boxes of a 2-D mesh] there): e.g. ``o = (3, 5)``, ``s = (3, 5)`` of a (6, 10)
      row-parallel weight;
    - a whole tensor: ``o = 0``, ``s = S``.

    A flat slice ``[a, a + n)`` of the flattened tensor (the chunks of format version 1) is
    generally not a box, but it is a union of at most ``2 * ndim - 1`` boxes that are each a
    contiguous run of the slice (`flat_regions`): the rest of the row ``a`` starts in, whole
    rows, the start of the row it ends in, recursively in each row. So every stored chunk is a
    list of `Region`\\ s (a box and where its data starts in the chunk), and loading copies, for
    every region of every chunk, the intersection with the destination's box: per dimension
    ``lo = max(o1, o2)``, ``hi = min(o1 + s1, o2 + s2)``, empty when ``hi <= lo`` anywhere;
    each side narrowed to ``[lo, hi)`` relative to its own offsets.

    Saved boxes tile the tensor when their volumes sum to ``numel(S)`` and no two intersect
    (`tiling_problem`: sorted by dim-0 offset, each box is compared with the earlier ones whose
    dim-0 range it still overlaps).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["Box", "Region", "flat_regions", "flat_box_start", "copy_region", "tiling_problem"]


@dataclass(frozen=True)
class Box:
    """Per dimension, the first index and the extent (Note [boxes])."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise ValueError(
                f"Box: offsets and sizes must have one entry per dimension, got "
                f"offsets {self.offsets} and sizes {self.sizes}"
            )
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(
                f"Box: offsets and sizes must be >= 0, got offsets "
                f"{self.offsets} and sizes {self.sizes}"
            )

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls((0,) * len(shape), tuple(int(d) for d in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def inside(self, shape: Sequence[int]) -> bool:
        """Whether the box lies within a tensor of ``shape``."""
        return len(shape) == len(self.sizes) and all(
            o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape)
        )

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when they share no element."""
        offsets, sizes = [], []
        for o1, s1, o2, s2 in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(o1, o2), min(o1 + s1, o2 + s2)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class Region:
    """A box whose data starts at element ``start`` of a chunk's 1-D data."""

    box: Box
    start: int


def flat_box_start(shape: Sequence[int], box: Box) -> int | None:
    """The first element of ``box`` in the flattened tensor when the box is a contiguous
    slice of it (dimensions narrowed to one index, one partial dimension, whole ones); None
    otherwise. An empty box starts at 0."""
    if box.numel == 0:
        return 0
    partial = [d for d in range(len(shape)) if box.sizes[d] != shape[d]]
    if partial and any(box.sizes[d] != 1 for d in range(partial[-1])):
        return None
    start, stride = 0, 1
    for d in reversed(range(len(shape))):
        start += box.offsets[d] * stride
        stride *= shape[d]
    return start


def flat_span(shape: Sequence[int], box: Box) -> tuple[int, int]:
    """``[first, last + 1)`` of the box's elements in the flattened tensor (a superset of
    them, for a quick rejection of flat chunks); ``(0, 0)`` for an empty box."""
    if box.numel == 0:
        return 0, 0
    first = last = 0
    stride = 1
    for d in reversed(range(len(shape))):
        first += box.offsets[d] * stride
        last += (box.offsets[d] + box.sizes[d] - 1) * stride
        stride *= shape[d]
    return first, last + 1


@functools.lru_cache(maxsize=1 << 16)
def flat_regions(shape: tuple[int, ...], start: int, length: int) -> tuple[Region, ...]:
    """The flat slice ``[start, start + length)`` of a tensor of ``shape`` as boxes, each a
    contiguous run of the slice, in order (Note [boxes])."""
    boxes: list[Box] = []
    _split(tuple(shape), start, start + length, (), boxes)
    out = []
    for box in boxes:
        first = flat_box_start(shape, box)
        assert first is not None  # every box _split makes is contiguous
        out.append(Region(box, first - start))
    return tuple(out)


def _split(shape: tuple[int, ...], a: int, b: int, prefix: tuple[int, ...], out: list[Box]) -> None:
    """Append the boxes of the flat range ``[a, b)`` of the sub-tensor of ``shape`` at the
    index ``prefix`` of the outer dimensions."""
    if b <= a:
        return
    ones = (1,) * len(prefix)
    if not shape:  # one element
        out.append(Box(prefix, ones))
        return
    inner, rest = math.prod(shape[1:]), shape[1:]
    if inner == 0:
        return
    first = a // inner
    row_end = (first + 1) * inner
    if a % inner or b < row_end:  # a partial first row: its part, then the rest
        end = min(b, row_end)
        _split(rest, a - first * inner, end - first * inner, (*prefix, first), out)
        _split(shape, end, b, prefix, out)
        return
    whole_end = b // inner  # rows first .. whole_end - 1 are whole
    out.append(Box((*prefix, first, *(0,) * len(rest)), (*ones, whole_end - first, *rest)))
    if b % inner:
        _split(rest, 0, b - whole_end * inner, (*prefix, whole_end), out)


def copy_region(src: torch.Tensor, region: Region, dst: torch.Tensor, dst_box: Box) -> bool:
    """Copy the intersection of ``region`` (its data in the 1-D ``src`` from
    ``region.start``) with ``dst_box`` (its data: the 1-D ``dst``). False when they do not
    meet."""
    common = region.box.intersect(dst_box)
    if common is None:
        return False
    s = src[region.start : region.start + region.box.numel].view(region.box.sizes)
    d = dst.view(dst_box.sizes)
    for dim, (lo, n) in enumerate(zip(common.offsets, common.sizes)):
        s = s.narrow(dim, lo - region.box.offsets[dim], n)
        d = d.narrow(dim, lo - dst_box.offsets[dim], n)
    d.copy_(s)
    return True


def tiling_problem(boxes: Sequence[Box], shape: Sequence[int]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly (None when they do)."""
    total = math.prod(shape)
    held = 0
    for box in boxes:
        if not box.inside(shape) or box.numel == 0:
            return f"a piece {box.offsets} + {box.sizes} is empty or outside {list(shape)}"
        held += box.numel
    if held != total:
        return f"pieces hold {held} of {total} elements"
    if not shape:
        return None  # one box of one element
    order = sorted(boxes, key=lambda b: b.offsets)
    active: list[Box] = []
    for box in order:
        active = [a for a in active if a.offsets[0] + a.sizes[0] > box.offsets[0]]
        for other in active:
            if other.intersect(box) is not None:
                return (
                    f"pieces overlap: {other.offsets} + {other.sizes} and "
                    f"{box.offsets} + {box.sizes}"
                )
        active.append(box)
    return None
