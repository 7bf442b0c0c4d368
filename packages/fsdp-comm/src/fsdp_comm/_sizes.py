"""The one reader of byte sizes that every command-line flag of this project uses.

The rule, everywhere: a number (decimals allowed) with an optional unit K, M, G or T, each a
power of 1024, written with or without ``i`` and ``B`` (``64M``, ``64MB``, ``64MiB`` are the same
67108864 bytes, as GPU makers and ``ls -h`` use them); ``B`` alone or no unit means the flag's
default unit, which is bytes unless the flag says otherwise (``fsdp plan --gpu-memory 80`` is
80 GiB). Zero is allowed only where a flag asks for it.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

__all__ = ["parse_size", "size_arg", "SIZE_UNITS"]

#: Unit letter -> bytes.
SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}

_SIZE = re.compile(
    r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:([kmgt])i?b?|(b))?\s*$", re.IGNORECASE
)


def parse_size(
    text: str | int | float,
    *,
    argument: str = "size",
    default_unit: str = "b",
    allow_zero: bool = False,
) -> int:
    """Bytes from ``"64M"``, ``"1.5GiB"``, ``"4096"``, ``80`` (see the module's rule).

    Raises `ValueError` naming ``argument``, the rule and the text received."""
    if isinstance(text, bool):
        raise ValueError(f"{argument}: not a size: {text!r} (examples: 4096, 64K, 16M, 80G)")
    if isinstance(text, (int, float)):
        value = float(text) * SIZE_UNITS[default_unit.lower()]
    else:
        match = _SIZE.match(text)
        if not match:
            raise ValueError(
                f"{argument}: not a size: {text!r} (a number with an optional unit "
                "K, M, G or T, powers of 1024: 4096, 64K, 16M, 1.5G)"
            )
        unit = (match.group(2) or match.group(3) or default_unit).lower()
        value = float(match.group(1)) * SIZE_UNITS[unit]
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{argument}: a size must be finite and {bound}, got {text!r}")
    return int(value)


def size_arg(
    argument: str, *, default_unit: str = "b", allow_zero: bool = False
) -> Callable[[str], int]:
    """An argparse ``type=`` for a size flag: a bad size is a usage error, not a traceback."""

    def parse(text: str) -> int:
        try:
            return parse_size(
                text, argument=argument, default_unit=default_unit, allow_zero=allow_zero
            )
        except ValueError as exc:  # argparse prefixes the flag's name itself
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{argument}: ")) from None

    parse.__name__ = "size"  # argparse's "invalid size value" wording
    return parse
