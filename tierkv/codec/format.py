"""Constants and the page header of the lossless KV codec's format (v1).

The format itself is described in ``tierkv/codec/FORMAT.md``; the C extension
(``_codec.c`` and friends) and the portable one (:mod:`tierkv.codec.portable`) both
follow it, and both take their constants from here or mirror them. :func:`peek_header`
reads a blob's header (dtype, layout, mode, payload length, checksum) without decoding
it; the blob is ``HEADER_BYTES + payload_bytes`` long. Pure functions, thread-safe.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from tierkv.errors import CorruptPageError, InputError
from tierkv.layout import DType, KVLayout, LayoutKind

MAGIC = b"TK"
CODEC_ID = 1
FORMAT_VERSION = 1
HEADER_BYTES = 40
PAYLOAD_FIXED = 32  # hi, tz, lo, flags, seven u32 section lengths
NSECTIONS = 7  # tables, repeated rows, rANS, escapes, raw signs, mid bits, lo exceptions

# Coding constants (codec_core.h has the same).
LANES = 64
STATE_TOP = 1 << 31  # initial encoder states: STATE_TOP + 31 bits of the mid stream's tail
TAIL_BITS_PER_LANE = 31
PROB_BITS = 11
SMALL_PROB_BITS = 8
RANS_L = 1 << 16
LEVEL_BITS = 6
SIDE_CENTER = 15
SIDE_ALPHA = 32
RMAX = 15
FLIP_ALPHA_MAX = 256
MAX_LO = 8

# Header layout: magic, codec, version, dtype, mode, kind, reserved byte,
# layers, tokens, heads, head_dim, payload length, reserved word, then the checksum.
_HEADER = struct.Struct("<2sBBBBBBIIIIII")
_CHECKSUM = struct.Struct("<Q")


class Mode(enum.Enum):
    """How a page's payload holds it."""

    RAW = 0  # the page's bytes as they are (incompressible input)
    CODED = 1


DTYPE_CODE = {DType.BF16: 1, DType.FP16: 2, DType.FP32: 3, DType.FP8_E4M3: 4, DType.FP8_E5M2: 5}
_CODE_DTYPE = {v: k for k, v in DTYPE_CODE.items()}
KIND_CODE = {LayoutKind.KV: 0, LayoutKind.LATENT: 1}
_CODE_KIND = {v: k for k, v in KIND_CODE.items()}

# Field widths per dtype: (element bits, exponent bits, mantissa bits).
FIELDS = {DType.BF16: (16, 8, 7), DType.FP16: (16, 5, 10), DType.FP32: (32, 8, 23),
          DType.FP8_E4M3: (8, 4, 3), DType.FP8_E5M2: (8, 5, 2)}


class DecodeStatus(enum.IntEnum):
    """Why a blob did not decode (the C decoder's return codes)."""

    OK = 0
    SHORT = 1
    MAGIC = 2
    VERSION = 3
    LAYOUT = 4
    CHECKSUM = 5
    STRUCTURE = 6
    STREAM = 7
    NO_MEMORY = 8


ERROR_TEXT = {
    DecodeStatus.SHORT: "the blob is shorter than its header says",
    DecodeStatus.MAGIC: "not a tierkv codec page (bad magic or codec id)",
    DecodeStatus.VERSION: "unsupported codec format version",
    DecodeStatus.LAYOUT: "the page header's dtype or layout differs from the codec's",
    DecodeStatus.CHECKSUM: "checksum mismatch",
    DecodeStatus.STRUCTURE: "inconsistent section lengths or tables",
    DecodeStatus.STREAM: "the coded streams do not decode to a whole page",
    DecodeStatus.NO_MEMORY: "out of memory for decoder scratch",
}


@dataclass(frozen=True)
class PageHeader:
    """A blob's header as read by :func:`peek_header`."""

    dtype: DType
    kind: LayoutKind
    num_layers: int
    tokens_per_page: int
    num_kv_heads: int
    head_dim: int
    mode: Mode
    payload_bytes: int
    checksum: int


def max_encoded_bytes(page_bytes: int) -> int:
    """Upper bound of a blob's length for a page of ``page_bytes``: incompressible
    pages are stored raw behind the header, so nothing grows by more than that."""
    if page_bytes <= 0:
        raise InputError(f"page_bytes must be positive, got {page_bytes}")
    return page_bytes + HEADER_BYTES


def geometry(layout: KVLayout) -> tuple[int, int, int, int, int, int]:
    """The layout as the C extension's six integer arguments."""
    return (DTYPE_CODE[layout.dtype], KIND_CODE[layout.kind], layout.num_layers,
            layout.tokens_per_page, layout.num_kv_heads, layout.head_dim)


def pack_header(dtype: DType, kind: LayoutKind, dims: tuple[int, int, int, int], mode: Mode,
                payload: bytes | memoryview) -> bytes:
    """The 40-byte header for ``payload`` (the portable encoder's; the C one writes its own);
    ``dims`` is (layers, tokens per page, kv heads, head_dim)."""
    head = _HEADER.pack(MAGIC, CODEC_ID, FORMAT_VERSION, DTYPE_CODE[dtype], mode.value, KIND_CODE[kind], 0,
                        *dims, len(payload), 0)
    return head + _CHECKSUM.pack(payload_checksum(head, payload))


def payload_checksum(head32: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3-64 of the payload, seeded with xxh3-64 of the header's first 32 bytes."""
    seed = xxhash.xxh3_64_intdigest(bytes(head32[:32]))
    return xxhash.xxh3_64_intdigest(payload, seed=seed)


def peek_header(blob: bytes | bytearray | memoryview) -> PageHeader:
    """Parses a blob's header; raises CorruptPageError if it is not one of ours.

    Does not verify the checksum (decoding does); trailing bytes after the blob are
    allowed, as when a tier returns whole blocks.
    """
    try:
        view = memoryview(blob).cast("B")
    except TypeError:
        raise InputError(f"peek_header takes a blob's bytes (bytes, bytearray, memoryview or a uint8 "
                         f"array), got {type(blob).__name__}") from None
    if len(view) < HEADER_BYTES:
        raise CorruptPageError(f"a codec page has a {HEADER_BYTES}-byte header, got {len(view)} bytes")
    (magic, codec, version, dtype, mode, kind, _, layers, tokens, heads, head_dim, plen,
     _) = _HEADER.unpack_from(view)
    if magic != MAGIC or codec != CODEC_ID:
        raise CorruptPageError(ERROR_TEXT[DecodeStatus.MAGIC])
    if version != FORMAT_VERSION:
        raise CorruptPageError(f"codec format version {version}, this build reads {FORMAT_VERSION}")
    if dtype not in _CODE_DTYPE or kind not in _CODE_KIND or mode not in (0, 1):
        raise CorruptPageError(f"unknown dtype code {dtype}, layout kind {kind} or mode {mode}")
    (checksum,) = _CHECKSUM.unpack_from(view, 32)
    return PageHeader(_CODE_DTYPE[dtype], _CODE_KIND[kind], layers, tokens, heads, head_dim, Mode(mode),
                      plen, checksum)


def tail_bits(last_plane_mid_bits: int) -> int:
    """How many mid bits travel in the rANS states (``tail_bits`` in codec_core.h)."""
    return min(last_plane_mid_bits, TAIL_BITS_PER_LANE * LANES)
