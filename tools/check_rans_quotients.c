/*
 * Exhaustive check of the AVX-512 rANS encoder's single-precision quotients
 * (next_state_f32 in tierkv/codec/codec_simd_rans.c): for pbits 11 (the main tables)
 * and 10 (the least it is used with), every frequency f in 1..2^pbits, every quotient
 * q below 2^(32 - pbits) and the remainders 0, 1, f/2 and f - 1, the state it computes
 * equals q (2^pbits - f) + y + start from the exact integer quotient. It needs a CPU with
 * AVX-512 (F, BW, VL) and takes about a minute and a quarter:
 *
 *     gcc -O2 -I tierkv/codec -o /tmp/check_rans_quotients tools/check_rans_quotients.c
 *     /tmp/check_rans_quotients
 *
 * An argument n checks every n-th frequency only (and 2^pbits): tests/codec runs it so.
 */
#include "codec_simd_rans.c"

#include <stdio.h>
#include <stdlib.h>

__attribute__((target("avx512f,avx512bw,avx512vl"))) static long
check(int pbits, uint32_t every)
{
    long bad = 0, n = 0;
    const __m128i pb = _mm_cvtsi32_si128(pbits);
    const __m512i one_p = _mm512_set1_epi32(1 << pbits), start = _mm512_set1_epi32(7);
    const uint64_t qmax = 1ull << (32 - pbits);
    const uint32_t top = 1u << pbits;
    for (uint32_t f = 1; f <= top; f = f < top && f + every > top ? top : f + every) {
        const __m512 r = _mm512_set1_ps(1.0f / (float)f);
        const __m512i sf = _mm512_set1_epi32((int)((1u << pbits) - f));
        const uint32_t js[4] = {0, 1, f / 2, f - 1};
        for (int ji = 0; ji < 4; ji++) {
            for (uint64_t q0 = 0; q0 < qmax; q0 += 16) {
                uint32_t ys[16], out[16];
                for (int l = 0; l < 16; l++) {   /* y >= 1 (states are >= 2^16), y < 2^32 */
                    uint64_t y = (q0 + (uint64_t)l) * f + js[ji];
                    ys[l] = y > 0xFFFFFFFFull ? 0xFFFFFFFFu : y == 0 ? 1 : (uint32_t)y;
                }
                _mm512_storeu_si512(out, next_state_f32(_mm512_loadu_si512(ys), r, sf, start, pb, one_p));
                for (int l = 0; l < 16; l++, n++) {
                    uint32_t q = ys[l] / f;
                    bad += out[l] != q * ((1u << pbits) - f) + ys[l] + 7;
                }
            }
        }
    }
    printf("pbits %d: %ld states checked, %ld wrong\n", pbits, n, bad);
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
    long bad = check(11, every);
    bad += check(10, every);
    return bad != 0;
}
