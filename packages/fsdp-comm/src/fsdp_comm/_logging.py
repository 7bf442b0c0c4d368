"""Where every package's log records go: `configure_logging` and ``FSDP_LOG_LEVEL``.

Each package logs to its own logger: ``fsdp.comm``, ``fsdp.memory``, ``fsdp.engine``,
``fsdp.ckpt`` and ``fsdp`` (the umbrella and ``fsdp train``), all children of ``fsdp``. The
packages never add handlers themselves; this module is the one place that does, and only when
asked: `configure_logging` (``fsdp train`` calls it), or ``FSDP_LOG_LEVEL`` set when
``fsdp_comm`` is first imported. Without either, Python's defaults apply (warnings and errors
reach stderr, nothing else).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import warnings

__all__ = [
    "configure_logging",
    "configure_from_environment",
    "child_environment",
    "rank_of_record",
    "LOGGER_NAMES",
    "ENV_VAR",
]

#: The logger of each package (``logging.getLogger(name)``), the umbrella's last.
LOGGER_NAMES = ("fsdp.comm", "fsdp.memory", "fsdp.engine", "fsdp.ckpt", "fsdp")
ENV_VAR = "FSDP_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_FORMAT = "[rank %(rank)s] %(asctime)s %(name)s %(levelname)s: %(message)s"
# A rank thread of the threads backend ("fsdp-rank3") and the threads our packages start for a
# rank ("fsdp-comm-threads-rank3", "fsdp-ckpt-save-rank3") end with the rank they serve.
_RANK_THREAD = re.compile(r"^fsdp.*-rank(\d+)$")
_lock = threading.Lock()


def rank_of_record(thread_name: str | None = None) -> str:
    """The rank a record comes from, as text: a rank thread's own rank (threads backend), else
    ``RANK`` (torchrun, `launch`'s processes), else ``SLURM_PROCID``, else ``-``."""
    match = _RANK_THREAD.match(thread_name or threading.current_thread().name)
    if match:
        return match.group(1)
    for name in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return "-"


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` (a fixed rank, or the one `rank_of_record` finds)."""

    def __init__(self, rank: int | None) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = str(self.rank) if self.rank is not None else rank_of_record(record.threadName)
        return True


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at the time of each record (so a later redirect,
    such as pytest's capture, is followed)."""

    _fsdp_handler = True

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass  # always the current sys.stderr


def _parse_level(value: int | str, where: str) -> int:
    """A level name (any case) or number from 0 to 50, as a number; ValueError naming
    ``where`` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        number: int | None = value
    elif isinstance(value, str):
        text = value.strip()
        number = (
            int(text)
            if text.isdigit()
            else (logging.getLevelName(text.upper()) if text.upper() in _LEVELS else None)
        )
    else:
        raise TypeError(f"{where} must be a level name or number, got {type(value).__name__}")
    if number is None or not 0 <= number <= 50:
        raise ValueError(
            f"{where} must be one of {', '.join(_LEVELS)} (any case) or a number "
            f"from 0 to 50, got {value!r}"
        )
    return number


def _our_handler(logger: logging.Logger) -> logging.Handler | None:
    return next((h for h in logger.handlers if getattr(h, "_fsdp_handler", False)), None)


def configure_logging(level: int | str | None = None, *, rank: int | None = None) -> int:
    """Send the records of every ``fsdp.*`` logger to stderr, one line each::

        [rank 1] 12:00:01 fsdp.ckpt INFO: saved /ckpt (v000003): 1.2 MiB on this rank in 0.04 s

    ``level``: a name (``"INFO"``, any case) or number; default ``FSDP_LOG_LEVEL``, else
    WARNING. ``rank``: the rank to show; default per record: the rank thread's own rank under
    the threads backend, else ``RANK`` or ``SLURM_PROCID``, else ``-``. Calling it again
    changes the level and rank, never adds a second handler. Records stop at the ``fsdp``
    logger (they do not also reach the root logger's handlers). Returns the level set.
    Raises `ValueError` naming ``FSDP_LOG_LEVEL`` (or ``level``) for an unknown level.
    """
    if level is None:
        raw = os.environ.get(ENV_VAR, "").strip()
        number = _parse_level(raw, ENV_VAR) if raw else logging.WARNING
    else:
        number = _parse_level(level, "level")
    logger = logging.getLogger("fsdp")
    with _lock:
        handler = _our_handler(logger)
        if handler is None:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
            logger.addHandler(handler)
        handler.filters = [_RankFilter(rank)]
        logger.setLevel(number)
        logger.propagate = False  # one line per record, even when the root has handlers too
    return number


def child_environment() -> dict[str, str]:
    """``FSDP_LOG_LEVEL`` for rank processes, so they log at the level this process was
    configured with (empty when `configure_logging` was not called)."""
    logger = logging.getLogger("fsdp")
    if _our_handler(logger) is None:
        return {}
    return {ENV_VAR: str(logger.level)}


def configure_from_environment() -> None:
    """At import and in each rank process: configure only when ``FSDP_LOG_LEVEL`` is set. A
    bad value warns here (an import must not fail over a log level); `configure_logging`
    called explicitly (as ``fsdp train`` does) raises."""
    if not os.environ.get(ENV_VAR, "").strip():
        return
    try:
        configure_logging()
    except ValueError as exc:
        warnings.warn(f"{exc}; fsdp logging left unconfigured", UserWarning, stacklevel=2)
