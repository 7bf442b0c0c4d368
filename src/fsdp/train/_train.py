"""``fsdp train``: a GPT or Llama trained with FSDP on local ranks, under torchrun, or under
Slurm, optionally with tensor parallelism (``--tp``: `fsdp.models._tp_plan`).

`TrainConfig` holds every setting; `train_rank` is what each rank runs; `run_training` starts
the ranks (or joins torchrun's/Slurm's) and returns rank 0's `TrainSummary`.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import threading
import time
import types
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from fsdp_engine import STRATEGY_NAMES, MeshShapeError, strategy_mesh_shape

from ..models import GPT, LLAMA_SIZES, MODEL_SIZES, GPTConfig, Llama, LlamaConfig, init_gpt_module
from ._data import ByteCorpus
from ._metrics import metrics_problem
from ._mfu import ModelShape, flops_per_token, model_shape
from ._profile import PROFILE_WARMUP, TrainProfiling, profiled_window
from ._reporter import StepReporter
from ._tp import resume_tp_problem, tp_problem, train_meshes

__all__ = [
    "TrainConfig",
    "TrainSummary",
    "train_rank",
    "run_training",
    "STRATEGIES",
    "TRAIN_MODELS",
    "tp_problem",
    "COMPILE_BACKENDS",
    "inductor_problem",
    "launcher_world_size",
    "launcher_problem",
    "local_device_problem",
    "world_problem",
    "resume_problem",
    "profiled_window",
    "PROFILE_WARMUP",
]

STRATEGIES = STRATEGY_NAMES  # the engine's names (fsdp_engine.ShardingStrategy)
#: ``--compile`` backends (``torch.compile(backend=...)``); a bare ``--compile`` is the first.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
#: ``--model`` names: the GPT sizes, and the Llama sizes as ``llama-NAME``.
TRAIN_MODELS: dict[str, GPTConfig | LlamaConfig] = {
    **MODEL_SIZES,
    **{f"llama-{name}": c for name, c in LLAMA_SIZES.items()},
}
_BUILD_LOCK = threading.Lock()
_log = logging.getLogger("fsdp")


@dataclass(frozen=True)
class TrainConfig:
    model: str = "small"
    world_size: int = 2
    backend: str = "torch"
    strategy: str = "full_shard"
    shard_size: int | None = None  # hybrid: ranks per shard group (default: half the world)
    reshard_after_forward: bool | int | None = None  # None: the engine's default
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    prefetch: bool = True
    grad_accum: int = 1
    clip: float | None = 1.0
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    meta_init: bool = False
    steps: int = 60
    global_batch: int = 8
    lr: float = 3e-3
    seed: int = 0
    data: str | None = None
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    metrics: str | None = None
    threads_per_rank: int | None = None
    progress: bool = True
    hf_config: str | None = None  # a transformers model instead of the built-in GPT (_hf.py)
    hf_pretrained: str | None = None  # a save_pretrained directory (_hf_pretrained.py)
    seq_len: int | None = None  # default: the model's (128 at most for --hf-config)
    host_mmap_threshold: int = 0  # Note [host heap] in fsdp_memory; 0: glibc's own
    compile: str | None = None  # a COMPILE_BACKENDS name: each block compiled before sharding
    tensorboard: str | None = None  # a directory for TensorBoard scalars (needs fsdp[tb])
    peak_tflops: float | None = None  # per device, for MFU; default: a known GPU's
    log_every: int = 10  # steps per plain progress line (stdout not a terminal)
    profile: str | None = None  # a directory for per-rank traces and the step timeline
    profile_steps: int = 3  # steps profiled, after up to PROFILE_WARMUP warm-up steps
    tp: int = 1  # ranks per tensor-parallel group (fsdp.models._tp_plan); dp = world_size / tp
    sequence_parallel: bool = True  # with tp > 1: norms and residuals cut along the sequence
    fault_tolerant: bool = False  # issue #31: replicas that survive a host (_fault_tolerant.py)

    def __post_init__(self) -> None:
        peak = self.peak_tflops
        if peak is not None and (
            isinstance(peak, bool)
            or not isinstance(peak, (int, float))
            or not (math.isfinite(peak) and peak > 0)
        ):
            raise ValueError(
                f"--peak-tflops must be a finite number > 0 (TFLOP/s per device), got {peak!r}"
            )
        every = self.log_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"--log-every must be an integer >= 1, got {every!r}")
        n = self.profile_steps
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"--profile-steps must be an integer >= 1, got {n!r}")

    def model_config(self) -> GPTConfig | LlamaConfig:
        """The built-in model's configuration (`TRAIN_MODELS`)."""
        return TRAIN_MODELS[self.model]

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: the world divided by the tensor-parallel size."""
        return self.world_size // self.tp

    def model_description(self) -> dict[str, Any]:
        """What a checkpoint records about the model, to refuse resuming a different one."""
        if self.hf_config is not None:
            return {"hf_config": self.hf_config}
        if self.hf_pretrained is not None:
            return {"hf_pretrained": self.hf_pretrained}
        return asdict(self.model_config())

    def sequence_length(self, max_positions: int | None = None) -> int:
        if self.seq_len is not None:
            return self.seq_len
        if self.hf_config is not None or self.hf_pretrained is not None:
            return min(128, max_positions or 128)
        return self.model_config().seq_len


@dataclass
class TrainSummary:
    steps: int
    start_step: int
    losses: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    peak_rss_mib: list[float] = field(default_factory=list)
    params: int = 0
    checkpoint: str | None = None
    mean_step_time_s: float = 0.0
    mfu: float | None = None  # 0..1, over tokens_per_s; None without a known peak
    mfu_basis: str = ""  # the peak used, or why MFU is unknown
    flops_per_token: float = 0.0  # training FLOPs per token (see fsdp.train._mfu.flops_per_token)
    cuda_max_memory_allocated_bytes: list[int] | None = None  # per rank; CUDA only
    timeline: Any = None  # --profile: rank 0's fsdp_engine.TimelineSummary


def _dtype(name: str | None) -> torch.dtype | None:
    return (
        None
        if name is None
        else {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]
    )


def _mesh(backend: Any, cfg: TrainConfig) -> Any:
    """The engine's mesh shape for the strategy (hybrid: ``--shard-size``, default half the
    world); 2-D for no_shard and hybrid_shard, the 1-D world otherwise."""
    from fsdp_comm import init_mesh

    shape = strategy_mesh_shape(cfg.strategy, backend.world_size, shard_size=cfg.shard_size)
    if cfg.strategy in ("no_shard", "hybrid_shard"):
        return init_mesh(shape, backend=backend)
    return backend


def _reshard_problem(cfg: TrainConfig, world_size: int) -> str | None:
    rf = cfg.reshard_after_forward
    if rf is None or isinstance(rf, bool):
        return None
    if cfg.strategy == "shard_grad_op":
        return (
            f"--reshard-after-forward {rf}: shard_grad_op never reshards after forward; "
            "a group size needs full_shard or hybrid_shard"
        )
    if rf < 1:  # the CLI takes only >= 2 (0 and 1 read as booleans); the engine takes 1
        return f"--reshard-after-forward: a group size must be >= 1, got {rf}"
    shard = strategy_mesh_shape(cfg.strategy, world_size, shard_size=cfg.shard_size).shard
    if shard % rf:
        return (
            f"--reshard-after-forward {rf} must divide the shard group size {shard} "
            f"({cfg.strategy} at world size {world_size})"
        )
    return None


def world_problem(cfg: TrainConfig, world_size: int, world: str) -> str | None:
    """Why ``cfg`` cannot run on ``world_size`` ranks, or None. ``world`` names where the size
    comes from in the message (``--world-size 3``, ``the launcher's world size 16``). With
    ``--tp N`` the batch and the strategy are laid out over the ``world_size / N``
    data-parallel ranks."""
    problem = tp_problem(cfg, world_size, world)
    if problem is not None:
        return problem
    if cfg.tp > 1:
        world_size //= cfg.tp
        world = f"the data-parallel size {world_size} ({world} / --tp {cfg.tp})"
    if cfg.global_batch % world_size:
        return (
            f"--global-batch {cfg.global_batch} must be divisible by {world} (each "
            f"{'data-parallel group' if cfg.tp > 1 else 'rank'} takes an equal share)"
        )
    if cfg.shard_size is not None and (cfg.shard_size < 1 or world_size % cfg.shard_size):
        return f"--shard-size {cfg.shard_size} must divide {world}"
    try:
        strategy_mesh_shape(cfg.strategy, world_size, shard_size=cfg.shard_size)
    except MeshShapeError as exc:
        return f"--strategy {cfg.strategy} on {world}: {exc.message}"
    return _reshard_problem(cfg, world_size)


def launcher_world_size(environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The world size torchrun or Slurm set, as (variable, text), or None outside them.

    Mirrors `_join_scheduler_environment`: torchrun's ``WORLD_SIZE`` (with ``RANK``), or under
    Slurm (``SLURM_PROCID`` set) ``WORLD_SIZE`` if set, else ``SLURM_NTASKS``.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return "WORLD_SIZE", env["WORLD_SIZE"]
    if "SLURM_PROCID" in env:
        name = "WORLD_SIZE" if "WORLD_SIZE" in env else "SLURM_NTASKS"
        return name, env.get(name, "")
    return None


def launcher_problem(environ: Mapping[str, str] | None = None) -> str | None:
    """Why this Slurm task cannot find its job's other tasks (a missing or malformed
    ``SLURM_*`` variable, named with the rule and the value), or None (also outside Slurm and
    under torchrun, whose variables win)."""
    from fsdp_comm import slurm_environment

    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    try:
        slurm_environment(env)
    except ValueError as exc:
        return str(exc)
    return None


def local_device_problem(environ: Mapping[str, str], device_count: int) -> str | None:
    """Why this launched rank has no GPU of its own: ``LOCAL_RANK`` (its index on the node,
    the CUDA device it takes) not below the ``device_count`` devices it sees; None when fine."""
    text = environ.get("LOCAL_RANK", "0")
    try:
        local = int(text)
    except ValueError:
        return f"LOCAL_RANK must be an integer >= 0 (this rank's index on its node), got {text!r}"
    if 0 <= local < device_count or (local >= 0 and device_count == 1):
        return None  # one device seen: each task's own GPU (srun --gpus-per-task=1)
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    seen = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    return (
        f"LOCAL_RANK {local} names cuda:{local}, but this process sees {device_count} CUDA "
        f"device(s){seen}: LOCAL_RANK must be below the device count, so start at most "
        f"{device_count} ranks per node (torchrun --nproc-per-node, sbatch "
        "--ntasks-per-node)"
    )


def resume_problem(resumed_step: int, steps: int, resume: str | None) -> str | None:
    """Why training ``steps`` steps from a checkpoint at ``resumed_step`` is refused: it would
    save the weights of step ``resumed_step`` labelled with a lower (or the same) step."""
    if steps > resumed_step:
        return None
    return (
        f"--resume: {resume} holds a checkpoint at step {resumed_step}; --steps is the "
        f"total step count and must be greater than {resumed_step}, got {steps}"
    )


def _build_local(backend: Any, cfg: TrainConfig) -> tuple[Any, list[Any], int, ModelShape]:
    """The unsharded model, its blocks, its sequence length and its shape for the FLOPs
    count (under the build lock)."""
    with _BUILD_LOCK:  # ranks of the threads backend share the global random generator
        torch.manual_seed(cfg.seed)
        if cfg.hf_config is not None or cfg.hf_pretrained is not None:
            from ..hf import build_hf_model, build_hf_pretrained

            if cfg.hf_pretrained is not None:
                hf = build_hf_pretrained(cfg.hf_pretrained)  # on meta; filled once sharded
            else:
                assert cfg.hf_config is not None  # one of the two, by the condition above
                hf = build_hf_model(cfg.hf_config)
            if cfg.activation_checkpointing:
                # a transformers PreTrainedModel (HFModel types it as any nn.Module)
                hf.model.gradient_checkpointing_enable(  # type: ignore[operator]
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
            hf_cfg = hf.model.config  # transformers maps hidden_size to n_embd and the like
            width = getattr(hf_cfg, "hidden_size", 0) or getattr(hf_cfg, "n_embd", 0)
            shape = model_shape(hf.model, len(hf.blocks), int(width))
            model = hf.model if cfg.hf_pretrained is not None else hf.model.to(backend.device)
            return model, hf.blocks, cfg.sequence_length(hf.max_positions), shape
        config = cfg.model_config()
        build = GPT if isinstance(config, GPTConfig) else Llama
        if cfg.meta_init:
            with torch.device("meta"):
                model = build(config)  # type: ignore[arg-type]
        else:
            model = build(config).to(backend.device)  # type: ignore[arg-type]
        model.activation_checkpointing = cfg.activation_checkpointing
        width = config.d_model if isinstance(config, GPTConfig) else config.dim
        shape = model_shape(model, config.n_layers, width)
        return model, list(model.blocks), cfg.sequence_length(), shape


def _class_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    return type(module).forward(module, *args, **kwargs)


def _compile_blocks(blocks: list[Any], backend: str) -> None:
    """``torch.compile`` each block's forward, before `fully_shard` (torchtitan's order:
    activation checkpointing, then compile, then sharding).

    The forward, not ``block.compile()``: that compiles ``Module._call_impl``, which runs the
    forward hooks `fully_shard` registers, so dynamo would trace the engine's hooks (locks,
    collectives, views), breaking the graph at each and recompiling as the engine's state
    changes. A compiled instance ``forward`` leaves the hooks outside the compiled region and
    parameter names unchanged (checkpoints load with or without ``--compile``). It looks the
    forward up on the block's class at each call, after `fully_shard` has swapped that class:
    transformers' checkpointing wraps the class's ``forward`` and checkpoints only from the
    outermost wrapper, which a forward bound now would bypass. Checkpointing needs no step
    of its own: GPT.forward calls ``checkpoint(block, x)`` around the whole block (hooks, then
    compiled forward, both run again in the recomputation); transformers' wrapper runs inside
    the compiled forward. ``self`` is an argument of one compiled function shared by all
    blocks, so alike blocks share one graph instead of recompiling per block.
    """
    from tqdm import tqdm

    # torch.fx's Interpreter makes a (disabled) tqdm bar while compiling; tqdm's default lock
    # is a multiprocessing semaphore, which a rank ending with os._exit would leak.
    tqdm.set_lock(threading.RLock())
    compiled = torch.compile(_class_forward, backend=backend)
    for block in blocks:
        block.forward = types.MethodType(compiled, block)


_PROBE_CPP = """
#include <omp.h>
extern "C" int fsdp_inductor_probe(int n) {
  int s = 0;
#pragma omp parallel for reduction(+:s)
  for (int i = 0; i < n; ++i) s += i;
  return s;
}
"""


@functools.cache
def _inductor_problem(cxx: Any, cuda: bool) -> str | None:
    if cuda:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "inductor on a GPU needs triton (pip install triton)"
    try:
        from torch._inductor.codecache import CppCodeCache

        if CppCodeCache.load(_PROBE_CPP).fsdp_inductor_probe(4) == 6:
            return None
        return "a C++ kernel built by inductor returned a wrong result"
    except Exception as exc:  # no compiler, no OpenMP, no headers, or torch's internals moved
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        detail = " / ".join(lines[-3:])[-400:] if lines else ""
        return (
            f"inductor cannot build C++ kernels here, so it needs a working C++ compiler "
            f"with OpenMP (g++; or set CXX): {type(exc).__name__}: {detail}"
        )


def inductor_problem() -> str | None:
    """None when ``torch.compile(backend="inductor")`` can build kernels here, else why not.

    Builds and runs a tiny OpenMP kernel through inductor's own C++ build (its compiler,
    flags and cache), as every compiled CPU graph needs; on a GPU also needs triton. Once per
    process and compiler setting (a cache hit after the first build)."""
    import torch._inductor.config as inductor_config

    cxx = inductor_config.cpp.cxx
    return _inductor_problem(
        tuple(cxx) if isinstance(cxx, list) else cxx, torch.cuda.is_available()
    )


def build_model(backend: Any, cfg: TrainConfig) -> tuple[Any, int, ModelShape]:
    """The sharded model (each block a unit, the rest the root unit), its sequence length and
    its shape for the FLOPs count."""
    from fsdp_engine import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    model, blocks, seq_len, shape = _build_local(backend, cfg)
    if cfg.tp > 1:  # tensor parallelism first, then FSDP over the dp mesh (as FSDP2)
        from ..models import parallelize

        mesh, tp_mesh = train_meshes(backend, cfg)
        parallelize(model, tp_mesh, sequence_parallel=cfg.sequence_parallel, seq_len=seq_len)
    elif cfg.fault_tolerant:  # issue #31: the hosts are the fault-tolerant replicate dim
        from ._fault_tolerant import ft_mesh

        mesh = ft_mesh(backend)
    else:
        mesh = _mesh(backend, cfg)
    if cfg.compile is not None:
        _compile_blocks(blocks, cfg.compile)
    kwargs: dict[str, Any] = dict(
        mesh=mesh,
        reshard_after_forward=(
            False if cfg.strategy == "shard_grad_op" else cfg.reshard_after_forward
        ),
        mp_policy=MixedPrecisionPolicy(
            param_dtype=_dtype(cfg.param_dtype), reduce_dtype=_dtype(cfg.reduce_dtype)
        ),
        offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy(),
        param_init_fn=init_gpt_module if cfg.meta_init else None,
        # Ranks initialise meta-built units independently: take rank 0's values everywhere.
        sync_module_states=cfg.meta_init,
    )
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    if not cfg.prefetch:
        for unit in [*blocks, model]:
            unit.set_modules_to_forward_prefetch([])
            unit.set_modules_to_backward_prefetch([])
    if cfg.hf_pretrained is not None:  # each rank reads only the rows it keeps
        from ..hf import load_hf_pretrained

        load_hf_pretrained(model, cfg.hf_pretrained, device=backend.device)
    return model, seq_len, shape


def _layout(model: Any) -> list[Any]:
    from fsdp_engine import sharded_layout

    return [s for s in sharded_layout(model) if s.shard_rank == 0 and s.replicate_rank == 0]


def _resume(cfg: TrainConfig, model: GPT, opt: torch.optim.Optimizer) -> int:
    if cfg.resume is None:
        return 0
    import fsdp_ckpt

    saved_extra = fsdp_ckpt.inspect_checkpoint(cfg.resume).index.extra
    problem = resume_tp_problem(cfg, saved_extra if isinstance(saved_extra, dict) else {})
    if problem is not None:  # before loading rows of another order
        raise ValueError(problem)
    try:
        extra = fsdp_ckpt.load(cfg.resume, model, opt)
    except fsdp_ckpt.CheckpointMismatchError as exc:
        problems = [ln.strip() for ln in str(exc).splitlines()[1:] if ln.strip()]
        raise ValueError(
            f"--resume: {cfg.resume} holds a checkpoint of a different model than --model "
            f"{cfg.model} ({len(problems)} mismatches, first: {problems[0] if problems else exc})"
        ) from None
    saved = extra.get("model")
    if saved is not None and saved != cfg.model_description():
        raise ValueError(
            f"--resume: {cfg.resume} holds a checkpoint of model {saved}, not of "
            f"{cfg.model_description()}"
        )
    step = int(extra.get("step", 0))
    _log.info("resumed from %s at step %d", cfg.resume, step)
    return step


def _save(cfg: TrainConfig, model: GPT, opt: torch.optim.Optimizer, step: int) -> str | None:
    if cfg.save is None:
        return None
    import fsdp_ckpt

    extra: dict[str, Any] = {"step": step, "model": cfg.model_description(), "seed": cfg.seed}
    if cfg.tp > 1:  # fused weights are stored in an order of this tp size (resume_tp_problem)
        extra["tp"] = cfg.tp
        extra["not_exportable"] = (  # fsdp_ckpt.export refuses it (its NOT_EXPORTABLE)
            f"fsdp train --tp {cfg.tp} stores the fused projections' rows in tp-interleaved "
            "order (Note [fused projections under tensor parallelism] in fsdp.models._tp_plan); "
            f"resume it with --tp {cfg.tp}"
        )
    hf_config: Any = getattr(model, "config", None)
    if hasattr(hf_config, "to_json_string") and hasattr(hf_config, "model_type"):
        # A transformers model: its config, for `fsdp export-hf` (pure JSON, as config.json).
        extra["hf_config"] = json.loads(hf_config.to_json_string(use_diff=False))
    fsdp_ckpt.save(cfg.save, model, opt, extra=extra)
    _log.info("checkpoint of step %d saved to %s", step, cfg.save)
    return cfg.save


def _logits(model: Any, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits  # transformers returns outputs


def _one_step(
    model: Any,
    opt: Any,
    corpus: ByteCorpus,
    backend: Any,
    cfg: TrainConfig,
    step: int,
    seq_len: int,
) -> tuple[float, float]:
    """One optimizer step; the loss (mean over ranks) and the global gradient norm before
    clipping (computed, not clipped, when clipping is off: one scalar all-reduce)."""
    from fsdp_engine import clip_grad_norm_

    total = 0.0
    for micro in range(cfg.grad_accum):
        model.set_requires_gradient_sync(micro == cfg.grad_accum - 1)
        # The tp ranks of one data-parallel group (consecutive ranks) take the same rows.
        x, y = corpus.batch(
            step=step * cfg.grad_accum + micro,
            seed=cfg.seed,
            global_batch=cfg.global_batch,
            seq_len=seq_len,
            rank=backend.rank // cfg.tp,
            world_size=backend.world_size // cfg.tp,
        )
        x, y = x.to(backend.device), y.to(backend.device)
        loss = F.cross_entropy(_logits(model, x).flatten(0, 1).float(), y.flatten())
        loss = loss / cfg.grad_accum
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        total += loss.item()
    norm = clip_grad_norm_(model, cfg.clip if cfg.clip is not None else math.inf)
    opt.step()
    opt.zero_grad(set_to_none=True)
    mean = torch.tensor([total], device=backend.device)
    backend.all_reduce(mean)
    return mean.item() / backend.world_size, float(norm)


def _train_steps(
    model: Any,
    opt: Any,
    corpus: ByteCorpus,
    backend: Any,
    cfg: TrainConfig,
    seq_len: int,
    summary: TrainSummary,
    reporter: StepReporter,
) -> None:
    tokens = cfg.global_batch * cfg.grad_accum * seq_len  # per step, all ranks together
    profiling = TrainProfiling(cfg.profile, cfg.profile_steps, model, summary.start_step, cfg.steps)
    try:
        for step in range(summary.start_step, cfg.steps):
            lr = float(opt.param_groups[0]["lr"])  # the rate this step uses
            profiling.before(step)
            t0 = time.perf_counter()
            loss, grad_norm = _one_step(model, opt, corpus, backend, cfg, step, seq_len)
            step_time = time.perf_counter() - t0
            timeline = profiling.after(step)
            summary.losses.append(loss)
            reporter.step(step, loss, lr, grad_norm, step_time, tokens, timeline)
            if cfg.save_every and (step + 1) % cfg.save_every == 0 and step + 1 < cfg.steps:
                _save(cfg, model, opt, step + 1)
    finally:
        profiling.close()
    summary.timeline = profiling.summary


def train_rank(backend: Any, cfg: TrainConfig) -> TrainSummary:
    """Train on this rank; every rank returns the same summary (memory per rank included)."""
    torch.set_num_threads(
        cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // backend.world_size)
    )
    if cfg.host_mmap_threshold:
        from fsdp_memory import set_host_mmap_threshold

        set_host_mmap_threshold(cfg.host_mmap_threshold)
    if cfg.fault_tolerant:  # issue #31: each replica group's checkpoints its own
        from ._fault_tolerant import ft_config

        cfg = ft_config(cfg)
    corpus = ByteCorpus.load(cfg.data)
    model, seq_len, shape = build_model(backend, cfg)
    if cfg.hf_pretrained is not None:  # the model's own tokens, not bytes
        from ..hf import tokenized_corpus

        corpus = tokenized_corpus(corpus, cfg.hf_pretrained, min_tokens=seq_len + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start = _resume(cfg, model, opt)
    problem = resume_problem(start, cfg.steps, cfg.resume)
    if problem is not None:  # never save a checkpoint at a lower step than the one resumed
        raise ValueError(problem)
    builtin = cfg.hf_config is None and cfg.hf_pretrained is None
    params = (
        cfg.model_config().num_params
        if builtin
        else sum(s.global_shape.numel() for s in _layout(model))
    )
    summary = TrainSummary(steps=cfg.steps, start_step=start, params=params)
    flops = flops_per_token(shape, seq_len)
    if backend.rank == 0:
        _log.info(
            "training %s: %d parameters, %d ranks, sequence length %d, %.3g FLOPs per token",
            cfg.hf_config or cfg.hf_pretrained or cfg.model,
            params,
            backend.world_size,
            seq_len,
            flops,
        )
    reporter = StepReporter(backend, cfg, start, flops, _dtype(cfg.param_dtype) or torch.float32)
    t_begin = time.perf_counter()
    try:
        if cfg.fault_tolerant:  # issue #31: quorum and commit vote around each step
            from ._fault_tolerant import ft_train_steps

            ft_train_steps(model, opt, corpus, backend, cfg, seq_len, summary, reporter)
        else:
            _train_steps(model, opt, corpus, backend, cfg, seq_len, summary, reporter)
    finally:
        reporter.close()
    tokens = cfg.global_batch * cfg.grad_accum * seq_len * len(summary.losses)
    summary.tokens_per_s = tokens / max(time.perf_counter() - t_begin, 1e-9)
    reporter.fill(summary)
    summary.checkpoint = _save(cfg, model, opt, cfg.steps)
    if summary.checkpoint is not None:
        # The version this last save pushed beyond keep_last is deleted by rank 0's background
        # thread; a launcher ends ranks as soon as they return, so wait for it here (no-op on
        # other ranks), or the run leaves it beside the new one until the next save.
        import fsdp_ckpt

        fsdp_ckpt.wait_for_cleanup(summary.checkpoint)
    return summary


def _join_scheduler_environment() -> bool:
    """True under torchrun or Slurm (one process per rank already started). Under Slurm,
    torchrun's variables are set from ``SLURM_*`` (`fsdp_comm.join_slurm_environment`: the
    head node from the node list, a port from the job id); ValueError names a bad one."""
    from fsdp_comm import join_slurm_environment

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return True
    if not join_slurm_environment():
        return False
    _log.info(
        "Slurm job %s: rank %s of %s (local rank %s), rendezvous at %s:%s",
        os.environ.get("SLURM_JOB_ID", "?"),
        os.environ["RANK"],
        os.environ["WORLD_SIZE"],
        os.environ["LOCAL_RANK"],
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    return True


def run_training(cfg: TrainConfig) -> TrainSummary:
    """Start ``cfg.world_size`` local ranks (or join torchrun's/Slurm's) and train."""
    from fsdp_comm import get_backend, launch

    if cfg.compile is not None:  # before any rank starts (the CLI checks the same earlier)
        if cfg.compile not in COMPILE_BACKENDS:
            raise ValueError(
                f"--compile must be one of {', '.join(COMPILE_BACKENDS)}, got {cfg.compile!r}"
            )
        problem = inductor_problem() if cfg.compile == "inductor" else None
        if problem is not None:
            raise ValueError(f"--compile inductor: {problem}")
    problem = metrics_problem(cfg.metrics, cfg.tensorboard, profile=cfg.profile is not None)
    if problem is not None:  # before any rank starts: a CSV of other columns, no tensorboard
        raise ValueError(problem)
    if _join_scheduler_environment():
        if torch.cuda.is_available():
            problem = local_device_problem(os.environ, torch.cuda.device_count())
            if problem is not None:
                raise ValueError(problem)
        backend = get_backend(cfg.backend)
        cfg = replace(cfg, world_size=backend.world_size)
        try:
            problem = world_problem(
                cfg, backend.world_size, f"the launcher's world size {backend.world_size}"
            )
            if problem is not None:
                raise ValueError(problem)
            summary = train_rank(backend, cfg)
            # Every rank is done before any tears the group down: a rank destroying its gloo
            # group while a peer still used it died with SIGABRT once under load (2026-11-23).
            backend.barrier()
            return summary
        finally:
            backend.close()
    problem = world_problem(cfg, cfg.world_size, f"--world-size {cfg.world_size}")
    if problem is not None:
        raise ValueError(problem)
    options = {"device": "cuda"} if cfg.backend == "torch" and torch.cuda.is_available() else {}
    summaries: list[TrainSummary] = launch(
        train_rank,
        cfg.world_size,
        backend=cfg.backend,
        args=(cfg,),
        backend_options=options,
        timeout=24 * 3600,
        threads_per_rank=cfg.threads_per_rank,
    )
    return summaries[0]
