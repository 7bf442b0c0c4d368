"""The ``threads`` backend: N ranks as threads of one process exchanging real data.

Exact results with no process start-up cost: the fast path for engine tests. Asynchronous
collectives run on a per-rank worker thread, so compute on the calling thread overlaps them.
The ranks share the process's global random generator: code that seeds and builds a model per
rank should do so under a lock or with explicit generators.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._backend import Backend
from ._errors import CommError
from ._reduce_op import ReduceOp
from ._serial_worker import SerialWorker
from ._settings import resolve_timeout
from ._thread_world import ThreadWorld
from ._work import CompletedWork, FutureWork, Work

__all__ = ["ThreadsBackend"]


class ThreadsBackend(Backend):
    """One rank of an in-process group; make a whole group with `ThreadsBackend.create`."""

    name = "threads"

    def __init__(
        self,
        world: ThreadWorld,
        rank: int,
        *,
        device: torch.device | str = "cpu",
        timeout: float | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        if not 0 <= rank < world.size:
            raise ValueError(f"rank must satisfy 0 <= rank < {world.size}, got {rank}")
        self._world = world
        self._rank = rank
        self._device = torch.device(device)
        self._seq = 0
        self._groups_made = 0
        self._worker: SerialWorker | None = None

    @classmethod
    def create(
        cls,
        world_size: int,
        *,
        device: torch.device | str = "cpu",
        timeout: float | None = None,
    ) -> list[ThreadsBackend]:
        """One backend per rank of a new in-process group; hand one to each thread."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        _settle_cuda_device_guard()
        world = ThreadWorld(world_size, tuple(range(world_size)))
        return [cls(world, r, device=device, timeout=timeout) for r in range(world_size)]

    @classmethod
    def from_options(cls, **options: Any) -> ThreadsBackend:
        """Registry factory: ``get_backend("threads")`` is a single-rank group.

        Pass ``world=`` and ``rank=`` to join an existing group (as `launch` does).
        """
        world = options.pop("world", None)
        rank = options.pop("rank", 0)
        if world is None:
            world = ThreadWorld(1, (0,))
        return cls(world, rank, **options)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._world.ranks

    @property
    def world(self) -> ThreadWorld:
        """The shared rendezvous of this group (`launch` aborts it when a rank fails)."""
        return self._world

    @property
    def capabilities(self) -> dict[str, str]:
        return {"all": "in-process copies; reductions summed in rank order on every rank"}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # ---- collectives -------------------------------------------------------------------------
    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work | None:
        def body(inputs: list[torch.Tensor]) -> Callable[[], None] | None:
            n = inp.numel()
            for r, t in enumerate(inputs):
                slot = out[r * n : (r + 1) * n]
                if t.data_ptr() != slot.data_ptr():  # an in-place input is there already
                    slot.copy_(t)
            return None

        return self._collective("all_gather_into_tensor", inp, body, async_op)

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None:
        n, r = out.numel(), self._rank

        def body(inputs: list[torch.Tensor]) -> Callable[[], None] | None:
            op.reduce([t[r * n : (r + 1) * n] for t in inputs], out)
            return None

        return self._collective("reduce_scatter_tensor", inp, body, async_op)

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work | None:
        def body(inputs: list[torch.Tensor]) -> Callable[[], object] | None:
            result = op.reduce(inputs, torch.empty_like(tensor))
            return lambda: tensor.copy_(result)  # others read `tensor` until every rank is done

        return self._collective("all_reduce", tensor, body, async_op)

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        def body(inputs: list[torch.Tensor]) -> Callable[[], None] | None:
            if self._rank != src:
                tensor.copy_(inputs[src])
            return None

        return self._collective("broadcast", tensor, body, async_op)

    def _barrier_impl(self) -> None:
        self._collective("barrier", None, lambda inputs: None, False)

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None:
        key = (self._groups_made, ranks)
        self._groups_made += 1
        sub = self._world.subworld(key, ranks)
        if self._rank not in ranks:
            return None
        return ThreadsBackend(
            sub, ranks.index(self._rank), device=self._device, timeout=self._timeout
        )

    # ---- machinery ---------------------------------------------------------------------------
    def _collective(
        self,
        name: str,
        payload: Any,
        body: Callable[[list[Any]], Callable[[], object] | None],
        async_op: bool,
    ) -> Work | None:
        seq = self._seq
        self._seq += 1
        timeout = resolve_timeout(self._timeout)

        def run() -> None:
            inputs = self._world.arrive(seq, self._rank, name, payload, timeout)
            try:
                after = body(inputs)
            finally:
                self._world.depart(seq, name, timeout)
            if after is not None:
                after()

        if async_op:
            return FutureWork(self._ensure_worker().submit(run), name)
        if self._worker is not None and not self._worker.idle():
            # Keep program order behind still-running async collectives.
            FutureWork(self._worker.submit(run), name).wait(timeout)
            return CompletedWork()
        try:
            run()
        except CommError:
            raise
        except Exception as exc:
            raise self._wrap_error(name, exc) from exc
        return CompletedWork()

    def _ensure_worker(self) -> SerialWorker:
        if self._worker is None:
            self._worker = SerialWorker(f"fsdp-comm-threads-rank{self.ranks[self._rank]}")
        return self._worker


def _settle_cuda_device_guard() -> None:
    """Note [CUDA device guard and rank threads]: on a CUDA build of torch where no GPU is
    usable, DTensor's sharding propagation enters FakeTensorMode, whose ``__enter__`` swaps the
    CUDA device guard for a no-op one (``torch._C._ensureCUDADeviceGuardSet``). That swap is not
    thread-safe: two rank threads doing it at once segfaulted in one test in two with torch
    2.11+cu130 on a CPU-only host. Doing it once here, before any rank thread starts, makes the
    later calls see the no-op guard already in place (48 of 48 engine parity tests then pass,
    twice). CPU builds and hosts with a GPU are unaffected: there the call changes nothing."""
    settle = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if (
        settle is not None
        and torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]  # unannotated in torch
        and not torch.cuda.is_available()
    ):
        settle()
