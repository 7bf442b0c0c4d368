"""Rank side of test_tp_layouts.py: a small model with tensor-parallel and plain parameters in
the same units, sharded at (dp 2, tp 2), (dp 4, tp 1) or (dp 1, tp 2), saved and loaded across
those layouts with fsdp-ckpt and with torch.distributed.checkpoint (DCP).

Shapes divide neither dp nor dp * tp: the hidden size 22 is 11 rows per tp rank (6 and 5 per dp
rank at dp 2, 6/6/6/4 at dp 4), the vocabulary 19 is 10 and 9 per tp rank. Each block's
LayerNorm is not parallelised: a plain parameter next to column- and row-parallel weights in
one unit, which every tp rank holds whole.

A launch runs a list of tasks (`run`); each rank reports per task, errors as tracebacks, so a
failing case fails its own test and the other cases still run.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, D, HIDDEN, LAYERS, SEQ = 19, 10, 22, 2, 6
GLOBAL_BATCH = 8  # sequences per step, split over the dp ranks (1, 2, 4)
LR = 1e-2
SAVE_AT = 2  # steps trained before the save
MORE = 2  # steps trained after it (or after the load)
# (dp, tp) of each layout; rank r is (r // tp, r % tp) of the (dp, tp) mesh. "hsdp2tp2" is
# (replicate 2, shard 1, tp 2): its dp ranks are hybrid replicas.
LAYOUTS = {"dp2tp2": (2, 2), "dp4": (4, 1), "dp1tp2": (1, 2), "hsdp2tp2": (2, 2)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)  # plain: not parallelised
        self.up = nn.Linear(D, HIDDEN)  # column-parallel
        self.down = nn.Linear(HIDDEN, D)  # row-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)  # row-parallel (vocabulary rows)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)  # column-parallel, output gathered

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # norms away from 1 and 0, so their values and moments matter
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(torch.randn(m.weight.shape) * 0.1)
                m.bias.add_(torch.randn(m.bias.shape) * 0.1)
    return net


def batch(step: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // dp
    mine = data[dp_rank * per : (dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(net.parameters(), lr=LR)


# ---- sharding ----------------------------------------------------------------------------------
_MESHES: dict[str, Any] = {}


def mesh_of(layout: str) -> Any:
    """The (dp, tp) DeviceMesh of ``layout`` (a 1-D "dp" mesh without tp), made once."""
    if layout not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        dp, tp = LAYOUTS[layout]
        if layout == "hsdp2tp2":
            _MESHES[layout] = init_device_mesh(
                "cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp")
            )
        elif tp == 1:
            _MESHES[layout] = init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        else:
            _MESHES[layout] = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    return _MESHES[layout]


def shard(net: Net, layout: str, impl: str) -> Net:
    """Tensor parallelism (tp > 1), then ``fully_shard`` of each block and the root on the dp
    mesh, with torch's FSDP2 (``impl="torch"``) or fsdp_engine's."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard
    mesh = mesh_of(layout)
    if LAYOUTS[layout][1] > 1:
        from torch.distributed.tensor import Replicate

        parallelize_module(
            net,
            mesh["tp"],
            {
                "tok": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        for block in net.blocks:
            parallelize_module(
                block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}
            )
    dp_mesh = (
        mesh["replicate", "shard"] if mesh.ndim == 3 else mesh["dp"] if mesh.ndim > 1 else mesh
    )
    for block in net.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(net, mesh=dp_mesh)
    return net


def train(net: Net, opt: torch.optim.Optimizer, layout: str, steps: range) -> list[float]:
    """Steps on this rank's dp slice of each global batch; the global mean loss per step."""
    dp, tp = LAYOUTS[layout]
    dp_rank = dist.get_rank() // tp
    losses = []
    for step in steps:
        x, y = batch(step, dp_rank, dp)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the tp ranks of a dp rank hold the same loss
        losses.append(total.item() / dist.get_world_size())
    return losses


def full_state(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole parameters and AdamW state by FQN (collective: DTensors are gathered)."""

    def whole(t: torch.Tensor) -> torch.Tensor:
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        return t.detach().clone()

    names = {id(p): n for n, p in net.named_parameters()}
    params = {n: whole(p) for n, p in net.named_parameters()}
    optim = {
        names[id(p)]: {k: whole(v) for k, v in sorted(s.items())} for p, s in opt.state.items()
    }
    return {"params": params, "optim": dict(sorted(optim.items()))}


# ---- saving and loading ------------------------------------------------------------------------
def _save(kind: str, net: Net, opt: torch.optim.Optimizer, path: str) -> None:
    if kind == "ckpt":
        import fsdp_ckpt as ck

        ck.save(path, net, opt, extra={"step": SAVE_AT})
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save(
        {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)},
        checkpoint_id=path,
    )


def _load(kind: str, net: Net, opt: torch.optim.Optimizer, path: str) -> None:
    if kind == "ckpt":
        import fsdp_ckpt as ck

        extra = ck.load(path, net, opt)
        assert extra in ({"step": SAVE_AT}, {}), extra  # {}: converted from DCP
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, opt, state["optim"])


def save_task(kind: str, impl: str, layout: str, path: str) -> dict[str, Any]:
    """Train SAVE_AT steps, save, then go on MORE steps: the state saved and the losses of
    the uninterrupted run."""
    net = shard(build(0), layout, impl)
    opt = optimizer(net)
    before = train(net, opt, layout, range(SAVE_AT))
    state = full_state(net, opt)
    _save(kind, net, opt, path)
    after = train(net, opt, layout, range(SAVE_AT, SAVE_AT + MORE))
    return {"state": state, "losses": before + after}


def load_task(kind: str, impl: str, layout: str, path: str) -> dict[str, Any]:
    """A model initialised differently, loaded from ``path``: the state it holds then, and the
    losses of the MORE steps after the save."""
    net = shard(build(1), layout, impl)
    opt = optimizer(net)
    _load(kind, net, opt, path)
    state = full_state(net, opt)
    return {"state": state, "losses": train(net, opt, layout, range(SAVE_AT, SAVE_AT + MORE))}


def refused_task(kind: str, impl: str, layout: str, path: str) -> dict[str, Any]:
    """fsdp-ckpt on torch's FSDP2 (its DTensor parameters are not fsdp_engine units): the
    error, which must come before anything is written."""
    net = shard(build(0), layout, impl)
    try:
        _save(kind, net, optimizer(net), path)
    except ValueError as exc:
        return {"error_message": str(exc)}
    return {"error_message": None}


def layout_task(kind: str, impl: str, layout: str, path: str) -> dict[str, Any]:
    """`_layouts`, `full_parameters` and fsdp-ckpt's `full_state_dict` against
    ``full_tensor()``."""
    import fsdp_ckpt as ck
    from fsdp_engine import full_parameters

    del kind, path
    net = shard(build(0), layout, impl)
    res = _layouts(net)
    want = {n: p.full_tensor() for n, p in net.named_parameters()}
    full = full_parameters(net)
    gathered = ck.full_state_dict(net)
    return {
        **res,
        "full_parameters": all(torch.equal(full[n], v) for n, v in want.items()),
        "full_state_dict": dist.get_rank() != 0
        or (
            gathered.keys() == want.keys()
            and all(torch.equal(gathered[n], v) for n, v in want.items())
        ),
    }


# ---- dp_mesh_dims: parameters already DTensors on the whole mesh (FSDP2's SPMD spelling) ----
# in_proj's 31 rows are 16 and 15 per tp rank, its 10 columns 5 per dp rank (FSDP2 refuses
# uneven shards on dims other than 0, and so does fsdp_engine)
SPMD_DIM, SPMD_HIDDEN = 10, 31
SPMD = {  # (mesh sizes, dim names, shard dim, replicate dim)
    "spmd_fsdp_tp": ((2, 2), ("fsdp", "tp"), "fsdp", None),
    "spmd_hsdp_tp": ((2, 1, 2), ("rep", "fsdp", "tp"), "fsdp", "rep"),
}


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(SPMD_DIM, SPMD_HIDDEN)
        self.out_proj = nn.Linear(SPMD_HIDDEN, SPMD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


def _spmd_model(mesh: Any) -> Mlp:
    """Weights column- and row-parallel over "tp", everything else replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = Mlp()
    for mod_name, mod in model.named_children():
        for name, p in list(mod.named_parameters(recurse=False)):
            place: list[Any] = [Replicate()] * mesh.ndim
            if name == "weight":
                place[-1] = Shard(0) if mod_name == "in_proj" else Shard(1)
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, place)))
    return model


def spmd_task(kind: str, impl: str, layout: str, path: str) -> dict[str, Any]:
    """`fully_shard(mesh=M, dp_mesh_dims=...)` with FSDP's shard on dim 1 where tp cuts dim 0
    (``shard_placement_fn``): one step, then the layout against torch's account of it, and
    an fsdp-ckpt save of the state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard

    del kind, impl
    sizes, names, shard_dim, rep_dim = SPMD[layout]
    mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
    model = _spmd_model(mesh)

    def fn(p: Any) -> Any:
        return Shard(1 if any(getattr(q, "dim", None) == 0 for q in p.placements) else 0)

    from fsdp_engine import fully_shard

    dims = DataParallelMeshDims(shard=shard_dim, replicate=rep_dim)
    for m in (model.in_proj, model.out_proj, model):
        fully_shard(m, mesh=mesh, shard_placement_fn=fn, dp_mesh_dims=dims)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randn(4, SPMD_DIM, generator=torch.Generator().manual_seed(1))
    model(DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)).sum().backward()
    opt.step()
    opt.zero_grad()
    res = _layouts(model)
    state = full_state(model, opt)
    import fsdp_ckpt as ck

    ck.save(path, model, opt)
    return {**res, "state": state}


def _layouts(net: nn.Module) -> dict[str, Any]:
    """Every rank's `sharded_layout` against torch's account of its DTensor parameters
    (``compute_local_shape_and_global_offset``), gathered on rank 0."""
    from fsdp_engine import model_backend, sharded_layout
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = dict(net.named_parameters())
    mine = []
    for s in sharded_layout(net):
        p = params[s.fqn]
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        try:
            start: int | str = s.flat_start
        except ValueError as exc:
            start = str(exc)
        mine.append(
            {
                "fqn": s.fqn,
                "offsets": s.offsets,
                "sizes": s.sizes,
                "torch": (tuple(offset), tuple(shape)),
                "writes": s.replicate_rank == 0,
                "same_memory": s.local.data_ptr() == p._local_tensor.data_ptr() or s.length == 0,
                "flat_start": start,
                "global_shape": tuple(s.global_shape),
            }
        )
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    world = model_backend(net)
    return {"layouts": everyone, "world": (world.rank, world.world_size)}


TASKS = {
    "save": save_task,
    "load": load_task,
    "refused": refused_task,
    "layout": layout_task,
    "spmd": spmd_task,
}


def run(backend: Any, tasks: list[tuple[str, ...]]) -> dict[tuple[str, ...], Any]:
    """Run ``tasks`` ((what, kind, impl, layout, path), in order) on every rank; rank 0
    reports their results, every rank its errors."""
    del backend  # the default process group is up; meshes come from init_device_mesh
    torch.set_num_threads(1)
    out: dict[tuple[str, ...], Any] = {}
    for task in tasks:
        what, *args = task
        try:
            result = TASKS[what](*args)
            out[task] = result if dist.get_rank() == 0 else {}
        except Exception:  # noqa: BLE001 - reported by the test reading this task
            out[task] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def reference(steps: int) -> list[float]:
    """One process, the global batch, fp32: the uninterrupted run's losses."""
    net = build(0)
    opt = optimizer(net)
    losses = []
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
