/*
 * Private to the codec's SIMD files (codec_simd*.c): the intrinsics and the small
 * register helpers they share. Functions are chosen at run time (codec_simd.c's
 * have_* and use_gather) and built with per-function target attributes, so the rest
 * of the codec compiles for the baseline CPU.
 */
#ifndef TIERKV_CODEC_SIMD_H
#define TIERKV_CODEC_SIMD_H

#include "codec_enc.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* Entry t of a table of 32 (wide: 64) entries held in two (four) registers. */
__attribute__((target("avx512f"))) static inline __m512i
lookup(int wide, __m512i t, const __m512i *tab)
{
    __m512i lo = _mm512_permutex2var_epi32(tab[0], t, tab[1]);
    if (!wide) return lo;
    __m512i hi = _mm512_permutex2var_epi32(tab[2], t, tab[3]);
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(t, _mm512_set1_epi32(32)), lo, hi);
}

/* Bytes shifted right (left) by n < 8: 16-bit shifts, then the bits that crossed from
 * the neighbouring byte masked off. */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i
srl8(__m512i v, int n)
{
    return _mm512_and_si512(_mm512_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm512_set1_epi8((char)(0xFF >> n)));
}

__attribute__((target("avx512f,avx512bw"))) static inline __m512i
sll8(__m512i v, int n)
{
    return _mm512_and_si512(_mm512_sll_epi16(v, _mm_cvtsi32_si128(n)), _mm512_set1_epi8((char)(0xFF << n)));
}

#endif

#endif
