"""Size classes and argument checks."""

from __future__ import annotations

import pytest
import torch
from fsdp_memory import MemoryManager, bucket_nbytes


@pytest.mark.parametrize(
    "nbytes", [1, 7, 511, 512, 513, 4096, 8193, 10**6, 3 * 2**20 + 1, 2**31 + 5]
)
def test_bucket_covers_the_request_with_little_padding(nbytes: int) -> None:
    size = bucket_nbytes(nbytes)
    assert size >= nbytes
    assert size % 512 == 0
    if nbytes > 8192:
        assert size < nbytes * 1.0625


def test_nearly_equal_sizes_share_a_bucket_and_equal_sizes_always_do() -> None:
    assert bucket_nbytes(4_000_000) == bucket_nbytes(4_000_100)
    assert bucket_nbytes(2**20) != bucket_nbytes(2 * 2**20)
    assert bucket_nbytes(1000) == bucket_nbytes(1000)


@pytest.mark.parametrize("numel", [0, -1, -(2**40)])
def test_non_positive_numel_is_a_value_error_naming_argument_rule_and_value(numel: int) -> None:
    mm = MemoryManager("cpu")
    with pytest.raises(ValueError, match=rf"numel must be a positive integer \(> 0\), got {numel}"):
        mm.allocate(numel, torch.float32)


@pytest.mark.parametrize("numel", [1.5, "8", None, True])
def test_non_int_numel_is_a_type_error(numel: object) -> None:
    with pytest.raises(TypeError, match="numel must be an int"):
        MemoryManager("cpu").allocate(numel, torch.float32)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", float, None, 3])
def test_unknown_dtype_is_a_type_error(dtype: object) -> None:
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        MemoryManager("cpu").allocate(4, dtype)  # type: ignore[arg-type]


def test_quantized_dtype_is_refused_with_a_type_error() -> None:
    with pytest.raises(TypeError, match="not supported"):
        MemoryManager("cpu").allocate(4, torch.qint8)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int8,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex128,
        torch.float8_e4m3fn,
    ],
)
def test_every_usual_dtype_allocates_a_flat_buffer(dtype: torch.dtype) -> None:
    mm = MemoryManager("cpu")
    buf = mm.allocate(1000, dtype)
    assert buf.shape == (1000,) and buf.dtype == dtype and buf.is_contiguous()
    mm.free(buf)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"max_inflight_all_gathers": 0},
            ValueError,
            "max_inflight_all_gathers must be None or an int >= 1, got 0",
        ),
        (
            {"max_inflight_bytes": -5},
            ValueError,
            "max_inflight_bytes must be None or an int >= 1, got -5",
        ),
        ({"pooling": "yes"}, TypeError, "pooling must be True or False"),
        ({"max_cached_bytes": -1}, ValueError, "max_cached_bytes must be None or an int >= 0"),
        ({"timeout": 0}, ValueError, "timeout must be a number of seconds greater than 0"),
    ],
)
def test_bad_manager_settings_name_the_setting(kwargs: dict, error: type, pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        MemoryManager("cpu", **kwargs)


def test_bad_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="'cpu' or a CUDA device"):
        MemoryManager("meta")
    with pytest.raises(TypeError, match="device must be"):
        MemoryManager(1.0)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MemoryManager("cuda")
