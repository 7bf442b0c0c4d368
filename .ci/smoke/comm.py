"""fsdp-comm installed alone: two thread ranks all-gather and reduce-scatter."""
import fsdp_comm
import torch


def rank(backend: fsdp_comm.Backend) -> list[float]:
    out = torch.empty(4)
    backend.all_gather_into_tensor(out, torch.full((2,), float(backend.rank)))
    return out.tolist()


results = fsdp_comm.launch(rank, 2, backend="threads", timeout=60)
assert results == [[0.0, 0.0, 1.0, 1.0]] * 2, results
print("fsdp-comm", fsdp_comm.__version__, "ok; backends:", fsdp_comm.available_backends())
