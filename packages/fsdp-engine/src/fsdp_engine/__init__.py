"""fsdp-engine: FlatParameter Fully Sharded Data Parallel for PyTorch.

`fully_shard` each block, then the model; train as usual. Communication and memory come from
fsdp-comm and fsdp-memory through their public interfaces (any implementation can be passed).
"""

import importlib.metadata as _metadata

from ._clip_grad import clip_grad_norm_
from ._context import CommBackend, MemoryLayer
from ._deferred_init import reset_parameters
from ._flat_param import ALIGN_BYTES, FlatLayout, FlatParameter, ParamSlot, flat_padded_numel
from ._full_params_context import register_fsdp_forward_method, summon_full_params
from ._fully_shard import FSDPModule, UnshardHandle, fully_shard
from ._grad_scaler import ShardedGradScaler
from ._layout import ParamShard, full_parameters, model_backend, sharded_layout
from ._mesh_shape import MeshShape, MeshShapeError, strategy_mesh_shape
from ._policies import (
    STRATEGY_NAMES,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from ._profile import StepProfile, profile_steps
from ._state import MAX_REDUCTIONS_IN_FLIGHT
from ._timeline_summary import TimelineSummary, UnitTimes
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
    "ALIGN_BYTES",
    "MAX_REDUCTIONS_IN_FLIGHT",
    "MeshShape",
    "MeshShapeError",
    "STRATEGY_NAMES",
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
    "StepProfile",
    "TimelineSummary",
    "UnitTimes",
    "UnshardHandle",
    "clip_grad_norm_",
    "flat_padded_numel",
    "full_parameters",
    "fully_shard",
    "model_backend",
    "profile_steps",
    "register_fsdp_forward_method",
    "reset_parameters",
    "sharded_layout",
    "strategy_mesh_shape",
    "summon_full_params",
]
