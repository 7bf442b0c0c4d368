"""`SavedParamRegistry`: a saved view of a live gathered buffer becomes a reference, found
by its storage whatever the number of live buffers; anything else passes through."""

from __future__ import annotations

import torch
from fsdp_engine._saved_params import SavedParamRef, SavedParamRegistry


def test_views_of_live_buffers_become_references_and_others_pass() -> None:
    reg = SavedParamRegistry()
    units = [object() for _ in range(100)]
    fulls = [torch.randn(30) for _ in units]
    for unit, full in zip(units, fulls):
        reg.add(unit, 0, full)
    view = fulls[57][6:18].view(3, 4)
    ref = reg.pack(view)
    assert isinstance(ref, SavedParamRef) and ref.unit is units[57] and ref.offset == 6
    assert ref.size == (3, 4) and ref.stride == (4, 1)
    other = torch.randn(5)
    assert reg.pack(other) is other
    as_int = fulls[3].view(torch.int32)  # same storage, another dtype: not a parameter view
    assert reg.pack(as_int) is as_int
    sparse = torch.eye(3).to_sparse()
    assert reg.pack(sparse) is sparse
    reg.remove(units[57])
    assert reg.pack(view) is view
    assert isinstance(reg.pack(fulls[58][:2]), SavedParamRef)


def test_a_regathered_group_replaces_its_entry() -> None:
    reg, unit = SavedParamRegistry(), object()
    old, new = torch.randn(8), torch.randn(8)
    reg.add(unit, 1, old)
    reg.add(unit, 1, new)
    assert not isinstance(reg.pack(old[:2]), SavedParamRef)
    assert isinstance(reg.pack(new[:2]), SavedParamRef)
    reg.remove(unit)
    assert not isinstance(reg.pack(new[:2]), SavedParamRef)
