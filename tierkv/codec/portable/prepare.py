"""The GPU decoder's host side in numpy and Python (``codec_gpu.c`` in C): the same checks
and the same descriptor and side block per page, word for word, where the C extension is
not built (a GPU machine with no compiler, say). About a millisecond a page: the C one is
what the store uses. Used by :mod:`tierkv.codec.gpu`; the word layout is
``codec_gpu_kernel.cuh``'s.
"""

from __future__ import annotations

import numpy as np

from tierkv.codec.format import HEADER_BYTES, PAYLOAD_FIXED, DecodeStatus, Mode
from tierkv.codec.portable.common import Geometry, bits_for
from tierkv.codec.portable.decode import _Corrupt, check_blob, lo_exception_list, open_payload

THREADS = 64           # GD_THREADS: a thread block per page
DESC_WORDS = 32
NONE = 0xFFFFFFFF
GEO_CHANS = 6          # GG_CHANS: the channels' index among the geometry words
EMULATION_FAULT = 9    # GD_ERR_EMULATION: a barrier not every emulated thread reached
TABLE_WORDS = 256
NCTX = 6
(MODE, PAYLOAD_LO, PAYLOAD_HI, SIDE_LO, SIDE_HI, RANS_OFF, RANS_LEN, ESC_OFF, ESC_LEN, SIGN_OFF, SIGN_LEN, MID_OFF,
 MID_LEN, HI, TZ, LO, MIDW, FLAGS, ESC_SYM, FROM_LO, FROM_HI, TAIL, NEXC, PLEN) = range(24)


def geometry_words(g: Geometry) -> np.ndarray:
    """The batch's geometry words (``gpu_geometry`` in C)."""
    flip_pbits = 8 if g.flip_alpha <= 128 else 11
    words = [g.itemsize, g.ebits, g.mbits, g.nbits, g.planes, g.tokens, g.chans, g.nkc, g.flip_alpha, flip_pbits,
             g.flip_esc if g.flip_esc >= 0 else NONE, bits_for(g.tokens), g.page_bytes & NONE, g.page_bytes >> 32]
    return np.array(words, dtype=np.uint32)


def prepare_page(g: Geometry, blob: memoryview, at: int, side_at: int) -> tuple[int, np.ndarray, np.ndarray]:
    """One blob at byte ``at`` of the batch, its side block at word ``side_at``: the status,
    the descriptor and the side words (empty unless coded and accepted)."""
    desc = np.zeros(DESC_WORDS, dtype=np.uint32)
    none = np.zeros(0, dtype=np.uint32)
    status, mode, payload = check_blob(g, blob)
    if status is not DecodeStatus.OK:
        return int(status), desc, none
    desc[PAYLOAD_LO], desc[PAYLOAD_HI] = (at + HEADER_BYTES) & NONE, (at + HEADER_BYTES) >> 32
    desc[PLEN], desc[MODE] = len(payload), mode.value
    if mode is Mode.RAW:
        return 0, desc, none
    try:
        return 0, desc, _coded(g, payload, desc, side_at)
    except _Corrupt as exc:
        return int(exc.status), np.zeros(DESC_WORDS, dtype=np.uint32), none


def _coded(g: Geometry, payload: bytes, desc: np.ndarray, side_at: int) -> np.ndarray:
    pr, parts, bases, tables, dup, src, nrows, total, n_tail = open_payload(g, payload)
    coded = int(nrows.sum()) * g.chans
    kk, lo_bits = lo_exception_list(pr, parts[6], coded)
    P, T, C = g.planes, g.tokens, g.chans
    side = np.zeros(NCTX * TABLE_WORDS + 4 * P + 1 + 2 * P * T + 2 * kk.size, dtype=np.uint32)
    for ctx, c in enumerate(tables.ctxs):
        if c.used:
            freq = np.array(tables.freq[ctx], dtype=np.uint32)
            start = np.array(tables.start[ctx], dtype=np.uint32)
            side[ctx * TABLE_WORDS:ctx * TABLE_WORDS + c.alpha] = freq | start << 16
    w = NCTX * TABLE_WORDS
    side[w:w + P] = np.frombuffer(bases, dtype=np.uint8)
    side[w + P:w + 2 * P] = nrows
    kk0 = np.concatenate([[0], np.cumsum(nrows[:-1])]) * C
    side[w + 2 * P:w + 3 * P] = kk0
    plane_of = np.searchsorted(kk0, kk, side="right") - 1
    side[w + 3 * P:w + 4 * P + 1] = np.searchsorted(plane_of, np.arange(P + 1), side="left")
    tok = side[w + 4 * P + 1:w + 4 * P + 1 + P * T].reshape(P, T)
    srcw = side[w + 4 * P + 1 + P * T:w + 4 * P + 1 + 2 * P * T].reshape(P, T)
    for p in range(P):
        rows = np.flatnonzero(~dup[p])
        tok[p, :rows.size] = rows
        srcw[p] = NONE
        for t in np.flatnonzero(dup[p]).tolist():
            s = int(src[p, t])
            while dup[p, s]:
                s = int(src[p, s])
            srcw[p, t] = s
    local = kk - kk0[plane_of]
    exc = side[w + 4 * P + 1 + 2 * P * T:].reshape(-1, 2)
    exc[:, 0] = (plane_of * T + tok[plane_of, local // C]) * C + local % C
    exc[:, 1] = lo_bits
    offs = np.cumsum([PAYLOAD_FIXED + len(parts[0]) + P] + [len(x) for x in parts[1:]])
    desc[SIDE_LO], desc[SIDE_HI] = side_at & NONE, side_at >> 32
    desc[RANS_OFF:MID_LEN + 1] = [offs[1], len(parts[2]), offs[2], len(parts[3]), offs[3], len(parts[4]),
                                  offs[4], len(parts[5])]
    desc[HI], desc[TZ], desc[LO], desc[MIDW] = pr.hi, pr.tz, pr.lo, pr.mid
    desc[FLAGS] = pr.sign_coded[0] | pr.sign_coded[1] << 1
    desc[ESC_SYM] = pr.esc(g)
    desc[FROM_LO], desc[FROM_HI] = (total - n_tail) & NONE, (total - n_tail) >> 32
    desc[TAIL], desc[NEXC] = n_tail, kk.size
    return side
