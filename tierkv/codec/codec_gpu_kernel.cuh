/*
 * The GPU decoder of the lossless page codec (format v1, tierkv/codec/FORMAT.md): one
 * thread block of 64 threads per page, thread j running rANS lane j.
 *
 * One source, two builds. As CUDA (tierkv/codec/gpu.py prepends a prologue and builds it
 * with CuPy's NVRTC) it decodes pages read into pinned or device memory straight into
 * HBM. As C (codec_gpu_emu.c) it runs on the CPU under a small emulation of a thread
 * block (64 cooperative contexts, barriers and warp ballots), so the CPU tests check this
 * code, line for line, against the C decoder. The prologue defines:
 *   u8 u16 u32 u64         fixed-width unsigned types
 *   TK_KERNEL(name)        a kernel's declaration; TK_DEVICE a device function's
 *   TK_SHARED              block-shared storage
 *   TK_TID, TK_BID         thread index (0..63) and block index (the page)
 *   TK_SYNC()              the block barrier
 *   TK_BALLOT(pred)        the 32-bit mask of pred over the calling thread's warp
 *   TK_POPC(x)             population count
 * Only block-uniform control flow reaches TK_SYNC and TK_BALLOT: every loop bound below
 * comes from the layout or the host's checked metadata, never from the rANS stream, so
 * a corrupt page runs to the end and is reported, without early exits.
 *
 * What the host does first (codec_gpu.c): checks the header, the checksum and every
 * section length as the C decoder does; turns the tables into frequencies and starts,
 * the repeated rows into a coded-row list and a source per repeated row, the low-bit
 * exceptions into element indices; all into a descriptor and a side block per page. The
 * device does the rest: the rANS lanes (renormalisation words found by a ballot and a
 * prefix count over the two warps), escapes and raw signs by prefix sums over their known
 * widths, every element of a row by its own thread, the mid bits carried by the final
 * states, the low-bit exceptions and the repeated rows; and every check the C decoder
 * makes of the streams (a failed page gets a nonzero status and must not be used).
 */
#ifndef TIERKV_CODEC_GPU_LAYOUT
#define TIERKV_CODEC_GPU_LAYOUT

#define GD_THREADS 64
#define GD_DESC_WORDS 32
#define GD_NONE 0xFFFFFFFFu
#define GD_TABLE_WORDS 256                 /* per context in the side block: freq | start << 16 */
#define GD_NCTX 6
#define GD_SLOT_WORDS (2 * 256 + 4 * 2048) /* side 2 x 2^8, first flips 2 x up to 2^11, main 2 x 2^11 */
#define GD_WINDOW_BYTES 264                /* the mid tail: at most 7 + 64 x 31 bits, and a margin */
#define GD_ERR_STREAM 7                    /* tierkv.codec.format: the streams are inconsistent */
#define GD_ERR_EMULATION 9                 /* the CPU emulation found a barrier not every thread reached */

/* Descriptor words (u32 per page). */
enum {
    GD_MODE, GD_PAYLOAD_LO, GD_PAYLOAD_HI, GD_SIDE_LO, GD_SIDE_HI, GD_RANS_OFF, GD_RANS_LEN,
    GD_ESC_OFF, GD_ESC_LEN, GD_SIGN_OFF, GD_SIGN_LEN, GD_MID_OFF, GD_MID_LEN, GD_HI, GD_TZ, GD_LO,
    GD_MIDW, GD_FLAGS, GD_ESC_SYM, GD_FROM_LO, GD_FROM_HI, GD_TAIL, GD_NEXC, GD_PLEN,
};

/* Geometry words (u32, the same for every page of a batch). */
enum {
    GG_ITEMSIZE, GG_EBITS, GG_MBITS, GG_NBITS, GG_PLANES, GG_TOKENS, GG_CHANS, GG_NKC, GG_FLIP_ALPHA,
    GG_FLIP_PBITS, GG_FLIP_ESC, GG_FLIP_NB, GG_PAGE_LO, GG_PAGE_HI, GG_WORDS,
};

/* The side block of a page (u32 words from its GD_SIDE offset; give the macros 64-bit
 * arguments, 2 x planes x tokens may pass 2^32 for a 2 GiB page): the tables of the six
 * contexts, then per plane the base exponent, the coded rows and the coded elements
 * before it, the first low-bit exception of each plane (planes + 1), the coded rows'
 * tokens and each row's source (GD_NONE when coded), then the exceptions as pairs
 * (element of the page, low bits). */
#define GD_SIDE_BASE(P) (GD_NCTX * GD_TABLE_WORDS)
#define GD_SIDE_NROWS(P) (GD_SIDE_BASE(P) + (P))
#define GD_SIDE_KK0(P) (GD_SIDE_NROWS(P) + (P))
#define GD_SIDE_EXC0(P) (GD_SIDE_KK0(P) + (P))
#define GD_SIDE_TOK(P) (GD_SIDE_EXC0(P) + (P) + 1)
#define GD_SIDE_SRC(P, T) (GD_SIDE_TOK(P) + (P) * (T))
#define GD_SIDE_EXC(P, T) (GD_SIDE_SRC(P, T) + (P) * (T))
#define GD_SIDE_WORDS(P, T, NEXC) (GD_SIDE_EXC(P, T) + 2 * (NEXC))

/* Where each context's slots start in the shared slot table. */
#define GD_SLOT_SIDE(kc) ((kc) * 256)
#define GD_SLOT_FLIP(kc) (512 + (kc) * 2048)
#define GD_SLOT_MAIN(kc) (512 + 4096 + (kc) * 2048)

#endif /* TIERKV_CODEC_GPU_LAYOUT */

#if !defined(TK_LAYOUT_ONLY) && !defined(TIERKV_CODEC_GPU_KERNEL)
#define TIERKV_CODEC_GPU_KERNEL

#define GD_RANS_L 0x10000u
#define GD_STATE_TOP 0x80000000u
#define GD_TAIL_BITS 31

/* Up to 32 bits of an LSB-first stream from bit off (zeros past its end). */
TK_DEVICE u32 gd_bits(const u8 *buf, u64 len, u64 off, u32 nb)
{
    u64 q = off >> 3, v = 0;
    for (u32 i = 0; i < 5; i++)
        if (q + i < len) v |= (u64)buf[q + i] << (8 * i);
    v >>= off & 7;
    return nb >= 32 ? (u32)v : (u32)v & ((1u << nb) - 1);
}

/* The mid stream with its tail: bytes before the window from the section, the rest from
 * the window built from the final rANS states. */
TK_DEVICE u32 gd_mid_bits(const u8 *sec, u64 sec_len, const u8 *win, u64 wbyte, u64 off, u32 nb)
{
    u64 q = off >> 3, v = 0;
    for (u32 i = 0; i < 5; i++) {
        u64 b = q + i;
        u32 byte = 0;
        if (b < wbyte) byte = b < sec_len ? sec[b] : 0;
        else if (b - wbyte < GD_WINDOW_BYTES) byte = win[b - wbyte];
        v |= (u64)byte << (8 * i);
    }
    v >>= off & 7;
    return nb >= 32 ? (u32)v : (u32)v & ((1u << nb) - 1);
}

TK_DEVICE u32 gd_load(const u8 *p, u32 isz)
{
    if (isz == 2) return (u32)p[0] | (u32)p[1] << 8;
    if (isz == 1) return p[0];
    return (u32)p[0] | (u32)p[1] << 8 | (u32)p[2] << 16 | (u32)p[3] << 24;
}

TK_DEVICE void gd_store(u8 *p, u32 isz, u32 v)
{
    p[0] = (u8)v;
    if (isz >= 2) p[1] = (u8)(v >> 8);
    if (isz == 4) {
        p[2] = (u8)(v >> 16);
        p[3] = (u8)(v >> 24);
    }
}

/* One step of the 64 lanes: lane TK_TID decodes a symbol when active. Renormalisation
 * words are taken in lane order (a prefix count of the lanes that need one); the lanes'
 * escapes (symbol == esc) are counted the same way, for the caller's escape offsets.
 * *pos is the rANS stream position (bytes), the same in every thread (64 bits: it keeps
 * counting past the end of a damaged stream). */
typedef struct { u32 sym, esc_before, esc_total; } gd_step_t;

TK_DEVICE gd_step_t gd_step(u32 *x, int active, const u32 *slots, u32 pbits, u32 esc, const u8 *rans,
                            u32 rans_len, u64 *pos, u32 *cnt, u32 *parity, int *err)
{
    const u32 tid = TK_TID, lane = tid & 31, warp = tid >> 5;
    u32 v = *x, e = slots[v & ((1u << pbits) - 1)];
    gd_step_t r;
    r.sym = e & 0xFF;
    v = ((e >> 8) & 0xFFF) * (v >> pbits) + (e >> 20);
    int need = active && v < GD_RANS_L;
    int is_esc = active && r.sym == esc;
    u32 bn = TK_BALLOT(need), be = TK_BALLOT(is_esc);
    u32 below = lane ? 0xFFFFFFFFu >> (32 - lane) : 0;
    u32 *c = cnt + 2 * *parity;
    if (lane == 0) c[warp] = (u32)TK_POPC(bn) | (u32)TK_POPC(be) << 8;
    TK_SYNC();
    u32 w0 = c[0], w1 = c[1];
    *parity ^= 1;
    u32 nb = (u32)TK_POPC(bn & below) + (warp ? (w0 & 0xFF) : 0);
    r.esc_before = (u32)TK_POPC(be & below) + (warp ? (w0 >> 8) : 0);
    r.esc_total = (w0 >> 8) + (w1 >> 8);
    if (need) {
        u64 at = *pos + 2 * nb;
        if (at + 2 <= rans_len) v = v << 16 | (u32)rans[at] | (u32)rans[at + 1] << 8;
        else *err = GD_ERR_STREAM;
    }
    *pos += 2 * ((w0 & 0xFF) + (w1 & 0xFF));
    if (active) *x = v;
    return r;
}

/* A context's slot table (symbol | freq << 8 | slot - start << 20), the threads taking
 * each symbol's slots in turn: a symbol may hold most of the 2^11 slots. */
TK_DEVICE void gd_fill_slots(u32 *slots, const u32 *table, u32 alpha)
{
    for (u32 s = 0; s < alpha; s++) {
        u32 f = table[s] & 0xFFFF, st = table[s] >> 16;
        for (u32 k = TK_TID; k < f; k += GD_THREADS) slots[st + k] = s | f << 8 | k << 20;
    }
}

/* blobs: the payloads' bytes; descs: GD_DESC_WORDS per page; sides: the side blocks;
 * geo: GG_WORDS; outs: page_bytes per page; scratch: 3 x chans words per page; status:
 * per page, 0 to decode (the host's verdict otherwise, left as it is), set nonzero here
 * when the streams do not check out. */
TK_KERNEL(tk_codec_decode)(const u8 *blobs, const u32 *descs, const u32 *sides, const u32 *geo, u8 *outs,
                           u32 *scratch, int *status)
{
    TK_SHARED u32 s_slots[GD_SLOT_WORDS];
    TK_SHARED u32 s_cnt[4];
    TK_SHARED u32 s_sum[GD_THREADS];
    TK_SHARED u32 s_x[GD_THREADS];
    TK_SHARED u8 s_win[GD_WINDOW_BYTES];
    TK_SHARED int s_err;

    const u32 tid = TK_TID;
    const u64 page = TK_BID;
    if (status[page] != 0) return;   /* refused by the host: the whole block leaves */
    const u32 *d = descs + page * GD_DESC_WORDS;
    const u32 isz = geo[GG_ITEMSIZE], ebits = geo[GG_EBITS], mbits = geo[GG_MBITS];
    const u32 planes = geo[GG_PLANES], T = geo[GG_TOKENS], C = geo[GG_CHANS], nkc = geo[GG_NKC];
    const u64 page_bytes = (u64)geo[GG_PAGE_HI] << 32 | geo[GG_PAGE_LO];
    const u8 *pay = blobs + ((u64)d[GD_PAYLOAD_HI] << 32 | d[GD_PAYLOAD_LO]);
    u8 *out = outs + page * page_bytes;

    if (d[GD_MODE] == 0) {   /* stored raw */
        for (u64 i = tid; i < page_bytes; i += GD_THREADS) out[i] = pay[i];
        return;
    }

    const u32 *side = sides + ((u64)d[GD_SIDE_HI] << 32 | d[GD_SIDE_LO]);
    u32 *cmax = scratch + page * 3 * C, *fpos = cmax + C, *ksig = fpos + C;
    const u8 *rans = pay + d[GD_RANS_OFF], *escs = pay + d[GD_ESC_OFF];
    const u8 *sign = pay + d[GD_SIGN_OFF], *mids = pay + d[GD_MID_OFF];
    const u32 rans_len = d[GD_RANS_LEN], esc_len = d[GD_ESC_LEN], sign_len = d[GD_SIGN_LEN];
    const u32 mid_len = d[GD_MID_LEN];
    const u32 hi = d[GD_HI], tz = d[GD_TZ], lo = d[GD_LO], midw = d[GD_MIDW], flags = d[GD_FLAGS];
    const u32 esc_sym = d[GD_ESC_SYM], tail = d[GD_TAIL];
    const u64 from = (u64)d[GD_FROM_HI] << 32 | d[GD_FROM_LO];
    const u32 emask = (1u << ebits) - 1, himask = (1u << hi) - 1;
    const u32 hshift = mbits - hi, sshift = geo[GG_NBITS] - 1, midshift = tz + lo;
    const u32 flip_pbits = geo[GG_FLIP_PBITS], flip_esc = geo[GG_FLIP_ESC], flip_nb = geo[GG_FLIP_NB];
    const u64 plane_bytes = (u64)T * C * isz;
    int err = 0;

    if (tid == 0) s_err = 0;
    for (u32 kc = 0; kc < nkc; kc++) {
        gd_fill_slots(s_slots + GD_SLOT_SIDE(kc), side + (0 + kc) * GD_TABLE_WORDS, 32);
        if (flags >> kc & 1) gd_fill_slots(s_slots + GD_SLOT_FLIP(kc), side + (2 + kc) * GD_TABLE_WORDS,
                                           geo[GG_FLIP_ALPHA]);
        gd_fill_slots(s_slots + GD_SLOT_MAIN(kc), side + (4 + kc) * GD_TABLE_WORDS, esc_sym + 1);
    }

    /* The 64 initial states (the encoder's final ones). */
    u32 x = GD_RANS_L, parity = 0;
    u64 pos = 4 * GD_THREADS;
    if (rans_len < 4 * GD_THREADS) err = GD_ERR_STREAM;
    else x = gd_load(rans + 4 * tid, 4);
    if (x < GD_RANS_L) {
        err = GD_ERR_STREAM;
        x = GD_RANS_L;
    }
    TK_SYNC();

    u64 epos = 0, ksign = 0;   /* bits consumed of the escape and raw-sign streams */
    for (u32 p = 0; p < planes; p++) {
        const u32 kc = nkc == 2 ? (p & 1) : 0, coded = flags >> kc & 1;
        const u32 nrows = side[GD_SIDE_NROWS(planes) + p], base = side[GD_SIDE_BASE(planes) + p];
        const u64 kk0 = side[GD_SIDE_KK0(planes) + p];
        const u32 *tok = side + GD_SIDE_TOK((u64)planes) + (u64)p * T;
        const u32 *src = side + GD_SIDE_SRC((u64)planes, (u64)T) + (u64)p * T;
        u8 *plane = out + p * plane_bytes;

        /* Channel maxima: base + symbol - 15, symbol 31 escaping to ebits raw bits. */
        for (u32 c0 = 0; c0 < C; c0 += GD_THREADS) {
            const u32 c = c0 + tid;
            const int active = c < C;
            gd_step_t s = gd_step(&x, active, s_slots + GD_SLOT_SIDE(kc), 8, 31, rans, rans_len, &pos, s_cnt,
                                  &parity, &err);
            if (active) {
                u32 m;
                if (s.sym == 31) {
                    m = gd_bits(escs, esc_len, epos + (u64)s.esc_before * ebits, ebits);
                } else {
                    m = base + s.sym - 15;   /* below 0 wraps above emask */
                    if (m > emask) err = GD_ERR_STREAM;
                    m &= emask;
                }
                cmax[c] = m;
            }
            epos += (u64)s.esc_total * ebits;
        }
        /* First sign flips: positions 1..nrows, nrows meaning none. */
        if (coded) {
            for (u32 c0 = 0; c0 < C; c0 += GD_THREADS) {
                const u32 c = c0 + tid;
                const int active = c < C;
                gd_step_t s = gd_step(&x, active, s_slots + GD_SLOT_FLIP(kc), flip_pbits, flip_esc, rans,
                                      rans_len, &pos, s_cnt, &parity, &err);
                if (active) {
                    u32 f = s.sym;
                    if (s.sym == flip_esc) f = gd_bits(escs, esc_len, epos + (u64)s.esc_before * flip_nb, flip_nb);
                    if (f >= nrows) err = GD_ERR_STREAM;
                    fpos[c] = f + 1;
                }
                epos += (u64)s.esc_total * flip_nb;
            }
        }
        TK_SYNC();
        /* Each channel's raw signs are contiguous: where they start, by a prefix sum over
         * the channels (thread j sums a contiguous share of them). */
        {
            const u32 share = (C + GD_THREADS - 1) / GD_THREADS;
            const u32 c_lo = tid * share < C ? tid * share : C;
            const u32 c_hi = c_lo + share < C ? c_lo + share : C;
            u32 mine = 0;
            for (u32 c = c_lo; c < c_hi; c++) {
                u32 fc = fpos[c] <= nrows ? fpos[c] : nrows;
                mine += coded ? 1 + nrows - fc - (fc < nrows) : nrows;
            }
            s_sum[tid] = mine;
            TK_SYNC();
            u64 before = 0, total = 0;
            for (u32 j = 0; j < GD_THREADS; j++) {
                before += j < tid ? s_sum[j] : 0;
                total += s_sum[j];
            }
            for (u32 c = c_lo; c < c_hi; c++) {
                u32 fc = fpos[c] <= nrows ? fpos[c] : nrows;
                ksig[c] = (u32)(ksign + before);
                before += coded ? 1 + nrows - fc - (fc < nrows) : nrows;
            }
            ksign += total;
            TK_SYNC();
        }
        /* The coded rows: a main symbol per element, assembled at once. */
        for (u32 k = 0; k < nrows; k++) {
            const u32 t = tok[k];
            for (u32 c0 = 0; c0 < C; c0 += GD_THREADS) {
                const u32 c = c0 + tid;
                const int active = c < C;
                gd_step_t s = gd_step(&x, active, s_slots + GD_SLOT_MAIN(kc), 11, esc_sym, rans, rans_len, &pos,
                                      s_cnt, &parity, &err);
                if (active) {
                    u32 sg, e, hv;
                    const u64 ks = ksig[c];
                    if (coded) {
                        const u32 fc = fpos[c];
                        if (k < fc) sg = gd_bits(sign, sign_len, ks, 1);
                        else if (k == fc) sg = gd_bits(sign, sign_len, ks, 1) ^ 1;
                        else sg = gd_bits(sign, sign_len, ks + k - fc, 1);
                    } else {
                        sg = gd_bits(sign, sign_len, ks + k, 1);
                    }
                    const u32 mv = midw ? gd_bits(mids, mid_len, (kk0 + (u64)k * C + c) * midw, midw) : 0;
                    if (s.sym == esc_sym) {
                        const u32 v = gd_bits(escs, esc_len, epos + (u64)s.esc_before * (ebits + hi), ebits + hi);
                        e = v & emask;
                        hv = (v >> ebits) & himask;
                    } else {
                        const u32 r = s.sym >> hi;
                        if (r > cmax[c]) err = GD_ERR_STREAM;
                        e = (cmax[c] - r) & emask;
                        hv = s.sym & himask;
                    }
                    gd_store(plane + ((u64)t * C + c) * isz, isz,
                             sg << sshift | e << mbits | hv << hshift | mv << midshift);
                }
                epos += (u64)s.esc_total * (ebits + hi);
            }
        }
        if (p == planes - 1) {
            /* Each final state is 2^31 plus up to 31 bits of the mid stream's tail. */
            const u32 n_lo = tid * GD_TAIL_BITS;
            u32 n = tail > n_lo ? tail - n_lo : 0;
            if (n > GD_TAIL_BITS) n = GD_TAIL_BITS;
            if (x < GD_STATE_TOP || (n < GD_TAIL_BITS && (x - GD_STATE_TOP) >> n)) err = GD_ERR_STREAM;
            s_x[tid] = x;
            for (u32 i = tid; i < GD_WINDOW_BYTES; i += GD_THREADS) s_win[i] = 0;
            TK_SYNC();
            const u64 wbyte = from >> 3;
            if (tid == 0) {
                if ((from & 7) && wbyte < mid_len) s_win[0] = mids[wbyte];
                for (u32 j = 0; j < GD_THREADS; j++) {
                    if (s_x[j] < GD_STATE_TOP) continue;
                    u64 b = (from & 7) + (u64)j * GD_TAIL_BITS;
                    u64 v = (u64)(s_x[j] - GD_STATE_TOP) << (b & 7);
                    for (u64 q = b >> 3; v && q < GD_WINDOW_BYTES; v >>= 8, q++) s_win[q] |= (u8)v;
                }
            }
            TK_SYNC();
            /* The elements whose mid bits reach into the tail get them now (OR: the bits
             * before the tail are the section's, already in place). */
            if (midw && tail) {
                const u64 coded_elems = kk0 + (u64)nrows * C;
                for (u64 kk = from / midw + tid; kk < coded_elems; kk += GD_THREADS) {
                    const u64 local = kk - kk0;
                    const u32 k = (u32)(local / C), c = (u32)(local % C);
                    u8 *q = plane + ((u64)tok[k] * C + c) * isz;
                    const u32 mv = gd_mid_bits(mids, mid_len, s_win, wbyte, kk * midw, midw);
                    gd_store(q, isz, gd_load(q, isz) | mv << midshift);
                }
            }
            TK_SYNC();
        }
        TK_SYNC();
        /* This plane's low-bit exceptions (element indices are the host's, checked). */
        {
            const u32 e_lo = side[GD_SIDE_EXC0(planes) + p], e_hi = side[GD_SIDE_EXC0(planes) + p + 1];
            const u32 *exc = side + GD_SIDE_EXC((u64)planes, (u64)T);
            for (u32 i = e_lo + tid; i < e_hi; i += GD_THREADS) {
                u8 *q = out + (u64)exc[2 * (u64)i] * isz;
                gd_store(q, isz, gd_load(q, isz) | exc[2 * (u64)i + 1] << tz);
            }
        }
        TK_SYNC();
        /* Repeated rows, from their coded sources (the host resolved chains). */
        const u64 rb = (u64)C * isz;
        for (u32 t = 0; t < T; t++) {
            if (src[t] == GD_NONE) continue;
            const u8 *from_row = plane + (u64)src[t] * rb;
            u8 *to_row = plane + (u64)t * rb;
            for (u64 b = tid; b < rb; b += GD_THREADS) to_row[b] = from_row[b];
        }
        TK_SYNC();
    }
    /* Every stream consumed exactly (up to 7 padding bits in the bit streams). */
    if (pos != rans_len) err = GD_ERR_STREAM;
    if (epos > (u64)esc_len * 8 || (u64)esc_len * 8 - epos >= 8) err = GD_ERR_STREAM;
    if (ksign > (u64)sign_len * 8 || (u64)sign_len * 8 - ksign >= 8) err = GD_ERR_STREAM;
    if (err) s_err = err;
    TK_SYNC();
    if (tid == 0 && s_err) status[page] = s_err;
}

#endif /* the kernel */
