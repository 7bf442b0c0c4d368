"""`Backend`: the one interface every collective implementation follows.

Public methods validate their arguments (refusing a wrong output size before any communication),
run the optional cross-rank debug check, then call the backend's ``_impl`` method. Ranks given
to and returned by a backend are its own (group-local) ranks; ``ranks`` maps them to the ranks of
the world the backend was made from, for messages.

Note [staged collectives]
    A caller that keeps its data in another order than the collective's (fsdp_engine's
    parameter-major unsharded buffers against the rank-major order of an all-gather's output
    and a reduce-scatter's input) copies once to reorder. Where a backend moves the data
    through memory of its own (the torch backend's shared-memory path on gloo: every rank
    writes its input into a shared segment, and reads the result out of it), that copy can be
    the one the backend makes anyway: `all_gather_copy_out` hands the gathered data to the
    caller's ``copy_out(gathered, out)``, which writes it into ``out`` in the caller's order
    straight out of the segment, and `reduce_scatter_copy_in` has the caller's
    ``copy_in(inp, staging)`` write the rank-major input straight into the segment. That is
    one copy of every gathered unit and one of every gradient fewer per step, and no
    rank-major buffer of the caller's own. `stages` says which calls go that way; for the
    others, the default implementations gather into (or reduce from) a temporary buffer and
    copy, so both methods are correct on every backend, only not cheaper.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ._debug import check_across_ranks
from ._errors import CommError
from ._reduce_op import ReduceOp
from ._settings import debug_enabled, resolve_timeout
from ._work import ChainedWork, Work

__all__ = ["Backend"]


class Backend(ABC):
    """Collectives for one group of ranks (torch.distributed's names and argument order).

    Every collective takes contiguous tensors on ``device``. Synchronous calls return ``None``;
    with ``async_op=True`` they return a `Work`. Backends are context managers: leaving the
    block (or calling `close`) releases what the backend created.
    """

    #: Registry name of the backend ("torch", "threads", ...).
    name: str = "backend"

    def __init__(self, *, timeout: float | None = None) -> None:
        self._timeout = resolve_timeout(timeout)
        self._debug = debug_enabled()
        self._debug_seq = 0
        self._device_type: str | None = None  # cached: checked on every call

    # ---- identity ----------------------------------------------------------------------------
    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank within the backend's group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Device the collectives run on; tensors must live there."""

    @property
    def ranks(self) -> tuple[int, ...]:
        """Ranks of the group's members in the world they were created from."""
        return tuple(range(self.world_size))

    @property
    def timeout(self) -> float:
        """Seconds a blocking wait may last before `CommTimeoutError`."""
        return self._timeout

    @property
    def capabilities(self) -> Mapping[str, str]:
        """Which algorithm each collective uses here (for example a gloo fallback and why)."""
        return {}

    # ---- collectives -------------------------------------------------------------------------
    def all_gather_into_tensor(
        self, out: torch.Tensor, inp: torch.Tensor, *, async_op: bool = False
    ) -> Work | None:
        """Concatenate every rank's ``inp`` (equal sizes) into ``out`` in rank order.

        ``inp`` may be this rank's own slot of ``out`` (``out[rank * n:(rank + 1) * n]``):
        an in-place gather, as NCCL's; every backend takes it."""
        name = "all_gather_into_tensor"
        self._check_pair(name, out, inp)
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"{name}: out must hold world_size * inp.numel() = {self.world_size} * "
                f"{inp.numel()} = {inp.numel() * self.world_size} elements, got {out.numel()}"
            )
        self._maybe_debug_check(name, inp, out)
        return self._result(self._all_gather_impl(_flat(out), _flat(inp), async_op), async_op)

    def reduce_scatter_tensor(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce ``inp`` across ranks and keep this rank's equal chunk in ``out``."""
        name = "reduce_scatter_tensor"
        self._check_pair(name, out, inp)
        self._check_op(name, op)
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"{name}: inp must hold world_size * out.numel() = {self.world_size} * "
                f"{out.numel()} = {out.numel() * self.world_size} elements, got {inp.numel()}"
            )
        self._maybe_debug_check(name, inp, out, op=op)
        work = self._reduce_scatter_impl(_flat(out), _flat(inp), op, async_op)
        return self._result(work, async_op)

    def all_reduce(
        self, tensor: torch.Tensor, *, op: ReduceOp = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` across ranks in place."""
        name = "all_reduce"
        self._check_tensor(name, "tensor", tensor)
        self._check_op(name, op)
        self._maybe_debug_check(name, tensor, tensor, op=op)
        return self._result(self._all_reduce_impl(_flat(tensor), op, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, *, src: int, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` from rank ``src`` (a rank of this group) to every rank, in place."""
        name = "broadcast"
        self._check_tensor(name, "tensor", tensor)
        self._check_rank(name, "src", src)
        self._maybe_debug_check(name, tensor, tensor, src=src)
        return self._result(self._broadcast_impl(_flat(tensor), src, async_op), async_op)

    # ---- staged collectives (Note [staged collectives]) ---------------------------------------
    def stages(self, collective: str, nbytes: int) -> bool:
        """True when ``collective`` ("all_gather_into_tensor" or "reduce_scatter_tensor") of
        ``nbytes`` (the all-gather's output, the reduce-scatter's input) passes through a
        buffer of this backend's own, so that `all_gather_copy_out` and
        `reduce_scatter_copy_in` save a copy. Collective the first time (it may probe the
        group): every rank asks with the same arguments in the same order."""
        if collective not in ("all_gather_into_tensor", "reduce_scatter_tensor"):
            raise ValueError(
                "stages: collective must be 'all_gather_into_tensor' or "
                f"'reduce_scatter_tensor', got {collective!r}"
            )
        return self._stages_impl(collective, nbytes)

    def all_gather_copy_out(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_out: Callable[[torch.Tensor, torch.Tensor], object],
        *,
        async_op: bool = False,
    ) -> Work | None:
        """All-gather ``inp`` and write the result with ``copy_out(gathered, out)``, where
        ``gathered`` is what `all_gather_into_tensor` would write into ``out`` (every rank's
        ``inp`` in rank order, 1-D) and is valid only during the call: ``copy_out`` puts it
        in the caller's order in one copy (Note [staged collectives])."""
        name = "all_gather_into_tensor"
        self._check_pair(name, out, inp)
        _check_callable(name, "copy_out", copy_out)
        if out.numel() != inp.numel() * self.world_size:
            raise ValueError(
                f"{name}: out must hold world_size * inp.numel() = {self.world_size} * "
                f"{inp.numel()} = {inp.numel() * self.world_size} elements, got {out.numel()}"
            )
        self._maybe_debug_check(name, inp, out)
        work = self._all_gather_copy_out_impl(out, _flat(inp), copy_out, async_op)
        return self._result(work, async_op)

    def reduce_scatter_copy_in(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_in: Callable[[torch.Tensor, torch.Tensor], object],
        *,
        op: ReduceOp = ReduceOp.SUM,
        async_op: bool = False,
    ) -> Work | None:
        """Reduce-scatter the input ``copy_in(inp, staging)`` writes into ``staging`` (1-D,
        ``inp.numel()`` elements, what `reduce_scatter_tensor` takes as ``inp``): the caller's
        order becomes the collective's in one copy (Note [staged collectives]). ``inp`` is
        not used after the call returns."""
        name = "reduce_scatter_tensor"
        self._check_pair(name, out, inp)
        self._check_op(name, op)
        _check_callable(name, "copy_in", copy_in)
        if inp.numel() != out.numel() * self.world_size:
            raise ValueError(
                f"{name}: inp must hold world_size * out.numel() = {self.world_size} * "
                f"{out.numel()} = {out.numel() * self.world_size} elements, got {inp.numel()}"
            )
        self._maybe_debug_check(name, inp, out, op=op)
        work = self._reduce_scatter_copy_in_impl(_flat(out), inp, copy_in, op, async_op)
        return self._result(work, async_op)

    def barrier(self) -> None:
        """Block until every rank of the group has reached the barrier."""
        self._barrier_impl()

    def new_group(self, ranks: Sequence[int]) -> Backend | None:
        """Make a backend for a subset of this group's ranks.

        Collective: every rank of this group calls it with the same ``ranks`` in the same order.
        Returns ``None`` on ranks that are not members.
        """
        members = self._check_group_ranks(ranks)
        return self._new_group_impl(members)

    def close(self) -> None:  # noqa: B027 - optional hook: most backends own nothing
        """Release what this backend created (process groups, threads). Idempotent."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, ranks={list(self.ranks)})"
        )

    # ---- implementation hooks ----------------------------------------------------------------
    @abstractmethod
    def _all_gather_impl(
        self, out: torch.Tensor, inp: torch.Tensor, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def _all_reduce_impl(
        self, tensor: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None: ...

    @abstractmethod
    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None: ...

    @abstractmethod
    def _barrier_impl(self) -> None: ...

    @abstractmethod
    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None: ...

    def _stages_impl(self, collective: str, nbytes: int) -> bool:
        return False

    def _all_gather_copy_out_impl(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_out: Callable[[torch.Tensor, torch.Tensor], object],
        async_op: bool,
    ) -> Work | None:
        """Without a buffer of the backend's own: gather into a temporary one, then copy."""
        gathered = torch.empty(out.numel(), dtype=out.dtype, device=out.device)
        work = self._all_gather_impl(gathered, inp, True)
        assert work is not None
        chained = ChainedWork(
            [work], "all_gather_into_tensor", finish=lambda: copy_out(gathered, out)
        )
        if not async_op:
            chained.wait()
        return chained

    def _reduce_scatter_copy_in_impl(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        copy_in: Callable[[torch.Tensor, torch.Tensor], object],
        op: ReduceOp,
        async_op: bool,
    ) -> Work | None:
        staging = torch.empty(inp.numel(), dtype=inp.dtype, device=inp.device)
        copy_in(inp, staging)
        return self._reduce_scatter_impl(out, staging, op, async_op)

    # ---- helpers -----------------------------------------------------------------------------
    def _describe(self, collective: str) -> str:
        return f"{collective} on rank {self.rank} of group ranks {list(self.ranks)}"

    def _result(self, work: Work | None, async_op: bool) -> Work | None:
        if not async_op:
            return None
        if work is None:
            raise AssertionError(f"{type(self).__name__} returned no Work for an async call")
        return work

    def _check_tensor(self, collective: str, arg: str, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{collective}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if self._device_type is None:
            self._device_type = self.device.type
        if t.device.type != self._device_type:
            raise ValueError(
                f"{collective}: {arg} must be on this backend's device {self.device}, "
                f"got a tensor on {t.device}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{collective}: {arg} must be contiguous, got strides {t.stride()}")

    def _check_pair(self, collective: str, out: Any, inp: Any) -> None:
        self._check_tensor(collective, "out", out)
        self._check_tensor(collective, "inp", inp)
        if out.dtype != inp.dtype:
            raise TypeError(
                f"{collective}: out and inp must have the same dtype, got out={out.dtype} "
                f"inp={inp.dtype}"
            )

    def _check_op(self, collective: str, op: Any) -> None:
        if not isinstance(op, ReduceOp):
            raise TypeError(
                f"{collective}: op must be an fsdp_comm.ReduceOp (SUM, AVG, MAX or "
                f"ReduceOp.premul_sum(factor)), got {op!r}"
            )

    def _check_rank(self, collective: str, arg: str, rank: Any) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise TypeError(f"{collective}: {arg} must be an int rank, got {rank!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(
                f"{collective}: {arg} must be a rank of this group, 0 <= {arg} < "
                f"{self.world_size}, got {rank}"
            )

    def _check_group_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        members = tuple(ranks)
        if not members:
            raise ValueError("new_group: ranks must name at least one rank, got []")
        for r in members:
            self._check_rank("new_group", "ranks", r)
        if len(set(members)) != len(members) or list(members) != sorted(members):
            raise ValueError(f"new_group: ranks must be sorted and unique, got {list(members)}")
        return members

    def _maybe_debug_check(
        self,
        collective: str,
        inp: torch.Tensor,
        out: torch.Tensor,
        *,
        op: ReduceOp | None = None,
        src: int | None = None,
    ) -> None:
        if not self._debug or self.world_size == 1:
            return
        self._debug_seq += 1
        check_across_ranks(self, collective, self._debug_seq, inp, out, op=op, src=src)

    def _wrap_error(self, collective: str, exc: BaseException) -> CommError:
        """Turn a backend's own exception into a `CommError` naming the collective and ranks."""
        from ._errors import CommTimeoutError

        text = str(exc)
        lowered = text.lower()
        cls = CommTimeoutError if ("timed out" in lowered or "timeout" in lowered) else CommError
        return cls(f"{self._describe(collective)} failed: {text}")


def _check_callable(collective: str, arg: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"{collective}: {arg} must be a callable (source, destination), got {type(fn).__name__}"
        )


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view (the tensor itself when it already is one: this runs on every call)."""
    return t if t.dim() == 1 else t.view(-1)
