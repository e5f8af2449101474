/*
 * The encoder of the C codec: one page in, one blob (header + payload) out.
 *
 * The passes over the page's elements live in codec_scan.c (repeated rows, zero bits,
 * per-plane analysis, raw streams); this file makes the per-page decisions (code the
 * signs? leave out the low mantissa bits?), builds the tables, runs rANS in reverse
 * decode order and lays out the payload. A page that would not shrink is stored raw.
 * Declared in codec_core.h; called by _codec.c without the GIL.
 */
#include <math.h>

#include "codec_enc.h"

#define TABLES_CAP (NCTX * (1 + 2 + 256))   /* bytes: every context's table at its largest */

static double
entropy_bits(const uint32_t *counts, int alpha)
{
    double n = 0, bits = 0;
    for (int i = 0; i < alpha; i++) n += counts[i];
    for (int i = 0; i < alpha; i++)
        if (counts[i]) bits += counts[i] * log2(n / counts[i]);
    return bits;
}

static double
table_bits(const uint32_t *counts, int alpha)
{
    int first = -1, last = -1;
    for (int i = 0; i < alpha; i++)
        if (counts[i]) { if (first < 0) first = i; last = i; }
    return first < 0 ? 1 : 1 + 2 * bits_for(alpha) + LEVEL_BITS * (last - first + 1);
}

static void
decide_signs(Enc *E)
{
    int alpha = E->lay->flip_alpha;
    for (int kc = 0; kc < E->lay->nkc; kc++) {
        const uint32_t *n = E->counts[CTX_FLIP(kc)];
        double coded = entropy_bits(n, alpha) + table_bits(n, alpha) + (double)E->flip_raw[kc];
        double raw = (double)E->elems_kc[kc];
        E->pr.sign_coded[kc] = raw > 0 && coded * 1000 < raw * SIGN_KEEP_PERMILLE;
    }
}

/* The low lo mantissa bits (above tz) are left out when they are zero in nearly every
 * element (FP16 cast from BF16, say): the few others are listed as exceptions. */
static void
decide_lo(Enc *E)
{
    Params *pr = &E->pr;
    int room = E->lay->mbits - pr->hi - pr->tz;
    int kmax = room < MAX_LO ? room : MAX_LO, best = 0;
    double best_saving = 0, n = (double)E->coded_elems;
    for (int k = 1; k <= kmax; k++) {
        uint64_t nonzero = E->lo_nonzero[k];
        double saving = k * n - (double)nonzero * LO_EXCEPTION_BITS - 32;
        if (saving > best_saving) {
            best_saving = saving;
            best = k;
        }
    }
    if (best > 0 && best_saving * 1000 >= LO_MIN_SAVING_PERMILLE * n) pr->lo = best;
    pr->mid = E->lay->mbits - pr->hi - pr->tz - pr->lo;
}

/* Levels, frequencies and encoder symbols of every context the page uses; the tables'
 * bits go to w. */
static void
build_model(Enc *E, BitWriter *w)
{
    Model *m = &E->m;
    model_contexts(E->lay, &E->pr, m);
    for (int ctx = 0; ctx < NCTX; ctx++) {
        E->et_ok[ctx] = 0;   /* set below where the vector encoder's tables are built */
        if (!m->used[ctx]) continue;
        int alpha = m->alpha[ctx], nb = bits_for(alpha);
        counts_to_levels(E->counts[ctx], alpha, E->levels[ctx], m->pbits[ctx]);
        m->present[ctx] = levels_to_freqs(E->levels[ctx], alpha, m->freq[ctx], m->pbits[ctx]) == 0;
        bw_put(w, m->present[ctx], 1);
        if (!m->present[ctx]) continue;
        int first = 0, last = alpha - 1;
        while (E->levels[ctx][first] == 0) first++;
        while (E->levels[ctx][last] == 0) last--;
        bw_put(w, (uint32_t)first, nb);
        bw_put(w, (uint32_t)(last - first), nb);
        for (int i = first; i <= last; i++) bw_put(w, E->levels[ctx][i], LEVEL_BITS);
        freqs_to_starts(m->freq[ctx], alpha, m->start[ctx]);
        for (int i = 0; i < alpha; i++)
            if (m->freq[ctx][i]) encsym_init(&E->es[ctx][i], m->start[ctx][i], m->freq[ctx][i], m->pbits[ctx]);
        E->et_ok[ctx] = E->avx512 && E->lay->chans % LANES == 0
            && enc_tables(&E->et[ctx], E->es[ctx], m->freq[ctx], alpha, m->pbits[ctx]) == 0;
    }
    bw_flush(w);
}

static size_t
put_varint(uint8_t *p, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* The lo exceptions: their count, then per exception the gap to the previous one (in
 * coded elements, decode order) and its lo bits, a byte. */
static size_t
write_lo_exceptions(const Enc *E, uint8_t *out)
{
    const Layout *lay = E->lay;
    const size_t C = lay->chans, T = lay->tokens;
    const uint8_t mask = (uint8_t)((1u << E->pr.lo) - 1);
    const uint64_t mask8 = 0x0101010101010101ull * mask;
    /* the analysis counted the coded elements whose lo low bits are not all zero */
    size_t count = E->pr.lo ? (size_t)E->lo_nonzero[E->pr.lo] : 0, n = 0, k = 0;
    int64_t prev = -1;
    n = put_varint(out, count);
    if (!count) return n;
    for (size_t g = 0; g < lay->planes * T; g++) {
        if (E->dup[g]) continue;
        const uint8_t *lov = E->lov + g * C;
        for (size_t c = 0; c < C; c++, k++) {
            if ((c & 7) == 0 && c + 8 <= C && (rd_u64(lov + c) & mask8) == 0) {   /* eight without one */
                c += 7;
                k += 7;
                continue;
            }
            uint8_t v = lov[c] & mask;
            if (!v) continue;
            n += put_varint(out + n, (uint64_t)((int64_t)k - prev - 1));
            out[n++] = v;
            prev = (int64_t)k;
        }
    }
    return n;
}

static size_t
write_dups(const Enc *E, uint8_t *out)
{
    size_t n = put_varint(out, E->ndup);
    int64_t prev = -1;
    size_t rows = E->lay->planes * E->lay->tokens;
    for (size_t g = 0; g < rows; g++) {
        if (!E->dup[g]) continue;
        n += put_varint(out + n, (uint64_t)((int64_t)g - prev - 1));
        n += put_varint(out + n, (g % E->lay->tokens) - E->dup_src[g] - 1);
        prev = (int64_t)g;
    }
    return n;
}

/* Side or first-flip symbols of a plane, in reverse chunk order. */
static void
put_channel_syms(const Enc *E, uint32_t *x, uint8_t **p8, int ctx, const uint8_t *s8, const uint32_t *s32)
{
    const EncSym *es = E->es[ctx];
    const Layout *lay = E->lay;
    size_t C = lay->chans;
    if (E->et_ok[ctx]) {
        uint8_t *tmp = E->s0;                   /* C bytes, free once the planes are analysed */
        if (!s8) {
            for (size_t c = 0; c < C; c++) {
                uint32_t s = s32[c] - 1;
                tmp[c] = (uint8_t)(lay->flip_esc >= 0 && s >= (uint32_t)lay->flip_esc ? (uint32_t)lay->flip_esc : s);
            }
        }
        encode_syms_avx512(x, p8, s8 ? s8 : tmp, C, &E->et[ctx]);
        return;
    }
    for (size_t c0 = (C - 1) / LANES * LANES;; c0 -= LANES) {
        int n = (int)(C - c0 < LANES ? C - c0 : LANES);
        for (int j = n - 1; j >= 0; j--) {
            uint32_t s;
            if (s8) {
                s = s8[c0 + j];
            } else {
                s = s32[c0 + j] - 1;
                if (lay->flip_esc >= 0 && s >= (uint32_t)lay->flip_esc) s = (uint32_t)lay->flip_esc;
            }
            rans_put(&x[j], p8, &es[s]);
        }
        if (c0 == 0) break;
    }
}

/* rANS in exact reverse of the decoder's order; returns the stream's first byte. */
static uint8_t *
write_rans(const Enc *E, uint8_t *end)
{
    const Layout *lay = E->lay;
    const Params *pr = &E->pr;
    size_t C = lay->chans, T = lay->tokens;
    uint32_t x[LANES];
    uint8_t *p8 = end;
    for (int j = 0; j < LANES; j++) x[j] = STATE_TOP + E->lane_tail[j];
    for (size_t pp = lay->planes; pp-- > 0;) {
        int kc = lay->nkc == 2 ? (int)(pp & 1) : 0;
        const EncSym *main = E->es[CTX_MAIN(kc)];
        for (size_t t = T; t-- > 0;) {
            if (E->dup[pp * T + t]) continue;
            if (E->et_ok[CTX_MAIN(kc)]) {   /* a run of coded rows is one sequence of whole chunks */
                size_t t0 = t;
                while (t0 > 0 && !E->dup[pp * T + t0 - 1]) t0--;
                encode_syms_avx512(x, &p8, E->sym + (pp * T + t0) * C, (t - t0 + 1) * C, &E->et[CTX_MAIN(kc)]);
                t = t0;
                continue;
            }
            const uint8_t *sym = E->sym + (pp * T + t) * C;
            for (size_t c0 = (C - 1) / LANES * LANES;; c0 -= LANES) {
                int n = (int)(C - c0 < LANES ? C - c0 : LANES);
                for (int j = n - 1; j >= 0; j--) rans_put(&x[j], &p8, &main[sym[c0 + j]]);
                if (c0 == 0) break;
            }
        }
        if (pr->sign_coded[kc]) put_channel_syms(E, x, &p8, CTX_FLIP(kc), NULL, E->fpos + pp * C);
        put_channel_syms(E, x, &p8, CTX_SIDE(kc), E->side + pp * C, NULL);
    }
    for (int j = LANES - 1; j >= 0; j--) {
        p8 -= 4;
        wr_u32(p8, x[j]);
    }
    return p8;
}

static void
store_raw(const Layout *lay, const uint8_t *src, uint8_t *dst, size_t *out_len)
{
    memcpy(dst + HEADER_BYTES, src, lay->page_bytes);
    write_header(lay, MODE_RAW, dst, lay->page_bytes);
    *out_len = HEADER_BYTES + lay->page_bytes;
}

/* Carves the per-page arrays out of this thread's scratch; -1 without memory. */
static int
alloc_enc(Enc *E)
{
    const Layout *lay = E->lay;
    size_t pc = lay->planes * lay->chans, pt = lay->planes * lay->tokens;
    E->nslots = 16;
    while (E->nslots < 2 * (size_t)lay->tokens) E->nslots <<= 1;
    E->rans_cap = 2 * (lay->elems + 2 * pc) + 4 * LANES + 16;
    E->esc_cap = (pc * (size_t)(lay->ebits + 32) + lay->elems * (size_t)(lay->ebits + lay->mbits)) / 8 + 16;
    E->sign_cap = lay->elems / 8 + 16;
    E->mid_cap = lay->elems * (size_t)lay->mbits / 8 + 16;
    size_t misc_cap = TABLES_CAP + pt * 20 + lay->elems * 11 + 32;   /* dup list, lo exceptions */
    size_t sign_words = ((size_t)lay->tokens + 31) / 32 * lay->chans;
    size_t total = sign_words * 4 + pt * 4 + pc * 4 + lay->planes * 4 + E->nslots * 4 + pc * 2 + 2 * lay->elems
        + pc + 2 * pt + 2 * lay->planes + lay->chans + E->rans_cap + E->esc_cap + E->sign_cap + E->mid_cap
        + misc_cap + 64;
    uint8_t *b = scratch_get(SCRATCH_ENC_ARRAYS, total);
    if (b == NULL) return -1;
    E->signw = (uint32_t *)b; b += sign_words * 4;
    E->dup_src = (uint32_t *)b; b += pt * 4;
    E->fpos = (uint32_t *)b; b += pc * 4;
    E->nrows = (uint32_t *)b; b += lay->planes * 4;
    E->slots = (uint32_t *)b; b += E->nslots * 4;
    E->cmax = (uint16_t *)b; b += pc * 2;
    E->sym = b; b += lay->elems;
    E->lov = b; b += lay->elems;
    E->side = b; b += pc;
    E->dup = b; b += pt;
    E->resc = b; b += pt;
    E->side_esc = b; b += lay->planes;
    E->base = b; b += lay->planes;
    E->s0 = b; b += lay->chans;
    E->rans_buf = b; b += E->rans_cap;
    E->raw_buf = b; b += E->esc_cap + E->sign_cap + E->mid_cap;
    E->misc = b;
    return 0;
}

static Enc *
new_enc(const Layout *lay, const uint8_t *src)
{
    Enc *E = scratch_get(SCRATCH_ENC_STATE, sizeof(Enc));
    if (E == NULL) return NULL;
    E->lay = lay;
    E->src = src;
    memset(E->counts, 0, sizeof(E->counts));
    memset(E->lo_nonzero, 0, sizeof(E->lo_nonzero));
    memset(E->flip_raw, 0, sizeof(E->flip_raw));
    memset(E->elems_kc, 0, sizeof(E->elems_kc));
    E->ndup = 0;
    E->coded_elems = 0;
    E->bmi2 = have_avx2();   /* AVX2 and BMI2 */
    E->avx512bw = have_avx512_bw();
    E->avx512 = E->avx512bw;   /* encode_syms_avx512 is built for AVX-512 F, BW and VL */
    return alloc_enc(E) == 0 ? E : NULL;
}

static void
write_payload(const Enc *E, uint8_t *o, const size_t *len, const uint8_t *const *part)
{
    o[0] = (uint8_t)E->pr.hi;
    o[1] = (uint8_t)E->pr.tz;
    o[2] = (uint8_t)E->pr.lo;
    o[3] = (uint8_t)(E->pr.sign_coded[0] | E->pr.sign_coded[1] << 1);
    for (int i = 0; i < NSECTIONS; i++) wr_u32(o + 4 + 4 * i, (uint32_t)len[i]);
    o += PAYLOAD_FIXED;
    memcpy(o, part[0], len[0]);
    o += len[0];
    memcpy(o, E->base, E->lay->planes);
    o += E->lay->planes;
    for (int i = 1; i < NSECTIONS; i++) {
        memcpy(o, part[i], len[i]);
        o += len[i];
    }
}

/* Encodes one page into dst (cap >= page_bytes + HEADER_BYTES); 0, or -1 without memory. */
int
encode_page(const Layout *lay, const uint8_t *src, uint8_t *dst, size_t cap, size_t *out_len)
{
    Enc *E = new_enc(lay, src);
    if (E == NULL) return -1;
    params_init(lay, &E->pr, lay->hi_default);
    find_dups(E);
    E->pr.tz = common_zero_bits(E);
    for (size_t p = 0; p < lay->planes; p++) analyse_plane(E, p);
    decide_signs(E);
    decide_lo(E);

    BitWriter tw = {E->misc, E->misc + TABLES_CAP, 0, 0, 0};
    build_model(E, &tw);
    uint8_t *dups = tw.p;
    uint8_t *r0 = E->raw_buf, *r1 = r0 + E->esc_cap, *r2 = r1 + E->sign_cap;
    BitWriter esc = {r0, r1, 0, 0, 0}, sign = {r1, r2, 0, 0, 0}, mid = {r2, r2 + E->mid_cap, 0, 0, 0};
    write_streams(E, &esc, &sign, &mid);
    size_t mid_len = take_mid_tail(E, r2, E->coded_elems * (size_t)E->pr.mid);
    uint8_t *rans = write_rans(E, E->rans_buf + E->rans_cap);
    size_t len[NSECTIONS] = {(size_t)(tw.p - E->misc), write_dups(E, dups), (size_t)(E->rans_buf + E->rans_cap - rans),
                     (size_t)(esc.p - r0), (size_t)(sign.p - r1), mid_len};
    uint8_t *exc = dups + len[1];
    len[6] = write_lo_exceptions(E, exc);
    const uint8_t *part[NSECTIONS] = {E->misc, dups, rans, r0, r1, r2, exc};

    size_t payload = PAYLOAD_FIXED + lay->planes;
    for (int i = 0; i < NSECTIONS; i++) payload += len[i];
    if (tw.overflow || esc.overflow || sign.overflow || mid.overflow || payload >= lay->page_bytes
            || HEADER_BYTES + payload > cap) {
        store_raw(lay, src, dst, out_len);
        return 0;
    }
    write_payload(E, dst + HEADER_BYTES, len, part);
    write_header(lay, MODE_CODED, dst, payload);
    *out_len = HEADER_BYTES + payload;
    return 0;
}
