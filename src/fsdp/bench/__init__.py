"""The benchmarks, one runnable module each (``python -m fsdp.bench.NAME --help``):

- `fsdp.bench.engines`: a training step of this engine against torch's FSDP2, FSDP1 and DDP
  on CPU or GPU (also ``fsdp compare``).
- `fsdp.bench.gpu`: speed, per-unit overhead and CPU offload on one GPU, against FSDP2.
- `fsdp.bench.timeline`: the step timeline (exposed and hidden communication).
- `fsdp.bench.traffic`: noise-free counters of what the engine adds to a step.
- `fsdp.bench.ablations`: the FSDP paper's ablations at small scale.

This package imports none of them, so that ``python -m`` runs each one fresh.
"""

__all__: list[str] = []
