"""fsdp-engine installed alone: one step of a sharded model on two thread ranks."""
import copy

import fsdp_comm
import fsdp_engine
import torch
from torch import nn

torch.manual_seed(0)
TEMPLATE = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def rank(backend: fsdp_comm.Backend) -> float:
    model = copy.deepcopy(TEMPLATE)  # rank threads share one RNG: copy, don't re-seed
    mesh = fsdp_comm.init_mesh(backend.world_size, backend=backend)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp_engine.fully_shard(layer, mesh=mesh)
    fsdp_engine.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = model(torch.ones(2, 8)).square().mean()
    loss.backward()
    opt.step()
    return loss.item()


losses = fsdp_comm.launch(rank, 2, backend="threads", timeout=120)
reference = TEMPLATE(torch.ones(2, 8)).square().mean().item()
assert abs(losses[0] - reference) < 1e-6 and losses[0] == losses[1], (losses, reference)
print("fsdp-engine", fsdp_engine.__version__, "ok; loss", losses[0])
