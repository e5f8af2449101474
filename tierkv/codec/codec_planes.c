/*
 * The decoder's planes (codec_dec.c opens the payload): a plane decodes in passes,
 * channel maxima and first sign flips, then every symbol of its rows (64 rANS lanes,
 * sixteen at a time with AVX-512 where the CPU has it, in 64-symbol chunks that may end
 * mid-row), then its rows, assembled by codec_rows.c. Up to MAX_GROUP pages of a batch
 * can decode their planes together (decode_planes_group): each run of symbols goes
 * through decode_symsN_avx512 for all of them as far as they have whole chunks, so the
 * state vectors of every page in the group (four a page) are in flight together, and
 * each page finishes alone.
 */
#include "codec_dec.h"

/* Lookahead budget: a chunk of LANES symbols reads at most one word per lane (with margin). */
#define CHUNK_READ_BYTES (2 * LANES * 2)

/* Branch-free (shift by 0 or 16): whether a state needs a word is a coin toss to the
 * branch predictor. */
#define RENORM(v, p)                                                    \
    do {                                                                \
        uint32_t w_ = rd_u16(p);                                        \
        uint32_t n_ = (v) < RANS_L;                                     \
        (v) = ((v) << (n_ * 16)) | (w_ & (0 - n_));                     \
        (p) += 2 * n_;                                                  \
    } while (0)

/* Unchecked decode: the caller made sure CHUNK_READ_BYTES remain. */
static inline uint32_t
get_sym(uint32_t *x, const uint32_t *restrict tab, const uint8_t **pp)
{
    uint32_t v = *x;
    uint32_t e = tab[v & (PROB_SCALE - 1)];
    v = (e >> 8 & 0xFFF) * (v >> PROB_BITS) + (e >> 20);
    RENORM(v, *pp);
    *x = v;
    return e & 0xFF;
}

static inline uint32_t
get_sym_checked(uint32_t *x, const uint32_t *tab, int pbits, const uint8_t **pp, const uint8_t *end, int *err)
{
    uint32_t v = *x;
    uint32_t e = tab[v & ((1u << pbits) - 1)];
    v = (e >> 8 & 0xFFF) * (v >> pbits) + (e >> 20);
    if (v < RANS_L) {
        if (end - *pp >= 2) {
            v = (v << 16) | rd_u16(*pp);
            *pp += 2;
        } else {
            *err = ERR_STREAM;
        }
    }
    *x = v;
    return e & 0xFF;
}

/* ----------------------------------------------------------------- tables -- */

static void
fill_slots(uint32_t *slot, const uint16_t *freq, const uint16_t *start, int alpha, int present, int pbits)
{
    if (!present) {   /* a context without symbols: any lookup yields symbol 0 */
        for (uint32_t s = 0; s < (1u << pbits); s++) slot[s] = 1u << pbits << 8 | s << 20;
        return;
    }
    for (int i = 0; i < alpha; i++) {
        uint32_t f = freq[i], st = start[i];
        for (uint32_t k = 0; k < f; k++) slot[st + k] = (uint32_t)i | f << 8 | k << 20;
    }
}

/* The scalar decoder's slot table of a context; the AVX-512 path does without. */
static const uint32_t *
ensure_slots(Dec *D, int ctx)
{
    Model *m = &D->m;
    if (!D->filled[ctx]) {
        fill_slots(D->slot[ctx], m->freq[ctx], m->start[ctx], m->alpha[ctx], m->present[ctx], m->pbits[ctx]);
        D->filled[ctx] = 1;
    }
    return D->slot[ctx];
}

/* ---------------------------------------------------------------- planes -- */

/* One page's symbols of context ctx by decode_symsN_vbmi2 (group_kernel16 for a group
 * of one) where VBMI2 runs and the context's tables fit its search: the symbols decoded
 * into out, a multiple of LANES (0: the caller's other paths go on). */
static size_t
alone_syms16(Dec *D, uint32_t *xs, const uint8_t **pp, int ctx, uint8_t *out, size_t nsyms)
{
    const Model *m = &D->m;
    if (!D->vbmi2 || D->lay->chans % LANES || nsyms < LANES) return 0;
    if (D->np16[ctx] < 0) D->np16[ctx] = search_tables16(m->freq[ctx], m->start[ctx], m->alpha[ctx], m->pbits[ctx],
                                                       D->t16[ctx]);
    if (D->np16[ctx] > 64) return 0;
    uint32_t *gx[1] = {xs};
    const uint8_t **gp[1] = {pp};
    const uint8_t *end[1] = {D->rans_end};
    const uint16_t *tabs[1] = {D->t16[ctx]};
    const int np[1] = {D->np16[ctx]}, pbits[1] = {m->pbits[ctx]};
    uint8_t *o[1] = {out};
    return decode_symsN_vbmi2(1, gx, gp, end, tabs, np, pbits, o, nsyms / LANES * LANES);
}

/* A symbol per channel (side maxima or first flips) into D->sym, LANES at a time; the
 * first `done` (whole chunks) are there already (decode_symsN_avx512). */
static void
channel_syms(Dec *D, uint32_t *xs, const uint8_t **pp, int ctx, size_t done)
{
    const size_t C = D->lay->chans;
    const int pbits = D->m.pbits[ctx];
    const uint32_t mask = (1u << pbits) - 1;
    const uint8_t *p = *pp, *const end = D->rans_end;
    uint32_t x[LANES];
    size_t c0 = done;
    if (c0 < C) c0 += alone_syms16(D, xs, &p, ctx, D->sym + c0, C - c0);
    if (D->avx512 && C % LANES == 0 && c0 < C)
        c0 += decode_syms_avx512(xs, &p, end, D->m.freq[ctx], D->m.start[ctx], D->m.alpha[ctx], pbits,
                                 D->gather && !done ? ensure_slots(D, ctx) : NULL, D->sym + c0, C - c0);
    if (c0 == C) {
        *pp = p;
        return;
    }
    const uint32_t *restrict tab = ensure_slots(D, ctx);
    uint8_t *restrict out = D->sym;
    memcpy(x, xs, sizeof(x));
    for (; c0 + LANES <= C && end - p >= CHUNK_READ_BYTES; c0 += LANES) {
        for (int j = 0; j < LANES; j++) {
            uint32_t v = x[j];
            uint32_t e = tab[v & mask];
            v = (e >> 8 & 0xFFF) * (v >> pbits) + (e >> 20);
            RENORM(v, p);
            x[j] = v;
            out[c0 + j] = (uint8_t)e;
        }
    }
    for (; c0 < C; c0 += LANES) {
        int n = (int)(C - c0 < LANES ? C - c0 : LANES);
        for (int j = 0; j < n; j++) out[c0 + j] = (uint8_t)get_sym_checked(&x[j], tab, pbits, &p, end, &D->err);
    }
    memcpy(xs, x, sizeof(x));
    *pp = p;
}

/* The channel maxima of a plane, in the array the rows read at the page's element width
 * (cmax8, cmax16 or cmax). */
static void
decode_side(Dec *D, uint32_t *x, const uint8_t **pp, size_t p, int kc, size_t done)
{
    const Layout *lay = D->lay;
    const int base = D->base[p], isz = lay->itemsize;
    const uint32_t emax = (1u << lay->ebits) - 1;
    const size_t C = lay->chans;
    void *dst = isz == 1 ? (void *)D->cmax8 : isz == 2 ? (void *)D->cmax16 : (void *)D->cmax;
    const uint8_t *restrict sym = D->sym;
    channel_syms(D, x, pp, CTX_SIDE(kc), done);
    uint32_t flags = 0;   /* bit 0: a value past emax, bit 1: an escape */
    if (D->avx512) {
        flags = side_values_avx512(sym, C, base, emax, isz, dst);
    } else {
        uint32_t bad = 0, esc = 0;
        for (size_t c = 0; c < C; c++) {   /* escaped channels are filled in below, in order */
            uint32_t s = sym[c], v = (uint32_t)(base + (int)s - SIDE_CENTER), e = v & emax;
            esc |= s == SIDE_ALPHA - 1;
            bad |= (s != SIDE_ALPHA - 1) & (v > emax);   /* below 0 wraps above emax */
            store_elem((uint8_t *)dst + c * (size_t)isz, isz, e);
        }
        flags = bad | esc << 1;
    }
    if (flags & 2)
        for (size_t c = 0; c < C; c++)
            if (sym[c] == SIDE_ALPHA - 1)
                store_elem((uint8_t *)dst + c * (size_t)isz, isz, br_get(&D->esc, lay->ebits));
    if (flags & 1) D->err = ERR_STREAM;
}

static void
decode_flips(Dec *D, uint32_t *x, const uint8_t **pp, int kc, uint32_t nrows, size_t done)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans;
    uint32_t *restrict f = D->fpos;
    const uint8_t *restrict sym = D->sym;
    channel_syms(D, x, pp, CTX_FLIP(kc), done);
    uint32_t bad = 0;
    if (lay->flip_esc >= 0) {   /* escapes (pages of more than 256 tokens) are read in order */
        const int nb = bits_for((int)lay->tokens);
        for (size_t c = 0; c < C; c++) {
            uint32_t v = sym[c] == (uint32_t)lay->flip_esc ? br_get(&D->esc, nb) : sym[c];
            bad |= v >= nrows;
            f[c] = v + 1;
        }
    } else if (D->avx512) {
        bad = (uint32_t)flip_positions_avx512(sym, C, nrows, f);
    } else {
        for (size_t c = 0; c < C; c++) {
            uint32_t v = sym[c];
            bad |= v >= nrows;
            f[c] = v + 1;
        }
    }
    if (bad) D->err = ERR_STREAM;
}

/* Every main symbol of a plane's coded rows, row after row; the first `done` (whole
 * chunks) are in D->sym already (decode_symsN_avx512). After them (the rows its group's
 * other pages lack) the search alone runs: a slot table costs more to build than it saves. */
static void
decode_symbols(Dec *D, uint32_t *xs, const uint8_t **pp, int kc, uint32_t nrows, size_t done)
{
    const size_t C = D->lay->chans, n = (size_t)nrows * C;
    const uint8_t *p = *pp, *const end = D->rans_end;
    uint32_t x[LANES];
    size_t i = done;   /* symbols decoded, row-major */
    if (i < n) i += alone_syms16(D, xs, &p, CTX_MAIN(kc), D->sym + i, n - i);
    if (D->avx512 && C % LANES == 0 && i < n)
        i += decode_syms_avx512(xs, &p, end, D->m.freq[CTX_MAIN(kc)], D->m.start[CTX_MAIN(kc)],
                                D->m.alpha[CTX_MAIN(kc)], PROB_BITS,
                                D->gather && !done ? ensure_slots(D, CTX_MAIN(kc)) : NULL, D->sym + i, n - i);
    const uint32_t *restrict tab = i < n ? ensure_slots(D, CTX_MAIN(kc)) : NULL;
    memcpy(x, xs, sizeof(x));
    while (i < n) {
        uint8_t *restrict sym = D->sym + i - i % C;   /* the row's start */
        size_t c0 = i % C;   /* a multiple of LANES: the vector paths stop at whole chunks */
        for (; c0 + LANES <= C && end - p >= CHUNK_READ_BYTES; c0 += LANES) {
            uint32_t s[LANES];
            for (int j = 0; j < LANES; j++) s[j] = get_sym(&x[j], tab, &p);
            for (int j = 0; j < LANES; j++) sym[c0 + j] = (uint8_t)s[j];
        }
        for (; c0 < C; c0 += LANES) {
            int m = (int)(C - c0 < LANES ? C - c0 : LANES);
            for (int j = 0; j < m; j++)
                sym[c0 + j] = (uint8_t)get_sym_checked(&x[j], tab, PROB_BITS, &p, end, &D->err);
        }
        i += C - i % C;
    }
    memcpy(xs, x, sizeof(x));
    *pp = p;
}

/* Plane p's K/V class and coded rows. */
static int
plane_class(const Dec *D, size_t p, uint32_t *nrows)
{
    const size_t T = D->lay->tokens;
    uint32_t n = 0;
    for (size_t t = 0; t < T; t++) n += !D->dup[p * T + t];
    *nrows = n;
    return D->lay->nkc == 2 ? (int)(p & 1) : 0;
}

/* Plane p's rows once its symbols are decoded: the mid tail after the last plane, the
 * signs, then each row assembled or copied from the row it repeats. */
static void
plane_rows(Dec *D, const uint32_t *x, size_t p, int kc, uint32_t nrows, uint8_t *plane)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans, T = lay->tokens, rb = C * (size_t)lay->itemsize;
    if (p == lay->planes - 1) {   /* the tail of the mid bits is in the states */
        mid_last_plane(D);
        absorb_tail(D, x);
    }
    if (D->err) return;
    if (D->fused && C % 64 == 0 && nrows <= 25 && D->pr.sign_coded[kc]) {   /* the rows' masks alone */
        plane_sign_rows_vbmi(D->sgr, D->fpos, D->sign, D->sign_len, &D->ksign, nrows, C);
    } else {
        plane_signs(D, D->pr.sign_coded[kc], nrows);
        if (D->fused && C >= 64) sign_rows_avx512(D->sgw, C, nrows, D->sgr);   /* assemble_row's masks */
    }
    if (!assemble_rows(D, nrows, p, plane)) {   /* every coded row at once, else one by one */
        uint32_t k = 0;
        for (size_t t = 0; t < T; t++) {
            if (D->dup[p * T + t]) continue;
            assemble_row(D, D->sym + (size_t)k * C, k, plane + t * rb);
            k++;
        }
    }
    for (size_t t = 0; t < T; t++)   /* then the repeated rows, in order: a source is done before */
        if (D->dup[p * T + t]) memcpy(plane + t * rb, plane + D->dup_src[p * T + t] * rb, rb);
}

static void
decode_plane(Dec *D, uint32_t *x, const uint8_t **pp, size_t p, uint8_t *plane)
{
    uint32_t nrows;
    const int kc = plane_class(D, p, &nrows);
    decode_side(D, x, pp, p, kc, 0);
    if (D->pr.sign_coded[kc]) decode_flips(D, x, pp, kc, nrows, 0);
    decode_symbols(D, x, pp, kc, nrows, 0);
    plane_rows(D, x, p, kc, nrows, plane);
}

/* Runs of symbols of several pages at once: page g's next n[g] - done[g] symbols of
 * context ctx[g] (skipped where skip[g]), decoded by decode_symsN_avx512 for every page
 * that still has whole chunks while at least two do, each into its D->sym from
 * done[g] (advanced past what was decoded); the callers finish each page alone. */
static void
group_syms(int G, Dec *const D[], uint32_t *const x[], const uint8_t **const pp[], const int ctx[],
           const size_t n[], const int skip[], size_t done[])
{
    for (;;) {
        uint32_t *gx[MAX_GROUP];
        const uint8_t **gp[MAX_GROUP];
        const uint8_t *end[MAX_GROUP];
        const uint16_t *tabs[MAX_GROUP];
        uint8_t *out[MAX_GROUP];
        int np[MAX_GROUP], pbits[MAX_GROUP], who[MAX_GROUP], k = 0;
        size_t m = SIZE_MAX;
        for (int g = 0; g < G; g++) {
            if (skip[g] || n[g] - done[g] < LANES) continue;
            Dec *d = D[g];
            const Model *md = &d->m;
            const int c = ctx[g];
            if (d->np16[c] < 0)
                d->np16[c] = search_tables16(md->freq[c], md->start[c], md->alpha[c], md->pbits[c], d->t16[c]);
            if (d->np16[c] > 64) continue;   /* more than the tables hold: the page goes on alone */
            gx[k] = x[g]; gp[k] = pp[g]; end[k] = d->rans_end; tabs[k] = d->t16[c];
            out[k] = d->sym + done[g]; np[k] = d->np16[c]; pbits[k] = md->pbits[c]; who[k++] = g;
            if (n[g] - done[g] < m) m = n[g] - done[g];
        }
        if (k < 2) return;
        size_t r = (D[0]->vbmi2 ? decode_symsN_vbmi2 : decode_symsN_avx512)(k, gx, gp, end, tabs, np, pbits, out,
                                                                            m / LANES * LANES);
        for (int j = 0; j < k; j++) done[who[j]] += r;
        if (r < m / LANES * LANES) return;   /* a stream near its end: each goes on alone */
    }
}

/* Plane p of G pages (2 to MAX_GROUP): each run of symbols (channel maxima, first flips,
 * main symbols) decoded for the pages together as far as they have whole chunks, the
 * rest of each run and the rows page by page. Only where every page has AVX-512 and
 * whole chunks a row (decode_pages checks). */
static void
decode_plane_group(int G, Dec *const D[], uint32_t *const x[], const uint8_t **const pp[], size_t p,
                   uint8_t *const plane[])
{
    const size_t C = D[0]->lay->chans;
    uint32_t nrows[MAX_GROUP];
    int kc[MAX_GROUP], ctx[MAX_GROUP], skip[MAX_GROUP];
    size_t n[MAX_GROUP], done[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        kc[g] = plane_class(D[g], p, &nrows[g]);
        ctx[g] = CTX_SIDE(kc[g]);
        n[g] = C;
        skip[g] = 0;
        done[g] = 0;
    }
    group_syms(G, D, x, pp, ctx, n, skip, done);
    for (int g = 0; g < G; g++) {
        decode_side(D[g], x[g], pp[g], p, kc[g], done[g]);
        ctx[g] = CTX_FLIP(kc[g]);
        skip[g] = !D[g]->pr.sign_coded[kc[g]];
        done[g] = 0;
    }
    group_syms(G, D, x, pp, ctx, n, skip, done);
    for (int g = 0; g < G; g++) {
        if (!skip[g]) decode_flips(D[g], x[g], pp[g], kc[g], nrows[g], done[g]);
        ctx[g] = CTX_MAIN(kc[g]);
        n[g] = (size_t)nrows[g] * C;
        skip[g] = 0;
        done[g] = 0;
    }
    group_syms(G, D, x, pp, ctx, n, skip, done);
    for (int g = 0; g < G; g++) decode_symbols(D[g], x[g], pp[g], kc[g], nrows[g], done[g]);
    for (int g = 0; g < G; g++) plane_rows(D[g], x[g], p, kc[g], nrows[g], plane[g]);
}

/* The lanes' initial states (the encoder's final ones) from the front of the stream;
 * 0 or an error code. */
static int
initial_states(const Dec *D, const uint8_t **pp, uint32_t *x)
{
    const uint8_t *p = *pp;
    if ((size_t)(D->rans_end - p) < 4 * LANES) return ERR_STREAM;
    for (int j = 0; j < LANES; j++, p += 4) {
        x[j] = rd_u32(p);
        if (x[j] < RANS_L) return ERR_STREAM;
    }
    *pp = p;
    return 0;
}

static size_t
plane_bytes(const Layout *lay)
{
    return (size_t)lay->tokens * lay->chans * (size_t)lay->itemsize;
}

/* After the last plane: every stream consumed exactly; 0 or an error code. */
static int
planes_done(const Dec *D, const uint8_t *p)
{
    if (D->err || D->esc.underflow) return D->err ? D->err : ERR_STREAM;
    if (p != D->rans_end || D->exc_left || D->exc != D->exc_end) return ERR_STREAM;
    if ((size_t)(D->esc.end - D->esc.p) * 8 + (size_t)D->esc.n >= 8) return ERR_STREAM;
    if (D->ksign > D->sign_len * 8 || D->sign_len * 8 - D->ksign >= 8) return ERR_STREAM;
    return 0;
}

int
decode_planes(Dec *D, const uint8_t *rans, uint8_t *dst)
{
    const Layout *lay = D->lay;
    const uint8_t *p = rans;
    uint32_t x[LANES];
    int rc = initial_states(D, &p, x);
    if (rc) return rc;
    for (size_t pl = 0; pl < lay->planes && !D->err; pl++) decode_plane(D, x, &p, pl, dst + pl * plane_bytes(lay));
    return planes_done(D, p);
}

/* decode_planes for G pages (at most MAX_GROUP), plane by plane together while two or
 * more decode, then alone; rc[g] each page's result. */
void
decode_planes_group(int G, Dec *const D[], const uint8_t *const rans[], uint8_t *const dst[], int32_t rc[])
{
    const Layout *lay = D[0]->lay;
    const size_t pb = plane_bytes(lay);
    const uint8_t *p[MAX_GROUP];
    uint32_t xs[MAX_GROUP][LANES];
    for (int g = 0; g < G; g++) {
        p[g] = rans[g];
        rc[g] = initial_states(D[g], &p[g], xs[g]);
    }
    for (size_t pl = 0; pl < lay->planes; pl++) {
        Dec *gd[MAX_GROUP];
        uint32_t *gx[MAX_GROUP];
        const uint8_t **gp[MAX_GROUP];
        uint8_t *plane[MAX_GROUP];
        int k = 0;
        for (int g = 0; g < G; g++) {
            if (rc[g] || D[g]->err) continue;
            gd[k] = D[g]; gx[k] = xs[g]; gp[k] = &p[g]; plane[k++] = dst[g] + pl * pb;
        }
        if (k >= 2) decode_plane_group(k, gd, gx, gp, pl, plane);
        else if (k == 1) decode_plane(gd[0], gx[0], gp[0], pl, plane[0]);
    }
    for (int g = 0; g < G; g++)
        if (!rc[g]) rc[g] = planes_done(D[g], p[g]);
}
