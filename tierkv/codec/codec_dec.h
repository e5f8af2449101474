/*
 * The decoder's state, shared by codec_dec.c (payload, tables), codec_planes.c (rANS
 * symbols, the plane loop) and codec_rows.c (signs, mid bits and the assembly of rows).
 * Private to the decoder; codec_core.h is the codec's shared header.
 */
#ifndef TIERKV_CODEC_DEC_H
#define TIERKV_CODEC_DEC_H

#include "codec_core.h"

typedef struct {
    const Layout *lay;
    Params pr;
    Model m;
    uint32_t slot[NCTX][PROB_SCALE];   /* sym | freq << 8 | bias << 20, for used contexts */
    uint8_t filled[NCTX];              /* slot[ctx] is built */
    uint16_t t16[NCTX][192];           /* decode_symsN_avx512's tables (search_tables16) */
    int np16[NCTX];                    /* their present symbols; -1: not built yet */
    const uint8_t *base, *rans_end;
    const uint8_t *sign;               /* raw signs, channel by channel */
    const uint8_t *mid;                /* mid bits from bit mid0 on: the section, read in place, then
                                        * (the last plane) mid_buf with the tail from the states */
    uint8_t *mid_buf;                  /* scratch of mid_cap bytes */
    const uint8_t *mid_sec;            /* the section (mid_sec_len bytes) */
    size_t mid_cap, mid_sec_len, mid0;
    size_t sign_len, mid_len, ksign, kmid, mid_bits, tail;
    uint8_t *dup;                      /* per plane x token */
    uint32_t *dup_src;
    uint32_t *cmax, *fpos, *midv;      /* per channel */
    uint16_t *cmax16;
    uint8_t *cmax8;
    int simd;                          /* combine_16_avx2 and unpack_mids_bmi2 may run here */
    int avx512;                        /* decode_syms_avx512 may run here */
    int vbmi;                          /* assemble_16_avx512 may run here */
    int gather;                        /* decode_syms_avx512 may gather (use_gather) */
    int vbmi2;                         /* decode_symsN_vbmi2 may run here */
    uint8_t perm[64], shift[64];       /* assemble_16_avx512's constants for this page's mid width */
    uint8_t *sym;                      /* per plane: tokens x channels */
    const uint8_t *exc, *exc_end;      /* lo exceptions still to apply */
    uint64_t exc_left, exc_next;       /* how many, and the coded element of the next one */
    uint64_t *sgw;                     /* per plane: sign masks, 64 rows x channels a word */
    uint64_t *sgr;                     /* per plane: sign masks by row, 64 channels a word (fused rows) */
    int fused;                         /* rows go through assemble_16/8_avx512 (assemble_row) */
    uint16_t **rowp;                   /* per token: a plane's coded rows' outputs (assemble_rows) */
    uint8_t *rowres;                   /* per token: their assembly's bits */
    BitReader esc;
    int err;
} Dec;

/* Up to 57 bits of a fixed-order stream from bit offset off (zeros past its end). */
static inline uint64_t
bits_at(const uint8_t *buf, size_t len, size_t off)
{
    size_t q = off >> 3;
    if (q + 8 <= len) return rd_u64(buf + q) >> (off & 7);
    uint64_t v = 0;
    for (size_t i = q; i < len && i < q + 8; i++) v |= (uint64_t)buf[i] << (8 * (i - q));
    return v >> (off & 7);
}

static inline int
get_varint(const uint8_t **pp, const uint8_t *end, uint64_t *v)
{
    uint64_t out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*pp >= end) return -1;
        uint8_t b = *(*pp)++;
        if (shift == 63 && (b & 0x7F) > 1) return -1;   /* past 64 bits */
        out |= (uint64_t)(b & 0x7F) << shift;
        if (!(b & 0x80)) {
            *v = out;
            return 0;
        }
    }
    return -1;
}

/* codec_dec.c: the checks before decoding, shared with the GPU decoder's host side */
int check_blob(const Layout *lay, const uint8_t *blob, size_t len, int *mode, size_t *plen);
int dec_open(const Layout *lay, const uint8_t *o, size_t plen, Dec **out, const uint8_t **sec, uint64_t *len,
             int copy_mid);

/* codec_planes.c: every plane of one page (0 or an error code), or of G pages together
 * (2 to MAX_GROUP; rc[g] each page's result) */
int decode_planes(Dec *D, const uint8_t *rans, uint8_t *dst);
void decode_planes_group(int G, Dec *const D[], const uint8_t *const rans[], uint8_t *const dst[], int32_t rc[]);

/* codec_rows.c */
int load_mid(Dec *D, const uint8_t *section, size_t len, int copy);
void mid_last_plane(Dec *D);
void absorb_tail(Dec *D, const uint32_t *x);
void plane_signs(Dec *D, int coded, uint32_t nrows);
void assemble_row(Dec *D, const uint8_t *sym, uint32_t k, uint8_t *out);
int assemble_rows(Dec *D, uint32_t nrows, size_t p, uint8_t *plane);

#endif
