"""FSDP x tensor parallelism checkpoints across layouts: saved at (dp 2, tp 2) on 4 ranks,
loaded at (dp 4, tp 1) (plain FSDP) and at (dp 1, tp 2) on 2 ranks, and back (also hybrid:
(replicate 2, shard 1, tp 2) to (dp 1, tp 2) and back); parameters and
AdamW state bit for bit, then the next losses as an uninterrupted run's. With fsdp-ckpt
(fsdp_engine models), with torch.distributed.checkpoint through get/set_model_state_dict and
get/set_optimizer_state_dict (torch's FSDP2 and fsdp_engine), and through fsdp-ckpt's DCP
conversions. The model (tp_ranks.py) has uneven shapes and plain LayerNorms in tp units.

Three launches (2, 4, then 2 ranks) run every save and load in order (`_RUNS`); each test
reads its own task's result.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import fsdp_ckpt as ck
import pytest
import torch
from fsdp_ckpt._box import Box, tiling_problem
from fsdp_comm import launch

from . import tp_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

A, B, C, H = "dp2tp2", "dp4", "dp1tp2", "hsdp2tp2"
WORLD = {A: 4, B: 4, C: 2, H: 4}
IMPLS = ("torch", "ours")
# (source layout, destination layout) of every load; the sources save in launch 1 (C) or 2.
PAIRS = [(A, B), (A, C), (B, A), (C, A), (B, C), (C, B), (A, A), (H, C), (C, H)]
RTOL = 1e-6  # losses: tp and dp change fp32 summation orders (seen: 1e-7)
# Every task's result by task, "root" (the checkpoints' directory) and "error" (a launch that
# failed): filled once for the module by the `runs` fixture.
_RUNS: dict[Any, Any] = {}


def _path(root: Path, kind: str, impl: str, layout: str) -> str:
    return str(root / f"{kind}-{impl}-{layout}")


def _saves(root: Path, layouts: tuple[str, ...]) -> list[tuple[str, ...]]:
    tasks = [("save", "ckpt", "ours", lay, _path(root, "ckpt", "ours", lay)) for lay in layouts]
    tasks += [
        ("save", "dcp", impl, lay, _path(root, "dcp", impl, lay))
        for impl in IMPLS
        for lay in layouts
    ]
    return tasks + [("layout", "", "ours", lay, "") for lay in layouts]


def _loads(root: Path, dst: str) -> list[tuple[str, ...]]:
    tasks = []
    for src, d in PAIRS:
        if d == dst:
            tasks.append(("load", "ckpt", "ours", dst, _path(root, "ckpt", "ours", src)))
            tasks += [("load", "dcp", impl, dst, _path(root, "dcp", impl, src)) for impl in IMPLS]
    return tasks


def _interop(root: Path) -> list[tuple[str, ...]]:
    """fsdp-ckpt's DCP conversions, one process, between the launches: the (dp 2, tp 2)
    fsdp-ckpt checkpoint to DCP (loaded at (dp 1, tp 2) by both implementations' DCP), and
    torch FSDP2's DCP checkpoint to fsdp-ckpt (loaded there by fsdp-ckpt)."""
    to_dcp = [("load", "dcp", impl, C, str(root / "to_dcp")) for impl in IMPLS]
    from_dcp = [("load", "ckpt", "ours", C, str(root / "from_dcp"))]
    return _converted(
        to_dcp, ck.to_dcp, _path(root, "ckpt", "ours", A), root / "to_dcp"
    ) + _converted(from_dcp, ck.from_dcp, _path(root, "dcp", "torch", A), root / "from_dcp")


def _converted(tasks: list[tuple[str, ...]], convert: Any, *args: Any) -> list[tuple[str, ...]]:
    """``tasks`` once ``convert(*args)`` succeeded; else none, their tests reporting why."""
    try:
        convert(*args)
    except Exception:  # noqa: BLE001 - reported by the tests of the loads
        _RUNS.update({t: {"error": traceback.format_exc()} for t in tasks})
        return []
    return tasks


def _launch(world: int, tasks: list[tuple[str, ...]]) -> None:
    from ..forkserver_preload import warm_forkserver

    warm_forkserver()
    if tasks:
        _RUNS.update(launch(tp_ranks.run, world, backend="torch", args=(tasks,), timeout=500)[0])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("tp")
    if "error" not in _RUNS:
        try:
            _launch(2, [*_saves(root, (C,)), ("refused", "ckpt", "torch", C, str(root / "x"))])
            _launch(
                4,
                [
                    *_saves(root, (A, B, H)),
                    *_loads(root, A),
                    *_loads(root, B),
                    *_loads(root, H),
                    *(("spmd", "", "ours", lay, str(root / lay)) for lay in tp_ranks.SPMD),
                ],
            )
            _launch(2, [*_loads(root, C), *_interop(root)])
        except Exception as exc:  # noqa: BLE001 - every test reports it
            _RUNS["error"] = exc
    if "error" in _RUNS:
        raise _RUNS["error"]
    _RUNS.setdefault("root", root)
    return _RUNS["root"], _RUNS


def _result(runs: Any, task: tuple[str, ...]) -> dict[str, Any]:
    res = runs[1][task]
    if "error" in res:
        pytest.fail(f"{task}:\n{res['error']}")
    return res


def _assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), name
    assert got["optim"].keys() == want["optim"].keys() and want["optim"]
    for fqn, state in want["optim"].items():
        assert got["optim"][fqn].keys() == state.keys(), fqn
        for name, value in state.items():
            assert torch.equal(got["optim"][fqn][name].float(), value.float()), (fqn, name)


_REFERENCE: list[float] = []


def _reference() -> list[float]:
    if not _REFERENCE:
        _REFERENCE.extend(tp_ranks.reference(tp_ranks.SAVE_AT + tp_ranks.MORE))
    return _REFERENCE


def _check_load(
    runs: Any, kind: str, impl: str, src_path: str, dst: str, saved: dict[str, Any]
) -> None:
    got = _result(runs, ("load", kind, impl, dst, src_path))
    _assert_same_state(got["state"], saved["state"])
    after = torch.tensor(got["losses"])
    uninterrupted = torch.tensor(saved["losses"][tp_ranks.SAVE_AT :])
    torch.testing.assert_close(after, uninterrupted, rtol=RTOL, atol=0)
    torch.testing.assert_close(
        after, torch.tensor(_reference()[tp_ranks.SAVE_AT :]), rtol=RTOL, atol=0
    )


@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{s}-to-{d}" for s, d in PAIRS])
def test_fsdp_ckpt_across_layouts(runs: Any, src: str, dst: str) -> None:
    path = _path(runs[0], "ckpt", "ours", src)
    _check_load(runs, "ckpt", "ours", path, dst, _result(runs, ("save", "ckpt", "ours", src, path)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("src", "dst"), PAIRS, ids=[f"{s}-to-{d}" for s, d in PAIRS])
def test_dcp_across_layouts(runs: Any, impl: str, src: str, dst: str) -> None:
    path = _path(runs[0], "dcp", impl, src)
    _check_load(runs, "dcp", impl, path, dst, _result(runs, ("save", "dcp", impl, src, path)))


@pytest.mark.parametrize("impl", IMPLS)
def test_fsdp_ckpt_to_dcp_loads_in_either_fsdp(runs: Any, impl: str) -> None:
    saved = _result(runs, ("save", "ckpt", "ours", A, _path(runs[0], "ckpt", "ours", A)))
    _check_load(runs, "dcp", impl, str(runs[0] / "to_dcp"), C, saved)


def test_torch_fsdp2_dcp_to_fsdp_ckpt(runs: Any) -> None:
    saved = _result(runs, ("save", "dcp", "torch", A, _path(runs[0], "dcp", "torch", A)))
    _check_load(runs, "ckpt", "ours", str(runs[0] / "from_dcp"), C, saved)


def test_dcp_and_fsdp_ckpt_save_the_same_state(runs: Any) -> None:
    """Both implementations train alike: what they saved is the same to fp32 rounding."""
    ours = _result(runs, ("save", "dcp", "ours", A, _path(runs[0], "dcp", "ours", A)))
    torch_ = _result(runs, ("save", "dcp", "torch", A, _path(runs[0], "dcp", "torch", A)))
    for name, value in torch_["state"]["params"].items():
        torch.testing.assert_close(ours["state"]["params"][name], value, rtol=1e-5, atol=1e-6)


def _check_layouts(
    res: dict[str, Any], shapes: dict[str, torch.Size], world: int, not_flat: Any
) -> None:
    """Every rank's boxes are torch's account of its DTensors, views of its parameters'
    memory; ``flat_start`` raises exactly where ``not_flat(fqn)``; the writers' boxes tile
    every parameter once."""
    assert res["world"] == (0, world)  # model_backend spans dp x tp
    writers: dict[str, list[Box]] = {}
    for rank, pieces in enumerate(res["layouts"]):
        assert {p["fqn"] for p in pieces} == set(shapes)
        for p in pieces:
            assert p["global_shape"] == tuple(shapes[p["fqn"]]), (rank, p)
            if all(p["sizes"]):
                assert (p["offsets"], p["sizes"]) == p["torch"], (rank, p)
            assert p["same_memory"], (rank, p)
            if p["writes"]:
                writers.setdefault(p["fqn"], []).append(Box(p["offsets"], p["sizes"]))
            expected = not_flat(p["fqn"]) and all(p["sizes"])
            assert isinstance(p["flat_start"], str) == expected, (rank, p)
    assert writers.keys() == shapes.keys()
    for fqn, boxes in writers.items():
        boxes = [b for b in boxes if b.numel]
        assert tiling_problem(boxes, tuple(shapes[fqn])) is None, (fqn, boxes)


@pytest.mark.parametrize("layout", [A, B, C, H])
def test_sharded_layout_is_torchs_account_of_each_box(runs: Any, layout: str) -> None:
    res = _result(runs, ("layout", "", "ours", layout, ""))
    assert res["full_parameters"] and res["full_state_dict"]
    shapes = {n: p.shape for n, p in tp_ranks.build(0).named_parameters()}
    _check_layouts(
        res, shapes, WORLD[layout], lambda fqn: fqn.endswith("down.weight") and layout != B
    )


@pytest.mark.parametrize("layout", list(tp_ranks.SPMD))
def test_spmd_mesh_layout_and_checkpoint(runs: Any, layout: str) -> None:
    """dp_mesh_dims (parameters DTensors on the whole mesh), FSDP sharding dim 1 where tp
    cuts dim 0, a hybrid replica dim: boxes as torch says, saved once, loaded whole."""
    res = _result(runs, ("spmd", "", "ours", layout, str(runs[0] / layout)))
    model = tp_ranks.Mlp()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    sharded = tp_ranks.SPMD[layout][0][-2] > 1  # FSDP cuts in_proj's tp rows' columns
    _check_layouts(
        res,
        shapes,
        4,
        lambda fqn: fqn == "out_proj.weight" or (fqn == "in_proj.weight" and sharded),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=tp_ranks.LR)
    ck.load(runs[0] / layout, model, opt)
    _assert_same_state(tp_ranks.full_state(model, opt), res["state"])


def test_flat_start_names_the_parameter_and_the_way_out(runs: Any) -> None:
    res = _result(runs, ("layout", "", "ours", A, ""))
    message = next(p["flat_start"] for p in res["layouts"][1] if p["fqn"] == "blocks.0.down.weight")
    assert "blocks.0.down.weight" in message and "offsets" in message


def test_tp_index_uses_box_chunks_only_where_needed(runs: Any) -> None:
    path = Path(_path(runs[0], "ckpt", "ours", A))
    version = json.loads((path / "CURRENT").read_text())["version"]
    index = json.loads((path / version / "index.json").read_text())
    assert index["format_version"] == 2 and index["world_size"] == 4
    params = index["params"]
    down = params["blocks.0.down.weight"]
    assert down["shape"] == [tp_ranks.D, tp_ranks.HIDDEN]
    assert sorted((c["offsets"], c["sizes"]) for c in down["chunks"]) == [
        ([0, 0], [5, 11]),
        ([0, 11], [5, 11]),
        ([5, 0], [5, 11]),
        ([5, 11], [5, 11]),
    ]
    up = params["blocks.0.up.weight"]  # column-parallel: contiguous rows, flat chunks
    assert sorted((c["start"], c["length"]) for c in up["chunks"]) == [
        (0, 60),
        (60, 50),
        (110, 60),
        (170, 50),
    ]
    assert len(params["blocks.0.norm.weight"]["chunks"]) == 2  # one tp rank writes it
    assert len(params["blocks.0.down.bias"]["chunks"]) == 2  # tp replicates it
    ck.verify(path)


def test_tp_checkpoint_loads_into_a_plain_model_and_exports(runs: Any, tmp_path: Path) -> None:
    path = _path(runs[0], "ckpt", "ours", A)
    saved = _result(runs, ("save", "ckpt", "ours", A, path))
    model = tp_ranks.build(1)
    opt = tp_ranks.optimizer(model)
    assert ck.load(path, model, opt) == {"step": tp_ranks.SAVE_AT}
    _assert_same_state(tp_ranks.full_state(model, opt), saved["state"])
    from safetensors.torch import load_file

    exported = load_file(ck.export(path, tmp_path / "m.safetensors"))
    for name, value in saved["state"]["params"].items():
        assert torch.equal(exported[name], value), name


def test_fsdp_ckpt_refuses_torch_fsdp2_parameters(runs: Any) -> None:
    res = _result(runs, ("refused", "ckpt", "torch", C, str(runs[0] / "x")))
    assert res["error_message"] is not None and "DTensor" in res["error_message"]
    assert not (runs[0] / "x" / "CURRENT").exists()
