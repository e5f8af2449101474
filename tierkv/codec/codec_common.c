/*
 * Parts of the C codec that the encoder and the decoder share: the page geometry per
 * dtype and layout kind, the set of contexts a page's model uses, the quantised
 * frequency tables (levels -> frequencies, identical on both sides), the header and
 * its checksum. Declared in codec_core.h; used by codec_enc.c and codec_dec.c.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>

#include "../xxh_simd.h"

#include "codec_core.h"

/* Weight of level l >= 1: 16 * 2^((l-1)/4), from integers only so that every
 * implementation reconstructs the same frequencies. */
static const uint32_t LEVEL_BASE[4] = {16, 19, 23, 27};
#define MAX_LEVEL ((1 << LEVEL_BITS) - 1)

static uint32_t
level_weight(int level)
{
    return LEVEL_BASE[(level - 1) & 3] << ((level - 1) >> 2);
}

int
layout_init(Layout *lay)
{
    switch (lay->dtype) {
    case DT_BF16: lay->nbits = 16; lay->ebits = 8; lay->mbits = 7; break;
    case DT_FP16: lay->nbits = 16; lay->ebits = 5; lay->mbits = 10; break;
    case DT_FP32: lay->nbits = 32; lay->ebits = 8; lay->mbits = 23; break;
    case DT_E4M3: lay->nbits = 8; lay->ebits = 4; lay->mbits = 3; break;
    case DT_E5M2: lay->nbits = 8; lay->ebits = 5; lay->mbits = 2; break;
    default: return -1;
    }
    lay->itemsize = lay->nbits / 8;
    if (lay->layers == 0 || lay->tokens == 0 || lay->heads == 0 || lay->head_dim == 0)
        return -1;
    if (lay->kind == KIND_KV) {
        lay->planes = (size_t)lay->layers * 2;
        lay->chans = (size_t)lay->heads * lay->head_dim;
        lay->nkc = 2;
    } else if (lay->kind == KIND_LATENT && lay->heads == 1) {
        lay->planes = lay->layers;
        lay->chans = lay->head_dim;
        lay->nkc = 1;
    } else {
        return -1;
    }
    /* Pages are at most 2 GiB (tierkv.layout.MAX_PAGE_BYTES); 32-bit lengths suffice. */
    double bytes = (double)lay->planes * lay->tokens * lay->chans * lay->itemsize;
    if (bytes > (double)(1u << 31))
        return -1;
    lay->elems = lay->planes * lay->tokens * lay->chans;
    lay->page_bytes = lay->elems * (size_t)lay->itemsize;
    lay->rmax = RMAX;
    lay->hi_default = 1;
    lay->flip_alpha = lay->tokens < FLIP_ALPHA_MAX ? (int)lay->tokens : FLIP_ALPHA_MAX;
    lay->flip_esc = lay->tokens > FLIP_ALPHA_MAX ? FLIP_ALPHA_MAX - 1 : -1;
    return 0;
}

int
bits_for(int alpha)
{
    int nb = 0;
    while ((1 << nb) < alpha) nb++;
    return nb;
}

void
params_init(const Layout *lay, Params *pr, int hi)
{
    memset(pr, 0, sizeof(*pr));
    pr->hi = hi;
    pr->main_alpha = (lay->rmax << hi) + 1;
    pr->esc = pr->main_alpha - 1;
    pr->mid = lay->mbits - hi;
}

/* Which contexts a page carries tables for, and their alphabet sizes. */
void
model_contexts(const Layout *lay, const Params *pr, Model *m)
{
    memset(m->used, 0, sizeof(m->used));
    memset(m->alpha, 0, sizeof(m->alpha));
    for (int kc = 0; kc < lay->nkc; kc++) {
        m->used[CTX_SIDE(kc)] = 1;
        m->alpha[CTX_SIDE(kc)] = SIDE_ALPHA;
        m->pbits[CTX_SIDE(kc)] = SMALL_PROB_BITS;
        m->used[CTX_FLIP(kc)] = (uint8_t)pr->sign_coded[kc];
        m->alpha[CTX_FLIP(kc)] = lay->flip_alpha;
        m->pbits[CTX_FLIP(kc)] = lay->flip_alpha <= 128 ? SMALL_PROB_BITS : PROB_BITS;
        m->used[CTX_MAIN(kc)] = 1;
        m->alpha[CTX_MAIN(kc)] = pr->main_alpha;
        m->pbits[CTX_MAIN(kc)] = PROB_BITS;
    }
}

/* Frequencies summing to 2^pbits from levels (0 = absent); -1 if none is present. */
int
levels_to_freqs(const uint8_t *levels, int alpha, uint16_t *freq, int pbits)
{
    const uint32_t scale = 1u << pbits;
    uint32_t sum = 0;
    int top = 0;   /* the first largest frequency */
    if (alpha >= 16 && pbits <= 11 && have_avx512_bw()) {
        if (level_freqs_avx512(levels, alpha, freq, pbits, &sum, &top) != 0)
            return -1;
    } else {
        uint32_t w[256];
        uint64_t total = 0;
        for (int i = 0; i < alpha; i++) {
            w[i] = levels[i] ? level_weight(levels[i]) : 0;
            total += w[i];
        }
        if (total == 0)
            return -1;
        const double inv = 1.0 / (double)total;   /* quotients from a reciprocal, then made exact */
        for (int i = 0; i < alpha; i++) {
            uint32_t f = 0;
            if (w[i]) {
                const uint64_t x = (uint64_t)w[i] * scale;   /* below 2^35 */
                uint64_t q = (uint64_t)((double)x * inv);   /* within one of x / total */
                if (q * total > x) q--;
                else if ((q + 1) * total <= x) q++;
                f = q < 1 ? 1 : (uint32_t)q;
            }
            freq[i] = (uint16_t)f;
            top = f > freq[top] ? i : top;
            sum += f;
        }
    }
    while (sum != scale) {
        if (sum < scale) {
            freq[top] = (uint16_t)(freq[top] + (scale - sum));
            sum = scale;
        } else {
            uint32_t cut = sum - scale;
            if (cut > (uint32_t)freq[top] - 1) cut = (uint32_t)freq[top] - 1;
            if (cut == 0)
                return -1;   /* more symbols present than the scale has slots */
            freq[top] = (uint16_t)(freq[top] - cut);
            sum -= cut;
            top = 0;
            for (int i = 1; i < alpha; i++)
                if (freq[i] > freq[top]) top = i;
        }
    }
    return 0;
}

/* Encoder side: the level nearest (in log terms) to each symbol's share of the page. */
void
counts_to_levels(const uint32_t *counts, int alpha, uint8_t *levels, int pbits)
{
    uint64_t n = 0;
    for (int i = 0; i < alpha; i++)
        n += counts[i];
    for (int i = 0; i < alpha; i++) {
        if (counts[i] == 0) {
            levels[i] = 0;
            continue;
        }
        double ideal = (double)counts[i] * (double)(1u << pbits) / (double)n;
        int level = ideal <= 1.0 ? 1 : 1 + (int)lround(4.0 * log2(ideal));
        if (level < 1) level = 1;
        if (level > MAX_LEVEL) level = MAX_LEVEL;
        levels[i] = (uint8_t)level;
    }
}

void
freqs_to_starts(const uint16_t *freq, int alpha, uint16_t *start)
{
    uint32_t s = 0;
    for (int i = 0; i < alpha; i++) {
        start[i] = (uint16_t)s;
        s += freq[i];
    }
}

/* xxh3-64 of the payload, seeded with xxh3-64 of the header's first 32 bytes. */
uint64_t
page_checksum(const uint8_t *header, const uint8_t *payload, size_t payload_len)
{
    return tk_xxh3_64(payload, payload_len, XXH3_64bits(header, 32));
}

/* Writes the 40-byte header in front of a payload already at out + HEADER_BYTES. */
void
write_header(const Layout *lay, int mode, uint8_t *out, size_t payload_len)
{
    out[0] = 'T';
    out[1] = 'K';
    out[2] = CODEC_ID;
    out[3] = FORMAT_VERSION;
    out[4] = (uint8_t)lay->dtype;
    out[5] = (uint8_t)mode;
    out[6] = (uint8_t)lay->kind;
    out[7] = 0;
    wr_u32(out + 8, lay->layers);
    wr_u32(out + 12, lay->tokens);
    wr_u32(out + 16, lay->heads);
    wr_u32(out + 20, lay->head_dim);
    wr_u32(out + 24, (uint32_t)payload_len);
    wr_u32(out + 28, 0);
    wr_u64(out + 32, page_checksum(out, out + HEADER_BYTES, payload_len));
}

/* Each thread's scratch hangs off a pthread key whose destructor frees it when the
 * thread ends (codec worker threads come and go with their pools). */
typedef struct { void *buf[SCRATCH_KINDS]; size_t cap[SCRATCH_KINDS]; } Scratch;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_ok;

static void
scratch_free(void *p)
{
    Scratch *s = p;
    for (int k = 0; k < SCRATCH_KINDS; k++) free(s->buf[k]);
    free(s);
}

static void
scratch_key_init(void)
{
    scratch_key_ok = pthread_key_create(&scratch_key, scratch_free) == 0;
}

static Scratch *
scratch_of_thread(int create)
{
    pthread_once(&scratch_once, scratch_key_init);
    if (!scratch_key_ok) return NULL;
    Scratch *s = pthread_getspecific(scratch_key);
    if (s == NULL && create) {
        s = calloc(1, sizeof(Scratch));
        if (s != NULL && pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            s = NULL;
        }
    }
    return s;
}

void *
scratch_get(int kind, size_t bytes)
{
    Scratch *s = scratch_of_thread(1);
    if (s == NULL) return NULL;
    if (s->cap[kind] < bytes) {
        free(s->buf[kind]);
        s->buf[kind] = malloc(bytes);
        s->cap[kind] = s->buf[kind] ? bytes : 0;
    }
    return s->buf[kind];
}

/* Frees this thread's scratch when it has grown past SCRATCH_KEEP_BYTES. */
void
scratch_trim(void)
{
    Scratch *s = scratch_of_thread(0);
    for (int k = 0; s != NULL && k < SCRATCH_KINDS; k++) {
        if (s->cap[k] > SCRATCH_KEEP_BYTES) {
            free(s->buf[k]);
            s->buf[k] = NULL;
            s->cap[k] = 0;
        }
    }
}
