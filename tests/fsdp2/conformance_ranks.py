"""Rank-side cases of test_conformance.py: behaviours PyTorch's own FSDP2 tests check, each run
on torch's ``fully_shard`` and on ours, against a one-process reference computed on every rank
(the same model before sharding, every rank's batch, gradients averaged over ranks).

Each case returns plain data: per parameter either ``"none"`` (no gradient), the largest
difference from the reference, or a message. Module level, so the forkserver can import it.
"""

from __future__ import annotations

import copy
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM = 23, 13


class Net(nn.Module):
    """Embedding, two bodies, a norm and a head; odd sizes (uneven over 2 and 4 ranks)."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.body = nn.Sequential(nn.Linear(DIM, 17), nn.ReLU(), nn.Linear(17, DIM))
        self.body2 = nn.Sequential(nn.Linear(DIM, 11), nn.ReLU(), nn.Linear(11, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=not tie)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.norm(self.body2(self.body(self.embed(x))))
        return h if skip_head else self.head(h)


def fully_shard_of(impl: str) -> Callable[..., Any]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_engine import fully_shard
    return fully_shard


def _full(t: torch.Tensor | None) -> torch.Tensor | None:
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def data(rank: int, step: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (3, 5), generator=gen)


def compare_grads(model: nn.Module, ref: nn.Module) -> dict[str, Any]:
    """Per parameter: "none" when neither has a gradient, the largest difference, or what
    differs."""
    out: dict[str, Any] = {}
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        a, b = _full(p.grad), q.grad
        if a is None and b is None:
            out[name] = "none"
        elif (a is None) != (b is None):
            out[name] = (
                f"gradient is {'None' if a is None else 'set'}, reference's is "
                f"{'None' if b is None else 'set'}"
            )
        else:
            out[name] = (a - b).abs().max().item()
    return out


def compare_params(model: nn.Module, ref: nn.Module) -> float:
    return max(
        (_full(p) - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())
    )


def reference(ref: nn.Module, fn: Callable[[nn.Module, int], None], world: int) -> None:
    """Run ``fn`` for every rank's batch on the unsharded model; average the gradients."""
    for r in range(world):
        fn(ref, r)
    for p in ref.parameters():
        if p.grad is not None:
            p.grad /= world


def _sum_backward(m: nn.Module, r: int) -> None:
    m(data(r)).sum().backward()


def step_and_compare(
    model: nn.Module, ref: nn.Module, rank: int, world: int, weight_decay: float = 0.01
) -> dict[str, Any]:
    """One AdamW step on both (built after any freezing): the gradients compared before the
    step, the parameters after it (``params_after_step``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=weight_decay)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=weight_decay)
    _sum_backward(model, rank)
    reference(ref, _sum_backward, world)
    out = compare_grads(model, ref)
    opt.step()
    ropt.step()
    out["params_after_step"] = compare_params(model, ref)
    return out


def train_and_compare(
    model: nn.Module,
    ref: nn.Module,
    rank: int,
    world: int,
    steps: int,
    opt: torch.optim.Optimizer,
    ropt: torch.optim.Optimizer,
    check: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """``steps`` steps of a mean-square loss on both; the largest gradient difference seen
    and the parameters' difference at the end. ``check`` runs after each backward."""
    worst = 0.0
    for step in range(steps):

        def fn(m: nn.Module, r: int, step: int = step) -> None:
            m(data(r, step)).pow(2).mean().backward()

        fn(model, rank)
        reference(ref, fn, world)
        worst = max(
            [worst, *(v for v in compare_grads(model, ref).values() if isinstance(v, float))]
        )
        if check is not None:
            check()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    return worst, compare_params(model, ref)


def shard(
    impl: str, model: Net, *, group_head: bool = True, rf: Any = None, mesh: Any = None
) -> None:
    fully_shard = fully_shard_of(impl)
    fully_shard(model.body, reshard_after_forward=rf, mesh=mesh)
    fully_shard(model.body2, reshard_after_forward=rf, mesh=mesh)
    if group_head:
        fully_shard([model.norm, model.head], reshard_after_forward=rf, mesh=mesh)
    fully_shard(model, reshard_after_forward=rf, mesh=mesh)


# ---- cases -----------------------------------------------------------------------------------
def case_partial_forward(impl: str, rank: int, world: int) -> dict[str, Any]:
    """A grouped unit whose head takes no part in the forward: its gradients stay None."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model)

    def fn(m: nn.Module, r: int) -> None:
        m(data(r), skip_head=True).sum().backward()

    fn(model, rank)
    reference(ref, fn, world)
    return compare_grads(model, ref)


def case_frozen_after_shard(impl: str, rank: int, world: int) -> dict[str, Any]:
    """requires_grad_(False) after fully_shard: no gradient, the optimizer leaves it alone."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model)
    for m in (model, ref):
        m.body[0].weight.requires_grad_(False)
        m.head.bias.requires_grad_(False)
    return step_and_compare(model, ref, rank, world, weight_decay=0.1)


def case_non_root_after_step(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Forward and backward through a non-root unit alone, after a root step."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)

    def step(m: nn.Module, r: int) -> None:
        m(data(r)).sum().backward()

    def alone(m: nn.Module, r: int) -> None:
        x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(7 + r))
        m.body(x).sum().backward()

    step(model, rank)
    reference(ref, step, world)
    for o in (opt, ropt):
        o.step()
        o.zero_grad()
    alone(model, rank)
    reference(ref, alone, world)
    return compare_grads(model, ref)


def case_chunked_loss(impl: str, rank: int, world: int, rf: Any) -> dict[str, Any]:
    """The loss head called once per chunk with a backward each, then one backward through
    the model (torchtitan's chunked cross-entropy)."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model, rf=rf)

    _chunked_loss(model, rank)
    reference(ref, _chunked_loss, world)
    return compare_grads(model, ref)


def _chunked_loss(m: nn.Module, r: int) -> None:
    """The head per chunk, a backward each, then one backward through the model."""
    h = m(data(r), skip_head=True)
    hd = h.detach().requires_grad_(True)
    for c in hd.chunk(3, dim=0):
        m.head(c).pow(2).sum().backward()
    h.backward(hd.grad)


def case_chunked_loss_resident_ac(impl: str, rank: int, world: int) -> dict[str, Any]:
    """The chunked loss when every shard group has one rank (mesh (world, 1): units whose
    gathered form is their shard) and the bodies are activation-checkpointed: the backward
    through the model after the head's recomputes them (before: with the DTensors the first
    backward had put back, "got mixed torch.Tensor and DTensor"; torchtitan at dp 1 x tp 2)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    model = Net()
    ref = copy.deepcopy(model)
    model.body = checkpoint_wrapper(model.body)
    model.body2 = checkpoint_wrapper(model.body2)
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    shard(impl, model, mesh=mesh)

    _chunked_loss(model, rank)
    reference(ref, _chunked_loss, world)
    grads = compare_grads(model, ref)
    return {k.replace("._checkpoint_wrapped_module", ""): v for k, v in grads.items()}


def case_chunked_accumulation(impl: str, rank: int, world: int) -> dict[str, Any]:
    """The chunked loss over three micro-batches, synchronising only the last
    (test_partial_group_forward_grad_accum_chunked): the grouped head stays gathered between
    micro-batches with its unreduced gradient shown as ``.grad``; once reduced, that shown
    tensor is stale and must not be counted again (it was, for a while this session)."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model, rf=False)

    def fn(m: nn.Module, r: int, sync_last: bool = False) -> None:
        for step in range(3):
            if sync_last:
                m.set_requires_gradient_sync(step == 2)
                m.set_is_last_backward(step == 2)
            h = m(data(r, step), skip_head=True)
            hd = h.detach().requires_grad_(True)
            for c in hd.chunk(2, dim=0):
                m.head(c).pow(2).sum().backward()
            h.backward(hd.grad)

    fn(model, rank, sync_last=True)
    reference(ref, fn, world)
    return compare_grads(model, ref)


def case_hsdp_accumulation(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Hybrid sharding on (2 replicas x 2 shards): two micro-batches reduce-scattered without
    the replica all-reduce (set_requires_all_reduce(False)), the third with it."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model, group_head=False, mesh=mesh)
    for micro in range(3):
        model.set_requires_all_reduce(micro == 2)
        model(data(rank, micro)).pow(2).mean().backward()
        for r in range(world):
            (ref(data(r, micro)).pow(2).mean() / world).backward()
    return compare_grads(model, ref)


def case_tied_grouped(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Tied embedding and head sharded together, fully_shard([embed, head]), then the root,
    as FSDP2 recommends: three steps match the reference."""
    fully_shard = fully_shard_of(impl)
    model = Net(tie=True)
    ref = copy.deepcopy(model)
    fully_shard(model.body)
    fully_shard([model.embed, model.head])
    fully_shard(model)
    grads, params = train_and_compare(
        model,
        ref,
        rank,
        world,
        3,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.optim.SGD(ref.parameters(), lr=0.1),
    )
    return {"grads": grads, "params": params}


def case_tied_siblings(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Tied weights in two units, neither containing the other: refused at the first
    forward."""
    fully_shard = fully_shard_of(impl)
    model = Net(tie=True)
    fully_shard(model.embed)
    fully_shard(model.head)
    fully_shard(model)
    try:
        model(data(rank))
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def case_meta_assign(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Build on meta, shard, load a full state dict with assign=True (rank 0's weights,
    distributed as DTensors), train a step: as the reference."""
    from torch.distributed.tensor import distribute_tensor

    ref = Net()
    full_sd = ref.state_dict()
    with torch.device("meta"):
        model = Net()
    shard(impl, model)
    sharded = {
        k: nn.Parameter(distribute_tensor(full_sd[k], v.device_mesh, v.placements))
        for k, v in model.state_dict().items()
    }
    model.load_state_dict(sharded, assign=True)
    return step_and_compare(model, ref, rank, world)


def case_meta_left(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Forward with parameters still on meta: a RuntimeError naming them."""
    with torch.device("meta"):
        model = Net()
    shard(impl, model)
    try:
        model(data(rank))
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"error": None}


def case_frozen_float8(impl: str, rank: int, world: int) -> dict[str, Any]:
    """A frozen float8 weight in a unit with trainable fp32 ones (a quantised base model):
    gathered, computed with, the others train."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.w8 = nn.Parameter(torch.randn(9, DIM).to(torch.float8_e4m3fn), requires_grad=False)
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) @ self.w8.to(torch.float32).t()

    model = Model()
    ref = copy.deepcopy(model)
    fully_shard_of(impl)(model)

    def fn(m: nn.Module, r: int) -> None:
        m(torch.randn(4, DIM, generator=torch.Generator().manual_seed(r))).sum().backward()

    fn(model, rank)
    reference(ref, fn, world)
    out = compare_grads(model, ref)
    mine = model.w8.to_local().float()  # full_tensor() would all-gather float8 over gloo
    rows = -(-ref.w8.shape[0] // world)
    out["w8"] = (
        (mine - ref.w8.float()[rank * rows : rank * rows + mine.shape[0]]).abs().max().item()
    )
    return out


def case_placement(impl: str, rank: int, world: int) -> dict[str, Any]:
    """shard_placement_fn: 2-D weights on dim 1, the rest on dim 0; two steps as the
    reference, contiguous local tensors and gradients."""
    from torch.distributed.tensor import Shard

    def placement(p: nn.Parameter) -> Any:
        return Shard(1) if p.ndim == 2 else None

    class Mlp(nn.Module):  # dim 1 of every weight even: FSDP2 refuses uneven dims > 0
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, 12)
            self.body = nn.Sequential(nn.Linear(12, 18), nn.ReLU(), nn.Linear(18, 12))
            self.head = nn.Linear(12, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(x)))

    fully_shard = fully_shard_of(impl)
    model = Mlp()
    ref = copy.deepcopy(model)
    fully_shard(model.body, shard_placement_fn=placement)
    fully_shard(model, shard_placement_fn=placement)
    out: dict[str, Any] = {
        "placements": {n: [repr(p) for p in q.placements] for n, q in model.named_parameters()}
    }

    def contiguous() -> None:
        out["contiguous"] = all(
            p.to_local().is_contiguous() and p.grad.to_local().is_contiguous()
            for p in model.parameters()
        )

    out["grads"], out["params"] = train_and_compare(
        model,
        ref,
        rank,
        world,
        2,
        torch.optim.AdamW(model.parameters(), lr=0.1),
        torch.optim.AdamW(ref.parameters(), lr=0.1),
        contiguous,
    )
    return out


def case_extension(impl: str, rank: int, world: int) -> dict[str, Any]:
    """FSDP2's all-gather extension patched on the local tensors: called, and forward computes
    with what fsdp_post_all_gather built (here: the weights rounded through bfloat16)."""
    calls = {"pre": 0, "post": 0}

    def pre(
        self: torch.Tensor,
        mesh: Any,
        outer_size: Any,
        outer_stride: Any,
        module: Any,
        mp_policy: Any,
    ) -> Any:
        calls["pre"] += 1
        return (self.to(torch.bfloat16),), None

    def post(
        self: torch.Tensor, outputs: Any, metadata: Any, param_dtype: Any, *, out: Any = None
    ) -> Any:
        calls["post"] += 1
        (t,) = outputs
        return t.to(param_dtype), (t,)

    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model, group_head=False)
    for name, p in model.named_parameters():
        if name.endswith("weight") and p.ndim == 2:
            p._local_tensor.fsdp_pre_all_gather = pre.__get__(p._local_tensor)
            p._local_tensor.fsdp_post_all_gather = post.__get__(p._local_tensor)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("weight") and p.ndim == 2:
                p.copy_(p.to(torch.bfloat16).float())

    _sum_backward(model, rank)
    reference(ref, _sum_backward, world)
    out = {k: v for k, v in compare_grads(model, ref).items() if not k.endswith("weight")}
    out["calls"] = calls["pre"] > 0 and calls["pre"] == calls["post"]
    return out


def case_all_reduce_hook(impl: str, rank: int, world: int) -> dict[str, Any]:
    """set_all_reduce_hook: the hook gets each reduced gradient shard and what it writes is the
    gradient (here it doubles it)."""
    seen: list[tuple[int, ...]] = []

    def hook(output: torch.Tensor) -> None:
        seen.append(tuple(output.shape))
        output.mul_(2)

    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model, group_head=False)
    model.set_all_reduce_hook(hook)

    _sum_backward(model, rank)
    reference(ref, _sum_backward, world)
    for n, p in ref.named_parameters():
        if p.grad is not None and not n.startswith("body"):  # the hook is the root unit's
            p.grad *= 2
    return {"hook_calls": len(seen), "grads": compare_grads(model, ref)}


def case_registration(impl: str, rank: int, world: int) -> dict[str, Any]:
    """After a forward that keeps a unit gathered, its registered parameters are the
    unsharded tensors; after backward (or reshard()) the DTensors again. A write to the
    unsharded parameters between forward and reshard() is kept."""
    from torch.distributed.tensor import DTensor

    model = Net()
    shard(impl, model, rf=False)
    kinds = {}
    model(data(rank))
    kinds["after_forward"] = sorted({type(p).__name__ for p in model.parameters()})
    kinds["full_shape"] = tuple(model.head.weight.shape)
    model(data(rank)).sum().backward()
    kinds["after_backward"] = all(isinstance(p, DTensor) for p in model.parameters())
    return kinds


def case_ignored_params(impl: str, rank: int, world: int) -> dict[str, Any]:
    """ignored_params: those stay plain parameters (no DTensor, no sharding, a local
    gradient), the others are sharded and match the reference."""
    from torch.distributed.tensor import DTensor

    model = Net()
    ref = copy.deepcopy(model)
    ignored = set(model.body2.parameters())
    fully_shard = fully_shard_of(impl)
    fully_shard(model.body, ignored_params=ignored)
    fully_shard(model, ignored_params=ignored)
    out: dict[str, Any] = {
        "plain": [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    }
    _sum_backward(model, rank)
    _sum_backward(ref, rank)  # ignored parameters: this rank's own gradient, unreduced
    mine = {n: p.grad for n, p in ref.named_parameters() if n.startswith("body2")}
    ref.zero_grad()
    reference(ref, _sum_backward, world)
    out["grads"] = {n: v for n, v in compare_grads(model, ref).items() if not n.startswith("body2")}
    out["ignored"] = max(
        (p.grad - mine[n]).abs().max().item()
        for n, p in model.named_parameters()
        if n.startswith("body2")
    )
    return out


def case_module_rules(impl: str, rank: int, world: int) -> dict[str, Any]:
    """fully_shard.state, a second fully_shard of one module, containers without forward, and
    deepcopy of a unit: FSDP2's answers."""
    fully_shard = fully_shard_of(impl)
    model = Net()
    fully_shard(model.body)
    fully_shard(model)
    out: dict[str, Any] = {"states": len({id(fully_shard.state(m)) for m in (model, model.body)})}
    for name, call, kind in (
        ("reapply", lambda: fully_shard(model.body), AssertionError),
        ("module_list", lambda: fully_shard(nn.ModuleList([nn.Linear(3, 3)])), ValueError),
        ("deepcopy", lambda: copy.deepcopy(model), AssertionError),
    ):
        try:
            call()
            out[name] = None
        except kind as exc:
            out[name] = str(exc)
    return out


def case_pending_gradients(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Gradient accumulation without sync (FSDP2's pending gradients): while unsharded the
    parameter shows this rank's unreduced gradient as .grad, the same tensor each step;
    an in-place edit of it counts; the sharded .grad holds only what was reduced."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6, bias=False)
    ref = copy.deepcopy(model)
    fully_shard_of(impl)(model, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    out: dict[str, Any] = {}
    local = torch.zeros(6, 4)
    saved = None
    for step, sync in enumerate((False, False, True)):
        model.set_requires_gradient_sync(sync)
        x = torch.full((2, 4), float(rank + step + 1))
        model(x).sum().backward()
        local += torch.autograd.grad(ref(x).sum(), ref.weight)[0]
        if sync:
            out["none_after_sync"] = model.weight.grad is None
            continue
        grad = model.weight.grad
        out[f"pending{step}"] = (grad - local).abs().max().item()
        out["same_object"] = saved is None or grad is saved
        saved = grad
        if step == 1:
            grad.mul_(2)  # an edit of the unreduced gradient counts
            local *= 2
    model.reshard()
    total = local.clone()
    dist.all_reduce(total)
    out["reduced"] = (_full(model.weight.grad) - total / world).abs().max().item()
    return out


def case_input_grad_then_backward(impl: str, rank: int, world: int) -> dict[str, Any]:
    """``torch.autograd.grad`` toward the input first (a gradient penalty, the input half of a
    split backward), then a backward through the same graph: the parameters get their
    gradient from the second pass. This engine warns after the first (Note [backward that
    skips the parameters]): the weight half of pipelining's split backward cannot reach it."""
    model = Net()
    ref = copy.deepcopy(model)
    shard(impl, model)

    def fn(m: nn.Module, r: int) -> list[str]:
        got: list[torch.Tensor] = []  # the body's output: the units after it are skipped
        handle = m.body.register_forward_hook(lambda mod, args, out: got.append(out))
        loss = m(data(r)).sum()
        handle.remove()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.autograd.grad(loss, got, retain_graph=True)
        loss.backward()
        return [str(w.message) for w in seen]

    seen = fn(model, rank)
    reference(ref, fn, world)
    out = compare_grads(model, ref)
    out["warned"] = any("reached this unit's outputs but not its parameters" in m for m in seen)
    return out


def case_pending_set_by_user(impl: str, rank: int, world: int) -> dict[str, Any]:
    """Gradients set on the registered unsharded parameters without a backward (what the
    split backward of pipelining's zero-bubble schedules does, ``weight.grad = dw`` then
    ``+=``) are pending gradients too: the synchronising backward reduces them with its own."""
    torch.manual_seed(0)
    model = nn.Linear(4, 6, bias=False)
    ref = copy.deepcopy(model)
    fully_shard_of(impl)(model, reshard_after_forward=False)
    model.set_reshard_after_backward(False)
    local = torch.zeros(6, 4)
    out: dict[str, Any] = {}
    saved = None
    for step, sync in enumerate((False, False, True)):
        model.set_requires_gradient_sync(sync)
        x = torch.full((2, 4), float(rank + step + 1))
        y = model(x)
        dw = torch.autograd.grad(ref(x).sum(), ref.weight)[0]
        local += dw
        if sync:
            y.sum().backward()
            continue
        weight = model.weight
        if weight.grad is None:
            weight.grad = dw.clone()
        else:
            weight.grad += dw
        out["same_object"] = saved is None or weight.grad is saved
        saved = weight.grad
    model.reshard()
    total = local.clone()
    dist.all_reduce(total)
    out["reduced"] = (_full(model.weight.grad) - total / world).abs().max().item()
    return out


def case_split_backward(
    impl: str, rank: int, world: int, reduce_dtype: torch.dtype
) -> dict[str, Any]:
    """The split backward of pipelining's zero-bubble schedules on a grouped unit that stays
    gathered (PyTorch's ``test_grouped_pipeline_split_backward``, uneven shapes): two
    micro-batches differentiate toward the input first (``stage_backward_input``), then
    toward the registered unsharded parameters (``stage_backward_weight``), without
    gradient sync; a third runs a whole synchronising backward. The unreduced ``.grad`` after
    each weight pass, and the reduced gradient at the end, against a bf16 reference."""
    from fsdp_engine import MixedPrecisionPolicy as OurPolicy
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.pipelining._backward import (
        stage_backward_input,
        stage_backward_weight,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=False), nn.Linear(7, 3, bias=False))
    ref = copy.deepcopy(model).to(torch.bfloat16)
    for p in ref.parameters():
        p.grad_dtype = reduce_dtype
    policy = (TorchPolicy if impl == "torch" else OurPolicy)(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype
    )
    fully_shard = fully_shard_of(impl)
    fully_shard([model[0], model[1]], reshard_after_forward=False, mp_policy=policy)
    fully_shard(model)
    model.set_reshard_after_backward(False)
    out: dict[str, Any] = {"dtype": True, "same_object": True, "none_after_sync": True}
    saved: list[torch.Tensor] = []
    for step in range(3):
        sync = step == 2
        model.set_requires_gradient_sync(sync)
        x = torch.full((2, 5), rank + step + 1.0, dtype=torch.bfloat16, requires_grad=True)
        y = model(x)
        if sync:
            y.sum().backward()
        else:
            _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], model.parameters())
            stage_backward_weight(model.parameters(), groups)
        ref(x.detach()).sum().backward()
        params = list(model.parameters())
        if sync:
            out["none_after_sync"] = all(p.grad is None for p in params)
            continue
        for i, (p, q) in enumerate(zip(params, ref.parameters())):
            if p.grad is None:
                out[f"unreduced{step}.{i}"] = "gradient is None"
                continue
            out["dtype"] &= p.grad.dtype == reduce_dtype
            out[f"unreduced{step}.{i}"] = _relative(p.grad, q.grad)
            if step:
                out["same_object"] &= p.grad is saved[i]
            else:
                saved.append(p.grad)
    model[0].reshard()
    for i, (p, q) in enumerate(zip(model.parameters(), ref.parameters())):
        total = q.grad.float()
        dist.all_reduce(total)
        out[f"reduced.{i}"] = _relative(_full(p.grad), total / world)
    return out


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest value (bf16 sums of values up to
    a few units: an absolute tolerance would depend on the data)."""
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp(min=1)).item()


CASES: dict[str, Callable[..., dict[str, Any]]] = {
    "partial_forward": case_partial_forward,
    "frozen_after_shard": case_frozen_after_shard,
    "non_root_after_step": case_non_root_after_step,
    "chunked_loss_reshard": lambda i, r, w: case_chunked_loss(i, r, w, True),
    "chunked_loss_default": lambda i, r, w: case_chunked_loss(i, r, w, None),
    "tied_grouped": case_tied_grouped,
    "tied_siblings": case_tied_siblings,
    "meta_assign": case_meta_assign,
    "meta_left": case_meta_left,
    "hsdp_accumulation": case_hsdp_accumulation,
    "frozen_float8": case_frozen_float8,
    "placement": case_placement,
    "extension": case_extension,
    "all_reduce_hook": case_all_reduce_hook,
    "registration": case_registration,
    "ignored_params": case_ignored_params,
    "module_rules": case_module_rules,
    "pending_gradients": case_pending_gradients,
    "pending_set_by_user": case_pending_set_by_user,
    "input_grad_then_backward": case_input_grad_then_backward,
    "chunked_accumulation": case_chunked_accumulation,
    "chunked_loss_resident_ac": case_chunked_loss_resident_ac,
    "split_backward_bf16": lambda i, r, w: case_split_backward(i, r, w, torch.bfloat16),
    "split_backward_fp32": lambda i, r, w: case_split_backward(i, r, w, torch.float32),
}


def run_cases(backend: Any, impl: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Every named case on this rank; a case's exception becomes ``{"exception": text}``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = CASES[name](impl, rank, world)
        except Exception:  # one broken case fails only its own test
            out[name] = {"exception": traceback.format_exc()}
    return out
