"""Rank functions for ``test_torchtitan.py``: torchtitan's own Llama3 parallelisation on CPU/gloo.

Module level (and no ``test_`` names): ``launch`` ranks run these, pytest collects nothing here.
``python -m tests.integration.titan_ranks IMPL WORKDIR OUT`` runs the whole ``scenario`` in a
fresh interpreter and pickles its results to OUT (see ``scenario`` for why).

Every rank builds torchtitan's Llama3 on the meta device, calls torchtitan's
``parallelize_llama`` (selective activation checkpointing, then ``apply_fsdp_to_decoder``) with
the FSDP implementation under test patched in as ``torchtitan.distributed.fsdp.fully_shard``, on
a 1-D ``init_device_mesh("cpu", (world,))``; materialises it with ``to_empty`` +
``init_weights`` and trains with torchtitan's own components, set up as its ``llama3_debugmodel``
trainer config sets them up (``ChunkedLossWrapper`` over ``CrossEntropyLoss``, ``default_adamw``
(fused AdamW), the warmup-stable-decay ``LRSchedulersContainer``, ``dist_utils.clip_grad_norm_``,
``CheckpointManager``), on fixed random token batches. torchtitan's ``Trainer`` itself is not
used: it imports tensorboard, wandb, datasets and a tokenizer.

CPU patches, each the least that lets torchtitan 0.3.0 run here:
  * ``_stub_triton_kernels``: torchtitan imports ``triton`` unconditionally through the MoE
    expert-parallel token dispatcher (``distributed/minimal_async_ep/kernels.py``); without triton
    that one module is replaced by a stub whose functions raise (Llama3 is dense, never calls it).
  * ``model_config``: torchtitan's language-model configs offer only compiled FlexAttention or
    varlen (CUDA flash) attention; the layers here use torchtitan's ``ScaledDotProductAttention``
    (causal SDPA) instead, so nothing is compiled and no attention mask is built.
  * ``_sum_reduction_on_gloo``: torchtitan sets the gradient divide factor to 1.0, which makes
    torch's FSDP2 reduce-scatter with ``PREMUL_SUM``, an op gloo lacks; forced to plain SUM.
  * ``train_rank``: the ``partial_dtensor`` SPMD backend (plain FSDP2 on a 1-D mesh, no
    ``dp_mesh_dims`` argument) and a ``ParallelDims`` whose ``fsdp`` mesh is the given 1-D CPU
    mesh, so torchtitan's own mesh builder (whose ``device_type`` falls back to ``"cuda"`` on a
    CPU-only torch) is not run.
  * ``full_state``: ``model.state_dict()`` + ``full_tensor()``, not torch's
    ``get_model_state_dict``, which cannot map torchtitan's split ``wq``/``wk``/``wv`` keys.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SEED = 0
INIT_SEED = 1234
DIM, N_HEADS, N_LAYERS, VOCAB, SEQ = 64, 4, 2, 256, 32
GLOBAL_BATCH = 8  # sequences per step whatever the world size (1, 2 and 4 divide it)
TOTAL_STEPS = 6
SAVE_AT = 3
LR = 3e-3
MAX_NORM = 0.25  # below every measured norm (~0.52), so clipping scales each step's gradients
NUM_CHUNKS = 4  # ChunkedLossWrapper chunks of the sequence (SEQ % NUM_CHUNKS == 0)


# ---- torchtitan on CPU -------------------------------------------------------------------------
def _stub_triton_kernels() -> None:
    """Let torchtitan import without triton: stub the MoE expert-parallel module that needs it."""
    name = "torchtitan.distributed.minimal_async_ep"
    if importlib.util.find_spec("triton") is not None or name in sys.modules:
        return

    def _needs_triton(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("torchtitan's MinimalAsyncEP needs triton (stubbed on CPU)")

    stub = types.ModuleType(name)
    stub.__doc__ = "CPU stub: torchtitan's MinimalAsyncEP kernels need triton."
    for fn in ("combine_op", "dispatch_op", "init_buffer", "maybe_update_minimal_async_ep_config"):
        setattr(stub, fn, _needs_triton)
    stub.MinimalAsyncEPDispatchMetadata = type("MinimalAsyncEPDispatchMetadata", (), {})
    sys.modules[name] = stub


def titan() -> types.SimpleNamespace:
    """torchtitan's modules this test uses (imported after the CPU stub)."""
    _stub_triton_kernels()
    import torchtitan.components.checkpoint as checkpoint
    import torchtitan.components.loss as loss
    import torchtitan.components.optimizer as optimizer
    import torchtitan.config as config
    import torchtitan.distributed.activation_checkpoint as ac
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common as common
    import torchtitan.models.llama3 as llama3
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dist_utils.set_spmd_backend("partial_dtensor")  # what Trainer does with the config's value
    return types.SimpleNamespace(
        checkpoint=checkpoint,
        loss=loss,
        optimizer=optimizer,
        config=config,
        ac=ac,
        fsdp=fsdp,
        dist_utils=dist_utils,
        common=common,
        llama3=llama3,
        ParallelDims=ParallelDims,
        ScaledDotProductAttention=ScaledDotProductAttention,
    )


def model_config(tt: types.SimpleNamespace) -> Any:
    """torchtitan's ``llama3`` debugmodel recipe at tiny dims, with SDPA attention."""
    ll, common = tt.llama3, tt.common
    layers = ll._build_llama3_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        hidden_dim=common.compute_ffn_hidden_dim(DIM, multiple_of=64),
        rope=common.ComplexRoPE.Config(
            dim=DIM // N_HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"
        ),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = tt.ScaledDotProductAttention.Config()
    return ll.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=common.Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=ll._EMBEDDING_INIT
        ),
        norm=common.RMSNorm.Config(normalized_shape=DIM, param_init=ll._NORM_INIT),
        lm_head=common.Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=ll._output_linear_init(DIM)
        ),
        layers=layers,
    )


def fully_shard_of(impl: str) -> Any:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    elif impl == "ours":
        from fsdp_engine import fully_shard
    else:
        raise ValueError(f"unknown FSDP implementation {impl!r}")
    return fully_shard


def _sum_reduction_on_gloo(original: Any) -> Any:
    """``disable_fsdp_gradient_division`` plus forced SUM reductions where gloo runs them.

    torchtitan sets every FSDP module's gradient divide factor to 1.0 (it scales the loss by the
    global token count itself); torch's FSDP2 then reduce-scatters fp32 gradients with
    ``ReduceOp.PREMUL_SUM(1.0)``, which gloo does not have. ``set_force_sum_reduction_for_comms``
    (what torchtitan's own symmetric-memory path calls) makes it a plain SUM, the same sum.
    """
    from torch.distributed.fsdp import FSDPModule

    def disable_fsdp_gradient_division(model: nn.Module) -> None:
        original(model)
        if dist.get_backend() == "gloo":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)

    return disable_fsdp_gradient_division


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


# ---- data --------------------------------------------------------------------------------------
def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step`` (0-based): inputs and next-token labels."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    tokens = torch.randint(VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = GLOBAL_BATCH // world
    inputs, labels = batch(step)
    return inputs[rank * per : (rank + 1) * per], labels[rank * per : (rank + 1) * per]


class StepState:
    """Stateful train state (the trainer's ``train_state``): the next step to run."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Batches(StepState):
    """Stateful stand-in for torchtitan's dataloader: deterministic batches by position."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = local_batch(self.step, self.rank, self.world)
        self.step += 1
        return out


# ---- training pieces (shared by the ranks and the one-process reference) ------------------------
def build_meta_model(tt: types.SimpleNamespace) -> nn.Module:
    with torch.device("meta"):
        model = model_config(tt).build()
    model.verify_module_protocol()
    return model


def components(tt: types.SimpleNamespace, model: nn.Module) -> tuple[Any, Any, Any]:
    """Loss, optimizers and LR schedulers as torchtitan's ``llama3_debugmodel`` config sets them."""
    loss_fn = tt.loss.ChunkedLossWrapper.Config(
        num_chunks=NUM_CHUNKS,
        loss_fn=tt.loss.CrossEntropyLoss.Config(global_vocab_size=VOCAB),
    ).build(compile_config=None)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # the trainer does this when the loss is chunked
    opt_cfg = tt.optimizer.default_adamw(lr=LR)
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = tt.optimizer.LRSchedulersContainer.Config(
        warmup_steps=2,
        decay_ratio=0.5,
        decay_type="linear",
        min_lr_factor=0.0,
    ).build(optimizers=optimizers, training_steps=TOTAL_STEPS)
    return loss_fn, optimizers, schedulers


def train_step(
    tt: types.SimpleNamespace,
    model: nn.Module,
    loss_fn: Any,
    optimizers: Any,
    schedulers: Any,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    group: Any = None,
) -> tuple[float, float]:
    """torchtitan's ``Trainer.train_step`` for one microbatch: (global loss, grad norm)."""
    optimizers.zero_grad()
    local_valid = (labels != tt.loss.IGNORE_INDEX).sum()
    global_valid = (
        tt.dist_utils.dist_sum_tensor(local_valid, group) if group is not None else local_valid
    )
    pred = model(inputs)
    loss, _ = loss_fn(pred, labels, global_valid)
    del pred
    loss.backward()
    norm = tt.dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
    optimizers.step()
    schedulers.step()
    loss = loss.detach()
    total = tt.dist_utils.dist_sum(loss, group) if group is not None else float(loss)
    return total, float(norm)


def reference(
    init_state: dict[str, torch.Tensor], steps: int = TOTAL_STEPS
) -> dict[str, list[float]]:
    """One process, no FSDP, no activation checkpointing: the same model from ``init_state``."""
    tt = titan()
    model = build_meta_model(tt)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()  # buffers (RoPE cache); the parameters come from init_state
    missing, unexpected = model.load_state_dict(init_state, strict=False)
    assert not unexpected and all("rope" in k for k in missing), (missing, unexpected)
    loss_fn, optimizers, schedulers = components(tt, model)
    losses, norms = [], []
    for step in range(steps):
        loss, norm = train_step(tt, model, loss_fn, optimizers, schedulers, *batch(step))
        losses.append(loss)
        norms.append(norm)
    return {"losses": losses, "norms": norms}


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict, as torchtitan's checkpoints name it.

    Collective: every rank must call it. ``model.state_dict()`` and ``full_tensor()`` rather than
    ``get_model_state_dict(full_state_dict=True)``: torchtitan's ``FusedQKVLinear`` splits
    ``wqkv`` into ``wq``/``wk``/``wv`` in a state-dict post-hook, and torch's
    ``get_model_state_dict`` then fails to map ``...qkv_linear.wq.weight`` back to a parameter.
    """
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


# ---- the rank function ---------------------------------------------------------------------------
def train_rank(
    backend: Any, impl: str, ckpt_root: str, stop_step: int, save_at: int | None, resume: bool
) -> dict[str, Any]:
    """One rank: parallelise, initialise, train up to ``stop_step``, checkpointing as it goes.

    A fresh run (``resume=False``) saves every ``save_at`` steps; a resumed one loads the
    ``SAVE_AT`` checkpoint first (after initialising from another seed) and saves nothing.
    Returns the step it started at, the losses and clip norms of its steps (all-reduced: the same
    on every rank), facts about the parallelised model, and on rank 0 of a fresh run the full
    initial state dict.
    """
    del backend  # the default torch.distributed group is initialised by fsdp_comm.launch
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    tt = titan()
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    parallel_dims = tt.ParallelDims(
        dp_replicate=1,
        dp_shard=world,
        cp=1,
        tp=1,
        pp=1,
        ep=1,
        world_size=world,
        spmd_backend="partial_dtensor",
    )
    parallel_dims._single_axis_meshes = {"fsdp": mesh}  # the 1-D CPU mesh instead of build_mesh()
    cfg = tt.config
    training = cfg.TrainingConfig(
        local_batch_size=GLOBAL_BATCH // world,
        seq_len=SEQ,
        steps=TOTAL_STEPS,
        max_norm=MAX_NORM,
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )
    parallelism = cfg.ParallelismConfig(
        data_parallel_shard_degree=world, spmd_backend="partial_dtensor"
    )
    model = build_meta_model(tt)
    impl_fully_shard, shard_calls = fully_shard_of(impl), []

    def fully_shard(module: Any, **kwargs: Any) -> Any:
        shard_calls.append(sorted(kwargs))
        return impl_fully_shard(module, **kwargs)

    gradient_division = _sum_reduction_on_gloo(tt.fsdp.disable_fsdp_gradient_division)
    with (
        patched(tt.fsdp, "fully_shard", fully_shard),
        patched(tt.fsdp, "disable_fsdp_gradient_division", gradient_division),
    ):
        model = tt.llama3.parallelize_llama(
            model,
            parallel_dims=parallel_dims,
            training=training,
            parallelism=parallelism,
            compile_config=cfg.CompileConfig(enable=False),
            ac_config=tt.ac.SelectiveAC.Config(),
            dump_folder=ckpt_root,
        )
    model.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED if not resume else INIT_SEED + 1)  # a resume must overwrite it
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    params = dict(model.named_parameters())
    facts = {
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "meshes_ok": all(
            isinstance(p, DTensor) and p.device_mesh.size() == world for p in params.values()
        ),
        "n_params": len(params),
        "fully_shard_calls": len(shard_calls),
        "fully_shard_kwargs": sorted({k for call in shard_calls for k in call}),
        # torchtitan's SelectiveAC wraps each transformer block in a CheckpointWrapper
        "ac_on_every_layer": all(
            "._checkpoint_wrapped_module." in n for n in params if n.startswith("layers.")
        ),
        # torchtitan finds the FSDP units with isinstance(m, torch's FSDPModule): gradient
        # division (distributed/fsdp.py) and ChunkedLossWrapper's lm_head (components/loss.py)
        "fsdp_modules": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
    }
    init_state = None
    if not resume:
        full = full_state(model)  # collective
        init_state = full if rank == 0 else None

    loss_fn, optimizers, schedulers = components(tt, model)
    batches, train_state = Batches(rank, world), StepState()
    checkpointer = tt.checkpoint.CheckpointManager.Config(
        enable=True,
        folder="checkpoint",
        interval=save_at or 10**9,
        last_save_model_only=False,
    ).build(
        dataloader=batches,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=ckpt_root,
    )
    try:
        loaded = checkpointer.load(step=SAVE_AT if resume else -1)
        assert loaded == resume, (loaded, resume)
        assert batches.step == train_state.step
        start = train_state.step
        losses, norms = [], []
        for step in range(start, stop_step):
            inputs, labels = batches.next()
            loss, norm = train_step(
                tt, model, loss_fn, optimizers, schedulers, inputs, labels, group=mesh
            )
            losses.append(loss)
            norms.append(norm)
            train_state.step = step + 1
            checkpointer.save(curr_step=step + 1)
    finally:
        checkpointer.close()
    return {
        "start": start,
        "losses": losses,
        "norms": norms,
        "init_state": init_state,
        "facts": facts,
    }


# ---- the whole scenario, in a fresh process ------------------------------------------------------
def scenario(impl: str, workdir: str) -> dict[str, Any]:
    """Fresh run at world 4 (saving at ``SAVE_AT``), resume at world 2, one-process reference."""
    return scenarios([impl], workdir)[impl]


def scenarios(impls: list[str], workdir: str) -> dict[str, Any]:
    """`scenario` for each implementation, in this one process: the launches of every
    implementation first, then the one-process references (see below). An implementation whose
    runs fail gets ``{"error": traceback}`` and the others go on.

    Meant for a fresh interpreter (``python -m tests.integration.titan_ranks``): importing
    torchtitan takes ~10 s here (it imports inductor and pipelining and builds ``torch.compile``
    wrappers at module level), so this process imports it once, for every implementation, and
    ``launch`` forks the ranks from it (``start_method="fork"``) rather than each forkserver rank
    importing it again: 4 ranks on 2 cores would spend ~20 s on that per launch. The
    implementation's own module (fsdp_engine for "ours") is imported here too, before forking,
    for the same reason. Forking is safe here because this process has run no torch parallel
    region (fsdp_comm's Note [start methods]); the references run last, after every fork.
    """
    runs = launches(impls, workdir)
    add_references(runs)
    return runs


def launches(impls: list[str], workdir: str) -> dict[str, Any]:
    """The ranks of `scenarios` (fresh at 4, resumed at 2) for each implementation; no
    reference yet (`add_references`), so that a caller can fork more launches first."""
    import traceback

    from fsdp_comm import launch

    torch.set_num_threads(1)
    titan()
    runs: dict[str, Any] = {}
    for impl in impls:
        try:
            fully_shard_of(impl)  # imported once here, inherited by the forked ranks
            ckpt_root = os.path.join(workdir, impl, "run")
            fresh = launch(
                train_rank,
                4,
                backend="torch",
                args=(impl, ckpt_root, TOTAL_STEPS, SAVE_AT, False),
                timeout=300,
                start_method="fork",
                threads_per_rank=1,
            )
            resumed = launch(
                train_rank,
                2,
                backend="torch",
                args=(impl, ckpt_root, TOTAL_STEPS, None, True),
                timeout=300,
                start_method="fork",
                threads_per_rank=1,
            )
            runs[impl] = {"fresh": fresh, "resumed": resumed}
        except Exception:
            runs[impl] = {"error": traceback.format_exc()}
    return runs


def add_references(runs: dict[str, Any]) -> None:
    """The one-process reference of each successful run in ``runs`` (in place), from the
    initial state its fresh rank 0 gathered. Runs torch parallel regions: call it after the
    last ``launch`` that forks from this process. Runs starting from the same weights share
    one reference."""
    import traceback

    done: list[tuple[dict[str, torch.Tensor], dict[str, list[float]]]] = []
    for key, run in runs.items():
        if "error" in run:
            continue
        try:
            init = run["fresh"][0]["init_state"]
            ref = next(
                (
                    ref
                    for other, ref in done
                    if other.keys() == init.keys()
                    and all(torch.equal(other[k], init[k]) for k in init)
                ),
                None,
            )
            if ref is None:
                ref = reference(init)
                done.append((init, ref))
            run["reference"] = ref
        except Exception:
            runs[key] = {"error": traceback.format_exc()}


if __name__ == "__main__":
    import pickle

    _impls, _workdir, _out = sys.argv[1:4]
    _result = scenarios(_impls.split(","), _workdir)
    with open(_out, "wb") as _f:
        pickle.dump(_result, _f)
