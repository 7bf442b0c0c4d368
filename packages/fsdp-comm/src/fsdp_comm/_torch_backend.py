"""The ``torch`` backend: a torch.distributed process group (gloo on CPU, NCCL on GPU).

Where gloo lacks a collective or runs it slowly, the backend picks a better algorithm and says
so in `TorchBackend.capabilities`: large all-gathers and reduce-scatters use a pairwise exchange
(Note [gloo algorithms] in ``_pairwise.py``), and the pre-multiplied sum, which gloo lacks, is
computed by the reduction itself or by scaling a copy (never the caller's input). On NCCL every
collective is the native one, pre-multiplied sums included.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist

from ._agreement import agree
from ._backend import Backend
from ._errors import BackendUnavailableError, CommError
from ._join import STARTING, join_from_environment
from ._nccl_watchdog import Watchdog
from ._pairwise import pairwise_all_gather, pairwise_reduce_scatter
from ._reduce_op import ReduceKind, ReduceOp
from ._shm_collectives import SharedMemoryCollectives, stores_are_ordered
from ._shm_gather import HostLayout, SharedMemoryGather, probe_host_layout
from ._torch_work import _TorchWork, call_watched, group_timeout, new_watchdog, stream_ordered_waits
from ._work import ChainedWork, CompletedWork, Work

__all__ = ["TorchBackend"]

_log = logging.getLogger("fsdp.comm")

# Newer torch names the tensor collectives *_single and warns on the old names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: Output bytes from which gloo all-gathers use the pairwise exchange (Note [gloo algorithms]).
DEFAULT_ALL_GATHER_PAIRWISE_MIN_BYTES = 256 << 10
#: Input bytes from which gloo reduce-scatters use the pairwise exchange.
DEFAULT_REDUCE_SCATTER_PAIRWISE_MIN_BYTES = 256 << 10
#: Output bytes from which gloo all-gathers between ranks of one host go through shared memory
#: (Note [shared-memory all-gather] in _shm_gather.py); None disables it.
DEFAULT_ALL_GATHER_SHM_MIN_BYTES = 4 << 20
#: Largest all-gather output through shared memory: every rank maps the whole segment, which
#: counts in each rank's resident memory, so larger gathers use the pairwise exchange.
ALL_GATHER_SHM_MAX_BYTES = 32 << 20
#: Input bytes from which gloo reduce-scatters between ranks of one host go through shared
#: memory (Note [shared-memory collectives without gloo] in _shm_collectives.py); None: never.
#: Its segment is mapped by every rank and counts in each rank's resident memory: alone it
#: pushed the meta-init test's backward growth (256 MiB model, 4 ranks) from 295 to 344 MiB
#: (limit 320); with the engine's layout copies staged into the segment (Note [staged
#: collectives] in _backend.py), which drop a rank-major buffer per collective, it is 289 MiB.
DEFAULT_REDUCE_SCATTER_SHM_MIN_BYTES: int | None = 4 << 20
#: Largest reduce-scatter input through shared memory (resident memory, as for all-gathers).
REDUCE_SCATTER_SHM_MAX_BYTES = 32 << 20


# Note [a gloo work's last reference]
# gloo runs a collective on its own worker thread, which still holds the work (and so its
# tensors) for a moment after the work is marked complete. When Python has already dropped a
# tensor of that work (a temporary waited for and forgotten), the worker's release is the
# tensor's last one and must take the GIL to free its Python object. During interpreter
# shutdown taking the GIL ends the thread by a forced unwind, and libstdc++ aborts the process
# ("terminate called without an active exception"): a rank that finished its work died at
# exit. Seen in about 1 of 2 runs of `tests/integration/test_train.py::test_under_torchrun`
# (`fsdp train` under torchrun, 2 ranks; a core dump showed gloo's runLoop destroying an
# AsyncAllreduceWork inside take_gil), from the barrier every rank runs before the group is
# torn down: its flag was a temporary. The barrier's flag is therefore the backend's own
# tensor, alive as long as the backend. That alone left 2 of 12 runs aborting, now from the
# checkpoint's closing agreement (an all-reduce of a temporary): any collective of a
# temporary can be the last. So the first gloo backend of a process also registers an exit
# handler that, before shutdown begins, releases the GIL for `_GLOO_DRAIN_S`: a worker that
# finished a collective needs only the GIL to drop what it holds, and does so then.
# Collectives still in flight at exit (a rank abandoning its peers) stay a risk.

#: Seconds the exit handler of Note [a gloo work's last reference] releases the GIL for.
_GLOO_DRAIN_S = 0.05


def _let_gloo_workers_finish() -> None:
    time.sleep(_GLOO_DRAIN_S)


@functools.cache
def _register_gloo_drain() -> None:
    atexit.register(_let_gloo_workers_finish)


# Note [stream-ordered waits]
# On an NCCL group torch's `work.wait(timeout)` blocks the host: ProcessGroupNCCL polls the
# collective's end in 1 ms sleeps until the GPU has finished it, so the CPU could never run
# ahead of the GPU (49 host-blocking waits per engine step at world size 2; issue #27).
# `work.wait()` with no timeout (TORCH_NCCL_BLOCKING_WAIT unset) is what FSDP2 uses: it makes
# the current CUDA stream wait on the collective's end event and returns at once. So on an
# NCCL group serving a CUDA device (`stream_ordered_waits`, decided once per backend),
# `Work.wait()` does only that, `wait_stream(s)` does it with `s` current, and synchronous
# calls are issued asynchronously and waited for so; a barrier still blocks the host. gloo and
# every other group keep the host wait with a timeout, as does NCCL with the blocking wait set.
#
# A wait that does not block cannot time out, so a daemon thread does it: the `Watchdog` of
# _nccl_watchdog.py (the cupy-nccl backend's), one per backend, whose "communicator" aborts
# the group and whose "event" is the torch work (_torch_work.py). A collective is watched from
# just before torch issues it (one stuck in NCCL's lazy connection set-up counts) until its
# work `is_completed()`. One still running after FSDP_COMM_TIMEOUT, or completed with an error
# (its result future says TIMEOUT or COMM_ERROR, or torch's wait raised), makes the watchdog
# record a `CommTimeoutError` or `CommError` naming the collective, this rank and the group's
# ranks (the peer at world size 2), then call `ProcessGroup.abort()`, which ends the group's
# NCCL kernels and calls blocked in NCCL. From then on every call and every wait of the backend
# raises that error at once, and `is_completed()` is True so that pollers (fsdp-memory's rate
# limiter) move on to the wait that raises.
#
# On a hang (a peer died or called another collective) the host runs ahead until something
# needs the GPU (the rate limiter, a `.item()`); after FSDP_COMM_TIMEOUT the abort ends the
# stuck kernels, that call returns, and the next collective or wait raises on every rank:
# `CommTimeoutError: all_gather_into_tensor on rank 0 of group ranks [0, 1] (with peer rank 1)
# did not complete within 300 s (FSDP_COMM_TIMEOUT): ... The NCCL process group was aborted;
# this backend cannot be used again.` ProcessGroupNCCL's own watchdog would tear the process
# down at torch's timeout of the group (TORCH_NCCL_ASYNC_ERROR_HANDLING), hiding that, so
# groups this backend creates get a torch timeout `NCCL_GROUP_TIMEOUT_GRACE_S` longer; a group
# passed in should have one longer than FSDP_COMM_TIMEOUT. The clock starts when the host
# issues a collective, so the timeout also covers how far the host runs ahead.
#
# Memory stays bounded while the host runs ahead: the engine takes a rate-limiter ticket per
# all-gather, freed only once the all-gather completed on the GPU, and finishes the oldest
# reductions once more than MAX_REDUCTIONS_IN_FLIGHT units have them in flight. A buffer freed
# after a stream-ordered wait is reused in stream order (on CUDA fsdp-memory's pool hands it
# out at once and makes the new owner's stream wait on its event), so running ahead reuses
# memory instead of allocating more. torch keeps a collective's tensors until its work is
# waited for or completes; the watchdog drops a completed work at the next call.


class TorchBackend(Backend):
    """Collectives of one torch.distributed process group.

    ``group=None`` uses the default group, initialising it from torchrun's environment
    (``env://``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) when needed, or as a
    one-rank group when none of those is set. The group's backend is NCCL for CUDA devices and
    gloo for CPU; ``process_group_backend="gloo"`` with a CUDA ``device`` runs several ranks on
    one GPU, which NCCL refuses (Note [gloo on CUDA]).
    """

    name = "torch"
    #: The first collective of this group that failed by itself (see `_TorchWork`).
    _failed_wait: CommError | None = None
    #: Watches the collectives of an NCCL group (Note [stream-ordered waits]); None elsewhere.
    _watchdog: Watchdog | None = None

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | str | None = None,
        timeout: float | None = None,
        all_gather_pairwise_min_bytes: int = DEFAULT_ALL_GATHER_PAIRWISE_MIN_BYTES,
        reduce_scatter_pairwise_min_bytes: int = DEFAULT_REDUCE_SCATTER_PAIRWISE_MIN_BYTES,
        all_gather_shm_min_bytes: int | None = DEFAULT_ALL_GATHER_SHM_MIN_BYTES,
        process_group_backend: str | None = None,
        reduce_scatter_shm_min_bytes: int | None = DEFAULT_REDUCE_SCATTER_SHM_MIN_BYTES,
    ) -> None:
        super().__init__(timeout=timeout)
        self._owns_default_group = False
        self._barrier_flag: torch.Tensor | None = None
        if process_group_backend not in (None, "gloo", "nccl"):
            raise ValueError(
                "process_group_backend must be None (NCCL for CUDA, gloo for CPU), "
                f"'gloo' or 'nccl', got {process_group_backend!r}"
            )
        # Launch facts still to agree on through the new group (under torchrun), else None.
        unchecked: dict[str, Any] | None = None
        if group is None and not dist.is_initialized():
            device, unchecked = _init_default_group(device, self._timeout, process_group_backend)
            self._owns_default_group = True
        if group is None:
            group = dist.group.WORLD
            # torch's WORLD is None only before the default group exists; it does by now.
            assert group is not None, "no default process group after initialising it"
        self._group = group
        self._device = _resolve_device(device, self._group)
        self._global_ranks = tuple(dist.get_process_group_ranks(self._group))
        self._rank = dist.get_rank(self._group)
        self._gloo = dist.get_backend(self._group) == "gloo" or self._device.type == "cpu"
        if "gloo" in str(dist.get_backend(self._group)):
            _register_gloo_drain()  # Note [a gloo work's last reference]
        # Note [gloo algorithms]: the pairwise exchange is for gloo's point-to-point; a
        # group without it (torch's in-process "threaded" test group) keeps the native calls.
        self._pairwise_ok = "gloo" in str(dist.get_backend(self._group))
        # Note [gloo on CUDA]: gloo runs only broadcast and all-reduce on CUDA tensors.
        self._gloo_cuda = self._gloo and self._device.type == "cuda" and self.world_size > 1
        self._ag_pairwise_min = _check_bytes(
            "all_gather_pairwise_min_bytes", all_gather_pairwise_min_bytes
        )
        self._rs_pairwise_min = _check_bytes(
            "reduce_scatter_pairwise_min_bytes", reduce_scatter_pairwise_min_bytes
        )
        self._ag_shm_min = (
            None
            if all_gather_shm_min_bytes is None
            else _check_bytes("all_gather_shm_min_bytes", all_gather_shm_min_bytes)
        )
        self._rs_shm_min = (
            None
            if reduce_scatter_shm_min_bytes is None
            else _check_bytes("reduce_scatter_shm_min_bytes", reduce_scatter_shm_min_bytes)
        )
        # None: not decided yet; False: off. Asynchronous collectives where stores are ordered
        # (Note [shared-memory collectives without gloo]), else the fenced synchronous gather.
        self._shm: SharedMemoryCollectives | SharedMemoryGather | Literal[False] | None = None
        self._shm_layout: HostLayout | None = None
        if stream_ordered_waits(self._group, self._device):  # Note [stream-ordered waits]
            self._watchdog = new_watchdog(
                self._group, self._timeout, self._rank, self._global_ranks
            )
            # Stops the thread when the backend is dropped unclosed (and at interpreter exit).
            self._stop_watchdog = weakref.finalize(self, self._watchdog.close)
        _log.debug(
            "torch.distributed group of %d ranks over %s on %s",
            self.world_size,
            dist.get_backend(self._group),
            self._device,
        )
        if unchecked is not None:  # Note [launch-time agreement] in _agreement.py
            agree(unchecked, what=STARTING, backend=self)

    @classmethod
    def from_options(cls, **options: Any) -> TorchBackend:
        return cls(**options)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._global_ranks)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def ranks(self) -> tuple[int, ...]:
        return self._global_ranks

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group behind this backend (for a DeviceMesh over it)."""
        return self._group

    @property
    def group(self) -> dist.ProcessGroup:
        """The underlying torch.distributed process group."""
        return self._group

    @property
    def shared_memory_layout(self) -> HostLayout | None:
        """Which ranks of the group share a shared-memory directory, once the first all-gather
        that could go through it has probed (Note [which ranks share memory]); None before."""
        return self._shm_layout

    @property
    def shared_memory_all_gathers(self) -> int:
        """How many all-gathers went through shared memory (0 when the path is off)."""
        if isinstance(self._shm, SharedMemoryCollectives):
            return self._shm.all_gather_calls
        return self._shm.calls if isinstance(self._shm, SharedMemoryGather) else 0

    @property
    def shared_memory_reduce_scatters(self) -> int:
        """How many reduce-scatters went through shared memory (0 when the path is off)."""
        if isinstance(self._shm, SharedMemoryCollectives):
            return self._shm.reduce_scatter_calls
        return 0

    @property
    def capabilities(self) -> dict[str, str]:
        if self._gloo_cuda:
            return {
                "all_gather_into_tensor": "gloo on CUDA: one broadcast per rank",
                "reduce_scatter_tensor": "gloo on CUDA: all-reduce, then this rank's slice",
                "premul_sum": "gloo lacks it: summing a scaled copy of the input",
            }
        if not self._gloo:
            return {
                "all_gather_into_tensor": "native",
                "reduce_scatter_tensor": "native",
                "premul_sum": "native (NCCL)",
                "waits": self._waits_capability(),
            }
        return {
            "all_gather_into_tensor": (
                f"gloo native below {self._ag_pairwise_min} output bytes; pairwise exchange "
                "(isend/irecv with every peer) from there, faster on gloo; through shared "
                f"memory from {self._ag_shm_min} to {ALL_GATHER_SHM_MAX_BYTES} bytes when "
                "every rank of the group shares its /dev/shm (probed once)"
            ),
            "reduce_scatter_tensor": (
                f"gloo native below {self._rs_pairwise_min} input bytes; pairwise exchange "
                "then a local reduction in rank order from there, faster on gloo; through "
                f"shared memory from {self._rs_shm_min} to {REDUCE_SCATTER_SHM_MAX_BYTES} "
                "input bytes when every rank shares its /dev/shm and the CPU orders stores"
            ),
            "premul_sum": (
                "gloo lacks it: done by the local reduction of the pairwise "
                "exchange, or by summing a scaled copy of the input"
            ),
        }

    def _waits_capability(self) -> str:
        if self._watchdog is None:
            return f"the host waits, {self._timeout:g} s at most"
        return (
            "stream-ordered: the current CUDA stream waits, the host does not; a watchdog "
            f"thread aborts the group after {self._timeout:g} s (FSDP_COMM_TIMEOUT)"
        )

    def close(self) -> None:
        if self._watchdog is not None:
            self._stop_watchdog()
        if self._owns_default_group and dist.is_initialized():
            self._owns_default_group = False
            try:
                dist.destroy_process_group()
            except Exception:
                if self._watchdog is None or self._watchdog.error is None:
                    raise  # an aborted group may not tear down cleanly; its error was raised

    # ---- collectives -------------------------------------------------------------------------
    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work | None:
        name = "all_gather_into_tensor"
        if self._gloo_cuda:
            return self._gloo_cuda_all_gather(out, inp, async_op)
        shm = self._shared_memory(_nbytes(out), self._ag_shm_min, ALL_GATHER_SHM_MAX_BYTES)
        if shm is not None:
            try:
                work = shm.all_gather(out, inp)  # None: synchronous, the copies are the work
                if work is not None and not async_op:
                    work.wait()
            except Exception as exc:
                raise self._wrap_error(name, exc) from exc
            return work or CompletedWork()
        if self._use_pairwise(_nbytes(out), self._ag_pairwise_min):
            try:
                works = pairwise_all_gather(out, inp, self._rank, self._global_ranks, self._group)
            except Exception as exc:
                raise self._wrap_error(name, exc) from exc
            return self._finish(name, works, None, async_op, peers=self._pairwise_peers())
        return self._call(name, _ALL_GATHER, out, inp, group=self._group, async_op=async_op)

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None:
        name = "reduce_scatter_tensor"
        if self._gloo_cuda:
            return self._gloo_cuda_reduce_scatter(out, inp, op, async_op)
        shm = self._shared_memory(_nbytes(inp), self._rs_shm_min, REDUCE_SCATTER_SHM_MAX_BYTES)
        if isinstance(shm, SharedMemoryCollectives):
            return self._shm_call(name, async_op, shm.reduce_scatter, out, inp, op)
        if self._use_pairwise(_nbytes(inp), self._rs_pairwise_min):
            try:
                works, parts = pairwise_reduce_scatter(
                    out, inp, self._rank, self._global_ranks, self._group
                )
            except Exception as exc:
                raise self._wrap_error(name, exc) from exc
            return self._finish(
                name, works, lambda: op.reduce(parts, out), async_op, peers=self._pairwise_peers()
            )
        torch_op, scaled = self._lower_op(op, inp)
        return self._call(
            name, _REDUCE_SCATTER, out, scaled, op=torch_op, group=self._group, async_op=async_op
        )

    def _stages_impl(self, collective: str, nbytes: int) -> bool:
        """The all-gathers and reduce-scatters that go through shared memory (Note [staged
        collectives] in _backend.py; the first such question probes the group)."""
        if self._gloo_cuda:
            return False
        if collective == "all_gather_into_tensor":
            shm = self._shared_memory(nbytes, self._ag_shm_min, ALL_GATHER_SHM_MAX_BYTES)
        else:
            shm = self._shared_memory(nbytes, self._rs_shm_min, REDUCE_SCATTER_SHM_MAX_BYTES)
        return isinstance(shm, SharedMemoryCollectives)

    def _all_gather_copy_out_impl(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_out: Callable[[torch.Tensor, torch.Tensor], object],
        async_op: bool,
    ) -> Work | None:
        if not self._stages_impl("all_gather_into_tensor", _nbytes(out)):
            return super()._all_gather_copy_out_impl(out, inp, copy_out, async_op)
        assert isinstance(self._shm, SharedMemoryCollectives)
        return self._shm_call(
            "all_gather_into_tensor", async_op, self._shm.all_gather, out, inp, copy_out=copy_out
        )

    def _reduce_scatter_copy_in_impl(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_in: Callable[[torch.Tensor, torch.Tensor], object],
        op: ReduceOp,
        async_op: bool,
    ) -> Work | None:
        if not self._stages_impl("reduce_scatter_tensor", _nbytes(inp)):
            return super()._reduce_scatter_copy_in_impl(out, inp, copy_in, op, async_op)
        assert isinstance(self._shm, SharedMemoryCollectives)
        return self._shm_call(
            "reduce_scatter_tensor",
            async_op,
            self._shm.reduce_scatter,
            out,
            inp,
            op,
            copy_in=copy_in,
        )

    def _shm_call(
        self, name: str, async_op: bool, fn: Callable[..., Work], *args: Any, **kwargs: Any
    ) -> Work:
        try:
            work = fn(*args, **kwargs)
            if not async_op:
                work.wait()
        except Exception as exc:
            raise self._wrap_error(name, exc) from exc
        return work

    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work | None:
        torch_op = self._torch_op(op)
        if op.kind is ReduceKind.PREMUL_SUM and self._gloo:
            assert op.factor is not None  # PREMUL_SUM always has one (__post_init__)
            tensor.mul_(op.factor)  # the caller's tensor is the output anyway
        return self._call(
            "all_reduce", dist.all_reduce, tensor, op=torch_op, group=self._group, async_op=async_op
        )

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        return self._call(
            "broadcast",
            dist.broadcast,
            tensor,
            src=self._global_ranks[src],
            group=self._group,
            async_op=async_op,
        )

    def _barrier_impl(self) -> None:
        # A barrier as a one-element all-reduce: gloo's and NCCL's own barrier take no timeout.
        # The flag is the backend's, never a temporary: Note [a gloo work's last reference].
        if self._barrier_flag is None:
            self._barrier_flag = torch.zeros(1, device=self._device)
        work = self._call(
            "barrier", dist.all_reduce, self._barrier_flag, group=self._group, async_op=True
        )
        if isinstance(work, _TorchWork):
            work.synchronize()  # the host waits, also on NCCL (Note [stream-ordered waits])
        elif work is not None:
            work.wait()

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None:
        global_ranks = [self._global_ranks[r] for r in ranks]
        nested = self._group is not dist.group.WORLD
        if nested and self._rank not in ranks:
            return None  # local synchronisation: only members take part
        if self._watchdog is not None:
            self._watchdog.refuse("new_group")
        try:
            group = dist.new_group(
                global_ranks,
                timeout=group_timeout(self._timeout, nccl=self._watchdog is not None),
                use_local_synchronization=nested,
            )
        except Exception as exc:
            raise self._wrap_error("new_group", exc) from exc
        if self._rank not in ranks:
            return None
        return TorchBackend(
            group,
            device=self._device,
            timeout=self._timeout,
            all_gather_pairwise_min_bytes=self._ag_pairwise_min,
            reduce_scatter_pairwise_min_bytes=self._rs_pairwise_min,
            all_gather_shm_min_bytes=self._ag_shm_min,
            reduce_scatter_shm_min_bytes=self._rs_shm_min,
        )

    # Note [gloo on CUDA]: several processes sharing one GPU (NCCL refuses two ranks on one
    # device) can still run collectives over gloo, which stages CUDA tensors through the host
    # but implements only broadcast and all-reduce for them. So an all-gather is one broadcast
    # per rank into its slice of the output, and a reduce-scatter is an all-reduce of a copy of
    # the input followed by a copy of this rank's slice. Slow, but asynchronous in the way NCCL
    # is (work.wait() orders the caller's stream), which is what tests on one GPU need.
    def _gloo_cuda_all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work:
        name = "all_gather_into_tensor"
        parts = out.view(-1).chunk(self.world_size)
        parts[self._rank].copy_(inp.view(-1))
        try:
            works = [
                dist.broadcast(part, src=src, group=self._group, async_op=True)
                for part, src in zip(parts, self._global_ranks)
            ]
        except Exception as exc:
            raise self._wrap_error(name, exc) from exc
        return self._finish(name, works, None, async_op)

    def _gloo_cuda_reduce_scatter(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work:
        name = "reduce_scatter_tensor"
        avg = op.kind is ReduceKind.AVG  # summed then divided: gloo's CUDA AVG is not assured
        torch_op, scaled = (dist.ReduceOp.SUM, inp) if avg else self._lower_op(op, inp)
        total = scaled.detach().clone().view(-1)
        try:
            work = dist.all_reduce(total, op=torch_op, group=self._group, async_op=True)
        except Exception as exc:
            raise self._wrap_error(name, exc) from exc
        mine = total.chunk(self.world_size)[self._rank]

        def finish() -> None:
            out.view(-1).copy_(mine)
            if avg:
                out.div_(self.world_size)

        return self._finish(name, [work], finish, async_op)

    # ---- helpers -----------------------------------------------------------------------------
    def _shared_memory(
        self, nbytes: int, min_bytes: int | None, max_bytes: int
    ) -> SharedMemoryCollectives | SharedMemoryGather | None:
        """The shared-memory path for a collective of ``nbytes``, deciding once
        (collectively) whether the group's ranks share a shared-memory directory (Note [which
        ranks share memory])."""
        if min_bytes is None or not self._use_pairwise(nbytes, min_bytes):
            return None
        if nbytes > max_bytes:
            return None
        if self._shm is None:
            try:
                layout = probe_host_layout(
                    self._group, self._rank, self._global_ranks, debug=self._debug
                )
                self._shm_layout = layout
                self._shm = self._new_shared_memory() if layout.shared else False
            except Exception as exc:
                raise self._wrap_error("shared-memory setup", exc) from exc
        return self._shm or None

    def _new_shared_memory(self) -> SharedMemoryCollectives | SharedMemoryGather:
        if stores_are_ordered():
            return SharedMemoryCollectives(
                self._group, self._rank, self.world_size, self._timeout, ranks=self._global_ranks
            )
        return SharedMemoryGather(self._group, self._rank, self.world_size)

    def _use_pairwise(self, nbytes: int, min_bytes: int) -> bool:
        return self._gloo and self._pairwise_ok and self.world_size > 1 and nbytes >= min_bytes

    def _torch_op(self, op: ReduceOp) -> Any:
        if op.kind is ReduceKind.SUM:
            return dist.ReduceOp.SUM
        if op.kind is ReduceKind.AVG:
            return dist.ReduceOp.AVG
        if op.kind is ReduceKind.MAX:
            return dist.ReduceOp.MAX
        if self._gloo:
            return dist.ReduceOp.SUM  # inputs are scaled by the caller of _torch_op
        assert op.factor is not None  # PREMUL_SUM always has one (__post_init__)
        # Private in torch.distributed (imported there, not exported), hence the ignore.
        return dist._make_nccl_premul_sum(op.factor)  # type: ignore[attr-defined]

    def _lower_op(self, op: ReduceOp, inp: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """The torch op to run and the input to send (a scaled copy for gloo premul sums)."""
        if op.kind is ReduceKind.PREMUL_SUM and self._gloo:
            assert op.factor is not None  # PREMUL_SUM always has one (__post_init__)
            return dist.ReduceOp.SUM, inp * op.factor
        return self._torch_op(op), inp

    def _call(
        self, collective: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> Work | None:
        if self._watchdog is not None:
            return call_watched(self, self._watchdog, collective, fn, *args, **kwargs)
        try:
            work = fn(*args, **kwargs)
        except Exception as exc:
            raise self._wrap_error(collective, exc) from exc
        if work is None:
            return CompletedWork()
        return _TorchWork(work, self, collective, self._peer())

    def _peer(self) -> str | None:
        """Between two ranks the peer is known; in larger groups the error names the group."""
        if self.world_size != 2:
            return None
        return f"with peer rank {self._global_ranks[1 - self._rank]}"

    def _pairwise_peers(self) -> list[str]:
        """What each work of `pairwise_all_gather`/`pairwise_reduce_scatter` waits for, in
        their order: a send to and a receive from every other rank."""
        return [
            label
            for peer, g in enumerate(self._global_ranks)
            if peer != self._rank
            for label in (f"send to peer rank {g}", f"receive from peer rank {g}")
        ]

    def _finish(
        self,
        collective: str,
        works: list[Any],
        finish: Callable[[], Any] | None,
        async_op: bool,
        peers: list[str] | None = None,
    ) -> Work:
        labels: list[str | None] = (
            list(peers) if peers is not None and len(peers) == len(works) else [None] * len(works)
        )
        wrapped = [_TorchWork(w, self, collective, labels[i]) for i, w in enumerate(works)]
        chained = ChainedWork(
            wrapped,
            collective,
            finish=finish,
            on_error=lambda exc: self._wrap_error(collective, exc),
        )
        if not async_op:
            chained.wait()
        return chained


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check_bytes(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (bytes), got {value!r}")
    return value


def _resolve_device(device: torch.device | str | None, group: dist.ProcessGroup) -> torch.device:
    if device is not None:
        return torch.device(device)
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _init_default_group(
    device: torch.device | str | None, timeout: float, pg_backend: str | None = None
) -> tuple[torch.device, dict[str, Any] | None]:
    """Initialise the default group from torchrun's environment, or as a world of one; with
    the launch facts the ranks still have to agree on through the group (None: agreed, or no
    peers)."""
    dev = (
        torch.device(device)
        if device is not None
        else (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    )
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"torch backend: device {dev} was asked for but torch.cuda.is_available() is "
                "False (a CPU build of torch, or no GPU/driver here)"
            )
        dev = torch.device("cuda", dev.index if dev.index is not None else _local_device())
        torch.cuda.set_device(dev)
    if pg_backend is None:
        pg_backend = "cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo"
    td = group_timeout(timeout, nccl=dev.type == "cuda" and "nccl" in pg_backend)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return dev, join_from_environment(pg_backend, dev, timeout, td)
    try:
        # Not re-exported in torch's stubs, hence the ignore.
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(pg_backend, store=store, rank=0, world_size=1, timeout=td)
    except Exception as exc:
        raise CommError(
            f"torch backend: initialising the default process group failed: {exc}"
        ) from exc
    return dev, None


def _local_device() -> int:
    """The CUDA device of this rank: ``LOCAL_RANK`` among the devices it sees, or device 0 when
    it sees exactly one (``srun --gpus-per-task=1``, or ``CUDA_VISIBLE_DEVICES`` set per task:
    each task's own GPU is its device 0)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return 0 if torch.cuda.device_count() == 1 else local_rank
