"""The one help layout of every command of this project (``fsdp train``, ``fsdp comm-bench``,
``fsdp ckpt``, ``fsdp compare`` and the ``python -m ...bench`` modules).

Each option's help ends with its default, ``(default: 8)``, unless it has none (``None`` or a
flag's ``False``) or its help already says what the default is. A description with line breaks
(a module docstring with example commands) keeps its layout; a one-paragraph description is
wrapped to the terminal.
"""

from __future__ import annotations

import argparse

__all__ = ["CliHelpFormatter", "format_default"]


def format_default(value: object) -> str:
    """How a default reads in help: ``a,b`` for a sequence, ``true`` for ``True``."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return ",".join(format_default(v) for v in value)
    return str(value)


def _shows_default(action: argparse.Action, text: str) -> bool:
    default = action.default
    if not action.option_strings or default is None or default is False:
        return False
    if default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
        return False
    return "default" not in text.lower()


class CliHelpFormatter(argparse.HelpFormatter):
    """argparse's help with each option's default; pass it as ``formatter_class``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not _shows_default(action, text):
            return text
        shown = format_default(action.default).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"(default: {shown})"

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text.strip():
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))
