/*
 * The GPU decoder's C side: the host's preparation of a batch (codec_gpu.c) and the CPU
 * emulation of the kernel (codec_gpu_emu.c). The kernel and the descriptor layout it
 * reads: codec_gpu_kernel.cuh. Used by _codec.c.
 */
#ifndef TIERKV_CODEC_GPU_H
#define TIERKV_CODEC_GPU_H

#include "codec_core.h"

#define TK_LAYOUT_ONLY
#include "codec_gpu_kernel.cuh"
#undef TK_LAYOUT_ONLY

/* A growing array of u32 words: the batch's side blocks. */
typedef struct { uint32_t *w; size_t len, cap; } GpuSink;

/* The batch's geometry words (GG_WORDS). */
void gpu_geometry(const Layout *lay, uint32_t *geo);
/* Checks blob (at byte `at` of the batch's buffer) and writes its descriptor (GD_DESC_WORDS)
 * and side block; 0, or the C decoder's error code for a page it would refuse. */
int gpu_prepare_page(const Layout *lay, const uint8_t *blob, size_t len, uint64_t at, uint32_t *desc,
                     GpuSink *side);
/* Runs the kernel over n pages on the CPU, one emulated thread block after another. */
int gpu_emulate(const uint8_t *blobs, const uint32_t *descs, const uint32_t *sides, const uint32_t *geo,
                uint8_t *outs, int32_t *status, size_t n);

#endif
