/*
 * SIMD paths, chosen at run time (have_avx512, have_avx512_vbmi, use_gather, have_avx2);
 * the scalar code in codec_dec.c, codec_rows.c and codec_scan.c does the same everywhere
 * else, byte for byte:
 * - AVX-512F: rANS symbols, sixteen lanes a vector and four vectors in flight (the 64
 *   lanes of a chunk), so that their dependency chains overlap; renormalisation expands
 *   the next words of the stream into the lanes that need one. The slot -> symbol
 *   lookup gathers from the context's slot table for three vectors of four and runs a
 *   binary search over the cumulative frequencies in registers for the fourth (on AMD),
 *   or searches for all four (elsewhere, where microcode mitigations make gathers
 *   slow).
 * - AVX-512BW + VBMI: a row of 16-bit elements (bf16, fp16) in one pass, sixty-four
 *   channels a step: the mid mantissa fields unpacked from the stream by a byte permute
 *   and a multishift, the signs tested out of the channels' sign words, exponents and
 *   hi bits from the symbols.
 * - BMI2: the fixed-width mid mantissa fields spread into bytes or 16-bit lanes (pdep)
 *   when decoding, and gathered from the elements (pext) when encoding.
 * - AVX2: the row assembly for 16-bit elements where AVX-512 VBMI is missing, sixteen
 *   elements in 16-bit lanes, which GCC's vectoriser does not manage (C's integer
 *   promotion widens every shift to 32 bits).
 */
#include "codec_enc.h"

/* Vectors of a chunk that gather where gathers run (use_gather): three gathers and one
 * search measured best on Zen 4 (1.70 GB/s vs 1.66 with two, 1.64 with four). */
#define GATHERS 3

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* -1: not asked yet. Threads racing here all store the same answer. */
static int avx2_state = -1, avx512_state = -1, amd_state = -1;
static int simd_allowed = 2;

/* 2: every path the CPU has (rANS symbols partly by gathers on AMD, by the register
 * search elsewhere); 3: the same with the search alone, 4: with gathers; 1: AVX2 and
 * BMI2 but not AVX-512; 0: scalar only. */
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
    if (simd_allowed >= 3) return simd_allowed == 4;
    if (amd_state < 0) {
        __builtin_cpu_init();
        amd_state = __builtin_cpu_is("amd");
    }
    return amd_state;
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

/* Entry t of a table of 32 (wide: 64) entries held in two (four) registers. */
__attribute__((target("avx512f"))) static inline __m512i
lookup(int wide, __m512i t, const __m512i *tab)
{
    __m512i lo = _mm512_permutex2var_epi32(tab[0], t, tab[1]);
    if (!wide) return lo;
    __m512i hi = _mm512_permutex2var_epi32(tab[2], t, tab[3]);
    return _mm512_mask_blend_epi32(_mm512_test_epi32_mask(t, _mm512_set1_epi32(32)), lo, hi);
}

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

/* Entry i of a 64-entry table held in four registers (two when narrow). */
__attribute__((target("avx512f"))) static inline __m512i
table64(int wide, __m512i i, const __m512i *tab)
{
    return lookup(wide, i, tab);
}

/* rANS encoding of one row's symbols (nsyms, a multiple of 64; lane j takes symbols j,
 * j + 64, ...) in the exact reverse of the decoder's order: chunks last to first, and
 * in each the vectors of lanes 48-63, 32-47, 16-31, 0-15, each pushing the words its
 * lanes shed below *pp in ascending lane order (a masked store of the compressed low
 * halves). x / freq is exact in double precision (x < 2^32, freq <= 2^12: a quotient
 * that is not an integer lies at least 2^-12 below the next one, far beyond the
 * rounding of a double). Returns 0 when the context has more than 64 symbols (the
 * caller goes scalar), else nsyms. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) size_t
encode_syms_avx512(uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms, const EncSym *es,
                   const uint16_t *freq, int alpha, int pbits)
{
    int32_t tabs[3][64];   /* freq, start, x_max - 1 (0xFFFFFFFF for 2^32: never sheds) */
    if (alpha > 64) return 0;
    memset(tabs, 0, sizeof(tabs));
    for (int i = 0; i < alpha; i++) {   /* absent symbols (never looked up) stay 0: their EncSym is unset */
        if (!freq[i]) continue;
        tabs[0][i] = (int32_t)es[i].freq;
        tabs[1][i] = (int32_t)es[i].start;
        tabs[2][i] = (int32_t)(uint32_t)(es[i].x_max - 1);
    }
    const int wide = alpha > 32;
    __m512i fr[4], st[4], xm[4];
    for (int i = 0; i < 4; i++) {
        fr[i] = _mm512_loadu_si512(tabs[0] + 16 * i);
        st[i] = _mm512_loadu_si512(tabs[1] + 16 * i);
        xm[i] = _mm512_loadu_si512(tabs[2] + 16 * i);
    }
    const __m512i scale = _mm512_set1_epi32(1 << pbits), lo16 = _mm512_set1_epi32(0xFFFF);
    uint8_t *p = *pp;
    __m512i x[4];
    for (int v = 0; v < 4; v++) x[v] = _mm512_loadu_si512(xs + 16 * v);
    for (size_t c0 = nsyms; c0 > 0;) {
        c0 -= LANES;
        for (int v = 3; v >= 0; v--) {
            __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(syms + c0 + 16 * v)));
            __m512i f = table64(wide, s, fr), start = table64(wide, s, st), xmax1 = table64(wide, s, xm);
            __mmask16 shed = _mm512_cmpgt_epu32_mask(x[v], xmax1);
            unsigned n = (unsigned)__builtin_popcount((unsigned)shed);
            __m256i words = _mm512_cvtepi32_epi16(_mm512_maskz_compress_epi32(shed, _mm512_and_si512(x[v], lo16)));
            p -= 2 * n;
            _mm256_mask_storeu_epi16(p, (__mmask16)((1u << n) - 1), words);
            __m512i y = _mm512_mask_srli_epi32(x[v], shed, x[v], 16);
            __m512d fl = _mm512_cvtepu32_pd(_mm512_castsi512_si256(f));
            __m512d fh = _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(f, 1));
            __m512d yl = _mm512_cvtepu32_pd(_mm512_castsi512_si256(y));
            __m512d yh = _mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(y, 1));
            __m256i ql = _mm512_cvttpd_epu32(_mm512_div_pd(yl, fl)), qh = _mm512_cvttpd_epu32(_mm512_div_pd(yh, fh));
            __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(ql), qh, 1);
            /* x' = (q << pbits) + (y - q * f) + start = q * (2^pbits - f) + y + start */
            x[v] = _mm512_add_epi32(_mm512_mullo_epi32(q, _mm512_sub_epi32(scale, f)), _mm512_add_epi32(y, start));
        }
    }
    for (int v = 0; v < 4; v++) _mm512_storeu_si512(xs + 16 * v, x[v]);
    *pp = p;
    return nsyms;
}

static int bw_state = -1;

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

/* codec_scan.c's plane_maxima, plane_flips and plane_symbols for 16-bit elements
 * (chans % 32 == 0), with the same results: channel maxima 32 channels a step, first
 * sign flips 16 a step, then per coded row its symbols and low bits 32 a step, the
 * low-bit statistics by bit tests; the symbol histogram stays scalar (four tables). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) void
analyse_plane_16_avx512(Enc *E, size_t p, int kc)
{
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    const size_t C = lay->chans, T = lay->tokens, rb = C * 2;
    const uint16_t *plane = (const uint16_t *)(E->src + p * T * rb);
    const uint8_t *dup = E->dup + p * T;
    const __m512i emask = _mm512_set1_epi16((short)((1 << lay->ebits) - 1));
    const __m128i mbits = _mm_cvtsi32_si128(lay->mbits);
    uint16_t *cmax = E->cmax + p * C;
    size_t first = 0;   /* the plane's first coded row (row 0 never repeats) */
    for (size_t c = 0; c < C; c += 32) {
        __m512i acc = _mm512_setzero_si512();
        for (size_t t = 0; t < T; t++)
            if (!dup[t])
                acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_srl_epi16(_mm512_loadu_si512(plane + t * C + c), mbits),
                                                             emask));
        _mm512_storeu_si512(cmax + c, acc);
    }
    plane_side(E, p, kc);

    const uint32_t none = E->nrows[p];
    uint32_t *f = E->fpos + p * C;
    const __m256i sbit = _mm256_set1_epi16((short)0x8000);
    for (size_t c = 0; c < C; c += 16) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(plane + first * C + c));
        __m512i fv = _mm512_set1_epi32((int)none);
        uint32_t k = 1;
        for (size_t t = first + 1; t < T; t++) {
            if (dup[t]) continue;
            __mmask16 diff = _mm256_test_epi16_mask(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(plane + t * C + c)), v0),
                                                    sbit);
            __mmask16 open = _mm512_cmpeq_epi32_mask(fv, _mm512_set1_epi32((int)none));
            fv = _mm512_mask_mov_epi32(fv, diff & open, _mm512_set1_epi32((int)k));
            k++;
        }
        _mm512_storeu_si512(f + c, fv);
    }
    plane_flip_counts(E, p, kc);

    const int hshift = lay->mbits - pr->hi;
    const __m512i mmask = _mm512_set1_epi16((short)((1 << lay->mbits) - 1));
    const __m512i rmax = _mm512_set1_epi16((short)lay->rmax), esc = _mm512_set1_epi16((short)pr->esc);
    const __m512i restmask = _mm512_set1_epi16((short)((1 << hshift) - 1)), low8 = _mm512_set1_epi16(0xFF);
    const __m128i hi = _mm_cvtsi32_si128(pr->hi), hs = _mm_cvtsi32_si128(hshift), tz = _mm_cvtsi32_si128(pr->tz);
    __m512i kmask[MAX_LO + 1];
    for (int k = 1; k <= MAX_LO; k++) kmask[k] = _mm512_set1_epi16((short)((1 << k) - 1));
    uint64_t nonzero[MAX_LO + 1] = {0};
    uint32_t cm[4][256] = {{0}};   /* four tables: a run of one symbol would wait on its own counts */
    for (size_t t = 0; t < T; t++) {
        if (dup[t]) continue;
        const uint16_t *row = plane + t * C;
        uint8_t *sym = E->sym + (p * T + t) * C, *lov = E->lov + (p * T + t) * C;
        for (size_t c = 0; c < C; c += 32) {
            __m512i v = _mm512_loadu_si512(row + c);
            __m512i e = _mm512_and_si512(_mm512_srl_epi16(v, mbits), emask), m = _mm512_and_si512(v, mmask);
            __m512i r = _mm512_sub_epi16(_mm512_loadu_si512(cmax + c), e);
            __m512i code = _mm512_or_si512(_mm512_sll_epi16(r, hi), _mm512_srl_epi16(m, hs));
            __m512i sv = _mm512_mask_mov_epi16(esc, _mm512_cmplt_epu16_mask(r, rmax), code);
            _mm256_storeu_si256((__m256i *)(sym + c), _mm512_cvtepi16_epi8(sv));
            __m512i lo = _mm512_and_si512(_mm512_srl_epi16(_mm512_and_si512(m, restmask), tz), low8);
            _mm256_storeu_si256((__m256i *)(lov + c), _mm512_cvtepi16_epi8(lo));
            for (int k = 1; k <= MAX_LO; k++)
                nonzero[k] += (uint64_t)__builtin_popcount(_mm512_test_epi16_mask(lo, kmask[k]));
        }
        for (size_t c = 0; c < C; c += 4) {
            cm[0][sym[c]]++;
            cm[1][sym[c + 1]]++;
            cm[2][sym[c + 2]]++;
            cm[3][sym[c + 3]]++;
        }
        E->coded_elems += C;
        E->elems_kc[kc] += C;
    }
    for (int i = 0; i < 256; i++) E->counts[CTX_MAIN(kc)][i] += cm[0][i] + cm[1][i] + cm[2][i] + cm[3][i];
    for (int k = 1; k <= MAX_LO; k++) E->lo_nonzero[k] += nonzero[k];
}

/* wq[c] |= (sign of row[c]) << shift for 16-bit elements, sixteen channels a step;
 * returns how many channels it did (a multiple of 16). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) size_t
or_signs_16_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    const __m128i sh = _mm_cvtsi32_si128((int)shift);
    size_t c = 0;
    for (; c + 16 <= C; c += 16) {
        __m512i sg = _mm512_cvtepu16_epi32(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(row + 2 * c)), 15));
        __m512i w = _mm512_loadu_si512(wq + c);
        _mm512_storeu_si512(wq + c, _mm512_or_si512(w, _mm512_sll_epi32(sg, sh)));
    }
    return c;
}

/* codec_rows.c's plane_signs for coded signs and nrows <= 56, eight channels a step:
 * each channel's bit offset in the stream by a prefix sum of (1 + its raw rows), its
 * word by a gather, its mask as the scalar code makes it. Stops before a group whose
 * words would reach past the section's len bytes (the scalar code zero-pads those);
 * returns the channels done and advances *ks past their bits. */
__attribute__((target("avx512f"))) size_t
plane_signs_avx512(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                   uint32_t nrows, size_t C)
{
    const __m512i one = _mm512_set1_epi64(1), n = _mm512_set1_epi64(nrows), all = _mm512_set1_epi64((long long)((1ull << nrows) - 1));
    const __m512i seven = _mm512_set1_epi64(7);
    const __m512i up1 = _mm512_setr_epi64(0, 0, 1, 2, 3, 4, 5, 6), up2 = _mm512_setr_epi64(0, 0, 0, 1, 2, 3, 4, 5);
    const __m512i up4 = _mm512_setr_epi64(0, 0, 0, 0, 0, 1, 2, 3), last = _mm512_set1_epi64(7);
    size_t c = 0, k = *ks;
    for (; c + 8 <= C; c += 8) {
        __m512i fc = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(f + c)));
        __m512i nraw = _mm512_sub_epi64(_mm512_sub_epi64(n, fc),
                                        _mm512_maskz_mov_epi64(_mm512_cmplt_epu64_mask(fc, n), one));
        __m512i inc = _mm512_add_epi64(nraw, one), sum = inc;   /* inclusive prefix sum of inc */
        sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xFE, up1, sum));
        sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xFC, up2, sum));
        sum = _mm512_add_epi64(sum, _mm512_maskz_permutexvar_epi64(0xF0, up4, sum));
        __m512i off = _mm512_add_epi64(_mm512_set1_epi64((long long)k), _mm512_sub_epi64(sum, inc));
        size_t end = k + (size_t)_mm_cvtsi128_si64(_mm512_castsi512_si128(_mm512_permutexvar_epi64(last, sum)));
        if (((end >> 3) + 8) > len) break;   /* the last word read starts at most at byte end / 8 */
        __m512i v = _mm512_srlv_epi64(_mm512_i64gather_epi64(_mm512_srli_epi64(off, 3), (const void *)sign, 1),
                                      _mm512_and_si512(off, seven));
        __m512i s0 = _mm512_and_si512(v, one);
        __m512i raw = _mm512_and_si512(_mm512_srli_epi64(v, 1), _mm512_sub_epi64(_mm512_sllv_epi64(one, nraw), one));
        __m512i head = _mm512_and_si512(_mm512_sub_epi64(_mm512_setzero_si512(), s0),
                                        _mm512_sub_epi64(_mm512_sllv_epi64(one, fc), one));
        __m512i w = _mm512_or_si512(head, _mm512_sllv_epi64(_mm512_xor_si512(s0, one), fc));
        w = _mm512_or_si512(w, _mm512_sllv_epi64(raw, _mm512_add_epi64(fc, one)));
        _mm512_storeu_si512(sw + c, _mm512_and_si512(w, all));
        k = end;
    }
    *ks = k;
    return c;
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

/* analyse_plane_16_avx512 for 8-bit elements (FP8, chans % 64 == 0): the same passes
 * and results, sixty-four channels a step in bytes (first flips sixteen a step). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) void
analyse_plane_8_avx512(Enc *E, size_t p, int kc)
{
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    const size_t C = lay->chans, T = lay->tokens;
    const uint8_t *plane = E->src + p * T * C;
    const uint8_t *dup = E->dup + p * T;
    const __m512i emask = _mm512_set1_epi8((char)((1 << lay->ebits) - 1));
    uint16_t *cmax = E->cmax + p * C;
    for (size_t c = 0; c < C; c += 64) {
        __m512i acc = _mm512_setzero_si512();
        for (size_t t = 0; t < T; t++)
            if (!dup[t]) acc = _mm512_max_epu8(acc, _mm512_and_si512(srl8(_mm512_loadu_si512(plane + t * C + c), lay->mbits),
                                                                     emask));
        _mm512_storeu_si512(cmax + c, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(acc)));
        _mm512_storeu_si512(cmax + c + 32, _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(acc, 1)));
    }
    plane_side(E, p, kc);

    const uint32_t none = E->nrows[p];
    uint32_t *f = E->fpos + p * C;
    const __m128i sbit = _mm_set1_epi8((char)0x80);
    for (size_t c = 0; c < C; c += 16) {
        __m128i v0 = _mm_loadu_si128((const __m128i *)(plane + c));   /* row 0 never repeats */
        __m512i fv = _mm512_set1_epi32((int)none);
        uint32_t k = 1;
        for (size_t t = 1; t < T; t++) {
            if (dup[t]) continue;
            __mmask16 diff = _mm_test_epi8_mask(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(plane + t * C + c)), v0), sbit);
            __mmask16 open = _mm512_cmpeq_epi32_mask(fv, _mm512_set1_epi32((int)none));
            fv = _mm512_mask_mov_epi32(fv, diff & open, _mm512_set1_epi32((int)k));
            k++;
        }
        _mm512_storeu_si512(f + c, fv);
    }
    plane_flip_counts(E, p, kc);

    const int hshift = lay->mbits - pr->hi;
    const __m512i mmask = _mm512_set1_epi8((char)((1 << lay->mbits) - 1));
    const __m512i rmax = _mm512_set1_epi8((char)lay->rmax), esc = _mm512_set1_epi8((char)pr->esc);
    const __m512i restmask = _mm512_set1_epi8((char)((1 << hshift) - 1));
    __m512i kmask[MAX_LO + 1];
    for (int k = 1; k <= MAX_LO; k++) kmask[k] = _mm512_set1_epi8((char)((1 << k) - 1));
    uint64_t nonzero[MAX_LO + 1] = {0};
    uint32_t cm[4][256] = {{0}};
    uint8_t cmax8[64];
    for (size_t t = 0; t < T; t++) {
        if (dup[t]) continue;
        const uint8_t *row = plane + t * C;
        uint8_t *sym = E->sym + (p * T + t) * C, *lov = E->lov + (p * T + t) * C;
        for (size_t c = 0; c < C; c += 64) {
            __m512i v = _mm512_loadu_si512(row + c);
            _mm256_storeu_si256((__m256i *)cmax8, _mm512_cvtepi16_epi8(_mm512_loadu_si512(cmax + c)));
            _mm256_storeu_si256((__m256i *)(cmax8 + 32), _mm512_cvtepi16_epi8(_mm512_loadu_si512(cmax + c + 32)));
            __m512i e = _mm512_and_si512(srl8(v, lay->mbits), emask), m = _mm512_and_si512(v, mmask);
            __m512i r = _mm512_sub_epi8(_mm512_loadu_si512(cmax8), e);
            __m512i code = _mm512_or_si512(sll8(r, pr->hi), srl8(m, hshift));
            _mm512_storeu_si512(sym + c, _mm512_mask_mov_epi8(esc, _mm512_cmplt_epu8_mask(r, rmax), code));
            __m512i lo = srl8(_mm512_and_si512(m, restmask), pr->tz);
            _mm512_storeu_si512(lov + c, lo);
            for (int k = 1; k <= MAX_LO; k++)
                nonzero[k] += (uint64_t)__builtin_popcountll(_mm512_test_epi8_mask(lo, kmask[k]));
        }
        for (size_t c = 0; c < C; c += 4) {
            cm[0][sym[c]]++;
            cm[1][sym[c + 1]]++;
            cm[2][sym[c + 2]]++;
            cm[3][sym[c + 3]]++;
        }
        E->coded_elems += C;
        E->elems_kc[kc] += C;
    }
    for (int i = 0; i < 256; i++) E->counts[CTX_MAIN(kc)][i] += cm[0][i] + cm[1][i] + cm[2][i] + cm[3][i];
    for (int k = 1; k <= MAX_LO; k++) E->lo_nonzero[k] += nonzero[k];
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

/* A row of 16-bit elements, sixty-four channels a step: mid bits unpacked from the
 * stream (fields of w <= 8 bits from byte `mid`, whole rows being byte aligned), signs
 * from bit kbit of each channel's sign word, exponents and hi bits from the symbols.
 * Returns how many channels it assembled (a multiple of 64) and ORs into *res bit 0
 * when a residual exceeds its channel maximum, bit 1 when the row holds escapes. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) size_t
assemble_16_avx512(uint16_t *out, const uint8_t *sym, const uint64_t *sw, uint32_t kbit,
                   const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                   size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    const int w = pr->mid;
    const __m512i vperm = _mm512_loadu_si512(perm), vshift = _mm512_loadu_si512(shift);
    const __m512i wmask = _mm512_set1_epi8((char)((1u << w) - 1));
    const __m512i himask = _mm512_set1_epi16((short)((1 << pr->hi) - 1));
    const __m512i emask = _mm512_set1_epi16((short)((1 << lay->ebits) - 1));
    const __m512i esc = _mm512_set1_epi16((short)pr->esc), bit = _mm512_set1_epi64((long long)(1ull << kbit));
    const __m512i signbit = _mm512_set1_epi16((short)(1u << (lay->nbits - 1)));
    const __m128i hi = _mm_cvtsi32_si128(pr->hi), mbits = _mm_cvtsi32_si128(lay->mbits);
    const __m128i hshift = _mm_cvtsi32_si128(lay->mbits - pr->hi), midshift = _mm_cvtsi32_si128(pr->tz + pr->lo);
    const __mmask64 need = w ? (__mmask64)(~0ull >> (64 - 8 * w)) : 0;
    __mmask32 bad = 0, any_esc = 0;
    size_t c = 0;
    for (; c + 64 <= C; c += 64) {
        __m512i mb = _mm512_maskz_loadu_epi8(need, mid + c / 8 * (size_t)w);
        mb = _mm512_and_si512(_mm512_multishift_epi64_epi8(vshift, _mm512_permutexvar_epi8(vperm, mb)), wmask);
        __mmask64 sg = 0;
        for (int q = 0; q < 8; q++)
            sg |= (__mmask64)_mm512_test_epi64_mask(_mm512_loadu_si512(sw + c + 8 * q), bit) << (8 * q);
        __m512i s8 = _mm512_loadu_si512(sym + c);
        for (int h = 0; h < 2; h++) {
            __m512i s = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(s8, 1) : _mm512_castsi512_si256(s8));
            __m512i m = _mm512_cvtepu8_epi16(h ? _mm512_extracti64x4_epi64(mb, 1) : _mm512_castsi512_si256(mb));
            __m512i cm = _mm512_loadu_si512(cmax + c + 32 * h);
            __m512i r = _mm512_srl_epi16(s, hi);
            __mmask32 is_esc = _mm512_cmpeq_epi16_mask(s, esc);
            bad |= _mm512_mask_cmpgt_epu16_mask((__mmask32)~is_esc, r, cm);
            any_esc |= is_esc;
            __m512i e = _mm512_sll_epi16(_mm512_and_si512(_mm512_sub_epi16(cm, r), emask), mbits);
            __m512i v = _mm512_or_si512(e, _mm512_sll_epi16(_mm512_and_si512(s, himask), hshift));
            v = _mm512_or_si512(v, _mm512_sll_epi16(m, midshift));
            v = _mm512_mask_mov_epi16(v, (__mmask32)(sg >> (32 * h)), _mm512_or_si512(v, signbit));
            _mm512_storeu_si512(out + c + 32 * h, v);
        }
    }
    *res |= (uint32_t)(bad != 0) | (uint32_t)(any_esc != 0) << 1;
    return c;
}

/* assemble_16_avx512 for 8-bit elements (FP8): sixty-four channels a step, all in bytes. */
__attribute__((target("avx512f,avx512bw,avx512vbmi"))) size_t
assemble_8_avx512(uint8_t *out, const uint8_t *sym, const uint64_t *sw, uint32_t kbit,
                  const uint8_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                  size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    const int w = pr->mid;
    const __m512i vperm = _mm512_loadu_si512(perm), vshift = _mm512_loadu_si512(shift);
    const __m512i wmask = _mm512_set1_epi8((char)((1u << w) - 1));
    const __m512i himask = _mm512_set1_epi8((char)((1 << pr->hi) - 1));
    const __m512i emask = _mm512_set1_epi8((char)((1 << lay->ebits) - 1));
    const __m512i esc = _mm512_set1_epi8((char)pr->esc), bit = _mm512_set1_epi64((long long)(1ull << kbit));
    const __m512i signbit = _mm512_set1_epi8((char)0x80);
    const int hshift = lay->mbits - pr->hi, midshift = pr->tz + pr->lo;
    const __mmask64 need = w ? (__mmask64)(~0ull >> (64 - 8 * w)) : 0;
    __mmask64 bad = 0, any_esc = 0;
    size_t c = 0;
    for (; c + 64 <= C; c += 64) {
        __m512i m = _mm512_maskz_loadu_epi8(need, mid + c / 8 * (size_t)w);
        m = _mm512_and_si512(_mm512_multishift_epi64_epi8(vshift, _mm512_permutexvar_epi8(vperm, m)), wmask);
        __mmask64 sg = 0;
        for (int q = 0; q < 8; q++)
            sg |= (__mmask64)_mm512_test_epi64_mask(_mm512_loadu_si512(sw + c + 8 * q), bit) << (8 * q);
        __m512i s = _mm512_loadu_si512(sym + c), cm = _mm512_loadu_si512(cmax + c);
        __m512i r = srl8(s, pr->hi);
        __mmask64 is_esc = _mm512_cmpeq_epi8_mask(s, esc);
        bad |= _mm512_mask_cmpgt_epu8_mask(~is_esc, r, cm);
        any_esc |= is_esc;
        __m512i v = sll8(_mm512_and_si512(_mm512_sub_epi8(cm, r), emask), lay->mbits);
        v = _mm512_or_si512(v, sll8(_mm512_and_si512(s, himask), hshift));
        v = _mm512_or_si512(v, sll8(m, midshift));
        v = _mm512_mask_mov_epi8(v, sg, _mm512_or_si512(v, signbit));
        _mm512_storeu_si512(out + c, v);
    }
    *res |= (uint32_t)(bad != 0) | (uint32_t)(any_esc != 0) << 1;
    return c;
}

/* Mid fields k.. (w <= 7 bits each) as bytes (isz 1) or 16-bit lanes (isz 2), eight per
 * 64-bit read, spread by pdep; returns how many it unpacked (whole groups of 8 that lie
 * inside the stream). */
__attribute__((target("bmi2"))) size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t k, int w, size_t C)
{
    const uint64_t lane8 = 0x0101010101010101ull * ((1u << w) - 1);
    const uint64_t lane16 = 0x0001000100010001ull * ((1u << w) - 1);
    uint8_t *o8 = out;
    uint16_t *o16 = out;
    size_t c = 0;
    for (; c + 8 <= C; c += 8, k += 8) {
        size_t off = k * (size_t)w, q = off >> 3;
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

/* Mid fields of a row of 8- or 16-bit elements (bits shift.. shift+w-1 of each, w <= 7)
 * packed into the bit writer eight at a time by pext; returns how many it packed. Where
 * the writer is at a byte boundary (rows of a multiple of 8 channels keep it there),
 * eight fields are w whole bytes, stored straight into the stream. */
__attribute__((target("bmi2"))) size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    const uint64_t f = ((1ull << w) - 1) << shift;
    const uint64_t m8 = 0x0101010101010101ull * f, m16 = 0x0001000100010001ull * f;
    size_t c = 0;
    if (w > 7) return 0;
    if ((bw->n & 7) == 0 && !bw->overflow) {
        for (; bw->n > 0; bw->n -= 8, bw->acc >>= 8) {   /* the pending whole bytes first */
            if (bw->p >= bw->end) return 0;   /* nothing packed yet: the caller's bw_put reports it */
            *bw->p++ = (uint8_t)bw->acc;
        }
        bw->acc = 0;
        for (; c + 8 <= C && bw->end - bw->p >= 8; c += 8, bw->p += w) {
            uint64_t v = isz == 1 ? _pext_u64(rd_u64(row + c), m8)
                                  : _pext_u64(rd_u64(row + 2 * c), m16)
                                        | _pext_u64(rd_u64(row + 2 * c + 8), m16) << (4 * w);
            wr_u64(bw->p, v);   /* 8w <= 56 bits; the bytes above them are the next group's */
        }
    }
    for (; c + 8 <= C; c += 8) {
        if (isz == 1) {
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + c), m8), 4 * w);   /* 8w bits: two puts */
            bw_put(bw, (uint32_t)(_pext_u64(rd_u64(row + c), m8) >> (4 * w)), 4 * w);
        } else {
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + 2 * c), m16), 4 * w);
            bw_put(bw, (uint32_t)_pext_u64(rd_u64(row + 2 * c + 8), m16), 4 * w);
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

size_t
decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                   const uint16_t *start, int alpha, int pbits, const uint32_t *slots, uint8_t *out, size_t nsyms)
{
    (void)xs; (void)pp; (void)end; (void)freq; (void)start; (void)alpha; (void)pbits; (void)slots; (void)out;
    (void)nsyms;
    return 0;
}

size_t
unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t k, int w, size_t C)
{
    (void)out; (void)isz; (void)mid; (void)len; (void)k; (void)w; (void)C;
    return 0;
}

size_t
pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w)
{
    (void)bw; (void)row; (void)isz; (void)C; (void)shift; (void)w;
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
have_avx512_bw(void)
{
    return 0;
}

size_t
assemble_8_avx512(uint8_t *out, const uint8_t *sym, const uint64_t *sw, uint32_t kbit,
                  const uint8_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                  size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    (void)out; (void)sym; (void)sw; (void)kbit; (void)cmax; (void)mid; (void)perm; (void)shift; (void)C;
    (void)lay; (void)pr; (void)res;
    return 0;
}

size_t
plane_signs_avx512(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                   uint32_t nrows, size_t C)
{
    (void)sw; (void)f; (void)sign; (void)len; (void)ks; (void)nrows; (void)C;
    return 0;
}

size_t
or_signs_16_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift)
{
    (void)wq; (void)row; (void)C; (void)shift;
    return 0;
}

void
analyse_plane_16_avx512(Enc *E, size_t p, int kc)
{
    (void)E; (void)p; (void)kc;
}

void
analyse_plane_8_avx512(Enc *E, size_t p, int kc)
{
    (void)E; (void)p; (void)kc;
}

size_t
encode_syms_avx512(uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms, const EncSym *es,
                   const uint16_t *freq, int alpha, int pbits)
{
    (void)xs; (void)pp; (void)syms; (void)nsyms; (void)es; (void)freq; (void)alpha; (void)pbits;
    return 0;
}

void
assemble_16_consts(int w, uint8_t *perm, uint8_t *shift)
{
    (void)w; (void)perm; (void)shift;
}

size_t
assemble_16_avx512(uint16_t *out, const uint8_t *sym, const uint64_t *sw, uint32_t kbit,
                   const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                   size_t C, const Layout *lay, const Params *pr, uint32_t *res)
{
    (void)out; (void)sym; (void)sw; (void)kbit; (void)cmax; (void)mid; (void)perm; (void)shift; (void)C;
    (void)lay; (void)pr; (void)res;
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

#endif
