"""fsdp-memory installed alone: a buffer comes back from the pool it went to."""
import fsdp_memory
import torch

pool = fsdp_memory.BufferPool("cpu")
first = pool.allocate(1000, torch.float32)
ptr = first.data_ptr()
pool.free(first)
again = pool.allocate(1000, torch.float32)
assert again.data_ptr() == ptr, "the pool did not reuse its buffer"
print("fsdp-memory", fsdp_memory.__version__, "ok;", pool.stats())
