"""Rank-side code for the FSDP2 drop-in tests, launched by `fsdp_comm.launch` (module level, so
the forkserver can import it).

`run_sections` runs several checks in one launched group (rank start-up and the torch.distributed
imports cost seconds; the checks themselves milliseconds) and returns, per section, either the
section's result or ``{"error": traceback}``, so one failing feature fails only its own tests.
Every section builds a fresh model. Results hold only plain tensors, strings and numbers (a
DTensor does not travel between processes). ``fsdp_engine`` is imported only when the "ours"
implementation is asked for.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import time
import traceback
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .models import batch, build, loss_fn, make_optimizer

_MESHES: dict[str, Any] = {}


# ---- set-up ----------------------------------------------------------------------------------
def get_fully_shard(impl: str) -> Callable[..., Any]:
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    elif impl == "ours":
        from fsdp_engine import fully_shard
    else:
        raise ValueError(impl)
    return fully_shard


def mesh_of(kind: str) -> Any:
    """``"1d"``: all ranks on one shard dimension; ``"hsdp"``: 2 replicas x 2 shards (world 4)."""
    if kind not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        if kind == "1d":
            _MESHES[kind] = init_device_mesh("cpu", (dist.get_world_size(),))
        elif kind == "hsdp":
            _MESHES[kind] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            raise ValueError(kind)
    return _MESHES[kind]


def sharded_model(impl: str, mesh_kind: str = "1d", reshard: bool | None = None) -> torch.nn.Module:
    """The test model, each block a unit and then the root, as FSDP2 users write it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fully_shard = get_fully_shard(impl)
    mesh = mesh_of(mesh_kind)
    model = build()
    mp = MixedPrecisionPolicy()  # torch's own policy class, passed to both implementations
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model


def _rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.detach()
    return (t.full_tensor() if isinstance(t, DTensor) else t).clone()


def _describe(t: Any) -> dict[str, Any]:
    """What a user can see of a tensor without communicating."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {
        "type": type(t).__name__,
        "is_dtensor": isinstance(t, DTensor),
        "shape": tuple(t.shape),
        "ndim": t.ndim,
        "device": str(t.device),
    }
    if isinstance(t, DTensor):
        out["placements"] = tuple(repr(p) for p in t.placements)
        out["mesh_shape"] = tuple(t.device_mesh.shape)
        out["local_shape"] = tuple(t.to_local().shape)
    return out


def _shapes(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], int]]:
    return {n: (tuple(p.shape), p.ndim) for n, p in model.named_parameters()}


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def _train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer | None,
    steps: range,
    clip: float | None = None,
    observe: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    rank, world = _rank()
    losses, norms = [], []
    for step in steps:
        if observe:
            observe("before_forward")
        loss = loss_fn(model, step, rank, world)
        if observe:
            observe("after_forward")
        loss.backward()
        if observe:
            observe("after_backward")
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(_norm_result(norm))
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if observe:
            observe("after_step")
        losses.append(loss.item())
    return {"losses": losses, "norms": norms}


def _norm_result(norm: torch.Tensor) -> dict[str, Any]:
    """What clip_grad_norm_ returned: its kind, its full value, and ``.item()`` as users call
    it."""
    return {"describe": _describe(norm), "value": _full(norm).item(), "item": norm.item()}


def _clone_tree(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone_tree(v) for v in obj)
    return copy.deepcopy(obj)


def _count_comms(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the number of collectives it issued (c10d and functional collectives)."""
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:
        out = fn()
    return out, comm.get_total_counts()


# ---- sections --------------------------------------------------------------------------------
def sec_structure(impl: str, mesh_kind: str) -> dict[str, Any]:
    """FSDPModule recognition and the parameters as registered after fully_shard."""
    from torch.distributed.fsdp import FSDPModule

    model = sharded_model(impl, mesh_kind)
    return {
        "isinstance": {
            "root": isinstance(model, FSDPModule),
            **{f"blocks.{i}": isinstance(b, FSDPModule) for i, b in enumerate(model.blocks)},
        },
        "types": {"root": type(model).__name__, "block": type(model.blocks[0]).__name__},
        "params": {n: _describe(p) for n, p in model.named_parameters()},
        "full": _full_params(model),
    }


def sec_state_dict(impl: str, mesh_kind: str) -> dict[str, Any]:
    """model.state_dict() without communication; load_state_dict round trip."""
    model = sharded_model(impl, mesh_kind)
    sd, comms = _count_comms(model.state_dict)
    out: dict[str, Any] = {
        "comms": comms,
        "describe": {k: _describe(v) for k, v in sd.items()},
        "full": {k: _full(v) for k, v in sd.items()},
    }
    saved = _clone_tree(sd)
    opt = make_optimizer("adamw_foreach", model.parameters())
    _train(model, opt, range(2))  # the parameters move away from `saved`
    out["moved"] = any(
        not torch.equal(_full(p), out["full"][n]) for n, p in model.named_parameters()
    )
    result = model.load_state_dict(saved)
    out["load_result"] = (list(result.missing_keys), list(result.unexpected_keys))
    out["after_load"] = {n: _describe(p) for n, p in model.named_parameters()}
    out["after_load_full"] = _full_params(model)
    # The reloaded model computes the step-0 loss again.
    out["loss_after_load"] = _train(model, None, range(1))["losses"][0]
    return out


def sec_optim(impl: str, mesh_kind: str, kind: str, reshard: bool | None = None) -> dict[str, Any]:
    """Train with a torch optimizer; record shapes at every phase, including inside forward."""
    model = sharded_model(impl, mesh_kind, reshard=reshard)
    try:
        opt = make_optimizer(kind, model.parameters())
    except (RuntimeError, ValueError) as exc:  # e.g. fused AdamW not supported here
        if "fused" in kind:
            return {"unsupported": f"{type(exc).__name__}: {exc}"}
        raise
    phases: dict[str, list[dict[str, Any]]] = defaultdict(list)
    phases["after_shard"].append(_shapes(model))

    def in_forward(module: torch.nn.Module, args: Any) -> None:
        phases["in_forward"].append(_shapes(module))

    handle = model.blocks[0].register_forward_pre_hook(in_forward)
    out = _train(model, opt, range(3), observe=lambda ph: phases[ph].append(_shapes(model)))
    handle.remove()
    out["phases"] = dict(phases)
    out["final"] = _full_params(model)
    out["placements"] = {n: _describe(p).get("placements") for n, p in model.named_parameters()}
    return out


def sec_clip(impl: str, mesh_kind: str, clip: float) -> dict[str, Any]:
    """clip_grad_norm_ on the sharded parameters: returned norm, clipped grads, next losses."""
    model = sharded_model(impl, mesh_kind)
    opt = make_optimizer("adamw_foreach", model.parameters())
    rank, world = _rank()
    loss_fn(model, 0, rank, world).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    first = {
        **_norm_result(norm),
        "clipped_grads": {n: _full(p.grad) for n, p in model.named_parameters()},
    }
    opt.step()
    opt.zero_grad()
    out = _train(model, opt, range(1, 4), clip=clip)
    out["first"] = first
    return out


def sec_hooks(impl: str, mesh_kind: str) -> dict[str, Any]:
    """Post-accumulate-grad hooks on the sharded parameters, then optimizer-in-backward."""
    from torch.distributed.tensor import DTensor

    rank, world = _rank()
    model = sharded_model(impl, mesh_kind)
    counts: dict[str, int] = defaultdict(int)
    seen: dict[str, dict[str, Any]] = {}
    params = dict(model.named_parameters())

    def make_hook(name: str) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            counts[name] += 1
            g = p.grad
            seen[name] = {
                "same_param": p is params[name],
                "param": _describe(p),
                "grad": None if g is None else _describe(g),
                "grad_local": None
                if g is None
                else (g.to_local() if isinstance(g, DTensor) else g).detach().clone(),
            }

        return hook

    handles = [p.register_post_accumulate_grad_hook(make_hook(n)) for n, p in params.items()]
    out: dict[str, Any] = {"counts": []}
    for step in range(2):
        loss_fn(model, step, rank, world).backward()
        out["counts"].append(dict(counts))
        counts.clear()
        if step == 0:
            out["seen"] = seen.copy()
            # The hook saw the final (reduced, sharded) gradient: the one left on the parameter.
            out["hook_grad_is_final"] = {
                n: p.grad is not None
                and torch.equal(
                    (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad),
                    seen[n]["grad_local"],
                )
                for n, p in params.items()
                if n in seen
            }
            out["grads"] = {n: _full(p.grad) for n, p in params.items() if p.grad is not None}
            for s in out["seen"].values():
                del s["grad_local"]
        refs = [
            weakref.ref(t)
            for p in params.values()
            if p.grad is not None
            for t in (p.grad, p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        ]
        model.zero_grad(set_to_none=True)
    # zero_grad(set_to_none=True) frees the gradients' memory by the next forward at the latest.
    loss_fn(model, 2, rank, world)
    gc.collect()
    out["grads_alive_after_forward"] = sum(r() is not None for r in refs)
    for h in handles:
        h.remove()

    # Optimizer in backward: one optimizer per parameter, stepped as its gradient is ready.
    model = sharded_model(impl, mesh_kind)
    opts = {p: make_optimizer("adamw_forloop", [p]) for p in model.parameters()}
    fired: dict[int, int] = defaultdict(int)

    def step_in_backward(p: torch.Tensor) -> None:
        fired[id(p)] += 1
        opts[p].step()
        p.grad = None

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_in_backward)
    in_bwd = _train(model, None, range(3))
    out["in_backward"] = {
        "losses": in_bwd["losses"],
        "final": _full_params(model),
        "fired": sorted(fired.values()),
        "grads_left": [n for n, p in model.named_parameters() if p.grad is not None],
    }
    return out


def _snapshot(named: Any) -> dict[str, Any]:
    """What the module holds now under each name: ``_describe`` plus is-an-nn.Parameter."""
    return {
        n: {**_describe(p), "is_parameter": isinstance(p, torch.nn.Parameter)} for n, p in named
    }


def sec_unshard(impl: str, mesh_kind: str, trained: bool = False) -> dict[str, Any]:
    """unshard() registers full plain parameters on the module; reshard() the DTensors again.
    ``trained``: after one training step (the units initialised by a forward), else before any
    forward."""
    model = sharded_model(impl, mesh_kind)
    opt = make_optimizer("adamw_foreach", model.parameters())
    first = 1 if trained else 0
    if trained:
        _train(model, opt, range(first))
    block = model.blocks[0]
    out: dict[str, Any] = {}

    def snapshot(m: torch.nn.Module) -> dict[str, Any]:
        return _snapshot(m.named_parameters())

    out["before"] = snapshot(block)
    block.unshard()
    out["unsharded"] = snapshot(block)
    out["unsharded_values"] = {n: p.detach().clone() for n, p in block.named_parameters()}
    out["unsharded_attr"] = _describe(block.qkv.weight)  # the attribute users read
    out["other_block_during"] = snapshot(model.blocks[1])
    block.reshard()
    out["resharded"] = snapshot(block)

    handle = model.blocks[1].unshard(async_op=True)
    out["async_handle"] = type(handle).__name__
    if handle is not None:
        handle.wait()
    out["async_unsharded"] = snapshot(model.blocks[1])
    out["async_values"] = {n: p.detach().clone() for n, p in model.blocks[1].named_parameters()}
    model.blocks[1].reshard()

    model.unshard()  # the root unit: only the root's own parameters
    root_own = {n: p for n, p in model.named_parameters() if not n.startswith("blocks.")}
    out["root_own_unsharded"] = _snapshot(root_own.items())
    out["root_own_values"] = {n: p.detach().clone() for n, p in root_own.items()}
    out["root_blocks_during"] = snapshot(model.blocks[0])
    model.reshard()
    out["root_resharded"] = snapshot(model)
    # Training after the unshard/reshard cycles is untouched.
    out["losses"] = _train(model, opt, range(first, first + 2))["losses"]
    return out


_SD_OPTIONS = {
    # name: (options for get_*, options for set_*)
    "sharded": ({}, {}),
    "full": ({"full_state_dict": True}, {"full_state_dict": True}),
    # full_state_dict + cpu_offload gives the values to rank 0 only (the other ranks get empty
    # dicts), so loading needs broadcast_from_rank0, and through set_model_state_dict and
    # set_optimizer_state_dict: set_state_dict(model_state_dict={}) on the other ranks would
    # treat the call as optimizer-only and skip the model's broadcast that rank 0 enters.
    "full_cpu_offload": (
        {"full_state_dict": True, "cpu_offload": True},
        {"full_state_dict": True, "cpu_offload": True, "broadcast_from_rank0": True},
    ),
}


def sec_dcp_api(impl: str, mesh_kind: str, variant: str) -> dict[str, Any]:
    """get_model_state_dict / get_state_dict / set_state_dict, then training continues."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    get_kw, set_kw = _SD_OPTIONS[variant]
    get_opts, set_opts = StateDictOptions(**get_kw), StateDictOptions(**set_kw)
    a = sharded_model(impl, mesh_kind)
    opt_a = make_optimizer("adamw_foreach", a.parameters())
    out: dict[str, Any] = {"first": _train(a, opt_a, range(2))["losses"]}

    msd = get_model_state_dict(a, options=get_opts)
    out["model_sd"] = {k: _describe(v) for k, v in msd.items()}
    out["model_sd_full"] = {k: _full(v) for k, v in msd.items()}
    msd2, osd = get_state_dict(a, opt_a, options=get_opts)
    out["model_sd_keys_2"] = sorted(msd2)
    out["optim_state_keys"] = sorted(osd.get("state", {}))
    out["optim_group_params"] = [list(g["params"]) for g in osd.get("param_groups", [])]
    out["optim_state"] = {
        fqn: {k: _describe(v) for k, v in st.items() if isinstance(v, torch.Tensor)}
        for fqn, st in osd.get("state", {}).items()
    }
    saved_m, saved_o = _clone_tree(msd2), _clone_tree(osd)
    out["next"] = _train(a, opt_a, range(2, 4))["losses"]  # uninterrupted

    b = sharded_model(impl, mesh_kind)
    opt_b = make_optimizer("adamw_foreach", b.parameters())
    if set_opts.broadcast_from_rank0:
        set_model_state_dict(b, saved_m, options=set_opts)
        set_optimizer_state_dict(b, opt_b, saved_o, options=set_opts)
    else:
        set_state_dict(
            b, opt_b, model_state_dict=saved_m, optim_state_dict=saved_o, options=set_opts
        )
    out["reloaded_params"] = {n: _describe(p) for n, p in b.named_parameters()}
    out["resumed"] = _train(b, opt_b, range(2, 4))["losses"]
    return out


def sec_dcp_save(impl: str, mesh_kind: str, path: str, steps: int) -> dict[str, Any]:
    """Train, dcp.save model and optimizer, keep training (the uninterrupted run)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = sharded_model(impl, mesh_kind)
    opt = make_optimizer("adamw_foreach", model.parameters())
    out = {"first": _train(model, opt, range(steps))["losses"]}
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    dist.barrier()
    out["saved_full"] = _full_params(model)
    out["next"] = _train(model, opt, range(steps, steps + 2))["losses"]
    return out


def sec_dcp_load(impl: str, mesh_kind: str, path: str, steps: int) -> dict[str, Any]:
    """A fresh model and optimizer at another world size resume from the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = sharded_model(impl, mesh_kind)
    opt = make_optimizer("adamw_foreach", model.parameters())
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out = {"loaded_full": _full_params(model)}
    out["resumed"] = _train(model, opt, range(steps, steps + 2))["losses"]
    return out


def _call_twice(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A method that calls the module itself, as Hugging Face's ``generate`` or a Lightning
    step does."""
    return self(x) + self(x)


def sec_forward_method(impl: str, mesh_kind: str) -> dict[str, Any]:
    """register_fsdp_forward_method on a method that calls ``self(x)`` twice: its loss and the
    full gradients, then one more forward and backward still work."""
    import types

    if impl == "torch":
        from torch.distributed.fsdp import register_fsdp_forward_method
    else:
        from fsdp_engine import register_fsdp_forward_method
    model = sharded_model(impl, mesh_kind)
    model.twice = types.MethodType(_call_twice, model)
    register_fsdp_forward_method(model, "twice")
    rank, world = _rank()
    x, y = batch(0, rank, world)
    loss = torch.nn.functional.cross_entropy(model.twice(x).flatten(0, 1), y.flatten())
    loss.backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    again = loss_fn(model, 1, rank, world)
    again.backward()
    return {"loss": loss.item(), "grads": grads, "again": again.item()}


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "structure": sec_structure,
    "state_dict": sec_state_dict,
    "optim": sec_optim,
    "clip": sec_clip,
    "hooks": sec_hooks,
    "unshard": sec_unshard,
    "dcp_api": sec_dcp_api,
    "dcp_save": sec_dcp_save,
    "dcp_load": sec_dcp_load,
    "forward_method": sec_forward_method,
}


def run_sections(
    backend: Any, impl: str, sections: tuple[tuple[Any, ...], ...]
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Each key ``(name, mesh_kind, *args)`` runs ``SECTIONS[name](impl, mesh_kind, *args)``.

    A section that fails on some ranks only can leave the others waiting in a collective: the
    launch then ends at its timeout. ``FSDP2_TEST_DEBUG=1`` prints each section as it starts.
    """
    torch.set_num_threads(1)
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    for key in sections:
        name, mesh_kind, *args = key
        if os.environ.get("FSDP2_TEST_DEBUG"):
            print(f"[rank {dist.get_rank()}] section {key}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            results[key] = SECTIONS[name](impl, mesh_kind, *args)
        except Exception:
            results[key] = {"error": traceback.format_exc()}
        results[key]["seconds"] = time.perf_counter() - start
    return results
