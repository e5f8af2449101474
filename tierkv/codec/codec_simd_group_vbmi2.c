/*
 * codec_simd_group.c built again for CPUs with AVX-512 VBMI2 and BMI2:
 * decode_symsN_vbmi2, the same symbols with the renormalisation's words expanded
 * into 16-bit halves (see there).
 */
#define GROUP_VBMI2 1
#include "codec_simd_group.c"
