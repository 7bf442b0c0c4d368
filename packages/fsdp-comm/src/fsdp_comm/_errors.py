"""Errors raised by fsdp-comm. Every error names the collective and the ranks involved."""

from __future__ import annotations

__all__ = ["AgreementError", "CommError", "CommTimeoutError", "BackendUnavailableError"]


class CommError(RuntimeError):
    """A collective failed: a peer died, sizes disagreed across ranks, or the backend broke."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective (or a whole `launch`) did not complete within its deadline."""


class BackendUnavailableError(CommError):
    """A backend cannot run here; the message says what to install or why."""


class AgreementError(CommError):
    """Ranks were started (or set up) differently: the message names each fact that differs
    and which ranks say what (`fsdp_comm.agree`)."""
