"""fsdp: Fully Sharded Data Parallel for PyTorch, as layered packages.

This umbrella re-exports the main names of each layer; import the layer packages directly
(`fsdp_comm`, ...) for everything else.
"""

from fsdp_comm import (
    Backend,
    BackendUnavailableError,
    CommError,
    CommTimeoutError,
    Mesh,
    ReduceOp,
    Work,
    available_backends,
    get_backend,
    init_mesh,
    launch,
    register_backend,
)

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CommError",
    "CommTimeoutError",
    "Mesh",
    "ReduceOp",
    "Work",
    "available_backends",
    "get_backend",
    "init_mesh",
    "launch",
    "register_backend",
]
