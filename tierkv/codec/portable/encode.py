"""The portable codec's encoder: the same format as ``codec_enc.c``, in numpy and Python.

The analysis and the raw streams are numpy; the rANS coding is a Python loop over the
symbols, in the exact reverse of the decoder's order (so a page costs tens of
milliseconds). Used by :mod:`tierkv.codec.portable` (the fallback where the C extension
is not built, and the tests' check that the two implementations read each other).
"""

from __future__ import annotations

import numpy as np

from tierkv.codec.format import (LANES, LEVEL_BITS, MAX_LO, RANS_L, SIDE_ALPHA, SIDE_CENTER, STATE_TOP,
                                 TAIL_BITS_PER_LANE, Mode, pack_header, tail_bits)
from tierkv.codec.portable.common import (NCTX, BitWriter, Geometry, Params, bits_for, contexts,
                                    counts_to_levels, ctx_flip, ctx_main, ctx_side, fixed_bits, levels_to_freqs,
                                    pack_bits)

SIGN_KEEP = 0.990    # code signs only when it saves 1% of their bits
LO_MIN_SAVING = 0.05  # drop low mantissa bits only when it saves 0.05 bit per element
LO_EXCEPTION_BITS = 16  # estimated cost of one lo exception

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


class _Plane:
    """One plane's analysis: its coded rows and the symbols of each."""

    def __init__(self, g: Geometry, pr: Params, u: np.ndarray, dup: np.ndarray) -> None:
        self.rows = np.flatnonzero(~dup)               # token indices of the coded rows
        v = u[self.rows]                               # [n, C] element values
        self.v = v
        e = (v >> g.mbits) & ((1 << g.ebits) - 1)
        self.cmax = e.max(axis=0)
        hist = np.bincount(self.cmax, minlength=1 << g.ebits)
        self.base = int(np.argmax(hist))
        d = self.cmax.astype(np.int64) - self.base + SIDE_CENTER
        self.side = np.where((d >= 0) & (d < SIDE_ALPHA - 1), d, SIDE_ALPHA - 1)
        s = (v >> (g.nbits - 1)) & 1
        differs = s != s[0]
        n = len(self.rows)
        self.fpos = np.where(differs.any(axis=0), differs.argmax(axis=0), n)  # first flip, n = none
        hshift = g.mbits - pr.hi
        m = v & ((1 << g.mbits) - 1)
        r = self.cmax[None, :].astype(np.int64) - e
        self.sym = np.where(r < g.rmax, (r << pr.hi) | (m >> hshift), pr.esc(g)).astype(np.int64)
        self.lo8 = ((m & ((1 << hshift) - 1)) >> pr.tz) & 0xFF

    @property
    def flip_syms(self) -> np.ndarray:
        return self.fpos - 1


def _dups(g: Geometry, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows equal to an earlier row of their plane, and the row each repeats."""
    dup = np.zeros((g.planes, g.tokens), dtype=bool)
    src = np.zeros((g.planes, g.tokens), dtype=np.int64)
    for p in range(g.planes):
        seen: dict[bytes, int] = {}
        for t in range(g.tokens):
            key = u[p, t].tobytes()
            if key in seen:
                dup[p, t], src[p, t] = True, seen[key]
            else:
                seen[key] = t
    return dup, src


def _entropy_bits(counts: np.ndarray) -> float:
    n = counts.sum()
    c = counts[counts > 0].astype(np.float64)
    return float((c * np.log2(n / c)).sum()) if n else 0.0


def _table_bits(counts: np.ndarray) -> float:
    nz = np.flatnonzero(counts)
    return 1.0 if nz.size == 0 else 1 + 2 * bits_for(counts.size) + LEVEL_BITS * (nz[-1] - nz[0] + 1)


def _decide(g: Geometry, pr: Params, planes: list[_Plane], counts: list[np.ndarray]) -> None:
    for kc in range(g.nkc):
        mine = [pl for p, pl in enumerate(planes) if g.kc(p) == kc]
        raw = sum(pl.v.size for pl in mine)
        left = sum(int((1 + np.where(pl.fpos < len(pl.rows), len(pl.rows) - 1 - pl.fpos, 0)).sum())
                   for pl in mine)
        cf = counts[ctx_flip(kc)]
        coded = _entropy_bits(cf) + _table_bits(cf) + left
        pr.sign_coded[kc] = int(raw > 0 and coded < raw * SIGN_KEEP)
    hist8 = np.sum([np.bincount(pl.lo8.ravel(), minlength=256) for pl in planes], axis=0)
    n = float(sum(pl.v.size for pl in planes))
    room = g.mbits - pr.hi - pr.tz
    best, best_saving = 0, 0.0
    for k in range(1, min(room, MAX_LO) + 1):
        nonzero = float(hist8[(np.arange(256) & ((1 << k) - 1)) != 0].sum())
        saving = k * n - nonzero * LO_EXCEPTION_BITS - 32
        if saving > best_saving:
            best, best_saving = k, saving
    if best and best_saving >= LO_MIN_SAVING * n:
        pr.lo = best
    pr.mid = g.mbits - pr.hi - pr.tz - pr.lo


def _model(g: Geometry, pr: Params, counts: list[np.ndarray]) -> tuple[bytes, list[list[int] | None]]:
    """The tables' bits and, per context, the (start, freq) pairs the coder uses."""
    w = BitWriter()
    tables: list[list[int] | None] = [None] * NCTX
    for ctx, c in enumerate(contexts(g, pr)):
        if not c.used:
            continue
        counts_c = np.zeros(c.alpha, dtype=np.int64)
        counts_c[:min(c.alpha, counts[ctx].size)] = counts[ctx][:c.alpha]
        levels = counts_to_levels(counts_c, c.pbits)
        freq = levels_to_freqs(levels, c.pbits)
        w.put(freq is not None, 1)
        if freq is None:
            continue
        nz = [i for i, v in enumerate(levels) if v]
        nb = bits_for(c.alpha)
        w.put(nz[0], nb)
        w.put(nz[-1] - nz[0], nb)
        for i in range(nz[0], nz[-1] + 1):
            w.put(levels[i], LEVEL_BITS)
        tables[ctx] = freq
    return w.flush(), tables


def _varint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _streams(g: Geometry, pr: Params, planes: list[_Plane]) -> tuple[bytes, bytes, bytes, list[int]]:
    """Escapes (in decode order), raw signs (channel by channel), the mid bits less their
    tail, and the tail's 31-bit pieces that the lanes' initial states carry."""
    esc = BitWriter()
    mids, signs = [], []
    midshift = pr.tz + pr.lo
    for p, pl in enumerate(planes):
        coded = pr.sign_coded[g.kc(p)]
        for c in np.flatnonzero(pl.side == SIDE_ALPHA - 1):
            esc.put(int(pl.cmax[c]), g.ebits)
        if coded and g.flip_esc >= 0:
            for c in np.flatnonzero(pl.flip_syms >= g.flip_esc):
                esc.put(int(pl.flip_syms[c]), bits_for(g.tokens))
        for k in range(len(pl.rows)):
            for c in np.flatnonzero(pl.sym[k] == pr.esc(g)):
                val = int(pl.v[k, c])
                esc.put((val >> g.mbits) & ((1 << g.ebits) - 1), g.ebits)
                esc.put((val >> (g.mbits - pr.hi)) & ((1 << pr.hi) - 1), pr.hi)
        mids.append(((pl.v >> midshift) & ((1 << pr.mid) - 1)).ravel())
        row = np.arange(len(pl.rows))[:, None]
        raw = (row == 0) | (row > pl.fpos[None, :]) if coded else np.ones(pl.v.shape, dtype=bool)
        signs.append(((pl.v >> (g.nbits - 1)) & 1).T[raw.T])   # channel by channel
    mid_bits = fixed_bits(np.concatenate(mids), pr.mid)
    n = tail_bits(planes[-1].v.size * pr.mid)
    tail = mid_bits[mid_bits.size - n:]
    lanes = [int((tail[j:j + TAIL_BITS_PER_LANE].astype(np.int64) << np.arange(len(tail[j:j + TAIL_BITS_PER_LANE])))
                 .sum()) for j in range(0, TAIL_BITS_PER_LANE * LANES, TAIL_BITS_PER_LANE)]
    signs_bits = np.concatenate(signs).astype(np.uint8)
    return esc.flush(), pack_bits(signs_bits), pack_bits(mid_bits[:mid_bits.size - n]), lanes


def _put(x: int, out: list[bytes], start: int, freq: int, pbits: int) -> int:
    if x >= ((RANS_L >> pbits) << 16) * freq:
        out.append((x & 0xFFFF).to_bytes(2, "little"))
        x >>= 16
    return ((x // freq) << pbits) + x % freq + start


def _rans(g: Geometry, pr: Params, planes: list[_Plane], tables: list[list[int] | None],
          lane_tail: list[int]) -> bytes:
    ctxs = contexts(g, pr)
    cum = [None if t is None else [sum(t[:i]) for i in range(len(t))] for t in tables]
    x = [STATE_TOP + t for t in lane_tail]
    words: list[bytes] = []  # emitted in reverse stream order

    def put(lane: int, ctx: int, sym: int) -> None:
        freq, start = tables[ctx], cum[ctx]
        assert freq is not None and start is not None
        x[lane] = _put(x[lane], words, start[sym], freq[sym], ctxs[ctx].pbits)

    C = g.chans
    chunks = list(range(0, C, LANES))
    for p in reversed(range(g.planes)):
        pl, kc = planes[p], g.kc(p)
        for k in reversed(range(len(pl.rows))):
            for c0 in reversed(chunks):
                n = min(LANES, C - c0)
                for j in reversed(range(n)):
                    put(j, ctx_main(kc), int(pl.sym[k, c0 + j]))
        if pr.sign_coded[kc]:
            fs = np.minimum(pl.flip_syms, g.flip_esc) if g.flip_esc >= 0 else pl.flip_syms
            for c0 in reversed(chunks):
                for j in reversed(range(min(LANES, C - c0))):
                    put(j, ctx_flip(kc), int(fs[c0 + j]))
        for c0 in reversed(chunks):
            for j in reversed(range(min(LANES, C - c0))):
                put(j, ctx_side(kc), int(pl.side[c0 + j]))
    head = b"".join(v.to_bytes(4, "little") for v in x)
    return head + b"".join(reversed(words))


def encode_page(g: Geometry, row: np.ndarray, hi: int = 1) -> bytes:
    """One page (``uint8 [page_bytes]``) as a blob."""
    u = row.view(_UINT[g.itemsize]).astype(np.int64).reshape(g.planes, g.tokens, g.chans)
    pr = Params(hi=hi)
    dup, src = _dups(g, u)
    any_bits = int(np.bitwise_or.reduce((u & ((1 << (g.mbits - hi)) - 1)).ravel()))
    pr.tz = g.mbits - hi if any_bits == 0 else (any_bits & -any_bits).bit_length() - 1
    planes = [_Plane(g, pr, u[p], dup[p]) for p in range(g.planes)]
    counts = [np.zeros(256, dtype=np.int64) for _ in range(NCTX)]
    for p, pl in enumerate(planes):
        kc = g.kc(p)
        counts[ctx_side(kc)] += np.bincount(pl.side, minlength=256)[:256]
        fs = np.minimum(pl.flip_syms, g.flip_esc) if g.flip_esc >= 0 else pl.flip_syms
        counts[ctx_flip(kc)] += np.bincount(fs, minlength=256)[:256]
        counts[ctx_main(kc)] += np.bincount(pl.sym.ravel(), minlength=256)[:256]
    _decide(g, pr, planes, counts)
    tables_bits, tables = _model(g, pr, counts)
    dups = bytearray(_varint(int(dup.sum())))
    prev = -1
    for gi in np.flatnonzero(dup.ravel()):
        dups += _varint(int(gi) - prev - 1) + _varint(int(gi % g.tokens - src.ravel()[gi] - 1))
        prev = int(gi)
    esc, sign, mid, lane_tail = _streams(g, pr, planes)
    lo = np.concatenate([pl.lo8.ravel() for pl in planes]) & ((1 << pr.lo) - 1)
    exc = bytearray(_varint(int(np.count_nonzero(lo))))
    prev = -1
    for k in np.flatnonzero(lo):
        exc += _varint(int(k) - prev - 1) + bytes([int(lo[k])])
        prev = int(k)
    parts = [tables_bits, bytes(dups), _rans(g, pr, planes, tables, lane_tail), esc, sign, mid, bytes(exc)]
    fixed = bytes([pr.hi, pr.tz, pr.lo, pr.sign_coded[0] | pr.sign_coded[1] << 1])
    fixed += b"".join(len(x).to_bytes(4, "little") for x in parts)
    payload = fixed + parts[0] + bytes(pl.base for pl in planes) + b"".join(parts[1:])
    dims = (g.layers, g.tokens, g.heads, g.head_dim)
    if len(payload) >= g.page_bytes:
        return pack_header(g.dtype, g.kind, dims, Mode.RAW, row.tobytes()) + row.tobytes()
    return pack_header(g.dtype, g.kind, dims, Mode.CODED, payload) + payload
