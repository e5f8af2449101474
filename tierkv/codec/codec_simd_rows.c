/*
 * The decoder's SIMD row work (codec_rows.c calls it): sign masks of a plane eight
 * channels a step (AVX-512F), rows of 16- and 8-bit elements assembled in one pass
 * (AVX-512 BW and VBMI: mid fields by a byte permute and a multishift, signs tested
 * out of the channels' sign words), and where VBMI is missing the BMI2 unpacking of
 * mid fields and the AVX2 assembly of 16-bit rows, which GCC's vectoriser does not
 * manage (C's integer promotion widens every shift to 32 bits).
 */
#include "codec_simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* Eight channels of a plane's coded signs (nrows <= 56) from channel c on, their bits
 * from offset k: each one's first-flip row fc, raw rows nraw and bit offset (a prefix sum
 * of 1 + nraw); returns the offset past the eight. */
__attribute__((target("avx512f"), always_inline)) static inline size_t
signs_offsets(const uint32_t *f, size_t k, uint32_t nrows, __m512i *fc, __m512i *nraw, __m512i *off)
{
    const __m512i one = _mm512_set1_epi64(1), n = _mm512_set1_epi64(nrows);
    const __m512i up1 = _mm512_setr_epi64(0, 0, 1, 2, 3, 4, 5, 6), up2 = _mm512_setr_epi64(0, 0, 0, 1, 2, 3, 4, 5);
    const __m512i up4 = _mm512_setr_epi64(0, 0, 0, 0, 0, 1, 2, 3), last = _mm512_set1_epi64(7);
    *fc = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)f));
    *nraw = _mm512_sub_epi64(_mm512_sub_epi64(n, *fc), _mm512_maskz_mov_epi64(_mm512_cmplt_epu64_mask(*fc, n), one));
    __m512i inc = _mm512_add_epi64(*nraw, one), sum = inc;   /* inclusive prefix sum of inc */
    sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xFE, up1, sum));
    sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xFC, up2, sum));
    sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xF0, up4, sum));
    *off = _mm512_add_epi64(_mm512_set1_epi64((long long)k), _mm512_sub_epi64(sum, inc));
    return k + (size_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(_mm512_permutexvar_epi64(last, sum)));
}

/* The eight channels' sign words (the scalar plane_signs' masks) from v, each channel's
 * stream bits from its offset on: its first row's sign, the rows up to fc repeating it,
 * row fc inverting it, the raw rows after. */
__attribute__((target("avx512f"), always_inline)) static inline __m512i
signs_words(__m512i v, __m512i fc, __m512i nraw, uint32_t nrows)
{
    const __m512i one = _mm512_set1_epi64(1), all = _mm512_set1_epi64((long long)((1ull << nrows) - 1));
    __m512i s0 = _mm512_and_si512(v, one);
    __m512i raw = _mm512_and_si512(_mm512_srli_epi64(v, 1), _mm512_sub_epi64(_mm512_sllv_epi64(one, nraw), one));
    __m512i head = _mm512_and_si512(_mm512_sub_epi64(_mm512_setzero_si512(), s0),
                                    _mm512_sub_epi64(_mm512_sllv_epi64(one, fc), one));
    __m512i w = _mm512_or_si512(head, _mm512_sllv_epi64(_mm512_xor_si512(s0, one), fc));
    w = _mm512_or_si512(w, _mm512_sllv_epi64(raw, _mm512_add_epi64(fc, one)));
    return _mm512_and_si512(w, all);
}

/* codec_rows.c's plane_signs for coded signs and nrows <= 56, eight channels a step,
 * their words by a gather. Stops before a group whose words would reach past the
 * section's len bytes (the scalar code zero-pads those); returns the channels done and
 * advances *ks past their bits. */
__attribute__((target("avx512f"))) size_t
plane_signs_avx512(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                   uint32_t nrows, size_t C)
{
    const __m512i seven = _mm512_set1_epi64(7);
    size_t c = 0, k = *ks;
    for (; c + 8 <= C; c += 8) {
        __m512i fc, nraw, off;
        size_t end = signs_offsets(f + c, k, nrows, &fc, &nraw, &off);
        if (((end >> 3) + 8) > len) break;   /* the last word read starts at most at byte end / 8 */
        __m512i v = _mm512_srlv_epi64(_mm512_i64gather_epi64(_mm512_srli_epi64(off, 3), (const void *)sign, 1),
                                      _mm512_and_si512(off, seven));
        _mm512_storeu_si512(sw + c, signs_words(v, fc, nraw, nrows));
        k = end;
    }
    *ks = k;
    return c;
}

/* plane_signs_avx512 with VBMI: a group's eight words come from one read of the bytes
 * they span, where that is at most 64 (a gather otherwise: up to 8 x 56 bits and the
 * last word's 8 bytes may reach 65), and a byte permute that puts each channel's eight
 * bytes in its lane, where a gather of eight loads did. Same results, same stopping
 * rule. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) size_t
plane_signs_vbmi(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                 uint32_t nrows, size_t C)
{
    const __m512i seven = _mm512_set1_epi64(7), iota = _mm512_set1_epi64(0x0706050403020100ll);
    const __m512i low = _mm512_set_epi64(0x0808080808080808ll, 0, 0x0808080808080808ll, 0, 0x0808080808080808ll, 0,
                                         0x0808080808080808ll, 0);   /* each qword's byte 0, eight times */
    size_t c = 0, k = *ks;
    for (; c + 8 <= C; c += 8) {
        __m512i fc, nraw, off;
        size_t end = signs_offsets(f + c, k, nrows, &fc, &nraw, &off);
        if (((end >> 3) + 8) > len) break;   /* the last word read starts at most at byte end / 8 */
        size_t b0 = k >> 3, span = (end >> 3) + 8 - b0;   /* bytes the eight words' reads cover */
        __m512i v;
        if (span <= 64) {
            __m512i win = _mm512_maskz_loadu_epi8(~0ull >> (64 - span), sign + b0);
            __m512i at = _mm512_sub_epi64(_mm512_srli_epi64(off, 3), _mm512_set1_epi64((long long)b0));
            __m512i idx = _mm512_add_epi8(_mm512_shuffle_epi8(at, low), iota);   /* bytes at..at+7 */
            v = _mm512_srlv_epi64(_mm512_permutexvar_epi8(idx, win), _mm512_and_si512(off, seven));
        } else {
            v = _mm512_srlv_epi64(_mm512_i64gather_epi64(_mm512_srli_epi64(off, 3), (const void *)sign, 1),
                                  _mm512_and_si512(off, seven));
        }
        _mm512_storeu_si512(sw + c, signs_words(v, fc, nraw, nrows));
        k = end;
    }
    *ks = k;
    return c;
}

/* Sixteen channels' coded signs for nrows <= 25 (1 + nraw bits each from a bit offset
 * below 8: one 32-bit read), their bits from bit *k of the section on, read through a
 * 64-byte window of its bytes (zero past its len, as bits_at reads them): each
 * channel's sign word (signs_words in 32-bit lanes); *k advances past their bits. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline __m512i
signs16_words(const uint32_t *f, size_t *k, uint32_t nrows, const uint8_t *sign, size_t len)
{
    const __m512i one = _mm512_set1_epi32(1), n = _mm512_set1_epi32((int)nrows), zero = _mm512_setzero_si512();
    const __m512i seven = _mm512_set1_epi32(7), iota = _mm512_set1_epi32(0x03020100);
    const __m512i low = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                         0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const __m512i fc = _mm512_loadu_si512(f);
    const __m512i nraw = _mm512_sub_epi32(_mm512_sub_epi32(n, fc), _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(fc, n), one));
    const __m512i inc = _mm512_add_epi32(nraw, one);
    __m512i sum = inc;   /* inclusive prefix sum of inc: lanes moved up by 1, 2, 4, 8 */
    sum = _mm512_add_epi32(sum, _mm512_alignr_epi32(sum, zero, 15));
    sum = _mm512_add_epi32(sum, _mm512_alignr_epi32(sum, zero, 14));
    sum = _mm512_add_epi32(sum, _mm512_alignr_epi32(sum, zero, 12));
    sum = _mm512_add_epi32(sum, _mm512_alignr_epi32(sum, zero, 8));
    const size_t k0 = *k, b0 = k0 >> 3;
    const __m512i off = _mm512_add_epi32(_mm512_set1_epi32((int)(k0 & 7)), _mm512_sub_epi32(sum, inc));   /* from b0 */
    *k = k0 + (uint32_t)_mm_extract_epi32(_mm512_extracti32x4_epi32(sum, 3), 3);
    size_t span = ((*k) >> 3) + 4 - b0;   /* at most 16 x 25 bits + 7 + 4 bytes: 55 */
    if (b0 >= len) span = 0;
    else if (span > len - b0) span = len - b0;
    const __m512i win = _mm512_maskz_loadu_epi8(span ? ~0ull >> (64 - span) : 0, sign + (b0 < len ? b0 : 0));
    const __m512i idx = _mm512_add_epi8(_mm512_shuffle_epi8(_mm512_srli_epi32(off, 3), low), iota);
    const __m512i v = _mm512_srlv_epi32(_mm512_permutexvar_epi8(idx, win), _mm512_and_si512(off, seven));
    const __m512i s0 = _mm512_and_si512(v, one);
    const __m512i raw = _mm512_and_si512(_mm512_srli_epi32(v, 1), _mm512_sub_epi32(_mm512_sllv_epi32(one, nraw), one));
    const __m512i head = _mm512_and_si512(_mm512_sub_epi32(zero, s0), _mm512_sub_epi32(_mm512_sllv_epi32(one, fc), one));
    __m512i w = _mm512_or_si512(head, _mm512_sllv_epi32(_mm512_xor_si512(s0, one), fc));
    w = _mm512_or_si512(w, _mm512_sllv_epi32(raw, _mm512_add_epi32(fc, one)));
    return _mm512_and_si512(w, _mm512_set1_epi32((int)((1u << nrows) - 1)));
}

/* plane_signs and sign_rows_avx512 at once for coded signs, nrows <= 25 and C a multiple
 * of 64: each group of 64 channels' sign words in 32-bit lanes (four vectors of
 * sixteen), then each row's mask (rows[r * C / 64 + j], bit i: channel 64 j + i) by a byte
 * permute per vector and a byte test per row. Reads past the section's len bytes see
 * zeros, as the scalar reader's do; advances *ks past the plane's bits. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void
plane_sign_rows_vbmi(uint64_t *rows, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                     uint32_t nrows, size_t C)
{
    const size_t G = C / 64;
    const __m512i idx0 = _mm512_set_epi32(0x3C383430, 0x2C282420, 0x1C181410, 0x0C080400, 0x3C383430, 0x2C282420,
                                          0x1C181410, 0x0C080400, 0x3C383430, 0x2C282420, 0x1C181410, 0x0C080400,
                                          0x3C383430, 0x2C282420, 0x1C181410, 0x0C080400);   /* byte p: 4 (p % 16) */
    size_t k = *ks;
    for (size_t j = 0; j < G; j++) {
        __m512i in[4];
        for (int i = 0; i < 4; i++) in[i] = signs16_words(f + 64 * j + 16 * i, &k, nrows, sign, len);
        for (uint32_t b = 0; 8 * b < nrows; b++) {
            const __m512i idx = _mm512_add_epi8(idx0, _mm512_set1_epi8((char)b));
            __m512i bytes = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++)   /* channel 16i + t's byte b to byte 16i + t */
                bytes = _mm512_mask_permutexvar_epi8(bytes, (__mmask64)0xFFFF << (16 * i), idx, in[i]);
            for (uint32_t r = 0; r < 8 && 8 * b + r < nrows; r++)
                rows[(size_t)(8 * b + r) * G + j] = (uint64_t)_mm512_test_epi8_mask(bytes, _mm512_set1_epi8((char)(1u << r)));
        }
    }
    *ks = k;
}

/* The per-page constants of assemble_16_avx512 (mid width w <= 8): qword lane j of the
 * permuted mid bytes holds bytes j*w.. of a group of 64 fields, and byte i of it the
 * field at bit i*w (vpmultishiftqb). */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void
assemble_16_consts(int w, uint8_t *perm, uint8_t *shift)
{
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 8; i++) {
            perm[8 * j + i] = (uint8_t)(j * w + i);
            shift[8 * j + i] = (uint8_t)(i * w);
        }
}

/* A plane's sign masks by row (sign_rows): rows[k * G + j] bit i is the sign of coded
 * row k of channel 64 j + i, for the G = C / 64 whole groups of channels, from the
 * channels' sign words (word q of channel c holds rows 64q..64q+63). Each group's words
 * are eight vectors of eight channels; for each byte b of the words (rows 8b..8b+7) a
 * byte permute per vector gathers the 64 channels' byte b into one vector, and a byte
 * test per row turns it into the row's mask: 8 permutes and 8 tests for 8 rows of 64
 * channels, where testing each channel's word for each row took 8 tests and their
 * merging per row. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void
sign_rows_avx512(const uint64_t *sw, size_t C, uint32_t nrows, uint64_t *rows)
{
    const size_t G = C / 64;
    const __m512i idx0 = _mm512_set_epi64(0x3830282018100800ll, 0x3830282018100800ll, 0x3830282018100800ll,
                                          0x3830282018100800ll, 0x3830282018100800ll, 0x3830282018100800ll,
                                          0x3830282018100800ll, 0x3830282018100800ll);   /* byte p: 8 (p % 8) */
    for (uint32_t q = 0; 64 * q < nrows; q++) {
        const uint32_t left = nrows - 64 * q < 64 ? nrows - 64 * q : 64;
        for (size_t j = 0; j < G; j++) {
            const uint64_t *w = sw + (size_t)q * C + 64 * j;
            __m512i in[8];
            for (int i = 0; i < 8; i++) in[i] = _mm512_loadu_si512(w + 8 * i);
            for (uint32_t b = 0; 8 * b < left; b++) {
                const __m512i idx = _mm512_add_epi8(idx0, _mm512_set1_epi8((char)b));
                __m512i bytes = _mm512_setzero_si512();
                for (int i = 0; i < 8; i++)   /* channel 8i + t's byte b to byte 8i + t */
                    bytes = _mm512_mask_permutexvar_epi8(bytes, (__mmask64)0xFF << (8 * i), idx, in[i]);
                for (uint32_t r = 0; r < 8 && 8 * b + r < left; r++)
                    rows[(size_t)(64 * q + 8 * b + r) * G + j] =
                        (uint64_t)_mm512_test_epi8_mask(bytes, _mm512_set1_epi8((char)(1u << r)));
            }
        }
    }
}

/* Channels c..c+63 of a row, for both assemblers: their mid fields (w <= 8 bits each,
 * from the row's byte-aligned mid bits) one a byte. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline __m512i
row_mid_bytes(const uint8_t *mid, size_t c, int w, __mmask64 need, __m512i vperm, __m512i vshift, __m512i wmask)
{
    __m512i m = _mm512_maskz_loadu_epi8(need, mid + c / 8 * (size_t)w);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(vshift, _mm512_permutexvar_epi8(vperm, m)), wmask);
}

/* The per-page constants of the 16-bit assembly. A symbol s = r << hi | h shifted left
 * by mbits - hi is S = r << mbits | h << (mbits - hi): the exponent's residual and the hi
 * bits already in their places (amask and hmask part them), so that the exponent is
 * (M << mbits) - (r << mbits) under emask, M the channel maximum, and the check r <= M
 * compares the two shifted (no 16-bit value overflows: M < 2^ebits, r < 16). */
typedef struct {
    __m512i vperm, vshift, wmask, amask, hmask, emask, esc, signbit;
    __m128i mbits, hshift, midshift;
    __mmask64 need;
    int w;
} Asm16;

__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline Asm16
asm16_consts(const uint8_t *perm, const uint8_t *shift, const Layout *lay, const Params *pr)
{
    Asm16 k;
    const int hshift = lay->mbits - pr->hi;
    k.w = pr->mid;
    k.vperm = _mm512_loadu_si512(perm);
    k.vshift = _mm512_loadu_si512(shift);
    k.wmask = _mm512_set1_epi8((char)((1u << k.w) - 1));
    k.hmask = _mm512_set1_epi16((short)(((1 << pr->hi) - 1) << hshift));
    k.amask = _mm512_set1_epi16((short)~(((1 << pr->hi) - 1) << hshift));
    k.emask = _mm512_set1_epi16((short)(((1 << lay->ebits) - 1) << lay->mbits));
    k.esc = _mm512_set1_epi16((short)pr->esc);
    k.signbit = _mm512_set1_epi16((short)(1u << (lay->nbits - 1)));
    k.mbits = _mm_cvtsi32_si128(lay->mbits);
    k.hshift = _mm_cvtsi32_si128(hshift);
    k.midshift = _mm_cvtsi32_si128(pr->tz + pr->lo);
    k.need = k.w ? (__mmask64)(~0ull >> (64 - 8 * k.w)) : 0;
    return k;
}

/* Channels c..c+63 of one 16-bit row, their maxima shifted left by mbits in cms (two
 * vectors of 32); returns bit 0 when a residual exceeds its channel maximum, bit 1 when
 * the channels hold escapes. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"), always_inline)) static inline uint32_t
asm16_block(const Asm16 *k, uint16_t *out, const uint8_t *sym, __mmask64 sgn, const __m512i *cms,
            const uint8_t *mid, size_t c)
{
    __mmask32 bad = 0, any_esc = 0;
    __m512i mb = row_mid_bytes(mid, c, k->w, k->need, k->vperm, k->vshift, k->wmask);
    __m512i s8 = _mm512_loadu_si512(sym + c);
    for (int h = 0; h < 2; h++) {
        __m512i s = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(s8, 1) : _mm512_castsi512_si256(s8));
        __m512i m = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(mb, 1) : _mm512_castsi512_si256(mb));
        __m512i sh = _mm512_sll_epi16(s, k->hshift);
        __m512i rs = _mm512_and_si512(sh, k->amask);   /* r << mbits */
        __mmask32 is_esc = _mm512_cmpeq_epi16_mask(s, k->esc);
        bad |= _mm512_mask_cmpgt_epu16_mask((__mmask32)~is_esc, rs, cms[h]);
        any_esc |= is_esc;
        /* (M - r) << mbits under emask, OR the mid field, OR the hi bits (a | b & c) */
        __m512i v = _mm512_ternarylogic_epi32(_mm512_sll_epi16(m, k->midshift), _mm512_sub_epi16(cms[h], rs),
                                              k->emask, 0xF8);
        v = _mm512_ternarylogic_epi32(v, sh, k->hmask, 0xF8);
        v = _mm512_mask_add_epi16(v, (__mmask32)(sgn >> (32 * h)), v, k->signbit);   /* bit 15 is clear: an OR */
        _mm512_storeu_si512(out + c + 32 * h, v);
    }
    return (uint32_t)(bad != 0) | (uint32_t)(any_esc != 0) << 1;
}

/* A row of 16-bit elements, sixty-four channels a step: mid bits unpacked from the
 * stream (fields of w <= 8 bits from byte `mid`, whole rows being byte aligned), signs
 * from the row's masks (sg[j]: channels 64j..64j+63, sign_rows_avx512), exponents and hi
 * bits from the symbols. Returns how many channels it assembled (a multiple of 64) and
 * ORs into *res bit 0 when a residual exceeds its channel maximum, bit 1 when the row
 * holds escapes. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) size_t
assemble_16_avx512(uint16_t *out, const uint8_t *sym, const uint64_t *sg,
                   const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                   size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    const Asm16 k = asm16_consts(perm, shift, lay, pr);
    for (size_t c = 0; c + 64 <= C; c += 64) {
        const __m512i cms[2] = {_mm512_sll_epi16(_mm512_loadu_si512(cmax + c), k.mbits),
                                _mm512_sll_epi16(_mm512_loadu_si512(cmax + c + 32), k.mbits)};
        *res |= asm16_block(&k, out, sym, (__mmask64)sg[c / 64], cms, mid, c);
    }
    return C / 64 * 64;
}

/* assemble_16_avx512 for a plane's nrows coded rows at once, C a multiple of 64: row r
 * from sym + r C, its mid bits from mid + r C w / 8 and its signs from sg + r C / 64, into
 * out[r]; res[r] gets the row's bits. The page's constants are set up once, each group
 * of 64 channels' shifted maxima once for all rows. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) void
assemble_16_rows_avx512(uint16_t *const *out, uint32_t nrows, const uint8_t *sym, const uint64_t *sg,
                        const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                        size_t C, const Layout *lay, const Params *pr, uint8_t *res)
{
    const Asm16 k = asm16_consts(perm, shift, lay, pr);
    const size_t mid_row = C * (size_t)k.w / 8, G = C / 64;
    memset(res, 0, nrows);
    for (size_t c = 0; c < C; c += 64) {
        const __m512i cms[2] = {_mm512_sll_epi16(_mm512_loadu_si512(cmax + c), k.mbits),
                                _mm512_sll_epi16(_mm512_loadu_si512(cmax + c + 32), k.mbits)};
        for (uint32_t r = 0; r < nrows; r++)
            res[r] |= (uint8_t)asm16_block(&k, out[r], sym + (size_t)r * C, (__mmask64)sg[(size_t)r * G + c / 64], cms,
                                           mid + r * mid_row, c);
    }
}

/* assemble_16_avx512 for 8-bit elements (FP8): sixty-four channels a step, all in bytes. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) size_t
assemble_8_avx512(uint8_t *out, const uint8_t *sym, const uint64_t *sg,
                  const uint8_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                  size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    const int w = pr->mid;
    const __m512i vperm = _mm512_loadu_si512(perm), vshift = _mm512_loadu_si512(shift);
    const __m512i wmask = _mm512_set1_epi8((char)((1u << w) - 1));
    const __m512i himask = _mm512_set1_epi8((char)((1 << pr->hi) - 1));
    const __m512i emask = _mm512_set1_epi8((char)((1 << lay->ebits) - 1));
    const __m512i esc = _mm512_set1_epi8((char)pr->esc);
    const __m512i signbit = _mm512_set1_epi8((char)0x80);
    const int hshift = lay->mbits - pr->hi, midshift = pr->tz + pr->lo;
    const __mmask64 need = w ? (__mmask64)(~0ull >> (64 - 8 * w)) : 0;
    __mmask64 bad = 0, any_esc = 0;
    size_t c = 0;
    for (; c + 64 <= C; c += 64) {
        const __mmask64 sgn = (__mmask64)sg[c / 64];
        __m512i m = row_mid_bytes(mid, c, w, need, vperm, vshift, wmask);
        __m512i s = _mm512_loadu_si512(sym + c), cm = _mm512_loadu_si512(cmax + c);
        __m512i r = srl8(s, pr->hi);
        __mmask64 is_esc = _mm512_cmpeq_epi8_mask(s, esc);
        bad |= _mm512_mask_cmpgt_epu8_mask(~is_esc, r, cm);
        any_esc |= is_esc;
        __m512i v = sll8(_mm512_and_si512(_mm512_sub_epi8(cm, r), emask), lay->mbits);
        v = _mm512_or_si512(v, sll8(_mm512_and_si512(s, himask), hshift));
        v = _mm512_or_si512(v, sll8(m, midshift));
        v = _mm512_mask_mov_epi8(v, sgn, _mm512_or_si512(v, signbit));
        _mm512_storeu_si512(out + c, v);
    }
    *res |= (uint32_t)(bad != 0) | (uint32_t)(any_esc != 0) << 1;
    return c;
}

/* Mid fields from bit `bit` on (w <= 7 bits each) as bytes (isz 1) or 16-bit lanes (isz
 * 2), eight per 64-bit read, spread by pdep; returns how many it unpacked (whole groups
 * of 8 that lie inside the stream). */
__attribute__((target("bmi2"))) size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t bit, int w, size_t C)
{
    const uint64_t lane8 = 0x0101010101010101ull * ((1u << w) - 1);
    const uint64_t lane16 = 0x0001000100010001ull * ((1u << w) - 1);
    uint8_t *o8 = out;
    uint16_t *o16 = out;
    size_t c = 0;
    for (; c + 8 <= C; c += 8, bit += 8 * (size_t)w) {
        size_t off = bit, q = off >> 3;
        if (q + 8 > len) break;
        uint64_t v = rd_u64(mid + q) >> (off & 7);
        if (isz == 1) {
            uint64_t b = _pdep_u64(v, lane8);
            memcpy(o8 + c, &b, 8);
        } else {
            uint64_t a = _pdep_u64(v, lane16), b = _pdep_u64(v >> (4 * w), lane16);
            memcpy(o16 + c, &a, 8);
            memcpy(o16 + c + 4, &b, 8);
        }
    }
    return c;
}

__attribute__((target("avx2"))) static inline __m256i
sign_lanes(const uint64_t *sw, __m128i kbit)
{
    const __m256i one = _mm256_set1_epi64x(1);
    __m256i a = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)sw), kbit), one);
    __m256i b = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 4)), kbit), one);
    __m256i c = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 8)), kbit), one);
    __m256i d = _mm256_and_si256(_mm256_srl_epi64(_mm256_loadu_si256((const __m256i *)(sw + 12)), kbit), one);
    /* 64-bit lanes hold 0 or 1; packing pairs of them (32 -> 16 bits) then the permute
     * [0 2 1 3] leaves a..b as eight 32-bit lanes in order; once more gives sixteen
     * 16-bit lanes in order */
    __m256i ab = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    __m256i cd = _mm256_permute4x64_epi64(_mm256_packus_epi32(c, d), 0xD8);
    __m256i abcd = _mm256_packus_epi32(ab, cd);
    return _mm256_permute4x64_epi64(abcd, 0xD8);
}

__attribute__((target("avx2"))) uint32_t
combine_16_avx2(uint16_t *out, const uint8_t *sym, const uint64_t *sw,
                uint32_t kbit, const uint16_t *cmax, const uint16_t *mv, size_t C,
                const Layout *lay, const Params *pr)
{
    const __m128i hi = _mm_cvtsi32_si128(pr->hi), kb = _mm_cvtsi32_si128((int)kbit);
    const __m128i mbits = _mm_cvtsi32_si128(lay->mbits), hshift = _mm_cvtsi32_si128(lay->mbits - pr->hi);
    const __m128i midshift = _mm_cvtsi32_si128(pr->tz + pr->lo);
    const __m128i sshift = _mm_cvtsi32_si128(lay->nbits - 1);
    const __m256i himask = _mm256_set1_epi16((short)((1 << pr->hi) - 1));
    const __m256i emask = _mm256_set1_epi16((short)((1 << lay->ebits) - 1));
    const __m256i esc = _mm256_set1_epi16((short)pr->esc);
    __m256i bad = _mm256_setzero_si256(), any_esc = _mm256_setzero_si256();
    size_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m256i s = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(sym + c)));
        __m256i r = _mm256_srl_epi16(s, hi);
        __m256i cm = _mm256_loadu_si256((const __m256i *)(cmax + c));
        __m256i is_esc = _mm256_cmpeq_epi16(s, esc);
        bad = _mm256_or_si256(bad, _mm256_andnot_si256(is_esc, _mm256_cmpgt_epi16(r, cm)));
        any_esc = _mm256_or_si256(any_esc, is_esc);
        __m256i e = _mm256_sll_epi16(_mm256_and_si256(_mm256_sub_epi16(cm, r), emask), mbits);
        __m256i h = _mm256_sll_epi16(_mm256_and_si256(s, himask), hshift);
        __m256i m = _mm256_sll_epi16(_mm256_loadu_si256((const __m256i *)(mv + c)), midshift);
        __m256i g = _mm256_sll_epi16(sign_lanes(sw + c, kb), sshift);
        __m256i v = _mm256_or_si256(_mm256_or_si256(e, h), _mm256_or_si256(m, g));
        _mm256_storeu_si256((__m256i *)(out + c), v);
    }
    uint32_t res = (uint32_t)!_mm256_testz_si256(bad, bad) | (uint32_t)!_mm256_testz_si256(any_esc, any_esc) << 1;
    const uint32_t h = (uint32_t)pr->hi, hm = (1u << pr->hi) - 1, es = (uint32_t)pr->esc;
    const uint32_t em = (1u << lay->ebits) - 1, mb = (uint32_t)lay->mbits;
    for (; c < C; c++) {
        uint32_t s = sym[c], r = s >> h, g = (uint32_t)(sw[c] >> kbit) & 1;
        res |= (r > cmax[c]) & (s != es);
        res |= (uint32_t)(s == es) << 1;
        out[c] = (uint16_t)(g << (lay->nbits - 1) | ((cmax[c] - r) & em) << mb | (s & hm) << (mb - h)
            | (uint32_t)mv[c] << (pr->tz + pr->lo));
    }
    return res;
}

#else

size_t
plane_signs_avx512(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                   uint32_t nrows, size_t C)
{
    (void)sw; (void)f; (void)sign; (void)len; (void)ks; (void)nrows; (void)C;
    return 0;
}

void
assemble_16_consts(int w, uint8_t *perm, uint8_t *shift)
{
    (void)w; (void)perm; (void)shift;
}

size_t
plane_signs_vbmi(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                 uint32_t nrows, size_t C)
{
    (void)sw; (void)f; (void)sign; (void)len; (void)ks; (void)nrows; (void)C;
    return 0;
}

void
sign_rows_avx512(const uint64_t *sw, size_t C, uint32_t nrows, uint64_t *rows)
{
    (void)sw; (void)C; (void)nrows; (void)rows;
}

size_t
assemble_16_avx512(uint16_t *out, const uint8_t *sym, const uint64_t *sg,
                   const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                   size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    (void)out; (void)sym; (void)sg; (void)cmax; (void)mid; (void)perm; (void)shift; (void)C;
    (void)lay; (void)pr; (void)res;
    return 0;
}

void
assemble_16_rows_avx512(uint16_t *const *out, uint32_t nrows, const uint8_t *sym, const uint64_t *sg,
                        const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                        size_t C, const Layout *lay, const Params *pr, uint8_t *res)
{
    (void)out; (void)nrows; (void)sym; (void)sg; (void)cmax; (void)mid; (void)perm; (void)shift; (void)C;
    (void)lay; (void)pr; (void)res;
}

size_t
assemble_8_avx512(uint8_t *out, const uint8_t *sym, const uint64_t *sg,
                  const uint8_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                  size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    (void)out; (void)sym; (void)sg; (void)cmax; (void)mid; (void)perm; (void)shift; (void)C;
    (void)lay; (void)pr; (void)res;
    return 0;
}

size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t bit, int w, size_t C)
{
    (void)out; (void)isz; (void)mid; (void)len; (void)bit; (void)w; (void)C;
    return 0;
}

uint32_t
combine_16_avx2(uint16_t *out, const uint8_t *sym, const uint64_t *sw,
                uint32_t kbit, const uint16_t *cmax, const uint16_t *mv, size_t C,
                const Layout *lay, const Params *pr)
{
    (void)out; (void)sym; (void)sw; (void)kbit; (void)cmax; (void)mv; (void)C; (void)lay; (void)pr;
    return 1;   /* never called: have_avx2() is 0 */
}

void
plane_sign_rows_vbmi(uint64_t *rows, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                     uint32_t nrows, size_t C)
{
    (void)rows; (void)f; (void)sign; (void)len; (void)ks; (void)nrows; (void)C;   /* never called: no VBMI here */
}

#endif
