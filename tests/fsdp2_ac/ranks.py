"""Rank functions and models for the FSDP2 drop-in tests (activation checkpointing, compile,
meta-device init).

Every test runs twice through `IMPLS`: ``"torch"`` is `torch.distributed.fsdp.fully_shard`,
``"ours"`` is `fsdp_engine.fully_shard`, called the same way (``fully_shard(module,
mesh=mesh)``, each block then the root, ``mesh`` a torch `DeviceMesh`). The rank functions
are module-level so that `fsdp_comm.launch` can start them in forkserver process ranks (gloo,
default process group initialised); each returns plain, picklable values.
"""

from __future__ import annotations

import gc
import os
import resource
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

# The one place that marks "ours" as expected to fail: delete the mark when the drop-in lands.
IMPLS = [
    "torch",
    "ours",
]


def get_fully_shard(impl: str) -> Callable[..., Any]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    elif impl == "ours":
        from fsdp_engine import fully_shard
    else:
        raise ValueError(f"impl must be 'torch' or 'ours', got {impl!r}")
    return fully_shard


def _device_mesh(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


# ---- a small GPT with LayerNorms ------------------------------------------------------------
# Sizes that do not divide 2 or 4 (61, 3 * 20 + 1) so that shards are uneven.
D, HEADS, HIDDEN, VOCAB, SEQ, LAYERS, BATCH = 20, 2, 61, 61, 8, 2, 2
STEPS, LR = 3, 0.2

# Calls of Block._mlp (LayerNorm + MLP) in eager mode: a checkpointed MLP runs twice per
# step (forward and recomputation), so the AC tests can tell that checkpointing really ran.
MLP_CALLS = [0]


class Block(nn.Module):
    """Pre-LN transformer block; ``ckpt_mlp=True`` checkpoints LayerNorm + MLP inside forward
    (form c): the recomputation runs inside the block while its FSDP unit is unsharded."""

    def __init__(self, ckpt_mlp: bool = False) -> None:
        super().__init__()
        self.ckpt_mlp = ckpt_mlp
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            MLP_CALLS[0] += 1
        return self.fc2(F.gelu(self.fc1(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        if self.ckpt_mlp:
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)


class TinyLM(nn.Module):
    """``ckpt_blocks=True`` wraps each (sharded) block call in
    ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (form d)."""

    def __init__(self, ckpt_mlp: bool = False, ckpt_blocks: bool = False) -> None:
        super().__init__()
        self.ckpt_blocks = ckpt_blocks
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(ckpt_mlp) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.ckpt_blocks else block(x)
        return self.head(self.ln_f(x))


def build_model(**flags: bool) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(**flags)
    with torch.no_grad():  # LayerNorm affine parameters that are not the identity
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.1, 0.1)
    return model


def make_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s slice of the global batch of ``step`` (BATCH rows per rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=g)
    mine = data[rank * BATCH : (rank + 1) * BATCH]
    return mine[:, :-1], mine[:, 1:]


def train(
    model: nn.Module,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int = STEPS,
) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = batches(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameter values by their plain names (wrapper prefixes removed)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        for prefix in _WRAPPER_PREFIXES:
            name = name.replace(prefix, "")
        value = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = value.detach().clone()
    return out


def reference_run(world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model in one process on the whole global batch, no checkpointing, eager."""
    model = build_model()

    def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*[make_batch(i, r, world) for r in range(world)])
        return torch.cat(xs), torch.cat(ys)

    return train(model, batches), full_params(model)


def run_many(
    be: Any, fn_name: str, impl: str, variants: tuple[str, ...]
) -> dict[str, tuple[str, Any]]:
    """``fn_name``'s rank function (`ac_rank`, `compile_rank`) for each variant in turn in one
    launched group: a rank's start-up costs more than one short run on 2 cores. Each variant
    builds its own model (and compile_rank resets dynamo and its counters); returns
    ``{variant: ("ok", result) or ("err", traceback)}`` so a failing variant fails only its own
    test."""
    fn = {"ac_rank": ac_rank, "compile_rank": compile_rank}[fn_name]
    out: dict[str, tuple[str, Any]] = {}
    for variant in variants:
        try:
            out[variant] = ("ok", fn(be, impl, variant))
        except Exception:
            out[variant] = ("err", traceback.format_exc())
    return out


def launched_many(
    fn_name: str, impl: str, world: int, variants: tuple[str, ...], cache: dict[Any, Any]
) -> dict[str, list[tuple[str, Any]]]:
    """`run_many` launched once per ``(fn_name, impl, world, variants)`` (cached in ``cache``,
    a failed launch too); ``{variant: [each rank's ("ok"|"err", value)]}``."""
    from fsdp_comm import launch

    from ..forkserver_preload import warm_forkserver

    key = (fn_name, impl, world, variants)
    if key not in cache:
        try:
            warm_forkserver()
            per_rank = launch(
                run_many, world, backend="torch", args=(fn_name, impl, variants), timeout=300
            )
            cache[key] = ("ok", {v: [r[v] for r in per_rank] for v in variants})
        except Exception as exc:  # noqa: BLE001 - raised again for every reader
            cache[key] = ("err", exc)
    kind, value = cache[key]
    if kind == "err":
        raise value
    return value


def results_of(per_rank: list[tuple[str, Any]], what: str) -> list[Any]:
    """Each rank's result of one variant; a rank's error as this test's failure."""
    import pytest

    for rank, (kind, value) in enumerate(per_rank):
        if kind == "err":
            pytest.fail(f"{what} failed on rank {rank}:\n{value}")
    return [value for _, value in per_rank]


# ---- 1. activation checkpointing -----------------------------------------------------------
AC_FORMS = ("wrapper_before", "apply_after", "inner_checkpoint", "outer_checkpoint")


def ac_rank(be: Any, impl: str, form: str) -> dict[str, Any]:
    """Shard TinyLM with activation checkpointing in ``form`` and train STEPS steps.

    wrapper_before:   checkpoint_wrapper(block) for each block, then fully_shard (torchtitan).
    apply_after:      fully_shard, then apply_activation_checkpointing(model, check_fn=Block).
    inner_checkpoint: Block.forward checkpoints its LayerNorm + MLP (use_reentrant=False).
    outer_checkpoint: TinyLM.forward calls checkpoint(block, x) on each sharded block.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if form not in AC_FORMS:
        raise ValueError(f"form must be one of {AC_FORMS}, got {form!r}")
    torch.set_num_threads(1)
    fully_shard = get_fully_shard(impl)
    mesh = _device_mesh(be.world_size)
    model = build_model(ckpt_mlp=form == "inner_checkpoint", ckpt_blocks=form == "outer_checkpoint")
    if form == "wrapper_before":
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if form == "apply_after":
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block)
        )
    MLP_CALLS[0] = 0
    losses = train(model, lambda i: make_batch(i, be.rank, be.world_size))
    params = full_params(model)  # a collective: every rank gathers
    return {
        "losses": losses,
        "mlp_calls": MLP_CALLS[0],
        "params": params if be.rank == 0 else None,
        "block_types": [type(b).__name__ for b in model.blocks],
    }


# ---- 2. torch.compile -----------------------------------------------------------------------
# (No "torch" in these names: `pytest -k torch` selects the torch cases by their ids.)
COMPILE_MODES = ("aot_eager-method", "aot_eager-assigned", "inductor-method")


def compile_rank(be: Any, impl: str, mode: str) -> dict[str, Any]:
    """Compile each block before fully_shard, then train STEPS steps.

    aot_eager-method:   block.compile(backend="aot_eager") (in place).
    aot_eager-assigned: model.blocks[i] = torch.compile(block, backend="aot_eager").
    inductor-method:    block.compile(backend="inductor").
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
    torch.set_num_threads(1)
    backend, how = mode.split("-")
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1  # no worker pool on a 2-core machine
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # this mode's stats only (see run_many)
    fully_shard = get_fully_shard(impl)
    mesh = _device_mesh(be.world_size)
    model = build_model()
    for i, block in enumerate(model.blocks):
        if how == "assigned":
            model.blocks[i] = torch.compile(block, backend=backend)
        else:
            block.compile(backend=backend)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = train(model, lambda i: make_batch(i, be.rank, be.world_size))
    params = full_params(model)
    counters = dict(torch._dynamo.utils.counters["stats"])
    return {
        "losses": losses,
        "params": params if be.rank == 0 else None,
        "dynamo_stats": counters,
        "graph_breaks": {
            str(k)[:300]: v for k, v in torch._dynamo.utils.counters["graph_break"].items()
        },
    }


# ---- 3. meta-device init, memory ------------------------------------------------------------
META_LAYERS, META_WIDTH, META_BATCH = 16, 2048, 4
META_MODEL_BYTES = META_LAYERS * (META_WIDTH * META_WIDTH + META_WIDTH) * 4  # ~256 MiB fp32


class LinearStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(META_WIDTH, META_WIDTH) for _ in range(META_LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_hwm() -> None:
    """VmHWM := current RSS (ranks are forked and inherit the parent's high-water mark)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at its 128 KiB default so that every freed tensor of 128 KiB
    or more goes back to the OS at once. By default glibc raises the threshold to the size of
    the last freed mmapped block (up to 32 MiB), after which freed 16 MiB buffers stay in the
    heap: RSS then measures the allocator's retention (about 1 GiB per rank here for torch
    FSDP2's forward + backward), not the memory the engine holds. False where not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 128 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _init_fn(m: nn.Module) -> None:
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()


def meta_rank(be: Any, impl: str, flow: str) -> dict[str, Any]:
    """Build LinearStack on meta, shard and materialise it, run one forward + backward.

    fsdp2:         fully_shard on meta, model.to_empty(device="cpu"), reset_parameters() on the
                   sharded (DTensor) parameters under no_grad.
    param_init_fn: fully_shard(block, mesh=mesh, param_init_fn=...) materialises and shards
                   each unit in turn (the FSDP paper's deferred init).
    Returns bytes: RSS before building and the VmHWM growth after init, after the forward
    and after the backward (with glibc's mmap threshold fixed, see `_fix_mmap_threshold`).
    """
    from torch.distributed.tensor import DTensor

    if flow not in ("fsdp2", "param_init_fn"):
        raise ValueError(f"flow must be 'fsdp2' or 'param_init_fn', got {flow!r}")
    torch.set_num_threads(1)
    mmap_fixed = _fix_mmap_threshold()
    fully_shard = get_fully_shard(impl)
    mesh = _device_mesh(be.world_size)
    # Warm up what a first collective and a first autograd step allocate, outside the window.
    t = torch.ones(8, requires_grad=True)
    dist.all_reduce(t.detach().clone())
    (t * 2).sum().backward()
    x = torch.randn(META_BATCH, META_WIDTH, generator=torch.Generator().manual_seed(be.rank))
    del t
    gc.collect()

    _reset_hwm()
    before = _current_rss()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LinearStack()
    if flow == "fsdp2":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
    else:
        for block in model.blocks:
            fully_shard(block, mesh=mesh, param_init_fn=_init_fn)
        fully_shard(model, mesh=mesh, param_init_fn=_init_fn)
    init_growth = _hwm() - before

    params = list(model.named_parameters())
    not_real = [
        n for n, p in params if p.is_meta or (isinstance(p, DTensor) and p.to_local().is_meta)
    ]
    local_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
        for _, p in params
    )
    loss = model(x).square().mean()
    forward_growth = _hwm() - before
    loss.backward()
    step_growth = _hwm() - before
    grads_ok = all(p.grad is not None for _, p in params)
    # Whether every rank drew the same values for its shard of the first weight (FSDP2's flow
    # on a CPU mesh: DTensor has no RNG tracker there, so each rank's uniform_ starts from the
    # same seed). Reported, not asserted.
    w = model.blocks[0].weight
    w = (w.to_local() if isinstance(w, DTensor) else w).detach().contiguous()
    shards = [torch.empty_like(w) for _ in range(be.world_size)]
    dist.all_gather(shards, w)
    return {
        "before": before,
        "init_growth": init_growth,
        "forward_growth": forward_growth,
        "step_growth": step_growth,
        "mmap_fixed": mmap_fixed,
        "identical_shards": all(torch.equal(shards[0], s) for s in shards[1:]),
        "loss": loss.item(),
        "not_real": not_real,
        "grads_ok": grads_ok,
        "num_params": len(params),
        "dtensor": all(isinstance(p, DTensor) for _, p in params),
        "global_shapes": sorted({tuple(p.shape) for _, p in params}),
        "local_bytes": local_bytes,
        "pid": os.getpid(),
    }
