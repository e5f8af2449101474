/*
 * xxh3-64 whose long-input loop runs in AVX-512 or AVX2 where the CPU has them (SSE2,
 * xxhash.h's x86-64 default, elsewhere): the same hashes, 1.6x (AVX2) and 2.1x (AVX-512)
 * as fast on page-sized buffers. xxhash.h is compiled as its own x86 dispatcher
 * (xxh_x86dispatch.c) compiles it, every kernel under its target attribute, and the
 * kernel is picked once, at the first long input. Included instead of xxhash.h by the
 * C files that hash pages (tierkv/_native.c, tierkv/codec/codec_common.c); everything
 * is static (XXH_INLINE_ALL).
 */
#ifndef TIERKV_XXH_SIMD_H
#define TIERKV_XXH_SIMD_H

#include <stddef.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define XXH_X86DISPATCH
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#define TK_XXH_DISPATCH 1
#endif
#define XXH_INLINE_ALL
#include <xxhash.h>

#ifdef TK_XXH_DISPATCH
#if XXH_VERSION_NUMBER >= 802   /* 0.8.2 takes the whole accumulate loop, not one stripe's step */
#define TK_ACC_AVX512 XXH3_accumulate_avx512
#define TK_ACC_AVX2 XXH3_accumulate_avx2
#else
#define TK_ACC_AVX512 XXH3_accumulate_512_avx512
#define TK_ACC_AVX2 XXH3_accumulate_512_avx2
#endif

static __attribute__((noinline, unused)) XXH_TARGET_AVX512 XXH64_hash_t
tk_xxh3_long_avx512(const void *p, size_t len, XXH64_hash_t seed)
{
    return XXH3_hashLong_64b_withSeed_internal(p, len, seed, TK_ACC_AVX512, XXH3_scrambleAcc_avx512,
                                               XXH3_initCustomSecret_avx512);
}

static __attribute__((noinline, unused)) XXH_TARGET_AVX2 XXH64_hash_t
tk_xxh3_long_avx2(const void *p, size_t len, XXH64_hash_t seed)
{
    return XXH3_hashLong_64b_withSeed_internal(p, len, seed, TK_ACC_AVX2, XXH3_scrambleAcc_avx2,
                                               XXH3_initCustomSecret_avx2);
}

/* 2: AVX-512 F, 1: AVX2, 0: neither (-1: not asked yet; threads racing here all store
 * the same answer). */
static int tk_xxh3_kernel = -1;
#endif

/* XXH3_64bits_withSeed(p, len, seed) (seed 0: XXH3_64bits), the same value. */
static inline __attribute__((unused)) XXH64_hash_t
tk_xxh3_64(const void *p, size_t len, XXH64_hash_t seed)
{
#ifdef TK_XXH_DISPATCH
    if (len > XXH3_MIDSIZE_MAX) {   /* shorter inputs take the same scalar paths in every build */
        int k = tk_xxh3_kernel;
        if (k < 0) {
            __builtin_cpu_init();
            k = tk_xxh3_kernel = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
        }
        if (k == 2)
            return tk_xxh3_long_avx512(p, len, seed);
        if (k == 1)
            return tk_xxh3_long_avx2(p, len, seed);
    }
#endif
    return XXH3_64bits_withSeed(p, len, seed);
}

#endif
