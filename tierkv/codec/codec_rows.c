/*
 * The decoder's row assembly: a plane's signs from their first flips and raw bits, the
 * fixed-width mid mantissa bits (with the tail that came back in the rANS states), and
 * each row put together from symbols, channel maxima, signs and mid bits, then patched
 * for escapes and lo exceptions. Called by codec_planes.c; the 16-bit rows go through
 * codec_simd_rows.c's AVX-512 VBMI pass (mid bits and assembly in one) or its AVX2 assembly
 * where the CPU has them.
 */
#include "codec_dec.h"

/* The lo exceptions of the row of coded elements [k0, k0 + C): OR their bits in. */
static void
apply_lo_exceptions(Dec *D, uint8_t *out, size_t k0)
{
    const Layout *lay = D->lay;
    const int isz = lay->itemsize;
    while (D->exc_left && D->exc_next < k0 + lay->chans) {
        size_t c = (size_t)(D->exc_next - k0);
        if (D->exc_next < k0 || D->exc >= D->exc_end) {
            D->err = ERR_STRUCTURE;
            D->exc_left = 0;
            return;
        }
        uint32_t v = *D->exc++;
        if (v == 0 || v >> D->pr.lo) D->err = ERR_STREAM;
        store_elem(out + c * isz, isz, load_elem(out + c * isz, isz) | v << D->pr.tz);
        if (--D->exc_left) {
            uint64_t gap;
            if (get_varint(&D->exc, D->exc_end, &gap) != 0 || gap > ~D->exc_next) {
                D->err = ERR_STRUCTURE;
                D->exc_left = 0;
                return;
            }
            D->exc_next += gap + 1;
        }
    }
}

/* nb <= 64 bits of a fixed-order stream from bit offset off. */
static inline uint64_t
bits64_at(const uint8_t *buf, size_t len, size_t off, uint32_t nb)
{
    uint64_t v = bits_at(buf, len, off);
    if (nb > 56) v = (v & 0xFFFFFFFFull) | bits_at(buf, len, off + 32) << 32;
    return nb >= 64 ? v : v & ((1ull << nb) - 1);
}

/* A plane's signs as bit masks: word q of channel c holds rows 64q..64q+63. Each
 * channel's raw bits are contiguous in the stream: its first coded row, then the rows
 * after its first flip (every row when the plane's signs are not coded). */
void
plane_signs(Dec *D, int coded, uint32_t nrows)
{
    const size_t C = D->lay->chans;
    const uint32_t *restrict f = D->fpos;
    uint64_t *restrict sw = D->sgw;
    const uint8_t *sign = D->sign;
    const size_t len = D->sign_len;
    size_t ks = D->ksign;
    if (nrows <= 56) {   /* one word per channel, one read */
        const uint64_t all = (1ull << nrows) - 1;
        if (!coded) {
            for (size_t c = 0; c < C; c++, ks += nrows) sw[c] = bits_at(sign, len, ks) & all;
            D->ksign = ks;
            return;
        }
        size_t c = D->vbmi ? plane_signs_vbmi(sw, f, sign, len, &ks, nrows, C)
                   : D->avx512 ? plane_signs_avx512(sw, f, sign, len, &ks, nrows, C) : 0;
        for (; c < C; c++) {
            /* branch-free: s0 and whether the channel flips at all are coin tosses */
            uint64_t v = bits_at(sign, len, ks), s0 = v & 1;
            uint32_t fc = f[c];   /* in [1, nrows]: decode_flips checked it */
            uint32_t nraw = nrows - fc - (fc < nrows);
            uint64_t raw = (v >> 1) & ((1ull << nraw) - 1);
            sw[c] = (((0 - s0) & ((1ull << fc) - 1)) | (s0 ^ 1) << fc | raw << fc << 1) & all;
            ks += 1 + nraw;
        }
        D->ksign = ks;
        return;
    }
    for (size_t c = 0; c < C; c++) {
        /* rows [0, fc) repeat the first sign, row fc inverts it, later rows are raw;
         * fc = 0 (signs not coded) makes every row raw. */
        uint32_t fc = coded ? f[c] : 0;
        uint64_t s0 = bits_at(sign, len, ks) & 1;
        ks += coded;
        for (uint32_t k0 = 0; k0 < nrows; k0 += 64) {
            uint32_t n = nrows - k0 < 64 ? nrows - k0 : 64, at = 0;
            uint64_t w = 0;
            if (coded && fc >= k0) {   /* fc == k0: the inverted row opens this block */
                at = fc - k0 < n ? fc - k0 : n;
                w = s0 ? (at == 64 ? ~0ull : (1ull << at) - 1) : 0;
                if (at < n) w |= (s0 ^ 1) << at++;
            }
            if (at < n) {
                w |= bits64_at(sign, len, ks, n - at) << at;
                ks += n - at;
            }
            sw[(size_t)(k0 >> 6) * C + c] = w;
        }
    }
    D->ksign = ks;
}

/* The row's fixed-width mid mantissa bits, as elements of width isz. */
static void
row_mids(Dec *D, void *out, int isz)
{
    const size_t C = D->lay->chans;
    const int w = D->pr.mid;
    const uint64_t mask = (1ull << w) - 1;
    uint32_t *restrict m32 = out;
    uint16_t *restrict m16 = out;
    uint8_t *restrict m8 = out;
    size_t k = D->kmid, c = 0;
    D->kmid += C;
    if (w == 0) {
        memset(out, 0, C * (size_t)isz);
        return;
    }
    if (D->simd && isz <= 2 && w <= 7) {
        c = unpack_mids_bmi2(out, isz, D->mid, D->mid_len, k * (size_t)w - D->mid0, w, C);
        k += c;
    }
    for (; c < C; c++, k++) {
        uint32_t v = (uint32_t)(bits_at(D->mid, D->mid_len, k * (size_t)w - D->mid0) & mask);
        if (isz == 2) m16[c] = (uint16_t)v;
        else if (isz == 1) m8[c] = (uint8_t)v;
        else m32[c] = v;
    }
}

/* out = sign | exponent | hi | mid for one row (lo bits zero), the sign being bit kbit of the
 * channel's sign mask; returns bit 0 when a residual exceeds its channel maximum, bit 1
 * when the row holds escapes (patched afterwards). The scalar loop; 16-bit rows have
 * an AVX2 version in codec_simd_rows.c. */
#define COMBINE_FN(NAME, T)                                                                 \
    static uint32_t                                                                         \
    NAME(T *restrict out, const uint8_t *restrict sym,                                      \
         const uint64_t *restrict sw, uint32_t kbit, const T *restrict cmax,                \
         const T *restrict mv, size_t C, const Layout *lay, const Params *pr)               \
    {                                                                                       \
        const uint32_t hi = (uint32_t)pr->hi, himask = (1u << pr->hi) - 1;                  \
        const uint32_t esc = (uint32_t)pr->esc, emask = (1u << lay->ebits) - 1;            \
        const uint32_t mbits = (uint32_t)lay->mbits, hshift = mbits - hi;                   \
        const uint32_t sshift = (uint32_t)lay->nbits - 1;                                   \
        const uint32_t midshift = (uint32_t)(pr->tz + pr->lo);                              \
        uint32_t bad = 0, any_esc = 0;                                                      \
        for (size_t c = 0; c < C; c++) {                                                    \
            uint32_t s = sym[c], r = s >> hi, sg = (uint32_t)(sw[c] >> kbit) & 1;           \
            bad |= (r > cmax[c]) & (s != esc);                                              \
            any_esc |= s == esc;                                                            \
            out[c] = (T)(sg << sshift | ((cmax[c] - r) & emask) << mbits                    \
                | (s & himask) << hshift | (uint32_t)mv[c] << midshift);                   \
        }                                                                                   \
        return bad | any_esc << 1;                                                          \
    }
COMBINE_FN(combine_8, uint8_t)
COMBINE_FN(combine_16, uint16_t)
COMBINE_FN(combine_32, uint32_t)
#undef COMBINE_FN

/* Escaped elements: their exponent and hi bits come from the escape stream. */
static void
patch_escapes(Dec *D, uint8_t *out, const uint8_t *sym)
{
    const Layout *lay = D->lay;
    const Params *pr = &D->pr;
    const int isz = lay->itemsize, hshift = lay->mbits - pr->hi;
    const uint32_t emask = (1u << lay->ebits) - 1, himask = (1u << pr->hi) - 1;
    const uint32_t keep = ~(emask << lay->mbits | himask << hshift);
    for (size_t c = 0; c < lay->chans; c++) {
        if (sym[c] != (uint32_t)pr->esc) continue;
        uint32_t e = br_get(&D->esc, lay->ebits), hv = br_get(&D->esc, pr->hi);
        uint32_t v = load_elem(out + c * isz, isz) & keep;
        store_elem(out + c * isz, isz, v | e << lay->mbits | hv << hshift);
    }
}

/* The mid section's exact length follows from the layout and the repeated rows (less
 * the tail the rANS states carry). The rows read it in place (unless copy is 0: the GPU
 * decoder's host side checks it only) until the last plane (mid_last_plane). */
int
load_mid(Dec *D, const uint8_t *section, size_t len, int copy)
{
    const Layout *lay = D->lay;
    size_t rows = 0, last = 0;
    for (size_t g = 0; g < lay->planes * lay->tokens; g++) rows += !D->dup[g];
    for (size_t t = 0; t < lay->tokens; t++) last += !D->dup[(lay->planes - 1) * lay->tokens + t];
    D->mid_bits = rows * lay->chans * (size_t)D->pr.mid;
    D->tail = tail_bits(last * lay->chans * (size_t)D->pr.mid);
    size_t from = D->mid_bits - D->tail;
    if (len != (from + 7) / 8) return ERR_STRUCTURE;
    if ((from & 7) && (section[from >> 3] >> (from & 7))) return ERR_STRUCTURE;   /* padding is zero */
    if (!copy) return 0;
    D->mid = D->mid_sec = section;
    D->mid_len = D->mid_sec_len = len;
    D->mid0 = 0;
    return 0;
}

/* Before the last plane's rows: its mid bits (from the byte its first coded element's
 * start in) into zero-padded scratch, where absorb_tail adds the tail the states carry,
 * and the rows read from there on (bit offsets less mid0). */
void
mid_last_plane(Dec *D)
{
    const size_t byte0 = D->kmid * (size_t)D->pr.mid >> 3;
    size_t n = D->mid_sec_len > byte0 ? D->mid_sec_len - byte0 : 0;
    size_t need = (D->mid_bits - 8 * byte0 + 7) / 8 + 16;   /* the rest of the bits, and 8-byte reads */
    if (need > D->mid_cap) need = D->mid_cap;
    if (n > need) n = need;
    memcpy(D->mid_buf, D->mid_sec + byte0, n);
    memset(D->mid_buf + n, 0, need - n);
    D->mid = D->mid_buf;
    D->mid_len = need;
    D->mid0 = 8 * byte0;
}

/* After the last symbol: each state is STATE_TOP plus 31 bits of the mid tail. The
 * lanes' bits follow each other from bit `from` of the mid bits on, where mid_buf holds
 * zeros (the section's padding is checked zero, mid_last_plane zero-fills past it): they
 * go through an accumulator, a 32-bit word at a time, after the section's bits of the
 * first byte (an 8-byte OR a lane read back the bytes the lane before had just written,
 * a store that could not forward). */
void
absorb_tail(Dec *D, const uint32_t *x)
{
    const size_t b = D->mid_bits - D->tail - D->mid0;
    uint8_t *q = D->mid_buf + (b >> 3);
    uint64_t acc = q[0] & ((1u << (b & 7)) - 1);
    int held = (int)(b & 7);
    for (int j = 0; j < LANES; j++) {
        if (x[j] < STATE_TOP) {
            D->err = ERR_STREAM;
            return;
        }
        uint32_t bits = x[j] - STATE_TOP;
        size_t lo = (size_t)j * TAIL_BITS_PER_LANE;
        size_t n = D->tail > lo ? D->tail - lo : 0;
        if (n > TAIL_BITS_PER_LANE) n = TAIL_BITS_PER_LANE;
        if (n < TAIL_BITS_PER_LANE && bits >> n) {
            D->err = ERR_STREAM;
            return;
        }
        acc |= (uint64_t)bits << held;   /* 0 past the tail */
        held += (int)n;
        if (held >= 32) {
            wr_u32(q, (uint32_t)acc);
            q += 4;
            acc >>= 32;
            held -= 32;
        }
    }
    for (; held > 0; held -= 8, acc >>= 8) *q++ = (uint8_t)acc;
}

/* A 16- or 8-bit row by assemble_16_avx512 or assemble_8_avx512 (whole chunks of 64
 * channels), the channels after the last chunk by the scalar combine; the row's mid
 * bits start byte aligned (k0 * mid is a multiple of 8 when C is). */
static uint32_t
assemble_fused(Dec *D, const uint8_t *sym, const uint64_t *sw, uint32_t k, size_t k0, uint8_t *out)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans;
    const int w = D->pr.mid;
    const uint64_t mask = (1ull << w) - 1;
    const uint8_t *mid = D->mid + (k0 * (size_t)w - D->mid0) / 8;
    uint32_t res = 0;
    const uint64_t *sg = D->sgr + (size_t)k * (C / 64);   /* the row's sign masks (sign_rows_avx512) */
    size_t c = lay->itemsize == 2
        ? assemble_16_avx512((uint16_t *)out, sym, sg, D->cmax16, mid, D->perm, D->shift, C, lay, &D->pr, &res)
        : assemble_8_avx512(out, sym, sg, D->cmax8, mid, D->perm, D->shift, C, lay, &D->pr, &res);
    if (c < C) {
        uint16_t *m16 = (uint16_t *)D->midv;
        uint8_t *m8 = (uint8_t *)D->midv;
        for (size_t j = c; j < C; j++) {
            uint64_t v = bits_at(D->mid, D->mid_len, (k0 + j) * (size_t)w - D->mid0) & mask;
            if (lay->itemsize == 2) m16[j] = (uint16_t)v;
            else m8[j] = (uint8_t)v;
        }
        res |= lay->itemsize == 2
            ? combine_16((uint16_t *)out + c, sym + c, sw + c, k & 63, D->cmax16 + c, m16 + c, C - c, lay, &D->pr)
            : combine_8(out + c, sym + c, sw + c, k & 63, D->cmax8 + c, m8 + c, C - c, lay, &D->pr);
    }
    D->kmid += C;
    return res;
}

/* A plane's coded rows at once where they are 16-bit and whole chunks of 64 channels
 * (assemble_16_rows_avx512), then each row's escapes and lo exceptions in order; returns
 * 0 where the plane does not qualify (its rows go one by one, assemble_row). The rows'
 * outputs are the plane's tokens that repeat no earlier row. */
int
assemble_rows(Dec *D, uint32_t nrows, size_t p, uint8_t *plane)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans, T = lay->tokens, rb = C * (size_t)lay->itemsize;
    if (!D->fused || lay->itemsize != 2 || C % 64) return 0;
    uint32_t k = 0;
    for (size_t t = 0; t < T; t++)
        if (!D->dup[p * T + t]) D->rowp[k++] = (uint16_t *)(plane + t * rb);
    const size_t k0 = D->kmid, w = (size_t)D->pr.mid;
    assemble_16_rows_avx512(D->rowp, nrows, D->sym, D->sgr, D->cmax16, D->mid + (k0 * w - D->mid0) / 8, D->perm,
                            D->shift, C, lay, &D->pr, D->rowres);
    for (k = 0; k < nrows; k++) {
        uint8_t *out = (uint8_t *)D->rowp[k];
        if (D->rowres[k] & 1) D->err = ERR_STREAM;
        if (D->rowres[k] & 2) patch_escapes(D, out, D->sym + (size_t)k * C);
        if (D->exc_left) apply_lo_exceptions(D, out, k0 + (size_t)k * C);
    }
    D->kmid += (size_t)nrows * C;
    return 1;
}

/* Row k (the plane's k-th coded row) from its symbols: mid bits, signs, exponents. */
void
assemble_row(Dec *D, const uint8_t *sym, uint32_t k, uint8_t *out)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans;
    uint32_t res;
    const uint64_t *sw = D->sgw + (size_t)(k >> 6) * C;
    size_t k0 = D->kmid;
    if (D->fused) {
        res = assemble_fused(D, sym, sw, k, k0, out);
    } else {
        row_mids(D, D->midv, lay->itemsize);
        if (lay->itemsize == 2 && D->simd)
            res = combine_16_avx2((uint16_t *)out, sym, sw, k & 63, D->cmax16, (uint16_t *)D->midv, C,
                                  lay, &D->pr);
        else if (lay->itemsize == 2)
            res = combine_16((uint16_t *)out, sym, sw, k & 63, D->cmax16, (uint16_t *)D->midv, C, lay, &D->pr);
        else if (lay->itemsize == 1)
            res = combine_8(out, sym, sw, k & 63, D->cmax8, (uint8_t *)D->midv, C, lay, &D->pr);
        else
            res = combine_32((uint32_t *)out, sym, sw, k & 63, D->cmax, D->midv, C, lay, &D->pr);
    }
    if (res & 1) D->err = ERR_STREAM;
    if (res & 2) patch_escapes(D, out, sym);
    if (D->exc_left) apply_lo_exceptions(D, out, k0);
}
