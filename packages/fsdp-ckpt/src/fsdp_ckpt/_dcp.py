"""Conversion to and from ``torch.distributed.checkpoint`` (DCP), in one process.

`to_dcp` writes the state dict torch FSDP users save with DCP::

    {"model": {fqn: tensor}, "optim": {"state": {fqn: {"exp_avg": .., "step": ..}},
                                        "param_groups": [{..., "params": [fqn, ...]}]}}

(the layout of ``torch.distributed.checkpoint.state_dict.get_state_dict``), so
``dcp.load`` into an FSDP2 model's sharded state dict reshards it there. `from_dcp` reads such a
checkpoint (the key names are arguments) and writes an fsdp-ckpt checkpoint of world size one,
which then loads at any world size. Both hold the whole state in memory once.

DCP pickles its metadata and non-tensor values; `from_dcp` reads them without the full pickle
machinery (see `_dcp_read`: an allow-list of DCP's classes, ``weights_only`` for values), so a
crafted checkpoint is refused with `CheckpointCorruptError` instead of running code.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ._args import check_bool, check_keep_last, check_key, check_path, check_storage
from ._dcp_read import load_into, read_metadata, template
from ._directory import CheckpointDir
from ._errors import CheckpointError
from ._export import Assembler, check_output, model_entries
from ._index import Chunk, Index, InlineItem, OptimizerSection, StateItem, TensorEntry, ValueItem
from ._inspect import verify_opened
from ._open import open_guarded
from ._optim_state import DCP_CLASS
from ._save import _RankWrite, commit_one_rank, shard_file
from ._storage import Storage, storage_for
from ._tensor_file import TensorSource, dtype_name
from ._values import can_inline, decode_value, encode_value, inline_tensor, tensor_from_inline
from ._version import __version__

__all__ = ["to_dcp", "from_dcp"]


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    # no_dist=True is what we mean; DCP still warns that it "assumes" it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _decode(value: Any, source: str) -> Any:
    return decode_value(value, tensors=lambda r: torch.empty(0), source=source)


def _optim_state_dict(section: OptimizerSection, asm: Assembler, source: str) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {}
    for fqn, items in section.state.items():
        state[fqn] = {}
        for name, item in items.items():
            if isinstance(item, TensorEntry):
                state[fqn][name] = asm.tensor(item)
            elif isinstance(item, InlineItem):
                state[fqn][name] = tensor_from_inline(item.tensor, source=source)
            else:
                state[fqn][name] = _decode(item.value, source)
    groups = [{k: _decode(v, source) for k, v in g.items()} for g in section.param_groups]
    return {"state": state, "param_groups": groups}


def _check_keys(model_key: object, optim_key: object) -> None:
    check_key(model_key, "model_key")
    check_key(optim_key, "optim_key")
    if model_key == optim_key:
        raise ValueError(
            f"model_key and optim_key must differ (both name one entry of the DCP state "
            f"dict), got {model_key!r} for both"
        )


def to_dcp(
    path: str | os.PathLike[str],
    dcp_dir: str | os.PathLike[str],
    *,
    model_key: str = "model",
    optim_key: str = "optim",
    storage: Storage | None = None,
) -> str:
    """Write the checkpoint at ``path`` as a DCP checkpoint in ``dcp_dir`` (verified first)."""
    # the submodules: torch.distributed.checkpoint re-exports them without declaring it
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    source = check_path(path)
    _check_keys(model_key, optim_key)
    check_output(check_path(dcp_dir, "dcp_dir"), directory=True)
    check_storage(storage)
    store = storage_for(path, storage)
    opened = open_guarded(store, source)
    verify_opened(store, opened)
    asm = Assembler(store, opened)
    state: dict[str, Any] = {
        model_key: {k: asm.tensor(e) for k, e in model_entries(opened).items()}
    }
    if opened.index.optimizer is not None:
        state[optim_key] = _optim_state_dict(opened.index.optimizer, asm, source)
    target = os.fspath(dcp_dir)
    with _single_process():
        dcp_save(state, storage_writer=FileSystemWriter(target), no_dist=True)
    return target


def _state_item(
    value: Any,
    param_shape: tuple[int, ...] | None,
    key: str,
    tensors: dict[str, TensorSource],
    where: str,
) -> StateItem:
    file = shard_file(0)
    if not isinstance(value, torch.Tensor):
        return ValueItem(encode_value(value, where=where, external=None))
    if tuple(value.shape) != param_shape and can_inline(value):
        return InlineItem(inline_tensor(value))
    tensors[key] = value
    chunks = (Chunk(file, key, 0, value.numel()),) if value.numel() else ()
    return TensorEntry(
        tuple(value.shape),
        dtype_name(value.dtype),
        chunks,
        per_param=tuple(value.shape) == param_shape,
    )


def _optimizer_section(
    optim: dict[str, Any], params: dict[str, TensorEntry], tensors: dict[str, TensorSource]
) -> OptimizerSection:
    state: dict[str, dict[str, StateItem]] = {}
    for fqn, items in optim.get("state", {}).items():
        shape = params[fqn].shape if fqn in params else None
        state[fqn] = {
            str(n): _state_item(
                v, shape, f"optim/{fqn}/{n}", tensors, f"DCP optimizer state {n!r} of {fqn}"
            )
            for n, v in items.items()
        }
    groups = tuple(
        {
            k: encode_value(v, where=f"DCP param_groups[{i}][{k!r}]", external=None)
            for k, v in g.items()
        }
        for i, g in enumerate(optim.get("param_groups", []))
    )
    return OptimizerSection(DCP_CLASS, groups, state)


def _model_section(
    model: Any, model_key: str, source: str, tensors: dict[str, TensorSource]
) -> dict[str, TensorEntry]:
    if not isinstance(model, dict) or not all(isinstance(t, torch.Tensor) for t in model.values()):
        raise CheckpointError(f"{source}: {model_key!r} is not a dict of tensors by FQN")
    params = {}
    for fqn, t in model.items():
        key = f"param/{fqn}"
        tensors[key] = t
        chunks = (Chunk(shard_file(0), key, 0, t.numel()),) if t.numel() else ()
        params[fqn] = TensorEntry(tuple(t.shape), dtype_name(t.dtype), chunks)
    return params


def _to_index(
    state: dict[str, Any], model_key: str, optim_key: str, source: str
) -> tuple[Index, dict[str, TensorSource]]:
    tensors: dict[str, TensorSource] = {}
    try:
        params = _model_section(state[model_key], model_key, source, tensors)
        optim = state.get(optim_key)
        if optim is not None and not isinstance(optim, dict):
            raise TypeError(f"{optim_key!r} is not a dict")
        section = None if optim is None else _optimizer_section(optim, params, tensors)
    except (TypeError, AttributeError, KeyError) as exc:  # a value we cannot store
        raise CheckpointError(f"{source}: cannot convert ({exc})") from None
    return Index(1, {}, params, {}, section, None, __version__), tensors


def from_dcp(
    dcp_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    model_key: str = "model",
    optim_key: str = "optim",
    keep_last: int = 1,
    storage: Storage | None = None,
    trust: bool = False,
) -> str:
    """Write the DCP checkpoint in ``dcp_dir`` as an fsdp-ckpt checkpoint at ``path``
    (committed like `save`); returns the version directory. Model tensors (parameters and
    buffers) are read from ``model_key``, optimizer state from ``optim_key`` if present.

    DCP's metadata is a pickle: it is read with an allow-list of DCP's own classes and its
    values with ``torch.load(weights_only=True)``, so a crafted checkpoint raises
    `CheckpointCorruptError` instead of running code; its data files must be regular files
    inside ``dcp_dir``. ``trust=True`` uses plain pickle (custom planners, storage
    extensions): only for checkpoints whose origin you trust."""
    source = check_path(dcp_dir, "dcp_dir")
    check_path(path)
    _check_keys(model_key, optim_key)
    check_keep_last(keep_last)
    check_storage(storage)
    check_bool(trust, "trust")
    metadata = read_metadata(source, trust=trust)
    state = template(metadata, source, (model_key, optim_key))
    if model_key not in state:
        tops = sorted(
            {str(p[0]) for p in (metadata.planner_data or {}).values()}
            | {k.split(".")[0] for k in metadata.state_dict_metadata}
        )
        raise ValueError(
            f"model_key: the DCP checkpoint in {source} has no {model_key!r} entry "
            f"(top-level keys: {tops})"
        )
    with _single_process():
        load_into(state, source, metadata, trust=trust)
    part, tensors = _to_index(state, model_key, optim_key, source)
    store = storage_for(path, storage)
    directory = CheckpointDir(store, os.fspath(path))
    return commit_one_rank(directory, _RankWrite({shard_file(0): tensors}, part), keep_last)
