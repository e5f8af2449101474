/*
 * tierkv._native: the compiled hot paths of page keys (see tierkv/keys.py).
 *
 * Holds the prefix-chained xxh3-128 page-key chain, KeySet (an open-addressing
 * hash set of 16-byte page keys, the in-memory index's membership test) and
 * checksum64 (xxh3-64 of a page buffer), and the ordered word accesses of a get's
 * landing record (tierkv/store/landed.py). Imported optionally by tierkv.keys, which
 * has a pure-Python fallback giving the same keys and the same KeySet contract.
 *
 * Built by setup.py against xxhash.h (0.8.x, header-only through XXH_INLINE_ALL; page
 * checksums through xxh_simd.h's AVX-512/AVX2 kernels).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "xxh_simd.h"

#define KEY_BYTES 16
/* Below this many bytes, checksum64 keeps the GIL: dropping it costs more than hashing. */
#define CHECKSUM_NOGIL_BYTES 16384
#define KEYSET_MIN_LOG2 4 /* 16 slots */
#define PREFETCH_AHEAD 8 /* keys ahead that prefix_len prefetches the slots of */

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(p) __builtin_prefetch(p)
#else
#define PREFETCH(p) ((void)0)
#endif

static int
host_is_little_endian(void)
{
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* ------------------------------------------------------------------ key chain */

enum { NOT_UINT32 = -1, DATA_LE = 0, DATA_BE = 1, DATA_WIDE = 2 };

/* Byte order of a buffer's uint32 items: raw bytes count as little-endian uint32s.
 * DATA_WIDE: 8-byte integers in the host's order (numpy's int64 and uint64 token ids),
 * narrowed to uint32 as they are hashed, each checked to lie in [0, 2^32). */
static int
uint32_byte_order(const Py_buffer *view)
{
    const char *f = view->format != NULL ? view->format : "B";
    char order = '@';
    if (*f == '@' || *f == '=' || *f == '<' || *f == '>' || *f == '!')
        order = *f++;
    if (view->itemsize == 1 && strcmp(f, "B") == 0)
        return DATA_LE;
    if (view->itemsize == 8 && (strcmp(f, "q") == 0 || strcmp(f, "Q") == 0 || strcmp(f, "l") == 0 ||
                                strcmp(f, "L") == 0 || strcmp(f, "n") == 0 || strcmp(f, "N") == 0))
        return order == '@' || order == '=' || (order == '<') == host_is_little_endian() ? DATA_WIDE : NOT_UINT32;
    if (view->itemsize != 4 || (strcmp(f, "I") != 0 && strcmp(f, "L") != 0))
        return NOT_UINT32;
    if (order == '<')
        return DATA_LE;
    if (order == '>' || order == '!')
        return DATA_BE;
    return host_is_little_endian() ? DATA_LE : DATA_BE;
}

static inline void
store_be64(uint8_t *p, uint64_t v)
{
    if (host_is_little_endian())
        v = XXH_swap64(v);
    memcpy(p, &v, 8);
}

/* n_ids 8-byte integers in the host's order (any alignment) as little-endian uint32s in
 * dst; returns their OR, whose high half must be 0. The portable loop (SSE2 where the
 * compiler vectorises it: about one cycle an id), and AVX2 and AVX-512 versions chosen at
 * import (narrow_level): a long prompt's 1 MiB of int64 ids is narrowed by the client of a
 * node service before every lookup (issue 21), and by the key chain as it hashes. */
static uint64_t
narrow_ids_portable(const uint8_t *src, size_t n_ids, uint8_t *dst)
{
    uint64_t ored = 0;
    for (size_t j = 0; j < n_ids; j++) {
        uint64_t v;
        memcpy(&v, src + 8 * j, 8);
        ored |= v;
        uint32_t id = host_is_little_endian() ? (uint32_t)v : XXH_swap32((uint32_t)v);
        memcpy(dst + 4 * j, &id, 4);
    }
    return ored;
}

/* The OR of n 8-byte integers (the ids after the pages hashed, which must be checked too). */
static uint64_t
or_of_ids_portable(const uint8_t *src, size_t n)
{
    uint64_t ored = 0;
    for (size_t j = 0; j < n; j++) {
        uint64_t v;
        memcpy(&v, src + 8 * j, 8);
        ored |= v;
    }
    return ored;
}

/* 0: the portable loops, 1: AVX2, 2: AVX-512F; the best the CPU has, set at import. */
static int narrow_level = 0;
static int narrow_best = 0;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define NARROW_X86 1

/* 16 ids a step: two 512-bit loads, their OR kept, each truncated to 8 uint32s (vpmovqd). */
__attribute__((target("avx512f"))) static uint64_t
narrow_ids_avx512(const uint8_t *src, size_t n_ids, uint8_t *dst)
{
    __m512i acc = _mm512_setzero_si512();
    size_t j = 0;
    for (; j + 16 <= n_ids; j += 16) {
        __m512i a = _mm512_loadu_si512((const void *)(src + 8 * j));
        __m512i b = _mm512_loadu_si512((const void *)(src + 8 * j + 64));
        acc = _mm512_or_si512(acc, _mm512_or_si512(a, b));
        _mm256_storeu_si256((__m256i *)(void *)(dst + 4 * j), _mm512_cvtepi64_epi32(a));
        _mm256_storeu_si256((__m256i *)(void *)(dst + 4 * j + 32), _mm512_cvtepi64_epi32(b));
    }
    return (uint64_t)_mm512_reduce_or_epi64(acc) | narrow_ids_portable(src + 8 * j, n_ids - j, dst + 4 * j);
}

__attribute__((target("avx512f"))) static uint64_t
or_of_ids_avx512(const uint8_t *src, size_t n)
{
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    size_t j = 0;
    for (; j + 16 <= n; j += 16) {
        acc0 = _mm512_or_si512(acc0, _mm512_loadu_si512((const void *)(src + 8 * j)));
        acc1 = _mm512_or_si512(acc1, _mm512_loadu_si512((const void *)(src + 8 * j + 64)));
    }
    return (uint64_t)_mm512_reduce_or_epi64(_mm512_or_si512(acc0, acc1)) | or_of_ids_portable(src + 8 * j, n - j);
}

/* 8 ids a step: the low halves of two vectors of four picked by one shuffle (per 128-bit
 * lane: a0 a1 b0 b1 | a2 a3 b2 b3), put in order by one cross-lane permute. */
__attribute__((target("avx2"))) static uint64_t
narrow_ids_avx2(const uint8_t *src, size_t n_ids, uint8_t *dst)
{
    __m256i acc = _mm256_setzero_si256();
    size_t j = 0;
    for (; j + 8 <= n_ids; j += 8) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(src + 8 * j));
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(src + 8 * j + 32));
        acc = _mm256_or_si256(acc, _mm256_or_si256(a, b));
        __m256 lo = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);
        _mm256_storeu_si256((__m256i *)(void *)(dst + 4 * j),
                            _mm256_permute4x64_epi64(_mm256_castps_si256(lo), 0xD8));
    }
    __m128i h = _mm_or_si128(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    uint64_t ored = (uint64_t)_mm_cvtsi128_si64(h) | (uint64_t)_mm_extract_epi64(h, 1);
    return ored | narrow_ids_portable(src + 8 * j, n_ids - j, dst + 4 * j);
}

__attribute__((target("avx2"))) static uint64_t
or_of_ids_avx2(const uint8_t *src, size_t n)
{
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        acc0 = _mm256_or_si256(acc0, _mm256_loadu_si256((const __m256i *)(const void *)(src + 8 * j)));
        acc1 = _mm256_or_si256(acc1, _mm256_loadu_si256((const __m256i *)(const void *)(src + 8 * j + 32)));
    }
    __m256i acc = _mm256_or_si256(acc0, acc1);
    __m128i h = _mm_or_si128(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    return (uint64_t)_mm_cvtsi128_si64(h) | (uint64_t)_mm_extract_epi64(h, 1) | or_of_ids_portable(src + 8 * j, n - j);
}
#endif

static uint64_t
narrow_ids(const uint8_t *src, size_t n_ids, uint8_t *dst)
{
#ifdef NARROW_X86
    if (narrow_level >= 2)
        return narrow_ids_avx512(src, n_ids, dst);
    if (narrow_level == 1)
        return narrow_ids_avx2(src, n_ids, dst);
#endif
    return narrow_ids_portable(src, n_ids, dst);
}

static uint64_t
or_of_ids(const uint8_t *src, size_t n)
{
#ifdef NARROW_X86
    if (narrow_level >= 2)
        return or_of_ids_avx512(src, n);
    if (narrow_level == 1)
        return or_of_ids_avx2(src, n);
#endif
    return or_of_ids_portable(src, n);
}

/* Page i's ids as little-endian uint32 bytes: in place, or narrowed (DATA_WIDE, their OR
 * added to *wide_or) or byte-swapped into dst. step: the page's bytes as uint32s. */
XXH_FORCE_INLINE const uint8_t *
page_ids(const uint8_t *data, size_t step, Py_ssize_t i, int order, uint8_t *dst, uint64_t *wide_or)
{
    if (order == DATA_WIDE) {
        *wide_or |= narrow_ids(data + (size_t)i * step * 2, step / 4, dst);
        return dst;
    }
    const uint8_t *page = data + (size_t)i * step;
    if (order == DATA_BE) {
        for (size_t j = 0; j < step; j += 4) {
            dst[j] = page[j + 3];
            dst[j + 1] = page[j + 2];
            dst[j + 2] = page[j + 1];
            dst[j + 3] = page[j];
        }
        return dst;
    }
    return page;
}

/* XXH128 canonical layout: high64 then low64, each big-endian. */
XXH_FORCE_INLINE void
store_key(uint8_t *out, XXH128_hash_t h)
{
    store_be64(out, h.high64);
    store_be64(out + 8, h.low64);
}

/* Any page length. scratch holds key[i-1] in its first 16 bytes and the page's ids after
 * it. The chain is serial, so each hash's latency counts: inlined with a constant step,
 * the copy and xxh3's length dispatch fold away, and the key goes back to scratch as the
 * two 8-byte stores xxh3's 8-byte loads forward from (about 2x faster than a runtime
 * length and a 16-byte memcpy). */
XXH_FORCE_INLINE uint64_t
chain_pages(const uint8_t *data, size_t step, Py_ssize_t n_pages, int order, uint8_t *scratch, uint8_t *out)
{
    uint64_t wide_or = 0;   /* DATA_WIDE: the OR of every id hashed (its high half must be 0) */
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        const uint8_t *ids = page_ids(data, step, i, order, scratch + KEY_BYTES, &wide_or);
        if (ids != scratch + KEY_BYTES)
            memcpy(scratch + KEY_BYTES, ids, step);
        XXH128_hash_t h = XXH3_128bits(scratch, KEY_BYTES + step);
        store_key(scratch, h);
        store_key(out + (size_t)i * KEY_BYTES, h);
    }
    return wide_or;
}

/* XXH3-128 of key[i-1] || ids for 48 <= len <= 128 bytes (8 to 28 tokens a page), split.
 * In XXH3_len_17to128_128b the first 16 bytes (the parent key) are read only by the last
 * of its mixes; so the rest, a page's own part, is computed for a block of pages ahead,
 * off the chain, and a link costs one 64x64 multiply and the finalisation. The same bits
 * as XXH3_128bits (tests/test_keys.py holds them to it), about twice as fast on 16-token
 * pages. Input byte k of the hash is ids[k - 16]. */
typedef struct {
    uint64_t low, xlow, high;
} ChainPart;

#define SPLIT_MIN 48
#define SPLIT_MAX 128
#define SPLIT_BLOCK 32

XXH_FORCE_INLINE ChainPart
chain_part(const uint8_t *ids, size_t len)
{
    const uint8_t *sec = XXH3_kSecret;
    XXH128_hash_t acc;
    acc.low64 = len * XXH_PRIME64_1;
    acc.high64 = 0;
    if (len > 96)
        acc = XXH128_mix32B(acc, ids + 32, ids + len - 80, sec + 96, 0);
    if (len > 64)
        acc = XXH128_mix32B(acc, ids + 16, ids + len - 64, sec + 64, 0);
    acc = XXH128_mix32B(acc, ids, ids + len - 48, sec + 32, 0);
    ChainPart c;   /* the last mix32B but for the parent's terms */
    c.low = acc.low64;
    c.xlow = XXH_readLE64(ids + len - 32) + XXH_readLE64(ids + len - 24);
    c.high = acc.high64 + XXH3_mix16B(ids + len - 32, sec + 16, 0);
    return c;
}

/* The link of a page: its part and the parent key, held as the two 8-byte words xxh3
 * reads from the parent's canonical bytes (each the byte swap of a half of the hash), so
 * that the chain runs in registers. */
XXH_FORCE_INLINE XXH128_hash_t
chain_link(ChainPart c, uint64_t p0, uint64_t p1, size_t len)
{
    const uint8_t *sec = XXH3_kSecret;
    uint64_t low = (c.low + XXH3_mul128_fold64(p0 ^ XXH_readLE64(sec), p1 ^ XXH_readLE64(sec + 8))) ^ c.xlow;
    uint64_t high = c.high ^ (p0 + p1);
    XXH128_hash_t h;
    h.low64 = XXH3_avalanche(low + high);
    h.high64 = (XXH64_hash_t)0 - XXH3_avalanche(low * XXH_PRIME64_1 + high * XXH_PRIME64_4 + len * XXH_PRIME64_2);
    return h;
}

/* scratch: the namespace (16 bytes), then room for SPLIT_BLOCK pages of ids, where ids
 * that are not little-endian uint32s are converted a block at a time. */
XXH_FORCE_INLINE uint64_t
chain_split(const uint8_t *data, size_t step, Py_ssize_t n_pages, int order, uint8_t *scratch, uint8_t *out)
{
    const size_t len = KEY_BYTES + step;
    uint8_t *room = scratch + KEY_BYTES;
    uint64_t wide_or = 0, p0 = XXH_readLE64(scratch), p1 = XXH_readLE64(scratch + 8);
    /* The ids' bytes a block: a block two ahead is fetched while this one is hashed. A
     * streamed lookup (tierkv serve) reads ids its client wrote on another core just
     * before: lines that core holds modified came over one at a time to the loop's
     * sequential reads, which took up to twice as long (a 128K-token prompt). The first
     * two blocks are not fetched ahead. */
    const size_t block_bytes = (size_t)SPLIT_BLOCK * step * (order == DATA_WIDE ? 2 : 1);
    const size_t all_bytes = (size_t)n_pages * step * (order == DATA_WIDE ? 2 : 1);
    for (Py_ssize_t b = 0; b < n_pages; b += SPLIT_BLOCK) {
        Py_ssize_t nb = n_pages - b < SPLIT_BLOCK ? n_pages - b : SPLIT_BLOCK;
        size_t ahead = ((size_t)b / SPLIT_BLOCK + 2) * block_bytes;
        for (size_t o = ahead; o < ahead + block_bytes && o < all_bytes; o += 64)
            PREFETCH(data + o);
        const uint8_t *ids = data + (size_t)b * step;
        if (order == DATA_WIDE) {
            wide_or |= narrow_ids(data + (size_t)b * step * 2, (size_t)nb * (step / 4), room);
            ids = room;
        } else if (order == DATA_BE) {
            for (Py_ssize_t k = 0; k < nb; k++)
                page_ids(data, step, b + k, DATA_BE, room + (size_t)k * step, &wide_or);
            ids = room;
        }
        for (Py_ssize_t k = 0; k < nb; k++) {
            XXH128_hash_t h = chain_link(chain_part(ids + (size_t)k * step, len), p0, p1, len);
            store_key(out + (size_t)(b + k) * KEY_BYTES, h);
            p0 = XXH_swap64(h.high64);   /* what XXH_readLE64 reads from the canonical bytes */
            p1 = XXH_swap64(h.low64);
        }
    }
    return wide_or;
}

static uint64_t
chain_loop(const uint8_t *ns, const uint8_t *data, Py_ssize_t step, Py_ssize_t n_pages,
           int order, uint8_t *scratch, uint8_t *out)
{
    memcpy(scratch, ns, KEY_BYTES);
    if (step == 16 * 4) /* tokens_per_page 16: the usual page size */
        return chain_split(data, 16 * 4, n_pages, order, scratch, out);
    if (KEY_BYTES + step >= SPLIT_MIN && KEY_BYTES + step <= SPLIT_MAX)
        return chain_split(data, (size_t)step, n_pages, order, scratch, out);
    if (step == 32 * 4 && order == DATA_LE)
        return chain_pages(data, 32 * 4, n_pages, DATA_LE, scratch, out);
    return chain_pages(data, (size_t)step, n_pages, order, scratch, out);
}

PyDoc_STRVAR(chain_doc,
"chain_xxh3_128(namespace, tokens, tokens_per_page, n_pages) -> bytes\n\n"
"Keys of the first n_pages pages of tokens, concatenated (n_pages * 16 bytes).\n"
"key[i] = XXH3_128(key[i-1] || page i's tokens as little-endian uint32), key[-1] =\n"
"namespace (16 bytes); each key is the canonical (big-endian) digest, as\n"
"xxhash.xxh3_128_digest returns it. tokens is a C-contiguous buffer of uint32\n"
"(any byte order declared in its format), of raw bytes read as little-endian\n"
"uint32, or of 8-byte integers in the host's order (int64, uint64): these are\n"
"hashed as uint32 and every one of them, the last partial page's too, must lie in\n"
"[0, 2**32): else OverflowError. Raises ValueError or TypeError on bad arguments.\n"
"Releases the GIL.");


static PyObject *
chain_xxh3_128(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"namespace", "tokens", "tokens_per_page", "n_pages", NULL};
    Py_buffer ns = {0}, tok = {0};
    PyObject *tokens_obj, *out = NULL;
    Py_ssize_t tpp, n_pages;
    uint8_t *scratch = NULL;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*Onn:chain_xxh3_128", kwlist,
                                     &ns, &tokens_obj, &tpp, &n_pages))
        return NULL;
    if (ns.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "namespace must be %d bytes, got %zd", KEY_BYTES, ns.len);
        goto done;
    }
    if (tpp <= 0 || tpp > (PY_SSIZE_T_MAX - KEY_BYTES) / 4) {
        PyErr_Format(PyExc_ValueError, "tokens_per_page must lie in [1, %zd], got %zd",
                     (PY_SSIZE_T_MAX - KEY_BYTES) / 4, tpp);
        goto done;
    }
    if (n_pages < 0) {
        PyErr_Format(PyExc_ValueError, "n_pages must be >= 0, got %zd", n_pages);
        goto done;
    }
    if (!PyObject_CheckBuffer(tokens_obj)) {
        PyErr_Format(PyExc_TypeError, "tokens must be a buffer of uint32 (e.g. a numpy uint32 "
                     "array), got %.100s", Py_TYPE(tokens_obj)->tp_name);
        goto done;
    }
    if (PyObject_GetBuffer(tokens_obj, &tok, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        goto done;
    int order = uint32_byte_order(&tok);
    if (order == NOT_UINT32) {
        PyErr_Format(PyExc_TypeError, "tokens must be a buffer of uint32 (format 'I', itemsize 4), "
                     "of bytes or of 8-byte integers in the host's order, got format '%.20s' with itemsize %zd",
                     tok.format != NULL ? tok.format : "B", tok.itemsize);
        goto done;
    }
    Py_ssize_t step = tpp * 4, width = order == DATA_WIDE ? 8 : 4;
    if (n_pages > tok.len / width / tpp || n_pages > PY_SSIZE_T_MAX / KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "%zd pages of %zd tokens need %zd tokens, the buffer holds %zd",
                     n_pages, tpp, n_pages <= PY_SSIZE_T_MAX / step ? n_pages * tpp : PY_SSIZE_T_MAX,
                     tok.len / width);
        goto done;
    }

    out = PyBytes_FromStringAndSize(NULL, n_pages * KEY_BYTES);
    if (out == NULL)
        goto done;
    /* the split chain converts a block of pages ahead; the others one page */
    int split = KEY_BYTES + step >= SPLIT_MIN && KEY_BYTES + step <= SPLIT_MAX;
    if (n_pages > 0) {
        scratch = PyMem_RawMalloc((size_t)KEY_BYTES + (size_t)step * (split ? SPLIT_BLOCK : 1));
        if (scratch == NULL) {
            Py_CLEAR(out);
            PyErr_NoMemory();
            goto done;
        }
    }
    /* The buffer export pins tokens' memory; out is not visible to anyone else yet. */
    int narrow = 1;
    uint64_t ored = 0;
    Py_BEGIN_ALLOW_THREADS
    if (n_pages > 0)
        ored = chain_loop(ns.buf, tok.buf, step, n_pages, order, scratch, (uint8_t *)PyBytes_AS_STRING(out));
    if (order == DATA_WIDE)   /* the ids hashed, then those of the partial page after them */
        narrow = !((ored | or_of_ids((const uint8_t *)tok.buf + n_pages * tpp * 8, tok.len / 8 - n_pages * tpp)) >> 32);
    Py_END_ALLOW_THREADS
    if (!narrow) {
        Py_CLEAR(out);
        PyErr_SetString(PyExc_OverflowError, "a token id lies outside [0, 2**32)");
    }

done:
    PyMem_RawFree(scratch);
    if (tok.obj != NULL)
        PyBuffer_Release(&tok);
    PyBuffer_Release(&ns);
    return out;
}

PyDoc_STRVAR(narrow_doc,
"narrow_ids(ids, out) -> bool\n\n"
"Writes the 8-byte integer ids (int64 or uint64 in the host's order, C-contiguous)\n"
"into out, a writable C-contiguous buffer of as many little-endian uint32s. False\n"
"where an id lies outside [0, 2**32) (out then holds some of them). TypeError or\n"
"ValueError for other buffers.\n"
"One pass: the check and the narrowing together. Releases the GIL.");

static PyObject *
py_narrow_ids(PyObject *self, PyObject *args)
{
    Py_buffer src = {0}, dst = {0};
    PyObject *src_obj, *dst_obj, *result = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:narrow_ids", &src_obj, &dst_obj))
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0)
        goto done;
    if (uint32_byte_order(&src) != DATA_WIDE || src.len % 8) {
        PyErr_Format(PyExc_TypeError, "narrow_ids takes 8-byte integers in the host's order, got format '%.20s' "
                     "with itemsize %zd", src.format != NULL ? src.format : "B", src.itemsize);
        goto done;
    }
    if (dst.itemsize != 4 || uint32_byte_order(&dst) != DATA_LE || dst.len != src.len / 2) {
        PyErr_Format(PyExc_ValueError, "narrow_ids writes %zd little-endian uint32s: got format '%.20s', %zd bytes",
                     src.len / 8, dst.format != NULL ? dst.format : "B", dst.len);
        goto done;
    }
    uint64_t ored;
    Py_BEGIN_ALLOW_THREADS
    ored = narrow_ids((const uint8_t *)src.buf, (size_t)src.len / 8, (uint8_t *)dst.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(!(ored >> 32));
done:
    PyBuffer_Release(&src);
    if (dst.obj != NULL)
        PyBuffer_Release(&dst);
    return result;
}

/* ------------------------------------------------------------------ checksum */

PyDoc_STRVAR(set_simd_doc,
"set_simd(level) -> int\n\n"
"Which vector paths narrow and check 8-byte ids (narrow_ids, the key chain of int64\n"
"ids): 2 (or True) AVX-512 where the CPU has it, 1 AVX2 where it has that, 0 (or False)\n"
"the portable loop; all give the same bytes. Returns the level in force after the call (the asked one or\n"
"the best below it the CPU has). For tests and comparisons: not meant to change while\n"
"other threads hash.");

static PyObject *
set_simd(PyObject *self, PyObject *arg)
{
    (void)self;
    long level = PyLong_AsLong(arg);
    if (level == -1 && PyErr_Occurred())
        return NULL;
    if (PyBool_Check(arg))   /* True: the best the CPU has (as the codec's set_simd), False: portable */
        level = arg == Py_True ? 2 : 0;
    if (level < 0 || level > 2) {
        PyErr_Format(PyExc_ValueError, "set_simd takes 0 (portable), 1 (AVX2) or 2 (AVX-512), got %ld", level);
        return NULL;
    }
    narrow_level = (int)level < narrow_best ? (int)level : narrow_best;
    return PyLong_FromLong(narrow_level);
}

PyDoc_STRVAR(checksum_doc,
"checksum64(buf) -> int\n\n"
"XXH3-64 of a contiguous buffer, as xxhash.xxh3_64_intdigest returns it.\n"
"Releases the GIL for buffers of 16 KiB and more.");

static PyObject *
checksum64(PyObject *self, PyObject *arg)
{
    Py_buffer view;
    XXH64_hash_t h;
    (void)self;
    if (!PyObject_CheckBuffer(arg)) {
        PyErr_Format(PyExc_TypeError, "checksum64 needs a bytes-like buffer, got %.100s",
                     Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len >= CHECKSUM_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        h = tk_xxh3_64(view.buf, (size_t)view.len, 0);
        Py_END_ALLOW_THREADS
    } else {
        h = tk_xxh3_64(view.buf, (size_t)view.len, 0);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

PyDoc_STRVAR(copy_checksums_doc,
"copy_checksums(dst, src) -> list[int]\n\n"
"Copies each row of src (a 2-D buffer of bytes, rows contiguous; or a list of contiguous\n"
"buffers of one row's bytes each) into the same row of dst (a 2-D buffer of bytes, rows\n"
"contiguous, writable, as many rows) and returns each row's checksum64, as the copy\n"
"followed by checksum64 of every row would, in one pass over the memory. The buffers must\n"
"not overlap. Releases the GIL for batches of 16 KiB and more.");

/* A 2-D view of bytes whose rows are contiguous (strides[1] == 1 where there are two or
 * more columns); any row stride. */
static int
get_rows(PyObject *obj, Py_buffer *v, int flags, const char *what)
{
    if (PyObject_GetBuffer(obj, v, flags | PyBUF_STRIDES | PyBUF_FORMAT) < 0)
        return -1;
    if (v->ndim != 2 || v->itemsize != 1 || (v->shape[1] > 1 && v->strides[1] != 1)) {
        PyErr_Format(PyExc_ValueError, "copy_checksums: %s must be a 2-D buffer of bytes with contiguous rows"
                     " (ndim %d, itemsize %zd)", what, v->ndim, v->itemsize);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

/* The bytes [lo, hi) a 2-D view's rows of w bytes span, whatever the sign of its row stride. */
static void
span_of(const Py_buffer *v, Py_ssize_t w, const char **lo, const char **hi)
{
    Py_ssize_t n = v->shape[0], step = v->strides[0];
    const char *a = v->buf, *b = (const char *)v->buf + (n > 0 ? (n - 1) * step : 0);
    *lo = a < b ? a : b;
    *hi = (a < b ? b : a) + w;
}

/* The rows of src for copy_checksums: one 2-D buffer (*whole), or one buffer a row (views,
 * n of them, each of w contiguous bytes); row i starts at starts[i]. */
static int
src_rows(PyObject *src, Py_ssize_t n, Py_ssize_t w, Py_buffer *whole, Py_buffer *views, const char **starts)
{
    if (!PyList_Check(src) && !PyTuple_Check(src)) {
        if (get_rows(src, whole, 0, "src") < 0)
            return -1;
        if (whole->shape[0] != n || whole->shape[1] != w) {
            PyErr_Format(PyExc_ValueError, "copy_checksums: dst is %zd x %zd bytes, src %zd x %zd", n, w,
                         whole->shape[0], whole->shape[1]);
            PyBuffer_Release(whole);
            return -1;
        }
        for (Py_ssize_t i = 0; i < n; i++)
            starts[i] = (const char *)whole->buf + i * whole->strides[0];
        return 0;
    }
    if (PySequence_Fast_GET_SIZE(src) != n) {
        PyErr_Format(PyExc_ValueError, "copy_checksums: dst has %zd rows, src %zd", n, PySequence_Fast_GET_SIZE(src));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(src, i), &views[i], PyBUF_C_CONTIGUOUS) < 0 ||
            (views[i].len != w && (PyBuffer_Release(&views[i]), 1))) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "copy_checksums: src row %zd is not %zd contiguous bytes", i, w);
            while (i-- > 0)
                PyBuffer_Release(&views[i]);
            return -1;
        }
        starts[i] = views[i].buf;
    }
    return 0;
}

/* Gives back what src_rows took. */
static void
release_src(int listed, Py_buffer *views, Py_ssize_t n, Py_buffer *whole)
{
    if (!listed) {
        PyBuffer_Release(whole);
        return;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        PyBuffer_Release(&views[i]);
}

static PyObject *
copy_checksums(PyObject *self, PyObject *args)
{
    PyObject *dst_obj, *src_obj, *out = NULL;
    Py_buffer d, whole;
    (void)self;
    if (!PyArg_ParseTuple(args, "OO:copy_checksums", &dst_obj, &src_obj))
        return NULL;
    if (get_rows(dst_obj, &d, PyBUF_WRITABLE, "dst") < 0)
        return NULL;
    Py_ssize_t n = d.shape[0], w = d.shape[1];
    int listed = PyList_Check(src_obj) || PyTuple_Check(src_obj);
    uint64_t *sums = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    const char **starts = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(char *));
    Py_buffer *views = listed ? PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_buffer)) : NULL;
    if (sums == NULL || starts == NULL || (listed && views == NULL)) {
        PyErr_NoMemory();
        goto done;
    }
    if (src_rows(src_obj, n, w, &whole, views, starts) < 0)
        goto done;
    const char *dlo, *dhi;
    span_of(&d, w, &dlo, &dhi);
    for (Py_ssize_t i = 0; i < n && w > 0; i++) {
        if (starts[i] < dhi && dlo < starts[i] + w) {   /* a source row within dst's span */
            PyErr_Format(PyExc_ValueError, "copy_checksums: src row %zd overlaps dst", i);
            release_src(listed, views, n, &whole);
            goto done;
        }
    }
    char *dp = d.buf;
    if (n * w >= CHECKSUM_NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = tk_copy_xxh3_64(dp + i * d.strides[0], starts[i], (size_t)w);
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = tk_copy_xxh3_64(dp + i * d.strides[0], starts[i], (size_t)w);
    }
    release_src(listed, views, n, &whole);
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong((unsigned long long)sums[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    PyMem_Free(views);
    PyMem_Free(starts);
    PyMem_Free(sums);
    PyBuffer_Release(&d);
    return out;
}

PyDoc_STRVAR(seal_records_doc,
"seal_records(keys, values, key_bytes, value_bytes, body) -> bytes\n\n"
"For n records stored back to back (keys: n * key_bytes bytes, values: n * value_bytes),\n"
"XXH3-64 of key i followed by the first body bytes of value i, as little-endian uint64s:\n"
"what xxhash.xxh3_64_intdigest(key + value[:body]) gives for each, in one pass.");

static PyObject *
seal_records(PyObject *self, PyObject *args)
{
    Py_buffer keys, vals;
    Py_ssize_t kb, vb, body;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nnn:seal_records", &keys, &vals, &kb, &vb, &body))
        return NULL;
    PyObject *out = NULL;
    uint8_t *scratch = NULL;
    if (kb <= 0 || vb <= 0 || body < 0 || body > vb || keys.len % kb || vals.len % vb
        || keys.len / kb != vals.len / vb) {
        PyErr_Format(PyExc_ValueError, "seal_records: %zd bytes of %zd-byte keys and %zd bytes of %zd-byte values "
                     "(sealing %zd bytes of each) are not one batch of records", keys.len, kb, vals.len, vb, body);
        goto done;
    }
    Py_ssize_t n = keys.len / kb;
    out = PyBytes_FromStringAndSize(NULL, n * 8);
    scratch = PyMem_Malloc((size_t)(kb + body) + 1);
    if (out == NULL || scratch == NULL) {
        Py_CLEAR(out);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *kp = keys.buf, *vp = vals.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(scratch, kp + i * kb, (size_t)kb);
        memcpy(scratch + kb, vp + i * vb, (size_t)body);
        uint64_t h = XXH3_64bits(scratch, (size_t)(kb + body));
        for (int b = 0; b < 8; b++)
            dst[i * 8 + b] = (uint8_t)(h >> (8 * b));
    }
    Py_END_ALLOW_THREADS
done:
    PyMem_Free(scratch);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&vals);
    return out;
}

/* ------------------------------------------------------------------ KeySet */

typedef struct {
    uint64_t w[2];
} Key;

/* One array of 16-byte slots, the all-zero key marking a free slot, so that a probe
 * touches one cache line; the all-zero key itself, if added, is held by has_zero. */
typedef struct {
    PyObject_HEAD
    Key *slots;
    uint8_t *vals;     /* one small value per slot (the store keeps a page's fastest tier here) */
    uint8_t zero_val;  /* value of the all-zero key */
    size_t mask;       /* capacity - 1; capacity is a power of two */
    int shift;         /* 64 - log2(capacity) */
    int has_zero;      /* whether the all-zero key is in the set */
    Py_ssize_t count;  /* keys in the set, the all-zero one included */
} KeySetObject;

static inline int
key_is_zero(const Key *k)
{
    return (k->w[0] | k->w[1]) == 0;
}

/* Page keys are xxh3 digests and already uniform, but the set must not degrade on
 * structured keys (tests, hand-made ones): one Fibonacci multiply costs ~1 ns. */
static inline size_t
ks_home(const KeySetObject *s, const Key *k)
{
    return (size_t)(((k->w[0] ^ k->w[1]) * UINT64_C(0x9E3779B97F4A7C15)) >> s->shift);
}

/* Slot of the non-zero key k, or -1. Terminates: the load stays below 0.7. */
static Py_ssize_t
ks_find(const KeySetObject *s, const Key *k)
{
    size_t i = ks_home(s, k);
    while (!key_is_zero(&s->slots[i])) {
        if (s->slots[i].w[0] == k->w[0] && s->slots[i].w[1] == k->w[1])
            return (Py_ssize_t)i;
        i = (i + 1) & s->mask;
    }
    return -1;
}

static inline int
ks_has(const KeySetObject *s, const Key *k)
{
    return key_is_zero(k) ? s->has_zero : ks_find(s, k) >= 0;
}

static void
ks_insert_absent(KeySetObject *s, const Key *k, uint8_t v)
{
    size_t i = ks_home(s, k);
    while (!key_is_zero(&s->slots[i]))
        i = (i + 1) & s->mask;
    s->slots[i] = *k;
    s->vals[i] = v;
    s->count++;
}

/* Replaces the table by an empty one of capacity 2**log2cap, rehashing the old keys
 * when keep is set. On allocation failure sets MemoryError and changes nothing. */
static int
ks_rebuild(KeySetObject *s, int log2cap, int keep)
{
    if (log2cap > 56) {
        PyErr_NoMemory();
        return -1;
    }
    size_t cap = (size_t)1 << log2cap;
    Key *slots = PyMem_Calloc(cap, sizeof(Key));
    uint8_t *vals = PyMem_Calloc(cap, 1);
    if (slots == NULL || vals == NULL) {
        PyMem_Free(slots);
        PyMem_Free(vals);
        PyErr_NoMemory();
        return -1;
    }
    Key *old = s->slots;
    uint8_t *old_vals = s->vals;
    size_t old_cap = old != NULL ? s->mask + 1 : 0;
    s->slots = slots;
    s->vals = vals;
    s->mask = cap - 1;
    s->shift = 64 - log2cap;
    s->has_zero = keep && s->has_zero;
    s->count = s->has_zero;
    for (size_t i = 0; keep && i < old_cap; i++)
        if (!key_is_zero(&old[i]))
            ks_insert_absent(s, &old[i], old_vals[i]);
    PyMem_Free(old);
    PyMem_Free(old_vals);
    return 0;
}

static int
ks_key_from(PyObject *obj, Key *out)
{
    Py_buffer view;
    if (PyBytes_Check(obj)) {
        if (PyBytes_GET_SIZE(obj) != KEY_BYTES) {
            PyErr_Format(PyExc_ValueError, "page key must be %d bytes, got %zd", KEY_BYTES,
                         PyBytes_GET_SIZE(obj));
            return -1;
        }
        memcpy(out, PyBytes_AS_STRING(obj), KEY_BYTES);
        return 0;
    }
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "page key must be bytes, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return -1;
    int rc = 0;
    if (view.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "page key must be %d bytes, got %zd", KEY_BYTES, view.len);
        rc = -1;
    } else {
        memcpy(out, view.buf, KEY_BYTES);
    }
    PyBuffer_Release(&view);
    return rc;
}

static PyObject *
ks_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, ":KeySet", kwlist))
        return NULL;
    KeySetObject *s = (KeySetObject *)type->tp_alloc(type, 0);
    if (s == NULL)
        return NULL;
    if (ks_rebuild(s, KEYSET_MIN_LOG2, 0) < 0) {
        Py_DECREF(s);
        return NULL;
    }
    return (PyObject *)s;
}

static void
ks_dealloc(KeySetObject *s)
{
    PyMem_Free(s->slots);
    PyMem_Free(s->vals);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyObject *
ks_add(KeySetObject *s, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"key", "value", NULL};
    PyObject *arg;
    unsigned char v = 0;
    Key k;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|b:add", kwlist, &arg, &v))
        return NULL;
    if (ks_key_from(arg, &k) < 0)
        return NULL;
    if (key_is_zero(&k)) {
        s->count += !s->has_zero;
        s->has_zero = 1;
        s->zero_val = v;
        Py_RETURN_NONE;
    }
    Py_ssize_t found = ks_find(s, &k);
    if (found >= 0) {
        s->vals[found] = v;
        Py_RETURN_NONE;
    }
    size_t cap = s->mask + 1;
    if (((size_t)s->count + 1) * 10 > cap * 7 && ks_rebuild(s, 65 - s->shift, 1) < 0)
        return NULL;
    ks_insert_absent(s, &k, v);
    Py_RETURN_NONE;
}

static PyObject *
ks_get(KeySetObject *s, PyObject *arg)
{
    Key k;
    if (ks_key_from(arg, &k) < 0)
        return NULL;
    if (key_is_zero(&k)) {
        if (s->has_zero)
            return PyLong_FromLong(s->zero_val);
        Py_RETURN_NONE;
    }
    Py_ssize_t found = ks_find(s, &k);
    if (found < 0)
        Py_RETURN_NONE;
    return PyLong_FromLong(s->vals[found]);
}

static PyObject *
ks_discard(KeySetObject *s, PyObject *arg)
{
    Key k;
    if (ks_key_from(arg, &k) < 0)
        return NULL;
    if (key_is_zero(&k)) {
        s->count -= s->has_zero;
        s->has_zero = 0;
        Py_RETURN_NONE;
    }
    Py_ssize_t found = ks_find(s, &k);
    if (found < 0)
        Py_RETURN_NONE;
    /* Backward-shift deletion: pull later entries of the run into the hole unless
     * their home lies cyclically in (hole, j], so no tombstones are ever needed. */
    size_t hole = (size_t)found, j = hole;
    for (;;) {
        j = (j + 1) & s->mask;
        if (key_is_zero(&s->slots[j]))
            break;
        size_t home = ks_home(s, &s->slots[j]);
        int stays = j > hole ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            s->slots[hole] = s->slots[j];
            s->vals[hole] = s->vals[j];
            hole = j;
        }
    }
    memset(&s->slots[hole], 0, sizeof(Key));
    s->vals[hole] = 0;
    s->count--;
    Py_RETURN_NONE;
}

static PyObject *
ks_clear(KeySetObject *s, PyObject *Py_UNUSED(ignored))
{
    if (ks_rebuild(s, KEYSET_MIN_LOG2, 0) < 0) { /* cannot shrink: empty the table in place */
        PyErr_Clear();
        memset(s->slots, 0, (s->mask + 1) * sizeof(Key));
        memset(s->vals, 0, s->mask + 1);
        s->has_zero = 0;
        s->count = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *
ks_prefix_len(KeySetObject *s, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"blob", "start", NULL};
    Py_buffer blob;
    Py_ssize_t start = 0, i;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|n:prefix_len", kwlist, &blob, &start))
        return NULL;
    Py_ssize_t n = blob.len / KEY_BYTES;
    if (blob.len % KEY_BYTES != 0 || start < 0 || start > n) {
        if (blob.len % KEY_BYTES != 0)
            PyErr_Format(PyExc_ValueError, "blob must hold whole %d-byte keys, got %zd bytes",
                         KEY_BYTES, blob.len);
        else
            PyErr_Format(PyExc_ValueError, "start must lie in [0, %zd], got %zd", n, start);
        PyBuffer_Release(&blob);
        return NULL;
    }
    /* Keeps the GIL: another thread's add() could otherwise move the table under us. */
    const uint8_t *p = blob.buf;
    for (i = start; i < n; i++) {
        Key k;
        if (i + PREFETCH_AHEAD < n) { /* lookups are independent: overlap their misses */
            memcpy(&k, p + (i + PREFETCH_AHEAD) * KEY_BYTES, KEY_BYTES);
            size_t ahead = ks_home(s, &k);
            PREFETCH(&s->slots[ahead]);
        }
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        if (!ks_has(s, &k))
            break;
    }
    PyBuffer_Release(&blob);
    return PyLong_FromSsize_t(i - start);
}

/* Values of the leading present keys of a blob, one byte each, as bytes. */
static PyObject *
ks_prefix_values(KeySetObject *s, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"blob", NULL};
    Py_buffer blob;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*:prefix_values", kwlist, &blob))
        return NULL;
    if (blob.len % KEY_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "blob must hold whole %d-byte keys, got %zd bytes", KEY_BYTES, blob.len);
        PyBuffer_Release(&blob);
        return NULL;
    }
    Py_ssize_t n = blob.len / KEY_BYTES, i;
    PyObject *out = PyBytes_FromStringAndSize(NULL, n);
    if (out == NULL) {
        PyBuffer_Release(&blob);
        return NULL;
    }
    uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
    const uint8_t *p = blob.buf;
    for (i = 0; i < n; i++) {
        Key k;
        if (i + PREFETCH_AHEAD < n) {
            memcpy(&k, p + (i + PREFETCH_AHEAD) * KEY_BYTES, KEY_BYTES);
            PREFETCH(&s->slots[ks_home(s, &k)]);
        }
        memcpy(&k, p + i * KEY_BYTES, KEY_BYTES);
        if (key_is_zero(&k)) {
            if (!s->has_zero)
                break;
            dst[i] = s->zero_val;
            continue;
        }
        Py_ssize_t found = ks_find(s, &k);
        if (found < 0)
            break;
        dst[i] = s->vals[found];
    }
    PyBuffer_Release(&blob);
    if (i < n && _PyBytes_Resize(&out, i) < 0)
        return NULL;
    return out;
}

static Py_ssize_t
ks_len(KeySetObject *s)
{
    return s->count;
}

static int
ks_contains(KeySetObject *s, PyObject *arg)
{
    Key k;
    if (ks_key_from(arg, &k) < 0)
        return -1;
    return ks_has(s, &k);
}

static PyMethodDef ks_methods[] = {
    {"add", (PyCFunction)(void (*)(void))ks_add, METH_VARARGS | METH_KEYWORDS,
     "add(key, value=0): insert a 16-byte key with a value in [0, 255], or set the value of a present one."},
    {"get", (PyCFunction)ks_get, METH_O, "get(key): the key's value, or None if absent."},
    {"prefix_values", (PyCFunction)(void (*)(void))ks_prefix_values, METH_VARARGS | METH_KEYWORDS,
     "prefix_values(blob): bytes holding the value of each leading present key of the blob."},
    {"discard", (PyCFunction)ks_discard, METH_O, "discard(key): remove a 16-byte key if present."},
    {"clear", (PyCFunction)ks_clear, METH_NOARGS, "clear(): remove every key and shrink."},
    {"prefix_len", (PyCFunction)(void (*)(void))ks_prefix_len, METH_VARARGS | METH_KEYWORDS,
     "prefix_len(blob, start=0) -> int\n\nblob holds n keys of 16 bytes. Returns how many "
     "consecutive keys, from key index start on, are present (stops at the first absent one)."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ks_as_sequence = {
    .sq_length = (lenfunc)ks_len,
    .sq_contains = (objobjproc)ks_contains,
};

PyDoc_STRVAR(ks_doc,
"KeySet()\n\n"
"A set of 16-byte page keys: open addressing, linear probing, backward-shift\n"
"deletion, load factor below 0.7, grows by doubling. Keys may be any bytes-like\n"
"object of 16 bytes; another length raises ValueError, a non-buffer TypeError.\n"
"Not thread-safe for compound use: the caller holds a lock. Each call holds the\n"
"GIL throughout, so concurrent misuse gives wrong answers, never a crash.");

static PyTypeObject KeySetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierkv._native.KeySet",
    .tp_basicsize = sizeof(KeySetObject),
    .tp_dealloc = (destructor)ks_dealloc,
    .tp_as_sequence = &ks_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = ks_doc,
    .tp_methods = ks_methods,
    .tp_new = ks_new,
};

/* ------------------------------------------------------- landing records */
/* A layer-by-layer get announces the layers that have landed in a word another
 * process (or thread) polls: the word's store must not become visible before the
 * bytes it announces, nor the poller's reads of those bytes happen before its load
 * of the word. Release and acquire give that on every CPU (x86's TSO gives it for
 * free; Arm's weaker ordering does not). */

static int
word_at(PyObject *obj, Py_ssize_t index, Py_buffer *view, uint64_t **word)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0)
        return -1;
    if (index < 0 || (size_t)view->len < (size_t)(index + 1) * sizeof(uint64_t)
        || ((uintptr_t)view->buf % sizeof(uint64_t)) != 0) {
        PyErr_Format(PyExc_ValueError, "word %zd is outside an aligned buffer of %zd bytes", index, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    *word = (uint64_t *)view->buf + index;
    return 0;
}

static PyObject *
store_release_u64(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t index;
    unsigned long long value;
    Py_buffer view;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "OnK", &obj, &index, &value) || word_at(obj, index, &view, &word) < 0)
        return NULL;
    __atomic_store_n(word, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *
load_acquire_u64(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t index;
    Py_buffer view;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "On", &obj, &index) || word_at(obj, index, &view, &word) < 0)
        return NULL;
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(value);
}

PyDoc_STRVAR(store_release_doc,
"store_release_u64(buffer, index, value): write uint64 word ``index`` of a writable,\n"
"8-byte-aligned buffer with release ordering (the bytes written before it are seen first).");
PyDoc_STRVAR(load_acquire_doc,
"load_acquire_u64(buffer, index) -> int: read uint64 word ``index`` with acquire ordering.");

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"set_simd", set_simd, METH_O, set_simd_doc},
    {"chain_xxh3_128", (PyCFunction)(void (*)(void))chain_xxh3_128, METH_VARARGS | METH_KEYWORDS,
     chain_doc},
    {"narrow_ids", py_narrow_ids, METH_VARARGS, narrow_doc},
    {"checksum64", checksum64, METH_O, checksum_doc},
    {"copy_checksums", copy_checksums, METH_VARARGS, copy_checksums_doc},
    {"seal_records", seal_records, METH_VARARGS, seal_records_doc},
    {"store_release_u64", store_release_u64, METH_VARARGS, store_release_doc},
    {"load_acquire_u64", load_acquire_u64, METH_VARARGS, load_acquire_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tierkv._native",
    .m_doc = "Compiled page-key chain (xxh3-128), KeySet and checksum64 for tierkv.keys.",
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&KeySetType) < 0)
        return NULL;
#ifdef NARROW_X86
    __builtin_cpu_init();
    narrow_best = __builtin_cpu_supports("avx512f") ? 2 : __builtin_cpu_supports("avx2") ? 1 : 0;
#endif
    narrow_level = narrow_best;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeySet", (PyObject *)&KeySetType) < 0
        || PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0
        || PyModule_AddIntConstant(m, "XXH_VERSION", XXH_VERSION_NUMBER) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
