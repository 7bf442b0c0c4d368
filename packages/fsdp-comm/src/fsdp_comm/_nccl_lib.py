"""CuPy's NCCL binding, loaded lazily: availability checks, install hints, enum values, versions.

Nothing here imports CuPy at module level, so ``import fsdp_comm`` never imports it; only
`load_nccl` does, when a ``cupy-nccl`` backend is created.
"""

from __future__ import annotations

import os
import platform
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ._errors import BackendUnavailableError
from ._reduce_op import ReduceKind

__all__ = [
    "NCCL_DTYPES",
    "NCCL_OPS",
    "NCCL_SUM",
    "NCCL_AVG_SINCE",
    "install_hint",
    "load_nccl",
    "nccl_dtype",
    "parse_nccl_version",
    "format_version",
    "torch_nccl_version",
    "nccl_version_mismatch",
    "warn_on_nccl_version_mismatch",
    "encode_unique_id",
    "decode_unique_id",
]

# ncclDataType_t and ncclRedOp_t values from nccl.h: part of NCCL's ABI, stable since 2.0.
NCCL_DTYPES: dict[torch.dtype, int] = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
NCCL_SUM, NCCL_MAX, NCCL_AVG = 0, 2, 4
NCCL_OPS: dict[ReduceKind, int] = {
    ReduceKind.SUM: NCCL_SUM,
    ReduceKind.MAX: NCCL_MAX,
    ReduceKind.AVG: NCCL_AVG,
    # No PREMUL_SUM: CuPy does not bind ncclRedOpCreatePreMulSum; the backend scales a copy.
}
#: ncclAvg and ncclBfloat16 first shipped in NCCL 2.10.
NCCL_AVG_SINCE = (2, 10, 0)
_BF16_SINCE = (2, 10, 0)
_BOOL_AS_BYTES = 1  # ncclUint8: bools travel as bytes, fine for copies, wrong for sums


def nccl_dtype(dtype: torch.dtype, *, reducing: bool, version: tuple[int, int, int]) -> int:
    """The NCCL data type for ``dtype``; `TypeError` (before any communication) when none fits."""
    if dtype == torch.bool and not reducing:
        return _BOOL_AS_BYTES
    code = NCCL_DTYPES.get(dtype)
    if code is None or (dtype == torch.bfloat16 and version < _BF16_SINCE):
        names = ", ".join(str(d).removeprefix("torch.") for d in NCCL_DTYPES)
        extra = " (bool only for all-gather and broadcast)" if dtype == torch.bool else ""
        raise TypeError(
            f"cupy-nccl: dtype {dtype} is not supported by NCCL {format_version(version)}"
            f"{extra}; supported: {names}"
        )
    return code


# ---- install hints and loading ---------------------------------------------------------------
def install_hint(torch_cuda: str | None) -> str:
    """The pip command that installs CuPy and NCCL matching a torch built for ``torch_cuda``."""
    major = torch_cuda.split(".")[0] if torch_cuda else None
    if major == "12":
        return (
            f'pip install "fsdp-comm[cupy]" (cupy-cuda12x and nvidia-nccl-cu12, matching '
            f"this torch's CUDA {torch_cuda})"
        )
    if major == "13":
        return (
            f'pip install "fsdp-comm[cupy-cu13]" (cupy-cuda13x and nvidia-nccl-cu13, '
            f"matching this torch's CUDA {torch_cuda})"
        )
    if major is not None:
        return (
            f"pip install cupy-cuda{major}x nvidia-nccl-cu{major} (this torch uses CUDA "
            f"{torch_cuda}; fsdp-comm's extras cover CUDA 12 and 13)"
        )
    return (
        'pip install "fsdp-comm[cupy]" for torch\'s CUDA 12 builds, or '
        '"fsdp-comm[cupy-cu13]" for its CUDA 13 builds'
    )


def _torch_gpu_problem() -> str | None:
    """Why torch cannot use a GPU here, or None when it can."""
    if torch.cuda.is_available():
        return None
    if getattr(torch.version, "hip", None):
        return (
            f"this torch ({torch.__version__}) is a ROCm build; cupy-nccl needs NVIDIA "
            "NCCL: use the torch backend (RCCL) instead"
        )
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
            "torch (and run on a machine with an NVIDIA GPU)"
        )
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"
    return (
        f"torch.cuda.is_available() is False: no NVIDIA GPU or working driver is visible "
        f"(torch built for CUDA {torch.version.cuda}{shown})"
    )


def load_nccl() -> Any:
    """Import ``cupy.cuda.nccl`` after checking CuPy, the NCCL library and a GPU are usable.

    Raises `BackendUnavailableError` saying what to install, or why the backend cannot run.
    """
    hint = install_hint(torch.version.cuda)
    try:
        import cupy
    except ImportError as exc:
        gpu = _torch_gpu_problem()
        also = f" Note: {gpu}." if gpu else ""
        raise BackendUnavailableError(
            f"cupy-nccl: CuPy is not installed ({exc}). Install it with: {hint}.{also}"
        ) from exc
    from cupy.cuda import nccl  # never raises: sets `available` instead

    if not getattr(nccl, "available", False):
        raise BackendUnavailableError(
            f"cupy-nccl: CuPy {cupy.__version__} is installed but cannot load the NCCL library "
            f"(libnccl.so.2; set CUPY_DEBUG_LIBRARY_LOAD=1 to see where it looked). Install "
            f"it with: {hint}"
        )
    gpu = _torch_gpu_problem()
    if gpu is not None:
        raise BackendUnavailableError(f"cupy-nccl cannot run here: {gpu}")
    if not cupy.cuda.is_available():
        raise BackendUnavailableError(
            f"cupy-nccl cannot run here: torch sees a GPU but CuPy {cupy.__version__} does not "
            f"({_cupy_device_error(cupy)}); the driver may be too old for CuPy's CUDA version. "
            f"Install the CuPy matching torch's CUDA: {hint}"
        )
    return nccl


def _cupy_device_error(cupy: Any) -> str:
    try:
        return f"{cupy.cuda.runtime.getDeviceCount()} devices"
    except Exception as exc:  # the reason is what we want to show
        return f"{type(exc).__name__}: {exc}"


# ---- versions --------------------------------------------------------------------------------
def parse_nccl_version(code: int) -> tuple[int, int, int]:
    """``(major, minor, patch)`` from NCCL's version code (``ncclGetVersion``).

    NCCL_VERSION_CODE is ``X*1000 + Y*100 + Z`` up to 2.8 and ``X*10000 + Y*100 + Z`` from 2.9
    on: 2708 is 2.7.8, 23203 is 2.32.3.
    """
    if isinstance(code, bool) or not isinstance(code, int) or code <= 0:
        raise ValueError(f"an NCCL version code must be a positive int, got {code!r}")
    if code < 10000:
        return code // 1000, code % 1000 // 100, code % 100
    return code // 10000, code % 10000 // 100, code % 100


def format_version(version: Sequence[int]) -> str:
    return ".".join(str(v) for v in version[:3])


def torch_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL torch was built with, or None (CPU and ROCm builds have none)."""
    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # unannotated in torch
    except Exception:  # no NCCL compiled in
        return None
    return tuple(int(v) for v in version[:3])  # type: ignore[return-value]


def nccl_version_mismatch(cupy_code: int, torch_version: Sequence[Any] | None) -> str | None:
    """A warning text when CuPy's NCCL (a version code) differs from torch's, else None.

    ``torch_version`` is `torch.cuda.nccl.version()`'s tuple, which may end with a suffix string.
    """
    if torch_version is None:
        return None
    ours = parse_nccl_version(cupy_code)
    theirs = tuple(int(v) for v in torch_version[:3])
    if ours == theirs:
        return None
    return (
        f"cupy-nccl: CuPy loaded NCCL {format_version(ours)} but torch uses NCCL "
        f"{format_version(theirs)}; this process now runs two NCCL versions (torch's "
        "process groups and this backend may differ in algorithms, bugs and NCCL_* "
        "settings). To use one version, install the NVIDIA NCCL wheel that matches torch's, "
        f'e.g. pip install "nvidia-nccl-cu12=={format_version(theirs)}" (or -cu13).'
    )


def warn_on_nccl_version_mismatch(cupy_code: int, torch_version: Sequence[Any] | None) -> None:
    """`warnings.warn` the text of `nccl_version_mismatch`, if any."""
    text = nccl_version_mismatch(cupy_code, torch_version)
    if text is not None:
        warnings.warn(text, UserWarning, stacklevel=3)


# ---- unique ids ------------------------------------------------------------------------------
# CuPy 14 returns the 128-byte ncclUniqueId as bytes; CuPy 13 as a tuple of C `char` values,
# which are signed on x86 and unsigned on Arm. The store carries raw bytes either way.
_SIGNED_CHAR = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}


def encode_unique_id(uid: bytes | Sequence[int]) -> bytes:
    """The raw bytes of a unique id as `get_unique_id` returned it (bytes or a tuple)."""
    if isinstance(uid, (bytes, bytearray)):
        return bytes(uid)
    return bytes(v & 0xFF for v in uid)


def decode_unique_id(
    data: bytes, *, as_tuple: bool, signed_char: bool = _SIGNED_CHAR
) -> bytes | tuple[int, ...]:
    """Raw id bytes in the form `NcclCommunicator` takes: bytes, or CuPy 13's tuple of chars."""
    if not as_tuple:
        return bytes(data)
    if signed_char:
        return tuple(b - 256 if b > 127 else b for b in data)
    return tuple(data)
