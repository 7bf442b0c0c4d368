"""fsdp: Fully Sharded Data Parallel for PyTorch, as layered packages.

This umbrella re-exports the main names of each layer; import the layer packages directly
(`fsdp_comm`, `fsdp_memory`, `fsdp_engine`) for everything else.
"""

import importlib.metadata as _metadata

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
from fsdp_engine import (
    CPUOffloadPolicy,
    FSDPModule,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ModuleWrapPolicy,
    OffloadPolicy,
    ShardedGradScaler,
    ShardingStrategy,
    TimelineSummary,
    clip_grad_norm_,
    fully_shard,
    profile_steps,
)
from fsdp_memory import MemoryManager, MemoryStats, RateLimiter

from .hf import HFExportReport, HFLoadReport, export_hf, load_hf_pretrained, save_hf_pretrained
from .models import GPT, GPTConfig

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("fsdp")
except _metadata.PackageNotFoundError:  # on sys.path without being installed
    __version__ = "0+unknown"

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "CPUOffloadPolicy",
    "CommError",
    "CommTimeoutError",
    "FSDPModule",
    "FullyShardedDataParallel",
    "GPT",
    "GPTConfig",
    "HFExportReport",
    "HFLoadReport",
    "MemoryManager",
    "MemoryStats",
    "Mesh",
    "MixedPrecisionPolicy",
    "ModuleWrapPolicy",
    "OffloadPolicy",
    "RateLimiter",
    "ReduceOp",
    "ShardedGradScaler",
    "ShardingStrategy",
    "TimelineSummary",
    "Work",
    "available_backends",
    "clip_grad_norm_",
    "export_hf",
    "fully_shard",
    "get_backend",
    "init_mesh",
    "launch",
    "load_hf_pretrained",
    "profile_steps",
    "register_backend",
    "save_hf_pretrained",
]
