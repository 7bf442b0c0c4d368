"""fsdp-engine: FlatParameter Fully Sharded Data Parallel for PyTorch.

`fully_shard` each block, then the model; train as usual. Communication and memory come from
fsdp-comm and fsdp-memory through their public interfaces (any implementation can be passed).
"""

import importlib.metadata as _metadata

from ._clip_grad import clip_grad_norm_
from ._context import CommBackend, MemoryLayer
from ._flat_param import FlatLayout, FlatParameter, ParamSlot
from ._full_params_context import register_fsdp_forward_method, summon_full_params
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard
from ._grad_scaler import ShardedGradScaler
from ._layout import ParamShard, full_parameters, model_backend, sharded_layout
from ._policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardingStrategy
from ._wrap import (
    CallableWrapPolicy,
    FullyShardedDataParallel,
    ModuleWrapPolicy,
    SizeBasedWrapPolicy,
    WrapPolicy,
)

try:  # the version lives in pyproject.toml only
    __version__ = _metadata.version("fsdp-engine")
except _metadata.PackageNotFoundError:  # on sys.path without being installed
    __version__ = "0+unknown"

__all__ = [
    "CallableWrapPolicy",
    "FullyShardedDataParallel",
    "ModuleWrapPolicy",
    "SizeBasedWrapPolicy",
    "WrapPolicy",
    "CPUOffloadPolicy",
    "CommBackend",
    "MemoryLayer",
    "FSDPModule",
    "FlatLayout",
    "FlatParameter",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamShard",
    "ParamSlot",
    "ShardedGradScaler",
    "ShardingStrategy",
    "UnshardHandle",
    "clip_grad_norm_",
    "full_parameters",
    "fully_shard",
    "model_backend",
    "register_fsdp_forward_method",
    "sharded_layout",
    "summon_full_params",
]
