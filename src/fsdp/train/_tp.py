"""``fsdp train --tp N``: what tensor parallelism asks of the other flags, and its meshes.

With ``--tp N`` the world is ``dp x N`` ranks (``dp = world / N``): each group of ``N``
consecutive ranks cuts every block by `fsdp.models._tp_plan`, and FSDP shards what each rank holds
over the ``dp`` ranks of its tp coordinate, as ``--strategy`` lays out a world of ``dp``
ranks (``hybrid_shard`` and ``no_shard``: a 3-D ``(replicate, shard, tp)`` mesh). The ranks
of one tp group see the same batch: the global batch is split over the ``dp`` groups.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._train import TrainConfig

__all__ = ["tp_problem", "checkpoint_tp_problem", "resume_tp_problem", "train_meshes"]

#: fsdp-ckpt's index format that stores tensor-parallel pieces (box chunks); older formats
#: store a parameter's dim-0 slices only.
_CKPT_TP_FORMAT = 2


def checkpoint_tp_problem(cfg: TrainConfig) -> str | None:
    """Why ``--save``/``--resume`` cannot run with ``--tp`` here: `fsdp_ckpt` (the checkpoint
    format of ``fsdp train``) stores tensor-parallel pieces from its index format 2 on; or
    None."""
    if cfg.tp == 1 or (cfg.save is None and cfg.resume is None):
        return None
    import fsdp_ckpt

    version = getattr(fsdp_ckpt, "FORMAT_VERSION", 1)
    if version >= _CKPT_TP_FORMAT:
        return None
    flag = "--save" if cfg.save is not None else "--resume"
    return (
        f"{flag} with --tp {cfg.tp}: fsdp train checkpoints with fsdp-ckpt, and this "
        f"fsdp-ckpt (index format {version}) cannot store tensor-parallel parameters "
        f"(format {_CKPT_TP_FORMAT} can); train with --tp without --save/--resume, or "
        "without --tp"
    )


def tp_problem(cfg: TrainConfig, world_size: int, world: str) -> str | None:
    """Why ``cfg.tp`` (and ``cfg.sequence_parallel``) cannot run on ``world_size`` ranks with
    the other settings, or None. ``world`` names where the size comes from."""
    tp = cfg.tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return f"--tp must be an integer >= 1 (ranks per tensor-parallel group), got {tp!r}"
    if world_size % tp:
        return f"--tp {tp} must divide {world} (the data-parallel size is the world size / --tp)"
    if tp == 1:
        return None
    unsupported = [
        (
            cfg.backend != "torch",
            f"--backend {cfg.backend} (tensor parallelism "
            "runs on torch.distributed's process groups: --backend torch)",
        ),
        (
            cfg.hf_config is not None,
            "--hf-config (plans exist for the built-in GPT and Llama only)",
        ),
        (
            cfg.hf_pretrained is not None,
            "--hf-pretrained (plans exist for the built-in GPT and Llama only)",
        ),
    ]
    for bad, what in unsupported:
        if bad:
            return f"--tp {tp} is not supported with {what}"
    from ..models import tp_model_problem

    problem = tp_model_problem(
        cfg.model_config(),
        tp,
        seq_len=cfg.sequence_length(),
        sequence_parallel=cfg.sequence_parallel,
    )
    if problem is not None:
        return f"--tp {tp} with --model {cfg.model}: {problem}"
    return checkpoint_tp_problem(cfg)


def resume_tp_problem(cfg: TrainConfig, extra: dict[str, Any]) -> str | None:
    """Why the checkpoint whose extra data is ``extra`` cannot continue at ``cfg.tp``: its
    fused projections hold their rows in the order of the tp size it was saved at (Note
    [fused projections under tensor parallelism] in fsdp.models._tp_plan); or None."""
    saved = extra.get("tp", 1)
    if saved == cfg.tp:
        return None
    return (
        f"--resume: {cfg.resume} was saved with --tp {saved}, and continues only at --tp "
        f"{saved} (the fused qkv and MLP weights are stored in an order that depends on the "
        f"tensor-parallel size), got --tp {cfg.tp}"
    )


def train_meshes(backend: Any, cfg: TrainConfig) -> tuple[Any, Any]:
    """(the mesh `fully_shard` takes, the tp mesh) for ``cfg`` over ``backend``'s world."""
    import torch

    from ..models import device_meshes

    return device_meshes(
        torch.device(backend.device).type,
        backend.world_size,
        cfg.tp,
        cfg.strategy,
        shard_size=cfg.shard_size,
    )
