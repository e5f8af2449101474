/*
 * The GPU decoder's host side: per blob, the checks the C decoder makes before it
 * decodes (header, checksum, parameters, section lengths, tables, repeated rows, the mid
 * section, every low-bit exception), then the page's descriptor and side block for the
 * kernel (codec_gpu_kernel.cuh, whose header part defines both). Small work next to
 * decoding: the tables, a word per row and per exception. Called by _codec.c.
 */
#include <stdlib.h>

#include "codec_dec.h"
#include "codec_gpu.h"

void
gpu_geometry(const Layout *lay, uint32_t *geo)
{
    memset(geo, 0, GG_WORDS * sizeof(uint32_t));
    geo[GG_ITEMSIZE] = (uint32_t)lay->itemsize;
    geo[GG_EBITS] = (uint32_t)lay->ebits;
    geo[GG_MBITS] = (uint32_t)lay->mbits;
    geo[GG_NBITS] = (uint32_t)lay->nbits;
    geo[GG_PLANES] = (uint32_t)lay->planes;
    geo[GG_TOKENS] = lay->tokens;
    geo[GG_CHANS] = (uint32_t)lay->chans;
    geo[GG_NKC] = (uint32_t)lay->nkc;
    geo[GG_FLIP_ALPHA] = (uint32_t)lay->flip_alpha;
    geo[GG_FLIP_PBITS] = lay->flip_alpha <= 128 ? SMALL_PROB_BITS : PROB_BITS;
    geo[GG_FLIP_ESC] = lay->flip_esc >= 0 ? (uint32_t)lay->flip_esc : GD_NONE;
    geo[GG_FLIP_NB] = (uint32_t)bits_for((int)lay->tokens);
    geo[GG_PAGE_LO] = (uint32_t)lay->page_bytes;
    geo[GG_PAGE_HI] = (uint32_t)((uint64_t)lay->page_bytes >> 32);
}

static int
sink_reserve(GpuSink *s, size_t words)
{
    if (s->len + words <= s->cap) return 0;
    size_t cap = s->cap ? s->cap : 4096;
    while (cap < s->len + words) cap *= 2;
    uint32_t *w = realloc(s->w, cap * sizeof(uint32_t));
    if (w == NULL) return -1;
    s->w = w;
    s->cap = cap;
    return 0;
}

static void
put_u64(uint32_t *desc, int at, uint64_t v)
{
    desc[at] = (uint32_t)v;
    desc[at + 1] = (uint32_t)(v >> 32);
}

/* The low-bit exceptions after the first (dec_open read the count and the first gap),
 * as element indices of the page: checked as apply_lo_exceptions checks them. */
static int
put_exceptions(Dec *D, uint32_t *exc, const uint32_t *kk0, const uint32_t *nrows, const uint32_t *tok,
               uint32_t *exc0)
{
    const Layout *lay = D->lay;
    const size_t C = lay->chans, T = lay->tokens;
    uint64_t left = D->exc_left, next = D->exc_next, i = 0;
    size_t p = 0;
    for (; left; left--, i++) {
        while (p < lay->planes && next >= (uint64_t)kk0[p] + (uint64_t)nrows[p] * C) exc0[++p] = (uint32_t)i;
        if (p == lay->planes) return ERR_STREAM;   /* past the coded elements */
        if (D->exc >= D->exc_end) return ERR_STRUCTURE;
        uint32_t v = *D->exc++;
        if (v == 0 || v >> D->pr.lo) return ERR_STREAM;
        uint64_t local = next - kk0[p];
        uint64_t k = local / C, c = local % C;
        exc[2 * i] = (uint32_t)((p * T + tok[p * T + k]) * C + c);
        exc[2 * i + 1] = v;
        if (left > 1) {
            uint64_t gap;
            if (get_varint(&D->exc, D->exc_end, &gap) != 0 || gap > ~next) return ERR_STRUCTURE;
            next += gap + 1;
        }
    }
    while (p < lay->planes) exc0[++p] = (uint32_t)i;
    return D->exc == D->exc_end ? 0 : ERR_STREAM;
}

int
gpu_prepare_page(const Layout *lay, const uint8_t *blob, size_t len, uint64_t at, uint32_t *desc, GpuSink *side)
{
    int mode = 0;
    size_t plen = 0;
    memset(desc, 0, GD_DESC_WORDS * sizeof(uint32_t));
    int rc = check_blob(lay, blob, len, &mode, &plen);
    if (rc) return rc;
    put_u64(desc, GD_PAYLOAD_LO, at + HEADER_BYTES);
    desc[GD_PLEN] = (uint32_t)plen;
    desc[GD_MODE] = (uint32_t)mode;
    if (mode == MODE_RAW) return 0;

    Dec *D;
    const uint8_t *sec[NSECTIONS];
    uint64_t slen[NSECTIONS];
    const uint8_t *o = blob + HEADER_BYTES;
    if ((rc = dec_open(lay, o, plen, &D, sec, slen, 0)) != 0) return rc;
    /* Every exception takes two bytes or more: a count beyond the section's bytes is refused
     * before anything is reserved for it (a short blob could claim 2^31 of them). */
    if (D->exc_left > slen[6] / 2) return ERR_STRUCTURE;
    const size_t P = lay->planes, T = lay->tokens, C = lay->chans;
    const size_t words = GD_SIDE_WORDS(P, T, (size_t)D->exc_left);
    if (sink_reserve(side, words) != 0) return ERR_NOMEM;
    uint32_t *w = side->w + side->len;
    memset(w, 0, words * sizeof(uint32_t));
    put_u64(desc, GD_SIDE_LO, side->len);

    for (int ctx = 0; ctx < NCTX; ctx++) {
        if (!D->m.used[ctx]) continue;
        uint32_t *tab = w + ctx * GD_TABLE_WORDS;
        for (int s = 0; s < D->m.alpha[ctx]; s++) tab[s] = D->m.freq[ctx][s] | (uint32_t)D->m.start[ctx][s] << 16;
    }
    uint32_t *base = w + GD_SIDE_BASE(P), *nrows = w + GD_SIDE_NROWS(P), *kk0 = w + GD_SIDE_KK0(P);
    uint32_t *exc0 = w + GD_SIDE_EXC0(P), *tok = w + GD_SIDE_TOK(P), *src = w + GD_SIDE_SRC(P, T);
    uint64_t kk = 0;
    for (size_t p = 0; p < P; p++) {
        base[p] = D->base[p];
        kk0[p] = (uint32_t)kk;
        uint32_t n = 0;
        for (size_t t = 0; t < T; t++) {
            size_t g = p * T + t;
            if (D->dup[g]) {
                uint32_t s = D->dup_src[g];   /* an earlier row: resolve it to a coded one */
                while (D->dup[p * T + s]) s = D->dup_src[p * T + s];
                src[g] = s;
            } else {
                src[g] = GD_NONE;
                tok[p * T + n++] = (uint32_t)t;
            }
        }
        nrows[p] = n;
        kk += (uint64_t)n * C;
    }
    desc[GD_NEXC] = (uint32_t)D->exc_left;
    if ((rc = put_exceptions(D, w + GD_SIDE_EXC(P, T), kk0, nrows, tok, exc0)) != 0) return rc;
    side->len += words;

    desc[GD_RANS_OFF] = (uint32_t)(sec[2] - o);
    desc[GD_RANS_LEN] = (uint32_t)slen[2];
    desc[GD_ESC_OFF] = (uint32_t)(sec[3] - o);
    desc[GD_ESC_LEN] = (uint32_t)slen[3];
    desc[GD_SIGN_OFF] = (uint32_t)(sec[4] - o);
    desc[GD_SIGN_LEN] = (uint32_t)slen[4];
    desc[GD_MID_OFF] = (uint32_t)(sec[5] - o);
    desc[GD_MID_LEN] = (uint32_t)slen[5];
    desc[GD_HI] = (uint32_t)D->pr.hi;
    desc[GD_TZ] = (uint32_t)D->pr.tz;
    desc[GD_LO] = (uint32_t)D->pr.lo;
    desc[GD_MIDW] = (uint32_t)D->pr.mid;
    desc[GD_FLAGS] = (uint32_t)(D->pr.sign_coded[0] | D->pr.sign_coded[1] << 1);
    desc[GD_ESC_SYM] = (uint32_t)D->pr.esc;
    put_u64(desc, GD_FROM_LO, D->mid_bits - D->tail);
    desc[GD_TAIL] = (uint32_t)D->tail;
    return 0;
}
