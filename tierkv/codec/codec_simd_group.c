/*
 * AVX-512 rANS symbols of up to MAX_GROUP pages at once (codec_planes.c's
 * decode_planes_group): each page's 64 lanes as four vectors of sixteen, four state
 * vectors a page in flight (a page's lanes are one chain of dependent steps: several
 * pages' chains overlap), the search over the cumulative frequencies in 16-bit lanes.
 * Measured on Zen 4 against one page at a time (codec_simd_rans.c, three gathers and a
 * search): see docs/benchmarks.md "Pages decoded together".
 *
 * Built twice: here for AVX-512 F and BW (decode_symsN_avx512, group_kernel), and by
 * codec_simd_group_vbmi2.c with GROUP_VBMI2 set for CPUs that also have VBMI2
 * (decode_symsN_vbmi2, group_kernel16: the states kept as 16-bit halves, their update
 * and renormalisation in 16-bit lanes too).
 */
#include "codec_simd.h"

#ifndef GROUP_VBMI2
#define GROUP_VBMI2 0
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#if GROUP_VBMI2
#define GROUP_TARGET "avx512f,avx512bw,avx512vbmi2"
#define GROUP_ENTRY decode_symsN_vbmi2
#else
#define GROUP_TARGET "avx512f,avx512bw"
#define GROUP_ENTRY decode_symsN_avx512
#endif

/* Entry t (16-bit lanes) of a table of 32 (wide: 64) 16-bit entries in one (two)
 * registers. */
__attribute__((target(GROUP_TARGET), always_inline)) static inline __m512i
lookup16(const int wide, __m512i t, const __m512i *tab)
{
    return wide ? _mm512_permutex2var_epi16(tab[0], t, tab[1]) : _mm512_permutexvar_epi16(t, tab[0]);
}

/* The G pages' search tables (tabs[g]: cumulative frequency, frequency and symbol by
 * rank, 64 words each) into one register of 32 words each (two where `wide`). */
__attribute__((target(GROUP_TARGET), always_inline)) static inline void
load_tables16(const int G, const int wide, const uint16_t *const tabs[], __m512i cum[][2], __m512i fr[][2],
              __m512i id[][2])
{
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 1 + wide; i++) {
            cum[g][i] = _mm512_loadu_si512(tabs[g] + 32 * i);
            fr[g][i] = _mm512_loadu_si512(tabs[g] + 64 + 32 * i);
            id[g][i] = _mm512_loadu_si512(tabs[g] + 128 + 32 * i);
        }
}

/* Each lane's rank k16: the last whose cumulative frequency is at most the lane's slot
 * s16, by halving steps from `first` (the pages' vectors step by step together, so that
 * their chains overlap). */
__attribute__((target(GROUP_TARGET), always_inline)) static inline void
search16(const int G, const int wide, const int first, __m512i cum[][2], __m512i s16[][2], __m512i k16[][2])
{
    for (int g = 0; g < G; g++)
        for (int q = 0; q < 2; q++) k16[g][q] = _mm512_setzero_si512();
    for (int step = first; step; step >>= 1)
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++) {
                __m512i t = _mm512_add_epi16(k16[g][q], _mm512_set1_epi16((short)step));
                __mmask32 le = _mm512_cmple_epu16_mask(lookup16(wide, t, cum[g]), s16[g][q]);
                k16[g][q] = _mm512_mask_mov_epi16(k16[g][q], le, t);
            }
}

#if !GROUP_VBMI2
/* G pages' symbols at once (2 to MAX_GROUP), each page's 64 lanes as four vectors of
 * sixteen: 4G independent state vectors in flight where one page has four, so the
 * chains of one step (search, multiply, renormalisation) overlap G times as much. The
 * search runs in 16-bit lanes: the slots of two state vectors (below 2^pbits <= 2^15)
 * narrowed into one vector of 32 words and searched over the cumulative frequencies as
 * words, each round's add, permute, compare and move serving 32 lanes; the symbol's
 * frequency and the slot's offset in it are widened back for the state's update. Tables
 * (tabs[g]: cumulative frequency, frequency, symbol by rank, 64 words each) and streams
 * are the pages' own; G, `wide` and `first` are constants of each instantiation (the
 * largest of the pages' searches; a smaller table's padding never matches). Stops
 * before a chunk whose words might run past any stream's end. */
__attribute__((target(GROUP_TARGET), always_inline)) static inline size_t
group_kernel(const int G, const int wide, const int first, uint32_t *const xs[], const uint8_t **const pp[],
             const uint8_t *const end[], const uint16_t *const tabs[], const int pbits[], uint8_t *const out[],
             size_t nsyms)
{
    __m512i cum[MAX_GROUP][2], fr[MAX_GROUP][2], id[MAX_GROUP][2], smask[MAX_GROUP], x[MAX_GROUP][4];
    __m128i sh[MAX_GROUP];
    const uint8_t *p[MAX_GROUP];
    load_tables16(G, wide, tabs, cum, fr, id);
    for (int g = 0; g < G; g++) {
        smask[g] = _mm512_set1_epi16((short)((1 << pbits[g]) - 1));
        sh[g] = _mm_cvtsi32_si128(pbits[g]);
        p[g] = *pp[g];
        for (int v = 0; v < 4; v++) x[g][v] = _mm512_loadu_si512(xs[g] + 16 * v);
    }
    const __m512i lim = _mm512_set1_epi32((int)RANS_L);
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    size_t r = 0;
    for (; r + LANES <= nsyms; r += LANES) {
        int room = 1;
        for (int g = 0; g < G; g++) room &= (size_t)(end[g] - p[g]) >= 2 * LANES;
        if (!room) break;
        __m512i s16[MAX_GROUP][2], k16[MAX_GROUP][2];
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++)   /* the low words of two state vectors' lanes, masked to slots */
                s16[g][q] = _mm512_and_si512(_mm512_permutex2var_epi16(x[g][2 * q], even, x[g][2 * q + 1]), smask[g]);
        search16(G, wide, first, cum, s16, k16);
        __mmask16 need[MAX_GROUP][4];
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++) {
                __m512i f = lookup16(wide, k16[g][q], fr[g]);
                __m512i bias = _mm512_sub_epi16(s16[g][q], lookup16(wide, k16[g][q], cum[g]));
                _mm256_storeu_si256((__m256i *)(out[g] + r + 32 * q),
                                    _mm512_cvtepi16_epi8(lookup16(wide, k16[g][q], id[g])));
                for (int h = 0; h < 2; h++) {
                    const int v = 2 * q + h;
                    __m512i fv = _mm512_cvtepu16_epi32(h ? _mm512_extracti64x4_epi64(f, 1) : _mm512_castsi512_si256(f));
                    __m512i bv = _mm512_cvtepu16_epi32(h ? _mm512_extracti64x4_epi64(bias, 1)
                                                         : _mm512_castsi512_si256(bias));
                    x[g][v] = _mm512_add_epi32(_mm512_mullo_epi32(fv, _mm512_srl_epi32(x[g][v], sh[g])), bv);
                    need[g][v] = _mm512_cmplt_epu32_mask(x[g][v], lim);
                }
            }
        for (int g = 0; g < G; g++)
            for (int v = 0; v < 4; v++) {
                const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p[g]));
                x[g][v] = _mm512_mask_mov_epi32(x[g][v], need[g][v],
                                                _mm512_or_si512(_mm512_slli_epi32(x[g][v], 16),
                                                                _mm512_maskz_expand_epi32(need[g][v], words)));
                p[g] += 2 * (size_t)__builtin_popcount((unsigned)need[g][v]);
            }
    }
    for (int g = 0; g < G; g++) {
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(xs[g] + 16 * v, x[g][v]);
        *pp[g] = p[g];
    }
    return r;
}

#endif

#if GROUP_VBMI2
/* group_kernel with each page's states held as 16-bit halves (VBMI2): lanes 32q..32q+31
 * as a vector of low words L[q] and one of high words H[q], so that the slots are L's
 * low bits (no narrowing), the search runs on them (search16), and the update stays in
 * 16-bit lanes: y = x >> pbits is a funnel shift of H:L (its low word) and H >> pbits
 * (its high one, below 2^(16 - pbits)); f y + bias is f y_lo's two product halves, f
 * y_hi (below 2^16, as f y < 2^32) and the bias added with its carry. A state below
 * 2^16 is one whose H is zero: H takes L and L the lane's next word, expanded in lane
 * order. Same symbols, states and stream positions as group_kernel, two state vectors a
 * page instead of four, about 38 vector ops a vector of 32 lanes where group_kernel takes
 * about 50. */
__attribute__((target(GROUP_TARGET), always_inline)) static inline size_t
group_kernel16(const int G, const int wide, const int first, uint32_t *const xs[], const uint8_t **const pp[],
               const uint8_t *const end[], const uint16_t *const tabs[], const int pbits[], uint8_t *const out[],
               size_t nsyms)
{
    __m512i cum[MAX_GROUP][2], fr[MAX_GROUP][2], id[MAX_GROUP][2], smask[MAX_GROUP], vsh[MAX_GROUP];
    __m512i L[MAX_GROUP][2], H[MAX_GROUP][2];
    __m128i sh[MAX_GROUP];
    const uint8_t *p[MAX_GROUP];
    const __m512i even = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32,
                                          30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi16(even, _mm512_set1_epi16(1)), one = _mm512_set1_epi16(1);
    load_tables16(G, wide, tabs, cum, fr, id);
    for (int g = 0; g < G; g++) {
        smask[g] = _mm512_set1_epi16((short)((1 << pbits[g]) - 1));
        vsh[g] = _mm512_set1_epi16((short)pbits[g]);
        sh[g] = _mm_cvtsi32_si128(pbits[g]);
        p[g] = *pp[g];
        for (int q = 0; q < 2; q++) {
            const __m512i a = _mm512_loadu_si512(xs[g] + 32 * q), b = _mm512_loadu_si512(xs[g] + 32 * q + 16);
            L[g][q] = _mm512_permutex2var_epi16(a, even, b);
            H[g][q] = _mm512_permutex2var_epi16(a, odd, b);
        }
    }
    size_t r = 0;
    for (; r + LANES <= nsyms; r += LANES) {
        int room = 1;
        for (int g = 0; g < G; g++) room &= (size_t)(end[g] - p[g]) >= 2 * LANES;
        if (!room) break;
        __m512i s16[MAX_GROUP][2], k16[MAX_GROUP][2];
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++) s16[g][q] = _mm512_and_si512(L[g][q], smask[g]);
        search16(G, wide, first, cum, s16, k16);
        __mmask32 need[MAX_GROUP][2];
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++) {
                const __m512i f = lookup16(wide, k16[g][q], fr[g]);
                const __m512i bias = _mm512_sub_epi16(s16[g][q], lookup16(wide, k16[g][q], cum[g]));
                _mm256_storeu_si256((__m256i *)(out[g] + r + 32 * q),
                                    _mm512_cvtepi16_epi8(lookup16(wide, k16[g][q], id[g])));
                const __m512i ylo = _mm512_shrdv_epi16(L[g][q], H[g][q], vsh[g]);
                const __m512i fyhi = _mm512_mullo_epi16(f, _mm512_srl_epi16(H[g][q], sh[g]));
                const __m512i lo = _mm512_add_epi16(_mm512_mullo_epi16(f, ylo), bias);
                __m512i hi = _mm512_add_epi16(_mm512_mulhi_epu16(f, ylo), fyhi);
                hi = _mm512_mask_add_epi16(hi, _mm512_cmplt_epu16_mask(lo, bias), hi, one);   /* the carry */
                need[g][q] = _mm512_cmpeq_epi16_mask(hi, _mm512_setzero_si512());
                H[g][q] = _mm512_mask_mov_epi16(hi, need[g][q], lo);
                L[g][q] = lo;
            }
        for (int g = 0; g < G; g++)
            for (int q = 0; q < 2; q++) {
                L[g][q] = _mm512_mask_expand_epi16(L[g][q], need[g][q], _mm512_loadu_si512(p[g]));
                p[g] += 2 * (size_t)__builtin_popcount((unsigned)need[g][q]);
            }
    }
    const __m512i inter = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i inter2 = _mm512_add_epi16(inter, _mm512_set1_epi16(16));
    for (int g = 0; g < G; g++) {
        for (int q = 0; q < 2; q++) {   /* the words back into 32-bit states */
            _mm512_storeu_si512(xs[g] + 32 * q, _mm512_permutex2var_epi16(L[g][q], inter, H[g][q]));
            _mm512_storeu_si512(xs[g] + 32 * q + 16, _mm512_permutex2var_epi16(L[g][q], inter2, H[g][q]));
        }
        *pp[g] = p[g];
    }
    return r;
}

#define GROUP_KERNEL group_kernel16
#else
#define GROUP_KERNEL group_kernel
#endif

#define TK_GROUPS(G, NP, ...)                                                     \
    ((NP) > 32 ? GROUP_KERNEL(G, 1, 32, __VA_ARGS__)                              \
     : (NP) > 16 ? GROUP_KERNEL(G, 0, 16, __VA_ARGS__)                            \
     : (NP) > 8 ? GROUP_KERNEL(G, 0, 8, __VA_ARGS__)                              \
     : (NP) > 4 ? GROUP_KERNEL(G, 0, 4, __VA_ARGS__)                              \
     : (NP) > 2 ? GROUP_KERNEL(G, 0, 2, __VA_ARGS__) : GROUP_KERNEL(G, 0, 1, __VA_ARGS__))

/* The next nsyms symbols of one context in each of G pages (2 to MAX_GROUP; page g's
 * lane j decodes its symbols j, j + 64, ... into out[g]) by group_kernel, from each
 * context's search_tables16 (np[g] present symbols, at most 64); stops before a chunk
 * whose words might run past any page's end. Returns the symbols decoded in each page,
 * a multiple of 64. */
__attribute__((target(GROUP_TARGET))) size_t
GROUP_ENTRY(int G, uint32_t *const xs[], const uint8_t **const pp[], const uint8_t *const end[],
                    const uint16_t *const tabs[], const int np[], const int pbits[], uint8_t *const out[],
                    size_t nsyms)
{
    int most = 0;
    for (int g = 0; g < G; g++) most = np[g] > most ? np[g] : most;
#if GROUP_VBMI2
    if (G == 1) return TK_GROUPS(1, most, xs, pp, end, tabs, pbits, out, nsyms);
#endif
    if (G == 2) return TK_GROUPS(2, most, xs, pp, end, tabs, pbits, out, nsyms);
    if (G == 3) return TK_GROUPS(3, most, xs, pp, end, tabs, pbits, out, nsyms);
    return TK_GROUPS(4, most, xs, pp, end, tabs, pbits, out, nsyms);
}

#if !GROUP_VBMI2

/* decode_symsN_avx512's tables of a context: the present symbols' cumulative
 * frequencies, frequencies and symbols as 16-bit words, 64 entries each (ranks past the
 * present symbols hold 2^pbits, never <= a slot); returns the present symbols, 65 where
 * there are more than 64 or the slots do not fit 15 bits. Sixteen symbols a step,
 * compressed to the present ones. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) int
search_tables16(const uint16_t *freq, const uint16_t *start, int alpha, int pbits, uint16_t *tabs)
{
    if (pbits > 15) return 65;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int np = 0;
    for (int i = 0; i < alpha; i += 16) {
        const __mmask16 m = alpha - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (alpha - i)) - 1);
        const __m512i f = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, freq + i));
        const __mmask16 present = _mm512_mask_test_epi32_mask(m, f, f);
        const int k = __builtin_popcount((unsigned)present);
        if (np + k > 64) return 65;
        const __mmask16 put = (__mmask16)((1u << k) - 1);
        const __m512i st = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, start + i));
        _mm256_mask_storeu_epi16(tabs + np, put, _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(present, st)));
        _mm256_mask_storeu_epi16(tabs + 64 + np, put, _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(present, f)));
        _mm256_mask_storeu_epi16(tabs + 128 + np, put,
                                 _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(
                                     present, _mm512_add_epi32(lane, _mm512_set1_epi32(i)))));
        np += k;
    }
    /* the ranks past the present symbols (no shift by 32: np may be 32 or 64) */
    const __mmask32 pad_lo = np >= 32 ? 0 : ~(__mmask32)0 << np;
    const __mmask32 pad_hi = np >= 64 ? 0 : np >= 32 ? ~(__mmask32)0 << (np - 32) : ~(__mmask32)0;
    const __m512i top = _mm512_set1_epi16((short)(1u << pbits)), zero = _mm512_setzero_si512();
    for (int t = 0; t < 3; t++) {
        _mm512_mask_storeu_epi16(tabs + 64 * t, pad_lo, t ? zero : top);
        _mm512_mask_storeu_epi16(tabs + 64 * t + 32, pad_hi, t ? zero : top);
    }
    return np;
}

#endif   /* !GROUP_VBMI2 */

#else

#if !GROUP_VBMI2
size_t
decode_symsN_avx512(int G, uint32_t *const xs[], const uint8_t **const pp[], const uint8_t *const end[],
                    const uint16_t *const tabs[], const int np[], const int pbits[], uint8_t *const out[],
                    size_t nsyms)
{
    (void)G; (void)xs; (void)pp; (void)end; (void)tabs; (void)np; (void)pbits; (void)out; (void)nsyms;
    return 0;   /* never called: group_pages() is 1 here */
}

size_t
decode_symsN_vbmi2(int G, uint32_t *const xs[], const uint8_t **const pp[], const uint8_t *const end[],
                   const uint16_t *const tabs[], const int np[], const int pbits[], uint8_t *const out[],
                   size_t nsyms)
{
    (void)G; (void)xs; (void)pp; (void)end; (void)tabs; (void)np; (void)pbits; (void)out; (void)nsyms;
    return 0;   /* never called: group_pages() is 1 here */
}

int
search_tables16(const uint16_t *freq, const uint16_t *start, int alpha, int pbits, uint16_t *tabs)
{
    (void)freq; (void)start; (void)alpha; (void)pbits; (void)tabs;
    return 65;   /* never called: group_pages() is 1 here */
}

#endif   /* !GROUP_VBMI2 */

#endif
