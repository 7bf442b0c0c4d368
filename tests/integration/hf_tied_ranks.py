"""Rank side of test_hf_tied_across_units.py (module level, for the forkserver)."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

STEPS, BATCH, SEQ, VOCAB = 3, 4, 8, 61


def build() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(config)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def shard(model: nn.Module) -> None:
    """As a user shards GPT-2: its blocks, then ``transformer``, then the root, which puts the
    input embedding (in ``transformer``) and the tied head (in the root) in two units."""
    from fsdp_engine import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model.transformer)
    fully_shard(model)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train(model: nn.Module, rank: int, world: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x = batch(step).chunk(world)[rank]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def tied_rank(backend: Any, ckpt_dir: str) -> dict[str, Any]:
    """Train the sharded model, then move its weights through model.state_dict, DCP, fsdp-ckpt
    and a full state dict into plain models; report what differs from one process."""
    import fsdp_ckpt
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model = build()
    ref = copy.deepcopy(model)
    shard(model)
    out: dict[str, Any] = {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "losses": _train(model, rank, world),
        "ref_losses": [],
    }
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):  # one process, the global batch: the ranks' mean loss
        x = batch(step)
        loss = ref(input_ids=x, labels=x).loss
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        out["ref_losses"].append(loss.item())
    expect = {n: p.detach() for n, p in ref.named_parameters()}
    out["params"] = max(
        (_full(p) - expect[n]).abs().max().item() for n, p in model.named_parameters()
    )
    # A full state dict (DCP's API) loads into the plain model.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    plain = build()
    plain.load_state_dict(full)
    out["full_sd"] = max((p - expect[n]).abs().max().item() for n, p in plain.named_parameters())
    out["full_sd_tied"] = torch.equal(full["lm_head.weight"], full["transformer.wte.weight"])
    # DCP: save the sharded state dict, load into a freshly sharded model.
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    again = build()
    shard(again)
    sd = again.state_dict()
    dcp.load(sd, checkpoint_id=os.path.join(ckpt_dir, "dcp"))
    again.load_state_dict(sd)
    out["dcp"] = max((_full(p) - expect[n]).abs().max().item() for n, p in again.named_parameters())
    # fsdp-ckpt: save sharded, load into a plain model on every rank.
    fsdp_ckpt.save(os.path.join(ckpt_dir, "ckpt"), model).wait()
    plain2 = build()
    fsdp_ckpt.load(os.path.join(ckpt_dir, "ckpt"), plain2)
    out["fsdp_ckpt"] = max((p - expect[n]).abs().max().item() for n, p in plain2.named_parameters())
    out["fsdp_ckpt_tied"] = plain2.lm_head.weight is plain2.transformer.wte.weight
    return out
