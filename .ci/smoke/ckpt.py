"""fsdp-ckpt installed alone: save a sharded model on two ranks, load it into a plain one."""
import tempfile

import fsdp_ckpt
import fsdp_comm
import fsdp_engine
import torch
from torch import nn

PATH = tempfile.mkdtemp()


torch.manual_seed(0)
expected = nn.Linear(8, 5)


def rank(backend: fsdp_comm.Backend) -> None:
    model = nn.Linear(8, 5)  # rank threads share one RNG: copy the weights, don't re-seed
    model.load_state_dict(expected.state_dict())
    fsdp_engine.fully_shard(model, mesh=fsdp_comm.init_mesh(backend.world_size, backend=backend))
    fsdp_ckpt.save(PATH, model, backend=backend)


fsdp_comm.launch(rank, 2, backend="threads", timeout=120)
plain = nn.Linear(8, 5)
fsdp_ckpt.load(PATH, plain)
for name in ("weight", "bias"):
    assert torch.equal(getattr(plain, name), getattr(expected, name)), f"loaded {name} differs"
print("fsdp-ckpt", fsdp_ckpt.__version__, "ok")
