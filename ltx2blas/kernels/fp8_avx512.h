/*
 * fp8 rounding, sixteen f32 values at a time on AVX-512, shared by the AVX-512 builds of the
 * fuse's rounding store (kernels.c) and of the fp8 layouts' passes (quant.c).
 */
#ifndef LTX_FP8_AVX512_H
#define LTX_FP8_AVX512_H

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define LTX_AVX512_TARGET __attribute__((target("avx512f")))

/* The value of each lane's fp8 code (each below 256), as ltx_fp8_value gives it, without a
 * table: for a normal code its exponent and mantissa bits placed in an f32's and the exponent
 * rebiased; for a subnormal code its mantissa m converted and scaled, m 2**(1 - bias - mant),
 * exact; inf and NaN selected, NaN unsigned. */
static inline LTX_AVX512_TARGET __m512 ltx_fp8_value_avx512(__m512i c, int kind)
{
    const ltx_fp8_format *f = &LTX_FP8[kind];
    const int mant = f->mant, bias = f->bias;
    const float quantum = f->quantum;
    const __m512i mag = _mm512_and_si512(c, _mm512_set1_epi32(0x7F));
    const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 23 - mant),
                                            _mm512_set1_epi32((127 - bias) << 23));
    const __m512i subnormal = _mm512_castps_si512(
        _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(quantum)));
    const __mmask16 small = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(1 << mant));
    __m512i v = _mm512_mask_blend_epi32(small, normal, subnormal);
    const __mmask16 inf = f->inf ? _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32((int)f->inf)) : 0;
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32((int)f->nan_above));
    v = _mm512_mask_mov_epi32(v, inf, _mm512_set1_epi32(0x7F800000));
    v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, nan, _mm512_set1_epi32(0x7FC00000)));
}

/* The fp8 code of each lane of x, nearest-even, as quant.c's fp8_encode gives it for every
 * input: below the smallest normal the magnitude is rounded to the subnormal quantum by one
 * f32 addition of a constant whose unit in the last place is that quantum (exact); above it
 * the f32 bits are rounded nearest-even at the fp8 mantissa and rebiased; a code past the
 * largest finite one -- inf and NaN included -- becomes the kind's `over` (e4m3 0x7E, or 0x7F
 * as torch cast before 2.13; e5m2 0x7C), and those lanes are returned in *past. The sign is
 * the input's. */
static inline LTX_AVX512_TARGET __m512i ltx_fp8_round_avx512(__m512 x, int kind,
                                                             __mmask16 *past)
{
    const ltx_fp8_format *f = &LTX_FP8[kind];
    const int mant = f->mant, bias = f->bias, shift = 23 - mant;
    const uint32_t magic_bits = (uint32_t)(127 + 23 + 1 - bias - mant) << 23 | 0x400000u;
    float magic;
    memcpy(&magic, &magic_bits, 4);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i sub = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(magic))),
        _mm512_set1_epi32((int)magic_bits));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, shift), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32((1 << (shift - 1)) - 1)), lsb),
        shift);
    const __m512i normal = _mm512_sub_epi32(rounded, _mm512_set1_epi32((127 - bias) << mant));
    const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((128 - bias) << 23));
    const __m512i code = _mm512_mask_blend_epi32(small, normal, sub);
    *past = _mm512_cmpgt_epu32_mask(code, _mm512_set1_epi32((int)f->largest));
    return _mm512_or_si512(
        _mm512_mask_mov_epi32(code, *past, _mm512_set1_epi32((int)f->over)), sign);
}
#endif

#endif
