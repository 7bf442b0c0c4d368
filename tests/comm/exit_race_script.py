"""Run by test_torchrun.py under `torchrun`: all-reduces of temporaries, then an immediate exit.

Note [a gloo work's last reference] (fsdp_comm/_torch_backend.py): a gloo worker releasing a
temporary's last reference during interpreter shutdown aborted the rank.
"""

import torch
from fsdp_comm import get_backend

be = get_backend("torch")
for size in (1, 1000, 100_000) * 7:
    be.all_reduce(torch.ones(size))
be.barrier()
