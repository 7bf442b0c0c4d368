"""The ``cupy-nccl`` backend (being written)."""

from __future__ import annotations

from typing import Any

from ._errors import BackendUnavailableError

__all__ = ["CupyNcclBackend"]


class CupyNcclBackend:
    name = "cupy-nccl"

    @classmethod
    def from_options(cls, **options: Any) -> Any:
        raise BackendUnavailableError("cupy-nccl: not written yet")
