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
#include <stdint.h>
#include <string.h>

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

static __attribute__((noinline, unused)) XXH_TARGET_AVX512 void
tk_xxh3_update_avx512(XXH3_state_t *st, const void *p, size_t len)
{
    XXH3_update(st, (const xxh_u8 *)p, len, TK_ACC_AVX512, XXH3_scrambleAcc_avx512);
}

static __attribute__((noinline, unused)) XXH_TARGET_AVX2 void
tk_xxh3_update_avx2(XXH3_state_t *st, const void *p, size_t len)
{
    XXH3_update(st, (const xxh_u8 *)p, len, TK_ACC_AVX2, XXH3_scrambleAcc_avx2);
}

/* 2: AVX-512 F, 1: AVX2, 0: neither (-1: not asked yet; threads racing here all store
 * the same answer). */
static int tk_xxh3_kernel = -1;

static inline int
tk_xxh3_pick(void)
{
    int k = tk_xxh3_kernel;
    if (k < 0) {
        __builtin_cpu_init();
        k = tk_xxh3_kernel = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    return k;
}
#endif

/* XXH3_64bits_withSeed(p, len, seed) (seed 0: XXH3_64bits), the same value. */
static inline __attribute__((unused)) XXH64_hash_t
tk_xxh3_64(const void *p, size_t len, XXH64_hash_t seed)
{
#ifdef TK_XXH_DISPATCH
    if (len > XXH3_MIDSIZE_MAX) {   /* shorter inputs take the same scalar paths in every build */
        int k = tk_xxh3_pick();
        if (k == 2)
            return tk_xxh3_long_avx512(p, len, seed);
        if (k == 1)
            return tk_xxh3_long_avx2(p, len, seed);
    }
#endif
    return XXH3_64bits_withSeed(p, len, seed);
}

/* Copies len bytes from src to dst and returns tk_xxh3_64(src, len, 0), in one pass over
 * the memory: a block at a time is copied, then hashed while it is in the L1 cache (a
 * copy followed by a hash read every byte twice from memory). The streaming hash gives
 * the one-shot's value. */
#define TK_COPY_HASH_BLOCK 16384
#ifdef TK_XXH_DISPATCH
/* The copy's stores bypass the cache (the destination is not read back here; normal
 * stores would first read every line of it): unaligned stores up to dst's first 64-byte
 * boundary, streaming stores after, ordered by the caller's sfence. */
static __attribute__((noinline, unused)) XXH_TARGET_AVX512 void
tk_stream_copy_avx512(char *dst, const char *src, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)dst & 63);
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 256 <= n; i += 256) {
        __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
        __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
        _mm512_stream_si512((void *)(dst + i), a);
        _mm512_stream_si512((void *)(dst + i + 64), b);
        _mm512_stream_si512((void *)(dst + i + 128), c);
        _mm512_stream_si512((void *)(dst + i + 192), d);
    }
    for (; i + 64 <= n; i += 64)
        _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512(src + i));
    memcpy(dst + i, src + i, n - i);
}
#endif

static inline __attribute__((unused)) XXH64_hash_t
tk_copy_xxh3_64(void *dst, const void *src, size_t len)
{
    if (len <= TK_COPY_HASH_BLOCK) {
        memcpy(dst, src, len);
        return tk_xxh3_64(src, len, 0);
    }
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
#ifdef TK_XXH_DISPATCH
    int k = tk_xxh3_pick();
#endif
    for (size_t off = 0; off < len; off += TK_COPY_HASH_BLOCK) {
        size_t n = len - off < TK_COPY_HASH_BLOCK ? len - off : TK_COPY_HASH_BLOCK;
        const char *s = (const char *)src + off;
#ifdef TK_XXH_DISPATCH
        if (k == 2) {
            tk_stream_copy_avx512((char *)dst + off, s, n);
            tk_xxh3_update_avx512(&st, s, n);
            continue;
        }
#endif
        memcpy((char *)dst + off, s, n);
#ifdef TK_XXH_DISPATCH
        if (k == 2)
            tk_xxh3_update_avx512(&st, s, n);
        else if (k == 1)
            tk_xxh3_update_avx2(&st, s, n);
        else
#endif
            XXH3_64bits_update(&st, s, n);
    }
#ifdef TK_XXH_DISPATCH
    if (k == 2)
        _mm_sfence();
#endif
    return XXH3_64bits_digest(&st);
}

#endif
