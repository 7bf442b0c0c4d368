"""`FaultTolerantReplicate`: a replicate dimension for hybrid sharding that survives the loss
of a replica group (a host) and takes it back without stopping the others.

Note [fault-tolerant replicas]
    Hybrid sharding keeps one complete sharded copy of the training state in every replica
    group, so losing a whole replica group loses no state. What stops training today is
    membership: torchrun's rendezvous re-forms the whole job when one node restarts, and a
    collective with a dead peer fails every rank. So here the replicate dimension is not part
    of torchrun's world:

    * Each replica group (a host) is its own world, started by its own torchrun, whose ranks
      are the shard group (``shard``: any fsdp_comm `Backend`). Replica groups meet only
      through a rendezvous store (a TCPStore at ``FSDP_FT_STORE``, hosted by replica group 0's
      rank 0). The store's host is what cannot be lost: when it dies, the others fail with
      a `CommError` naming it, and training restarts from the last checkpoint, as today. So
      is a shard group that loses one of its ranks while the others live: that shard of the
      state exists only there.
    * Every step begins with `start_step`: each replica group's leader (shard rank 0)
      registers for the next *round* and the first leader to propose fixes the round's
      quorum (compare-and-set in the store). A leader proposes once every member of the
      previous round has registered, has stopped its heartbeat (a counter each incarnation's
      leader bumps every 0.2 s; stale after ``heartbeat_timeout``), or ``timeout``
      (``FSDP_COMM_TIMEOUT``) has passed. The leader hands the decision (and later the vote's
      outcome) to its shard group through the store, where the others wait longer than the
      leader may wait on the other groups. The cross-replica collectives of that step run over
      the quorum only: rank ``s`` of each member group, in a torch process group (gloo on CPU,
      NCCL on CUDA) built on a prefix of the store. Groups are rebuilt (a new *epoch*) only
      when the members change or a member's last step failed.
    * `world_size` is the number of live replica groups and `rank` this group's position
      among them, so a caller that divides by shard x replicate (fsdp_engine's reduce-scatter
      pre-multiplies by 1 / (shard x replicate)) divides by the live replicas.
    * A cross-replica collective that fails (a peer died, or its link stalled past the
      timeout) is latched: the collective returns without raising, later ones of the step are
      skipped, and `commit` says False. The rule, stated in the docs: **a step is applied only
      when every member of its quorum saw every collective of the step succeed**. `commit`
      first agrees inside the shard group (max of the failure flags), then each leader votes
      in the store; one outcome (compare-and-set) for all: commit when all members voted yes
      in time, else drop. A dropped step is redone (same data, same step number) by the next
      quorum: the caller zeroes its gradients, skips the optimizer step and runs the step
      again. A partial reduction is never applied. Cross-replica collectives (and building
      their groups) time out after half the timeout: a rank blocked there keeps its shard
      peers waiting in their next shard collective, whose timeout is the whole of it.
    * Rejoin: a replica group that comes back (its processes restarted by torchrun, or a
      replacement host) registers as *fresh*. It never proposes a quorum while a member of
      the previous quorum is alive, nor does any group that was not a member of it or is
      behind its step (one cut off for a while whose processes lived on: a quorum of its own
      would roll the training back); the members admit it at their next step boundary.
      Heartbeats are per incarnation (a restart's beat does not keep its predecessor alive)
      and a failed beat is retried (a group back from a cut beats again). A member behind
      the newest step (or fresh) then receives the state from a member holding it, shard by
      shard (rank ``s`` from rank ``s``, same layout): the caller's ``state()`` (parameters,
      optimizer state, data position), the step count and the RNG state, as bytes, so
      afterwards both hold bitwise the same state. No checkpoint is read. The receiver loads
      it with ``load_state(state)``.
    * Metrics (`stats`) and ``fsdp.comm`` log records: quorum changes, steps dropped, the
      recovery time (the start of the first step that failed to the next committed step, so
      the time to notice the failure included) and the rejoin time
      (a fresh group's first `start_step` to its state loaded).

    Without this class nothing of it runs: `init_mesh` and the engine's hybrid sharding are
    unchanged.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ._backend import Backend
from ._errors import CommError, CommTimeoutError
from ._ft_state import recv_state, send_state
from ._mesh import Mesh
from ._quorum import Decision, Member, QuorumStore, connect_store
from ._reduce_op import ReduceKind, ReduceOp
from ._settings import resolve_timeout
from ._work import CompletedWork, Work

__all__ = ["FaultTolerantReplicate", "FaultToleranceStats"]

_log = logging.getLogger("fsdp.comm")


@dataclass
class FaultToleranceStats:
    """What the fault-tolerant replicate dimension did so far."""

    quorum_changes: int = 0
    steps_dropped: int = 0
    heals_received: int = 0
    heals_sent: int = 0
    recovery_s: list[float] = field(default_factory=list)
    rejoin_s: list[float] = field(default_factory=list)


class FaultTolerantReplicate(Backend):
    """The replicate dimension of hybrid sharding over replica groups that may die and come
    back (Note [fault-tolerant replicas]). Only `all_reduce` crosses replicas.

    Args:
        shard: this replica group's shard group (its own world).
        replica: this group's index, ``0 <= replica < replicas`` (default ``FSDP_FT_REPLICA``).
        replicas: how many replica groups there may be (default ``FSDP_FT_REPLICAS``).
        store: ``host:port`` of the rendezvous store (default ``FSDP_FT_STORE``); replica 0's
            shard rank 0 hosts it.
        state: returns this rank's training state to hand to a group that rejoins.
        load_state: loads what ``state`` returned on a live replica.
        timeout: seconds for the quorum, votes and collectives (``FSDP_COMM_TIMEOUT``).
        heartbeat_timeout: seconds without a heartbeat after which a replica group is taken
            for dead (default ``min(5, timeout / 2)``).

    Per step: `start_step`, forward and backward (the engine's all-reduces come here),
    then `commit`: True to take the optimizer step, False to zero the gradients and redo it.
    """

    name = "fault-tolerant"
    #: Read by fsdp_engine: keep this replicate dimension even while it has one member.
    fault_tolerant = True

    def __init__(
        self,
        shard: Backend,
        *,
        replica: int | None = None,
        replicas: int | None = None,
        store: str | None = None,
        state: Callable[[], Any] | None = None,
        load_state: Callable[[Any], None] | None = None,
        timeout: float | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        super().__init__(timeout=timeout)
        self.shard = shard
        self.replicas = _int_setting("replicas", replicas, "FSDP_FT_REPLICAS", low=1)
        self.replica = _int_setting("replica", replica, "FSDP_FT_REPLICA", low=0)
        if self.replica >= self.replicas:
            raise ValueError(
                f"replica must be < replicas ({self.replicas}), got replica={self.replica}"
            )
        address = store if store is not None else os.environ.get("FSDP_FT_STORE", "")
        if heartbeat_timeout is None:
            heartbeat_timeout = min(5.0, self._timeout / 2)
        self.heartbeat_timeout = resolve_timeout(heartbeat_timeout)
        self._state, self._load_state = state, load_state
        host_it = self.replica == 0 and shard.rank == 0
        self._store = connect_store(address, host_it=host_it, timeout=self._timeout)
        self._address = address
        # One token per incarnation, the same on every shard rank (the leader's).
        self._token = self._from_leader(uuid.uuid4().hex if shard.rank == 0 else "")
        self._handoffs = 0  # _through_store calls so far (the same count on every shard rank)
        self._closed = False
        self._quorum: QuorumStore | None = None
        if shard.rank == 0:
            self._quorum = QuorumStore(
                self._store,
                address,
                replicas=self.replicas,
                replica=self.replica,
                timeout=self._timeout,
                heartbeat_timeout=self.heartbeat_timeout,
                token=self._token,
            )
        self.step = 0  # committed steps
        self.stats = FaultToleranceStats()
        self.decision: Decision | None = None
        self._round = -1
        self._fresh = True
        self._failed = False  # a collective of this step failed
        self._rebuild = False  # ask the next quorum for new groups
        self._pg: dist.ProcessGroup | None = None
        self._epoch = -1
        self._index = 0
        self._size = 1
        self._failed_at: float | None = None
        self._started = time.monotonic()
        self._step_began = self._started  # the latest start_step: a failure's step began here

    # ---- identity ----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._index

    @property
    def world_size(self) -> int:
        return self._size

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def ranks(self) -> tuple[int, ...]:
        """The replica indices of the current quorum."""
        return tuple(m.replica for m in self.decision.members) if self.decision else (0,)

    def bind_state(
        self, state: Callable[[], Any] | None, load_state: Callable[[Any], None] | None
    ) -> None:
        """Set (or replace) ``state`` and ``load_state`` after construction: the model and
        optimizer are made after the mesh."""
        self._state, self._load_state = state, load_state

    def mesh(self) -> Mesh:
        """A 2-D `Mesh` for ``fully_shard``: this dimension over ``shard``."""
        return Mesh(
            world=self.shard,
            shard=self.shard,
            replicate=self,
            shape=(self.replicas, self.shard.world_size),
        )

    # ---- the step protocol -------------------------------------------------------------------
    def start_step(self) -> Decision:
        """Agree on this step's quorum, rebuild the replica groups if it changed, and hand the
        state to (or receive it from) a member that is behind. Collective over the shard
        group; retried with the next round while a member fails during it."""
        t0 = self._step_began = time.monotonic()
        while True:
            decision = self._next_decision()
            me = decision.index_of(self.replica, self._token)
            if me is None:  # late for this round: the next one admits us
                _log.info(
                    "replica %d not in quorum round %d; retrying", self.replica, decision.round
                )
                continue
            # Steady (the same epoch, no one to heal): every shard rank checks the same
            # decision alike and builds nothing, so no agreement is needed on how it went.
            steady = decision.epoch == self._epoch and not decision.healers()
            ok = True
            try:
                self._install(decision, me)
                healed = self._heal(decision, me)
            except Exception as exc:  # noqa: BLE001 - a peer died while we built or healed
                _log.warning(
                    "replica %d: quorum round %d broke (%s); retrying",
                    self.replica,
                    decision.round,
                    exc,
                )
                ok, healed = False, False
                self._latch()
            if (not ok) if steady else self._agree_flag(not ok):
                self._rebuild = True
                self._epoch = -1  # the group may be half-made: never reuse it
                continue
            break
        self.decision = decision
        self._failed = False
        if healed:
            elapsed = time.monotonic() - (self._started if self._fresh else t0)
            self.stats.rejoin_s.append(elapsed)
            _log.warning(
                "replica %d rejoined at step %d in %.3f s (state from a live replica)",
                self.replica,
                self.step,
                elapsed,
            )
        self._fresh = False
        return decision

    def commit(self) -> bool:
        """End of the step: True when every member of the quorum reduced every gradient (take
        the optimizer step), False when the step is dropped (zero the gradients, skip the
        optimizer step, call `start_step` and redo it). Collective over the shard group."""
        if self.decision is None:
            raise RuntimeError("commit() without start_step(): call start_step() first")
        failed = self._agree_flag(self._failed)
        ok = False
        if self._quorum is not None:
            ok = self._quorum.vote(self.decision.round, not failed, self.decision.members)
        # The vote waits up to the timeout for a member's: the others wait longer than that.
        ok = self._through_store("1" if ok else "0", 2 * self._timeout) == "1"
        if ok:
            self.step += 1
            if self._failed_at is not None:
                took = time.monotonic() - self._failed_at
                self.stats.recovery_s.append(took)
                _log.warning(
                    "replica %d recovered: step %d committed %.3f s after the failed step began",
                    self.replica,
                    self.step,
                    took,
                )
                self._failed_at = None
        else:
            self.stats.steps_dropped += 1
            self._rebuild = True
            if self._failed_at is None:
                self._failed_at = self._step_began
            _log.warning(
                "replica %d dropped step %d (quorum round %d, replicas %s): redone with the next "
                "quorum",
                self.replica,
                self.step,
                self.decision.round,
                list(self.ranks),
            )
        self._failed = False
        return ok

    def close(self) -> None:
        """Stop the heartbeat; the store's host waits (up to the timeout) for every rank of
        the last quorum's members to close first, so that none loses the store mid-call (its
        own shard peers included: they read their leader's word from the store)."""
        if self._closed:
            return
        self._closed = True
        if self._quorum is not None:
            self._quorum.close()
            self._quorum = None
        if self.decision is None:
            return
        # Counted per round: a group that fell out earlier and closes on its way out counts
        # under its own last round, not this one.
        key = f"ft/closed/{self.decision.round}"
        try:
            self._store.add(key, 1)
            if self.replica == 0 and self.shard.rank == 0:
                everyone = len(self.decision.members) * self.shard.world_size
                deadline = time.monotonic() + self._timeout
                while int(self._store.add(key, 0)) < everyone:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        except Exception:  # noqa: BLE001 - closing: the store may be gone already
            pass

    # ---- internals ---------------------------------------------------------------------------
    def _next_decision(self) -> Decision:
        text = ""
        if self._quorum is not None:
            q = self._quorum
            k = q.latest_round() if self._round < 0 else self._round
            me = Member(
                self.replica,
                self._token,
                self.step,
                self._fresh,
                self._rebuild,
                self.shard.world_size,
            )
            decision = q.decide(k, me)
            text = decision.to_json()
        # The leader may wait up to 10x the timeout to be admitted (a returning group): the
        # others wait on the store for longer than that, not in a broadcast that times out.
        decision = Decision.from_json(self._through_store(text, 11 * self._timeout))
        self._round = decision.round + 1
        return decision

    def _install(self, decision: Decision, me: int) -> None:
        """The replica process group of this quorum's epoch (rank ``s`` of each member)."""
        shards = {m.shards for m in decision.members}
        if shards != {self.shard.world_size}:
            raise CommError(
                f"replica groups of quorum round {decision.round} have different shard group "
                f"sizes {sorted(shards)}: every replica group must shard alike"
            )
        changed = decision.epoch != self._epoch
        self._index, self._size = me, len(decision.members)
        if not changed:
            return
        before = [m.replica for m in self.decision.members] if self.decision else []
        self.stats.quorum_changes += 1
        _log.warning(
            "replica %d: quorum round %d, epoch %d: replicas %s (were %s), step %d",
            self.replica,
            decision.round,
            decision.epoch,
            [m.replica for m in decision.members],
            before,
            decision.step,
        )
        self._pg = None
        self._epoch = -1
        if self._size > 1:
            prefix = f"ft/pg/{decision.epoch}/{self.shard.rank}"
            self._pg = _new_group(
                dist.PrefixStore(  # type: ignore[attr-defined]
                    prefix, self._store
                ),
                me,
                self._size,
                self,
            )
        self._epoch = decision.epoch
        self._rebuild = False

    def _heal(self, decision: Decision, me: int) -> bool:
        """Hand the state to the members that are behind; True when this group received it."""
        healers = decision.healers()
        if not healers:
            return False
        holders = [m for m in decision.members if m not in healers]
        mine = decision.members[me]
        index = {(m.replica, m.token): i for i, m in enumerate(decision.members)}
        assert self._pg is not None or not healers, "healing needs a replica group"
        for i, h in enumerate(healers):
            donor = holders[i % len(holders)]
            tag = 1000 + index[(h.replica, h.token)]
            if donor == mine:
                assert self._pg is not None
                t0 = time.monotonic()
                sent = send_state(
                    self._pg, index[(h.replica, h.token)], self._payload(), self.device, tag
                )
                self.stats.heals_sent += 1
                _log.warning(
                    "replica %d sent its state (%d bytes, step %d) to replica %d in %.3f s",
                    self.replica,
                    sent,
                    self.step,
                    h.replica,
                    time.monotonic() - t0,
                )
            elif h == mine:
                assert self._pg is not None
                got = recv_state(
                    self._pg, index[(donor.replica, donor.token)], self.device, tag, self._mesh_hint
                )
                self._apply(got)
                self.stats.heals_received += 1
                return True
        return False

    def _payload(self) -> dict[str, Any]:
        if self._state is None:
            raise ValueError(
                "a replica group rejoined but this FaultTolerantReplicate has no state=: pass "
                "state= and load_state= to hand over the training state"
            )
        out: dict[str, Any] = {
            "step": self.step,
            "rng": torch.get_rng_state(),
            "user": self._state(),
        }
        if torch.cuda.is_available() and self.device.type == "cuda":
            out["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return out

    def _apply(self, got: dict[str, Any]) -> None:
        if self._load_state is None:
            raise ValueError(
                "this replica group rejoined but has no load_state=: pass state= and "
                "load_state= to FaultTolerantReplicate"
            )
        self._load_state(got["user"])
        torch.set_rng_state(got["rng"].cpu())
        if "cuda_rng" in got:
            torch.cuda.set_rng_state(got["cuda_rng"].cpu(), self.device)
        self.step = int(got["step"])

    def _mesh_hint(self) -> Any:
        """The DeviceMesh of this rank's own DTensors, to rebuild the ones received."""
        from torch.distributed.tensor import DTensor

        found: list[Any] = []

        def walk(v: Any) -> None:
            if found:
                return
            if isinstance(v, DTensor):
                found.append(v.device_mesh)
            elif isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, (list, tuple)):
                for x in v:
                    walk(x)

        walk(self._state() if self._state is not None else None)
        if not found:
            raise CommError("received DTensors but this rank's state() holds none to place them")
        return found[0]

    def _latch(self) -> None:
        self._failed = True
        if self._failed_at is None:
            # From the step's start, not from the moment the failure was seen: a cut link is
            # seen only after a timeout, a dead peer at once, and recovery includes either.
            self._failed_at = self._step_began

    def _from_leader(self, text: str) -> str:
        """``text`` as the shard group's rank 0 has it."""
        if self.shard.world_size == 1:
            return text
        raw = text.encode()
        n = torch.tensor([len(raw)], dtype=torch.int64, device=self.shard.device)
        self.shard.broadcast(n, src=0)
        buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=self.shard.device)
        if self.shard.rank == 0 and raw:
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        if buf.numel():
            self.shard.broadcast(buf, src=0)
        return bytes(buf.cpu().tolist()).decode()

    def _through_store(self, text: str, wait_s: float) -> str:
        """``text`` as the shard group's rank 0 has it, handed over through the rendezvous
        store: the leader's quorum and vote wait on the other replica groups, at times longer
        than a collective's timeout, so the other shard ranks wait up to ``wait_s`` for the
        leader's word on the store. (In a broadcast they timed out while their leader still
        waited, legitimately, for a member's vote or to be admitted: found on the two hosts,
        2026-11-27.)"""
        if self.shard.world_size == 1:
            return text
        self._handoffs += 1
        key = f"ft/lead/{self._token}/{self._handoffs}"
        if self.shard.rank == 0:
            self._store.set(key, text)
            # Every rank has read a hand-off long before this one: a shard collective comes
            # between two hand-offs but for a round missed, and 16 missed in a row are not.
            if self._handoffs > 16:
                self._store.delete_key(f"ft/lead/{self._token}/{self._handoffs - 16}")
            return text
        try:
            self._store.wait([key], datetime.timedelta(seconds=wait_s))
            got = self._store.get(key)
        except Exception as exc:  # DistStoreError, DistNetworkError
            raise CommTimeoutError(
                f"replica {self.replica}: shard rank {self.shard.rank} had no word from its "
                f"leader (shard rank 0) through the store at {self._address} within "
                f"{wait_s:g} s: {exc}"
            ) from exc
        return bytes(got).decode()

    def _agree_flag(self, flag: bool) -> bool:
        """Across the shard group: any rank's flag."""
        if self.shard.world_size == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.shard.device)
        self.shard.all_reduce(t, op=ReduceOp.MAX)
        return bool(t.item())

    # ---- collectives -------------------------------------------------------------------------
    def _all_reduce_impl(self, tensor: torch.Tensor, op: ReduceOp, async_op: bool) -> Work | None:
        if self.decision is None:
            raise RuntimeError(
                "FaultTolerantReplicate.all_reduce outside a step: call start_step() first"
            )
        if op.kind is ReduceKind.PREMUL_SUM:
            assert op.factor is not None  # PREMUL_SUM has one
            tensor.mul_(op.factor)
        if self._failed or self._pg is None:
            return CompletedWork() if async_op else None
        kind = dist.ReduceOp.MAX if op.kind is ReduceKind.MAX else dist.ReduceOp.SUM
        opts = dist.AllreduceOptions()
        opts.reduceOp = kind  # type: ignore[assignment]
        try:
            self._pg.allreduce([tensor], opts).wait()
        except Exception as exc:  # noqa: BLE001 - latched: Note [fault-tolerant replicas]
            _log.warning(
                "replica %d: all_reduce over replicas %s failed at step %d: %s",
                self.replica,
                list(self.ranks),
                self.step,
                exc,
            )
            self._latch()
        else:
            if op.kind is ReduceKind.AVG:
                tensor.div_(self._size)
        return CompletedWork() if async_op else None

    def _unsupported(self, what: str) -> CommError:
        return CommError(
            f"{what} does not cross the fault-tolerant replicate dimension: only all_reduce"
        )

    def _all_gather_impl(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool) -> Work | None:
        raise self._unsupported("all_gather_into_tensor")

    def _reduce_scatter_impl(
        self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOp, async_op: bool
    ) -> Work | None:
        raise self._unsupported("reduce_scatter_tensor")

    def _broadcast_impl(self, tensor: torch.Tensor, src: int, async_op: bool) -> Work | None:
        raise self._unsupported("broadcast")

    def _barrier_impl(self) -> None:
        raise self._unsupported("barrier")

    def _new_group_impl(self, ranks: tuple[int, ...]) -> Backend | None:
        raise self._unsupported("new_group")


def _new_group(
    store: Any, rank: int, size: int, owner: FaultTolerantReplicate
) -> dist.ProcessGroup:
    # Half the timeout: a rank blocked in a cross-replica collective (or in building this
    # group) with a replica that is gone keeps its shard peers waiting in their next shard
    # collective, whose own timeout is the whole of it. With the whole timeout here too, a
    # peer whose cross-replica collective had succeeded timed out waiting for this rank
    # before it came back (a cut link on the two hosts, 2026-11-27).
    timeout = datetime.timedelta(seconds=owner.timeout / 2)
    if owner.device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)  # type: ignore[return-value]
    return dist.ProcessGroupGloo(store, rank, size, timeout)  # type: ignore[return-value]


def _int_setting(name: str, value: int | None, env: str, *, low: int) -> int:
    if value is None:
        raw = os.environ.get(env, "").strip()
        if not raw.isdigit():
            raise ValueError(f"{name} must be given or {env} set to an int >= {low}, got {raw!r}")
        value = int(raw)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value
