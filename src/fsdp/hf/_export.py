"""Hugging Face out: a checkpoint, or a live sharded model, as a ``save_pretrained`` directory.

`export_hf` reads a committed fsdp-ckpt checkpoint and `save_hf_pretrained` gathers a live
(sharded) model. Both write what ``transformers``' ``save_pretrained`` writes, so that
``AutoModelForCausalLM.from_pretrained(out_dir)`` loads it:

- ``config.json`` (and ``generation_config.json`` for models that generate), with ``dtype``
  and ``architectures`` set as ``save_pretrained`` sets them;
- the weights as safetensors files of at most ``max_shard_size`` bytes each:
  ``model.safetensors`` when one file holds everything, else ``model-00001-of-0000N.safetensors``
  ... and ``model.safetensors.index.json`` (``{"metadata": {"total_parameters", "total_size"},
  "weight_map": {name: file}}``).

Note [HF shard plan]: the files are planned before any tensor is read, from the shapes alone
(the checkpoint's index, or the parameters' global shapes), with the rule of
``huggingface_hub.split_torch_state_dict_into_shards``: walk the tensors in state-dict order;
a tensor larger than the maximum gets a file of its own (that file is larger than the maximum,
as in Hugging Face); otherwise it joins the open file unless that would pass the maximum, in
which case the open file is closed first. Tied weights are written once, under the name
Hugging Face keeps (the tie's source, e.g. ``transformer.wte.weight``, not ``lm_head.weight``).

Writing streams: tensors arrive one at a time (`fsdp_ckpt.iter_full_tensors`,
`fsdp_ckpt.iter_full_state_dict`), are added to their planned file's pending dict, and a
file is written (``safetensors.torch.save_file``, temporary name then rename) and dropped as
soon as its last tensor arrives. So the writer holds at most the open file plus one oversized
tensor: ``peak_shard_bytes <= max_shard_size + largest tensor``, reported in `HFExportReport`.

Sizes given as strings follow the project's rule (`fsdp_comm.parse_size`): units are powers of
1024, so the default ``"5GB"`` is 5 GiB, where Hugging Face reads ``"5GB"`` as 5 * 10**9 bytes.
Pass an int for an exact byte count.

transformers is imported only when needed (config handling, the model's layout for a
checkpoint); fsdp-ckpt itself never imports it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "HFExportReport",
    "export_hf",
    "save_hf_pretrained",
    "plan_shards",
    "parse_max_shard_size",
]

_log = logging.getLogger("fsdp")

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


@dataclass(frozen=True)
class HFExportReport:
    """What an export wrote. ``peak_shard_bytes`` is the most tensor data the writer held at
    once (rank 0; 0 on other ranks): at most ``max_shard_size + largest_tensor``."""

    out_dir: str
    files: tuple[str, ...]  # weight files, in file-number order
    weight_map: dict[str, str]  # tensor name -> file
    total_size: int  # bytes of tensor data (the index's metadata.total_size)
    total_parameters: int  # elements of the parameters written (buffers not counted)
    max_shard_size: int
    largest_tensor: int  # bytes
    peak_shard_bytes: int
    dropped_tied: tuple[str, ...] = field(default=())  # names not written: tied to another

    @property
    def num_tensors(self) -> int:
        return len(self.weight_map)


# ---- arguments -------------------------------------------------------------------------------


def parse_max_shard_size(value: int | str) -> int:
    """Bytes from an int or a size string (``"2GB"``: 2 GiB, `fsdp_comm.parse_size`'s rule)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"max_shard_size must be an int (bytes) or a size string such as "
            f"'2GB', got {type(value).__name__}"
        )
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"max_shard_size must be > 0 bytes, got {value}")
        return value
    from fsdp_comm import parse_size

    return parse_size(value, argument="max_shard_size")


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        found = _DTYPES.get(dtype.lower().removeprefix("torch."))
        if found is None:
            raise ValueError(f"dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
        return found
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(
        f"dtype must be a floating-point torch.dtype or a name "
        f"({', '.join(_DTYPES)}), got {dtype!r}"
    )


def _config_from_dict(d: Mapping[str, Any], source: str) -> Any:
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = dict(d)
    model_type = values.get("model_type")
    if not model_type:
        raise ValueError(f"config: {source} has no model_type")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"config: {source}: unknown model_type {model_type!r} for this transformers"
        )
    cls = CONFIG_MAPPING[model_type]
    config = cls.from_dict(values)
    assert isinstance(config, PretrainedConfig)
    return config


def _is_config(obj: Any) -> bool:
    return (
        hasattr(obj, "to_dict") and hasattr(obj, "save_pretrained") and hasattr(obj, "model_type")
    )


def _resolve_config(config: Any, *, saved: Any, where: str) -> Any:
    """A private copy of the transformers config to write (``saved``: the checkpoint's)."""
    if config is None:
        if saved is None:
            raise ValueError(
                f"no Hugging Face config: {where} records none (checkpoints "
                "saved by `fsdp train --hf-config` do). Pass the model's config: "
                "config= (a transformers PretrainedConfig, a config.json or its "
                "directory), or `fsdp export-hf --config PATH`"
            )
        if _is_config(saved):
            return copy.deepcopy(saved)
        if not isinstance(saved, Mapping):
            raise ValueError(f"{where}: its hf_config is not a config dict")
        return _config_from_dict(saved, f"{where} (extra['hf_config'])")
    if _is_config(config):
        return copy.deepcopy(config)
    if isinstance(config, Mapping):
        return _config_from_dict(config, "the dict passed as config")
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"config: no such file: {path} (pass a config.json or the directory holding one)"
            )
        try:
            values = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"config: cannot read {path} as JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"config: {path} does not hold a JSON object")
        return _config_from_dict(values, str(path))
    raise TypeError(
        "config must be a transformers PretrainedConfig, a dict, a config.json "
        f"path or None, got {type(config).__name__}"
    )


# ---- the model's state-dict layout -----------------------------------------------------------


@dataclass
class _Tensor:
    names: list[str]  # every name, state-dict order (tied weights have several)
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    name: str = ""  # the name written (set by _keep_names)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


def _layout(model: nn.Module) -> list[_Tensor]:
    """Parameters and persistent buffers in ``state_dict`` order, tied ones grouped."""
    found: dict[int, _Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        skip: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
        items = [(n, t, True) for n, t in mod._parameters.items()]
        items += [(n, t, False) for n, t in mod._buffers.items() if n not in skip]
        for name, t, is_param in items:
            if t is None:
                continue
            entry = found.get(id(t))
            if entry is None:
                found[id(t)] = _Tensor([prefix + name], tuple(t.shape), t.dtype, is_param)
            elif prefix + name not in entry.names:
                entry.names.append(prefix + name)
    return list(found.values())


def _tie_target_rule(model: Any) -> Callable[[str], bool]:
    """Whether a name is the target of a tie (the name Hugging Face drops on save)."""
    keys = getattr(model, "all_tied_weights_keys", None)  # transformers 5: {target: source}
    if not isinstance(keys, Mapping) or not keys:
        keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(keys, Mapping):
        exact = set(keys)
        return lambda name: name in exact
    if isinstance(keys, (list, tuple)):  # transformers 4: regular expressions
        patterns = [re.compile(p) for p in keys]
        return lambda name: any(p.search(name) for p in patterns)
    return lambda name: False


def _keep_names(layout: list[_Tensor], is_target: Callable[[str], bool]) -> list[str]:
    """Choose each tensor's written name; return the dropped (tied) names."""
    dropped = []
    for t in layout:
        sources = [n for n in t.names if not is_target(n)]
        t.name = sources[0] if sources else t.names[0]
        dropped += [n for n in t.names if n != t.name]
    return dropped


def _hf_class_name(model: nn.Module) -> str:
    for cls in type(model).__mro__:
        if cls.__module__.startswith("transformers."):
            return cls.__name__
    return type(model).__name__.removeprefix("FSDP")


def _meta_model(config: Any) -> nn.Module | None:
    """The config's model on the meta device (its names, shapes and ties), or None."""
    import transformers

    config = copy.deepcopy(config)
    classes = [getattr(transformers, a, None) for a in (config.architectures or [])]
    cls = next((c for c in classes if isinstance(c, type) and issubclass(c, nn.Module)), None)
    try:
        with torch.device("meta"):
            if cls is not None:
                return cls(config)
            auto = transformers.AutoModelForCausalLM
            # unannotated in transformers (unused-ignore: Any when it is not installed)
            model: nn.Module = auto.from_config(config)  # type: ignore[no-untyped-call, unused-ignore]
            return model
    except Exception as exc:  # a model type without a causal-LM head, a custom class, ...
        _log.warning(
            "export-hf: cannot build the %s model of the config (%s: %s); writing the "
            "checkpoint's names as they are",
            config.model_type,
            type(exc).__name__,
            exc,
        )
        return None


def _check_conversions(model: nn.Module) -> None:
    """Refuse models whose on-disk layout transformers converts on load (fused MoE experts):
    their in-memory names are not what ``from_pretrained`` reads."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter
    except ImportError:  # transformers 4: no conversions
        return
    try:
        # a transformers PreTrainedModel, typed here as nn.Module
        mapping = get_model_conversion_mapping(model, add_legacy=False)  # type: ignore[arg-type, unused-ignore]
    except Exception:  # the mapping's own lookup failing means none applies
        return
    if any(isinstance(m, WeightConverter) for m in mapping if not isinstance(m, PrefixChange)):
        raise ValueError(
            f"{type(model).__name__}: transformers stores this model's weights in "
            "another layout than it holds them in memory (a weight conversion "
            "mapping); export-hf does not convert them back yet"
        )


# ---- planning --------------------------------------------------------------------------------


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Names per file, by Hugging Face's rule (Note [HF shard plan]): greedy in the given
    order; a tensor over the maximum gets a file of its own, numbered when it is met."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for name, size in sizes:
        if size > max_shard_size:
            shards.append([name])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    return shards


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


@dataclass
class _Plan:
    tensors: list[_Tensor]  # written, in state-dict order
    out_dtype: dict[str, torch.dtype]  # by written name
    weight_map: dict[str, str]
    files: list[str]
    max_shard_size: int
    dropped: list[str]

    @property
    def sizes(self) -> dict[str, int]:
        return {
            t.name: t.numel * torch.empty(0, dtype=self.out_dtype[t.name]).element_size()
            for t in self.tensors
        }


def _plan(
    tensors: list[_Tensor], dropped: list[str], max_shard_size: int, dtype: torch.dtype | None
) -> _Plan:
    out_dtype = {
        t.name: dtype if dtype is not None and t.dtype.is_floating_point else t.dtype
        for t in tensors
    }
    plan = _Plan(tensors, out_dtype, {}, [], max_shard_size, dropped)
    sizes = plan.sizes
    shards = plan_shards(((t.name, sizes[t.name]) for t in tensors), max_shard_size)
    plan.files = _file_names(len(shards))
    plan.weight_map = {name: f for f, names in zip(plan.files, shards) for name in names}
    return plan


# ---- writing ---------------------------------------------------------------------------------


class _Writer:
    """Rank 0's side: pending files, each written and dropped when its last tensor arrives."""

    def __init__(self, out_dir: str, plan: _Plan) -> None:
        self.out_dir = out_dir
        self.plan = plan
        self.remaining = {f: 0 for f in plan.files}
        for f in plan.weight_map.values():
            self.remaining[f] += 1
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.pending_bytes = 0
        self.peak = 0
        self.written: list[str] = []
        for f, n in self.remaining.items():
            if n == 0:  # a model without tensors: one empty file, as save_pretrained writes
                self._flush(f)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        file = self.plan.weight_map[name]
        out = tensor.to(self.plan.out_dtype[name]).contiguous()
        self.pending.setdefault(file, {})[name] = out
        self.pending_bytes += out.numel() * out.element_size()
        self.peak = max(self.peak, self.pending_bytes)
        self.remaining[file] -= 1
        if self.remaining[file] == 0:
            self._flush(file)

    def _flush(self, file: str) -> None:
        from safetensors.torch import save_file

        tensors = self.pending.pop(file, {})
        tmp = os.path.join(self.out_dir, f".{file}.tmp-{os.getpid()}")
        try:
            save_file(tensors, tmp, metadata={"format": "pt"})
            os.replace(tmp, os.path.join(self.out_dir, file))
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.pending_bytes -= sum(t.numel() * t.element_size() for t in tensors.values())
        self.written.append(file)

    def finish(self, config: Any, generation_config: Any, architecture: str | None) -> None:
        missing = [f for f, n in self.remaining.items() if n]
        if missing:
            raise RuntimeError(f"export-hf: files {missing} did not receive every tensor")
        floats = [d for d in self.plan.out_dtype.values() if d.is_floating_point]
        if floats:
            config.dtype = str(floats[0]).removeprefix("torch.")
        if architecture is not None:
            config.architectures = [architecture]
        config.save_pretrained(self.out_dir)
        if generation_config is not None:
            generation_config.save_pretrained(self.out_dir)
        index_path = os.path.join(self.out_dir, SAFE_WEIGHTS_INDEX_NAME)
        if len(self.plan.files) > 1:
            sizes = self.plan.sizes
            index = {
                "metadata": {
                    "total_parameters": sum(t.numel for t in self.plan.tensors if t.is_param),
                    "total_size": sum(sizes.values()),
                },
                "weight_map": self.plan.weight_map,
            }
            tmp = f"{index_path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, index_path)
        self._remove_stale()

    def _remove_stale(self) -> None:
        """Weight files of an earlier save that this one does not replace (as
        ``save_pretrained`` does), and the other layout's entry point."""
        keep = set(self.plan.files)
        sharded = len(self.plan.files) > 1
        for name in os.listdir(self.out_dir):
            stale = (
                (_SHARD_NAME.fullmatch(name) and name not in keep)
                or (sharded and name == SAFE_WEIGHTS_NAME)
                or (not sharded and name == SAFE_WEIGHTS_INDEX_NAME)
            )
            path = os.path.join(self.out_dir, name)
            if stale and os.path.isfile(path):
                os.remove(path)

    def report(self) -> HFExportReport:
        return _report(self.out_dir, self.plan, self.peak)


def _report(out_dir: str, plan: _Plan, peak: int) -> HFExportReport:
    sizes = plan.sizes
    return HFExportReport(
        out_dir,
        tuple(plan.files),
        dict(plan.weight_map),
        sum(sizes.values()),
        sum(t.numel for t in plan.tensors if t.is_param),
        plan.max_shard_size,
        max(sizes.values(), default=0),
        peak,
        tuple(plan.dropped),
    )


def _prepare_out(out_dir: str | os.PathLike[str]) -> str:
    out = os.fspath(out_dir)
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"out_dir: {out} exists and is not a directory")
    return out


def _generation_config(model: Any) -> Any:
    try:
        if model is not None and model.can_generate():
            return getattr(model, "generation_config", None)
    except Exception:  # not a transformers model
        return None
    return None


# ---- from a checkpoint -----------------------------------------------------------------------


def _checkpoint_tensors(
    index: Any, meta: nn.Module | None, where: str
) -> tuple[list[_Tensor], dict[str, str], list[str]]:
    """The tensors to write (state-dict order, HF names), their checkpoint names, dropped."""
    from fsdp_ckpt import CheckpointError

    entries = {**index.params, **index.buffers}
    params = set(index.params)

    def dtype_of(name: str) -> torch.dtype:
        d = getattr(torch, entries[name].dtype, None)
        if not isinstance(d, torch.dtype):
            raise CheckpointError(f"{where}: {name} has an unknown dtype {entries[name].dtype}")
        return d

    if meta is None:
        tensors = [
            _Tensor([n], tuple(e.shape), dtype_of(n), n in params, n) for n, e in entries.items()
        ]
        return tensors, {n: n for n in entries}, []
    layout = _layout(meta)
    dropped = _keep_names(layout, _tie_target_rule(meta))
    source: dict[str, str] = {}
    missing, problems = [], []
    covered: set[str] = set()
    for t in layout:
        present = [n for n in t.names if n in entries]
        covered.update(present)
        if not present:
            missing.append(t.name)
            continue
        if len(present) > 1:
            problems.append(
                f"{' and '.join(present)} are separate tensors in the checkpoint "
                "but tied in the config (tie_word_embeddings?)"
            )
        name = t.name if t.name in present else present[0]
        if tuple(entries[name].shape) != t.shape:
            problems.append(
                f"{name}: shape {list(entries[name].shape)} in the checkpoint, "
                f"{list(t.shape)} in the config's model"
            )
        source[t.name] = name
        t.dtype, t.is_param = dtype_of(name), name in params
    unexpected = [n for n in entries if n not in covered]
    if missing:
        problems.append(
            f"missing from the checkpoint: {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}"
        )
    if unexpected:
        problems.append(
            f"not in the config's model: {', '.join(unexpected[:8])}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )
    if problems:
        raise ValueError(
            f"{where} does not hold the {type(meta).__name__} of this config: "
            + "; ".join(problems)
            + " (wrong --config / config=?)"
        )
    return [t for t in layout if t.name in source], source, dropped


def export_hf(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
) -> HFExportReport:
    """Write the model of the fsdp-ckpt checkpoint at ``checkpoint_dir`` as a Hugging Face
    ``save_pretrained`` directory ``out_dir`` (created if needed). One process; reads one
    tensor at a time, holds at most one file's worth (Note [HF shard plan]).

    ``config``: a transformers ``PretrainedConfig``, a dict, a ``config.json`` path (or its
    directory), or None for the one the checkpoint records (``fsdp train --hf-config``
    records it in ``extra["hf_config"]``). ``max_shard_size``: bytes, or a size string in
    powers of 1024 (``"5GB"`` is 5 GiB). ``dtype``: cast floating tensors (``"bf16"``,
    ``torch.float16``, ...); None keeps the checkpoint's. The checkpoint is verified first;
    `fsdp_ckpt.CheckpointError` if it is missing or damaged, ValueError when it does not
    match the config."""
    import fsdp_ckpt

    limit = parse_max_shard_size(max_shard_size)
    cast = _dtype(dtype)
    out = _prepare_out(out_dir)
    where = f"the checkpoint at {os.fspath(checkpoint_dir)}"
    info = fsdp_ckpt.inspect_checkpoint(checkpoint_dir)
    extra = info.index.extra if isinstance(info.index.extra, dict) else {}
    cfg = _resolve_config(config, saved=extra.get("hf_config"), where=where)
    meta = _meta_model(cfg)
    if meta is not None:
        _check_conversions(meta)
    tensors, source, dropped = _checkpoint_tensors(info.index, meta, where)
    plan = _plan(tensors, dropped, limit, cast)
    # The version directory inspected, so a save committing meanwhile cannot change what is read.
    stream = fsdp_ckpt.iter_full_tensors(info.directory, names=[source[t.name] for t in tensors])
    os.makedirs(out, exist_ok=True)
    writer = _Writer(out, plan)
    hf_name = {source[t.name]: t.name for t in tensors}
    for name, tensor in stream:
        writer.add(hf_name[name], tensor)
        del tensor
    writer.finish(cfg, _generation_config(meta), _hf_class_name(meta) if meta is not None else None)
    _log.info(
        "export-hf: wrote %d files (%d bytes) to %s",
        len(plan.files),
        writer.report().total_size,
        out,
    )
    return writer.report()


# ---- from a live model -----------------------------------------------------------------------


def _world(model: nn.Module, backend: Any) -> Any:
    if backend is not None:
        return backend
    if any(getattr(m, "_fsdp_state", None) is not None for m in model.modules()):
        from fsdp_engine import model_backend

        return model_backend(model)
    return None


def save_hf_pretrained(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    config: Any = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
    backend: Any = None,
) -> HFExportReport:
    """Write a live model (sharded with `fully_shard`, or plain) as a Hugging Face
    ``save_pretrained`` directory. Collective: every rank calls it; whole tensors are
    gathered one at a time, and rank 0 writes each file as soon as it is complete, so rank 0
    holds at most one file's worth (plus one oversized tensor) and the others one tensor.

    ``config`` defaults to ``model.config`` (a transformers model); see `export_hf` for it,
    ``max_shard_size`` and ``dtype``. ``backend``: the `fsdp_comm.Backend` spanning every rank
    (found in a sharded model). If rank 0 cannot write, every rank raises after the gather.
    Returns the report on every rank (``peak_shard_bytes`` is rank 0's; 0 elsewhere)."""
    import fsdp_ckpt

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    limit = parse_max_shard_size(max_shard_size)
    cast = _dtype(dtype)
    out = _prepare_out(out_dir)
    cfg = _resolve_config(
        config, saved=getattr(model, "config", None), where=f"the model ({type(model).__name__})"
    )
    _check_conversions(model)
    layout = _layout(model)
    dropped = _keep_names(layout, _tie_target_rule(model))
    plan = _plan(layout, dropped, limit, cast)
    world = _world(model, backend)
    rank = 0 if world is None else world.rank
    stream = fsdp_ckpt.iter_full_state_dict(model, names=[t.name for t in layout], backend=world)
    writer, failure = None, None
    if rank == 0:
        try:
            os.makedirs(out, exist_ok=True)
            writer = _Writer(out, plan)
        except Exception as exc:
            failure = exc
    for name, tensor in stream:  # every rank runs every step: each is a collective
        if writer is not None and failure is None and tensor is not None:
            try:
                writer.add(name, tensor)
            except Exception as exc:  # keep gathering so the other ranks are not left waiting
                failure = exc
        del tensor
    if writer is not None and failure is None:
        try:
            writer.finish(cfg, _generation_config(model), _hf_class_name(model))
        except Exception as exc:
            failure = exc
    if world is not None and world.world_size > 1:
        flag = torch.tensor(
            [0 if failure is None else 1], dtype=torch.int64, device=torch.device(world.device)
        )
        world.all_reduce(flag)
        if failure is None and int(flag.item()):
            raise RuntimeError(
                f"save_hf_pretrained: rank 0 could not write {out} (its error says why)"
            )
    if failure is not None:
        raise failure
    return writer.report() if writer is not None else _report(out, plan, 0)
