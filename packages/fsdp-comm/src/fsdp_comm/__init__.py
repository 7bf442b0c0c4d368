"""fsdp-comm: collectives for Fully Sharded Data Parallel behind one swappable interface.

Backends: ``torch`` (torch.distributed: gloo on CPU, NCCL on GPU), ``cupy-nccl`` (NCCL through
CuPy on torch CUDA tensors), ``threads`` (ranks as threads of one process) and ``fake`` (one
rank of a simulated world). Start ranks with `launch`, arrange them with `init_mesh`; under
Slurm, `join_slurm_environment` sets torchrun's variables from ``SLURM_*``. `agree` checks that
ranks were started (or set up) alike and names what differs. `FaultTolerantReplicate` is a
replicate dimension for hybrid sharding that survives the loss of a replica group and takes it
back (Note [fault-tolerant replicas]).
"""

import importlib.metadata as _metadata

from ._agreement import agree
from ._backend import Backend
from ._cli_format import CliHelpFormatter
from ._cupy_backend import CupyNcclBackend
from ._errors import AgreementError, BackendUnavailableError, CommError, CommTimeoutError
from ._fake_backend import FakeBackend, FakeTraffic
from ._ft_replicate import FaultToleranceStats, FaultTolerantReplicate
from ._launch import launch
from ._logging import configure_from_environment as _configure_from_environment
from ._logging import configure_logging
from ._mesh import Mesh, init_mesh
from ._reduce_op import ReduceKind, ReduceOp
from ._registry import ENTRY_POINT_GROUP, available_backends, get_backend, register_backend
from ._sizes import parse_size, size_arg
from ._slurm import expand_hostlist, join_slurm_environment, slurm_environment, slurm_port
from ._threads_backend import ThreadsBackend
from ._torch_backend import TorchBackend
from ._work import CompletedWork, Work

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("fsdp-comm")
except _metadata.PackageNotFoundError:  # on sys.path without being installed
    __version__ = "0+unknown"

_configure_from_environment()  # only when FSDP_LOG_LEVEL is set: library users opt in

__all__ = [
    "AgreementError",
    "Backend",
    "BackendUnavailableError",
    "CliHelpFormatter",
    "CommError",
    "CommTimeoutError",
    "CompletedWork",
    "CupyNcclBackend",
    "ENTRY_POINT_GROUP",
    "FakeBackend",
    "FakeTraffic",
    "FaultToleranceStats",
    "FaultTolerantReplicate",
    "Mesh",
    "ReduceKind",
    "ReduceOp",
    "ThreadsBackend",
    "TorchBackend",
    "Work",
    "agree",
    "available_backends",
    "configure_logging",
    "expand_hostlist",
    "get_backend",
    "init_mesh",
    "join_slurm_environment",
    "launch",
    "parse_size",
    "register_backend",
    "size_arg",
    "slurm_environment",
    "slurm_port",
]
