/*
 * Declarations shared by the C codec's files: format constants, the page geometry,
 * per-page parameters, the probability model, and the inline bit and rANS primitives.
 * Included by _codec.c (bindings), codec_common.c, codec_enc.c, codec_dec.c and the
 * other codec_*.c.
 * tierkv/codec/FORMAT.md is the format these implement; tierkv/codec/portable/common.py
 * and tierkv/codec/format.py mirror every constant here.
 */
#ifndef TIERKV_CODEC_CORE_H
#define TIERKV_CODEC_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FORMAT_VERSION 1
#define CODEC_ID 1
#define HEADER_BYTES 40
#define PAYLOAD_FIXED 32      /* hi, tz, lo, flags, seven u32 section lengths */
#define NSECTIONS 7           /* tables, dups, rans, escapes, signs, mids, low-bit exceptions */
#define LANES 64              /* interleaved rANS states; element c of a row uses c % LANES */
#define STATE_TOP (1u << 31)  /* initial encoder states: STATE_TOP + 31 bits of the mid tail */
#define TAIL_BITS_PER_LANE 31
#define PROB_BITS 11          /* the main and low-bit tables' frequencies sum to 2^PROB_BITS */
#define SMALL_PROB_BITS 8     /* ... the side tables' (and the first-flip tables' up to 128 tokens) */
#define PROB_SCALE (1u << PROB_BITS)
#define RANS_L (1u << 16)     /* states live in [2^16, 2^32); renormalisation moves 16 bits */
#define LEVEL_BITS 6          /* a table entry: a quarter-octave frequency level, 0 = absent */
#define SIDE_CENTER 15        /* side symbol = channel max exponent - plane base + 15 */
#define SIDE_ALPHA 32         /* 31 offsets and the escape */
#define RMAX 15               /* exponent residuals 0..14 are coded, larger ones escape; with one
                               * hi bit the main alphabet is 31 symbols, which the AVX-512 decoder
                               * searches in one register pair */
#define FLIP_ALPHA_MAX 256    /* first-flip symbols; with more tokens, 255 escapes */
#define MAX_LO 8
#define SIGN_KEEP_PERMILLE 990    /* code signs only when it saves 1% of their bits */
#define LO_MIN_SAVING_PERMILLE 50 /* drop low mantissa bits only when it saves 0.05 bit/element */
#define LO_EXCEPTION_BITS 16      /* estimated cost of one low-bit exception (varint + byte) */

enum { DT_BF16 = 1, DT_FP16 = 2, DT_FP32 = 3, DT_E4M3 = 4, DT_E5M2 = 5 };
enum { KIND_KV = 0, KIND_LATENT = 1 };
enum { MODE_RAW = 0, MODE_CODED = 1 };

/* decode_page's results; tierkv/codec/format.py holds the matching texts. */
enum {
    ERR_OK = 0, ERR_SHORT = 1, ERR_MAGIC = 2, ERR_VERSION = 3, ERR_LAYOUT = 4,
    ERR_CHECKSUM = 5, ERR_STRUCTURE = 6, ERR_STREAM = 7, ERR_NOMEM = 8,
};

/* Context ids, also the order of the tables in a page. */
#define CTX_SIDE(kc) (kc)
#define CTX_FLIP(kc) (2 + (kc))
#define CTX_MAIN(kc) (4 + (kc))
#define NCTX 6

/* A page: `planes` planes (layer x K/V, or layer for latent pages) of `tokens` rows of
 * `chans` channels (heads x head_dim); element (p, t, c) is at ((p*tokens)+t)*chans+c. */
typedef struct {
    int dtype, kind;
    uint32_t layers, tokens, heads, head_dim;
    int nbits, ebits, mbits, itemsize;   /* element width, exponent and mantissa bits */
    size_t planes, chans, elems, page_bytes;
    int nkc;                             /* 2 (K, V) or 1 (latent) */
    int rmax;                            /* exponent residuals 0..rmax-1 are coded, others escape */
    int hi_default;                      /* leading mantissa bits coded with the residual */
    int flip_alpha, flip_esc;            /* first-flip alphabet; escape symbol or -1 */
} Layout;

/* A page's coding parameters (payload bytes 0..3 hold hi, tz, lo and the sign flags). */
typedef struct {
    int hi, tz, lo, mid;                 /* mantissa = hi | mid | lo | tz bits; tz bits are zero
                                          * everywhere, lo bits zero but for listed exceptions */
    int sign_coded[2];                   /* per K/V class: first-flip positions coded */
    int main_alpha, esc;                 /* (rmax << hi) + 1 symbols; the last escapes */
} Params;

/* The probability model of one page: per context, frequencies summing to 2^pbits. */
typedef struct {
    int alpha[NCTX], pbits[NCTX];
    uint8_t used[NCTX];                  /* the page carries this context's table */
    uint8_t present[NCTX];               /* ... and it holds at least one symbol */
    uint16_t freq[NCTX][256];
    uint16_t start[NCTX][256];
} Model;

int bits_for(int alpha);

int layout_init(Layout *lay);
void params_init(const Layout *lay, Params *pr, int hi);
void model_contexts(const Layout *lay, const Params *pr, Model *m);
int levels_to_freqs(const uint8_t *levels, int alpha, uint16_t *freq, int pbits);
void counts_to_levels(const uint32_t *counts, int alpha, uint8_t *levels, int pbits);
void freqs_to_starts(const uint16_t *freq, int alpha, uint16_t *start);
uint64_t page_checksum(const uint8_t *header, const uint8_t *payload, size_t payload_len);
void write_header(const Layout *lay, int mode, uint8_t *out, size_t payload_len);

/* Per-thread scratch, grown on demand and kept for the thread's next page (pages past
 * SCRATCH_KEEP_BYTES are freed at once), freed when the thread ends. */
#define MAX_GROUP 4   /* pages whose symbols decode together (decode_pages) */
enum { SCRATCH_ENC_STATE, SCRATCH_ENC_ARRAYS, SCRATCH_DEC_STATE,
       SCRATCH_DEC_ARRAYS = SCRATCH_DEC_STATE + MAX_GROUP, SCRATCH_KINDS };
#define SCRATCH_KEEP_BYTES (64u << 20)
void *scratch_get(int kind, size_t bytes);
void scratch_trim(void);

/* The SIMD paths, each doing what the scalar code does, byte for byte. codec_simd.c:
 * whether each may run here, and set_simd's limit (2: every path the CPU has, 3: the
 * same but VBMI2 with the symbols' register search alone and one page at a time, 4:
 * with gathers and one page at a time, 5: as 2, 6: as 2 with two pages at a time, 7: as
 * 2 without VBMI2; 1: no AVX-512; 0: scalar only). */
int have_avx2(void);
int have_avx512(void);
int have_avx512_bw(void);
int have_avx512_vbmi(void);
int have_avx512_vbmi2(void);
int use_gather(void);
int group_pages(void);
void set_simd(int allowed);
/* codec_simd_rans.c: rANS symbols (the encoder's is declared below EncSym). */
size_t decode_syms_avx512(uint32_t *xs, const uint8_t **pp, const uint8_t *end, const uint16_t *freq,
                          const uint16_t *start, int alpha, int pbits, const uint32_t *slots, uint8_t *out,
                          size_t nsyms);
uint32_t side_values_avx512(const uint8_t *sym, size_t C, int base, uint32_t emax, int isz, void *dst);
int flip_positions_avx512(const uint8_t *sym, size_t C, uint32_t nrows, uint32_t *f);
int level_freqs_avx512(const uint8_t *levels, int alpha, uint16_t *freq, int pbits, uint32_t *sum, int *top);
int search_tables16(const uint16_t *freq, const uint16_t *start, int alpha, int pbits, uint16_t *tabs);
size_t decode_symsN_avx512(int G, uint32_t *const xs[], const uint8_t **const pp[], const uint8_t *const end[],
                           const uint16_t *const tabs[], const int np[], const int pbits[], uint8_t *const out[],
                           size_t nsyms);
size_t decode_symsN_vbmi2(int G, uint32_t *const xs[], const uint8_t **const pp[], const uint8_t *const end[],
                          const uint16_t *const tabs[], const int np[], const int pbits[], uint8_t *const out[],
                          size_t nsyms);
/* codec_simd_rows.c: the decoder's signs, mid bits and rows. */
size_t plane_signs_avx512(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                          uint32_t nrows, size_t C);
size_t plane_signs_vbmi(uint64_t *sw, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                        uint32_t nrows, size_t C);
void plane_sign_rows_vbmi(uint64_t *rows, const uint32_t *f, const uint8_t *sign, size_t len, size_t *ks,
                          uint32_t nrows, size_t C);
void sign_rows_avx512(const uint64_t *sw, size_t C, uint32_t nrows, uint64_t *rows);
void assemble_16_consts(int w, uint8_t *perm, uint8_t *shift);
size_t assemble_16_avx512(uint16_t *out, const uint8_t *sym, const uint64_t *sg,
                          const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                          size_t C, const Layout *lay, const Params *pr, uint32_t *res);
void assemble_16_rows_avx512(uint16_t *const *out, uint32_t nrows, const uint8_t *sym, const uint64_t *sg,
                             const uint16_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                             size_t C, const Layout *lay, const Params *pr, uint8_t *res);
size_t assemble_8_avx512(uint8_t *out, const uint8_t *sym, const uint64_t *sg,
                         const uint8_t *cmax, const uint8_t *mid, const uint8_t *perm, const uint8_t *shift,
                         size_t C, const Layout *lay, const Params *pr, uint32_t *res);
size_t unpack_mids_bmi2(void *out, int isz, const uint8_t *mid, size_t len, size_t bit, int w, size_t C);
uint32_t combine_16_avx2(uint16_t *out, const uint8_t *sym, const uint64_t *sw,
                         uint32_t kbit, const uint16_t *cmax, const uint16_t *mv, size_t C,
                         const Layout *lay, const Params *pr);

/* How many mid bits travel in the rANS states: up to 31 per lane, taken from the end
 * of the mid stream and no further back than the last plane's mid bits. */
static inline size_t tail_bits(size_t last_plane_mid_bits)
{
    size_t cap = (size_t)TAIL_BITS_PER_LANE * LANES;
    return last_plane_mid_bits < cap ? last_plane_mid_bits : cap;
}

int encode_page(const Layout *lay, const uint8_t *src, uint8_t *dst, size_t cap, size_t *out_len);
int decode_page(const Layout *lay, const uint8_t *blob, size_t len, uint8_t *dst);
/* n pages (at most MAX_GROUP) at once, each as decode_page would (rc[g] its result), their
 * rANS symbols interleaved where they can (group_pages). */
void decode_pages(const Layout *lay, int n, const uint8_t *const blob[], const size_t len[], uint8_t *const dst[],
                  int32_t rc[]);

/* ------------------------------------------------------------- byte access -- */

static inline uint32_t rd_u32(const uint8_t *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24; }
static inline void wr_u32(uint8_t *p, uint32_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); p[2] = (uint8_t)(v >> 16); p[3] = (uint8_t)(v >> 24); }
static inline uint64_t rd_u64(const uint8_t *p) { return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32; }
static inline void wr_u64(uint8_t *p, uint64_t v) { wr_u32(p, (uint32_t)v); wr_u32(p + 4, (uint32_t)(v >> 32)); }
static inline uint16_t rd_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

static inline uint32_t load_elem(const uint8_t *p, int itemsize)
{
    if (itemsize == 2) return (uint32_t)p[0] | (uint32_t)p[1] << 8;
    if (itemsize == 1) return p[0];
    return rd_u32(p);
}

static inline void store_elem(uint8_t *p, int itemsize, uint32_t v)
{
    if (itemsize == 2) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }
    else if (itemsize == 1) p[0] = (uint8_t)v;
    else wr_u32(p, v);
}

/* ---------------------------------------------------------------- raw bits -- */
/* LSB-first bit packing: a value's bit 0 lands in the lowest unused bit of the stream. */

typedef struct { uint8_t *p, *end; uint64_t acc; int n; int overflow; } BitWriter;

/* nb <= 32; v must fit in nb bits. Whole 32-bit words leave the accumulator at once. */
static inline void bw_put(BitWriter *w, uint32_t v, int nb)
{
    w->acc |= (uint64_t)v << w->n;
    w->n += nb;
    if (w->n >= 32) {
        if (w->end - w->p >= 4) wr_u32(w->p, (uint32_t)w->acc);
        else w->overflow = 1;
        w->p += 4;
        w->acc >>= 32;
        w->n -= 32;
    }
}

/* bw_put without a branch on the word boundary (a coin toss where the lengths vary,
 * as raw sign runs do), for callers that made sure of room for every word they put and
 * 4 bytes more: the accumulator's low word is stored each time, and the pointer passes
 * it only once it is whole. */
static inline void bw_put_room(BitWriter *w, uint32_t v, int nb)
{
    w->acc |= (uint64_t)v << w->n;
    w->n += nb;
    const int full = w->n >= 32;
    wr_u32(w->p, (uint32_t)w->acc);
    w->p += 4 * full;
    w->acc >>= 32 * full;
    w->n -= 32 * full;
}

size_t pack_mids_bmi2(BitWriter *bw, const uint8_t *row, int isz, size_t C, int shift, int w);   /* codec_simd_scan.c */

static inline void bw_flush(BitWriter *w)
{
    for (; w->n > 0; w->n -= 8) {
        if (w->p < w->end) *w->p = (uint8_t)w->acc;
        else w->overflow = 1;
        w->p++;
        w->acc >>= 8;
    }
    w->acc = 0;
    w->n = 0;
}

typedef struct { const uint8_t *p, *end; uint64_t acc; int n; int underflow; } BitReader;

/* Bits of acc above n already hold the bytes at p (the 8-byte load overlaps), and a
 * later refill ORs the same bytes into the same positions, so no masking is needed. */
static inline void br_refill(BitReader *r)
{
    if (r->end - r->p >= 8) {
        r->acc |= rd_u64(r->p) << r->n;
        int take = (63 - r->n) >> 3;
        r->p += take;
        r->n += 8 * take;
    } else {
        while (r->n <= 56 && r->p < r->end) {
            r->acc |= (uint64_t)*r->p++ << r->n;
            r->n += 8;
        }
    }
}

/* nb <= 32. Past the end of the stream sets underflow and returns 0. */
static inline uint32_t br_get(BitReader *r, int nb)
{
    if (r->n < nb) {
        br_refill(r);
        if (r->n < nb) {
            r->underflow = 1;
            return 0;
        }
    }
    uint32_t v = (uint32_t)(r->acc & ((1ull << nb) - 1));
    r->acc >>= nb;
    r->n -= nb;
    return v;
}

/* -------------------------------------------------------------------- rANS -- */

/* Encoder view of a symbol: x / freq through a 44-bit reciprocal, exact for x < 2^32 and
 * freq < 2^12 (the error x * (m - 2^44/freq) / 2^44 stays below 1/freq). */
typedef struct { uint64_t x_max; uint32_t rcp_hi, rcp_lo, freq, start, pbits; } EncSym;

static inline void encsym_init(EncSym *s, uint32_t start, uint32_t freq, int pbits)
{
    uint64_t m = ((1ull << 44) + freq - 1) / freq;
    s->x_max = ((uint64_t)(RANS_L >> pbits) << 16) * freq;
    s->rcp_hi = (uint32_t)(m >> 32);
    s->rcp_lo = (uint32_t)m;
    s->freq = freq;
    s->start = start;
    s->pbits = (uint32_t)pbits;
}

/* Pushes little-endian 16-bit words downwards from *pp; the caller guarantees room. */
static inline void rans_put(uint32_t *x, uint8_t **pp, const EncSym *s)
{
    /* Branch-free, as in the decoder: the word is always written below the stream and
     * kept only when the state sheds it; the caller's room covers one spare word. */
    uint32_t v = *x, emit = v >= s->x_max;
    (*pp)[-2] = (uint8_t)v;
    (*pp)[-1] = (uint8_t)(v >> 8);
    *pp -= 2 * emit;
    v >>= 16 * emit;
    uint32_t q = (uint32_t)(((uint64_t)v * s->rcp_hi + (((uint64_t)v * s->rcp_lo) >> 32)) >> 12);
    *x = (q << s->pbits) + (v - q * s->freq) + s->start;
}

/* The AVX-512 encoder's view of a context of at most 64 symbols (enc_tables builds it
 * once a page): per symbol 2^pbits - freq, start, x_max - 1 (0xFFFFFFFF for 2^32: never
 * sheds) and 1 / freq in double and in single precision; nreg: registers a table of
 * doubles takes. */
typedef struct { int32_t t[3][64]; double rcp[64]; float rcpf[64]; int nreg, pbits; } EncTables;

/* codec_simd_rans.c: the tables (-1 for a context of more than 64 symbols), and the
 * AVX-512 rANS encoder of nsyms (a multiple of 64) symbols */
int enc_tables(EncTables *t, const EncSym *es, const uint16_t *freq, int alpha, int pbits);
void encode_syms_avx512(uint32_t *xs, uint8_t **pp, const uint8_t *syms, size_t nsyms, const EncTables *t);

#endif
