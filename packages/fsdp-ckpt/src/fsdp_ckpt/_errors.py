"""Errors and warnings of fsdp-ckpt.

Every problem with a checkpoint is a `CheckpointError` (a `ValueError`), so callers can catch one
type; the subclasses say which kind: a file that is missing, truncated or altered
(`CheckpointCorruptError`, naming the file) or a model that does not fit the checkpoint
(`CheckpointMismatchError`, listing every key and shape by FQN).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

__all__ = [
    "add_note",
    "naming",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointMismatchWarning",
    "LoadReport",
    "ShapeMismatch",
]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``. Python 3.10 has no ``add_note``: the note is kept in
    ``__notes__`` all the same (where the messages sent to other ranks read it), though 3.10's
    tracebacks do not print it."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])  # noqa: B010


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    """Unpickle an error whose ``__init__`` takes other arguments than its ``args``: a rank's
    error reaches `fsdp_comm.launch`'s caller pickled (it used to arrive as a bare
    `CommError` quoting it, because unpickling called ``__init__(message)``)."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)  # path, report and notes
    return exc


@contextmanager
def naming(path: str) -> Iterator[None]:
    """An OSError while writing ``path`` names it: a full disk's ENOSPC from ``write`` or
    ``fsync`` carries no file name, and the other ranks only see the message."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None and exc.errno is not None and exc.strerror is not None:
            exc.filename = path  # str(exc) now reads "[Errno 28] No space left ...: 'path'"
        elif exc.filename is None:
            add_note(exc, f"while writing {path}")
        raise


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, found, trusted or loaded into this model."""


class CheckpointCorruptError(CheckpointError):
    """A file of the checkpoint is missing, truncated, altered or malformed.

    ``path`` names the file (as the storage sees it).
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


@dataclass(frozen=True)
class ShapeMismatch:
    """A tensor whose saved global shape differs from the model's."""

    fqn: str
    saved: tuple[int, ...]
    expected: tuple[int, ...]


@dataclass(frozen=True)
class LoadReport:
    """What a load found that does not match: keys by FQN, shapes by FQN.

    ``missing``: in the model (or optimizer) but not in the checkpoint; ``unexpected``: in the
    checkpoint but not in the model; ``shape_mismatches``: in both with different global shapes.
    Optimizer entries read ``optimizer state of <fqn>``. ``optimizer_class``: (the class the
    checkpoint's optimizer state belongs to, the given optimizer's class), qualified names,
    when they differ.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    shape_mismatches: tuple[ShapeMismatch, ...] = ()
    optimizer_class: tuple[str, str] | None = None

    @property
    def clean(self) -> bool:
        """True when everything matched."""
        return not (
            self.missing or self.unexpected or self.shape_mismatches or self.optimizer_class
        )

    def describe(self) -> str:
        """One line per problem, sorted, for error messages and logs."""
        lines = []
        if self.optimizer_class is not None:
            saved, given = self.optimizer_class
            lines.append(
                f"optimizer class: the checkpoint holds the state of {saved}, the "
                f"optimizer given is {given}"
            )
        lines += [f"missing from the checkpoint: {k}" for k in self.missing]
        lines += [f"unexpected in the checkpoint (not in the model): {k}" for k in self.unexpected]
        lines += [
            f"shape mismatch for {m.fqn}: checkpoint {list(m.saved)}, model {list(m.expected)}"
            for m in self.shape_mismatches
        ]
        return "\n".join(lines)


class CheckpointMismatchError(CheckpointError):
    """Strict load: the checkpoint does not fit the model. ``report`` lists every problem.

    Raised before anything in the model or optimizer is changed.
    """

    def __init__(self, report: LoadReport, *, path: str) -> None:
        super().__init__(
            f"checkpoint {path} does not fit the model (strict=True; nothing was "
            f"loaded):\n{report.describe()}"
        )
        self.report = report
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)


class CheckpointMismatchWarning(UserWarning):
    """Non-strict load skipped what did not match; ``report`` lists it by FQN."""

    def __init__(self, report: LoadReport, *, path: str) -> None:
        super().__init__(f"checkpoint {path}: loaded what matched, skipped:\n{report.describe()}")
        self.report = report
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, self.__dict__)
