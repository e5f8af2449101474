/*
 * codec_simd_group.c built again for CPUs with AVX-512 VBMI2: decode_symsN_vbmi2, the
 * same symbols from states kept as 16-bit halves (group_kernel16, see there).
 */
#define GROUP_VBMI2 1
#include "codec_simd_group.c"
