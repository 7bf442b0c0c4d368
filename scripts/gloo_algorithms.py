"""Compare all-gather and reduce-scatter algorithms over raw gloo (Note [gloo algorithms]).

    python scripts/gloo_algorithms.py ag 2 0.25,1,4,16,64     # kind, world size, MiB list
    python scripts/gloo_algorithms.py rs 4 1,4,16,64 [rounds]

Prints the median time of each algorithm per size (rounds alternate between algorithms, so a
busy machine slows all alike), after checking that all of them give the same result. The
fastest one for large messages sets the ``torch`` backend's choice and thresholds.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from fsdp_comm import launch

warnings.simplefilter("ignore", FutureWarning)


def ag_native(out, inp, r, w):
    dist.all_gather_into_tensor(out, inp)


def ag_broadcast_per_rank(out, inp, r, w):
    chunks = out.chunk(w)
    chunks[r].copy_(inp)
    for i, c in enumerate(chunks):
        dist.broadcast(c, src=i)


def ag_ring(out, inp, r, w):
    chunks = out.chunk(w)
    chunks[r].copy_(inp)
    for step in range(w - 1):
        send_i, recv_i = (r - step) % w, (r - step - 1) % w
        ops = [
            dist.P2POp(dist.isend, chunks[send_i], (r + 1) % w),
            dist.P2POp(dist.irecv, chunks[recv_i], (r - 1) % w),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def ag_pairwise(out, inp, r, w):
    chunks = out.chunk(w)
    chunks[r].copy_(inp)
    works = []
    for p in range(w):
        if p != r:
            works += [dist.isend(chunks[r], p), dist.irecv(chunks[p], p)]
    for work in works:
        work.wait()


def rs_native(out, inp, r, w):
    dist.reduce_scatter_tensor(out, inp)


def rs_all_reduce_slice(out, inp, r, w):
    t = inp.clone()
    dist.all_reduce(t)
    out.copy_(t.chunk(w)[r])


def rs_ring(out, inp, r, w):
    chunks = inp.chunk(w)
    acc, buf = chunks[(r - 1) % w].clone(), torch.empty_like(out)
    for step in range(w - 1):
        ops = [dist.P2POp(dist.isend, acc, (r + 1) % w), dist.P2POp(dist.irecv, buf, (r - 1) % w)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        acc = buf + chunks[(r - 2 - step) % w]
    out.copy_(acc)


def rs_pairwise(out, inp, r, w):
    chunks = inp.chunk(w)
    received = {p: torch.empty_like(out) for p in range(w) if p != r}
    works = []
    for p in received:
        works += [dist.isend(chunks[p], p), dist.irecv(received[p], p)]
    for work in works:
        work.wait()
    parts = [chunks[r] if p == r else received[p] for p in range(w)]
    torch.stack(parts).sum(0, out=out)


ALGORITHMS = {
    "ag": [ag_native, ag_broadcast_per_rank, ag_ring, ag_pairwise],
    "rs": [rs_native, rs_all_reduce_slice, rs_ring, rs_pairwise],
}


def _timed(fn, args) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rank_main(be, kind: str, sizes: list[int], rounds: int) -> dict[int, dict[str, float]]:
    r, w = be.rank, be.world_size
    report = {}
    for nbytes in sizes:
        n = nbytes // 4 // w
        small, big = (
            torch.arange(n, dtype=torch.float32) + r,
            torch.arange(n * w, dtype=torch.float32) + r,
        )
        times: dict[str, list[float]] = {f.__name__: [] for f in ALGORITHMS[kind]}
        reference = None
        for _ in range(rounds):
            for f in ALGORITHMS[kind]:
                out = torch.empty(n * w if kind == "ag" else n)
                times[f.__name__].append(_timed(f, (out, small if kind == "ag" else big, r, w)))
                if reference is None:
                    reference = out.clone()
                assert torch.allclose(out, reference), f.__name__
        report[nbytes] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return report


if __name__ == "__main__":
    kind, world = sys.argv[1], int(sys.argv[2])
    mib = [int(float(s) * (1 << 20)) for s in sys.argv[3].split(",")]
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    for nbytes, row in launch(rank_main, world, args=(kind, mib, rounds), timeout=1800)[0].items():
        cells = "  ".join(f"{k}={v:.2f}ms" for k, v in row.items())
        print(f"{kind} world={world} {nbytes / 2**20:g}MiB  {cells}")
