"""DH-HMAC-CHAP secrets: parse, generate, CRC and length checks; errors never echo the secret."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from nvmeof.auth import (DhchapHash, DhchapSecret, DhGroup, KeyTransform, generate_secret, parse_dhgroup,
                         parse_hash, parse_secret)
from nvmeof.errors import ConfigError


def encode(hh: str, key: bytes, crc: int | None = None) -> str:
    c = zlib.crc32(key) if crc is None else crc
    return "DHHC-1:%s:%s:" % (hh, base64.b64encode(key + struct.pack("<I", c)).decode())


def test_known_vector_matches_nvme_cli_layout() -> None:
    key = bytes(range(32))
    text = encode("00", key)
    s = parse_secret(text)
    assert s == DhchapSecret(KeyTransform.NONE, key)
    assert s.encode() == text
    assert len(text) == len("DHHC-1:00:") + 48 + 1


@pytest.mark.parametrize("transform, n", [(KeyTransform.NONE, 32), (KeyTransform.SHA256, 32),
                                          (KeyTransform.SHA384, 48), (KeyTransform.SHA512, 64)])
def test_generate_round_trips(transform: KeyTransform, n: int) -> None:
    s = generate_secret(transform)
    assert len(s.key) == n
    assert parse_secret(s.encode()) == s
    assert s.encode().startswith("DHHC-1:%02d:" % transform.value)


@pytest.mark.parametrize("n", [32, 48, 64])
def test_transform_00_takes_any_allowed_length(n: int) -> None:
    assert len(parse_secret(encode("00", b"k" * n)).key) == n


def test_generate_uses_the_given_entropy_source() -> None:
    s = generate_secret(random_bytes=lambda n: b"\x01" * n)
    assert s.key == b"\x01" * 32


@pytest.mark.parametrize("text, message", [
    (encode("00", b"s" * 32, crc=1), "CRC-32 check failed"),
    (encode("01", b"s" * 48), "32-byte key"),
    (encode("03", b"s" * 32), "64-byte key"),
    (encode("00", b"s" * 40), "32/48/64-byte key"),
    (encode("04", b"s" * 32), "hash id 00, 01, 02 or 03"),
    ("DHHC-2:00:abcd:", "prefix 'DHHC-1:'"),
    (encode("00", b"s" * 32)[:-1], "trailing ':'"),
    ("DHHC-1:00:!!!!:", "not valid base64"),
    ("DHHC-1:00::", "decoded 0 bytes"),
])
def test_bad_secrets_fail_without_echoing_them(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        parse_secret(text, what="host h dhchap_key")
    assert "host h dhchap_key" in str(e.value)
    b64 = text.split(":")[2] if text.count(":") >= 2 else text
    assert not b64 or b64 not in str(e.value)


def test_secret_is_hidden_from_repr_and_length_checked() -> None:
    s = generate_secret()
    assert s.key.hex() not in repr(s) and repr(s.key) not in repr(s)
    with pytest.raises(ConfigError, match="must be 48"):
        DhchapSecret(KeyTransform.SHA384, b"x" * 32)


def test_hash_and_dhgroup_names_are_the_kernels() -> None:
    assert parse_hash("hmac(sha512)") is DhchapHash.SHA512
    assert parse_dhgroup("ffdhe8192") is DhGroup.FFDHE8192
    assert parse_dhgroup("null") is DhGroup.NULL
    with pytest.raises(ConfigError, match="hmac\\(sha256\\)"):
        parse_hash("sha256")
    with pytest.raises(ConfigError, match="ffdhe2048"):
        parse_dhgroup("modp2048")
