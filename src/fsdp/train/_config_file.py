"""``--config FILE`` and ``--print-config``: a command's options from a TOML file, and back.

Keys are the command's long option names without the leading dashes, written with ``-`` or
``_`` (``global-batch = 16`` or ``global_batch = 16``); values are what the option takes on the
command line (``host-mmap-threshold = "1M"`` or ``1048576``, ``no-progress = true`` for a
flag). The file's values replace the defaults and options given on the command line win, so
every value passes the same checks as when typed. ``--print-config`` writes the options in
effect in this form, a start for a file.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NoReturn

__all__ = ["add_config_options", "parse_args_with_config", "read_config", "config_toml"]

#: Options that a config file cannot set.
_NOT_IN_FILES = frozenset({"help", "config", "print_config"})


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and ``--print-config`` to ``parser``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="read options from this TOML file: keys are the long options "
        "without the leading dashes (global-batch = 16); options on the "
        "command line win",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the options in effect as TOML (a file for --config) and exit without running",
    )


def parse_args_with_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the values of ``--config FILE`` as the defaults."""
    args = parser.parse_args(argv)
    if args.config is None:
        return args
    parser.set_defaults(**read_config(parser, args.config))
    return parser.parse_args(argv)


def read_config(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The values of the TOML file at ``path`` by option ``dest``, each converted and checked
    as the option would be on the command line; ``parser.error`` (exit 2) on a bad one."""
    options = _options(parser)
    values = {}
    for key, value in _load(parser, path).items():
        action = options.get(key.replace("-", "_"))
        if action is None:
            _unknown_key(parser, path, key, options)
        values[action.dest] = _convert(parser, path, key, value, action)
    return values


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Options a file may set, by long name with ``_`` for ``-``."""
    return {
        name.replace("-", "_"): action
        for action in parser._actions
        if action.dest not in _NOT_IN_FILES and (name := _long_name(action)) is not None
    }


def _long_name(action: argparse.Action) -> str | None:
    longs = [o[2:] for o in action.option_strings if o.startswith("--")]
    return longs[0] if longs else None


def _toml() -> ModuleType | None:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:  # Python 3.10: the tomli package, if installed
        import tomli
    except ModuleNotFoundError:
        return None
    module: ModuleType = tomli
    return module


def _load(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    toml = _toml()
    if toml is None:
        parser.error(
            "--config needs Python 3.11 or newer (tomllib) or the tomli package (pip install tomli)"
        )
    try:
        with open(path, "rb") as f:
            data: dict[str, Any] = toml.load(f)  # tomllib's (or tomli's) load
            return data
    except OSError as exc:
        parser.error(f"--config: cannot read {path}: {exc.strerror or exc}")
    except toml.TOMLDecodeError as exc:
        parser.error(f"--config {path}: not valid TOML: {exc}")


def _unknown_key(
    parser: argparse.ArgumentParser, path: str, key: str, options: dict[str, argparse.Action]
) -> NoReturn:
    names = [name.replace("_", "-") for name in options]
    close = difflib.get_close_matches(key.replace("_", "-"), names, n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    parser.error(
        f"--config {path}: unknown key {key!r}{hint} (keys are the long options of "
        f"{parser.prog} without the leading dashes; see {parser.prog} --help)"
    )


def _convert(
    parser: argparse.ArgumentParser, path: str, key: str, value: Any, action: argparse.Action
) -> Any:
    """``value`` as the option would hold it had it been typed on the command line."""

    def bad(rule: str) -> NoReturn:
        parser.error(f"--config {path}: {key} = {_shown(value)}: {rule}")

    if action.nargs == 0:  # a flag such as --json: true or false
        if not isinstance(value, bool):
            bad(f"--{_long_name(action)} is a flag: write true or false")
        return action.const if value else action.default
    if not isinstance(value, (str, int, float)) or (
        isinstance(value, bool) and action.type in (None, int, float)
    ):
        bad(f"--{_long_name(action)} takes {_takes(action)}, not a TOML {_toml_type(value)}")
    converted = _typed(action, str(value).lower() if isinstance(value, bool) else str(value), bad)
    if action.choices is not None and converted not in action.choices:
        bad(f"--{_long_name(action)} must be one of {', '.join(map(str, action.choices))}")
    return converted


def _typed(action: argparse.Action, text: str, bad: Callable[[str], NoReturn]) -> Any:
    if action.type is None:
        return text
    try:
        return action.type(text)  # type: ignore[operator]
    except argparse.ArgumentTypeError as exc:
        bad(f"--{_long_name(action)}: {exc}")
    except (TypeError, ValueError):
        bad(f"--{_long_name(action)} takes {_takes(action)}")


def _takes(action: argparse.Action) -> str:
    names = {int: "an integer", float: "a number", None: "a string"}
    return names.get(action.type, "a string or a number")  # type: ignore[arg-type]


def _toml_type(value: object) -> str:
    kinds = {bool: "boolean", list: "array", dict: "table"}
    return kinds.get(type(value), type(value).__name__)


def _shown(value: object) -> str:
    try:
        return _toml_value(value)
    except TypeError:
        return repr(value)


def config_toml(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The options in ``args`` as a TOML file that ``--config`` reads back (unset ones left
    out)."""
    lines = [f"# {parser.prog} options (read back with --config FILE)"]
    for action in parser._actions:
        name = _long_name(action)
        value = getattr(args, action.dest, None)
        if name is not None and action.dest not in _NOT_IN_FILES and value is not None:
            lines.append(f"{name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    """A TOML literal for a string, integer, float or boolean."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # 0.003, 1e-05, inf, nan: TOML's forms too
    if isinstance(value, str):  # JSON's escapes are TOML's, DEL aside
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"a config value must be a string, number or boolean, got {value!r}")
