"""Run by test_torchrun.py under `torchrun`: the torch backend joins from env:// unchanged."""

import json
import sys

import torch
from fsdp_comm import get_backend, init_mesh

be = get_backend("torch")
out = torch.empty(be.world_size)
be.all_gather_into_tensor(out, torch.tensor([float(be.rank)]))
mesh = init_mesh((1, be.world_size), backend=be)
print(
    json.dumps(
        {
            "rank": be.rank,
            "world_size": be.world_size,
            "gathered": out.tolist(),
            "coordinate": list(mesh.coordinate),
        }
    )
)
sys.stdout.flush()
be.close()
