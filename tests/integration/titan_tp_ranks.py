"""Rank functions for ``test_torchtitan.py``'s 2-D runs: torchtitan's Llama3 with FSDP x TP.

Module level (and no ``test_`` names): ``launch`` ranks run these, pytest collects nothing here.
``python -m tests.integration.titan_tp_ranks PARTS IMPLS WORKDIR OUT`` runs, in one fresh
interpreter, the 1-D scenarios of ``titan_ranks`` (part ``flat``) and/or the 2-D ones here (part
``tp``) for each implementation, and pickles ``{part: results}`` to OUT.

Every rank builds torchtitan's Llama3 (``titan_ranks.model_config``: the same tiny dims and SDPA
attention) with torchtitan's own tensor-parallel sharding declarations
(``set_llama3_sharding_config``, sequence parallelism on: torchtitan's default), builds
torchtitan's meshes with ``ParallelDims.build_mesh`` at data-parallel shard degree 2 x tensor
parallel degree 2 on 4 ranks, and calls torchtitan's ``parallelize_llama``: ``Module.parallelize``
(column/row-parallel projections, vocabulary-sharded embeddings and ``lm_head``, sequence-parallel
norms), selective activation checkpointing, then ``apply_fsdp_to_decoder`` with the FSDP
implementation under test patched in as its ``fully_shard``. Training is ``titan_ranks``' loop
with the trainer's TP-aware steps (``Trainer.post_dataloading_process``, ``train_step``): each
data-parallel rank reads its slice of the global batch (both tp ranks of it the same), the
token count and the loss are summed over torchtitan's ``batch``/``loss`` meshes (data-parallel
only), and ``ChunkedLossWrapper``'s cross-entropy runs loss-parallel on the vocabulary-sharded
logits (torchtitan 0.3.0 has no switch for that: it is how its CE treats a ``Shard(-1)``
prediction). A ``CheckpointManager`` checkpoint saved at step ``SAVE_AT`` is resumed by 2 ranks
at another layout.

Two of torchtitan 0.3.0's three ``spmd_backend`` values run here, each exercising one way FSDP
composes with TP:
  * ``partial_dtensor``: parameters are DTensors on the ``tp`` mesh; ``fully_shard(mesh=fsdp
    mesh)`` (the engine's Note [flat buffer on a 2-D mesh]). Resumed at dp 1 x tp 2.
  * ``full_dtensor``: parameters are DTensors on the whole (``dp_shard``, ``tp``) mesh,
    ``Replicate()`` on ``dp_shard``; ``fully_shard(mesh=that mesh, dp_mesh_dims=
    DataParallelMeshDims(shard="dp_shard"))`` (the engine's Note [SPMD mesh]); inputs and labels
    are DTensors too (``full_dtensor.parallelize_inputs``). Resumed at dp 2 x tp 1.
The third, ``spmd_types`` (torchtitan's default), keeps parameters plain tensors annotated with
``spmd_types`` types and passes ``dp_mesh_dims``: torch 2.13's own ``fully_shard`` rejects that
("all parameters must be DTensors on the full SPMD mesh"), and ours raises the same error, so it
is not run.

CPU patches, on top of ``titan_ranks``' (triton stub, SDPA attention, SUM reductions on gloo,
``full_state``):
  * ``build_meshes``: ``torchtitan.distributed.parallel_dims.device_type`` is ``"cpu"`` while
    ``ParallelDims.build_mesh`` runs (torchtitan's ``device_type`` falls back to ``"cuda"`` on a
    CPU-only torch); the rest of ``build_mesh`` is torchtitan's own (its ``"fake"``-backend
    size-1 axes included).
  * ``model_config``: the sharding declarations are set with ``set_llama3_sharding_config``
    directly, which is all that ``Llama3Model.Config.update_from_config`` adds for TP: the
    latter imports ``torchtitan.trainer``, which needs torchdata.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import titan_ranks as R

DP, TP = 2, 2  # the fresh run's layout (4 ranks)
BACKENDS = ("partial_dtensor", "full_dtensor")
# Where each backend's 2-rank resume goes: (dp shard degree, tp degree).
RESUME_AT = {"partial_dtensor": (1, 2), "full_dtensor": (2, 1)}
SP = True  # torchtitan's ParallelismConfig.enable_sequence_parallel default
assert R.SEQ % (R.NUM_CHUNKS * TP) == 0  # SP cuts the sequence, the loss chunks each tp piece


# ---- torchtitan's pieces, on CPU ----------------------------------------------------------------
def build_meshes(tt: types.SimpleNamespace, spmd_backend: str, dp: int, tp: int) -> Any:
    """torchtitan's ``ParallelDims`` with its meshes built by its own ``build_mesh`` on CPU."""
    import torchtitan.distributed.parallel_dims as parallel_dims_module

    parallel_dims = tt.ParallelDims(
        dp_replicate=1,
        dp_shard=dp,
        cp=1,
        tp=tp,
        pp=1,
        ep=1,
        world_size=dist.get_world_size(),
        spmd_backend=spmd_backend,
    )
    with R.patched(parallel_dims_module, "device_type", "cpu"):
        parallel_dims.build_mesh()
    return parallel_dims


def model_config(tt: types.SimpleNamespace, parallelism: Any) -> Any:
    """``titan_ranks.model_config`` with torchtitan's TP/SP sharding declarations."""
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    config = R.model_config(tt)
    set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
    return config


def _layout(t: Any) -> dict[str, Any]:
    """What a forward hook records of a tensor: its DTensor mesh, placements and shapes."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return {"dtensor": False, "shape": tuple(t.shape)}
    return {
        "dtensor": True,
        "mesh": tuple(t.device_mesh.mesh_dim_names or ()),
        "placements": tuple(repr(p) for p in t.placements),
        "shape": tuple(t.shape),
        "local_shape": tuple(t.to_local().shape),
    }


def _record_first(module: nn.Module, facts: dict[str, Any], key: str, inputs: bool) -> None:
    """Record the layout of ``module``'s first input (``inputs``) or output on its first call."""

    def hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if key not in facts:
            facts[key] = _layout(args[0] if inputs else output)

    module.register_forward_hook(hook)


# ---- the rank function ---------------------------------------------------------------------------
def train_rank(
    backend: Any,
    impl: str,
    spmd_backend: str,
    dp: int,
    tp: int,
    ckpt_root: str,
    stop_step: int,
    save_at: int | None,
    resume: bool,
) -> dict[str, Any]:
    """One rank at (dp shard ``dp``, tp ``tp``): parallelise with torchtitan, initialise, train
    up to ``stop_step``, checkpointing as ``titan_ranks.train_rank`` does."""
    del backend  # the default torch.distributed group is initialised by fsdp_comm.launch
    torch.set_num_threads(1)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    tt = R.titan()
    tt.dist_utils.set_spmd_backend(spmd_backend)  # what Trainer does with the config's value
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == dp * tp
    parallel_dims = build_meshes(tt, spmd_backend, dp, tp)
    cfg = tt.config
    training = cfg.TrainingConfig(
        local_batch_size=R.GLOBAL_BATCH // dp,
        seq_len=R.SEQ,
        steps=R.TOTAL_STEPS,
        max_norm=R.MAX_NORM,
        mixed_precision_param="float32",
        mixed_precision_reduce="float32",
    )
    parallelism = cfg.ParallelismConfig(
        data_parallel_shard_degree=dp,
        tensor_parallel_degree=tp,
        enable_sequence_parallel=SP,
        spmd_backend=spmd_backend,
    )
    with torch.device("meta"):
        model = model_config(tt, parallelism).build()
    model.verify_module_protocol()
    impl_fully_shard, shard_calls = R.fully_shard_of(impl), []

    def fully_shard(module: Any, **kwargs: Any) -> Any:
        shard_calls.append(
            {
                k: repr(v)
                for k, v in kwargs.items()
                if k in ("dp_mesh_dims", "reshard_after_forward")
            }
            | {"kwargs": sorted(kwargs), "mesh": tuple(kwargs["mesh"].mesh_dim_names or ())}
        )
        return impl_fully_shard(module, **kwargs)

    gradient_division = R._sum_reduction_on_gloo(tt.fsdp.disable_fsdp_gradient_division)
    with (
        R.patched(tt.fsdp, "fully_shard", fully_shard),
        R.patched(tt.fsdp, "disable_fsdp_gradient_division", gradient_division),
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
    torch.manual_seed(R.INIT_SEED if not resume else R.INIT_SEED + 1)  # a resume overwrites it
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    params = dict(model.named_parameters())
    facts: dict[str, Any] = {
        "fully_shard_calls": shard_calls,
        "params": {n: _layout(p) for n, p in params.items()},
        "all_dtensor": all(isinstance(p, DTensor) for p in params.values()),
        "ac_on_every_layer": all(
            "._checkpoint_wrapped_module." in n for n in params if n.startswith("layers.")
        ),
        "fsdp_modules": sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule)),
    }
    # What tensor parallelism did to the activations: sequence-parallel block inputs, replicated
    # (gathered) hidden states into lm_head, vocabulary-sharded logits (loss parallel).
    _record_first(model.layers["0"], facts, "block_input", inputs=True)
    _record_first(model.lm_head, facts, "lm_head_input", inputs=True)
    _record_first(model.lm_head, facts, "logits", inputs=False)

    init_state = None
    if not resume:
        full = R.full_state(model)  # collective
        init_state = full if rank == 0 else None

    batch_mesh = parallel_dims.get_optional_mesh("batch")  # None at dp 1
    loss_mesh = parallel_dims.get_optional_mesh("loss")
    dp_rank = batch_mesh.get_local_rank() if batch_mesh is not None else 0
    loss_fn, optimizers, schedulers = R.components(tt, model)
    train_context = tt.dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    batches, train_state = R.Batches(dp_rank, dp), R.StepState()
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
        loaded = checkpointer.load(step=R.SAVE_AT if resume else -1)
        assert loaded == resume, (loaded, resume)
        assert batches.step == train_state.step
        start = train_state.step
        losses, norms = [], []
        for step in range(start, stop_step):
            inputs, labels = batches.next()
            loss, norm = train_step(
                tt,
                parallel_dims,
                model,
                loss_fn,
                optimizers,
                schedulers,
                train_context,
                inputs,
                labels,
                batch_mesh,
                loss_mesh,
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
        "layout": (dp, tp),
    }


def train_step(
    tt: types.SimpleNamespace,
    parallel_dims: Any,
    model: nn.Module,
    loss_fn: Any,
    optimizers: Any,
    schedulers: Any,
    train_context: Any,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    batch_mesh: Any,
    loss_mesh: Any,
) -> tuple[float, float]:
    """torchtitan's ``Trainer.train_step`` for one microbatch with its TP/full-DTensor steps:
    (global loss, grad norm), the same on every rank."""
    optimizers.zero_grad()
    local_valid = (labels != tt.loss.IGNORE_INDEX).sum()
    global_valid = (
        tt.dist_utils.dist_sum_tensor(local_valid, batch_mesh)
        if parallel_dims.dp_enabled
        else local_valid
    )
    if parallel_dims.spmd_backend == "full_dtensor":
        from torchtitan.distributed import full_dtensor

        inputs, labels, _ = full_dtensor.parallelize_inputs(parallel_dims, inputs, labels, {})
    with train_context():
        pred = model(inputs)
        loss, _ = loss_fn(pred, labels, global_valid)
        del pred
        loss.backward()
    norm = tt.dist_utils.clip_grad_norm_(
        list(model.parameters()), R.MAX_NORM, foreach=True, pp_mesh=None, ep_enabled=False
    )
    optimizers.step()
    schedulers.step()
    loss = loss.detach()
    total = (
        tt.dist_utils.dist_sum(loss, loss_mesh)
        if parallel_dims.dp_cp_enabled
        else float(loss.item())
    )
    return total, float(norm)


# ---- the 2-D scenarios, in a fresh process -------------------------------------------------------
def launches(
    impls: list[str], workdir: str, backends: tuple[str, ...] = BACKENDS
) -> dict[str, Any]:
    """For each backend and implementation ("impl/backend"): a fresh run at dp ``DP`` x tp
    ``TP`` (saving at ``SAVE_AT``) and its resume on 2 ranks at ``RESUME_AT[backend]``, forked
    from this process (see ``titan_ranks.scenarios``); references via
    ``titan_ranks.add_references`` after the last launch. A failed fresh run is ``{"error":
    traceback}``; a failed resume is ``"resume_error"`` next to the fresh run's results."""
    import traceback

    from fsdp_comm import launch

    torch.set_num_threads(1)
    R.titan()
    runs: dict[str, Any] = {}
    for backend in backends:
        for impl in impls:
            key = f"{impl}/{backend}"
            ckpt_root = os.path.join(workdir, impl, backend)
            try:
                R.fully_shard_of(impl)  # imported once here, inherited by the forked ranks
                fresh = launch(
                    train_rank,
                    DP * TP,
                    backend="torch",
                    args=(impl, backend, DP, TP, ckpt_root, R.TOTAL_STEPS, R.SAVE_AT, False),
                    timeout=300,
                    start_method="fork",
                    threads_per_rank=1,
                )
            except Exception:
                runs[key] = {"error": traceback.format_exc()}
                continue
            runs[key] = run = {"fresh": fresh}
            dp, tp = RESUME_AT[backend]
            try:
                run["resumed"] = launch(
                    train_rank,
                    dp * tp,
                    backend="torch",
                    args=(impl, backend, dp, tp, ckpt_root, R.TOTAL_STEPS, None, True),
                    timeout=300,
                    start_method="fork",
                    threads_per_rank=1,
                )
            except Exception:
                run["resume_error"] = traceback.format_exc()
    return runs


def main(parts: list[str], impls: list[str], workdir: str) -> dict[str, Any]:
    """Every launch of the requested parts first (``flat``: ``titan_ranks``' 1-D runs, ``tp``:
    the 2-D runs here), then every reference: one torchtitan import for all of them."""
    runs: dict[str, Any] = {}
    if "flat" in parts:
        runs["flat"] = R.launches(impls, os.path.join(workdir, "flat"))
    if "tp" in parts:
        runs["tp"] = launches(impls, os.path.join(workdir, "tp"))
    for part in runs.values():
        R.add_references(part)
    return runs


if __name__ == "__main__":
    import pickle

    _parts, _impls, _workdir, _out = sys.argv[1:5]
    _result = main(_parts.split(","), _impls.split(","), _workdir)
    with open(_out, "wb") as _f:
        pickle.dump(_result, _f)
