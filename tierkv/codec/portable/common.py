"""Shared pieces of the portable codec: page geometry, per-page parameters, the quantised
frequency tables, and LSB-first bit packing.

Mirrors ``codec_core.h`` and ``codec_common.c`` exactly where the format depends on
it (geometry, contexts, levels to frequencies, bit order); the encoder-side choices
(levels from counts) may differ from C in the last rounding without harm, since the
decoder reconstructs frequencies from the levels the page carries. Used by
:mod:`tierkv.codec.portable.encode` and :mod:`tierkv.codec.portable.decode`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tierkv.codec.format import (DTYPE_CODE, FIELDS, FLIP_ALPHA_MAX, KIND_CODE, LEVEL_BITS, PROB_BITS, RMAX,
                                 SIDE_ALPHA, SMALL_PROB_BITS)
from tierkv.errors import InputError
from tierkv.layout import DType, LayoutKind

_CODE_DTYPE = {v: k for k, v in DTYPE_CODE.items()}
_CODE_KIND = {v: k for k, v in KIND_CODE.items()}

NCTX = 6
LEVEL_BASE = (16, 19, 23, 27)
MAX_LEVEL = (1 << LEVEL_BITS) - 1


def ctx_side(kc: int) -> int:
    return kc


def ctx_flip(kc: int) -> int:
    return 2 + kc


def ctx_main(kc: int) -> int:
    return 4 + kc


@dataclass(frozen=True)
class Geometry:
    """A page as ``planes x tokens x chans`` elements of ``nbits`` bits (``Layout`` in C)."""

    dtype: DType
    kind: LayoutKind
    layers: int
    tokens: int
    heads: int
    head_dim: int
    nbits: int
    ebits: int
    mbits: int
    planes: int
    chans: int
    nkc: int
    rmax: int
    flip_alpha: int
    flip_esc: int  # -1: first-flip positions never escape

    @property
    def itemsize(self) -> int:
        return self.nbits // 8

    @property
    def page_bytes(self) -> int:
        return self.planes * self.tokens * self.chans * self.itemsize

    def kc(self, plane: int) -> int:
        return plane & 1 if self.nkc == 2 else 0


def geometry_of(dtype_code: int, kind_code: int, layers: int, tokens: int, heads: int, head_dim: int) -> Geometry:
    """The geometry from the six integers the backends take (see ``format.geometry``)."""
    if dtype_code not in _CODE_DTYPE or kind_code not in _CODE_KIND or min(layers, tokens, heads, head_dim) <= 0:
        raise InputError(f"unsupported codec layout ({dtype_code}, {kind_code}, {layers}, {tokens}, {heads}, "
                         f"{head_dim})")
    dtype, kind = _CODE_DTYPE[dtype_code], _CODE_KIND[kind_code]
    nbits, ebits, mbits = FIELDS[dtype]
    if kind is LayoutKind.KV:
        planes, chans, nkc = 2 * layers, heads * head_dim, 2
    elif heads == 1:
        planes, chans, nkc = layers, head_dim, 1
    else:
        raise InputError(f"a latent layout has one head, got {heads}")
    rmax = RMAX
    flip_alpha = min(tokens, FLIP_ALPHA_MAX)
    flip_esc = FLIP_ALPHA_MAX - 1 if tokens > FLIP_ALPHA_MAX else -1
    return Geometry(dtype, kind, layers, tokens, heads, head_dim, nbits, ebits, mbits, planes, chans, nkc,
                    rmax, flip_alpha, flip_esc)


@dataclass
class Params:
    """A page's coding parameters: mantissa = hi | mid | lo | tz bits (tz bits zero
    everywhere, lo bits zero but for the listed exceptions)."""

    hi: int
    tz: int = 0
    lo: int = 0
    mid: int = 0
    sign_coded: list[int] = field(default_factory=lambda: [0, 0])

    def main_alpha(self, g: Geometry) -> int:
        return (g.rmax << self.hi) + 1

    def esc(self, g: Geometry) -> int:
        return self.main_alpha(g) - 1


@dataclass
class Context:
    used: bool
    alpha: int
    pbits: int


def contexts(g: Geometry, pr: Params) -> list[Context]:
    """The contexts a page carries tables for, in table order (``model_contexts`` in C)."""
    ctxs = [Context(False, 0, PROB_BITS) for _ in range(NCTX)]
    for kc in range(g.nkc):
        ctxs[ctx_side(kc)] = Context(True, SIDE_ALPHA, SMALL_PROB_BITS)
        ctxs[ctx_flip(kc)] = Context(bool(pr.sign_coded[kc]), g.flip_alpha,
                                     SMALL_PROB_BITS if g.flip_alpha <= 128 else PROB_BITS)
        ctxs[ctx_main(kc)] = Context(True, pr.main_alpha(g), PROB_BITS)
    return ctxs


def bits_for(alpha: int) -> int:
    nb = 0
    while (1 << nb) < alpha:
        nb += 1
    return nb


def level_weight(level: int) -> int:
    return LEVEL_BASE[(level - 1) & 3] << ((level - 1) >> 2)


def levels_to_freqs(levels: list[int], pbits: int) -> list[int] | None:
    """Frequencies summing to ``2**pbits`` (integer arithmetic, as in C); None if empty."""
    scale = 1 << pbits
    total = sum(level_weight(v) for v in levels if v)
    if total == 0:
        return None
    freq = [max(1, level_weight(v) * scale // total) if v else 0 for v in levels]
    s = sum(freq)
    while s != scale:
        top = max(range(len(freq)), key=lambda i: (freq[i], -i))
        if s < scale:
            freq[top] += scale - s
            s = scale
        else:
            cut = min(s - scale, freq[top] - 1)
            if cut == 0:
                return None
            freq[top] -= cut
            s -= cut
    return freq


def counts_to_levels(counts: np.ndarray, pbits: int) -> list[int]:
    n = int(counts.sum())
    out = []
    for c in counts.tolist():
        if c == 0:
            out.append(0)
            continue
        ideal = c * (1 << pbits) / n
        level = 1 if ideal <= 1.0 else 1 + int(math.floor(4.0 * math.log2(ideal) + 0.5))
        out.append(min(max(level, 1), MAX_LEVEL))
    return out


class BitWriter:
    """LSB-first bit packing into a growing bytearray."""

    def __init__(self) -> None:
        self.out = bytearray()
        self._acc = 0
        self._n = 0

    def put(self, value: int, nbits: int) -> None:
        if nbits == 0:
            return
        self._acc |= (value & ((1 << nbits) - 1)) << self._n
        self._n += nbits
        while self._n >= 8:
            self.out.append(self._acc & 0xFF)
            self._acc >>= 8
            self._n -= 8

    def flush(self) -> bytes:
        if self._n:
            self.out.append(self._acc & 0xFF)
        self._acc = self._n = 0
        return bytes(self.out)


class BitReader:
    """LSB-first reads; ``underflow`` is set on reading past the end (which yields 0)."""

    def __init__(self, data: bytes | memoryview) -> None:
        self._data = bytes(data)
        self._pos = 0  # in bits
        self.underflow = False

    def get(self, nbits: int) -> int:
        if nbits == 0:
            return 0
        end = self._pos + nbits
        if end > 8 * len(self._data):
            self.underflow = True
            return 0
        lo, hi = self._pos >> 3, (end + 7) >> 3
        v = int.from_bytes(self._data[lo:hi], "little") >> (self._pos & 7)
        self._pos = end
        return v & ((1 << nbits) - 1)

    @property
    def unread_bits(self) -> int:
        return 8 * len(self._data) - self._pos


def fixed_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Values of ``width`` bits each as one LSB-first bit array (the fixed-width streams)."""
    if width == 0 or values.size == 0:
        return np.zeros(0, dtype=np.uint8)
    return ((values.astype(np.uint64)[:, None] >> np.arange(width, dtype=np.uint64)) & 1).astype(np.uint8).ravel()


def pack_bits(bits: np.ndarray) -> bytes:
    return np.packbits(bits, bitorder="little").tobytes() if bits.size else b""


def to_bits(data: bytes | memoryview) -> np.ndarray:
    """The bits of ``data``, LSB-first, one per uint8."""
    return np.unpackbits(np.frombuffer(bytes(data), dtype=np.uint8), bitorder="little")


def unpack_fixed(bits: np.ndarray, count: int, width: int, offset_bits: int = 0) -> np.ndarray:
    """``count`` values of ``width`` bits from bit ``offset_bits`` of a bit array."""
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint64)
    chunk = bits[offset_bits:offset_bits + count * width].reshape(count, width).astype(np.uint64)
    return (chunk << np.arange(width, dtype=np.uint64)).sum(axis=1)
