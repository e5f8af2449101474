/*
 * AVX-512 rANS, both ways, 64 interleaved states as four vectors of sixteen: the
 * decoder's symbols (a slot-table gather on AMD, a binary search over the cumulative
 * frequencies in registers elsewhere or beside it, renormalisation by expanding the
 * next words into the lanes that need one) and the encoder's (exact quotients from
 * single-precision reciprocals and a remainder check where the frequencies sum to 2^10
 * or more, from double-precision ones elsewhere; the shed words compressed into a
 * masked store). codec_planes.c and
 * codec_enc.c call them where have_avx512_bw(); their scalar loops do the same.
 */
#include "codec_simd.h"

/* Vectors of a chunk that gather where gathers run (use_gather): three gathers and one
 * search measured best on Zen 4 (1.70 GB/s vs 1.66 with two, 1.64 with four). */
#define GATHERS 3

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

/* The next nsyms symbols of one context, sixty-four lanes a chunk as four vectors of
 * sixteen. Vectors v < ngather look each slot up in the context's slot table (sym |
 * freq << 8 | bias << 20, as the scalar decoder reads it) with a gather; the others
 * find the symbol's rank by a binary search over the cumulative frequencies held in
 * registers (permutes): the two use different units (loads, shuffles). Each step is taken for the four vectors together so that their
 * chains overlap; `ngather`, `wide` and `first` are constants in each instantiation
 * (the search unrolls). Renormalisation expands the next words of the stream into the
 * lanes that need one, vector 0 first. */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline size_t
syms_kernel(const int ngather, const int wide, const int first, uint32_t *xs, const uint8_t **pp,
            const uint8_t *end, const uint32_t *slots, const int32_t *tabs, int pbits, uint8_t *out, size_t nsyms)
{
    __m512i cum[4], fr[4], id[4];
    for (int i = 0; i < 4; i++) {
        cum[i] = _mm512_loadu_si512(tabs + 16 * i);
        fr[i] = _mm512_loadu_si512(tabs + 64 + 16 * i);
        id[i] = _mm512_loadu_si512(tabs + 128 + 16 * i);
    }
    const __m512i smask = _mm512_set1_epi32((1 << pbits) - 1), lim = _mm512_set1_epi32((int)RANS_L);
    const __m512i fmask = _mm512_set1_epi32(0xFFF), low8 = _mm512_set1_epi32(0xFF);
    const __m128i sh = _mm_cvtsi32_si128(pbits);
    const uint8_t *p = *pp;
    __m512i x[4], k[4], slot[4];
    for (int v = 0; v < 4; v++) x[v] = _mm512_loadu_si512(xs + 16 * v);
    size_t r = 0;
    /* a chunk takes at most a word per lane; its last vector's 32-byte read starts at most
     * 96 bytes in */
    for (; r + LANES <= nsyms && (size_t)(end - p) >= 2 * LANES; r += LANES, out += LANES) {
        for (int v = 0; v < 4; v++) {
            slot[v] = _mm512_and_si512(x[v], smask);
            k[v] = v < ngather ? _mm512_i32gather_epi32(slot[v], (const void *)slots, 4) : _mm512_setzero_si512();
        }
        for (int step = first; step; step >>= 1)
            for (int v = ngather; v < 4; v++) {
                __m512i t = _mm512_add_epi32(k[v], _mm512_set1_epi32(step));
                k[v] = _mm512_mask_mov_epi32(k[v], _mm512_cmple_epu32_mask(lookup(wide, t, cum), slot[v]), t);
            }
        __mmask16 need[4];
        for (int v = 0; v < 4; v++) {
            __m512i hi = _mm512_srl_epi32(x[v], sh);
            if (v < ngather) {   /* k holds the slot's table entry */
                x[v] = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(k[v], 8), fmask), hi),
                                        _mm512_srli_epi32(k[v], 20));
                k[v] = _mm512_and_si512(k[v], low8);
            } else {             /* k holds the symbol's rank */
                __m512i f = lookup(wide, k[v], fr), st = lookup(wide, k[v], cum);
                x[v] = _mm512_add_epi32(_mm512_mullo_epi32(f, hi), _mm512_sub_epi32(slot[v], st));
                k[v] = lookup(wide, k[v], id);
            }
            need[v] = _mm512_cmplt_epu32_mask(x[v], lim);
        }
        for (int v = 0; v < 4; v++) {
            __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
            p += 2 * (size_t)__builtin_popcount((unsigned)need[v]);
            x[v] = _mm512_mask_mov_epi32(x[v], need[v], _mm512_or_si512(_mm512_slli_epi32(x[v], 16),
                                                                        _mm512_maskz_expand_epi32(need[v], words)));
        }
        for (int v = 0; v < 4; v++) _mm_storeu_si128((__m128i *)(out + 16 * v), _mm512_cvtepi32_epi8(k[v]));
    }
    for (int v = 0; v < 4; v++) _mm512_storeu_si512(xs + 16 * v, x[v]);
    *pp = p;
    return r;
}

/* The search's register tables of a context: cumulative frequency, frequency, symbol, by
 * rank among the present symbols; returns their number (65: more than 64, no tables). */
static int
search_tables(const uint16_t *freq, const uint16_t *start, int alpha, int pbits, int32_t *tabs)
{
    int np = 0;
    for (int i = 0; i < alpha; i++) {
        if (!freq[i]) continue;
        if (np == 64) return 65;
        tabs[np] = start[i];
        tabs[64 + np] = freq[i];
        tabs[128 + np++] = i;
    }
    for (int i = np; i < 64; i++) {   /* never <= a slot, so the search never lands here */
        tabs[i] = 1 << pbits;
        tabs[64 + i] = tabs[128 + i] = 0;
    }
    return np;
}

#define TK_SEARCHES(NG, NP, ...)                                                  \
    ((NP) > 32 ? syms_kernel(NG, 1, 32, __VA_ARGS__)                              \
     : (NP) > 16 ? syms_kernel(NG, 0, 16, __VA_ARGS__)                            \
     : (NP) > 8 ? syms_kernel(NG, 0, 8, __VA_ARGS__)                              \
     : (NP) > 4 ? syms_kernel(NG, 0, 4, __VA_ARGS__)                              \
     : (NP) > 2 ? syms_kernel(NG, 0, 2, __VA_ARGS__) : syms_kernel(NG, 0, 1, __VA_ARGS__))

/* The next nsyms symbols of one context (lane j decodes symbols j, j + 64, ...) into
 * out; stops before a chunk whose words might run past end. `slots` (the context's slot
 * table, or NULL) allows gathers: then GATHERS of the four vectors gather and the others
 * search (all gather where the context has over 64 symbols); without it all search.
 * Returns the symbols decoded, a multiple of 64 (0 when neither can run: the caller
 * goes scalar). */
__attribute__((target("avx512f,avx512bw"))) size_t
decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                   const uint16_t *start, int alpha, int pbits, const uint32_t *slots, uint8_t *out, size_t nsyms)
{
    int32_t tabs[192];
    int np = search_tables(freq, start, alpha, pbits, tabs);
    if (np > 64) return slots ? syms_kernel(4, 0, 1, xs, pp, end, slots, tabs, pbits, out, nsyms) : 0;
    if (slots) return TK_SEARCHES(GATHERS, np, xs, pp, end, slots, tabs, pbits, out, nsyms);
    return TK_SEARCHES(0, np, xs, pp, end, slots, tabs, pbits, out, nsyms);
}

/* Entry i of a table of doubles held in nreg (2, 4 or 8) registers: 16, 32 or 64
 * entries, i in 64-bit lanes. */
__attribute__((target("avx512f"), always_inline)) static inline __m512d
lookup_pd(const int nreg, __m512i i, const __m512d *tab)
{
    __m512d r = _mm512_permutex2var_pd(tab[0], i, tab[1]);
    if (nreg == 2) return r;
    r = _mm512_mask_blend_pd(_mm512_test_epi64_mask(i, _mm512_set1_epi64(16)), r,
                             _mm512_permutex2var_pd(tab[2], i, tab[3]));
    if (nreg == 4) return r;
    __m512d h = _mm512_mask_blend_pd(_mm512_test_epi64_mask(i, _mm512_set1_epi64(16)),
                                     _mm512_permutex2var_pd(tab[4], i, tab[5]), _mm512_permutex2var_pd(tab[6], i, tab[7]));
    return _mm512_mask_blend_pd(_mm512_test_epi64_mask(i, _mm512_set1_epi64(32)), r, h);
}

/* floor(y / f) for eight 32-bit y (half a vector's lanes), from r = 1/f rounded to
 * double: floor((y + 1/2) * r) is exact. With y = q f + j (0 <= j < f), (y + 1/2) / f
 * = q + (j + 1/2) / f lies at least 1 / (2f) from an integer, while y + 1/2 is exact and
 * r's and the product's roundings (2^-53 each, relative) move it by under
 * (y + 1/2) 2^-52 / f: less than 1 / (2f) for any y < 2^51. (Also checked exhaustively
 * at every multiple of every f <= 2^11 below 2^32 and one below it.) Used for the
 * 2^8 tables, whose quotients reach 2^24: next_state_f32 takes the others. */
__attribute__((target("avx512f"), always_inline)) static inline __m256i
quotients(__m256i y, __m512d r)
{
    __m512d yd = _mm512_add_pd(_mm512_cvtepu32_pd(y), _mm512_set1_pd(0.5));
    return _mm512_cvttpd_epu32(_mm512_mul_pd(yd, r));
}

/* floor(y / f), exactly, for sixteen y < 2^32 whose quotients are below 2^22, from a
 * single-precision 1/f: y, 1/f and their product are each rounded by at most 2^-24
 * (relative), so the estimate lies within 3 * 2^-24 * 2^22 < 1 of y / f and its
 * truncation is the quotient or one off either way, which the remainder tells.
 * Returns x' = q (2^pbits - f) + y + start for the exact q (tools/check_rans_quotients.c
 * checks every f and quotient). */
__attribute__((target("avx512f"), always_inline)) static inline __m512i
next_state_f32(__m512i y, __m512 r, __m512i sf, __m512i start, __m128i pb, __m512i one_p)
{
    __m512i q = _mm512_cvttps_epu32(_mm512_mul_ps(_mm512_cvtepu32_ps(y), r));
    __m512i x = _mm512_add_epi32(_mm512_mullo_epi32(q, sf), _mm512_add_epi32(y, start));
    /* the remainder y - q f = x - (q << pbits) - start lies in [-f, 2f) */
    __m512i rem = _mm512_sub_epi32(_mm512_sub_epi32(x, _mm512_sll_epi32(q, pb)), start);
    __mmask16 over = _mm512_cmplt_epi32_mask(rem, _mm512_setzero_si512());
    __mmask16 under = _mm512_cmpge_epi32_mask(rem, _mm512_sub_epi32(one_p, sf));
    x = _mm512_mask_sub_epi32(x, over, x, sf);
    return _mm512_mask_add_epi32(x, under, x, sf);
}

/* encode_syms_avx512 for tables of nreg registers of doubles (a constant), or with
 * single-precision reciprocals (f32, where every quotient is below 2^22: pbits >= 10). */
__attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) static inline void
encode_kernel(const int nreg, const int f32, uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms,
              const EncTables *et)
{
    const int wide = nreg == 8;
    __m512i sf[4], st[4], xm[4], rf[4];
    __m512d rc[8];
    for (int i = 0; i < 4; i++) {
        sf[i] = _mm512_loadu_si512(et->t[0] + 16 * i);
        st[i] = _mm512_loadu_si512(et->t[1] + 16 * i);
        xm[i] = _mm512_loadu_si512(et->t[2] + 16 * i);
        rf[i] = _mm512_castps_si512(_mm512_loadu_ps(et->rcpf + 16 * i));
    }
    for (int i = 0; i < nreg; i++) rc[i] = _mm512_loadu_pd(et->rcp + 8 * i);
    const __m512i lo16 = _mm512_set1_epi32(0xFFFF), one_p = _mm512_set1_epi32(1 << et->pbits);
    const __m128i pb = _mm_cvtsi32_si128(et->pbits);
    uint8_t *p = *pp;
    __m512i x[4];
    for (int v = 0; v < 4; v++) x[v] = _mm512_loadu_si512(xs + 16 * v);
    for (size_t c0 = nsyms; c0 > 0;) {
        c0 -= LANES;
        for (int v = 3; v >= 0; v--) {
            __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(syms + c0 + 16 * v)));
            __m512i sf_ = lookup(wide, s, sf), start = lookup(wide, s, st), xmax1 = lookup(wide, s, xm);
            __mmask16 shed = _mm512_cmpgt_epu32_mask(x[v], xmax1);
            unsigned n = (unsigned)__builtin_popcount((unsigned)shed);
            __m256i words = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(shed, _mm512_and_si512(x[v], lo16)));
            p -= 2 * n;
            _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), words);
            __m512i y = _mm512_mask_srli_epi32(x[v], shed, x[v], 16);
            if (f32) {
                x[v] = next_state_f32(y, _mm512_castsi512_ps(lookup(wide, s, rf)), sf_, start, pb, one_p);
                continue;
            }
            __m512d rl = lookup_pd(nreg, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(s)), rc);
            __m512d rh = lookup_pd(nreg, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(s, 1)), rc);
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(quotients(_mm512_castsi512_si256(y), rl)),
                                           quotients(_mm512_extracti64x4_epi64(y, 1), rh), 1);
            /* x' = (q << pbits) + (y - q * f) + start = q * (2^pbits - f) + y + start */
            x[v] = _mm512_add_epi32(_mm512_mullo_epi32(q, sf_), _mm512_add_epi32(y, start));
        }
    }
    for (int v = 0; v < 4; v++) _mm512_storeu_si512(xs + 16 * v, x[v]);
    *pp = p;
}

/* rANS encoding of nsyms symbols (a multiple of 64; lane j takes symbols j, j + 64, ...)
 * in the exact reverse of the decoder's order: chunks last to first, and in each the
 * vectors of lanes 48-63, 32-47, 16-31, 0-15, each pushing the words its lanes shed
 * below *pp in ascending lane order (a masked store of the compressed low halves). The
 * quotient x / freq comes from the table of reciprocals (quotients: exact). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) void
encode_syms_avx512(uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms, const EncTables *et)
{
    if (et->pbits >= 10) {
        if (et->nreg == 8) encode_kernel(8, 1, xs, pp, syms, nsyms, et);
        else encode_kernel(4, 1, xs, pp, syms, nsyms, et);   /* only the int tables' width matters */
    } else if (et->nreg == 2) {
        encode_kernel(2, 0, xs, pp, syms, nsyms, et);
    } else if (et->nreg == 4) {
        encode_kernel(4, 0, xs, pp, syms, nsyms, et);
    } else {
        encode_kernel(8, 0, xs, pp, syms, nsyms, et);
    }
}

/* decode_side's values: the C channel maxima base + s - SIDE_CENTER from a plane's side
 * symbols s, into dst as elements of isz bytes (1, 2 or 4, the page's element width),
 * computed in 16-bit lanes as the scalar loop does in 32 (base < 256: nothing wraps into
 * 0..emax); an escaped channel's value is the caller's to fill. Returns bit 0 where a
 * value is past emax and bit 1 where a channel escapes. */
__attribute__((target("avx512f,avx512bw"))) uint32_t
side_values_avx512(const uint8_t *sym, size_t C, int base, uint32_t emax, int isz, void *dst)
{
    const __m512i off = _mm512_set1_epi16((short)(base - SIDE_CENTER)), em = _mm512_set1_epi16((short)emax);
    const __m512i escv = _mm512_set1_epi16(SIDE_ALPHA - 1);
    __mmask32 bad = 0, esc = 0;
    for (size_t c = 0; c < C; c += 32) {
        const __mmask32 m = C - c >= 32 ? ~(__mmask32)0 : (__mmask32)((1u << (C - c)) - 1);
        __m512i s = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_maskz_loadu_epi8(m, sym + c)));
        __m512i v = _mm512_add_epi16(s, off);
        const __mmask32 e = _mm512_mask_cmpeq_epi16_mask(m, s, escv);
        esc |= e;
        bad |= _mm512_mask_cmpgt_epu16_mask(m & ~e, v, em);
        v = _mm512_and_si512(v, em);
        if (isz == 2) {
            _mm512_mask_storeu_epi16((uint16_t *)dst + c, m, v);
        } else if (isz == 1) {
            _mm512_mask_cvtepi16_storeu_epi8((uint8_t *)dst + c, m, v);
        } else {
            _mm512_mask_storeu_epi32((uint32_t *)dst + c, (__mmask16)m,
                                     _mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)));
            _mm512_mask_storeu_epi32((uint32_t *)dst + c + 16, (__mmask16)(m >> 16),
                                     _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)));
        }
    }
    return (bad != 0) | (esc != 0) << 1;
}

/* decode_flips' positions without escapes: f[c] = sym[c] + 1 for the C channels;
 * returns whether a symbol is nrows or more. */
__attribute__((target("avx512f,avx512bw"))) int
flip_positions_avx512(const uint8_t *sym, size_t C, uint32_t nrows, uint32_t *f)
{
    const __m512i n = _mm512_set1_epi32((int)nrows), one = _mm512_set1_epi32(1);
    __mmask16 bad = 0;
    for (size_t c = 0; c < C; c += 16) {
        const __mmask16 m = C - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c)) - 1);
        __m512i v = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(m, sym + c)));
        bad |= _mm512_mask_cmpge_epu32_mask(m, v, n);
        _mm512_mask_storeu_epi32(f + c, m, _mm512_add_epi32(v, one));
    }
    return bad != 0;
}

/* floor(w 2^pbits / total) in each lane, exactly, for w < 2^20, w <= total < 2^28 and
 * pbits <= 11 (so w 2^pbits < 2^31 and every product below stays under 2^32): the
 * single-precision estimate (the reciprocal of total rounded to a float) is within
 * 2^-11 of a quotient of at most 2^11, so its truncation is off by at most one, and the
 * products with total say which way (tools/check_level_freqs.c). */
__attribute__((target("avx512f"), always_inline)) static inline __m512i
freq_quotients(__m512i w, __m512i total, __m512 inv, __m128i pb)
{
    const __m512i one = _mm512_set1_epi32(1), x = _mm512_sll_epi32(w, pb);
    __m512i q = _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_cvtepi32_ps(x), inv));
    const __m512i qt = _mm512_mullo_epi32(q, total);
    q = _mm512_mask_sub_epi32(q, _mm512_cmpgt_epu32_mask(qt, x), q, one);
    return _mm512_mask_add_epi32(q, _mm512_cmple_epu32_mask(_mm512_add_epi32(qt, total), x), q, one);
}

/* levels_to_freqs' frequencies before their sum is made 2^pbits (pbits <= 11, alpha <=
 * 256): freq[0..alpha) from the levels, *sum their sum and *top the first largest;
 * -1 where no level is present. */
__attribute__((target("avx512f,avx512bw"))) int
level_freqs_avx512(const uint8_t *levels, int alpha, uint16_t *freq, int pbits, uint32_t *sum, int *top)
{
    const __m512i wbase = _mm512_set_epi32(27, 23, 19, 16, 27, 23, 19, 16, 27, 23, 19, 16, 27, 23, 19, 16);
    const __m512i one = _mm512_set1_epi32(1);
    __m512i w[16], tot = _mm512_setzero_si512();
    const int nv = (alpha + 15) / 16;
    for (int v = 0; v < nv; v++) {   /* the weights W(l), 0 where absent */
        const int left = alpha - 16 * v;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __m512i l = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(m, levels + 16 * v)));
        __m512i lm = _mm512_sub_epi32(l, one);
        w[v] = _mm512_maskz_sllv_epi32(_mm512_test_epi32_mask(l, l), _mm512_permutexvar_epi32(lm, wbase),
                                       _mm512_srli_epi32(lm, 2));
        tot = _mm512_add_epi32(tot, w[v]);
    }
    const uint32_t total = (uint32_t)_mm512_reduce_add_epi32(tot);
    if (total == 0) return -1;
    const __m512i vt = _mm512_set1_epi32((int)total);
    const __m512 inv = _mm512_set1_ps(1.0f / (float)total);
    const __m128i pb = _mm_cvtsi32_si128(pbits);
    __m512i acc = _mm512_setzero_si512(), big = _mm512_setzero_si512(), f[16];
    for (int v = 0; v < nv; v++) {   /* max(1, quotient) where present */
        f[v] = _mm512_maskz_max_epu32(_mm512_test_epi32_mask(w[v], w[v]), freq_quotients(w[v], vt, inv, pb), one);
        acc = _mm512_add_epi32(acc, f[v]);
        big = _mm512_max_epu32(big, f[v]);
        const int left = alpha - 16 * v;
        _mm512_mask_cvtepi32_storeu_epi16(freq + 16 * v, left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1),
                                          f[v]);
    }
    const __m512i most = _mm512_set1_epi32(_mm512_reduce_max_epu32(big));
    *sum = (uint32_t)_mm512_reduce_add_epi32(acc);
    *top = 0;
    for (int v = 0; v < nv; v++) {   /* lanes past alpha hold 0, below any largest */
        const __mmask16 eq = _mm512_cmpeq_epi32_mask(f[v], most);
        if (eq) {
            *top = 16 * v + __builtin_ctz(eq);
            break;
        }
    }
    return 0;
}

#else

size_t
decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                   const uint16_t *start, int alpha, int pbits, const uint32_t *slots, uint8_t *out, size_t nsyms)
{
    (void)xs; (void)pp; (void)end; (void)freq; (void)start; (void)alpha; (void)pbits; (void)slots; (void)out;
    (void)nsyms;
    return 0;
}

void
encode_syms_avx512(uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms, const EncTables *et)
{
    /* never called: have_avx512_bw() is 0 here, so no context has its tables (et_ok) */
    (void)xs; (void)pp; (void)syms; (void)nsyms; (void)et;
}

uint32_t
side_values_avx512(const uint8_t *sym, size_t C, int base, uint32_t emax, int isz, void *dst)
{
    (void)sym; (void)C; (void)base; (void)emax; (void)isz; (void)dst;
    return 0;   /* never called: have_avx512_bw() is 0 here */
}

int
flip_positions_avx512(const uint8_t *sym, size_t C, uint32_t nrows, uint32_t *f)
{
    (void)sym; (void)C; (void)nrows; (void)f;
    return 0;   /* never called: have_avx512_bw() is 0 here */
}

int
level_freqs_avx512(const uint8_t *levels, int alpha, uint16_t *freq, int pbits, uint32_t *sum, int *top)
{
    (void)levels; (void)alpha; (void)freq; (void)pbits; (void)sum; (void)top;
    return -1;   /* never called: have_avx512_bw() is 0 here */
}

#endif

int
enc_tables(EncTables *t, const EncSym *es, const uint16_t *freq, int alpha, int pbits)
{
    if (alpha > 64) return -1;
    memset(t, 0, sizeof(*t));
    for (int i = 0; i < alpha; i++) {   /* absent symbols (never looked up) stay 0: their EncSym is unset */
        if (!freq[i]) continue;
        t->t[0][i] = (int32_t)((1u << pbits) - es[i].freq);
        t->t[1][i] = (int32_t)es[i].start;
        t->t[2][i] = (int32_t)(uint32_t)(es[i].x_max - 1);
        t->rcp[i] = 1.0 / (double)es[i].freq;
        t->rcpf[i] = 1.0f / (float)es[i].freq;
    }
    t->pbits = pbits;
    t->nreg = alpha <= 16 ? 2 : alpha <= 32 ? 4 : 8;
    return 0;
}
