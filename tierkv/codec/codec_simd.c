/*
 * Which SIMD paths run: the CPU's features, asked once (have_avx2, have_avx512,
 * have_avx512_bw, have_avx512_vbmi, have_avx512_vbmi2), the AVX-512 symbol lookup's
 * choice of gathers (use_gather) and set_simd's limit for tests and comparisons. The
 * paths themselves: codec_simd_rans.c (rANS symbols, both ways), codec_simd_group.c
 * (the symbols of several pages at once), codec_simd_rows.c (the decoder's signs, mid
 * bits and rows), codec_simd_scan.c (the encoder's passes over a page). Each does the
 * same as the scalar code in codec_planes.c, codec_rows.c and codec_scan.c, byte for
 * byte.
 */
#include "codec_simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* -1: not asked yet. Threads racing here all store the same answer. */
static int avx2_state = -1, avx512_state = -1, amd_state = -1;
static int simd_allowed = 2;

/* 2: every path the CPU has (rANS symbols of up to MAX_GROUP pages at once where a
 * batch has several, from 16-bit halves of the states where VBMI2 runs, else partly by
 * gathers on AMD, by the register search elsewhere); 3: one page at a time with the
 * search alone, 4: one page at a time with gathers (both without VBMI2); 5: as 2; 6: as
 * 2, two pages at a time; 7: as 2 without VBMI2; 1: AVX2 and BMI2 but not AVX-512; 0:
 * scalar only. */
void
set_simd(int allowed)
{
    simd_allowed = allowed;
}

/* Whether AVX-512 symbol decoding gathers from the slot table: on AMD (Zen 4) gathers
 * beside the five-step search are faster than the search alone (1.70 vs 1.60 GB/s a
 * page); on Intel the microcode mitigation of Gather Data Sampling makes gathers
 * several times slower, so the search stays alone there. */
int
use_gather(void)
{
    if (!have_avx512()) return 0;
    if (simd_allowed >= 3 && simd_allowed <= 4) return simd_allowed == 4;
    if (amd_state < 0) {
        __builtin_cpu_init();
        amd_state = __builtin_cpu_is("amd");
    }
    return amd_state;
}

/* How many of a batch's pages decode together (decode_symsN_avx512): MAX_GROUP where
 * AVX-512 BW runs, two at set_simd's level 6, one where it asked for one page at a
 * time (3, 4) or the CPU lacks it. */
int
group_pages(void)
{
    if (!have_avx512_bw() || simd_allowed == 3 || simd_allowed == 4) return 1;
    return simd_allowed == 6 ? 2 : MAX_GROUP;
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

static int vbmi_state = -1;

/* AVX-512 BW and VBMI (byte permutes and multishifts): the fused 16-bit row assembly. */
int
have_avx512_vbmi(void)
{
    if (simd_allowed < 2) return 0;
    if (vbmi_state < 0) {
        __builtin_cpu_init();
        vbmi_state = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vbmi");
    }
    return vbmi_state;
}

static int bw_state = -1, vbmi2_state = -1;

/* AVX-512 VBMI2 beside BW and VL (16-bit funnel shifts and expands): the symbols'
 * kernel on 16-bit halves (decode_symsN_vbmi2), for groups and lone pages; not at
 * set_simd's levels 3, 4 (the one-page kernel's search and gathers) and 7. */
int
have_avx512_vbmi2(void)
{
    if (simd_allowed < 2 || simd_allowed == 3 || simd_allowed == 4 || simd_allowed == 7 || !have_avx512_bw())
        return 0;
    if (vbmi2_state < 0) {
        __builtin_cpu_init();
        vbmi2_state = __builtin_cpu_supports("avx512vbmi2");
    }
    return vbmi2_state;
}

/* AVX-512 BW and VL (16-bit lanes, masked 256-bit stores): the encoder's plane analysis. */
int
have_avx512_bw(void)
{
    if (simd_allowed < 2) return 0;
    if (bw_state < 0) {
        __builtin_cpu_init();
        bw_state = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
            && __builtin_cpu_supports("avx512vl");
    }
    return bw_state;
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

int
have_avx512_vbmi(void)
{
    return 0;
}

int
use_gather(void)
{
    return 0;
}

int
group_pages(void)
{
    return 1;
}

int
have_avx512_bw(void)
{
    return 0;
}

int
have_avx512_vbmi2(void)
{
    return 0;
}

#endif
