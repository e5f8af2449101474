"""Parsing of human-readable byte sizes (``"64GiB"``, ``"512 MB"``, ``4096``).

Used by the config loader and the CLI.
"""

from __future__ import annotations

import re

from tierkv.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, what: str = "size") -> int:
    """Return ``value`` in bytes; ``what`` names the setting in error messages.

    Integers are bytes. Strings take decimal (kB, MB, GB, TB) or binary (KiB, MiB,
    GiB, TiB) suffixes, case-insensitive. Negative or fractional byte counts raise
    :class:`ConfigError`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte count or a string like '64GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: expected a non-negative byte count, got {value}")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a byte count or a string like '64GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot parse {value!r}; expected e.g. 4096, '512MiB', '64GiB', '2TB'")
    number = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if number != int(number):
        raise ConfigError(f"{what}: {value!r} is not a whole number of bytes")
    return int(number)


def format_size(nbytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
