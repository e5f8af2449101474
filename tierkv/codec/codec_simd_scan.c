/*
 * The encoder's SIMD passes (codec_scan.c calls them): a plane of 16- or 8-bit
 * elements analysed in AVX-512 BW (channel maxima, first sign flips, symbols, low-bit
 * statistics), sign words sixteen channels a step, and the packing of mid fields
 * (BMI2, and AVX-512 VBMI for 16-bit elements).
 * The results are the scalar passes', exactly: every path writes the same blobs.
 */
#include "codec_simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* First sign flips of the plane's channels, sixteen a step (element width isz, a
 * constant where it is inlined): f[c] is the coded row where channel c's sign first
 * differs from row 0's (row 0 never repeats), nrows where it never does. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline void
first_flips(const Enc *E, size_t p, const uint8_t *plane, const int isz)
{
    const size_t C = E->lay->chans, T = E->lay->tokens;
    const uint8_t *dup = E->dup + p * T;
    const __m512i none = _mm512_set1_epi32((int)E->nrows[p]);
    uint32_t *f = E->fpos + p * C;
    for (size_t c = 0; c < C; c += 16) {
        const uint8_t *col = plane + c * isz;
        __m256i v0 = isz == 2 ? _mm256_loadu_si256((const __m256i *)col)
                              : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)col));
        __m512i fv = none;
        uint32_t k = 1;
        for (size_t t = 1; t < T; t++) {
            if (dup[t]) continue;
            const uint8_t *at = col + t * C * isz;
            __mmask16 diff = isz == 2
                ? _mm256_test_epi16_mask(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)at), v0),
                                         _mm256_set1_epi16((short)0x8000))
                : _mm_test_epi8_mask(_mm_xor_si128(_mm_loadu_si128((const __m128i *)at), _mm256_castsi256_si128(v0)),
                                     _mm_set1_epi8((char)0x80));
            fv = _mm512_mask_mov_epi32(fv, diff & _mm512_cmpeq_epi32_mask(fv, none), _mm512_set1_epi32((int)k));
            k++;
        }
        _mm512_storeu_si512(f + c, fv);
    }
}

/* A coded row's symbols into four histograms (a run of one symbol in one table would
 * wait on its own counts). */
static inline void
tally_row(uint32_t cm[4][256], const uint8_t *sym, size_t C)
{
    for (size_t c = 0; c < C; c += 4) {
        cm[0][sym[c]]++;
        cm[1][sym[c + 1]]++;
        cm[2][sym[c + 2]]++;
        cm[3][sym[c + 3]]++;
    }
}

/* counts[s] += how often s (< alpha <= 32) occurs among the symbols of the plane's coded
 * rows (C each, at sym; dup marks the repeated ones), COUNT_VALUES values a pass (their
 * counters and constants stay in registers): a byte counter per value and lane, a
 * compare and a masked add per value and 64 symbols, summed into counts before a
 * counter could pass 255. */
#define COUNT_VALUES 8
__attribute__((target("avx512f,avx512bw"))) static void
count_syms(const uint8_t *sym, const uint8_t *dup, size_t T, size_t C, int alpha, uint32_t *counts)
{
    const __m512i ones = _mm512_set1_epi8(1);
    for (int s0 = 0; s0 < alpha; s0 += COUNT_VALUES) {
        __m512i acc[COUNT_VALUES], val[COUNT_VALUES];
        for (int j = 0; j < COUNT_VALUES; j++) {
            acc[j] = _mm512_setzero_si512();
            val[j] = _mm512_set1_epi8((char)(s0 + j));
        }
        int adds = 0;
        for (size_t t = 0; t < T; t++) {
            if (dup[t]) continue;
            for (size_t c = 0; c < C; c += 64) {
                __mmask64 valid = C - c >= 64 ? ~0ull : (1ull << (C - c)) - 1;
                __m512i v = _mm512_maskz_loadu_epi8(valid, sym + t * C + c);
                for (int j = 0; j < COUNT_VALUES; j++)
                    acc[j] = _mm512_mask_add_epi8(acc[j], _mm512_mask_cmpeq_epi8_mask(valid, v, val[j]), acc[j], ones);
                if (++adds == 255) {
                    for (int j = 0; j < COUNT_VALUES && s0 + j < alpha; j++)
                        counts[s0 + j] += (uint32_t)_mm512_reduce_add_epi64(_mm512_sad_epu8(acc[j], _mm512_setzero_si512()));
                    for (int j = 0; j < COUNT_VALUES; j++) acc[j] = _mm512_setzero_si512();
                    adds = 0;
                }
            }
        }
        for (int j = 0; j < COUNT_VALUES && s0 + j < alpha; j++)
            counts[s0 + j] += (uint32_t)_mm512_reduce_add_epi64(_mm512_sad_epu8(acc[j], _mm512_setzero_si512()));
    }
}

/* cnt[v] += how many of the n bytes at b equal v, for every v < nvals (<= 64): a
 * compare and a population count per value and 64 bytes (counts that run along a plane's
 * channels: one value in most of them would make a histogram's increments wait on each
 * other). */
__attribute__((target("avx512f,avx512bw"))) static void
count_bytes(const uint8_t *b, size_t n, int nvals, uint32_t *cnt)
{
    for (size_t c = 0; c < n; c += 64) {
        __mmask64 valid = n - c >= 64 ? ~0ull : (1ull << (n - c)) - 1;
        __m512i v = _mm512_maskz_loadu_epi8(valid, b + c);
        for (int s = 0; s < nvals; s++)
            cnt[s] += (uint32_t)__builtin_popcountll(_mm512_mask_cmpeq_epi8_mask(valid, v, _mm512_set1_epi8((char)s)));
    }
}

/* codec_scan.c's plane_side (C % 32 == 0) where the channel maxima span at most 64
 * values; 0 elsewhere (the caller runs plane_side). The maxima's histogram counts
 * bytes (maximum - least, put where the side symbols go next), the side symbols are
 * made a vector at a time and their counts read off the histogram. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static int
side_avx512(Enc *E, size_t p, int kc)
{
    const size_t C = E->lay->chans;
    const uint16_t *cmax = E->cmax + p * C;
    uint8_t *side = E->side + p * C;
    __m512i mn = _mm512_set1_epi16(-1), mx = _mm512_setzero_si512();
    for (size_t c = 0; c < C; c += 32) {
        __m512i v = _mm512_loadu_si512(cmax + c);
        mn = _mm512_min_epu16(mn, v);
        mx = _mm512_max_epu16(mx, v);
    }
    uint32_t lo = _mm512_reduce_min_epu32(_mm512_min_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(mn)),
                                                            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(mn, 1))));
    uint32_t hi = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(mx)),
                                                            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(mx, 1))));
    if (C == 0 || hi - lo >= 64) return 0;
    const __m512i least = _mm512_set1_epi16((short)lo);
    for (size_t c = 0; c < C; c += 32)
        _mm256_storeu_si256((__m256i *)(side + c), _mm512_cvtepi16_epi8(_mm512_sub_epi16(_mm512_loadu_si512(cmax + c), least)));
    uint32_t hist[64] = {0};
    const int range = (int)(hi - lo) + 1;
    count_bytes(side, C, range, hist);
    int best = 0;   /* the most common maximum, the smallest of equals */
    for (int v = 1; v < range; v++)
        if (hist[v] > hist[best]) best = v;
    const int base = (int)lo + best;
    E->base[p] = (uint8_t)base;
    /* side symbol: maximum - base + 15, or the escape (31) outside 0..30 (below 0: the
     * 16-bit difference wraps above 31) */
    const __m512i off = _mm512_set1_epi16((short)(SIDE_CENTER - base)), esc = _mm512_set1_epi16(SIDE_ALPHA - 1);
    for (size_t c = 0; c < C; c += 32) {
        __m512i d = _mm512_min_epu16(_mm512_add_epi16(_mm512_loadu_si512(cmax + c), off), esc);
        _mm256_storeu_si256((__m256i *)(side + c), _mm512_cvtepi16_epi8(d));
    }
    uint32_t *counts = E->counts[CTX_SIDE(kc)], nesc = 0;
    for (int v = 0; v < range; v++) {
        int d = (int)lo + v - base + SIDE_CENTER;
        int sym = d >= 0 && d < SIDE_ALPHA - 1 ? d : SIDE_ALPHA - 1;
        counts[sym] += hist[v];
        nesc += sym == SIDE_ALPHA - 1 ? hist[v] : 0;
    }
    E->side_esc[p] = nesc != 0;
    return 1;
}

/* codec_scan.c's plane_flip_counts (C % 16 == 0) where the first-flip alphabet has at
 * most 64 symbols; 0 elsewhere. The symbols go to E->s0 as bytes and are counted there. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static int
flip_counts_avx512(Enc *E, size_t p, int kc)
{
    const Layout *lay = E->lay;
    const size_t C = lay->chans;
    if (lay->flip_alpha > 64) return 0;   /* no escapes either: those need over 256 tokens */
    const uint32_t *f = E->fpos + p * C;
    const __m512i n1 = _mm512_set1_epi32((int)E->nrows[p] - 1), one = _mm512_set1_epi32(1);
    __m512i raw = _mm512_setzero_si512();
    for (size_t c = 0; c < C; c += 16) {
        __m512i fv = _mm512_loadu_si512(f + c);
        _mm_storeu_si128((__m128i *)(E->s0 + c), _mm512_cvtepi32_epi8(_mm512_sub_epi32(fv, one)));
        /* the first coded row and, past the flip, the nrows - 1 - f rows after it */
        raw = _mm512_add_epi32(raw, _mm512_add_epi32(one, _mm512_max_epi32(_mm512_sub_epi32(n1, fv),
                                                                           _mm512_setzero_si512())));
    }
    E->flip_raw[kc] += (uint64_t)(uint32_t)_mm512_reduce_add_epi32(raw);
    uint32_t h[64] = {0};
    count_bytes(E->s0, C, lay->flip_alpha, h);
    for (int s2 = 0; s2 < lay->flip_alpha; s2++) E->counts[CTX_FLIP(kc)][s2] += h[s2];
    return 1;
}

/* codec_scan.c's plane_maxima, plane_flips and plane_symbols for 16-bit (isz 2, chans
 * % 32 == 0) or 8-bit (isz 1, chans % 64 == 0) elements, with the same results: the
 * channel maxima a vector of channels a step, the first flips sixteen a step, then per
 * coded row its symbols and low bits, the low-bit statistics by bit tests (how many
 * elements have their k low bits not all zero); the symbol histogram stays scalar. */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline void
analyse_plane_avx512(Enc *E, size_t p, int kc, const int isz)
{
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    const size_t C = lay->chans, T = lay->tokens, step = isz == 2 ? 32 : 64;
    const uint8_t *plane = E->src + p * T * C * isz;
    const uint8_t *dup = E->dup + p * T;
    const int hshift = lay->mbits - pr->hi;
    const __m512i emask = isz == 2 ? _mm512_set1_epi16((short)((1 << lay->ebits) - 1))
                                   : _mm512_set1_epi8((char)((1 << lay->ebits) - 1));
    const __m512i mmask = isz == 2 ? _mm512_set1_epi16((short)((1 << lay->mbits) - 1))
                                   : _mm512_set1_epi8((char)((1 << lay->mbits) - 1));
    const __m512i restmask = isz == 2 ? _mm512_set1_epi16((short)((1 << hshift) - 1))
                                      : _mm512_set1_epi8((char)((1 << hshift) - 1));
    const __m512i rmax = isz == 2 ? _mm512_set1_epi16((short)lay->rmax) : _mm512_set1_epi8((char)lay->rmax);
    const __m512i esc = isz == 2 ? _mm512_set1_epi16((short)pr->esc) : _mm512_set1_epi8((char)pr->esc);
    const __m128i mbits = _mm_cvtsi32_si128(lay->mbits), hi = _mm_cvtsi32_si128(pr->hi);
    const __m128i hs = _mm_cvtsi32_si128(hshift), tz = _mm_cvtsi32_si128(pr->tz);
    uint16_t *cmax = E->cmax + p * C;
    for (size_t c = 0; c < C; c += step) {
        __m512i acc = _mm512_setzero_si512();
        for (size_t t = 0; t < T; t++) {
            if (dup[t]) continue;
            __m512i v = _mm512_loadu_si512(plane + (t * C + c) * isz);
            acc = isz == 2 ? _mm512_max_epu16(acc, _mm512_and_si512(_mm512_srl_epi16(v, mbits), emask))
                           : _mm512_max_epu8(acc, _mm512_and_si512(srl8(v, lay->mbits), emask));
        }
        if (isz == 2) {
            _mm512_storeu_si512(cmax + c, acc);
        } else {
            _mm512_storeu_si512(cmax + c, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(acc)));
            _mm512_storeu_si512(cmax + c + 32, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(acc, 1)));
        }
    }
    if (!side_avx512(E, p, kc)) plane_side(E, p, kc);
    first_flips(E, p, plane, isz);
    if (!flip_counts_avx512(E, p, kc)) plane_flip_counts(E, p, kc);

    __m512i kmask[MAX_LO + 1];
    for (int k = 1; k <= MAX_LO; k++)
        kmask[k] = isz == 2 ? _mm512_set1_epi16((short)((1 << k) - 1)) : _mm512_set1_epi8((char)((1 << k) - 1));
    uint64_t nonzero[MAX_LO + 1] = {0};
    uint32_t cm[4][256];
    const int by_value = pr->main_alpha <= 32;   /* count_syms after the rows, else tally_row */
    if (!by_value) memset(cm, 0, sizeof(cm));
    for (size_t t = 0; t < T; t++) {
        if (dup[t]) continue;
        const uint8_t *row = plane + t * C * isz;
        uint8_t *sym = E->sym + (p * T + t) * C, *lov = E->lov + (p * T + t) * C;
        uint64_t coded = ~0ull;   /* AND of the rows' masks of symbols that do not escape */
        for (size_t c = 0; c < C; c += step) {
            __m512i v = _mm512_loadu_si512(row + c * isz), m = _mm512_and_si512(v, mmask);
            if (isz == 2) {
                __m512i e = _mm512_and_si512(_mm512_srl_epi16(v, mbits), emask);
                __m512i r = _mm512_sub_epi16(_mm512_loadu_si512(cmax + c), e);
                __m512i code = _mm512_or_si512(_mm512_sll_epi16(r, hi), _mm512_srl_epi16(m, hs));
                __mmask32 kept = _mm512_cmplt_epu16_mask(r, rmax);
                coded &= 0xFFFFFFFF00000000ull | kept;
                __m512i sv = _mm512_mask_mov_epi16(esc, kept, code);
                _mm256_storeu_si256((__m256i *)(sym + c), _mm512_cvtepi16_epi8(sv));
                __m512i lo = _mm512_and_si512(_mm512_srl_epi16(_mm512_and_si512(m, restmask), tz),
                                              _mm512_set1_epi16(0xFF));
                _mm256_storeu_si256((__m256i *)(lov + c), _mm512_cvtepi16_epi8(lo));
                for (int k = 1; k <= MAX_LO; k++)
                    nonzero[k] += (uint64_t)__builtin_popcount(_mm512_test_epi16_mask(lo, kmask[k]));
            } else {
                __m512i cm8 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_loadu_si512(cmax + c))),
                                                 _mm512_cvtepi16_epi8(_mm512_loadu_si512(cmax + c + 32)), 1);
                __m512i r = _mm512_sub_epi8(cm8, _mm512_and_si512(srl8(v, lay->mbits), emask));
                __m512i code = _mm512_or_si512(sll8(r, pr->hi), srl8(m, hshift));
                __mmask64 kept = _mm512_cmplt_epu8_mask(r, rmax);
                coded &= kept;
                _mm512_storeu_si512(sym + c, _mm512_mask_mov_epi8(esc, kept, code));
                __m512i lo = srl8(_mm512_and_si512(m, restmask), pr->tz);
                _mm512_storeu_si512(lov + c, lo);
                for (int k = 1; k <= MAX_LO; k++)
                    nonzero[k] += (uint64_t)__builtin_popcountll(_mm512_test_epi8_mask(lo, kmask[k]));
            }
        }
        E->resc[p * T + t] = coded != ~0ull;
        if (!by_value) tally_row(cm, sym, C);
        E->coded_elems += C;
        E->elems_kc[kc] += C;
    }
    if (by_value)
        count_syms(E->sym + p * T * C, dup, T, C, pr->main_alpha, E->counts[CTX_MAIN(kc)]);
    else
        for (int i = 0; i < 256; i++) E->counts[CTX_MAIN(kc)][i] += cm[0][i] + cm[1][i] + cm[2][i] + cm[3][i];
    for (int k = 1; k <= MAX_LO; k++) E->lo_nonzero[k] += nonzero[k];
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void
analyse_plane_16_avx512(Enc *E, size_t p, int kc)
{
    analyse_plane_avx512(E, p, kc, 2);
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) void
analyse_plane_8_avx512(Enc *E, size_t p, int kc)
{
    analyse_plane_avx512(E, p, kc, 1);
}

/* wq[c] |= (sign of row[c]) << shift for 16-bit elements, sixteen channels a step;
 * returns how many channels it did (a multiple of 16). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) size_t
or_signs_16_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    const __m128i sh = _mm_cvtsi32_si128((int)shift);
    size_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512i sg = _mm512_cvtepu16_epi32(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(row + 2 * c)), 15));
        __m512i w = _mm512_loadu_si512(wq + c);
        _mm512_storeu_si512(wq + c, _mm512_or_si512(w, _mm512_sll_epi32(sg, sh)));
    }
    return c;
}

/* The same for 8-bit elements. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) size_t
or_signs_8_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    const __m128i sh = _mm_cvtsi32_si128((int)shift);
    size_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512i sg = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + c))), 7);
        __m512i w = _mm512_loadu_si512(wq + c);
        _mm512_storeu_si512(wq + c, _mm512_or_si512(w, _mm512_sll_epi32(sg, sh)));
    }
    return c;
}

/* Byte permutes of pack_mids_64_avx512: the low bytes of two vectors' 16-bit lanes, and per
 * width w the w low bytes of each 64-bit lane, lined up. */
static const uint8_t MID_EVEN[64] = {
    0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
    32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
    64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94,
    96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
static const uint8_t MID_GATHER[8][64] = {
    {
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 8, 16, 24, 32, 40, 48, 56, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49, 56, 57, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 2, 8, 9, 10, 16, 17, 18, 24, 25, 26, 32, 33, 34, 40, 41, 42, 48, 49, 50, 56, 57, 58, 0, 0, 0, 0, 0, 0, 0, 0,
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27, 32, 33, 34, 35, 40, 41, 42, 43, 48, 49, 50, 51, 56, 57, 58, 59,
     0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 16, 17, 18, 19, 20, 24, 25, 26, 27, 28, 32, 33, 34, 35, 36, 40, 41, 42, 43, 44, 48, 49,
     50, 51, 52, 56, 57, 58, 59, 60, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 16, 17, 18, 19, 20, 21, 24, 25, 26, 27, 28, 29, 32, 33, 34, 35, 36, 37, 40, 41,
     42, 43, 44, 45, 48, 49, 50, 51, 52, 53, 56, 57, 58, 59, 60, 61, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {
     0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 24, 25, 26, 27, 28, 29, 30, 32, 33, 34, 35,
     36, 37, 38, 40, 41, 42, 43, 44, 45, 46, 48, 49, 50, 51, 52, 53, 54, 56, 57, 58, 59, 60, 61, 62, 0, 0, 0, 0, 0, 0, 0, 0}};

/* The mid fields (bits shift.. shift+w-1, w <= 7) of groups of 64 16-bit elements packed
 * into 8w bytes each at dst, as bw_put would lay them out: the fields' low bytes
 * gathered from two vectors, then neighbours merged by a shift and a bit select, bytes
 * into 16-bit lanes of 2w bits, those into 32-bit lanes of 4w bits and into 64-bit
 * lanes of 8w bits (w bytes each), whose w low bytes a byte permute lines up. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) static void
pack_mids_64_avx512(uint8_t *dst, const uint8_t *row, size_t groups, int shift, int w)
{
    const __m512i even = _mm512_loadu_si512(MID_EVEN), gather = _mm512_loadu_si512(MID_GATHER[w]);
    const __m512i field = _mm512_set1_epi8((char)((1 << w) - 1));
    const __m512i keep1 = _mm512_set1_epi16((short)((1 << w) - 1)), keep2 = _mm512_set1_epi32((1 << 2 * w) - 1);
    const __m512i keep3 = _mm512_set1_epi64((long long)((1ull << 4 * w) - 1));
    const __m128i sh = _mm_cvtsi32_si128(shift);
    const __mmask64 bytes = (1ull << 8 * w) - 1;   /* w <= 7 */
    for (size_t g = 0; g < groups; g++, row += 128, dst += 8 * w) {
        __m512i a = _mm512_srl_epi16(_mm512_loadu_si512(row), sh), b = _mm512_srl_epi16(_mm512_loadu_si512(row + 64), sh);
        __m512i x = _mm512_and_si512(_mm512_permutex2var_epi8(a, even, b), field);
        /* lane = lo | hi << k: lo's k bits kept, the rest from the lane shifted right by
         * (half the lane's width - k), which brings hi down to bit k (0xCA: bit select) */
        x = _mm512_ternarylogic_epi32(keep1, x, _mm512_srli_epi16(x, 8 - w), 0xCA);
        x = _mm512_ternarylogic_epi32(keep2, x, _mm512_srli_epi32(x, 16 - 2 * w), 0xCA);
        x = _mm512_ternarylogic_epi64(keep3, x, _mm512_srli_epi64(x, 32 - 4 * w), 0xCA);
        _mm512_mask_storeu_epi8(dst, bytes, _mm512_permutexvar_epi8(gather, x));
    }
}

/* Mid fields of a row of 8- or 16-bit elements (bits shift.. shift+w-1 of each) packed
 * into the bit writer by pext, eight at a time where w <= 7, two at a time for 16-bit
 * elements where w <= 16; returns how many it packed. Where
 * the writer is at a byte boundary (rows of a multiple of 8 channels keep it there),
 * eight fields are w whole bytes, stored straight into the stream, and with AVX-512
 * VBMI 16-bit elements go sixty-four at a time (pack_mids_64_avx512) first. */
__attribute__((target("bmi2"))) size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    const uint64_t f = ((1ull << w) - 1) << shift;
    const uint64_t m8 = 0x0101010101010101ull * f, m16 = 0x0001000100010001ull * f;
    size_t c = 0;
    if (w > 7) {   /* 16-bit elements' wider fields (FP16: 9 bits): two a put */
        if (isz != 2 || w > 16) return 0;
        const uint64_t m32 = f | f << 16;
        for (; c + 2 <= C; c += 2) bw_put(bw, (uint32_t)_pext_u64(rd_u32(row + 2 * c), m32), 2 * w);
        return c;
    }
    if ((bw->n & 7) == 0 && !bw->overflow) {
        for (; bw->n > 0; bw->n -= 8, bw->acc >>= 8) {   /* the pending whole bytes first */
            if (bw->p >= bw->end) return 0;   /* nothing packed yet: the caller's bw_put reports it */
            *bw->p++ = (uint8_t)bw->acc;
        }
        bw->acc = 0;
        if (isz == 2 && C >= 64 && have_avx512_vbmi()) {   /* sixty-four fields a step */
            size_t room = (size_t)(bw->end - bw->p) / (size_t)(8 * w), groups = C / 64 < room ? C / 64 : room;
            pack_mids_64_avx512(bw->p, row, groups, shift, w);
            bw->p += groups * 8 * (size_t)w;
            c = groups * 64;
        }
        for (; c + 8 <= C && bw->end - bw->p >= 8; c += 8, bw->p += w) {
            uint64_t v = isz == 1 ? _pext_u64(rd_u64(row + c), m8)
                                  : _pext_u64(rd_u64(row + 2 * c), m16)
                                        | _pext_u64(rd_u64(row + 2 * c + 8), m16) << (4 * w);
            wr_u64(bw->p, v);   /* 8w <= 56 bits; the bytes above them are the next group's */
        }
    }
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

#else

void
analyse_plane_16_avx512(Enc *E, size_t p, int kc)
{
    (void)E; (void)p; (void)kc;
}

size_t
or_signs_16_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    (void)wq; (void)row; (void)C; (void)shift;
    return 0;
}

size_t
or_signs_8_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    (void)wq; (void)row; (void)C; (void)shift;
    return 0;
}

void
analyse_plane_8_avx512(Enc *E, size_t p, int kc)
{
    (void)E; (void)p; (void)kc;
}

size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    (void)bw; (void)row; (void)isz; (void)C; (void)shift; (void)w;
    return 0;
}

#endif
