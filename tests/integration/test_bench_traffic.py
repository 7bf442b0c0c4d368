"""Upper bounds on what the engine adds to a step (`fsdp.bench.traffic`, issue #27): copy
bytes per parameter, copy ops, collectives and pool allocations of one bf16 step of the tiny
GPT, rank 0. Counted, not timed: the bounds do not depend on the machine's load. Today's
values are in the comments; a change that moves more bytes or issues more collectives fails
here and says by how much."""

from __future__ import annotations

import pytest

from fsdp.bench.traffic import count_traffic

pytestmark = pytest.mark.slow


def test_world_size_one_moves_no_collective_and_few_bytes() -> None:
    c = count_traffic("ours", world_size=1, model="tiny")
    assert c.collectives == 0 and c.point_to_point == 0, c  # FSDP2 issues none either
    assert c.copy_bytes_per_param <= 18.5, c  # 18.19 (FSDP2: 31.30)
    assert c.copy_ops <= 10 and c.pool_allocations <= 4, c


def test_world_size_two_bounds() -> None:
    c = count_traffic("ours", world_size=2, model="tiny")
    # 3 forward gathers, 1 backward re-gather (the last block stays: Note [last unit
    # stays]), 3 reduce-scatters (FSDP2: 8)
    assert c.collectives == 7 and c.point_to_point == 0, c
    assert c.copy_bytes_per_param <= 24.0, c  # 23.55 (FSDP2: 32.49)
    assert c.copy_ops <= 17 and c.pool_allocations <= 11, c


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="model must be one of"):
        count_traffic("ours", model="huge")
