"""Parameters used by modules of several units (tied weights): which unit holds them.

Note [shared parameters]
    A parameter registered by modules under two units (Hugging Face GPT-2 sharded as its
    blocks, then ``transformer``, then the root: the input embedding ``transformer.wte`` and
    the tied ``lm_head`` share one weight) is held by their lowest common ancestor unit, as
    the paper recommends (section 7.2.2). ``fully_shard`` is called bottom-up, so the first
    call whose subtree holds a use of it shards it (``transformer`` here); a later call that
    finds the parameter's original tensor still registered in its own subtree, with the
    earlier unit inside that subtree too, is that common ancestor: it takes the parameter
    over. The earlier unit's shard is laid out again without it (each rank keeps its own rows
    of every other parameter, so nothing is communicated), and the ancestor shards it with
    its own parameters from the rows each rank already holds. Every registration then shows
    the ancestor's DTensor parameter, so ``state_dict`` has both names over one tensor, as
    the plain model has. The ancestor's forward encloses both uses, so its gathered buffer
    serves both, and both gradients reach its one flat gradient. One INFO line of the
    ``fsdp.engine`` logger names each parameter moved.

    Two units where neither contains the other (``fully_shard(model.tok_embeddings)``, then
    ``fully_shard(model.output)`` over the tied weight) are refused at the first forward with
    FSDP2's words ("already managed by another"): neither forward encloses the other's, so
    no unit could serve both uses.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ._flat_param import FlatLayout, FlatParameter

__all__ = ["take_over_shared", "check_ties"]

_log = logging.getLogger("fsdp.engine")


def take_over_shared(modules: list[nn.Module], param: nn.Parameter, unit_name: str) -> Any:
    """``param`` is the original tensor of a parameter an earlier `fully_shard` call sharded,
    found registered in ``modules``' subtree. If that earlier unit lies inside the subtree,
    remove the parameter from it and return its DTensor (whose local rows the caller shards
    again, with the slots the earlier unit registered it in); else None (refused at the first
    forward: `check_ties`)."""
    sharded = getattr(param, "_fsdp_replaced_by", None)
    flat = getattr(sharded, "_fsdp_flat", None)
    if flat is None or getattr(param, "_fsdp_shared_refused", False):
        return None
    for top in modules:
        for mod in top.modules():
            state = getattr(mod, "_fsdp_state", None)
            if state is None or not any(f is flat for f in state.config.flats):
                continue
            if state.unit is not None:
                raise ValueError(
                    # _fsdp_sharded_as: set on the original by `shard_params`.
                    f"fully_shard({unit_name}): parameter {param._fsdp_sharded_as} is shared "  # type: ignore[attr-defined]
                    "with this module, but its unit already ran a forward; call fully_shard on "
                    "every module before the first forward"
                )
            index = next(i for i, q in enumerate(flat.params) if q is sharded)
            _log.info(
                "fully_shard(%s) holds the shared parameter %s (its lowest common "
                "ancestor unit; Note [shared parameters])",
                unit_name,
                param._fsdp_sharded_as,  # type: ignore[attr-defined]
            )
            _remove_from_flat(state, flat, index)
            return sharded, flat.layout.slots[index].uses
    # Two units, neither inside the other: no later ancestor may take it over either.
    param._fsdp_shared_refused = True  # type: ignore[attr-defined]
    return None


def _remove_from_flat(state: Any, flat: FlatParameter, index: int) -> None:
    """Lay ``flat`` out again without parameter ``index``; each rank copies its own rows."""
    flats = state.config.flats
    keep = [j for j in range(len(flat.params)) if j != index]
    if not keep:
        flats.remove(flat)
        return
    slots = flat.layout.slots
    named = [(slots[j].fqn, slots[j].uses, flat.params[j]) for j in keep]
    layout = FlatLayout.build(
        named, flat.layout.shard_count, flat.dtype, [slots[j].shard_dim for j in keep]
    )
    old = flat.local_shard
    local = torch.zeros(layout.shard_numel, dtype=old.dtype, device=old.device)
    if old.device.type != "meta":
        for new_slot, j in zip(layout.slots, keep):
            layout.local_view(local, new_slot, flat.shard_index).copy_(
                flat.layout.local_view(old, slots[j], flat.shard_index)
            )
        if old.is_pinned():
            local = local.pin_memory()
    moved = FlatParameter(
        layout, local, flat.shard_index, [flat.params[j] for j in keep], flat.spec
    )
    moved.shard_group = flat.shard_group
    for p in moved.params:
        p._fsdp_flat = moved  # type: ignore[attr-defined]
    moved.use_sharded_views()
    flats[flats.index(flat)] = moved


def check_ties(root: nn.Module) -> None:
    """At the first forward: a parameter a unit sharded must not still be registered in its
    original form elsewhere in the tree (shared by two units neither of which contains the
    other); its users would silently train two copies."""
    for mod_name, mod in root.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            sharded_as = getattr(p, "_fsdp_sharded_as", None)
            if sharded_as is not None:
                fqn = f"{mod_name}.{pname}" if mod_name else pname
                raise ValueError(
                    f"parameter {fqn} is already managed by another FSDP unit, as "
                    f"{sharded_as}: a parameter used by modules of two units must be held by "
                    "a unit containing both (shard their common parent and skip fully_shard "
                    "on one of them; Note [shared parameters])"
                )
