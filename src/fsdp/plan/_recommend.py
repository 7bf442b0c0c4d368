"""`fsdp plan`'s recommendation: the configuration to run on a memory budget, and why.

Candidates go from cheapest in speed to leanest in memory: every strategy with the settings
asked for, then with activation checkpointing, then full sharding with checkpointing and CPU
offload. Among those that fit the GPU budget (and, with CPU offload, the nodes' host memory),
the fewest speed trade-offs win, then the least cross-node traffic, then the least traffic.
Without a budget nothing is recommended.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fsdp_engine import MeshShapeError, strategy_mesh_shape

from ._base import USABLE_FRACTION, format_bytes
from ._comm import CommVolume, comm
from ._memory import HostMemory, MemoryBreakdown, PlanConfig, host_memory, memory
from ._model import ModelShape

__all__ = ["Recommendation", "recommend"]

_PREFERENCE = ("no_shard", "hybrid_shard", "shard_grad_op", "full_shard")


@dataclass(frozen=True)
class Recommendation:
    """The configuration to run (see the module for the order of preference) and a sentence
    saying why; ``fits`` is False when nothing fits ``gpu_memory``, and None without a
    ``gpu_memory`` (then nothing is recommended: the configuration is the one asked for).
    ``host``: the host memory check of the CPU offload recommended, asked for, or refused for
    lack of host memory."""

    strategy: str
    activation_checkpointing: bool
    cpu_offload: bool
    fits: bool | None
    total_bytes: int
    cross_node_bytes: int
    text: str
    host: HostMemory | None = None


@dataclass(frozen=True)
class _Option:
    """One candidate, evaluated."""

    index: int
    config: PlanConfig
    memory: MemoryBreakdown
    comm: CommVolume
    host: HostMemory | None

    def fits_gpu(self, budget: int) -> bool:
        return self.memory.total <= USABLE_FRACTION * budget

    @property
    def fits_host(self) -> bool:
        return self.host is None or self.host.fits is not False


def _evaluate(model: ModelShape, index: int, config: PlanConfig) -> _Option:
    host = host_memory(model, config) if config.cpu_offload else None
    return _Option(index, config, memory(model, config), comm(model, config), host)


def _hybrid_differs(config: PlanConfig) -> bool:
    """Whether hybrid sharding lays out here with more than one replica (else it is full
    sharding, or impossible)."""
    try:
        shape = strategy_mesh_shape(
            "hybrid_shard",
            config.dp,
            shard_size=config.shard_size,
            gpus_per_node=max(1, config.gpus_per_node // config.tp),
        )
    except MeshShapeError:
        return False
    return shape.replicate > 1


def _candidates(config: PlanConfig) -> list[PlanConfig]:
    """What to try, cheapest in speed first: every strategy with the settings asked for, then
    with activation checkpointing, then full sharding with checkpointing and CPU offload (the
    paper's last memory lever; offloading a replicated model would need its whole state in
    host memory per GPU)."""
    hybrid = _hybrid_differs(config)
    strategies = [s for s in _PREFERENCE if s != "hybrid_shard" or hybrid]
    out = [
        _variant(config, s, config.activation_checkpointing, config.cpu_offload) for s in strategies
    ]
    if not config.activation_checkpointing:
        out += [_variant(config, s, True, config.cpu_offload) for s in strategies]
    if not config.cpu_offload:
        out.append(_variant(config, "full_shard", True, True))
    return out


def _variant(config: PlanConfig, strategy: str, checkpointing: bool, offload: bool) -> PlanConfig:
    shard = config.shard_size if strategy == "hybrid_shard" else None
    return replace(
        config,
        strategy=strategy,
        shard_size=shard,
        activation_checkpointing=checkpointing,
        cpu_offload=offload,
    )


def label(config: PlanConfig) -> str:
    """``"full_shard with activation checkpointing and CPU offload"``."""
    extras = [
        x
        for x, on in (
            ("activation checkpointing", config.activation_checkpointing),
            ("CPU offload", config.cpu_offload),
        )
        if on
    ]
    return config.strategy + (" with " + " and ".join(extras) if extras else "")


def recommend(model: ModelShape, config: PlanConfig) -> Recommendation:
    """The candidate to run: among those that fit ``gpu_memory`` and, with CPU offload, the
    host memory (without a budget: nothing), the fewest speed trade-offs first (activation
    checkpointing, then CPU offload), then the least cross-node traffic, then the least
    traffic."""
    budget = config.gpu_memory
    if budget is None:
        return _no_budget(model, config)
    options = [_evaluate(model, i, c) for i, c in enumerate(_candidates(config))]
    pool = [o for o in options if o.fits_gpu(budget) and o.fits_host]
    if not pool:
        refused = [o for o in options if o.fits_gpu(budget) and not o.fits_host]
        return _host_refused(config, refused[0]) if refused else _no_fit(model, config, options[-1])
    best = min(
        pool,
        key=lambda o: (_tradeoffs(o.config), o.comm.cross_node_bytes, o.comm.total_bytes, o.index),
    )
    c = best.config
    text = (
        f"{label(c)}: {format_bytes(best.memory.total)} per GPU (fits "
        f"{format_bytes(budget)}), {_traffic(c, best.comm)}"
        + (f"; host memory: {best.host.text()}" if best.host else "")
        + _versus(model, config, c)
    )
    return Recommendation(
        c.strategy,
        c.activation_checkpointing,
        c.cpu_offload,
        True,
        best.memory.total,
        best.comm.cross_node_bytes,
        text,
        best.host,
    )


def _no_budget(model: ModelShape, config: PlanConfig) -> Recommendation:
    """Without a memory budget nothing can be said to fit, so nothing is recommended."""
    option = _evaluate(model, 0, config)
    text = (
        f"none without a memory budget: pass --gpu-memory SIZE (80GB, say) to recommend "
        f"what fits; {label(config)} as asked needs {format_bytes(option.memory.total)} "
        "per GPU"
    )
    if not option.fits_host:
        assert option.host is not None
        text += f"; its CPU offload does not fit host memory: {option.host.text()}"
    return Recommendation(
        config.strategy,
        config.activation_checkpointing,
        config.cpu_offload,
        None,
        option.memory.total,
        option.comm.cross_node_bytes,
        text,
        option.host,
    )


def _traffic(config: PlanConfig, volume: CommVolume) -> str:
    if config.nodes == 1:
        return f"{format_bytes(volume.total_bytes)} per GPU per step inside the node"
    return f"{format_bytes(volume.cross_node_bytes)} per GPU per step across nodes"


def _tradeoffs(config: PlanConfig) -> int:
    return 2 * config.cpu_offload + config.activation_checkpointing


def _versus(model: ModelShape, asked: PlanConfig, chosen: PlanConfig) -> str:
    if label(asked) == label(chosen):
        return " (as asked)"
    mem = memory(model, asked)
    if asked.gpu_memory is not None and mem.total > USABLE_FRACTION * asked.gpu_memory:
        return f"; {label(asked)} needs {format_bytes(mem.total)} and does not fit"
    return f"; {label(asked)}: {format_bytes(mem.total)}, {_traffic(asked, comm(model, asked))}"


def _host_refused(config: PlanConfig, option: _Option) -> Recommendation:
    """Only CPU offload fits the GPUs, and the nodes' host memory cannot hold what it pins."""
    assert option.host is not None
    c = option.config
    text = (
        f"does not fit: {label(c)} would fit {format_bytes(config.gpu_memory or 0)} per "
        f"GPU ({format_bytes(option.memory.total)}) but its host memory does not: "
        f"{option.host.text()}; pass --host-memory SIZE if the nodes have more, or use "
        "more GPUs"
    )
    return Recommendation(
        c.strategy,
        c.activation_checkpointing,
        c.cpu_offload,
        False,
        option.memory.total,
        option.comm.cross_node_bytes,
        text,
        option.host,
    )


def _no_fit(model: ModelShape, config: PlanConfig, leanest: _Option) -> Recommendation:
    c = leanest.config
    need = _gpus_needed(model, c)
    more = f"; about {need} GPUs would fit it" if need else ""
    text = (
        f"does not fit {format_bytes(config.gpu_memory or 0)}: even {label(c)} needs "
        f"{format_bytes(leanest.memory.total)} per GPU (try a smaller micro-batch or more "
        f"GPUs{more})"
    )
    return Recommendation(
        c.strategy,
        c.activation_checkpointing,
        c.cpu_offload,
        False,
        leanest.memory.total,
        leanest.comm.cross_node_bytes,
        text,
        leanest.host,
    )


def _gpus_needed(model: ModelShape, config: PlanConfig) -> int | None:
    """The fewest GPUs (whole nodes, doubling) at which ``config`` fits, if any up to 2^16."""
    budget = USABLE_FRACTION * (config.gpu_memory or 0)
    gpus = config.gpus_per_node
    while gpus <= 2**16:
        if gpus % config.tp == 0 and memory(model, replace(config, gpus=gpus)).total <= budget:
            return gpus
        gpus *= 2
    return None
