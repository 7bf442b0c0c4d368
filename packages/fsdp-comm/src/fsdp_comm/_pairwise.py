"""Pairwise-exchange all-gather and reduce-scatter over torch.distributed point-to-point calls.

Note [gloo algorithms]
    gloo's own all-gather and reduce-scatter are slow for large messages on one host. Measured
    here (2 cores, world size 2 and 4, median of 5 rounds, `scripts/gloo_algorithms.py`), every
    rank sending each peer the chunk that peer needs and receiving the chunks it needs, all at
    once with isend/irecv, beat gloo's native calls, one broadcast per rank, an all-reduce plus a
    slice and a ring from about 256 KiB up: at 16 MiB 2.2x the native all-gather and 1.9x the
    native reduce-scatter (world size 2), 1.5x and 2.9x (world size 4). It moves the minimum
    data ((n-1)/n of the buffer per rank) in one round, and the reduction is done locally in
    rank order, so results are bitwise identical on every rank and to the in-process backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["pairwise_all_gather", "pairwise_reduce_scatter"]


def pairwise_all_gather(
    out: torch.Tensor, inp: torch.Tensor, rank: int, global_ranks: Sequence[int], group: Any
) -> list[Any]:
    """Start the exchange; returns torch works. ``out`` holds the result once all complete."""
    chunks = out.chunk(len(global_ranks))
    chunks[rank].copy_(inp)
    works = []
    for peer, peer_global in enumerate(global_ranks):
        if peer != rank:
            works.append(dist.isend(chunks[rank], peer_global, group=group))
            works.append(dist.irecv(chunks[peer], peer_global, group=group))
    return works


def pairwise_reduce_scatter(
    out: torch.Tensor, inp: torch.Tensor, rank: int, global_ranks: Sequence[int], group: Any
) -> tuple[list[Any], list[torch.Tensor]]:
    """Start the exchange; returns torch works and, per rank, the chunk to reduce into ``out``."""
    chunks = inp.chunk(len(global_ranks))
    parts: list[torch.Tensor] = []
    works = []
    for peer, peer_global in enumerate(global_ranks):
        if peer == rank:
            parts.append(chunks[rank])
            continue
        received = torch.empty_like(out)
        works.append(dist.isend(chunks[peer], peer_global, group=group))
        works.append(dist.irecv(received, peer_global, group=group))
        parts.append(received)
    return works, parts
