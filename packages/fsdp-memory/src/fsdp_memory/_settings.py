"""Settings read from the environment: ``FSDP_MEMORY_TIMEOUT`` and ``FSDP_MEMORY_DEBUG``."""

from __future__ import annotations

import os

__all__ = ["default_timeout", "resolve_timeout", "debug_from_env"]

_DEFAULT_TIMEOUT_S = 300.0


def default_timeout() -> float:
    """Seconds any blocking wait may take: ``FSDP_MEMORY_TIMEOUT``, else 300."""
    raw = os.environ.get("FSDP_MEMORY_TIMEOUT")
    if raw is None or raw.strip() == "":
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"FSDP_MEMORY_TIMEOUT must be a number of seconds greater than 0, got {raw!r}"
        ) from None
    if not value > 0:
        raise ValueError(f"FSDP_MEMORY_TIMEOUT must be greater than 0 seconds, got {raw!r}")
    return value


def resolve_timeout(timeout: float | None) -> float:
    """Return ``timeout`` if given (validated), else the environment default."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds greater than 0, got {timeout!r}")
    return float(timeout)


def debug_from_env() -> bool:
    """True when ``FSDP_MEMORY_DEBUG`` is 1/true/yes/on: poison freed buffers."""
    return os.environ.get("FSDP_MEMORY_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}
