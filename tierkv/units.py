"""Parsing of human-readable byte sizes (``"64GiB"``, ``"512 MB"``, ``4096``).

Used by the config loader and the CLI.
"""

from __future__ import annotations

import re
from fractions import Fraction

from tierkv.errors import ConfigError

#: The largest size any setting takes: 1 EiB. Past it a number is a typo, not a capacity,
#: and would overflow the 64-bit offsets and counts it ends up in.
MAX_SIZE_BYTES = 1 << 60

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
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_MAX_DIGITS = 40  # a longer number is either far past MAX_SIZE_BYTES or an absurd fraction


def parse_size(value: int | str, what: str = "size") -> int:
    """Return ``value`` in bytes; ``what`` names the setting in error messages.

    Integers are bytes. Strings take decimal (kB, MB, GB, TB) or binary (KiB, MiB,
    GiB, TiB) suffixes, case-insensitive, and are converted exactly (no float rounding).
    Negative, fractional or non-numeric byte counts, and sizes above
    :data:`MAX_SIZE_BYTES` (1 EiB), raise :class:`ConfigError`.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a byte count or a string like '64GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{what}: expected a non-negative byte count, got {value}")
        return _at_most_max(value, value, what)
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a byte count or a string like '64GiB', got {value!r}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{what}: cannot parse {value!r}; expected e.g. 4096, '512MiB', '64GiB', '2TB'")
    digits = match.group(1).lstrip("0")
    if len(digits) > _MAX_DIGITS:
        raise ConfigError(f"{what}: {_short(value)} is too long a number ({len(digits)} digits); sizes are at most "
                          f"{MAX_SIZE_BYTES} bytes (1 EiB = 1048576TiB)")
    number = Fraction(match.group(1)) * _UNITS[match.group(2).lower()]
    if number.denominator != 1:
        raise ConfigError(f"{what}: {value!r} is not a whole number of bytes")
    return _at_most_max(int(number), value, what)


def _at_most_max(nbytes: int, given: int | str, what: str) -> int:
    if nbytes > MAX_SIZE_BYTES:
        if isinstance(given, str):
            asked = f"{_short(given)} is {nbytes} bytes"
        else:  # str() of a huge int is slow, or refused past 4300 digits
            asked = f"{nbytes} bytes" if nbytes.bit_length() <= 256 else f"a {nbytes.bit_length()}-bit byte count"
        raise ConfigError(f"{what}: {asked}, more than the largest size tierkv takes, "
                          f"{MAX_SIZE_BYTES} bytes (1 EiB = 1048576TiB)")
    return nbytes


def _short(text: str) -> str:
    """``text`` quoted for a message, cut in the middle when very long."""
    return repr(text) if len(text) <= 48 else f"'{text[:20]}...{text[-20:]}' ({len(text)} characters)"


def format_size(nbytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")
