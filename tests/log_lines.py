"""A logging handler that keeps the messages it sees, for tests that read a logger's lines
(pytest's caplog misses loggers that other tests configured not to propagate)."""

from __future__ import annotations

import logging


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
