/*
 * The decoder of the C codec: one blob in, one page written into the caller's row.
 *
 * Checks before it decodes (header fields against the expected layout, lengths, the
 * xxh3-64 checksum) and after (every rANS state back at its initial value, every
 * stream consumed exactly); it never reads or writes outside the blob, its scratch
 * and the destination row, whatever the input. This file opens a payload (parameters,
 * tables, repeated rows, sections) and drives a page, or up to MAX_GROUP pages together
 * (decode_pages); codec_planes.c decodes the planes, codec_rows.c assembles their rows.
 * Declared in codec_core.h; called by _codec.c without the GIL.
 */
#include "codec_dec.h"

/* ----------------------------------------------------------------- tables -- */

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
        D->np16[ctx] = -1;    /* and the grouped search's on its first (group_syms) */
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
new_dec(const Layout *lay, int kind)
{
    size_t pt = lay->planes * lay->tokens, C = lay->chans, tc = (size_t)lay->tokens * C;
    size_t words = ((size_t)lay->tokens + 63) / 64 * C;
    size_t mid_cap = (lay->elems * (size_t)lay->mbits / 8 + 16 + 63) & ~(size_t)63;   /* keeps what follows aligned */
    size_t row_words = (size_t)lay->tokens * (C / 64);
    const size_t res_bytes = ((size_t)lay->tokens + 7) & ~(size_t)7;   /* keeps what follows aligned */
    uint8_t *b = scratch_get(kind, sizeof(Dec) + words * 8 + row_words * 8 + (size_t)lay->tokens * 8 + res_bytes
                             + pt * 5 + C * 16 + tc + mid_cap + 16);
    if (b == NULL) return NULL;
    Dec *D = (Dec *)b;
    b += sizeof(Dec);
    D->mid_buf = b;
    D->mid_cap = mid_cap;   /* mid_last_plane copies the last plane's mid bits here */
    b += mid_cap;
    D->sgw = (uint64_t *)b; b += words * 8;
    D->sgr = (uint64_t *)b; b += row_words * 8;
    D->rowp = (uint16_t **)b; b += (size_t)lay->tokens * 8;
    D->rowres = b; b += res_bytes;
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
    D->vbmi2 = have_avx512_vbmi2();
    D->dup = b; b += pt;
    D->sym = b;
    return D;
}

/* Checks a coded payload's parameters, section lengths, tables, repeated rows, mid
 * section and first low-bit exception, as decoding needs them; on success *out is the
 * thread's decoder state, sec[i] and len[i] each section, and the mid section is in the
 * state's scratch if copy_mid (the GPU decoder's host side, codec_gpu.c, starts from here
 * too, without the copy). 0 or an error code. */
static int
dec_open_in(const Layout *lay, const uint8_t *o, size_t plen, Dec **out, const uint8_t **sec, uint64_t *len,
            int copy_mid, int kind)
{
    Dec *D = new_dec(lay, kind);
    if (D == NULL) return ERR_NOMEM;
    *out = D;
    if (plen < PAYLOAD_FIXED) return ERR_STRUCTURE;
    int rc = parse_params(D, o);
    if (rc) return rc;
    if (D->vbmi && D->pr.mid <= 8) assemble_16_consts(D->pr.mid, D->perm, D->shift);
    D->fused = lay->itemsize <= 2 && D->vbmi && D->pr.mid <= 8 && lay->chans % 8 == 0;
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

int
dec_open(const Layout *lay, const uint8_t *o, size_t plen, Dec **out, const uint8_t **sec, uint64_t *len,
         int copy_mid)
{
    return dec_open_in(lay, o, plen, out, sec, len, copy_mid, SCRATCH_DEC_STATE);
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

/* n blobs (at most MAX_GROUP) into their rows: where two or more are coded pages whose
 * rows are whole chunks of LANES and the CPU runs decode_symsN_avx512, their symbols
 * are decoded together (each page's states, stream and tables its own); any other
 * page, and a page left alone when the others fail before or during their planes,
 * decodes alone. rc[g] is what decode_page returns. */
void
decode_pages(const Layout *lay, int n, const uint8_t *const blob[], const size_t len[], uint8_t *const dst[],
             int32_t rc[])
{
    int group = group_pages();
    if (group < 2 || lay->chans % LANES) {
        for (int g = 0; g < n; g++) rc[g] = decode_page(lay, blob[g], len[g], dst[g]);
        return;
    }
    Dec *D[MAX_GROUP];
    const uint8_t *rans[MAX_GROUP];
    uint8_t *out[MAX_GROUP];
    int who[MAX_GROUP], k = 0;
    for (int g = 0; g < n; g++) {   /* a page that is raw or refused is done here */
        int mode = 0;
        size_t plen = 0;
        rc[g] = check_blob(lay, blob[g], len[g], &mode, &plen);
        if (rc[g]) continue;
        if (mode == MODE_RAW) {
            memcpy(dst[g], blob[g] + HEADER_BYTES, plen);
            continue;
        }
        const uint8_t *sec[NSECTIONS];
        uint64_t slen[NSECTIONS];
        rc[g] = dec_open_in(lay, blob[g] + HEADER_BYTES, plen, &D[k], sec, slen, 1, SCRATCH_DEC_STATE + k);
        if (rc[g]) continue;
        rans[k] = sec[2];
        out[k] = dst[g];
        who[k++] = g;
    }
    for (int j0 = 0; j0 < k; j0 += group) {   /* level 6 groups in twos */
        int m = k - j0 < group ? k - j0 : group;
        int32_t res[MAX_GROUP];
        if (m == 1) res[0] = decode_planes(D[j0], rans[j0], out[j0]);
        else decode_planes_group(m, D + j0, rans + j0, out + j0, res);
        for (int j = 0; j < m; j++) rc[who[j0 + j]] = res[j];
    }
}
