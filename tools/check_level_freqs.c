/*
 * Check of the AVX-512 table frequencies (freq_quotients and level_freqs_avx512 in
 * tierkv/codec/codec_simd_rans.c) against exact integer division:
 *
 * 1. quotients: for pbits 8 and 11, every weight W(l) of the 63 levels and every total
 *    from W(l) to 2^28 - 1 (every n-th total with an argument n) together with the
 *    totals where the quotient is an integer or just past one (the divisors of
 *    W(l) 2^pbits and their neighbours), floor(W(l) 2^pbits / total);
 * 2. tables: a million random level vectors (alphabets of 16 to 256 symbols, spans and
 *    level mixes of every kind), each symbol's frequency before the sum is corrected,
 *    their sum and the first largest.
 *
 * It needs a CPU with AVX-512 (F, BW, VL); every total takes about a minute:
 *
 *     gcc -O2 -I tierkv/codec -o /tmp/check_level_freqs tools/check_level_freqs.c
 *     /tmp/check_level_freqs
 *
 * tests/codec runs it with every 4001st total.
 */
#include "codec_simd_rans.c"

#include <stdio.h>
#include <stdlib.h>

#define MAX_TOTAL (1u << 28)

static uint32_t
weight(int level)
{
    static const uint32_t base[4] = {16, 19, 23, 27};
    return level ? base[(level - 1) & 3] << ((level - 1) >> 2) : 0;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static long
check_totals(int pbits, const uint32_t *totals, size_t n, uint32_t w, long *checked)
{
    long bad = 0;
    const __m128i pb = _mm_cvtsi32_si128(pbits);
    const __m512i vw = _mm512_set1_epi32((int)w);
    for (size_t i = 0; i < n; i++) {
        uint32_t out[16];
        const uint32_t t = totals[i];
        _mm512_storeu_si512(out, freq_quotients(vw, _mm512_set1_epi32((int)t), _mm512_set1_ps(1.0f / (float)t), pb));
        bad += out[0] != (uint32_t)(((uint64_t)w << pbits) / t);
        (*checked)++;
    }
    return bad;
}

/* Totals t (w <= t < 2^28) at or next to an integer quotient of x = w 2^pbits: t = x / q
 * for every q, and t - 1, t + 1. */
static size_t
edge_totals(uint64_t x, uint32_t w, uint32_t *out)
{
    size_t n = 0;
    for (uint64_t q = 1; q <= x; q++) {
        uint64_t t = x / q;
        if (t < w) break;
        for (int d = -1; d <= 1; d++) {
            uint64_t u = t + (uint64_t)(int64_t)d;
            if (u >= w && u < MAX_TOTAL) out[n++] = (uint32_t)u;
        }
    }
    return n;
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) static long
check_quotients(int pbits, uint32_t every)
{
    long bad = 0, checked = 0;
    uint32_t *buf = malloc(sizeof(uint32_t) * 16 * 1024 * 1024);
    if (buf == NULL) return 1;
    for (int level = 1; level <= 63; level++) {
        const uint32_t w = weight(level);
        const uint64_t x = (uint64_t)w << pbits;
        bad += check_totals(pbits, buf, edge_totals(x, w, buf), w, &checked);
        const __m128i pb = _mm_cvtsi32_si128(pbits);
        const __m512i vw = _mm512_set1_epi32((int)w), lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4,
                                                                              3, 2, 1, 0);
        for (uint64_t t0 = w; t0 < MAX_TOTAL; t0 += 16 * (uint64_t)every) {   /* one reciprocal a vector of totals */
            uint32_t t[16], out[16];
            __m512i vt = _mm512_add_epi32(_mm512_set1_epi32((int)t0), _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)every)));
            _mm512_storeu_si512(t, vt);
            __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_cvtepi32_ps(vt));
            _mm512_storeu_si512(out, freq_quotients(vw, vt, inv, pb));
            for (int l = 0; l < 16; l++) {
                if (t[l] >= MAX_TOTAL) continue;
                bad += out[l] != (uint32_t)(x / t[l]);
                checked++;
            }
        }
    }
    free(buf);
    printf("quotients pbits %d: %ld checked, %ld wrong\n", pbits, checked, bad);
    return bad;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t
rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)((rng_state >> 11) % n);
}

static long
check_tables(long count)
{
    long bad = 0;
    for (long k = 0; k < count; k++) {
        uint8_t levels[256] = {0};
        const int alpha = 16 + (int)rnd(241), pbits = rnd(2) ? 11 : 8;
        const int first = (int)rnd((uint32_t)alpha), last = first + (int)rnd((uint32_t)(alpha - first));
        const int lo = 1 + (int)rnd(63), hi = lo + (int)rnd((uint32_t)(64 - lo)), sparse = (int)rnd(4);
        for (int i = first; i <= last; i++) levels[i] = rnd(4) < (uint32_t)sparse ? 0 : (uint8_t)(lo + (int)rnd((uint32_t)(hi - lo + 1)));
        uint64_t total = 0;
        for (int i = 0; i < alpha; i++) total += weight(levels[i]);
        uint16_t freq[256 + 32];
        for (int i = 0; i < 256 + 32; i++) freq[i] = 0xBEEF;
        uint32_t sum = 0;
        int top = -1;
        const int rc = level_freqs_avx512(levels, alpha, freq, pbits, &sum, &top);
        if (total == 0) {
            bad += rc != -1;
            continue;
        }
        uint32_t want_sum = 0, most = 0;
        int want_top = 0;
        for (int i = 0; i < alpha; i++) {
            uint64_t q = ((uint64_t)weight(levels[i]) << pbits) / total;
            uint32_t f = levels[i] ? (q < 1 ? 1 : (uint32_t)q) : 0;
            bad += freq[i] != f;
            want_sum += f;
            if (f > most) {
                most = f;
                want_top = i;
            }
        }
        for (int i = alpha; i < 256 + 32; i++) bad += freq[i] != 0xBEEF;   /* nothing written past alpha */
        bad += rc != 0 || sum != want_sum || top != want_top;
    }
    printf("tables: %ld checked, %ld wrong\n", count, bad);
    return bad;
}

int
main(int argc, char **argv)
{
    uint32_t every = argc > 1 ? (uint32_t)strtoul(argv[1], NULL, 10) : 1;
    if (every < 1) every = 1;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw")
            || !__builtin_cpu_supports("avx512vl")) {
        printf("no AVX-512 (F, BW, VL) on this CPU: nothing to check\n");
        return 2;
    }
    long bad = check_quotients(8, every);
    bad += check_quotients(11, every);
    bad += check_tables(1000000);
    return bad != 0;
}
