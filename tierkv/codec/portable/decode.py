"""The portable codec's decoder: reads what ``codec_enc.c`` (or :mod:`.encode`) writes.

Runs the same checks as ``codec_dec.c`` (header against the layout, lengths,
checksum, every stream consumed exactly, every rANS state back at its start) and
returns the same status codes. rANS decoding is a Python loop; the row assembly is
numpy. Used by :mod:`tierkv.codec.portable`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tierkv.codec.format import (CODEC_ID, FORMAT_VERSION, HEADER_BYTES, LANES, LEVEL_BITS, MAGIC, NSECTIONS,
                                 PAYLOAD_FIXED,
                                 RANS_L, SIDE_ALPHA, SIDE_CENTER, STATE_TOP, TAIL_BITS_PER_LANE, DecodeStatus, Mode,
                                 payload_checksum, peek_header, tail_bits)
from tierkv.codec.portable.common import (BitReader, Geometry, Params, bits_for, contexts, ctx_flip, ctx_main,
                                    ctx_side, levels_to_freqs, to_bits, unpack_fixed)
from tierkv.errors import CorruptPageError

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class _Corrupt(Exception):
    def __init__(self, status: DecodeStatus) -> None:
        super().__init__(status.name)
        self.status = status


class _Tables:
    """Per context: the symbol of each slot, and each symbol's frequency and start."""

    def __init__(self, g: Geometry, pr: Params, data: bytes) -> None:
        r = BitReader(data)
        self.ctxs = contexts(g, pr)
        self.sym: list[np.ndarray | None] = [None] * len(self.ctxs)
        self.freq: list[list[int]] = [[] for _ in self.ctxs]
        self.start: list[list[int]] = [[] for _ in self.ctxs]
        for i, c in enumerate(self.ctxs):
            if not c.used:
                continue
            levels = [0] * c.alpha
            if r.get(1):
                nb = bits_for(c.alpha)
                first, span = r.get(nb), r.get(nb)
                if first + span >= c.alpha:
                    raise _Corrupt(DecodeStatus.STRUCTURE)
                for k in range(first, first + span + 1):
                    levels[k] = r.get(LEVEL_BITS)
                freq = levels_to_freqs(levels, c.pbits)
                if freq is None:
                    raise _Corrupt(DecodeStatus.STRUCTURE)
            else:   # a context without symbols: every slot is symbol 0
                freq = [1 << c.pbits] + [0] * (c.alpha - 1)
            self.freq[i] = freq
            self.start[i] = [sum(freq[:k]) for k in range(c.alpha)]
            self.sym[i] = np.repeat(np.arange(c.alpha), freq)
        if r.underflow or r.unread_bits >= 8:
            raise _Corrupt(DecodeStatus.STRUCTURE)


class _Rans:
    """The interleaved rANS states and the shared word stream."""

    def __init__(self, data: bytes, tables: _Tables) -> None:
        if len(data) < 4 * LANES:
            raise _Corrupt(DecodeStatus.STREAM)
        self.data, self.t = data, tables
        self.x = [int.from_bytes(data[4 * j:4 * j + 4], "little") for j in range(LANES)]
        if any(v < RANS_L for v in self.x):
            raise _Corrupt(DecodeStatus.STREAM)
        self.pos = 4 * LANES

    def get(self, lane: int, ctx: int) -> int:
        t, pbits = self.t, self.t.ctxs[ctx].pbits
        v = self.x[lane]
        slot = v & ((1 << pbits) - 1)
        sym = int(t.sym[ctx][slot])  # type: ignore[index]
        v = t.freq[ctx][sym] * (v >> pbits) + slot - t.start[ctx][sym]
        if v < RANS_L:
            if self.pos + 2 > len(self.data):
                raise _Corrupt(DecodeStatus.STREAM)
            v = (v << 16) | int.from_bytes(self.data[self.pos:self.pos + 2], "little")
            self.pos += 2
        self.x[lane] = v
        return sym

    def channel_syms(self, chans: int, ctx: int) -> np.ndarray:
        return np.array([self.get(c % LANES, ctx) for c in range(chans)], dtype=np.int64)

    def tail(self, n: int) -> np.ndarray:
        """The n mid tail bits the final states carry (each is STATE_TOP + 31 bits)."""
        bits: list[int] = []
        for j, v in enumerate(self.x):
            if v < STATE_TOP:
                raise _Corrupt(DecodeStatus.STREAM)
            take = max(0, min(TAIL_BITS_PER_LANE, n - j * TAIL_BITS_PER_LANE))
            payload = v - STATE_TOP
            if payload >> take:
                raise _Corrupt(DecodeStatus.STREAM)
            bits.extend((payload >> i) & 1 for i in range(take))
        return np.array(bits, dtype=np.uint8)

    def finished(self) -> bool:
        return self.pos == len(self.data)


def _sections(g: Geometry, o: bytes) -> tuple[Params, list[bytes], bytes]:
    if len(o) < PAYLOAD_FIXED:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    hi, tz, lo, flags = o[0], o[1], o[2], o[3]
    if hi > g.mbits or (g.rmax << hi) + 1 > 256 or lo > 8 or tz + lo > g.mbits - hi:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    if flags & ~(3 if g.nkc == 2 else 1):
        raise _Corrupt(DecodeStatus.STRUCTURE)
    pr = Params(hi=hi, tz=tz, lo=lo, mid=g.mbits - hi - tz - lo, sign_coded=[flags & 1, (flags >> 1) & 1])
    lens = [int.from_bytes(o[4 + 4 * i:8 + 4 * i], "little") for i in range(NSECTIONS)]
    if PAYLOAD_FIXED + sum(lens) + g.planes != len(o):
        raise _Corrupt(DecodeStatus.STRUCTURE)
    q = PAYLOAD_FIXED + lens[0]
    bases = o[q:q + g.planes]
    parts, at = [o[PAYLOAD_FIXED:q]], q + g.planes
    for n in lens[1:]:
        parts.append(o[at:at + n])
        at += n
    return pr, parts, bases


class _Varints:
    """Reads LEB128 varints and bytes; running past the end is corrupt structure."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def varint(self) -> int:
        out, shift = 0, 0
        while True:
            if self.pos >= len(self.data) or shift >= 64:
                raise _Corrupt(DecodeStatus.STRUCTURE)
            b = self.data[self.pos]
            self.pos += 1
            if shift == 63 and b & 0x7F > 1:   # past 64 bits, as the C decoder refuses them
                raise _Corrupt(DecodeStatus.STRUCTURE)
            out |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return out

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Corrupt(DecodeStatus.STRUCTURE)
        self.pos += 1
        return self.data[self.pos - 1]

    def done(self) -> bool:
        return self.pos == len(self.data)


def lo_exception_list(pr: Params, data: bytes, total: int) -> tuple[np.ndarray, np.ndarray]:
    """The low-bit exceptions as (coded element, lo bits), checked; a count beyond two bytes
    an exception is refused before anything is allocated for it."""
    r = _Varints(data)
    n, k = r.varint(), -1
    if n and not pr.lo:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    if n > len(data) // 2:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    at, bits = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint32)
    for i in range(n):
        k += 1 + r.varint()
        v = r.byte()
        if k >= total or v == 0 or v >> pr.lo:
            raise _Corrupt(DecodeStatus.STREAM)
        at[i], bits[i] = k, v
    if not r.done():
        raise _Corrupt(DecodeStatus.STREAM)
    return at, bits


def _lo_exceptions(pr: Params, data: bytes, total: int) -> np.ndarray:
    """The lo bits of every coded element (zero but for the listed exceptions)."""
    at, bits = lo_exception_list(pr, data, total)
    lo = np.zeros(total, dtype=np.int64)
    lo[at] = bits
    return lo


def _dups(g: Geometry, data: bytes) -> tuple[np.ndarray, np.ndarray]:
    dup = np.zeros(g.planes * g.tokens, dtype=bool)
    src = np.zeros(g.planes * g.tokens, dtype=np.int64)
    r = _Varints(data)
    varint = r.varint
    n, gi = varint(), -1
    if n > dup.size:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    for _ in range(n):
        gi += 1 + varint()
        back = varint()
        t = gi % g.tokens if gi < dup.size else 0
        if gi >= dup.size or back >= t:
            raise _Corrupt(DecodeStatus.STRUCTURE)
        dup[gi], src[gi] = True, t - back - 1
    if not r.done():
        raise _Corrupt(DecodeStatus.STRUCTURE)
    return dup.reshape(g.planes, g.tokens), src.reshape(g.planes, g.tokens)


def _plane_syms(g: Geometry, pr: Params, rans: _Rans, esc: BitReader, p: int, base: int,
                n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Channel maxima, first flips and main symbols of plane p's n coded rows."""
    kc, C = g.kc(p), g.chans
    side = rans.channel_syms(C, ctx_side(kc))
    cmax = np.array([esc.get(g.ebits) if s == SIDE_ALPHA - 1 else base + s - SIDE_CENTER for s in side.tolist()])
    if ((cmax < 0) | (cmax >= 1 << g.ebits)).any():
        raise _Corrupt(DecodeStatus.STREAM)
    fpos = np.full(C, n, dtype=np.int64)
    if pr.sign_coded[kc]:
        fs = rans.channel_syms(C, ctx_flip(kc))
        if g.flip_esc >= 0:
            fs = np.array([esc.get(bits_for(g.tokens)) if s == g.flip_esc else s for s in fs.tolist()])
        if (fs >= n).any():
            raise _Corrupt(DecodeStatus.STREAM)
        fpos = fs + 1
    sym = np.zeros((n, C), dtype=np.int64)
    for k in range(n):
        for c0 in range(0, C, LANES):
            for j in range(min(LANES, C - c0)):
                sym[k, c0 + j] = rans.get(j, ctx_main(kc))
    return cmax, fpos, sym


def _plane_signs(n: int, C: int, coded: int, fpos: np.ndarray, bits: np.ndarray, ks: int) -> tuple[np.ndarray, int]:
    """Signs [n, C] from the raw sign bits (channel by channel) and the first flips."""
    k = np.arange(n)[:, None]
    raw = (k == 0) | (k > fpos[None, :]) if coded else np.ones((n, C), dtype=bool)
    count = int(raw.sum())
    if ks + count > bits.size:
        raise _Corrupt(DecodeStatus.STREAM)
    signs = np.zeros((C, n), dtype=np.int64)
    signs[raw.T] = bits[ks:ks + count]
    signs = signs.T
    if coded:
        s0 = signs[0][None, :]
        implied = np.where(k < fpos[None, :], s0, s0 ^ 1)
        signs = np.where(raw, signs, implied)
    return signs, ks + count


class Opened(NamedTuple):
    """A coded payload's parts once its structure checks out (``dec_open`` in C)."""

    pr: Params
    parts: list[bytes]
    bases: bytes
    tables: _Tables
    dup: np.ndarray
    src: np.ndarray
    nrows: np.ndarray
    mid_bits: int     # coded elements x mid width
    tail: int         # of them, carried by the final rANS states


def open_payload(g: Geometry, payload: bytes) -> Opened:
    """Checks a coded payload's parameters, section lengths, tables, bases, repeated rows
    and mid section (its length and zero padding), as the decoders need them."""
    pr, parts, bases = _sections(g, payload)
    tables = _Tables(g, pr, parts[0])
    if any(b >> g.ebits for b in bases):
        raise _Corrupt(DecodeStatus.STRUCTURE)
    dup, src = _dups(g, parts[1])
    nrows = (~dup).sum(axis=1)
    total = int(nrows.sum()) * g.chans * pr.mid
    n_tail = tail_bits(int(nrows[-1]) * g.chans * pr.mid)
    if len(parts[5]) != (total - n_tail + 7) // 8:
        raise _Corrupt(DecodeStatus.STRUCTURE)
    if (total - n_tail) & 7 and parts[5][(total - n_tail) >> 3] >> ((total - n_tail) & 7):
        raise _Corrupt(DecodeStatus.STRUCTURE)   # padding is zero
    return Opened(pr, parts, bases, tables, dup, src, nrows, total, n_tail)


def _decode_coded(g: Geometry, payload: bytes, out: np.ndarray) -> None:
    pr, parts, bases, tables, dup, src, nrows, total, n_tail = open_payload(g, payload)
    mid_bits = to_bits(parts[5])[:total - n_tail]
    lo_all = _lo_exceptions(pr, parts[6], int(nrows.sum()) * g.chans)
    rans, esc = _Rans(parts[2], tables), BitReader(parts[3])
    sign_bits = np.unpackbits(np.frombuffer(parts[4], dtype=np.uint8), bitorder="little").astype(np.int64)
    u = np.zeros((g.planes, g.tokens, g.chans), dtype=np.int64)
    ks = kmid = 0
    for p in range(g.planes):
        n = int(nrows[p])
        cmax, fpos, sym = _plane_syms(g, pr, rans, esc, p, bases[p], n)
        lov = lo_all[kmid:kmid + n * g.chans].reshape(n, g.chans)
        if p == g.planes - 1:
            mid_bits = np.concatenate([mid_bits, rans.tail(n_tail)])
        signs, ks = _plane_signs(n, g.chans, pr.sign_coded[g.kc(p)], fpos, sign_bits, ks)
        mids = unpack_fixed(mid_bits, n * g.chans, pr.mid, kmid * pr.mid).astype(np.int64).reshape(n, g.chans)
        kmid += n * g.chans
        is_esc = sym == pr.esc(g)
        r = sym >> pr.hi
        if ((r > cmax[None, :]) & ~is_esc).any():
            raise _Corrupt(DecodeStatus.STREAM)
        e = (cmax[None, :] - r) & ((1 << g.ebits) - 1)
        hv = sym & ((1 << pr.hi) - 1)
        for k, c in zip(*np.nonzero(is_esc)):
            e[k, c], hv[k, c] = esc.get(g.ebits), esc.get(pr.hi)
        hshift = g.mbits - pr.hi
        v = (signs << (g.nbits - 1)) | (e << g.mbits) | (hv << hshift) | (mids << (pr.tz + pr.lo)) | (lov << pr.tz)
        rows = np.flatnonzero(~dup[p])
        u[p, rows] = v
        for t in np.flatnonzero(dup[p]):
            u[p, t] = u[p, src[p, t]]
    if (esc.underflow or esc.unread_bits >= 8 or not rans.finished()
            or not 0 <= 8 * len(parts[4]) - ks < 8):
        raise _Corrupt(DecodeStatus.STREAM)
    out[:] = u.astype(_UINT[g.itemsize]).view(np.uint8).reshape(-1)


def check_blob(g: Geometry, blob: memoryview) -> tuple[DecodeStatus, Mode, bytes]:
    """The header and checksum checks (``check_blob`` in C): the status, the mode and the payload."""
    try:
        head = peek_header(blob)
    except CorruptPageError:
        if len(blob) < HEADER_BYTES:
            return DecodeStatus.SHORT, Mode.RAW, b""
        return (DecodeStatus.VERSION if bytes(blob[:3]) == MAGIC + bytes([CODEC_ID]) and blob[3] != FORMAT_VERSION
                else DecodeStatus.MAGIC), Mode.RAW, b""
    if (head.dtype, head.kind, head.num_layers, head.tokens_per_page, head.num_kv_heads, head.head_dim) != (
            g.dtype, g.kind, g.layers, g.tokens, g.heads, g.head_dim):
        return DecodeStatus.LAYOUT, head.mode, b""
    if head.payload_bytes > len(blob) - HEADER_BYTES:
        return DecodeStatus.SHORT, head.mode, b""
    payload = bytes(blob[HEADER_BYTES:HEADER_BYTES + head.payload_bytes])
    if payload_checksum(blob[:32], payload) != head.checksum:
        return DecodeStatus.CHECKSUM, head.mode, b""
    if blob[7] != 0 or bytes(blob[28:32]) != bytes(4):
        return DecodeStatus.STRUCTURE, head.mode, b""
    if head.mode is Mode.RAW and len(payload) != g.page_bytes:
        return DecodeStatus.STRUCTURE, head.mode, b""
    return DecodeStatus.OK, head.mode, payload


def decode_page(g: Geometry, blob: memoryview, out: np.ndarray) -> DecodeStatus:
    """Decodes ``blob`` into ``out`` (``uint8 [page_bytes]``); the status says how it went."""
    status, mode, payload = check_blob(g, blob)
    if status is not DecodeStatus.OK:
        return status
    if mode is Mode.RAW:
        out[:] = np.frombuffer(payload, dtype=np.uint8)
        return DecodeStatus.OK
    try:
        _decode_coded(g, payload, out)
    except _Corrupt as exc:
        return exc.status
    return DecodeStatus.OK
