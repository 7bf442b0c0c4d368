"""Rank side of tests/fsdp2/test_tensor_parallel.py: a small Llama-shaped transformer with
torchtitan's tensor-parallel plan (sequence parallel norms, column/row-parallel projections,
a row-parallel embedding and a column-parallel head), then ``fully_shard`` on the
data-parallel mesh, with torch's FSDP2 or ours; trained against one process.

Sizes divide neither the data-parallel size nor dp * tp after the tp split: the MLP's hidden
size 22 is 11 per tp rank (6 and 5 rows per dp rank), the vocabulary 38 is 19 per tp rank.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, D, HEADS, HIDDEN, SEQ, LAYERS = 38, 16, 4, 22, 8, 2
HD = D // HEADS
GLOBAL_BATCH = 4
LR = 1e-2
CLIP = 0.5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(D)
        self.wq = nn.Linear(D, D, bias=False)
        self.wk = nn.Linear(D, D, bias=False)
        self.wv = nn.Linear(D, D, bias=False)
        self.wo = nn.Linear(D, D)
        self.ffn_norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, D)
        self.checkpointed = False

    def _attention(self, h: torch.Tensor) -> torch.Tensor:
        b, t = h.shape[0], h.shape[1]
        # -1 heads: the local heads of a column-parallel piece (all of them without tp).
        q, k, v = (w(h).view(b, t, -1, HD).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.attention_norm(x))
        return x + self.w2(F.silu(self.w1(self.ffn_norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            from torch.utils.checkpoint import checkpoint

            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.output(self.norm(x))


def build() -> Net:
    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # non-trivial norm parameters, so their gradients matter
        for m in net.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.add_(torch.randn(m.weight.shape) * 0.1)
                m.bias.add_(torch.randn(m.bias.shape) * 0.1)
    return net


def batch(step: int, dp_rank: int = 0, dp: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    data = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    per = GLOBAL_BATCH // dp
    mine = data[dp_rank * per : (dp_rank + 1) * per]
    return mine[:, :-1], mine[:, 1:]


def apply_tp(
    net: Net, tp_mesh: Any, loss_parallel: bool = False, sequence_parallel: bool = True
) -> None:
    """torchtitan's Llama plan (apply_tp), sequence parallel on; ``loss_parallel``: the head
    leaves its logits sharded on the vocabulary for a loss-parallel cross-entropy. Without
    sequence parallelism the norms stay plain parameters: the model's parameters then live
    on two meshes, (dp, tp) and dp."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if not sequence_parallel:
        parallelize_module(
            net,
            tp_mesh,
            {
                "tok": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        for block in net.blocks:
            parallelize_module(
                block,
                tp_mesh,
                {
                    "wq": ColwiseParallel(),
                    "wk": ColwiseParallel(),
                    "wv": ColwiseParallel(),
                    "wo": RowwiseParallel(),
                    "w1": ColwiseParallel(),
                    "w2": RowwiseParallel(),
                },
            )
        return
    parallelize_module(
        net,
        tp_mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            )
            if loss_parallel
            else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in net.blocks:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "wq": ColwiseParallel(),
                "wk": ColwiseParallel(),
                "wv": ColwiseParallel(),
                "wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "w1": ColwiseParallel(),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
        # The projections read the whole sequence: each column-parallel layer
        # redistributes the norm's sequence shards (a DTensor) to Replicate.


def _fully_shard(impl: str):  # noqa: ANN202
    if impl == "torch":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_engine import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def _meshes(layout: str) -> tuple[Any, Any, int, int]:
    """(dp mesh, tp mesh, dp rank, dp size)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if layout == "hsdp":  # (replicate 2, shard 1, tp 2): 3-D
        mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
        dp = mesh["replicate", "shard"]
        return dp, mesh["tp"], dp._flatten().get_local_rank(), 2
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"], mesh["dp"].get_local_rank(), world // 2


def _train(impl: str, layout: str, config: str, steps: int) -> dict[str, Any]:
    fully_shard, mp_cls = _fully_shard(impl)
    dp_mesh, tp_mesh, dp_rank, dp = _meshes(layout)
    net = build()
    if config == "ac":
        for block in net.blocks:
            block.checkpointed = True
    apply_tp(
        net,
        tp_mesh,
        loss_parallel=config == "loss_parallel",
        sequence_parallel=config != "mixed_meshes",
    )
    kw: dict[str, Any] = {"mesh": dp_mesh}
    if config == "bf16":
        kw["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks:
        fully_shard(block, **kw)
    fully_shard(net, **kw)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, norms, ours_norms = [], [], []
    torch_clip_fails = None
    for step in range(steps):
        x, y = batch(step, dp_rank, dp)
        micro = 2 if config == "accum" else 1
        total = 0.0
        for m in range(micro):
            xs, ys = x.chunk(micro)[m], y.chunk(micro)[m]
            net.set_requires_gradient_sync(m == micro - 1)
            with _loss_context(config):
                loss = F.cross_entropy(net(xs).flatten(0, 1).float(), ys.flatten()) / micro
                loss.backward()
            if hasattr(loss, "full_tensor"):
                loss = loss.full_tensor()
            total += float(loss.detach())
        losses.append(total)
        if impl == "ours":  # ours against torch's on the same gradients
            from fsdp_engine import clip_grad_norm_ as ours_clip

            if config == "mixed_meshes":  # torch's fails on two meshes: ours clips
                norms.append(float(ours_clip(net.parameters(), CLIP)))
            else:
                ours_norms.append(float(ours_clip(net.parameters(), 1e9)))
        if config == "mixed_meshes":
            if impl == "torch":  # pytorch#180346: torch's clip needs one mesh
                try:
                    torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
                    torch_clip_fails = False
                except (RuntimeError, ValueError, AssertionError):
                    torch_clip_fails = True
                norms.append(float("nan"))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    placements = {n: tuple(repr(p) for p in q.placements) for n, q in net.named_parameters()}
    meshes = {n: tuple(q.device_mesh.mesh_dim_names) for n, q in net.named_parameters()}
    final = {n: q.full_tensor().detach().float().clone() for n, q in net.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "ours_norms": ours_norms,
        "final": final,
        "torch_clip_fails": torch_clip_fails,
        "placements": placements,
        "meshes": meshes,
    }


def _loss_context(config: str):  # noqa: ANN202
    import contextlib

    if config != "loss_parallel":
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


SECTIONS = (
    ("fp32", 3),
    ("bf16", 2),
    ("ac", 2),
    ("accum", 2),
    ("loss_parallel", 2),
    ("mixed_meshes", 2),
)


def run(backend: Any, impl: str, layouts: tuple[str, ...]) -> dict[Any, Any]:
    del backend  # the default process group is up; meshes come from init_device_mesh
    torch.set_num_threads(1)
    out: dict[Any, Any] = {}
    for layout in layouts:
        for config, steps in SECTIONS:
            try:
                out[(layout, config)] = _train(impl, layout, config, steps)
            except Exception:  # noqa: BLE001 - reported per section by the test
                out[(layout, config)] = {"error": traceback.format_exc()}
            dist.barrier()
    return out


def reference(config: str, steps: int) -> dict[str, Any]:
    """One process on the global batch, fp32 (bf16 compute for "bf16")."""
    torch.set_num_threads(1)
    net = build()
    if config == "ac":
        for block in net.blocks:
            block.checkpointed = True
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        if config == "bf16":
            shadow = build().to(torch.bfloat16)
            shadow.load_state_dict({k: v.to(torch.bfloat16) for k, v in net.state_dict().items()})
            loss = F.cross_entropy(shadow(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            for p, s in zip(net.parameters(), shadow.parameters()):
                p.grad = s.grad.float()
        else:
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
        losses.append(float(loss.detach()))
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    return {
        "losses": losses,
        "norms": norms,
        "final": {n: p.detach().clone() for n, p in net.named_parameters()},
    }


# ---- dp_mesh_dims: parameters already DTensors on the whole SPMD mesh (FSDP2's API) ------
SPMD_CASES = {
    # name: (mesh sizes, dim names, shard dims, replicate dims, tensor parallel)
    "fsdp": ((4,), ("fsdp",), "fsdp", None, False),
    "hsdp": ((2, 2), ("rep", "shard"), "shard", "rep", False),
    "multi_shard": ((2, 2), ("dp0", "dp1"), ("dp0", "dp1"), None, False),
    "ddp": ((4,), ("ddp",), None, "ddp", False),
    "fsdp_tp": ((2, 2), ("fsdp", "tp"), "fsdp", None, True),
    "hsdp_tp": ((1, 2, 2), ("rep", "fsdp", "tp"), "fsdp", "rep", True),
}
SPMD_DIM = 10


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(SPMD_DIM, 3 * SPMD_DIM)
        self.out_proj = nn.Linear(3 * SPMD_DIM, SPMD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(F.relu(self.in_proj(x)))


def _spmd_model(mesh: Any, tp: bool) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = Mlp()  # one MLP, as FSDP2's own test: see spmd_run
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        for name, p in list(mod.named_parameters(recurse=False)):
            place = [Replicate()] * mesh.ndim
            if tp and name == "weight":
                place[-1] = Shard(0) if "in_proj" in mod_name else Shard(1)
            mod.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, place)))
    return model


def _avoid_tp_dim(param: Any) -> Any:
    """With tp, FSDP shards a tp ``Shard(0)`` weight on dim 1 (as FSDP2's own test does)."""
    from torch.distributed.tensor import Shard

    return Shard(1 if any(getattr(q, "dim", None) == 0 for q in param.placements) else 0)


def _spmd_batch(step: int, dp_rank: int, dp: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3000 + step)
    return torch.randn(4, SPMD_DIM, generator=g).chunk(dp)[dp_rank]


def spmd_run(backend: Any, impl: str, cases: tuple[str, ...]) -> dict[str, Any]:
    del backend
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate

    fully_shard = _fully_shard(impl)[0]
    out: dict[str, Any] = {}
    for case in cases:
        sizes, names, shard, rep, tp = SPMD_CASES[case]
        try:
            mesh = init_device_mesh("cpu", sizes, mesh_dim_names=names)
            model = _spmd_model(mesh, tp)
            fn = _avoid_tp_dim if tp else None
            # Two units and the root. (Stacking two tensor-parallel MLPs whose row-parallel
            # output is Partial gives gradients Partial on the dp dims under DTensor's own
            # rules, FSDP or not, which neither FSDP reduces as a one-process run would.)
            for m in (model.in_proj, model.out_proj):
                fully_shard(
                    m,
                    mesh=mesh,
                    shard_placement_fn=fn,
                    dp_mesh_dims=DataParallelMeshDims(shard=shard, replicate=rep),
                )
            fully_shard(
                model,
                mesh=mesh,
                shard_placement_fn=fn,
                dp_mesh_dims=DataParallelMeshDims(shard=shard, replicate=rep),
            )
            dp_names = tuple(n for n in names if n != "tp")
            dp_mesh = mesh[dp_names] if len(dp_names) > 1 else mesh[dp_names[0]]
            dp_rank = (
                dp_mesh._flatten().get_local_rank()
                if dp_mesh.ndim > 1
                else dp_mesh.get_local_rank()
            )
            dp = dp_mesh.size()
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = []
            for step in range(2):
                x = DTensor.from_local(
                    _spmd_batch(step, dp_rank, dp), mesh, [Replicate()] * mesh.ndim, run_check=False
                )
                loss = model(x).sum()
                loss.backward()
                losses.append(float(loss.to_local().detach()))
                opt.step()
                opt.zero_grad()
            out[case] = {
                "losses": losses,
                "dp_rank": dp_rank,
                "dp": dp,
                "final": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
                "placements": {
                    n: tuple(repr(q) for q in p.placements) for n, p in model.named_parameters()
                },
            }
        except Exception:  # noqa: BLE001
            out[case] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def spmd_reference(dp: int) -> dict[str, Any]:
    """One process: each dp rank's loss is a sum over its rows; FSDP averages over dp."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        (model(_spmd_batch(step, 0, 1)).sum() / dp).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def meta_init_run(backend: Any) -> dict[str, Any]:
    """A model built on meta, cut by tp, then fully_shard(param_init_fn=reset_parameters):
    each unit materialised and initialised on its tp pieces (ours only: torch's fully_shard
    has no param_init_fn)."""
    del backend
    torch.set_num_threads(1)
    from fsdp_engine import fully_shard, reset_parameters
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    with torch.device("meta"):
        net = Net()
    apply_tp(net, mesh["tp"])
    for block in net.blocks:
        fully_shard(block, mesh=mesh["dp"], param_init_fn=reset_parameters)
    fully_shard(net, mesh=mesh["dp"], param_init_fn=reset_parameters)
    x, y = batch(0, mesh["dp"].get_local_rank(), 2)
    loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
    loss.backward()
    return {
        "full": {n: p.full_tensor().detach().clone() for n, p in net.named_parameters()},
        "meta": [n for n, p in net.named_parameters() if p.device.type == "meta"],
        "loss": float(loss.detach()),
    }
