"""Hugging Face weights in: a ``save_pretrained`` directory loaded into a model that
`fully_shard` sharded, each rank reading only the rows it keeps (``fsdp train --hf-pretrained
DIR``; needs ``pip install "fsdp[hf]"``).

`load_hf_pretrained(model, directory)` is the library function. `build_hf_pretrained` builds
the directory's causal LM on the meta device (nothing allocated), `check_hf_pretrained`
checks a directory before any rank starts, and `tokenized_corpus` turns the training text
into the directory's tokens.

Note [sharded safetensors read]
    A directory holds ``model.safetensors``, or ``model.safetensors.index.json`` whose
    ``weight_map`` names the file of each tensor. Everything is checked before a byte of
    weights is read: file names confined to the directory, every model tensor found (under
    any of the names it is registered as, so a tied ``lm_head.weight`` the file leaves out
    takes ``wte.weight``; with or without the model's ``base_model_prefix``), every global
    shape equal to the file's. A sharded parameter is a DTensor ``Shard(0)`` over this rank's
    rows of the unit's flat shard: `fsdp_engine.sharded_layout` gives each parameter's first
    element and length on this rank (the engine's ``torch.chunk`` arithmetic, Note
    [rank-major layout]) with a writable view of them. The loader reads exactly those rows,
    ``safe_open(...).get_slice(name)[start:stop]``, which copies that byte range out of the
    memory-mapped file, and copies them into the view, cast to the parameter's dtype. No rank
    reads or allocates a whole sharded tensor; `HFLoadReport` counts the bytes each rank read
    and its largest single read. Buffers are not sharded and are read whole; a plain
    (unsharded) model reads everything.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._model import HFModel, _blocks, _last_line, max_positions

if TYPE_CHECKING:  # annotations only: the training corpus is fsdp.train's
    from ..train import ByteCorpus

__all__ = [
    "HFLoadReport",
    "load_hf_pretrained",
    "build_hf_pretrained",
    "check_hf_pretrained",
    "load_tokenizer",
    "tokenized_corpus",
    "SINGLE_FILE",
    "INDEX_FILE",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: Keys of buffers transformers now computes that older checkpoints still hold (transformers
#: ignores them too, in ``_adjust_missing_and_unexpected_keys``).
_IGNORED_IN_FILES = (r"rotary_emb\.inv_freq", r"(^|\.)position_ids$")
_SHOWN = 12  # names listed in an error before "and N more"
_DEFAULT_POSITIONS = 1024
_log = logging.getLogger("fsdp")


@dataclass
class HFLoadReport:
    """What `load_hf_pretrained` did on this rank."""

    directory: str
    files: list[str]  # the safetensors files opened (names in the directory)
    loaded: list[str]  # the model's tensors given values (their first names)
    missing: list[str]  # model tensors the files lack (only with strict=False)
    unexpected: list[str]  # file tensors the model lacks (only with strict=False)
    bytes_read: int = 0  # bytes this rank read from the files (its slices, in file dtypes)
    largest_read_bytes: int = 0  # the largest single read
    full_bytes: int = 0  # the whole of the loaded tensors in the files (every rank's share)
    read_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key -> rows read


@dataclass(frozen=True)
class _Match:
    names: tuple[str, ...]  # every name the model registers the tensor under
    key: str  # the file's name for it
    file: Path
    shape: tuple[int, ...]  # the model's (global) shape
    is_param: bool


def _shown(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def _safe_open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # a truncated or foreign file: safetensors' own error types
        raise ValueError(f"{path}: not a readable safetensors file: {_last_line(exc)}") from None


def _index_files(directory: Path, index: Path) -> dict[str, Path]:
    try:
        data = json.loads(index.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{index}: cannot read it as JSON: {exc}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    ):
        raise ValueError(f"{index}: no weight_map from tensor names to file names")
    root = directory.resolve()
    paths: dict[str, Path] = {}
    for name in sorted(set(weight_map.values())):
        path = directory / name
        if Path(name).is_absolute() or path.resolve().parent != root:
            raise ValueError(f"{index}: names the file {name!r}, which is not in {directory}")
        if not path.is_file():
            raise ValueError(f"{index}: names the file {name}, which {directory} lacks")
        paths[name] = path
    return {key: paths[name] for key, name in weight_map.items()}


def weight_map(directory: str | Path) -> dict[str, Path]:
    """Each tensor name of the directory's weights and the file that holds it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory")
    single, index = directory / SINGLE_FILE, directory / INDEX_FILE
    if single.is_file():  # transformers' order: the single file first
        with _safe_open(single) as f:
            return {key: single for key in f.keys()}
    if index.is_file():
        return _index_files(directory, index)
    pickles = sorted(p.name for p in directory.glob("pytorch_model*.bin*"))
    if pickles:
        raise ValueError(
            f"{directory} holds {pickles[0]}, PyTorch's pickled format, which is "
            "not read (unpickling runs code): save the model with "
            "save_pretrained, whose default is safetensors"
        )
    raise ValueError(
        f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE} (what save_pretrained writes)"
    )


def _groups(model: nn.Module) -> tuple[list[tuple[tuple[str, ...], bool]], set[str]]:
    """Every parameter and persistent buffer as (all its names, is a parameter), and the
    names of the non-persistent buffers (never in files)."""
    names: dict[int, list[str]] = {}
    kinds: dict[int, bool] = {}
    transient: set[str] = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for pname, p in mod._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(prefix + pname)
                kinds[id(p)] = True
        for bname, b in mod._buffers.items():
            if b is None:
                continue
            if bname in mod._non_persistent_buffers_set:
                transient.add(prefix + bname)
            else:
                names.setdefault(id(b), []).append(prefix + bname)
                kinds.setdefault(id(b), False)
    return [(tuple(dict.fromkeys(n)), kinds[i]) for i, n in names.items()], transient


def _candidates(model: nn.Module, name: str) -> list[str]:
    """The names a file may hold ``name`` under: itself, and without (or with) the model's
    ``base_model_prefix`` (a base model's checkpoint into a model with a head, or back)."""
    out = [name]
    prefix = getattr(model, "base_model_prefix", "") or ""
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        elif not hasattr(model, prefix):
            out.append(f"{prefix}.{name}")
    return out


def _patterns(model: nn.Module, attr: str, extra: tuple[str, ...] = ()) -> re.Pattern[str] | None:
    found = [*(getattr(model, attr, None) or ()), *extra]
    return re.compile("|".join(f"({p})" for p in found)) if found else None


def _tensor_of(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    value = mod._parameters.get(attr)
    if value is not None:
        return value
    buffer = mod._buffers[attr]
    assert buffer is not None, f"{name}: a None buffer is in no state_dict"
    return buffer


def _plan(
    model: nn.Module, files: dict[str, Path], directory: Path, strict: bool
) -> tuple[list[_Match], list[str], list[str]]:
    """Which file tensor each model tensor takes, the missing and unexpected names; checks
    the shapes in the files' headers (reads no tensor data)."""
    groups, transient = _groups(model)
    matches: list[_Match] = []
    missing: list[str] = []
    used: set[str] = set()
    for names, is_param in groups:
        keys = [c for n in names for c in _candidates(model, n) if c in files]
        if not keys:
            missing.append(names[0])
            continue
        used.update(keys)
        shape = tuple(_tensor_of(model, names[0]).shape)
        matches.append(_Match(names, keys[0], files[keys[0]], shape, is_param))
    ignore_missing = _patterns(model, "_keys_to_ignore_on_load_missing")
    missing = [m for m in missing if ignore_missing is None or not ignore_missing.search(m)]
    transient_keys = {c for n in transient for c in _candidates(model, n)}
    ignore_unexpected = _patterns(model, "_keys_to_ignore_on_load_unexpected", _IGNORED_IN_FILES)
    unexpected = sorted(
        k
        for k in files
        if k not in used
        and k not in transient_keys
        and (ignore_unexpected is None or not ignore_unexpected.search(k))
    )
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} tensors of the model are not in the files: {_shown(missing)}"
            )
        if unexpected:
            parts.append(
                f"{len(unexpected)} tensors in the files are not in the model: {_shown(unexpected)}"
            )
        raise ValueError(
            f"{directory}: does not match the model: {'; '.join(parts)} "
            "(strict=False loads what matches)"
        )
    _check_shapes(matches, directory)
    return matches, missing, unexpected


def _check_shapes(matches: list[_Match], directory: Path) -> None:
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for m in matches:
            if m.file not in opened:
                opened[m.file] = stack.enter_context(_safe_open(m.file))
            try:
                found = tuple(opened[m.file].get_slice(m.key).get_shape())
            except Exception as exc:  # an index naming a file that lacks the tensor
                raise ValueError(
                    f"{m.file}: has no tensor {m.key} (its index says it does): {_last_line(exc)}"
                ) from None
            if found != m.shape:
                raise ValueError(
                    f"{m.key} in {m.file}: the file holds shape {list(found)}, "
                    f"the model's {m.names[0]} has shape {list(m.shape)}"
                )


def _on_meta(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _default_device(model: nn.Module) -> torch.device:
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _materialize(model: nn.Module, device: torch.device) -> set[nn.Module]:
    """Storage on ``device`` for the tensors on meta, as ``to_empty`` gives it (the engine
    takes moved shards back at its first forward), but keeping each parameter object, so
    tied parameters stay tied (``to_empty`` makes new ones for plain tensors). Buffers new
    here become zeros; returns the modules whose non-persistent buffers did."""
    zeroed: set[nn.Module] = set()
    done: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                if p is not None and p.device.type == "meta" and id(p) not in done:
                    done.add(id(p))
                    fresh = nn.Parameter(
                        torch.empty_like(p, device=device), requires_grad=p.requires_grad
                    )
                    torch.utils.swap_tensors(p, fresh)  # type: ignore[no-untyped-call]  # unannotated in torch
            for n, b in m._buffers.items():
                if b is not None and b.device.type == "meta":
                    m._buffers[n] = torch.zeros_like(b, device=device)
                    if n in m._non_persistent_buffers_set:
                        zeroed.add(m)
    return zeroed


def _recompute_buffers(model: nn.Module, zeroed: set[nn.Module]) -> None:
    """Non-persistent buffers (rotary ``inv_freq``: never in a file) computed again by
    transformers' ``_init_weights``, as ``from_pretrained`` does: after ``to_empty`` they
    hold garbage. Only modules without parameters of their own (``_init_weights`` would
    initialise those too); a module in ``zeroed`` that cannot be recomputed is warned about."""
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for name, m in model.named_modules():
            if not any(
                b is not None and n in m._non_persistent_buffers_set for n, b in m._buffers.items()
            ):
                continue
            if callable(init) and not any(p is not None for p in m._parameters.values()):
                init(m)
                if m in zeroed and all(
                    not b.any()
                    for n, b in m._buffers.items()
                    if b is not None and n in m._non_persistent_buffers_set
                ):
                    _log.warning(
                        "transformers' _init_weights left the non-persistent buffers "
                        "of %s (%s) zero (transformers >= 5 computes rotary buffers)",
                        name or "<root>",
                        type(m).__name__,
                    )
            elif m in zeroed:
                _log.warning(
                    "non-persistent buffers of %s (%s) were on the meta device and "
                    "are zeros now: nothing computes them again",
                    name or "<root>",
                    type(m).__name__,
                )


def _sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    if getattr(model, "_fsdp_state", None) is not None:
        return True
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "load_hf_pretrained: the model has DTensor parameters but its root is "
            "not a fully_shard unit: fully_shard the root module too (after its "
            "blocks)"
        )
    return False


def load_hf_pretrained(
    model: nn.Module,
    directory: str | Path,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
) -> HFLoadReport:
    """Load a Hugging Face ``save_pretrained`` directory (``model.safetensors``, or shards
    with ``model.safetensors.index.json``) into ``model``, each rank reading only the rows of
    each sharded parameter it keeps (Note [sharded safetensors read]).

    ``model`` is sharded with `fully_shard` (root included; every rank calls this), or a
    plain module (everything is read). A model still on the meta device (built there, then
    sharded) is materialised on ``device`` first (default: where its other tensors are, else
    CPU), keeping tied parameters tied; one materialised with ``to_empty`` works too. The
    non-persistent buffers of transformers models (rotary ``inv_freq``) are computed again
    either way. Values are cast to the model's dtypes (a bf16 file into fp32 parameters).
    Tied weights the files leave out (``lm_head`` when ``tie_word_embeddings``) take the
    tensor they share.

    Raises `ValueError` before reading anything: a missing directory or file, a tensor whose
    shape differs (naming it, its file and both shapes), and with ``strict`` any model tensor
    missing from the files or file tensor the model lacks (transformers' ignored keys, such as
    old rotary ``inv_freq`` buffers, excepted). With ``strict=False`` those are returned in
    the report and the missing tensors keep their values (zeros if materialised here).
    """
    directory = Path(directory)
    files = weight_map(directory)
    matches, missing, unexpected = _plan(model, files, directory, strict)
    sharded = _sharded(model)
    zeroed: set[nn.Module] = set()
    if _on_meta(model):
        zeroed = _materialize(
            model, torch.device(device) if device is not None else _default_device(model)
        )
        _zero_missing(model, missing)
    _recompute_buffers(model, zeroed)
    layout = {}
    if sharded:
        from fsdp_engine import sharded_layout

        layout = {s.fqn: s for s in sharded_layout(model)}  # initialises the units
    report = HFLoadReport(
        str(directory),
        sorted({m.file.name for m in matches}),
        [m.names[0] for m in matches],
        missing,
        unexpected,
    )
    with ExitStack() as stack, torch.no_grad():
        opened: dict[Path, Any] = {}
        for m in matches:
            if m.file not in opened:
                opened[m.file] = stack.enter_context(_safe_open(m.file))
            shard = next((layout[n] for n in m.names if n in layout), None)
            _read_one(opened[m.file], m, shard, model, report)
    return report


def _zero_missing(model: nn.Module, missing: list[str]) -> None:
    with torch.no_grad():
        for name in missing:
            t = _tensor_of(model, name)
            (t.to_local() if hasattr(t, "to_local") else t).zero_()


def _read_one(f: Any, m: _Match, shard: Any, model: nn.Module, report: HFLoadReport) -> None:
    """Read ``m``'s rows this rank keeps (all of it when not sharded) into the model."""
    piece = f.get_slice(m.key)
    itemsize = _itemsize(piece.get_dtype())
    full = 1
    for d in m.shape:
        full *= d
    report.full_bytes += full * itemsize
    if shard is not None:
        row_numel = full // m.shape[0] if m.shape and m.shape[0] else 0
        if shard.length == 0 or row_numel == 0:
            return
        start = shard.flat_start // row_numel
        rows = shard.length // row_numel
        value = piece[start : start + rows]
        target = shard.local.view(rows, *m.shape[1:])
    else:
        value = piece[:] if m.shape else f.get_tensor(m.key)
        target = _tensor_of(model, m.names[0])
    nbytes = value.numel() * value.element_size()
    report.bytes_read += nbytes
    report.largest_read_bytes = max(report.largest_read_bytes, nbytes)
    report.read_shapes[m.key] = tuple(value.shape)
    target.copy_(value)


_ITEMSIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZES.get(dtype, 4)


# ---- building the model, checking a directory, tokenising the data ---------------------------
def _config(directory: Path, flag: str) -> Any:
    if not directory.is_dir():
        raise ValueError(f"{flag}: no such directory: {directory}")
    if not (directory / "config.json").is_file():
        raise ValueError(f"{flag}: {directory} has no config.json (save_pretrained writes one)")
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f'{flag} needs transformers: pip install "fsdp[hf]"') from None
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # an unknown model_type, bad JSON, values transformers refuses
        raise ValueError(f"{flag}: {directory}/config.json: {_last_line(exc)}") from None


def _meta_model(config: Any, directory: Path, flag: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # fp32 parameters whatever dtype the weights are saved in
            # unannotated in transformers (unused-ignore: Any when it is not installed)
            model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call, unused-ignore]
            return model.float()
    except Exception as exc:  # not a causal LM, a config it cannot build
        raise ValueError(
            f"{flag}: {directory}: cannot build a causal LM from config.json: {_last_line(exc)}"
        ) from None


def build_hf_pretrained(directory: str | Path, flag: str = "--hf-pretrained") -> HFModel:
    """The causal LM of ``directory``'s ``config.json`` on the meta device, and its blocks
    (``_no_split_modules``): shard it, then `load_hf_pretrained` materialises and fills it."""
    directory = Path(directory)
    config = _config(directory, flag)
    model = _meta_model(config, directory, flag)
    blocks = _blocks(model)
    positions = max_positions(config) or _DEFAULT_POSITIONS
    description = {
        "hf_pretrained": str(directory),
        "model_type": config.model_type,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return HFModel(model, blocks, int(positions), description)


def load_tokenizer(directory: str | Path, flag: str = "--hf-pretrained") -> Any:
    """The directory's tokenizer (``tokenizer.json`` or what AutoTokenizer reads)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise ValueError(
            f"{flag}: {directory} has no tokenizer AutoTokenizer can load "
            f"({_last_line(exc)}): the training text is tokenised with the "
            "model's own tokenizer; save one there with "
            "tokenizer.save_pretrained(DIR)"
        ) from None


def _vocab_size(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "vocab_size", 0) or 0)


def check_hf_pretrained(directory: str | Path, flag: str = "--hf-pretrained") -> int | None:
    """Check ``directory`` before any rank starts: its config builds a causal LM with blocks,
    its weights match that model's tensors and shapes (headers only), its tokenizer loads and
    fits the vocabulary. Returns the model's maximum sequence length (None: none declared).
    Raises `ValueError` naming the problem."""
    directory = Path(directory)
    config = _config(directory, flag)
    model = _meta_model(config, directory, flag)
    try:
        _blocks(model)
        _plan(model, weight_map(directory), directory, strict=True)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    tokenizer = load_tokenizer(directory, flag)
    vocab = _vocab_size(config)
    if vocab and len(tokenizer) > vocab:
        raise ValueError(
            f"{flag}: {directory}: the tokenizer has {len(tokenizer)} tokens, more "
            f"than the model's vocabulary of {vocab}"
        )
    return max_positions(config)


#: Text tokenised for training: 4 MiB, about a million tokens (the whole default corpus,
#: 32 MiB, took 111 s with a small BPE tokenizer on two cores).
TOKENIZED_BYTES = 4 << 20
_TOKENIZED: dict[tuple[str, int, str], torch.Tensor] = {}
_TOKENIZE_LOCK = threading.Lock()
_CHUNK_CHARS = 1 << 16


def _chunks(text: str) -> list[str]:
    """``text`` in pieces of about 64K characters cut after a newline (tokenised as a batch,
    in parallel by fast tokenizers)."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + _CHUNK_CHARS)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return out


def tokenized_corpus(
    corpus: ByteCorpus,
    directory: str | Path,
    *,
    min_tokens: int = 2,
    max_bytes: int = TOKENIZED_BYTES,
    flag: str = "--hf-pretrained",
) -> ByteCorpus:
    """The first ``max_bytes`` of ``corpus``'s text (read as UTF-8) as the token ids of
    ``directory``'s tokenizer, in a corpus whose batches are token windows (no special tokens
    added). Ranks of one process share one tokenisation. Raises `ValueError` if the text
    makes fewer than ``min_tokens`` tokens (a window and its shifted target)."""
    key = (corpus.source, min(corpus.data.numel(), max_bytes), str(Path(directory).resolve()))
    with _TOKENIZE_LOCK:
        ids = _TOKENIZED.get(key)
        if ids is None:
            tokenizer = load_tokenizer(directory, flag)
            text = bytes(corpus.data[:max_bytes].numpy()).decode("utf-8", errors="replace")
            encoded = tokenizer(_chunks(text), add_special_tokens=False, verbose=False)
            ids = torch.tensor([i for row in encoded["input_ids"] for i in row], dtype=torch.int32)
            _TOKENIZED.clear()  # keep one corpus: a long-lived process trains on many
            _TOKENIZED[key] = ids
    if ids.numel() < min_tokens:
        raise ValueError(
            f"--data: {corpus.source} makes {ids.numel()} tokens with the "
            f"tokenizer of {directory}; a sequence needs {min_tokens}: give more "
            "text or a shorter --seq-len"
        )
    # the same corpus class with token ids (fsdp.hf does not import fsdp.train at runtime)
    return replace(corpus, data=ids, source=f"{corpus.source} (tokenised by {directory})")
