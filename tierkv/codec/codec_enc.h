/*
 * The encoder's state, shared by codec_enc.c (decisions, tables, rANS, the payload) and
 * codec_scan.c (the passes over the page's elements). Private to the encoder;
 * codec_core.h is the codec's shared header.
 */
#ifndef TIERKV_CODEC_ENC_H
#define TIERKV_CODEC_ENC_H

#include "codec_core.h"

typedef struct {
    const Layout *lay;
    const uint8_t *src;
    Params pr;
    Model m;
    uint8_t levels[NCTX][256];
    uint32_t counts[NCTX][256];
    uint64_t lo_nonzero[MAX_LO + 1];   /* [k]: coded elements whose k low bits above tz are not all zero */
    size_t nexc;                  /* elements whose lo bits are not zero */
    uint64_t flip_raw[2];         /* raw sign bits left per K/V class if signs are coded */
    uint64_t elems_kc[2];         /* coded elements per K/V class */
    EncSym es[NCTX][256];
    EncTables et[NCTX];           /* where avx512: the vector encoder's tables */
    uint8_t et_ok[NCTX];          /* ... built (the context has at most 64 symbols) */
    uint8_t *sym, *lov;           /* per element */
    uint8_t *side;                /* per plane x channel */
    uint32_t *fpos;               /* per plane x channel: first flip, counted in coded rows */
    uint32_t *nrows;              /* per plane: coded (non-repeated) rows */
    uint8_t *dup;                 /* per plane x token: 1 = repeats an earlier row */
    uint8_t *resc;                /* per plane x token: 1 = a coded row with an escaped symbol */
    uint8_t *side_esc;            /* per plane: 1 = a channel's side symbol escapes */
    uint32_t *dup_src;
    uint8_t *base;                /* per plane */
    uint16_t *cmax;               /* per plane x channel: max exponent */
    uint8_t *s0;                  /* per channel: sign in the first coded row */
    uint32_t *signw;              /* per 32 coded rows x channel: their signs, a bit each */
    uint32_t *slots;              /* repeated-row hash table */
    size_t nslots, ndup, coded_elems;
    uint8_t *rans_buf, *raw_buf, *misc;
    size_t rans_cap, esc_cap, sign_cap, mid_cap;
    uint32_t lane_tail[LANES];    /* mid tail bits each lane's initial state carries */
    int bmi2;                     /* pack_mids_bmi2 may run here */
    int avx512;                   /* encode_syms_avx512 may run here */
    int avx512bw;                 /* analyse_plane_16_avx512 may run here */
} Enc;

/* codec_scan.c */
void find_dups(Enc *E);
int common_zero_bits(const Enc *E);
void analyse_plane(Enc *E, size_t p);
void write_streams(const Enc *E, BitWriter *esc, BitWriter *sign, BitWriter *mid);
size_t take_mid_tail(Enc *E, uint8_t *mid, size_t total_bits);
void plane_side(Enc *E, size_t p, int kc);
void plane_flip_counts(Enc *E, size_t p, int kc);

/* codec_simd_scan.c */
void analyse_plane_16_avx512(Enc *E, size_t p, int kc);
void analyse_plane_8_avx512(Enc *E, size_t p, int kc);
size_t or_signs_16_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift);
size_t or_signs_8_avx512(uint32_t *wq, const uint8_t *row, size_t C, unsigned shift);

#endif
