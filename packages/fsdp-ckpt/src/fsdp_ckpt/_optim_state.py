"""Optimizer state by parameter FQN, sliced like the parameters so it reshards with them.

Saving reads ``optimizer.state_dict()`` and sorts each state value of each parameter:

- a tensor shaped like the parameter as this rank holds it (AdamW's ``exp_avg``, SGD's
  ``momentum_buffer``, any element-wise state) is written as the same flat slice as the
  parameter (``per_param``), by the ranks that write the parameter;
- another tensor (``step``, a 0-d tensor) is written whole by the rank holding the parameter's
  first element (inline in the index when small);
- a plain Python value is kept in the index.

Loading rebuilds a state dict for *this* optimizer (its parameters as this rank holds them) and
hands it to ``optimizer.load_state_dict``, so each optimizer's own rules apply (dtype and device
casts, ``step`` kept in float32). The optimizer's class is recorded by qualified name
(``torch.optim.adamw.AdamW``); loading into another class is a mismatch like a missing key
(AdamW's moments are no SGD momentum).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._box import Box
from ._errors import CheckpointCorruptError
from ._index import Chunk, InlineItem, OptimizerSection, StateItem, TensorEntry, ValueItem
from ._model_view import ModelView, Piece
from ._paths import show
from ._tensor_file import dtype_from_name, dtype_name
from ._values import can_inline, decode_value, encode_value, inline_tensor, tensor_from_inline

__all__ = [
    "collect_optimizer",
    "OptimizerLoad",
    "plan_optimizer_load",
    "Fill",
    "optimizer_class",
    "DCP_CLASS",
]

_DROPPED_GROUP_KEYS = ("params", "param_names")  # we key by FQN ourselves
DCP_CLASS = "dcp"  # the class recorded by from_dcp: DCP does not say which optimizer it was


def optimizer_class(optimizer: Any) -> str:
    """The qualified name of ``optimizer``'s class, as the index records it."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def class_mismatch(optimizer: Any, saved: str) -> tuple[str, str] | None:
    """(saved, this optimizer's class) when they differ; None when they agree or the
    checkpoint does not know (converted from DCP)."""
    if saved in ("", DCP_CLASS):
        return None
    mine = optimizer_class(optimizer)
    # Indexes written before the qualified name was recorded hold the bare class name.
    same = saved == mine if "." in saved else saved == type(optimizer).__name__
    return None if same else (saved, mine)


@dataclass(frozen=True)
class Fill:
    """Copy the box ``box`` of a stored tensor into ``dst`` (1-D: the box in row-major order,
    Note [boxes] in ``_box.py``)."""

    name: str
    entry: TensorEntry
    box: Box
    dst: torch.Tensor


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or None, got "
            f"{type(optimizer).__name__} {show(optimizer)}"
        )


def _pieces_of(optimizer: torch.optim.Optimizer, view: ModelView) -> list[Piece]:
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            piece = view.piece_of(p)
            if piece is None:
                raise ValueError(
                    f"optimizer.param_groups[{gi}] holds a parameter of shape "
                    f"{list(p.shape)} that is not a parameter of the model"
                )
            out.append(piece)
    return out


def _state_item(
    piece: Piece, name: str, value: Any, file: str, tensors: dict[str, torch.Tensor]
) -> StateItem | None:
    where = f"optimizer state {name!r} of {piece.fqn}"
    if isinstance(value, torch.Tensor) and value.shape == piece.param.shape:
        if not piece.writes:
            return None
        chunks: tuple[Chunk, ...] = ()
        if piece.length:
            key = f"optim/{piece.fqn}/{name}"
            tensors[key] = _local(value).detach().reshape(-1)
            chunks = (piece.chunk(file, key),)
        return TensorEntry(piece.global_shape, dtype_name(value.dtype), chunks, per_param=True)
    if not piece.owner:
        return None
    if isinstance(value, torch.Tensor):
        if can_inline(value):
            return InlineItem(inline_tensor(value))
        key = f"optim/{piece.fqn}/{name}"
        tensors[key] = value.detach()
        chunks = (Chunk(file, key, 0, value.numel()),) if value.numel() else ()
        return TensorEntry(tuple(value.shape), dtype_name(value.dtype), chunks)
    return ValueItem(encode_value(value, where=where, external=None))


def _groups(
    optimizer: torch.optim.Optimizer, sd: Mapping[str, Any], pieces: list[Piece]
) -> tuple[dict[str, Any], ...]:
    out, i = [], 0
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, sd["param_groups"])):
        hyper = {
            k: encode_value(v, where=f"optimizer.param_groups[{gi}][{k!r}]", external=None)
            for k, v in saved.items()
            if k not in _DROPPED_GROUP_KEYS
        }
        n = len(group["params"])
        out.append({**hyper, "params": [p.fqn for p in pieces[i : i + n]]})
        i += n
    return tuple(out)


def collect_optimizer(
    optimizer: Any, view: ModelView, *, file: str
) -> tuple[dict[str, torch.Tensor], OptimizerSection]:
    """This rank's optimizer tensors (keys in ``file``) and its part of the index section."""
    _check_optimizer(optimizer)
    pieces = _pieces_of(optimizer, view)
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, StateItem]] = {}
    for idx, values in sd["state"].items():
        piece = pieces[idx]
        items = {}
        for name, value in values.items():
            item = _state_item(piece, str(name), value, file, tensors)
            if item is not None:
                items[str(name)] = item
        if items:
            state[piece.fqn] = items
    section = OptimizerSection(optimizer_class(optimizer), _groups(optimizer, sd, pieces), state)
    return tensors, section


# ---- load ---------------------------------------------------------------------------------------
@dataclass
class OptimizerLoad:
    """A state dict for this optimizer, whose tensors are filled by `fills` before `apply`."""

    fills: list[Fill] = field(default_factory=list)
    state: dict[int, dict[str, Any]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    class_mismatch: tuple[str, str] | None = None  # (saved class, this optimizer's class)

    def apply(self, optimizer: torch.optim.Optimizer) -> None:
        """Load the filled state dict into ``optimizer``."""
        optimizer.load_state_dict({"state": self.state, "param_groups": self.groups})


def _saved_name(piece: Piece, state: Mapping[str, Any]) -> str | None:
    return next((a for a in (piece.fqn, *piece.aliases) if a in state), None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a sharded (DTensor) state tensor, or the tensor itself."""
    return getattr(t, "_local_tensor", t)


def _destination(existing: Any, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Reusing the optimizer's own tensor (a load into a live optimizer) writes in place:
    # no allocation, and the optimizer keeps its dtype and device. State of a DTensor
    # parameter is a DTensor of the same placements (its local rows are what is filled).
    if (
        isinstance(existing, torch.Tensor)
        and existing.shape == param.shape
        and _local(existing).is_contiguous()
    ):
        return existing
    if hasattr(param, "_local_tensor"):
        return torch.empty_like(param, dtype=dtype, device=_local(param).device)
    return torch.empty(param.shape, dtype=dtype)


def _load_item(
    piece: Piece, name: str, item: StateItem, plan: OptimizerLoad, existing: Any, source: str
) -> Any:
    label = f"optimizer state {name!r} of {piece.fqn}"
    if isinstance(item, ValueItem):
        return decode_value(item.value, tensors=lambda r: torch.empty(0), source=source)
    if isinstance(item, InlineItem):
        return tensor_from_inline(item.tensor, source=source)
    dtype = dtype_from_name(item.dtype, source=source)
    if item.per_param:
        if item.shape != piece.global_shape:
            plan.mismatched.append(
                (f"optimizer state of {piece.fqn}", item.shape, piece.global_shape)
            )
            return None
        out = _destination(existing, piece.param, dtype)
        plan.fills.append(Fill(label, item, piece.box, _local(out).view(-1)))
        return out
    out = _empty(item, dtype, label, source)
    plan.fills.append(Fill(label, item, Box.whole(item.shape), out.view(-1)))
    return out


def _empty(item: TensorEntry, dtype: torch.dtype, label: str, source: str) -> torch.Tensor:
    # The index bounds the shape by the size it records for the file; the file itself is
    # checked only when read, so an index lying about both fails here, cleanly.
    try:
        return torch.empty(item.shape, dtype=dtype)
    except RuntimeError as exc:
        raise CheckpointCorruptError(
            f"{label}: cannot allocate {list(item.shape)} {item.dtype} ({exc})", path=source
        ) from None


def _merged_groups(
    optimizer: torch.optim.Optimizer, section: OptimizerSection, pieces: list[Piece], source: str
) -> list[dict[str, Any]]:
    saved_by_fqn = {fqn: g for g in section.param_groups for fqn in g.get("params", [])}
    out, i = [], 0
    for group in optimizer.param_groups:
        n = len(group["params"])
        current = {k: v for k, v in group.items() if k != "params"}
        saved = next(
            (
                saved_by_fqn[a]
                for p in pieces[i : i + n]
                for a in (p.fqn, *p.aliases)
                if a in saved_by_fqn
            ),
            None,
        )
        if saved is not None:
            current.update(
                {
                    k: decode_value(v, tensors=lambda r: torch.empty(0), source=source)
                    for k, v in saved.items()
                    if k not in _DROPPED_GROUP_KEYS
                }
            )
        out.append({**current, "params": list(range(i, i + n))})
        i += n
    return out


def plan_optimizer_load(
    optimizer: Any, view: ModelView, section: OptimizerSection | None, *, source: str
) -> OptimizerLoad:
    """Match saved state to this optimizer's parameters by FQN; record what does not match."""
    _check_optimizer(optimizer)
    pieces = _pieces_of(optimizer, view)
    plan = OptimizerLoad()
    if section is None:
        plan.missing.append("optimizer state (the checkpoint was saved without an optimizer)")
        return plan
    plan.class_mismatch = class_mismatch(optimizer, section.class_name)
    used: set[str] = set()
    for idx, piece in enumerate(pieces):
        name = _saved_name(piece, section.state)
        if name is None:
            continue
        used.add(name)
        current = optimizer.state.get(piece.param, {})
        values = {
            n: _load_item(piece, n, item, plan, current.get(n), source)
            for n, item in section.state[name].items()
        }
        if all(v is not None for v in values.values()):
            plan.state[idx] = values
    plan.unexpected = [f"optimizer state of {fqn}" for fqn in section.state if fqn not in used]
    plan.groups = _merged_groups(optimizer, section, pieces, source)
    return plan
