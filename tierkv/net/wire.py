"""The node-to-node wire protocol: a versioned, checksummed header and frozen message types.

Every message is a 28-byte header followed by ``length`` payload bytes. The header's
``checksum`` is xxh3-64 over the header's first 20 bytes and the payload, so a torn,
truncated or corrupted message is refused whole. Page payloads also carry each page's
own :class:`PageMeta` (slot, generation, length, xxh3-64 of the page): a page whose bytes
do not hash to its meta, or whose generation is not the one expected, is a miss.

Used by both transports: :mod:`tierkv.net.tcp` sends whole messages over a socket;
:mod:`tierkv.net.rdma` sends the control messages (no page data) with SEND/RECV and
moves page data one-sided. Pure functions and frozen dataclasses, thread-safe.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tierkv.errors import InputError, TierKVError

MAGIC = b"TK"
VERSION = 3  # 2: a page list's frame checksum covers its metas; 3: authentication, reads that name keys
MAX_PAYLOAD_BYTES = 1 << 30  # refuse a header announcing more: a garbage or hostile length
_HEAD = struct.Struct("<2sBBHHQI")  # magic, version, kind, channel, credits, seq, length
_SUM = struct.Struct("<Q")
HEADER_BYTES = _HEAD.size + _SUM.size
_META = struct.Struct("<IQIQ")  # slot, generation, length, checksum
_COUNT = struct.Struct("<I")
#: Most pages (slots, metas) one message may name, and most keys one lookup may carry: a
#: receiver refuses more before building anything, so a small frame cannot make it
#: allocate a reply or a list many times its size. Senders split larger batches.
MAX_PAGES_PER_MESSAGE = 1 << 20
MAX_LOOKUP_KEYS = 1 << 20


def pages_per_message(page_bytes: int) -> int:
    """How many pages of ``page_bytes`` one READ reply or WRITE may carry (at least one)."""
    fits = (MAX_PAYLOAD_BYTES - _COUNT.size) // (_META.size + max(page_bytes, 0))
    return max(1, min(MAX_PAGES_PER_MESSAGE, fits))


def _count(b: memoryview, what: str, limit: int) -> int:
    (n,) = _COUNT.unpack_from(b)
    if n > limit:
        raise ProtocolError(f"{what} names {n} entries; a message carries at most {limit}")
    return int(n)


class ProtocolError(TierKVError):
    """A message that does not parse: bad magic, version, length or checksum."""


class Kind(enum.IntEnum):
    HELLO = 1        # client -> server: Hello
    WELCOME = 2      # server -> client: Welcome
    READ = 3         # ReadPages
    PAGES = 4        # Pages (reply to READ)
    WRITE = 5        # WritePages (pages inline over TCP; meta only over RDMA)
    WRITE_ACK = 6    # WriteAck
    CALL = 7         # Call (control RPC)
    REPLY = 8        # Reply
    NAK = 9          # receiver had no posted receive for the message (an RNR NAK): retry it
    STAGE = 10       # Stage (RDMA only: where to push a WRITE's bytes, reply to WRITE)
    CHALLENGE = 11   # server -> client: Challenge (a server with credentials, after HELLO)
    AUTH = 12        # client -> server: Auth (the answer to a CHALLENGE)


class WriteStatus(enum.IntEnum):
    STORED = 0
    DUPLICATE = 1      # same slot and generation already stored: an idempotent resend
    STALE = 2          # an older generation than the one stored: ignored
    BAD_CHECKSUM = 3   # the bytes do not hash to the meta: not stored
    OUT_OF_RANGE = 4
    FAILED = 5         # the transfer failed (peer lost, timeout): not known to be stored


@dataclass(frozen=True)
class Header:
    kind: Kind
    channel: int
    credits: int  # receive credits granted to the other side with this message
    seq: int
    length: int


@dataclass(frozen=True)
class PageMeta:
    """What a slot holds: ``generation`` 0 means nothing (a miss); ``checksum`` is the
    xxh3-64 of its ``length`` stored bytes."""

    slot: int
    generation: int
    length: int
    checksum: int


EMPTY_GENERATION = 0


def page_checksum(data: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


# -- framing ----------------------------------------------------------------------------
# Messages whose payload is a page list: the frame checksum covers the header, the
# count and the metas; each page's bytes are checked against its meta's own checksum by
# the receiver, so a page the owner overwrote mid-send is one miss, not a torn frame
# that costs the whole connection (and the page bytes are hashed once, not twice).
_PAGE_LISTS = frozenset((4, 5))  # Kind.PAGES, Kind.WRITE (Kind is defined below)


def _covered(kind: int, first: bytes | memoryview, length: int) -> int:
    """How many leading payload bytes the frame checksum covers."""
    if kind not in _PAGE_LISTS or len(first) < _COUNT.size:
        return length
    (n,) = _COUNT.unpack_from(first)
    return min(length, _COUNT.size + n * _META.size)


def _digest(head: bytes, parts: Sequence[bytes | memoryview], upto: int) -> int:
    h = xxhash.xxh3_64(head)
    for part in parts:
        if upto <= 0:
            break
        view = memoryview(part).cast("B")
        h.update(view[:upto])
        upto -= len(view)
    return h.intdigest()


def encode_header(kind: Kind, channel: int, credits: int, seq: int, payload: Sequence[bytes | memoryview]) -> bytes:
    length = sum(len(memoryview(p).cast("B")) for p in payload)
    head = _HEAD.pack(MAGIC, VERSION, int(kind), channel, min(credits, 0xFFFF), seq, length)
    first = b""
    for part in payload:  # the payload's first bytes (a page list's count), across parts
        if len(first) >= _COUNT.size:
            break
        first += bytes(memoryview(part).cast("B")[:_COUNT.size - len(first)])
    return head + _SUM.pack(_digest(head, payload, _covered(int(kind), first, length)))


def decode_header(raw: bytes | bytearray | memoryview) -> tuple[Header, int]:
    """The header and its checksum (checked against the payload by :func:`check_payload`)."""
    if len(raw) != HEADER_BYTES:
        raise ProtocolError(f"header of {len(raw)} bytes, expected {HEADER_BYTES}")
    magic, version, kind, channel, credits, seq, length = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, this side speaks {VERSION}")
    if length > MAX_PAYLOAD_BYTES:
        raise ProtocolError(f"payload of {length} bytes exceeds the limit of {MAX_PAYLOAD_BYTES}")
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown message kind {kind}") from None
    return Header(k, channel, credits, seq, length), _SUM.unpack_from(raw, _HEAD.size)[0]


def check_payload(raw_header: bytes | bytearray | memoryview, checksum: int, payload: memoryview | bytes) -> None:
    head = bytes(raw_header[:_HEAD.size])
    kind = head[3]
    got = _digest(head, [payload], _covered(kind, payload, len(payload)))
    if got != checksum:
        raise ProtocolError(f"message checksum {got:#x} does not match the header's {checksum:#x}")


# -- message bodies ---------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The client's opening: its id, and for an authenticating client its principal's
    name and a fresh nonce (:mod:`tierkv.net.auth`)."""

    client_id: int
    principal: str = ""
    nonce: bytes = b""

    def encode(self) -> list[bytes | memoryview]:
        name = self.principal.encode()
        if len(name) > 0xFF:
            raise InputError(f"a principal's name is at most 255 bytes, got {len(name)}")
        return [struct.pack("<QB", self.client_id, len(name)) + name + self.nonce]

    @classmethod
    def decode(cls, b: memoryview) -> Hello:
        _need(b, 9)
        client_id, n = struct.unpack_from("<QB", b)
        _need(b, 9 + n)
        nonce = bytes(b[9 + n:])
        if len(nonce) not in (0, 32):
            raise ProtocolError(f"a hello's nonce is 0 or 32 bytes, got {len(nonce)}")
        return cls(client_id, bytes(b[9:9 + n]).decode(), nonce)


@dataclass(frozen=True)
class Challenge:
    """A server with credentials answers HELLO with its nonce and its proof of the secret."""

    nonce: bytes
    proof: bytes

    def encode(self) -> list[bytes | memoryview]:
        return [self.nonce + self.proof]

    @classmethod
    def decode(cls, b: memoryview) -> Challenge:
        if len(b) != 64:
            raise ProtocolError(f"a challenge is 64 bytes, got {len(b)}")
        return cls(bytes(b[:32]), bytes(b[32:]))


@dataclass(frozen=True)
class Auth:
    """The client's proof of the secret, answering a CHALLENGE."""

    proof: bytes

    def encode(self) -> list[bytes | memoryview]:
        return [self.proof]

    @classmethod
    def decode(cls, b: memoryview) -> Auth:
        if len(b) != 32:
            raise ProtocolError(f"an auth answer is 32 bytes, got {len(b)}")
        return cls(bytes(b))


@dataclass(frozen=True)
class Welcome:
    """The server's side of the handshake: its epoch (changes when the server restarts),
    its slot geometry and the receive credits it grants to this connection."""

    epoch: int
    num_slots: int
    slot_bytes: int
    credits: int

    def encode(self) -> list[bytes | memoryview]:
        return [struct.pack("<QIQI", self.epoch, self.num_slots, self.slot_bytes, self.credits)]

    @classmethod
    def decode(cls, b: memoryview) -> Welcome:
        return cls(*_unpack("<QIQI", b))


@dataclass(frozen=True)
class ReadPages:
    """Pages to read by slot; ``keys`` (one per slot, all of one length) name the page each
    slot must hold. A server that serves a store (``keyed``) answers only reads that name
    keys, and only where the slot holds that key for a tenant the connection may see."""

    slots: tuple[int, ...]
    keys: tuple[bytes, ...] = ()

    def encode(self) -> list[bytes | memoryview]:
        head = _COUNT.pack(len(self.slots)) + struct.pack(f"<{len(self.slots)}I", *self.slots)
        if not self.keys:
            return [head]
        width = len(self.keys[0])
        if len(self.keys) != len(self.slots) or any(len(k) != width for k in self.keys) or not 0 < width <= 0xFFFF:
            raise InputError(f"a read names one key per slot, all of one length (1..65535 bytes): got "
                             f"{len(self.keys)} keys for {len(self.slots)} slots")
        return [head, struct.pack("<H", width) + b"".join(self.keys)]

    @classmethod
    def decode(cls, b: memoryview) -> ReadPages:
        n = _count(b, "a read", MAX_PAGES_PER_MESSAGE)
        end = 4 + 4 * n
        _need(b, end)
        slots = struct.unpack_from(f"<{n}I", b, 4)
        if len(b) == end:
            return cls(slots)
        _need(b, end + 2)
        (width,) = struct.unpack_from("<H", b, end)
        if width == 0 or len(b) != end + 2 + n * width:
            raise ProtocolError(f"a read of {n} slots carries {len(b) - end - 2} bytes of keys of {width} bytes each")
        raw = bytes(b[end + 2:])
        return cls(slots, tuple(raw[i * width:(i + 1) * width] for i in range(n)))


@dataclass(frozen=True)
class Pages:
    """Page metas followed by their bytes back to back (``data`` may be empty when the
    bytes moved one-sided). Reply to READ, and the body of WRITE."""

    metas: tuple[PageMeta, ...]
    data: memoryview

    def encode(self) -> list[bytes | memoryview]:
        head = bytearray(_COUNT.pack(len(self.metas)))
        for m in self.metas:
            head += _META.pack(m.slot, m.generation, m.length, m.checksum)
        return [bytes(head), self.data] if len(self.data) else [bytes(head)]

    @classmethod
    def decode(cls, b: memoryview) -> Pages:
        n = _count(b, "a page list", MAX_PAGES_PER_MESSAGE)
        end = 4 + n * _META.size
        _need(b, end)
        metas = tuple(PageMeta(*_META.unpack_from(b, 4 + i * _META.size)) for i in range(n))
        return cls(metas, b[end:])

    def offsets(self) -> list[int]:
        """Where each page's bytes start in ``data``; raises ProtocolError when they do not add up."""
        out, at = [], 0
        for m in self.metas:
            out.append(at)
            at += m.length
        if len(self.data) and at != len(self.data):
            raise ProtocolError(f"page lengths add up to {at} bytes, the message carries {len(self.data)}")
        return out


@dataclass(frozen=True)
class WriteAck:
    statuses: tuple[WriteStatus, ...]

    def encode(self) -> list[bytes | memoryview]:
        return [_COUNT.pack(len(self.statuses)) + bytes(int(s) for s in self.statuses)]

    @classmethod
    def decode(cls, b: memoryview) -> WriteAck:
        n = _count(b, "a write ack", MAX_PAGES_PER_MESSAGE)
        _need(b, 4 + n)
        return cls(tuple(WriteStatus(x) for x in bytes(b[4:4 + n])))


@dataclass(frozen=True)
class Call:
    """A control RPC: a method name and an opaque body (the server's handler parses it)."""

    method: str
    body: bytes

    def encode(self) -> list[bytes | memoryview]:
        name = self.method.encode()
        if len(name) > 0xFFFF:
            raise InputError(f"an RPC method name is at most 65535 bytes, got {len(name)}")
        return [struct.pack("<H", len(name)) + name, self.body]

    @classmethod
    def decode(cls, b: memoryview) -> Call:
        (n,) = _unpack("<H", b[:2])
        _need(b, 2 + n)
        return cls(bytes(b[2:2 + n]).decode(), bytes(b[2 + n:]))


@dataclass(frozen=True)
class Reply:
    ok: bool
    body: bytes

    def encode(self) -> list[bytes | memoryview]:
        return [bytes([1 if self.ok else 0]), self.body]

    @classmethod
    def decode(cls, b: memoryview) -> Reply:
        _need(b, 1)
        return cls(b[0] == 1, bytes(b[1:]))


@dataclass(frozen=True)
class Stage:
    """RDMA only, the server's first reply to a WRITE: the staging buffer it granted for
    that WRITE's bytes (``addr`` in the server's staging MR, ``length`` bytes). ``length``
    0: no staging free now, send the WRITE again later."""

    addr: int
    length: int

    def encode(self) -> list[bytes | memoryview]:
        return [struct.pack("<QQ", self.addr, self.length)]

    @classmethod
    def decode(cls, b: memoryview) -> Stage:
        return cls(*_unpack("<QQ", b))


@dataclass(frozen=True)
class Nak:
    def encode(self) -> list[bytes | memoryview]:
        return []

    @classmethod
    def decode(cls, b: memoryview) -> Nak:
        return cls()


Body = Hello | Challenge | Auth | Welcome | ReadPages | Pages | WriteAck | Call | Reply | Nak | Stage
BODY_OF: dict[Kind, type[Body]] = {
    Kind.HELLO: Hello, Kind.WELCOME: Welcome, Kind.READ: ReadPages, Kind.PAGES: Pages,
    Kind.WRITE: Pages, Kind.WRITE_ACK: WriteAck, Kind.CALL: Call, Kind.REPLY: Reply, Kind.NAK: Nak,
    Kind.STAGE: Stage, Kind.CHALLENGE: Challenge, Kind.AUTH: Auth,
}


def decode_body(kind: Kind, payload: memoryview) -> Body:
    try:
        return BODY_OF[kind].decode(payload)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed {kind.name} body of {len(payload)} bytes: {e}") from None


# -- key lists for the lookup RPC -------------------------------------------------------
def encode_keys(keys: Sequence[bytes]) -> bytes:
    out = bytearray(_COUNT.pack(len(keys)))
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) > 0xFFFF:
            raise InputError(f"a lookup key must be bytes of at most 65535, got {type(k).__name__} "
                             f"of {len(k) if hasattr(k, '__len__') else '?'}")
        out += struct.pack("<H", len(k)) + k
    return bytes(out)


def decode_keys(b: bytes) -> list[bytes]:
    """The keys of a lookup body; ProtocolError unless the body is exactly a key list."""
    if len(b) < _COUNT.size:
        raise ProtocolError(f"a key list of {len(b)} bytes has no count")
    n = _count(memoryview(b), "a key list", MAX_LOOKUP_KEYS)
    keys, at = [], _COUNT.size
    for i in range(n):
        if at + 2 > len(b):
            raise ProtocolError(f"a key list of {len(b)} bytes ends before key {i} of {n}")
        (ln,) = struct.unpack_from("<H", b, at)
        if at + 2 + ln > len(b):
            raise ProtocolError(f"key {i} of {ln} bytes runs past the {len(b)}-byte key list")
        keys.append(b[at + 2:at + 2 + ln])
        at += 2 + ln
    if at != len(b):
        raise ProtocolError(f"{len(b) - at} bytes after the {n} keys of a key list")
    return keys


def encode_metas(metas: Sequence[PageMeta]) -> bytes:
    return bytes(Pages(tuple(metas), memoryview(b"")).encode()[0])


def decode_metas(b: bytes) -> tuple[PageMeta, ...]:
    """The metas of a lookup reply; ProtocolError if it is not exactly a meta list."""
    try:
        return Pages.decode(memoryview(b)).metas
    except (struct.error, ValueError) as e:
        raise ProtocolError(f"malformed meta list of {len(b)} bytes: {e}") from None


def _need(b: memoryview, n: int) -> None:
    if len(b) < n:
        raise ProtocolError(f"body of {len(b)} bytes, needs at least {n}")


def _unpack(fmt: str, b: memoryview | bytes) -> tuple[int, ...]:
    size = struct.calcsize(fmt)
    if len(b) != size:
        raise ProtocolError(f"body of {len(b)} bytes, expected {size}")
    return struct.unpack(fmt, b)
