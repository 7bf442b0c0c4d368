"""The benchmarks, one runnable module each (``python -m fsdp.bench.NAME --help``):

- `fsdp.bench.engines`: a training step of this engine against torch's FSDP2, FSDP1 and DDP
  on CPU or GPU (also ``fsdp compare``).
- `fsdp.bench.gpu`: speed, per-unit overhead and CPU offload on one GPU, against FSDP2.
- `fsdp.bench.timeline`: the step timeline (exposed and hidden communication).
- `fsdp.bench.traffic`: noise-free counters of what the engine adds to a step.
- `fsdp.bench.ablations`: the FSDP paper's ablations at small scale.
- `fsdp.bench.fault_tolerant`: hybrid sharding with and without ``--fault-tolerant`` (and
  another checkout's), when nothing fails.

Each takes ``--record DIR``: the run as a JSON record (date, machine, versions, git commit,
command, configuration, figures), read back with `read_records`; ``scripts/gen_figures.py``
makes docs/figures.md from the records in docs/records. This package imports none of the
benchmarks, so that ``python -m`` runs each one fresh.
"""

from ._record import (
    RECORD_KINDS,
    SCHEMA_VERSION,
    make_record,
    read_record,
    read_records,
    validate_record,
    write_record,
)

__all__ = [
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "make_record",
    "read_record",
    "read_records",
    "validate_record",
    "write_record",
]
