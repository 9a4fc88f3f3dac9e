/*
 * Which instruction set a kernel unit is built for -- meson.build defines one LTX_VARIANT_* for
 * each build of kernels.c and quant.c -- and the names of its tables: kernels.c's
 * ltx_kernels_<variant> and quant.c's ltx_layout_<variant>, which dispatch.c joins into the one
 * table of that instruction set.
 */
#ifndef LTX2BLAS_VARIANT_H
#define LTX2BLAS_VARIANT_H

/* AVX-512 plus the bf16 conversion instructions (AVX512_BF16, with BW, DQ and VL): the avx512
 * build with the bf16 instructions besides. */
#if defined(LTX_VARIANT_AVX512BF16)
#define LTX_VARIANT_AVX512
#define LTX_BF16_CONVERT
#define LTX_VARIANT avx512bf16
#elif defined(LTX_VARIANT_AVX512)
#define LTX_VARIANT avx512
#elif defined(LTX_VARIANT_AVX2)
#define LTX_VARIANT avx2
#elif defined(LTX_VARIANT_NEON_BF16)
/* Armv8.2 with FEAT_BF16: the neon build with the BF16 instructions besides (BFMLALB/T for the
 * exact fuse, BFDOT for the Linear), chosen where the kernel reports HWCAP2_BF16. */
#define LTX_VARIANT_NEON
#define LTX_ARM_BF16
#define LTX_VARIANT neon_bf16
#elif defined(LTX_VARIANT_NEON)
#define LTX_VARIANT neon
#elif defined(LTX_VARIANT_BASE)
#define LTX_VARIANT base
#else
#error "define one LTX_VARIANT_*"
#endif

/* The builds with the dot-product kernels (kernels.h: dot_fuse_bf16 and the dot Linear). */
#if defined(LTX_BF16_CONVERT) || defined(LTX_ARM_BF16)
#define LTX_DOT_PAIRS
#endif

#define LTX_CAT_(a, b) a##b
#define LTX_CAT(a, b) LTX_CAT_(a, b)
#define LTX_STR_(a) #a
#define LTX_STR(a) LTX_STR_(a)
/* This build's name ("avx512", ...), and its tables' names. */
#define LTX_VARIANT_NAME LTX_STR(LTX_VARIANT)
#define LTX_KERNELS_TABLE LTX_CAT(ltx_kernels_, LTX_VARIANT)
#define LTX_LAYOUT_TABLE LTX_CAT(ltx_layout_, LTX_VARIANT)

#endif
