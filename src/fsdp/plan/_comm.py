"""Communication of one step (the FSDP paper's Sections 3.2.1 and 3.2.2), for `fsdp plan`.

Full sharding all-gathers each unit in forward and again in backward and reduce-scatters its
gradient: about ``3M(W-1)/W`` bytes per GPU for a model of ``M`` bytes on ``W`` GPUs with ring
collectives, 1.5x DDP's ``2M(W-1)/W``. Hybrid sharding keeps those collectives inside a shard
group (a node of ``G`` GPUs) and all-reduces the gradient shards across the replicas, so only
``2(M/G)(R-1)/R = 2M(W-G)/(GW)`` bytes per GPU cross nodes (the paper writes ``2M(W-1)/(GW)``,
which bounds it from above).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ._base import dtype_bytes
from ._memory import PlanConfig, units
from ._model import ModelShape
from ._tp import tp_collectives

__all__ = ["Collective", "CommVolume", "comm"]


@dataclass(frozen=True)
class Collective:
    """One kind of collective in one step.

    ``buffer_bytes``: the full tensors it moves, summed over its calls (an all-gather's output,
    a reduce-scatter's input, an all-reduce's tensor). ``group_size``: ranks in its group;
    ``cross_node``: whether that group spans nodes (then, as in the paper's Section 3.2.2
    accounting, all its traffic counts as cross-node). ``dim``: the mesh dimension of its
    group: ``"shard"`` (FSDP's shard group), ``"replicate"`` (hybrid sharding's replicas) or
    ``"tp"`` (tensor parallelism, `fsdp.plan._tp`)."""

    name: str
    kind: str
    calls: int
    buffer_bytes: int
    group_size: int
    cross_node: bool
    dim: str = "shard"

    @property
    def input_bytes(self) -> int:
        """Bytes each rank hands the backend (as `fsdp_comm.FakeBackend.traffic` counts them):
        an all-gather's input is one shard of its output."""
        return (
            self.buffer_bytes // self.group_size if self.kind == "all_gather" else self.buffer_bytes
        )

    @property
    def sent_bytes(self) -> int:
        """Bytes each GPU sends with bandwidth-optimal ring algorithms: ``B(n-1)/n`` for an
        all-gather or reduce-scatter of ``B`` bytes over ``n`` ranks, twice that for an
        all-reduce (Section 3.2.1: full sharding moves 1.5x DDP's volume)."""
        n = self.group_size
        ring = self.buffer_bytes * (n - 1) // n
        return 2 * ring if self.kind == "all_reduce" else ring


@dataclass(frozen=True)
class CommVolume:
    """Communication of one step (one micro-batch, forward and backward) per GPU."""

    collectives: tuple[Collective, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def cross_node_bytes(self) -> int:
        return sum(c.sent_bytes for c in self.collectives if c.cross_node)

    @property
    def intra_node_bytes(self) -> int:
        return self.total_bytes - self.cross_node_bytes

    def dim_bytes(self, dim: str) -> int:
        """Bytes each GPU sends in the groups of one mesh dimension (`Collective.dim`)."""
        return sum(c.sent_bytes for c in self.collectives if c.dim == dim)

    def by_kind(self, kind: str) -> Collective | None:
        """The collectives of ``kind`` merged into one (calls and bytes added)."""
        found = [c for c in self.collectives if c.kind == kind]
        if not found:
            return None
        return replace(
            found[0],
            name=kind,
            calls=sum(c.calls for c in found),
            buffer_bytes=sum(c.buffer_bytes for c in found),
        )


def spans_nodes(config: PlanConfig, *, group: str) -> bool:
    """Whether a shard, replicate or world group spans nodes. Shard groups are consecutive
    ranks (``[0, S)``, ``[S, 2S)``, ...), so they stay inside a node when ``S`` divides ``G``;
    replicate groups take one rank per shard group, so they span nodes when ``W > G``."""
    g, w = config.gpus_per_node, config.gpus
    if w <= g:
        return False
    if group == "shard":  # with --tp, a shard group's ranks are tp apart
        s = config.shard_group * config.tp
        return not (s <= g and g % s == 0)
    return True


def comm(model: ModelShape, config: PlanConfig) -> CommVolume:
    """Collectives of one step (Sections 3.2.1 and 3.2.2).

    Every unit is all-gathered before its forward and, when resharded after forward (full and
    hybrid sharding, not SHARD_GRAD_OP and never the root), again before its backward; its
    gradient is reduce-scattered in ``reduce_dtype``; with replicas (hybrid, or no sharding
    where the whole gradient is all-reduced) the gradient shard is then all-reduced across
    them. With no sharding a unit is only cast, and no collective is issued for it (Note
    [in-place gather] in fsdp_engine). Full sharding: ``~3M(W-1)/W`` per GPU; no sharding:
    ``2M(W-1)/W``; hybrid with a node per shard group: ``3M(G-1)/G`` inside nodes and
    ``2M(W-G)/(GW)`` across them. With tensor parallelism these move each rank's tp pieces
    (`fsdp.plan._tp.per_rank`), and the tp group's collectives follow (`tp_collectives`)."""
    u = units(model, config)
    f, n_units = config.shard_group, u.n_blocks + 1
    gather, grad = dtype_bytes(config.gather_dtype), dtype_bytes(config.grad_dtype)
    shard_cross = spans_nodes(config, group="shard")
    out: list[Collective] = []
    if f > 1:
        out.append(
            Collective(
                "all-gather (forward)", "all_gather", n_units, u.total * gather, f, shard_cross
            )
        )
        if config.strategy != "shard_grad_op":
            out.append(
                Collective(
                    "all-gather (backward)",
                    "all_gather",
                    u.n_blocks,
                    u.n_blocks * u.block * gather,
                    f,
                    shard_cross,
                )
            )
    if f > 1:
        out.append(
            Collective("reduce-scatter", "reduce_scatter", n_units, u.total * grad, f, shard_cross)
        )
    if config.replicas > 1:
        out.append(
            Collective(
                "all-reduce (replicas)",
                "all_reduce",
                n_units,
                u.total // f * grad,
                config.replicas,
                spans_nodes(config, group="replicate"),
                "replicate",
            )
        )
    tokens = config.micro_batch * (config.seq_len or model.seq_len)
    return CommVolume((*out, *tp_collectives(model, config, tokens)))
