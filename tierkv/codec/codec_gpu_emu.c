/*
 * The GPU decoder's kernel (codec_gpu_kernel.cuh) built as C and run on the CPU: a thread
 * block is 64 cooperative contexts (ucontext) in the calling thread, switched at every
 * barrier, so the CPU tests run the kernel's own code against the C decoder. Shared
 * memory is the kernel's function-level statics (one block runs at a time); a warp
 * ballot is a barrier with each thread's predicate in a slot; a barrier that some threads
 * reach while others have left fails the page (GD_ERR_EMULATION) instead of hanging.
 * Slow (a context switch per thread per barrier) and not reentrant: one call at a time,
 * under the GIL (_codec.c). Used by tests, never by the store.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <ucontext.h>

#include "codec_gpu.h"

typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;

enum { RUNNING, AT_BARRIER, DONE };
#define EMU_STACK (256 * 1024)

static struct {
    ucontext_t main, ctx[GD_THREADS];
    int state[GD_THREADS];
    u32 tid, bid;
    u32 ballot[2][GD_THREADS];
    int ballot_parity[GD_THREADS];
    /* the launch's arguments */
    const u8 *blobs;
    const u32 *descs, *sides, *geo;
    u8 *outs;
    u32 *scratch;
    int *status;
} emu;

static void
emu_sync(void)
{
    u32 t = emu.tid;
    emu.state[t] = AT_BARRIER;
    swapcontext(&emu.ctx[t], &emu.main);
}

static u32
emu_ballot(int pred)
{
    u32 t = emu.tid;
    int par = emu.ballot_parity[t];
    emu.ballot_parity[t] ^= 1;
    emu.ballot[par][t] = pred != 0;
    emu_sync();
    u32 mask = 0, w0 = emu.tid & ~31u;
    for (u32 i = 0; i < 32; i++) mask |= emu.ballot[par][w0 + i] << i;
    return mask;
}

#define TK_KERNEL(name) static void name
#define TK_DEVICE static inline
#define TK_SHARED static
#define TK_TID (emu.tid)
#define TK_BID (emu.bid)
#define TK_SYNC() emu_sync()
#define TK_BALLOT(pred) emu_ballot(pred)
#define TK_POPC(x) __builtin_popcount(x)
#include "codec_gpu_kernel.cuh"

static void
emu_thread(void)
{
    tk_codec_decode(emu.blobs, emu.descs, emu.sides, emu.geo, emu.outs, emu.scratch, emu.status);
    emu.state[emu.tid] = DONE;
}

/* One block: every thread runs to its next barrier (or its end) in turn, until all end.
 * 0, or -1 when a barrier was not reached by every thread still running. */
static int
emu_block(char *stacks)
{
    for (u32 t = 0; t < GD_THREADS; t++) {
        getcontext(&emu.ctx[t]);
        emu.ctx[t].uc_stack.ss_sp = stacks + (size_t)t * EMU_STACK;
        emu.ctx[t].uc_stack.ss_size = EMU_STACK;
        emu.ctx[t].uc_link = &emu.main;
        makecontext(&emu.ctx[t], emu_thread, 0);
        emu.state[t] = RUNNING;
        emu.ballot_parity[t] = 0;
    }
    for (;;) {
        for (u32 t = 0; t < GD_THREADS; t++) {
            if (emu.state[t] == DONE) continue;
            emu.tid = t;
            emu.state[t] = RUNNING;
            swapcontext(&emu.main, &emu.ctx[t]);
        }
        int done = 0;
        for (u32 t = 0; t < GD_THREADS; t++) done += emu.state[t] == DONE;
        if (done == GD_THREADS) return 0;
        if (done) return -1;
    }
}

int
gpu_emulate(const uint8_t *blobs, const uint32_t *descs, const uint32_t *sides, const uint32_t *geo,
            uint8_t *outs, int32_t *status, size_t n)
{
    char *stacks = malloc((size_t)GD_THREADS * EMU_STACK);
    u32 *scratch = calloc(n * 3 * (size_t)geo[GG_CHANS] + 1, sizeof(u32));
    if (stacks == NULL || scratch == NULL) {
        free(stacks);
        free(scratch);
        return ERR_NOMEM;
    }
    emu.blobs = blobs;
    emu.descs = descs;
    emu.sides = sides;
    emu.geo = geo;
    emu.outs = outs;
    emu.scratch = scratch;
    emu.status = (int *)status;
    for (size_t b = 0; b < n; b++) {
        emu.bid = (u32)b;
        if (emu_block(stacks) != 0) status[b] = GD_ERR_EMULATION;
    }
    free(stacks);
    free(scratch);
    return 0;
}
