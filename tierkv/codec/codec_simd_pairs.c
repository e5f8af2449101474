/*
 * AVX-512 rANS symbols of two pages at once (codec_planes.c's decode_planes2): each
 * page's 64 lanes as four vectors of sixteen, eight state vectors in flight where one
 * page has four (a page's lanes are one chain of dependent steps: two pages' chains
 * overlap), the search over the cumulative frequencies in 16-bit lanes. Measured on Zen
 * 4 against one page at a time (codec_simd_rans.c, three gathers and a search): see
 * docs/benchmarks.md "Two pages at once".
 */
#include "codec_simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* Entry t (16-bit lanes) of a table of 32 (wide: 64) 16-bit entries in one (two)
 * registers. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i
lookup16(const int wide, __m512i t, const __m512i *tab)
{
    return wide ? _mm512_permutex2var_epi16(tab[0], t, tab[1]) : _mm512_permutexvar_epi16(t, tab[0]);
}

/* Two pages' symbols at once, each page's 64 lanes as four vectors of sixteen: eight
 * independent state vectors in flight where one page has four, so the chains of one
 * step (search, multiply, renormalisation) overlap twice as much. The search runs in
 * 16-bit lanes: the slots of two state vectors (below 2^pbits <= 2^15) narrowed into
 * one vector of 32 words and searched over the cumulative frequencies as words, each
 * round's add, permute, compare and move serving 32 lanes; the symbol's frequency and
 * the slot's offset in it are widened back for the state's update. Tables (tabs[g]:
 * cumulative frequency, frequency, symbol by rank, 64 words each) and streams are the
 * pages' own; `wide` and `first` are constants of each instantiation (the larger of the
 * two pages' searches; a smaller table's padding never matches). Stops before a chunk
 * whose words might run past either stream's end. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline size_t
pair_kernel(const int wide, const int first, uint32_t *const xs[2], const uint8_t **const pp[2],
            const uint8_t *const end[2], const uint16_t *const tabs[2], const int pbits[2], uint8_t *const out[2],
            size_t nsyms)
{
    __m512i cum[2][2], fr[2][2], id[2][2], smask[2], x[2][4];
    __m128i sh[2];
    const uint8_t *p[2];
    for (int g = 0; g < 2; g++) {
        for (int i = 0; i < 2; i++) {
            cum[g][i] = _mm512_loadu_si512(tabs[g] + 32 * i);
            fr[g][i] = _mm512_loadu_si512(tabs[g] + 64 + 32 * i);
            id[g][i] = _mm512_loadu_si512(tabs[g] + 128 + 32 * i);
        }
        smask[g] = _mm512_set1_epi32((1 << pbits[g]) - 1);
        sh[g] = _mm_cvtsi32_si128(pbits[g]);
        p[g] = *pp[g];
        for (int v = 0; v < 4; v++) x[g][v] = _mm512_loadu_si512(xs[g] + 16 * v);
    }
    const __m512i lim = _mm512_set1_epi32((int)RANS_L);
    size_t r = 0;
    for (; r + LANES <= nsyms && (size_t)(end[0] - p[0]) >= 2 * LANES && (size_t)(end[1] - p[1]) >= 2 * LANES;
         r += LANES) {
        __m512i s16[2][2], k16[2][2];
        for (int g = 0; g < 2; g++)
            for (int q = 0; q < 2; q++) {
                __m256i a = _mm512_cvtepi32_epi16(_mm512_and_si512(x[g][2 * q], smask[g]));
                __m256i b = _mm512_cvtepi32_epi16(_mm512_and_si512(x[g][2 * q + 1], smask[g]));
                s16[g][q] = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
                k16[g][q] = _mm512_setzero_si512();
            }
        for (int step = first; step; step >>= 1)
            for (int g = 0; g < 2; g++)
                for (int q = 0; q < 2; q++) {
                    __m512i t = _mm512_add_epi16(k16[g][q], _mm512_set1_epi16((short)step));
                    __mmask32 le = _mm512_cmple_epu16_mask(lookup16(wide, t, cum[g]), s16[g][q]);
                    k16[g][q] = _mm512_mask_mov_epi16(k16[g][q], le, t);
                }
        __mmask16 need[2][4];
        for (int g = 0; g < 2; g++)
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
        for (int g = 0; g < 2; g++)
            for (int v = 0; v < 4; v++) {
                __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p[g]));
                p[g] += 2 * (size_t)__builtin_popcount((unsigned)need[g][v]);
                x[g][v] = _mm512_mask_mov_epi32(x[g][v], need[g][v],
                                                _mm512_or_si512(_mm512_slli_epi32(x[g][v], 16),
                                                                _mm512_maskz_expand_epi32(need[g][v], words)));
            }
    }
    for (int g = 0; g < 2; g++) {
        for (int v = 0; v < 4; v++) _mm512_storeu_si512(xs[g] + 16 * v, x[g][v]);
        *pp[g] = p[g];
    }
    return r;
}

#define TK_PAIRS(NP, ...)                                                         \
    ((NP) > 32 ? pair_kernel(1, 32, __VA_ARGS__)                                  \
     : (NP) > 16 ? pair_kernel(0, 16, __VA_ARGS__)                                \
     : (NP) > 8 ? pair_kernel(0, 8, __VA_ARGS__)                                  \
     : (NP) > 4 ? pair_kernel(0, 4, __VA_ARGS__)                                  \
     : (NP) > 2 ? pair_kernel(0, 2, __VA_ARGS__) : pair_kernel(0, 1, __VA_ARGS__))

/* The next nsyms symbols of one context in each of two pages (page g's lane j decodes
 * its symbols j, j + 64, ... into out[g]) by pair_kernel, from each context's
 * search_tables16 (np[g] present symbols, at most 64); stops before a chunk whose words
 * might run past either page's end. Returns the symbols decoded in each page, a
 * multiple of 64. */
__attribute__((target("avx512f,avx512bw"))) size_t
decode_syms2_avx512(uint32_t *const xs[2], const uint8_t **const pp[2], const uint8_t *const end[2],
                    const uint16_t *const tabs[2], const int np[2], const int pbits[2], uint8_t *const out[2],
                    size_t nsyms)
{
    return TK_PAIRS(np[0] > np[1] ? np[0] : np[1], xs, pp, end, tabs, pbits, out, nsyms);
}

#else

size_t
decode_syms2_avx512(uint32_t *const xs[2], const uint8_t **const pp[2], const uint8_t *const end[2],
                    const uint16_t *const tabs[2], const int np[2], const int pbits[2], uint8_t *const out[2],
                    size_t nsyms)
{
    (void)xs; (void)pp; (void)end; (void)tabs; (void)np; (void)pbits; (void)out; (void)nsyms;
    return 0;   /* never called: use_pairs() is 0 here */
}

#endif

/* decode_syms2_avx512's tables of a context: search_tables' as 16-bit words, 64 entries
 * each (ranks past the present symbols hold 2^pbits, never <= a slot); returns the
 * present symbols, 65 where there are more than 64 or the slots do not fit 15 bits. */
int
search_tables16(const uint16_t *freq, const uint16_t *start, int alpha, int pbits, uint16_t *tabs)
{
    if (pbits > 15) return 65;
    int np = 0;
    for (int i = 0; i < alpha; i++) {
        if (!freq[i]) continue;
        if (np == 64) return 65;
        tabs[np] = start[i];
        tabs[64 + np] = freq[i];
        tabs[128 + np++] = (uint16_t)i;
    }
    for (int i = np; i < 64; i++) {
        tabs[i] = (uint16_t)(1u << pbits);
        tabs[64 + i] = tabs[128 + i] = 0;
    }
    return np;
}
