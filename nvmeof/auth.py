"""DH-HMAC-CHAP secrets and the host authentication settings nvmet understands.

Holds the parser and generator for the ``DHHC-1:<hh>:<base64(key || crc32-le)>:``
representation (NVMe base spec 8.13.5.8, as ``nvme gen-dhchap-key`` writes it and the
kernel's ``nvme_auth_extract_key`` reads it), plus the ``dhchap_hash`` and
``dhchap_dhgroup`` names the kernel's ``hosts/<nqn>/`` configfs files accept. Used by
``nvmeof.validate`` (the model's checks) and ``nvmeof.spec`` (key generation).

Errors never contain the secret: they name what was being parsed (``what``) and
which part of the format is wrong.
"""

from __future__ import annotations

import base64
import binascii
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from nvmeof.errors import ConfigError

PREFIX = "DHHC-1:"
KEY_LENGTHS = (32, 48, 64)


class KeyTransform(Enum):
    """The ``<hh>`` field: how the host transforms the secret before use (0 = none)."""

    NONE = 0
    SHA256 = 1
    SHA384 = 2
    SHA512 = 3

    @property
    def key_lengths(self) -> tuple[int, ...]:
        """Key lengths (bytes) allowed with this transform."""
        return KEY_LENGTHS if self is KeyTransform.NONE else (KEY_LENGTHS[self.value - 1],)


class DhchapHash(Enum):
    """Values of ``hosts/<nqn>/dhchap_hash`` (kernel default ``hmac(sha256)``)."""

    SHA256 = "hmac(sha256)"
    SHA384 = "hmac(sha384)"
    SHA512 = "hmac(sha512)"


class DhGroup(Enum):
    """Values of ``hosts/<nqn>/dhchap_dhgroup`` (kernel default ``null``: no DH exchange)."""

    NULL = "null"
    FFDHE2048 = "ffdhe2048"
    FFDHE3072 = "ffdhe3072"
    FFDHE4096 = "ffdhe4096"
    FFDHE6144 = "ffdhe6144"
    FFDHE8192 = "ffdhe8192"


@dataclass(frozen=True)
class DhchapSecret:
    """A parsed DH-HMAC-CHAP secret. ``key`` is hidden from ``repr``."""

    transform: KeyTransform
    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.key) not in self.transform.key_lengths:
            raise ConfigError("DH-HMAC-CHAP key with transform %02d must be %s bytes long, got %d"
                              % (self.transform.value, "/".join(map(str, self.transform.key_lengths)),
                                 len(self.key)))

    def encode(self) -> str:
        """The ``DHHC-1:<hh>:<base64>:`` text, with the CRC-32 appended little-endian."""
        crc = struct.pack("<I", zlib.crc32(self.key) & 0xFFFFFFFF)
        return "%s%02d:%s:" % (PREFIX, self.transform.value, base64.b64encode(self.key + crc).decode("ascii"))


def parse_secret(text: str, *, what: str = "DH-HMAC-CHAP secret") -> DhchapSecret:
    """Parse and check a ``DHHC-1:<hh>:<base64(key || crc32-le)>:`` secret.

    Checks the prefix, that ``hh`` is 00..03, the base64, the key length (32/48/64
    bytes; exactly 32/48/64 for transforms 01/02/03) and the CRC-32. Raises
    :class:`ConfigError` naming ``what`` and the broken part, never the secret.
    """
    if not isinstance(text, str):
        raise ConfigError("%s: expected a string 'DHHC-1:<hh>:<base64>:', got %s"
                          % (what, type(text).__name__))
    if not text.startswith(PREFIX):
        raise ConfigError("%s: expected the prefix 'DHHC-1:' (secret not shown)" % what)
    parts = text[len(PREFIX):].split(":")
    if len(parts) != 3 or parts[2] != "":
        raise ConfigError("%s: expected 'DHHC-1:<hh>:<base64>:' with a trailing ':' (secret not shown)" % what)
    hh, b64 = parts[0], parts[1]
    if len(hh) != 2 or hh not in ("00", "01", "02", "03"):
        raise ConfigError("%s: expected hash id 00, 01, 02 or 03 after 'DHHC-1:' (secret not shown)" % what)
    try:
        raw = base64.b64decode(b64.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ConfigError("%s: the key part is not valid base64 (secret not shown)" % what) from None
    transform = KeyTransform(int(hh))
    key, crc = raw[:-4], raw[-4:]
    if len(raw) < 4 or len(key) not in transform.key_lengths:
        raise ConfigError("%s: expected a %s-byte key plus 4 CRC bytes for hash id %s, decoded %d bytes"
                          % (what, "/".join(map(str, transform.key_lengths)), hh, len(raw)))
    if struct.unpack("<I", crc)[0] != zlib.crc32(key) & 0xFFFFFFFF:
        raise ConfigError("%s: CRC-32 check failed, the secret is corrupt or mistyped (secret not shown)" % what)
    return DhchapSecret(transform, key)


def generate_secret(transform: KeyTransform = KeyTransform.NONE, key_bytes: int | None = None,
                    *, random_bytes: Callable[[int], bytes] = os.urandom) -> DhchapSecret:
    """A new random secret. ``key_bytes`` defaults to the transform's length (32 for
    ``NONE``); ``random_bytes`` is the entropy source (``os.urandom``; tests pass a
    deterministic one)."""
    n = key_bytes if key_bytes is not None else transform.key_lengths[0]
    return DhchapSecret(transform, random_bytes(n))


def parse_hash(text: str, *, what: str = "dhchap_hash") -> DhchapHash:
    """``'hmac(sha256)'`` etc. to :class:`DhchapHash`; :class:`ConfigError` otherwise."""
    try:
        return DhchapHash(text)
    except ValueError:
        raise ConfigError("%s: expected one of %s, got %r"
                          % (what, ", ".join(h.value for h in DhchapHash), text)) from None


def parse_dhgroup(text: str, *, what: str = "dhchap_dhgroup") -> DhGroup:
    """``'null'``, ``'ffdhe2048'`` etc. to :class:`DhGroup`; :class:`ConfigError` otherwise."""
    try:
        return DhGroup(text)
    except ValueError:
        raise ConfigError("%s: expected one of %s, got %r"
                          % (what, ", ".join(g.value for g in DhGroup), text)) from None
