"""The wire protocol: every message round-trips, and a damaged message is refused whole."""

from __future__ import annotations

import struct

import pytest

from tierkv.net.wire import (HEADER_BYTES, Body, Call, Hello, Kind, Nak, PageMeta, Pages, ProtocolError, ReadPages,
                             Reply, Stage, Welcome, WriteAck, WriteStatus, check_payload, decode_body, decode_header,
                             decode_keys, decode_metas, encode_header, encode_keys, encode_metas, page_checksum)

DATA = bytes(range(256)) * 3
META = (PageMeta(3, 7, 500, page_checksum(DATA[:500])), PageMeta(9, 1, 268, page_checksum(DATA[500:])))
BODIES: dict[Kind, Body] = {
    Kind.HELLO: Hello(12345),
    Kind.WELCOME: Welcome(2**63 + 5, 1000, 1 << 20, 16),
    Kind.READ: ReadPages((4, 0, 99)),
    Kind.PAGES: Pages(META, memoryview(DATA)),
    Kind.WRITE_ACK: WriteAck((WriteStatus.STORED, WriteStatus.STALE)),
    Kind.CALL: Call("lookup", b"\x00\x01body"),
    Kind.REPLY: Reply(False, b"why"),
    Kind.NAK: Nak(),
    Kind.STAGE: Stage(2**47 + 4096, 16 << 20),
}


def frame(kind: Kind, body: object) -> tuple[bytes, bytes]:
    payload = b"".join(bytes(p) for p in body.encode())  # type: ignore[attr-defined]
    return encode_header(kind, 3, 2, 77, [payload]), payload


@pytest.mark.parametrize("kind", list(BODIES))
def test_every_message_round_trips(kind: Kind) -> None:
    head, payload = frame(kind, BODIES[kind])
    assert len(head) == HEADER_BYTES
    header, checksum = decode_header(head)
    assert (header.kind, header.channel, header.credits, header.seq, header.length) == (kind, 3, 2, 77, len(payload))
    check_payload(head, checksum, payload)
    got = decode_body(kind, memoryview(payload))
    if isinstance(got, Pages):
        assert got.metas == META and bytes(got.data) == DATA and got.offsets() == [0, 500]
    else:
        assert got == BODIES[kind]


@pytest.mark.parametrize("kind,flip", [(Kind.PAGES, 0), (Kind.PAGES, 5), (Kind.PAGES, HEADER_BYTES + 10),
                                       (Kind.PAGES, HEADER_BYTES + 4 + 2 * 24 - 1), (Kind.CALL, -1),
                                       (Kind.READ, -1)])
def test_a_flipped_byte_is_refused(kind: Kind, flip: int) -> None:
    head, payload = frame(kind, BODIES[kind])
    raw = bytearray(head + payload)
    raw[flip] ^= 0x40
    with pytest.raises(ProtocolError):
        header, checksum = decode_header(bytes(raw[:HEADER_BYTES]))
        check_payload(bytes(raw[:HEADER_BYTES]), checksum, bytes(raw[HEADER_BYTES:]))


def test_a_torn_page_passes_the_frame_and_is_that_pages_miss() -> None:
    # The frame checksum of a page list covers its metas; each page is checked against
    # its own meta, so bytes overwritten mid-send cost one page, not the connection.
    import numpy as np

    from tierkv.net.verify import copy_accepted
    head, payload = frame(Kind.PAGES, BODIES[Kind.PAGES])
    raw = bytearray(payload)
    raw[-1] ^= 0x40                                  # the last byte of the second page
    header, checksum = decode_header(head)
    check_payload(head, checksum, bytes(raw))
    got = decode_body(Kind.PAGES, memoryview(bytes(raw)))
    assert isinstance(got, Pages)
    datas = [got.data[o:o + m.length] for o, m in zip(got.offsets(), got.metas)]
    dst = np.zeros((2, 268), np.uint8)
    res = copy_accepted(got.metas, datas, [3, 9], dst, None)
    assert res.ok == (True, False)


def test_bad_version_length_and_kind() -> None:
    head, _ = frame(Kind.NAK, Nak())
    with pytest.raises(ProtocolError, match="version 9"):
        decode_header(head[:2] + b"\x09" + head[3:])
    with pytest.raises(ProtocolError, match="exceeds"):
        decode_header(head[:16] + struct.pack("<I", 0xFFFFFFFF) + head[20:])
    with pytest.raises(ProtocolError, match="kind"):
        decode_header(head[:3] + b"\xee" + head[4:])
    with pytest.raises(ProtocolError, match="header of 3"):
        decode_header(head[:3])


def test_truncated_bodies_raise_protocol_errors() -> None:
    for kind in (Kind.READ, Kind.PAGES, Kind.WRITE_ACK, Kind.CALL, Kind.WELCOME):
        payload = b"".join(bytes(p) for p in BODIES[kind].encode())  # type: ignore[union-attr]
        with pytest.raises(ProtocolError):
            decode_body(kind, memoryview(payload[:3]))
    bad = Pages(META, memoryview(DATA[:700]))
    with pytest.raises(ProtocolError, match="add up"):
        Pages.decode(memoryview(b"".join(bytes(p) for p in bad.encode()))).offsets()


def test_keys_and_metas_helpers() -> None:
    keys = [b"\x01" * 16, b"", b"abc"]
    assert decode_keys(encode_keys(keys)) == keys
    assert decode_metas(encode_metas(META)) == META
