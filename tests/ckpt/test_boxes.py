"""Box arithmetic of fsdp-ckpt (Note [boxes] in fsdp_ckpt._box): flat slices as boxes,
copying the intersection of two boxes, and checking that pieces tile a tensor."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from fsdp_ckpt._box import (
    Box,
    Region,
    copy_region,
    flat_box_start,
    flat_regions,
    tiling_problem,
)

SHAPES = [(), (5,), (4, 6), (3, 4, 5), (2, 1, 3, 2), (0, 3), (3, 0)]


def _narrow(t: torch.Tensor, box: Box) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(box.offsets, box.sizes)):
        t = t.narrow(dim, o, n)
    return t


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_flat_slice_is_a_few_contiguous_boxes(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for a in range(n + 1):
        for b in range(a, n + 1):
            regions = flat_regions(shape, a, b - a)
            assert len(regions) <= max(1, 2 * len(shape) - 1), (a, b, regions)
            data = torch.arange(a, b)
            for r in regions:  # each box is the run of the slice its start says
                assert torch.equal(
                    _narrow(full, r.box).reshape(-1), data[r.start : r.start + r.box.numel]
                ), (a, b, r)
                assert flat_box_start(shape, r.box) == a + r.start
            assert sum(r.box.numel for r in regions) == b - a


def test_flat_box_start_only_for_contiguous_boxes() -> None:
    shape = (6, 10)
    assert flat_box_start(shape, Box((3, 0), (2, 10))) == 30  # dim-0 rows
    assert flat_box_start(shape, Box((4, 2), (1, 5))) == 42  # part of one row
    assert flat_box_start(shape, Box((0, 5), (3, 5))) is None  # a row-parallel piece
    assert flat_box_start(shape, Box((0, 5), (0, 5))) == 0  # empty


def test_copy_region_copies_the_intersection() -> None:
    g = torch.Generator().manual_seed(0)
    shape = (7, 5, 3)
    full = torch.randn(shape, generator=g)
    for _ in range(200):
        boxes = []
        for _ in range(2):
            lo = [int(torch.randint(0, d, (), generator=g)) for d in shape]
            boxes.append(
                Box(
                    tuple(lo),
                    tuple(
                        int(torch.randint(1, d - o + 1, (), generator=g)) for o, d in zip(lo, shape)
                    ),
                )
            )
        src, dst = boxes
        out = torch.full((dst.numel,), float("nan"))
        met = copy_region(_narrow(full, src).reshape(-1), Region(src, 0), out, dst)
        common = src.intersect(dst)
        assert met == (common is not None)
        want = torch.full(dst.sizes, float("nan"))
        if common is not None:
            shifted = Box(tuple(c - o for c, o in zip(common.offsets, dst.offsets)), common.sizes)
            _narrow(want, shifted).copy_(_narrow(full, common))
        assert torch.equal(out.view(dst.sizes).nan_to_num(-9), want.nan_to_num(-9))


def test_tiling_problem_finds_gaps_overlaps_and_strays() -> None:
    shape = (4, 6)
    quarters = [Box((r, c), (2, 3)) for r, c in itertools.product((0, 2), (0, 3))]
    assert tiling_problem(quarters, shape) is None
    assert "18 of 24" in tiling_problem(quarters[:3], shape)
    overlap = [*quarters[:3], Box((1, 3), (2, 3))]  # 24 elements, row 1 twice, row 3 never
    assert "overlap" in tiling_problem(overlap, shape)
    strays = [*quarters[:3], Box((2, 4), (2, 3))]
    assert "outside" in tiling_problem(strays, shape)
    assert tiling_problem([Box((), ())], ()) is None


@pytest.mark.parametrize(
    ("offsets", "sizes", "message"),
    [
        ((0,), (1, 2), "offsets and sizes must have one entry per dimension"),
        ((-1, 0), (1, 2), "must be >= 0"),
        ((0, 0), (1, -2), "must be >= 0"),
    ],
)
def test_box_refuses_bad_input_naming_it(
    offsets: tuple[int, ...], sizes: tuple[int, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Box(offsets, sizes)
