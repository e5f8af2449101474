/*
 * The encoder's passes over a page's elements: repeated rows, the mantissa bits that
 * are zero everywhere, per plane the channel maxima, first sign flips and symbols (with
 * their counts), and the raw streams (escapes, signs, mid bits) in decode order.
 * Called by codec_enc.c; the element width is a constant in each specialised loop.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "codec_enc.h"

static size_t
row_bytes(const Layout *lay) { return lay->chans * (size_t)lay->itemsize; }

static const uint8_t *
row_ptr(const Enc *E, size_t p, size_t t)
{
    return E->src + ((p * E->lay->tokens) + t) * row_bytes(E->lay);
}

/* Marks rows equal (byte for byte) to an earlier row of the same plane. */
void
find_dups(Enc *E)
{
    const Layout *lay = E->lay;
    size_t rb = row_bytes(lay), keylen = rb < 32 ? rb : 32;
    for (size_t p = 0; p < lay->planes; p++) {
        memset(E->slots, 0xFF, E->nslots * sizeof(uint32_t));
        E->nrows[p] = 0;
        for (size_t t = 0; t < lay->tokens; t++) {
            const uint8_t *row = row_ptr(E, p, t);
            size_t h = (size_t)XXH3_64bits(row, keylen) & (E->nslots - 1);
            uint8_t *dup = &E->dup[p * lay->tokens + t];
            *dup = 0;
            for (;;) {
                uint32_t s = E->slots[h];
                if (s == UINT32_MAX) {
                    E->slots[h] = (uint32_t)t;
                    break;
                }
                if (memcmp(row_ptr(E, p, s), row, rb) == 0) {
                    *dup = 1;
                    E->dup_src[p * lay->tokens + t] = s;
                    E->ndup++;
                    break;
                }
                h = (h + 1) & (E->nslots - 1);
            }
            E->nrows[p] += !*dup;
        }
    }
}

/* Mantissa bits below the hi bits that are zero in every element. */
int
common_zero_bits(const Enc *E)
{
    const Layout *lay = E->lay;
    int rest = lay->mbits - E->pr.hi;
    uint32_t mask = (1u << rest) - 1, any = 0;
    /* ORed a block at a time (a loop the compiler vectorizes), until bit 0 is seen */
    for (size_t i0 = 0; i0 < lay->elems && (any & 1) == 0; i0 += 1024) {
        size_t end = lay->elems - i0 < 1024 ? lay->elems : i0 + 1024;
        uint32_t blk = 0;
        switch (lay->itemsize) {
        case 1: for (size_t i = i0; i < end; i++) blk |= E->src[i]; break;
        case 2: for (size_t i = i0; i < end; i++) blk |= load_elem(E->src + 2 * i, 2); break;
        default: for (size_t i = i0; i < end; i++) blk |= load_elem(E->src + 4 * i, 4); break;
        }
        any |= blk & mask;
    }
    if (any == 0)
        return rest;
    int tz = 0;
    while (((any >> tz) & 1) == 0) tz++;
    return tz;
}

/* Channel maxima, the plane's base and side symbols. */
static inline __attribute__((always_inline)) void
plane_maxima(Enc *E, size_t p, int kc, const int isz)
{
    const Layout *lay = E->lay;
    const size_t C = lay->chans, T = lay->tokens;
    const uint32_t emask = (1u << lay->ebits) - 1;
    const int mbits = lay->mbits;
    uint16_t *restrict cmax = E->cmax + p * C;
    memset(cmax, 0, C * sizeof(uint16_t));
    for (size_t t = 0; t < T; t++) {
        if (E->dup[p * T + t]) continue;
        const uint8_t *row = row_ptr(E, p, t);
        for (size_t c = 0; c < C; c++) {
            uint16_t e = (uint16_t)((load_elem(row + c * isz, isz) >> mbits) & emask);
            cmax[c] = e > cmax[c] ? e : cmax[c];
        }
    }
    plane_side(E, p, kc);
}

/* From the plane's channel maxima: its base (their most common value), the side
 * symbols and their counts. */
void
plane_side(Enc *E, size_t p, int kc)
{
    const size_t C = E->lay->chans;
    const uint32_t emask = (1u << E->lay->ebits) - 1;
    const uint16_t *cmax = E->cmax + p * C;
    /* four histograms over the maxima's range only (zeroing 4 KiB a plane cost more
     * than the counting): most channels share a maximum, and one table's increments
     * would wait on each other */
    uint32_t hist[4][256];
    uint32_t lo = emask, hi = 0;
    size_t c = 0;
    for (c = 0; c < C; c++) {
        lo = cmax[c] < lo ? cmax[c] : lo;
        hi = cmax[c] > hi ? cmax[c] : hi;
    }
    for (int j = 0; j < 4 && C; j++) memset(&hist[j][lo], 0, (hi - lo + 1) * sizeof(uint32_t));
    for (c = 0; c + 4 <= C; c += 4)
        for (int j = 0; j < 4; j++) hist[j][cmax[c + j]]++;
    for (; c < C; c++) hist[0][cmax[c]]++;
    int base = 0;   /* the most common maximum, the smallest of equals */
    uint32_t best = 0;
    for (uint32_t v = lo; v <= hi && C; v++) {
        uint32_t n = hist[0][v] + hist[1][v] + hist[2][v] + hist[3][v];
        if (n > best) {
            best = n;
            base = (int)v;
        }
    }
    E->base[p] = (uint8_t)base;
    uint32_t n[4][SIDE_ALPHA] = {{0}};
    for (c = 0; c < C; c++) {
        int d = (int)cmax[c] - base + SIDE_CENTER;
        uint8_t s = (d >= 0 && d < SIDE_ALPHA - 1) ? (uint8_t)d : SIDE_ALPHA - 1;
        E->side[p * C + c] = s;
        n[c & 3][s]++;
    }
    E->side_esc[p] = n[0][SIDE_ALPHA - 1] + n[1][SIDE_ALPHA - 1] + n[2][SIDE_ALPHA - 1] + n[3][SIDE_ALPHA - 1] != 0;
    for (int s = 0; s < SIDE_ALPHA; s++) E->counts[CTX_SIDE(kc)][s] += n[0][s] + n[1][s] + n[2][s] + n[3][s];
}

/* First sign flip of each channel over the plane's coded rows (nrows = none). */
static inline __attribute__((always_inline)) void
plane_flips(Enc *E, size_t p, int kc, const int isz)
{
    const Layout *lay = E->lay;
    const size_t C = lay->chans, T = lay->tokens;
    const uint32_t n = E->nrows[p], none = n, sshift = (uint32_t)lay->nbits - 1;
    uint32_t *restrict f = E->fpos + p * C;
    uint8_t *restrict s0 = E->s0;
    uint32_t k = 0;
    for (size_t c = 0; c < C; c++) f[c] = none;
    for (size_t t = 0; t < T; t++) {
        if (E->dup[p * T + t]) continue;
        const uint8_t *row = row_ptr(E, p, t);
        if (k == 0) {
            for (size_t c = 0; c < C; c++) s0[c] = (uint8_t)(load_elem(row + c * isz, isz) >> sshift);
        } else {
            for (size_t c = 0; c < C; c++) {   /* branch-free: sign changes are coin tosses */
                uint32_t s = load_elem(row + c * isz, isz) >> sshift;
                f[c] = (f[c] == none) & (s != s0[c]) ? k : f[c];
            }
        }
        k++;
    }
    plane_flip_counts(E, p, kc);
}

/* The counts of the plane's first-flip symbols, and the raw sign bits coding them leaves. */
void
plane_flip_counts(Enc *E, size_t p, int kc)
{
    const Layout *lay = E->lay;
    const size_t C = lay->chans;
    const uint32_t n = E->nrows[p], *f = E->fpos + p * C;
    uint32_t h[4][FLIP_ALPHA_MAX];   /* zeroed over the alphabet only */
    uint64_t raw = 0;
    for (int j = 0; j < 4; j++) memset(h[j], 0, (size_t)lay->flip_alpha * sizeof(uint32_t));
    for (size_t c = 0; c < C; c++) {
        uint32_t sym = f[c] - 1;
        if (lay->flip_esc >= 0 && sym >= (uint32_t)lay->flip_esc) sym = (uint32_t)lay->flip_esc;
        h[c & 3][sym]++;
        raw += 1 + (f[c] < n ? n - 1 - f[c] : 0);
    }
    E->flip_raw[kc] += raw;
    for (int s = 0; s < lay->flip_alpha; s++) E->counts[CTX_FLIP(kc)][s] += h[0][s] + h[1][s] + h[2][s] + h[3][s];
}

/* Main symbols (exponent residual and hi bits) and the low-bit histogram. */
static inline __attribute__((always_inline)) void
plane_symbols(Enc *E, size_t p, int kc, const int isz)
{
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    const size_t C = lay->chans, T = lay->tokens;
    const uint32_t emask = (1u << lay->ebits) - 1, rmax = (uint32_t)lay->rmax, esc = (uint32_t)pr->esc;
    const int mbits = lay->mbits, hshift = lay->mbits - pr->hi, hi = pr->hi, tz = pr->tz;
    const uint32_t restmask = (1u << hshift) - 1, mmask = (1u << mbits) - 1;
    const uint16_t *restrict cmax = E->cmax + p * C;
    /* four histograms, so that runs of one symbol do not wait on each other's counts;
     * tzh counts the trailing zeros of the low 8 bits (8: all zero) */
    uint32_t cm[4][256] = {{0}}, tzh[4][9] = {{0}};
    for (size_t t = 0; t < T; t++) {
        if (E->dup[p * T + t]) continue;
        const uint8_t *row = row_ptr(E, p, t);
        uint8_t *restrict sym = E->sym + (p * T + t) * C, *restrict lov = E->lov + (p * T + t) * C;
        uint32_t escs = 0;
        for (size_t c = 0; c < C; c++) {
            uint32_t v = load_elem(row + c * isz, isz);
            uint32_t e = (v >> mbits) & emask, m = v & mmask, r = cmax[c] - e;
            uint32_t s = r < rmax ? (r << hi | m >> hshift) : esc;
            escs |= r >= rmax;
            sym[c] = (uint8_t)s;
            cm[c & 3][s]++;
            uint8_t lo8 = (uint8_t)(((m & restmask) >> tz) & 0xFF);
            lov[c] = lo8;
            tzh[c & 3][lo8 ? __builtin_ctz(lo8) : 8]++;
        }
        E->resc[p * T + t] = (uint8_t)escs;
        E->coded_elems += C;
        E->elems_kc[kc] += C;
    }
    for (int i = 0; i < 256; i++) E->counts[CTX_MAIN(kc)][i] += cm[0][i] + cm[1][i] + cm[2][i] + cm[3][i];
    /* an element's low k bits are not all zero when its trailing zeros number < k */
    for (int k = 1; k <= MAX_LO; k++)
        for (int z = 0; z < k; z++) E->lo_nonzero[k] += tzh[0][z] + tzh[1][z] + tzh[2][z] + tzh[3][z];
}

void
analyse_plane(Enc *E, size_t p)
{
    int kc = E->lay->nkc == 2 ? (int)(p & 1) : 0;
    if (E->lay->itemsize == 2 && E->avx512bw && E->lay->chans % 32 == 0) {
        analyse_plane_16_avx512(E, p, kc);
        return;
    }
    if (E->lay->itemsize == 1 && E->avx512bw && E->lay->chans % 64 == 0) {
        analyse_plane_8_avx512(E, p, kc);
        return;
    }
    switch (E->lay->itemsize) {
    case 1: plane_maxima(E, p, kc, 1); plane_flips(E, p, kc, 1); plane_symbols(E, p, kc, 1); break;
    case 2: plane_maxima(E, p, kc, 2); plane_flips(E, p, kc, 2); plane_symbols(E, p, kc, 2); break;
    default: plane_maxima(E, p, kc, 4); plane_flips(E, p, kc, 4); plane_symbols(E, p, kc, 4); break;
    }
}

/* One plane's part of the raw streams, in decode order. */
static inline __attribute__((always_inline)) void
plane_streams(const Enc *E, size_t p, BitWriter *esc_w, BitWriter *sign_w, BitWriter *mid, const int isz)
{
    /* the escape and sign writers in locals, so that their state stays in registers */
    BitWriter esc_l = *esc_w, sign_l = *sign_w, *esc = &esc_l, *sign = &sign_l;
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    const size_t C = lay->chans, T = lay->tokens;
    const int kc = lay->nkc == 2 ? (int)(p & 1) : 0, coded = pr->sign_coded[kc];
    const int hshift = lay->mbits - pr->hi, sshift = lay->nbits - 1, w = pr->mid;
    const uint32_t emask = (1u << lay->ebits) - 1, himask = (1u << pr->hi) - 1;
    const uint32_t midmask = (1u << w) - 1, midshift = (uint32_t)(pr->tz + pr->lo);
    const uint32_t *f = E->fpos + p * C;
    if (E->side_esc[p])
        for (size_t c = 0; c < C; c++)
            if (E->side[p * C + c] == SIDE_ALPHA - 1) bw_put(esc, E->cmax[p * C + c], lay->ebits);
    if (coded && lay->flip_esc >= 0)
        for (size_t c = 0; c < C; c++)
            if (f[c] - 1 >= (uint32_t)lay->flip_esc) bw_put(esc, f[c] - 1, bits_for((int)lay->tokens));
    uint32_t k = 0;
    for (size_t t = 0; t < T; t++) {
        if (E->dup[p * T + t]) continue;
        const uint8_t *row = row_ptr(E, p, t);
        const uint8_t *sym = E->sym + (p * T + t) * C;
        const uint64_t ones = 0x0101010101010101ull, escs = ones * (uint8_t)pr->esc;
        for (size_t c = 0; E->resc[p * T + t] && c < C; c++) {
            if ((c & 7) == 0 && c + 8 <= C) {   /* skip 8 symbols at once when none escapes */
                uint64_t z = rd_u64(sym + c) ^ escs;
                if (((z - ones) & ~z & ones << 7) == 0) {
                    c += 7;
                    continue;
                }
            }
            if (sym[c] != pr->esc) continue;
            uint32_t v = load_elem(row + c * isz, isz);
            bw_put(esc, (v >> lay->mbits) & emask, lay->ebits);
            bw_put(esc, (v >> hshift) & himask, pr->hi);
        }
        size_t c = E->bmi2 && isz <= 2 && w ? pack_mids_bmi2(mid, row, isz, C, (int)midshift, w) : 0;
        for (; c < C; c++) bw_put(mid, (load_elem(row + c * isz, isz) >> midshift) & midmask, w);
        k++;
    }
    /* Raw signs channel by channel: the first coded row, then every row past the
     * channel's first flip (every row when the plane's signs are not coded). The signs
     * are first gathered row by row into words of 32 rows per channel. */
    const uint32_t nw = (k + 31) / 32;
    uint32_t *restrict words = E->signw;
    memset(words, 0, (size_t)nw * C * sizeof(uint32_t));
    k = 0;
    for (size_t t = 0; t < T; t++) {
        if (E->dup[p * T + t]) continue;
        const uint8_t *row = row_ptr(E, p, t);
        uint32_t *restrict wq = words + (size_t)(k >> 5) * C;
        size_t c = !E->avx512bw ? 0 : isz == 2 ? or_signs_16_avx512(wq, row, C, k & 31)
                 : isz == 1 ? or_signs_8_avx512(wq, row, C, k & 31) : 0;
        for (; c < C; c++) wq[c] |= (load_elem(row + c * isz, isz) >> sshift) << (k & 31);
        k++;
    }
    if (k < 32 && coded && sign->end - sign->p >= (ptrdiff_t)(C * 32 / 8 + 8)) {
        for (size_t c = 0; c < C; c++) {   /* as below, with room for every word: no branch */
            uint32_t word = words[c], lo = f[c] + 1 < k ? f[c] + 1 : k;
            bw_put_room(sign, (word & 1) | ((word >> lo) & ((1u << (k - lo)) - 1)) << 1, (int)(k - lo) + 1);
        }
    } else if (k < 32) {   /* one word a channel: its coded bit and raw bits in one put */
        for (size_t c = 0; c < C; c++) {
            uint32_t word = words[c], lo = coded ? (f[c] + 1 < k ? f[c] + 1 : k) : 0;
            uint32_t bits = (word >> lo) & ((1u << (k - lo)) - 1);
            if (coded) bw_put(sign, (word & 1) | bits << 1, (int)(k - lo) + 1);
            else bw_put(sign, bits, (int)(k - lo));
        }
    } else {
        for (size_t c = 0; c < C; c++) {
            if (coded) bw_put(sign, words[c] & 1, 1);
            uint32_t first_raw = coded ? f[c] + 1 : 0;
            for (uint32_t q = 0; q < nw; q++) {
                uint32_t n = k - 32 * q < 32 ? k - 32 * q : 32, lo = first_raw > 32 * q ? first_raw - 32 * q : 0;
                if (lo >= n) continue;
                uint32_t bits = words[(size_t)q * C + c] >> lo, nb = n - lo;
                bw_put(sign, nb == 32 ? bits : bits & ((1u << nb) - 1), (int)nb);
            }
        }
    }
    *esc_w = esc_l;
    *sign_w = sign_l;
}

void
write_streams(const Enc *E, BitWriter *esc, BitWriter *sign, BitWriter *mid)
{
    for (size_t p = 0; p < E->lay->planes; p++) {
        switch (E->lay->itemsize) {
        case 1: plane_streams(E, p, esc, sign, mid, 1); break;
        case 2: plane_streams(E, p, esc, sign, mid, 2); break;
        default: plane_streams(E, p, esc, sign, mid, 4); break;
        }
    }
    bw_flush(esc);
    bw_flush(sign);
    bw_flush(mid);
}

/* Moves the last tail_bits() mid bits out of the mid stream into the lanes' initial
 * states ("bits back": the decoder finds them in its final states), so the states
 * flushed at the stream's start cost almost nothing. Returns the new mid length. */
size_t
take_mid_tail(Enc *E, uint8_t *mid, size_t total_bits)
{
    const Layout *lay = E->lay;
    size_t n = tail_bits((size_t)E->nrows[lay->planes - 1] * lay->chans * (size_t)E->pr.mid);
    size_t from = total_bits - n;
    memset(E->lane_tail, 0, sizeof(E->lane_tail));
    for (size_t i = 0; i < n; i += TAIL_BITS_PER_LANE) {   /* 31 bits a lane, read a word at a time */
        size_t b = from + i, nb = n - i < TAIL_BITS_PER_LANE ? n - i : TAIL_BITS_PER_LANE;
        uint64_t v = 0;
        for (size_t q = 0; q < 5 && (b >> 3) + q < (total_bits + 7) / 8; q++) v |= (uint64_t)mid[(b >> 3) + q] << (8 * q);
        E->lane_tail[i / TAIL_BITS_PER_LANE] = (uint32_t)((v >> (b & 7)) & ((1ull << nb) - 1));
    }
    size_t len = (from + 7) / 8;
    if (from & 7) mid[from >> 3] &= (uint8_t)((1u << (from & 7)) - 1);
    return len;
}
