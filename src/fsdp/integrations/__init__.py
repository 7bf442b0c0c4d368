"""Integrations of this engine with training frameworks, one module per framework.

Each module imports its framework only when it is itself imported, so importing `fsdp` (or
this package) never needs the framework installed:

- `fsdp.integrations.lightning`: `FSDPStrategy`, a ``lightning.pytorch`` strategy
  (``pip install "fsdp[lightning]"``).
"""

__all__: list[str] = []
