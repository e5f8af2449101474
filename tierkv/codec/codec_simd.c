/*
 * SIMD paths, chosen at run time (have_avx512, have_avx2); the scalar code in
 * codec_dec.c, codec_rows.c and codec_scan.c does the same everywhere else, byte for byte:
 * - AVX-512F: rANS symbols, sixteen lanes a vector and four vectors in flight (the 64
 *   lanes of a chunk), so that their dependency chains overlap. The slot -> symbol
 *   lookup is a binary search over the context's cumulative frequencies in registers
 *   (permutes, not gathers, which microcode mitigations make slow on some hosts), and
 *   renormalisation expands the next words of the stream into the lanes that need one.
 * - BMI2: the fixed-width mid mantissa fields spread into bytes or 16-bit lanes (pdep)
 *   when decoding, and gathered from the elements (pext) when encoding.
 * - AVX2: the row assembly for 16-bit elements (bf16, fp16), sixteen elements in
 *   16-bit lanes, which GCC's vectoriser does not manage (C's integer promotion widens
 *   every shift to 32 bits).
 */
#include "codec_core.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* -1: not asked yet. Threads racing here all store the same answer. */
static int avx2_state = -1, avx512_state = -1;
static int simd_allowed = 2;

/* 2: every path the CPU has; 1: AVX2 and BMI2 but not AVX-512; 0: scalar only. */
void
set_simd(int allowed)
{
    simd_allowed = allowed;
}

int
have_avx2(void)
{
    if (!simd_allowed) return 0;
    if (avx2_state < 0) {
        __builtin_cpu_init();
        avx2_state = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
    }
    return avx2_state;
}

int
have_avx512(void)
{
    if (simd_allowed < 2) return 0;
    if (avx512_state < 0) {
        __builtin_cpu_init();
        avx512_state = __builtin_cpu_supports("avx512f");
    }
    return avx512_state;
}

/* Entry t of a table of 32 (wide: 64) entries held in two (four) registers. */
__attribute__((target("avx512f"))) static inline __m512i
lookup(int wide, __m512i t, const __m512i *tab)
{
    __m512i lo = _mm512_permutex2var_epi32(tab[0], t, tab[1]);
    if (!wide) return lo;
    __m512i hi = _mm512_permutex2var_epi32(tab[2], t, tab[3]);
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(t, _mm512_set1_epi32(32)), lo, hi);
}

/* One step of sixteen lanes: symbol rank by binary search over the cumulative
 * frequencies, state update, renormalisation from the words at *p. */
__attribute__((target("avx512f"))) static inline __m512i
step16(int wide, int first, __m512i x, const uint8_t **p, const __m512i *cum, const __m512i *fr,
       __m512i smask, __m128i sh, __m512i *rank)
{
    __m512i slot = _mm512_and_si512(x, smask), k = _mm512_setzero_si512();
    for (int step = first; step; step >>= 1) {
        __m512i t = _mm512_add_epi32(k, _mm512_set1_epi32(step));
        k = _mm512_mask_mov_epi32(k, _mm512_cmple_epu32_mask(lookup(wide, t, cum), slot), t);
    }
    __m512i f = lookup(wide, k, fr), st = lookup(wide, k, cum);
    x = _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srl_epi32(x, sh)), _mm512_sub_epi32(slot, st));
    __mmask16 need = _mm512_cmplt_epu32_mask(x, _mm512_set1_epi32((int)RANS_L));
    __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)*p));
    *p += 2 * (size_t)__builtin_popcount((unsigned)need);
    *rank = k;
    return _mm512_mask_mov_epi32(x, need, _mm512_or_si512(_mm512_slli_epi32(x, 16),
                                                          _mm512_maskz_expand_epi32(need, words)));
}

__attribute__((target("avx512f"))) static inline size_t
decode_rows(int wide, int first, uint32_t *xs, const uint8_t **pp, const uint8_t *end, const int32_t *tabs,
            int pbits, uint8_t *out, size_t rows, size_t chans)
{
    __m512i cum[4], fr[4], id[4];
    for (int i = 0; i < 4; i++) {
        cum[i] = _mm512_loadu_si512(tabs + 16 * i);
        fr[i] = _mm512_loadu_si512(tabs + 64 + 16 * i);
        id[i] = _mm512_loadu_si512(tabs + 128 + 16 * i);
    }
    const __m512i smask = _mm512_set1_epi32((1 << pbits) - 1);
    const __m128i sh = _mm_cvtsi32_si128(pbits);
    const size_t chunks = chans / LANES, row_bytes = chunks * 2 * LANES + 2 * LANES;
    const uint8_t *p = *pp;
    __m512i x[LANES / 16], k[LANES / 16];
    for (int v = 0; v < LANES / 16; v++) x[v] = _mm512_loadu_si512(xs + 16 * v);
    size_t r = 0;
    for (; r < rows && (size_t)(end - p) >= row_bytes; r++) {
        for (size_t q = 0; q < chunks; q++, out += LANES) {
            /* LANES / 16 vectors, so that their searches overlap */
            for (int v = 0; v < LANES / 16; v++) x[v] = step16(wide, first, x[v], &p, cum, fr, smask, sh, &k[v]);
            for (int v = 0; v < LANES / 16; v++)
                _mm_storeu_si128((__m128i *)(out + 16 * v), _mm512_cvtepi32_epi8(lookup(wide, k[v], id)));
        }
    }
    for (int v = 0; v < LANES / 16; v++) _mm512_storeu_si512(xs + 16 * v, x[v]);
    *pp = p;
    return r;
}

/* Decodes rows x chans symbols of one context (chans % LANES == 0) into out, row after
 * row, each sixteen lanes a vector; stops before a row whose words might run past end.
 * Returns the rows decoded (0 when the context has more than 64
 * symbols: the caller goes scalar). */
__attribute__((target("avx512f"))) size_t
decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                   const uint16_t *start, int alpha, int pbits, uint8_t *out, size_t rows, size_t chans)
{
    int32_t tabs[192];   /* cumulative, frequency, symbol; by rank among present symbols */
    int np = 0;
    for (int i = 0; i < alpha; i++) {
        if (!freq[i]) continue;
        if (np == 64) return 0;
        tabs[np] = start[i];
        tabs[64 + np] = freq[i];
        tabs[128 + np++] = i;
    }
    for (int i = np; i < 64; i++) {   /* never <= a slot, so the search never lands here */
        tabs[i] = 1 << pbits;
        tabs[64 + i] = tabs[128 + i] = 0;
    }
    int first = 1;
    while (first * 2 < np) first *= 2;
    if (np > 32) return decode_rows(1, 32, xs, pp, end, tabs, pbits, out, rows, chans);
    return decode_rows(0, first, xs, pp, end, tabs, pbits, out, rows, chans);
}

/* Mid fields k.. (w <= 7 bits each) as bytes (isz 1) or 16-bit lanes (isz 2), eight per
 * 64-bit read, spread by pdep; returns how many it unpacked (whole groups of 8 that lie
 * inside the stream). */
__attribute__((target("bmi2"))) size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t k, int w, size_t C)
{
    const uint64_t lane8 = 0x0101010101010101ull * ((1u << w) - 1);
    const uint64_t lane16 = 0x0001000100010001ull * ((1u << w) - 1);
    uint8_t *o8 = out;
    uint16_t *o16 = out;
    size_t c = 0;
    for (; c + 8 <= C; c += 8, k += 8) {
        size_t off = k * (size_t)w, q = off >> 3;
        if (q + 8 > len) break;
        uint64_t v = rd_u64(mid + q) >> (off & 7);
        if (isz == 1) {
            uint64_t b = _pdep_u64(v, lane8);
            memcpy(o8 + c, &b, 8);
        } else {
            uint64_t a = _pdep_u64(v, lane16), b = _pdep_u64(v >> (4 * w), lane16);
            memcpy(o16 + c, &a, 8);
            memcpy(o16 + c + 4, &b, 8);
        }
    }
    return c;
}

/* Mid fields of a row of 8- or 16-bit elements (bits shift.. shift+w-1 of each, w <= 7)
 * packed into the bit writer eight at a time by pext; returns how many it packed. */
__attribute__((target("bmi2"))) size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    const uint64_t f = ((1ull << w) - 1) << shift;
    const uint64_t m8 = 0x0101010101010101ull * f, m16 = 0x0001000100010001ull * f;
    size_t c = 0;
    if (w > 7) return 0;
    for (; c + 8 <= C; c += 8) {
        if (isz == 1) {
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + c), m8), 4 * w);   /* 8w bits: two puts */
            bw_put(bw, (uint32_t)(_pext_u64(rd_u64(row + c), m8) >> (4 * w)), 4 * w);
        } else {
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + 2 * c), m16), 4 * w);
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + 2 * c + 8), m16), 4 * w);
        }
    }
    return c;
}

__attribute__((target("avx2"))) static inline __m256i
sign_lanes(const uint64_t *sw, __m128i kbit)
{
    const __m256i one = _mm256_set1_epi64x(1);
    __m256i a = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)sw), kbit), one);
    __m256i b = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 4)), kbit), one);
    __m256i c = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 8)), kbit), one);
    __m256i d = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 12)), kbit), one);
    /* 64-bit lanes hold 0 or 1; packing pairs of them (32 -> 16 bits) then the permute
     * [0 2 1 3] leaves a..b as eight 32-bit lanes in order; once more gives sixteen
     * 16-bit lanes in order */
    __m256i ab = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    __m256i cd = _mm256_permute4x64_epi64(_mm256_packus_epi32(c, d), 0xD8);
    __m256i abcd = _mm256_packus_epi32(ab, cd);
    return _mm256_permute4x64_epi64(abcd, 0xD8);
}

__attribute__((target("avx2"))) uint32_t
combine_16_avx2(uint16_t *out, const uint8_t *sym, const uint64_t *sw,
                uint32_t kbit, const uint16_t *cmax, const uint16_t *mv, size_t C,
                const Layout *lay, const Params *pr)
{
    const __m128i hi = _mm_cvtsi32_si128(pr->hi), kb = _mm_cvtsi32_si128((int)kbit);
    const __m128i mbits = _mm_cvtsi32_si128(lay->mbits), hshift = _mm_cvtsi32_si128(lay->mbits - pr->hi);
    const __m128i midshift = _mm_cvtsi32_si128(pr->tz + pr->lo);
    const __m128i sshift = _mm_cvtsi32_si128(lay->nbits - 1);
    const __m256i himask = _mm256_set1_epi16((short)((1 << pr->hi) - 1));
    const __m256i emask = _mm256_set1_epi16((short)((1 << lay->ebits) - 1));
    const __m256i esc = _mm256_set1_epi16((short)pr->esc);
    __m256i bad = _mm256_setzero_si256(), any_esc = _mm256_setzero_si256();
    size_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m256i s = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sym + c)));
        __m256i r = _mm256_srl_epi16(s, hi);
        __m256i cm = _mm256_loadu_si256((const __m256i *)(cmax + c));
        __m256i is_esc = _mm256_cmpeq_epi16(s, esc);
        bad = _mm256_or_si256(bad, _mm256_andnot_si256(is_esc, _mm256_cmpgt_epi16(r, cm)));
        any_esc = _mm256_or_si256(any_esc, is_esc);
        __m256i e = _mm256_sll_epi16(_mm256_and_si256(_mm256_sub_epi16(cm, r), emask), mbits);
        __m256i h = _mm256_sll_epi16(_mm256_and_si256(s, himask), hshift);
        __m256i m = _mm256_sll_epi16(_mm256_loadu_si256((const __m256i *)(mv + c)), midshift);
        __m256i g = _mm256_sll_epi16(sign_lanes(sw + c, kb), sshift);
        __m256i v = _mm256_or_si256(_mm256_or_si256(e, h), _mm256_or_si256(m, g));
        _mm256_storeu_si256((__m256i *)(out + c), v);
    }
    uint32_t res = (uint32_t)!_mm256_testz_si256(bad, bad) | (uint32_t)!_mm256_testz_si256(any_esc, any_esc) << 1;
    const uint32_t h = (uint32_t)pr->hi, hm = (1u << pr->hi) - 1, es = (uint32_t)pr->esc;
    const uint32_t em = (1u << lay->ebits) - 1, mb = (uint32_t)lay->mbits;
    for (; c < C; c++) {
        uint32_t s = sym[c], r = s >> h, g = (uint32_t)(sw[c] >> kbit) & 1;
        res |= (r > cmax[c]) & (s != es);
        res |= (uint32_t)(s == es) << 1;
        out[c] = (uint16_t)(g << (lay->nbits - 1) | ((cmax[c] - r) & em) << mb | (s & hm) << (mb - h)
            | (uint32_t)mv[c] << (pr->tz + pr->lo));
    }
    return res;
}

#else

void
set_simd(int allowed)
{
    (void)allowed;
}

int
have_avx2(void)
{
    return 0;
}

int
have_avx512(void)
{
    return 0;
}

size_t
decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                   const uint16_t *start, int alpha, int pbits, uint8_t *out, size_t rows, size_t chans)
{
    (void)xs; (void)pp; (void)end; (void)freq; (void)start; (void)alpha; (void)pbits; (void)out;
    (void)rows; (void)chans;
    return 0;
}

size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t k, int w, size_t C)
{
    (void)out; (void)isz; (void)mid; (void)len; (void)k; (void)w; (void)C;
    return 0;
}

size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    (void)bw; (void)row; (void)isz; (void)C; (void)shift; (void)w;
    return 0;
}

uint32_t
combine_16_avx2(uint16_t *out, const uint8_t *sym, const uint64_t *sw,
                uint32_t kbit, const uint16_t *cmax, const uint16_t *mv, size_t C,
                const Layout *lay, const Params *pr)
{
    (void)out; (void)sym; (void)sw; (void)kbit; (void)cmax; (void)mv; (void)C; (void)lay; (void)pr;
    return 1;   /* never called: have_avx2() is 0 */
}

#endif
