/*
 * The decoder of the C codec: one blob in, one page written into the caller's row.
 *
 * Checks before it decodes (header fields against the expected layout, lengths, the
 * xxh3-64 checksum) and after (every rANS state back at its initial value, every
 * stream consumed exactly); it never reads or writes outside the blob, its scratch
 * and the destination row, whatever the input. A plane decodes in passes: channel
 * maxima and first sign flips, then every symbol of its rows (64 rANS lanes, sixteen at
 * a time with AVX-512 where the CPU has it, in 64-symbol chunks that may end mid-row),
 * then its rows, assembled by codec_rows.c.
 * Declared in codec_core.h; called by _codec.c without the GIL.
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

/* Reads the page's tables; 0 or an error code. */
static int
read_model(Dec *D, const uint8_t *p, size_t len)
{
    Model *m = &D->m;
    BitReader r = {p, p + len, 0, 0, 0};
    uint8_t levels[256];
    model_contexts(D->lay, &D->pr, m);
    for (int ctx = 0; ctx < NCTX; ctx++) {
        if (!m->used[ctx]) continue;
        int alpha = m->alpha[ctx], nb = bits_for(alpha);
        m->present[ctx] = (uint8_t)br_get(&r, 1);
        memset(levels, 0, sizeof(levels));
        if (m->present[ctx]) {
            uint32_t first = br_get(&r, nb), span = br_get(&r, nb);
            if (first + span >= (uint32_t)alpha) return ERR_STRUCTURE;
            for (uint32_t i = first; i <= first + span; i++) levels[i] = (uint8_t)br_get(&r, LEVEL_BITS);
            if (levels_to_freqs(levels, alpha, m->freq[ctx], m->pbits[ctx]) != 0) return ERR_STRUCTURE;
        } else {
            /* A context without symbols decodes symbol 0 and leaves the state as it is
             * (fill_slots): symbol 0 taking every slot says the same to the SIMD search. */
            memset(m->freq[ctx], 0, sizeof(m->freq[ctx]));
            m->freq[ctx][0] = (uint16_t)(1u << m->pbits[ctx]);
        }
        freqs_to_starts(m->freq[ctx], alpha, m->start[ctx]);
        D->filled[ctx] = 0;   /* slot tables are built on first scalar use (ensure_slots) */
    }
    if (r.underflow || (size_t)(r.end - r.p) * 8 + (size_t)r.n >= 8) return ERR_STRUCTURE;
    return 0;
}

static int
read_dups(Dec *D, const uint8_t *p, size_t len)
{
    const uint8_t *end = p + len;
    size_t rows = D->lay->planes * D->lay->tokens;
    uint64_t n, delta, back;
    memset(D->dup, 0, rows);
    if (get_varint(&p, end, &n) != 0 || n > rows) return ERR_STRUCTURE;
    uint64_t g = (uint64_t)-1;
    for (uint64_t i = 0; i < n; i++) {
        if (get_varint(&p, end, &delta) != 0 || get_varint(&p, end, &back) != 0) return ERR_STRUCTURE;
        if (delta >= rows) return ERR_STRUCTURE;
        g = g + 1 + delta;
        uint64_t t = g % D->lay->tokens;
        if (g >= rows || back >= t) return ERR_STRUCTURE;
        D->dup[g] = 1;
        D->dup_src[g] = (uint32_t)(t - back - 1);
    }
    return p == end ? 0 : ERR_STRUCTURE;
}

/* ---------------------------------------------------------------- planes -- */

/* A symbol per channel (side maxima or first flips), LANES at a time. */
static void
channel_syms(Dec *D, uint32_t *xs, const uint8_t **pp, int ctx, uint32_t *restrict out)
{
    const size_t C = D->lay->chans;
    const int pbits = D->m.pbits[ctx];
    const uint32_t mask = (1u << pbits) - 1;
    const uint8_t *p = *pp, *const end = D->rans_end;
    uint32_t x[LANES];
    size_t c0 = 0;
    if (D->avx512 && C % LANES == 0) {
        c0 = decode_syms_avx512(xs, &p, end, D->m.freq[ctx], D->m.start[ctx], D->m.alpha[ctx], pbits,
                                D->gather ? ensure_slots(D, ctx) : NULL, D->sym, C);
        for (size_t c = 0; c < c0; c++) out[c] = D->sym[c];
    }
    if (c0 == C) {
        *pp = p;
        return;
    }
    const uint32_t *restrict tab = ensure_slots(D, ctx);
    memcpy(x, xs, sizeof(x));
    for (; c0 + LANES <= C && end - p >= CHUNK_READ_BYTES; c0 += LANES) {
        for (int j = 0; j < LANES; j++) {
            uint32_t v = x[j];
            uint32_t e = tab[v & mask];
            v = (e >> 8 & 0xFFF) * (v >> pbits) + (e >> 20);
            RENORM(v, p);
            x[j] = v;
            out[c0 + j] = e & 0xFF;
        }
    }
    for (; c0 < C; c0 += LANES) {
        int n = (int)(C - c0 < LANES ? C - c0 : LANES);
        for (int j = 0; j < n; j++) out[c0 + j] = get_sym_checked(&x[j], tab, pbits, &p, end, &D->err);
    }
    memcpy(xs, x, sizeof(x));
    *pp = p;
}

static void
decode_side(Dec *D, uint32_t *x, const uint8_t **pp, size_t p, int kc)
{
    const Layout *lay = D->lay;
    const int base = D->base[p], emax = (1 << lay->ebits) - 1;
    const size_t C = lay->chans;
    uint32_t *restrict cm = D->cmax;
    uint16_t *restrict cm16 = D->cmax16;
    uint8_t *restrict cm8 = D->cmax8;
    channel_syms(D, x, pp, CTX_SIDE(kc), cm);
    uint32_t bad = 0, esc = 0;
    for (size_t c = 0; c < C; c++) {   /* vectorises; escaped channels are filled in below, in order */
        uint32_t s = cm[c], v = (uint32_t)(base + (int)s - SIDE_CENTER);
        esc |= s == SIDE_ALPHA - 1;
        bad |= (s != SIDE_ALPHA - 1) & (v > (uint32_t)emax);   /* below 0 wraps above emax */
        cm16[c] = (uint16_t)(v & (uint32_t)emax);
    }
    if (esc)
        for (size_t c = 0; c < C; c++)
            if (cm[c] == SIDE_ALPHA - 1) cm16[c] = (uint16_t)br_get(&D->esc, lay->ebits);
    if (bad) D->err = ERR_STREAM;
    for (size_t c = 0; c < C; c++) {
        cm[c] = cm16[c];
        cm8[c] = (uint8_t)cm16[c];
    }
}

static void
decode_flips(Dec *D, uint32_t *x, const uint8_t **pp, int kc, uint32_t nrows)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans;
    uint32_t *restrict f = D->fpos;
    channel_syms(D, x, pp, CTX_FLIP(kc), f);
    if (lay->flip_esc >= 0) {   /* escapes (pages of more than 256 tokens) are read in order */
        const int nb = bits_for((int)lay->tokens);
        for (size_t c = 0; c < C; c++)
            if (f[c] == (uint32_t)lay->flip_esc) f[c] = br_get(&D->esc, nb);
    }
    uint32_t bad = 0;
    for (size_t c = 0; c < C; c++) {   /* vectorises */
        bad |= f[c] >= nrows;
        f[c] += 1;
    }
    if (bad) D->err = ERR_STREAM;
}

/* Every main symbol of a plane's coded rows, row after row. */
static void
decode_symbols(Dec *D, uint32_t *xs, const uint8_t **pp, int kc, uint32_t nrows)
{
    const size_t C = D->lay->chans, n = (size_t)nrows * C;
    const uint8_t *p = *pp, *const end = D->rans_end;
    uint32_t x[LANES];
    size_t i = 0;   /* symbols decoded, row-major */
    if (D->avx512 && C % LANES == 0)
        i = decode_syms_avx512(xs, &p, end, D->m.freq[CTX_MAIN(kc)], D->m.start[CTX_MAIN(kc)],
                               D->m.alpha[CTX_MAIN(kc)], PROB_BITS, D->gather ? ensure_slots(D, CTX_MAIN(kc)) : NULL,
                               D->sym, n);
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

static void
decode_plane(Dec *D, uint32_t *x, const uint8_t **pp, size_t p, uint8_t *plane)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans, T = lay->tokens, rb = C * (size_t)lay->itemsize;
    const int kc = lay->nkc == 2 ? (int)(p & 1) : 0, coded = D->pr.sign_coded[kc];
    uint32_t nrows = 0;
    for (size_t t = 0; t < T; t++) nrows += !D->dup[p * T + t];
    decode_side(D, x, pp, p, kc);
    if (coded) decode_flips(D, x, pp, kc, nrows);
    decode_symbols(D, x, pp, kc, nrows);
    if (p == lay->planes - 1) absorb_tail(D, x);
    if (D->err) return;
    plane_signs(D, coded, nrows);
    uint32_t k = 0;
    for (size_t t = 0; t < T; t++) {
        uint8_t *out = plane + t * rb;
        if (D->dup[p * T + t]) {
            memcpy(out, plane + D->dup_src[p * T + t] * rb, rb);
            continue;
        }
        assemble_row(D, D->sym + (size_t)k * C, k, out);
        k++;
    }
}

static int
decode_planes(Dec *D, const uint8_t *rans, uint8_t *dst)
{
    const Layout *lay = D->lay;
    size_t plane_bytes = (size_t)lay->tokens * lay->chans * (size_t)lay->itemsize;
    const uint8_t *p = rans;
    uint32_t x[LANES];
    if ((size_t)(D->rans_end - p) < 4 * LANES) return ERR_STREAM;
    for (int j = 0; j < LANES; j++, p += 4) {
        x[j] = rd_u32(p);
        if (x[j] < RANS_L) return ERR_STREAM;
    }
    for (size_t pl = 0; pl < lay->planes && !D->err; pl++) decode_plane(D, x, &p, pl, dst + pl * plane_bytes);
    if (D->err || D->esc.underflow) return D->err ? D->err : ERR_STREAM;
    if (p != D->rans_end || D->exc_left || D->exc != D->exc_end) return ERR_STREAM;
    if ((size_t)(D->esc.end - D->esc.p) * 8 + (size_t)D->esc.n >= 8) return ERR_STREAM;
    if (D->ksign > D->sign_len * 8 || D->sign_len * 8 - D->ksign >= 8) return ERR_STREAM;
    return 0;
}

/* --------------------------------------------------------------- payload -- */

static int
parse_params(Dec *D, const uint8_t *o)
{
    const Layout *lay = D->lay;
    int hi = o[0];
    if (hi > lay->mbits || (lay->rmax << hi) + 1 > 256) return ERR_STRUCTURE;
    params_init(lay, &D->pr, hi);
    D->pr.tz = o[1];
    D->pr.lo = o[2];
    if (D->pr.lo > MAX_LO || D->pr.tz + D->pr.lo > lay->mbits - hi) return ERR_STRUCTURE;
    if (o[3] & ~(lay->nkc == 2 ? 3 : 1)) return ERR_STRUCTURE;
    D->pr.sign_coded[0] = o[3] & 1;
    D->pr.sign_coded[1] = (o[3] >> 1) & 1;
    D->pr.mid = lay->mbits - hi - D->pr.tz - D->pr.lo;
    return 0;
}

/* Reads the exception count and the first gap; apply_lo_exceptions reads the rest. */
static int
read_lo_exceptions(Dec *D, const uint8_t *p, size_t len)
{
    D->exc = p;
    D->exc_end = p + len;
    D->exc_next = 0;
    if (get_varint(&D->exc, D->exc_end, &D->exc_left) != 0) return ERR_STRUCTURE;
    if (D->exc_left && (!D->pr.lo || D->exc_left > D->mid_bits + D->lay->elems)) return ERR_STRUCTURE;
    if (D->exc_left && get_varint(&D->exc, D->exc_end, &D->exc_next) != 0) return ERR_STRUCTURE;
    return 0;
}

static Dec *
new_dec(const Layout *lay)
{
    size_t pt = lay->planes * lay->tokens, C = lay->chans, tc = (size_t)lay->tokens * C;
    size_t words = ((size_t)lay->tokens + 63) / 64 * C;
    size_t mid_cap = (lay->elems * (size_t)lay->mbits / 8 + 16 + 63) & ~(size_t)63;   /* keeps what follows aligned */
    uint8_t *b = scratch_get(SCRATCH_DEC_STATE, sizeof(Dec) + words * 8 + pt * 5 + C * 16 + tc + mid_cap + 16);
    if (b == NULL) return NULL;
    Dec *D = (Dec *)b;
    b += sizeof(Dec);
    D->mid = b;
    D->mid_len = mid_cap;   /* the scratch's size; load_mid zero-pads it */
    b += mid_cap;
    D->sgw = (uint64_t *)b; b += words * 8;
    D->lay = lay;
    D->err = 0;
    D->kmid = D->ksign = 0;
    D->dup_src = (uint32_t *)b; b += pt * 4;
    D->cmax = (uint32_t *)b; b += C * 4;
    D->fpos = (uint32_t *)b; b += C * 4;
    D->midv = (uint32_t *)b; b += C * 4;
    D->cmax16 = (uint16_t *)b; b += C * 2;
    D->cmax8 = b; b += C;
    D->simd = have_avx2();
    D->avx512 = have_avx512_bw();   /* decode_syms_avx512 is built for AVX-512 F and BW */
    D->vbmi = have_avx512_vbmi();
    D->gather = use_gather();
    D->dup = b; b += pt;
    D->sym = b;
    return D;
}

/* Checks a coded payload's parameters, section lengths, tables, repeated rows, mid
 * section and first low-bit exception, as decoding needs them; on success *out is the
 * thread's decoder state, sec[i] and len[i] each section, and the mid section is in the
 * state's scratch if copy_mid (the GPU decoder's host side, codec_gpu.c, starts from here
 * too, without the copy). 0 or an error code. */
int
dec_open(const Layout *lay, const uint8_t *o, size_t plen, Dec **out, const uint8_t **sec, uint64_t *len,
         int copy_mid)
{
    Dec *D = new_dec(lay);
    if (D == NULL) return ERR_NOMEM;
    *out = D;
    if (plen < PAYLOAD_FIXED) return ERR_STRUCTURE;
    int rc = parse_params(D, o);
    if (rc) return rc;
    if (D->vbmi && D->pr.mid <= 8) assemble_16_consts(D->pr.mid, D->perm, D->shift);
    uint64_t sum = PAYLOAD_FIXED + lay->planes;
    for (int i = 0; i < NSECTIONS; i++) sum += len[i] = rd_u32(o + 4 + 4 * i);
    if (sum != plen) return ERR_STRUCTURE;
    const uint8_t *q = o + PAYLOAD_FIXED;
    sec[0] = q;
    if ((rc = read_model(D, q, len[0])) != 0) return rc;
    q += len[0];
    D->base = q;
    for (size_t p = 0; p < lay->planes; p++)
        if (q[p] >> lay->ebits) return ERR_STRUCTURE;
    q += lay->planes;
    for (int i = 1; i < NSECTIONS; i++) {
        sec[i] = q;
        q += len[i];
    }
    if ((rc = read_dups(D, sec[1], len[1])) != 0) return rc;
    D->rans_end = sec[2] + len[2];
    D->esc = (BitReader){sec[3], sec[3] + len[3], 0, 0, 0};
    D->sign = sec[4];
    D->sign_len = len[4];
    if ((rc = load_mid(D, sec[5], len[5], copy_mid)) != 0) return rc;
    return read_lo_exceptions(D, sec[6], len[6]);
}

static int
decode_coded(const Layout *lay, const uint8_t *o, size_t plen, uint8_t *dst)
{
    Dec *D;
    const uint8_t *sec[NSECTIONS];
    uint64_t len[NSECTIONS];
    int rc = dec_open(lay, o, plen, &D, sec, len, 1);
    return rc ? rc : decode_planes(D, sec[2], dst);
}

/* Checks a blob's header and checksum against the layout: 0 with *mode and *plen set,
 * or an error code (len may exceed the blob: trailing bytes are ignored). */
int
check_blob(const Layout *lay, const uint8_t *blob, size_t len, int *mode, size_t *plen_out)
{
    if (len < HEADER_BYTES) return ERR_SHORT;
    if (blob[0] != 'T' || blob[1] != 'K' || blob[2] != CODEC_ID) return ERR_MAGIC;
    if (blob[3] != FORMAT_VERSION) return ERR_VERSION;
    if (blob[4] != lay->dtype || blob[6] != lay->kind || rd_u32(blob + 8) != lay->layers
            || rd_u32(blob + 12) != lay->tokens || rd_u32(blob + 16) != lay->heads
            || rd_u32(blob + 20) != lay->head_dim)
        return ERR_LAYOUT;
    size_t plen = rd_u32(blob + 24);
    if (plen > len - HEADER_BYTES) return ERR_SHORT;
    if (page_checksum(blob, blob + HEADER_BYTES, plen) != rd_u64(blob + 32)) return ERR_CHECKSUM;
    if (blob[7] != 0 || rd_u32(blob + 28) != 0) return ERR_STRUCTURE;
    if (blob[5] == MODE_RAW && plen != lay->page_bytes) return ERR_STRUCTURE;
    if (blob[5] != MODE_RAW && blob[5] != MODE_CODED) return ERR_STRUCTURE;
    *mode = blob[5];
    *plen_out = plen;
    return 0;
}

/* Decodes one blob (len may exceed the blob: trailing bytes are ignored) into dst. */
int
decode_page(const Layout *lay, const uint8_t *blob, size_t len, uint8_t *dst)
{
    int mode = 0;
    size_t plen = 0;
    int rc = check_blob(lay, blob, len, &mode, &plen);
    if (rc) return rc;
    if (mode == MODE_RAW) {
        memcpy(dst, blob + HEADER_BYTES, plen);
        return 0;
    }
    return decode_coded(lay, blob + HEADER_BYTES, plen, dst);
}
