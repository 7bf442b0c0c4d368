"""Hugging Face transformers models for ``fsdp train --hf-config`` (optional: needs
``pip install "fsdp[hf]"``). Models are built from a config with random weights (nothing is
downloaded); their blocks (the classes the model lists in ``_no_split_modules``) become FSDP
units.

A spec is a local ``config.json`` path or ``MODEL_TYPE[:key=value,...]``, for example
``gpt2:n_layer=4,n_embd=256,n_head=4`` or ``llama:num_hidden_layers=2,hidden_size=128``.
The vocabulary is set to 256 (the byte-level training data). A directory holding a
``config.json`` names that file.

Keys and values are checked against the model type's config class, inline and in files alike
(`parse_hf_spec`): a value must have the type the class's constructor declares (else, the type
of its default), and a key must be one the class knows, or one transformers converts (such as
llama's legacy ``rope_theta``). An unknown inline key is an error. An unknown key in a file is
an error when it looks like a misspelling of a known one (a close match); a file's other
unknown keys (hub metadata such as gpt2's ``n_ctx``) are kept, as transformers keeps them,
with a warning.
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["HFModel", "build_hf_model", "parse_hf_spec", "check_hf_spec", "max_positions"]

BYTE_VOCAB = 256
_DEFAULT_POSITIONS = 1024
_log = logging.getLogger("fsdp")
_WARNED: set[tuple[str, tuple[str, ...]]] = set()


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _config_classes() -> Any:
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        raise ValueError('--hf-config needs transformers: pip install "fsdp[hf]"') from None
    return CONFIG_MAPPING


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _config_class(model_type: str) -> Any:
    classes = _config_classes()
    if model_type not in classes:
        raise ValueError(
            f"--hf-config: unknown model type {model_type!r}"
            f"{_suggest(model_type, list(classes.keys()))}"
        )
    return classes[model_type]


def _valid_keys(cls: Any, default: Any) -> list[str]:
    """Keys a config class takes: its fields, its constructor's arguments, its aliases."""
    names = set(default.to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    names |= {
        n
        for n, p in inspect.signature(cls.__init__).parameters.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return sorted(n for n in names if n != "self" and not n.startswith("_"))


def _type_name(default: Any) -> str | None:
    """The type a value must have to replace ``default`` (None: anything goes)."""
    if default is None:
        return None
    for kind, name in (
        (bool, "a boolean (true or false)"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a JSON list"),
        (dict, "a JSON object"),
    ):
        if isinstance(default, kind):
            return name
    return None


def _fits(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value)


def _annotations(cls: Any) -> dict[str, Any]:
    """The constructor's declared type of each argument that can be evaluated (transformers
    writes them as strings; one that does not evaluate is left out)."""
    namespace = dict(getattr(cls.__init__, "__globals__", {}))
    namespace.setdefault("torch", torch)
    hints: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        hint = param.annotation
        if hint is inspect.Parameter.empty:
            continue
        if isinstance(hint, str):
            try:
                hint = eval(hint, namespace)  # noqa: S307 (the library's own annotation)
            except Exception:  # a name the module imports only for type checkers
                continue
        hints[name] = hint
    return hints


_SCALARS = (
    (bool, "a boolean (true or false)"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
)


def _hint_fits(value: Any, hint: Any) -> bool | None:
    """Whether a JSON ``value`` has the declared type ``hint``; None: cannot tell."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        verdicts = [_hint_fits(value, a) for a in args]
        return True if True in verdicts else (None if None in verdicts else False)
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if hint in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list):
            return False
        if origin is list and args:
            return all(_hint_fits(v, args[0]) is not False for v in value)
        return True
    if hint is dict or origin is dict or typing.is_typeddict(hint):
        return isinstance(value, dict)
    return None


def _hint_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        names = [_hint_name(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(n for n in names if n))
    if origin is typing.Literal:
        return "one of " + ", ".join(_shown(a) for a in args)
    for kind, name in _SCALARS:
        if hint is kind:
            return name
    if hint in (list, tuple) or origin in (list, tuple):
        return "a JSON list"
    if hint is dict or origin is dict or typing.is_typeddict(hint):
        return "a JSON object"
    return getattr(hint, "__name__", str(hint))


def _converted(cls: Any, key: str, value: Any) -> bool:
    """True when transformers takes ``key`` without keeping it as an unknown attribute (a
    legacy name it converts, such as llama's ``rope_theta`` into ``rope_parameters``)."""
    try:
        return key not in cls(**{key: value}).to_dict()
    except Exception:  # a bad value for a key it knows: building the config reports it
        return True


def _unknown_key(
    cls: Any, model_type: str, key: str, value: Any, valid: list[str], where: str, in_file: bool
) -> bool:
    """Raise for an unknown ``key`` unless transformers converts it or it is a file's key
    with no close match among the known ones; True for the latter (to warn about)."""
    if _converted(cls, key, value):
        return False
    close = _suggest(key, valid)
    if in_file and not close:
        return True
    hint = close or f"; valid keys: {', '.join(valid)}"
    raise ValueError(f"--hf-config: {where}{cls.__name__} ({model_type}) has no key {key!r}{hint}")


def _check_inline(
    model_type: str, kwargs: dict[str, Any], source: Path | None = None
) -> dict[str, Any]:
    """``kwargs`` checked against ``model_type``'s config class: every key one of its keys
    (or one transformers converts), every value of the type its constructor declares, else
    of its default's type (an integer where only a float is expected becomes one).
    ``source``: the config.json the keys come from (its unknown keys that are no close match
    of a known key are kept, with a warning; it may hold null where the default is not)."""
    cls = _config_class(model_type)
    default = cls()
    valid = _valid_keys(cls, default)
    hints = _annotations(cls)
    where = f"{source}: " if source is not None else ""
    checked: dict[str, Any] = {}
    kept: list[str] = []
    for key, value in kwargs.items():
        if source is not None and key.startswith("_"):  # metadata (_name_or_path, ...)
            checked[key] = value
            continue
        if key not in valid:
            if _unknown_key(cls, model_type, key, value, valid, where, source is not None):
                kept.append(key)
            checked[key] = value
            continue
        hint = hints.get(key)
        if hint is not None and _hint_fits(value, hint) is False:
            raise ValueError(
                f"--hf-config: {where}{key} of {model_type} must be "
                f"{_hint_name(hint)}, got {_shown(value)}"
            )
        was = getattr(default, key, None)
        expected = _type_name(was) if hint is None else None
        if (
            expected is not None
            and not _fits(value, was)
            and not (value is None and source is not None)
        ):
            raise ValueError(
                f"--hf-config: {where}{key} of {model_type} must be {expected}, got {_shown(value)}"
            )
        as_float = hint is float or (hint is None and isinstance(was, float))
        checked[key] = float(value) if as_float and isinstance(value, int) else value
    if kept and (str(source), tuple(kept)) not in _WARNED:  # once per file, not per rank
        _WARNED.add((str(source), tuple(kept)))
        _log.warning(
            "--hf-config %s: keys %s does not know, kept as attributes as "
            "transformers keeps them: %s",
            source,
            cls.__name__,
            ", ".join(kept),
        )
    return checked


def _parse_inline(spec: str) -> tuple[str, dict[str, Any]]:
    model_type, _, rest = spec.partition(":")
    pairs = [p.split("=", 1) for p in rest.split(",") if p]
    bad = [p[0] for p in pairs if len(p) != 2]
    if bad:
        raise ValueError(f"--hf-config: expected key=value, got {bad} in {spec!r}")
    return model_type.strip(), {k.strip(): _value(v.strip()) for k, v in pairs}


def _parse_file(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        kwargs = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--hf-config: cannot read {path} as JSON: {exc}") from None
    if not isinstance(kwargs, dict) or kwargs.get("model_type") is None:
        raise ValueError(f"--hf-config: {path} has no model_type")
    model_type = str(kwargs.pop("model_type"))
    return model_type, _check_inline(model_type, kwargs, source=path)


def parse_hf_spec(spec: str) -> Any:
    """A transformers config from a ``config.json`` path (or its directory) or
    ``MODEL_TYPE[:k=v,...]``.

    Raises `ValueError` naming the problem: transformers missing, an unknown model type, a key
    the config class does not have (with close matches; see the module's docstring for keys in
    files) or a value of the wrong type."""
    classes = _config_classes()
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        model_type, kwargs = _parse_file(path)
    elif path.suffix == ".json":
        raise ValueError(f"--hf-config: no such file: {spec}")
    else:
        model_type, kwargs = _parse_inline(spec)
        kwargs = _check_inline(model_type, kwargs)
    kwargs["vocab_size"] = BYTE_VOCAB
    if model_type not in classes:
        _config_class(model_type)  # raises, with close matches
    try:
        return classes[model_type](**kwargs)
    except Exception as exc:  # transformers' own validation: ValueError, TypeError, ...
        raise ValueError(f"--hf-config: {spec}: {_last_line(exc)}") from None


def _last_line(exc: BaseException) -> str:
    """``exc`` in one line: its type and the last line of its message (the cause)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def max_positions(config: Any) -> int | None:
    """The longest sequence ``config`` declares (its positional table), None if it has none."""
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


@dataclass
class HFModel:
    model: nn.Module
    blocks: list[nn.Module]
    max_positions: int
    description: dict[str, Any]


def _blocks(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"--hf-config: {type(model).__name__} names no block classes "
            "(_no_split_modules); it cannot be wrapped per block"
        )
    return blocks


def _causal_lm(config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    # unannotated in transformers (unused-ignore: Any when it is not installed)
    model: nn.Module = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call, unused-ignore]
    return model


def check_hf_spec(spec: str) -> int | None:
    """Parse ``spec`` and build its model on the meta device (no memory, no ranks), so a bad
    spec fails up front; return the model's maximum sequence length (None: it declares none).
    Raises `ValueError` naming the problem."""
    config = parse_hf_spec(spec)
    try:
        with torch.device("meta"):
            model = _causal_lm(config)
    except Exception as exc:  # e.g. a hidden size not divisible by the number of heads
        raise ValueError(f"--hf-config: {spec} cannot be built: {_last_line(exc)}") from None
    _blocks(model)
    return max_positions(config)


def build_hf_model(spec: str) -> HFModel:
    """The causal LM of ``spec`` with random weights, and its block modules."""
    config = parse_hf_spec(spec)
    model = _causal_lm(config)
    blocks = _blocks(model)
    positions = max_positions(config) or _DEFAULT_POSITIONS
    description = {
        "hf_config": spec,
        "model_type": config.model_type,
        "params": sum(p.numel() for p in model.parameters()),
    }
    return HFModel(model, blocks, int(positions), description)
