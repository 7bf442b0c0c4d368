"""Settings read from the environment: ``FSDP_COMM_TIMEOUT`` and ``FSDP_COMM_DEBUG``."""

from __future__ import annotations

import os

__all__ = ["default_timeout", "debug_enabled", "resolve_timeout"]

_DEFAULT_TIMEOUT_S = 300.0


def default_timeout() -> float:
    """Seconds any blocking wait may take: ``FSDP_COMM_TIMEOUT``, else 300."""
    raw = os.environ.get("FSDP_COMM_TIMEOUT")
    if raw is None or raw.strip() == "":
        return _DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(
            f"FSDP_COMM_TIMEOUT must be a number of seconds greater than 0, got {raw!r}"
        ) from None
    if not value > 0:
        raise ValueError(f"FSDP_COMM_TIMEOUT must be greater than 0 seconds, got {raw!r}")
    return value


def resolve_timeout(timeout: float | None) -> float:
    """Return ``timeout`` if given (validated), else the environment default."""
    if timeout is None:
        return default_timeout()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds greater than 0, got {timeout!r}")
    return float(timeout)


def debug_enabled() -> bool:
    """True when ``FSDP_COMM_DEBUG`` is set to 1/true/yes: cross-rank checks before collectives."""
    return os.environ.get("FSDP_COMM_DEBUG", "").strip().lower() in {"1", "true", "yes", "on"}
