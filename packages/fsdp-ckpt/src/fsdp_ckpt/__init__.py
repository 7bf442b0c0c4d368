"""fsdp-ckpt: crash-safe sharded checkpoints that load at any world size.

`save` has every rank write only the slices it holds (safetensors, checksummed) and commits the
new version atomically; `load` reshards to the current world size, (dp, tp) layout and wrapping
(a plain unsharded model too), optimizer state included; `verify` checks every byte;
`full_state_dict` gathers whole parameters one unit at a time (`iter_full_state_dict` and
`iter_full_tensors`: one tensor at a time, from a model or a checkpoint); `export`, `to_dcp` and
`from_dcp` move checkpoints to single files and to and from ``torch.distributed.checkpoint``.
"""

from ._cleanup import wait_for_cleanup
from ._dcp import from_dcp, to_dcp
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointMismatchWarning,
    LoadReport,
    ShapeMismatch,
)
from ._export import export
from ._fsspec_storage import FsspecStorage
from ._full_state import full_state_dict
from ._index import FORMAT_VERSION
from ._inspect import CheckpointInfo, inspect_checkpoint, verify
from ._load import load
from ._save import SaveHandle, save
from ._storage import LocalStorage, Storage
from ._stream import iter_full_state_dict, iter_full_tensors
from ._version import __version__

__all__ = [
    "FORMAT_VERSION",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointMismatchWarning",
    "FsspecStorage",
    "LoadReport",
    "LocalStorage",
    "SaveHandle",
    "ShapeMismatch",
    "Storage",
    "__version__",
    "export",
    "from_dcp",
    "full_state_dict",
    "inspect_checkpoint",
    "iter_full_state_dict",
    "iter_full_tensors",
    "load",
    "save",
    "to_dcp",
    "verify",
    "wait_for_cleanup",
]
