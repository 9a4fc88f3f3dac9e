/*
 * Element passes of the scaled and quantised weight layouts: dequantise, add a bf16 delta,
 * requantise, by the rules of ltx2blas.reference (its "Scaled and quantised layouts" section).
 * quant.c is built once per instruction set, always with no contraction (the rounding is the
 * contract), into a table of these passes that dispatch.c hangs on the kernel table of the same
 * instruction set (ltx_kernels.layout). Every pass works on a range of rows (or one block) so
 * that a driver can share a weight out among threads; none allocates.
 */
#ifndef LTX2BLAS_QUANT_H
#define LTX2BLAS_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "kernels.h"

/* Offset of block scale (row, col) in the cuBLAS 128 x 4 tiled layout of a
 * [roundup(rows, 128), padded_cols] array (NVFP4's and MXFP8's block scales). */
static inline ltx_idx ltx_nvfp4_scale_offset(ltx_idx row, ltx_idx col, ltx_idx padded_cols)
{
    const ltx_idx tile = (row / 128) * (padded_cols / 4) + col / 4, r = row % 128;
    return tile * 512 + (r % 32) * 16 + (r / 32) * 4 + col % 4;
}

struct ltx_layout_passes {
    /* ---- per-tensor scaled fp8: n = f32(f32(code) * scale) + f32(delta) ---- */

    /* max |n| over n elements (codes and delta of one run of the weight). */
    float (*scaled_fp8_max)(const uint8_t *codes, const uint16_t *delta, ltx_idx count,
                            float scale, int e5m2);
    /* codes[i] = fp8(clamp(f32(n * mult), -fmax, fmax)), in place; fp8(n) when mult is
     * infinite (the whole tensor is zero). */
    void (*scaled_fp8_store)(uint8_t *codes, const uint16_t *delta, ltx_idx count, float scale,
                             float mult, float fmax, int e5m2);

    /* ---- blockwise fp8 / fp6: 128 x 128 blocks, one f32 scale each ([rows/128, cols/128]);
     * fp8: e4m3 codes [rows, cols]; fp6: packed [rows, cols * 3 / 4] (4 six-bit codes in 3
     * bytes) ---- */

    /* Rows r0..r1: delta[r, i] = bf16(bf16(f32(code) * scale[block]) + delta), in place;
     * returns max |merged| over the rows. */
    float (*block_merge_rows)(const uint8_t *codes, int fp6, const float *scales,
                              uint16_t *delta, ltx_idx cols, ltx_idx r0, ltx_idx r1);
    /* Blocks (bi, bj0..bj1) of merged bf16 [rows, cols], each: m = scale_max * f32(1 /
     * max|merged|) (448, or 0.1172 for fp6), code = e4m3(f32(merged * m)), scale = f32(1 / m). */
    void (*block_quantize)(const uint16_t *merged, ltx_idx cols, ltx_idx bi, ltx_idx bj0,
                           ltx_idx bj1, int fp6, uint8_t *codes, float *scales);

    /* ---- NVFP4: packed E2M1 rows (element 2j in the high nibble), E4M3 block scales of 16
     * elements in the tiled layout of `padded_cols` columns, one f32 scale_2 ---- */

    /* Rows r0..r1: delta[r, :] = bf16(bf16(e2m1 * f32(scale_2 * block scale)) + delta), in
     * place; returns max |merged| over the rows. */
    float (*nvfp4_merge_rows)(const uint8_t *packed, const uint8_t *scales, ltx_idx padded_cols,
                              float scale_2, uint16_t *delta, ltx_idx cols, ltx_idx r0,
                              ltx_idx r1);
    /* Rows r0..r1 of merged bf16 quantised with the new scale_2 `t`: packed codes and their
     * block scales (the caller zeroes the scale array's padding). */
    void (*nvfp4_quantize_rows)(const uint16_t *merged, float t, uint8_t *packed,
                                uint8_t *scales, ltx_idx padded_cols, ltx_idx cols, ltx_idx r0,
                                ltx_idx r1);

    /* ---- ComfyUI's nvfp4, mxfp8 and int8 (reference.fuse_comfy_*): dequantised into f32 and
     * merged in f32, n = f32(w + f32(delta)), never rounded to bf16; requantised to nearest.
     * Each layout has a pass that returns max |n| (NaN where an n is NaN), read before
     * anything is written, and a pass that requantises in place: a group's codes are read
     * before they are written, its old scale from `old_scales` (a copy), its new one to
     * `scales`, whose padding the caller zeroes. ---- */

    /* nvfp4 (stored as NVFP4 above), rows r0..r1: w = f32(e2m1 * f32(scale_2 * block scale)). */
    float (*comfy_nvfp4_max_rows)(const uint8_t *packed, const uint8_t *scales,
                                  ltx_idx padded_cols, float scale_2, const uint16_t *delta,
                                  ltx_idx cols, ltx_idx r0, ltx_idx r1);
    /* ... requantised with the new scale_2 t > 0: s = e4m3(min(f32(f32(max|group| / 6) / t),
     * 448)), code = e2m1(f32(n / f32(t * s))), +0 where t * s is 0. */
    void (*comfy_nvfp4_quantize_rows)(uint8_t *packed, const uint8_t *old_scales,
                                      uint8_t *scales, ltx_idx padded_cols, float scale_2,
                                      const uint16_t *delta, float t, ltx_idx cols, ltx_idx r0,
                                      ltx_idx r1);
    /* mxfp8 (e4m3 codes [rows, cols], an E8M0 exponent per 32 in the tiled layout), rows
     * r0..r1: w = f32(f32(code) * 2^(e - 127)), 0 for e = 0. */
    float (*comfy_mxfp8_max_rows)(const uint8_t *codes, const uint8_t *scales,
                                  ltx_idx padded_cols, const uint16_t *delta, ltx_idx cols,
                                  ltx_idx r0, ltx_idx r1);
    /* ... requantised: e = ceil(f32 log2(max(f32(max|group| / 448), 2^-127))) + 127 in 0..254,
     * code = e4m3(clamp(f32(n / 2^(e - 127)), +-448)); a group of maximum 0, or with e = 0, is
     * zero codes and e = 0. */
    void (*comfy_mxfp8_quantize_rows)(uint8_t *codes, const uint8_t *old_scales,
                                      uint8_t *scales, ltx_idx padded_cols,
                                      const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                      ltx_idx r1);
    /* int8 (codes [rows, cols], one f32 scale, or one per row where per_row), rows r0..r1:
     * w = f32(f32(code) * scale); row_top[r] = max over the row (row_top may be NULL). */
    float (*comfy_int8_max_rows)(const int8_t *codes, const float *scale, int per_row,
                                 const uint16_t *delta, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                                 float *row_top);
    /* ... requantised with the new scale(s): code = clamp(round_half_even(f32(n / new)), -128,
     * 127); scale may not be new_scale (the old one is read for each element). */
    void (*comfy_int8_quantize_rows)(int8_t *codes, const float *scale, const float *new_scale,
                                     int per_row, const uint16_t *delta, ltx_idx cols,
                                     ltx_idx r0, ltx_idx r1);

    /* ---- Quantising a bf16 weight (reference.quantize_*): the weight's own values, nothing
     * merged; blockwise fp8 and upstream's NVFP4 take the weight as block_quantize and
     * nvfp4_quantize_rows take a merged one, ComfyUI's nvfp4 and mxfp8 through their
     * quantize passes above with old_scales NULL (n = f32(delta), the weight, its zeros'
     * signs kept). ---- */

    /* The largest |w| over rows r0..r1 of finite bf16 w [., cols], as the bits of a bf16
     * magnitude (which order as the magnitudes do); each row's into row_top (may be NULL). */
    uint16_t (*bf16_absmax_rows)(const uint16_t *w, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                                 uint16_t *row_top);
    /* codes[i] = fp8(clamp(p, -fmax, fmax)), p = f32(w * mult), or bf16(w * mult) where
     * round_bf16 (a product in the weight's own dtype); fp8(w) where mult is infinite (an
     * all-zero weight). */
    void (*scaled_fp8_quantize)(const uint16_t *w, uint8_t *codes, ltx_idx count, float mult,
                                float fmax, int e5m2, int round_bf16);
    /* Rows r0..r1: code = clamp(rint(bf16(f32(w) / s)), -128, 127), a quotient in the
     * weight's own dtype, s = scale[0] or scale[r] where per_row (bf16 values as f32). */
    void (*int8_quantize_rows)(const uint16_t *w, int8_t *codes, const float *scale,
                               int per_row, ltx_idx cols, ltx_idx r0, ltx_idx r1);

    /* ---- DoRA (reference.fuse_dora) ---- */

    /* Rows r0..r1: delta = V = bf16(W + delta) in place, and row_sq[r] = sum_i V[r, i]^2 in
     * f64 in order (row_sq may be NULL). */
    void (*dora_merge_rows)(const uint16_t *w, uint16_t *delta, ltx_idx cols, ltx_idx r0,
                            ltx_idx r1, double *row_sq);
    /* out[r] = sum_i x[r, i]^2, f64, in order, for rows r0..r1 of bf16 x [., cols]. */
    void (*sum_squares_rows)(const uint16_t *x, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                             double *out);
    /* out[c] = sum_r x[r, c]^2, f64, rows in order, for columns c0..c1. */
    void (*sum_squares_cols)(const uint16_t *x, ltx_idx rows, ltx_idx cols, ltx_idx c0,
                             ltx_idx c1, double *out);
    /* out = bf16(f32(V) * f) with f per row (row_factor) or per column (col_factor); with
     * blend, out = bf16(W + f32(strength * f32(full - W))). out may be w. */
    void (*dora_store_rows)(const uint16_t *v, const float *row_factor, const float *col_factor,
                            const uint16_t *w, uint16_t *out, ltx_idx cols, ltx_idx r0,
                            ltx_idx r1, float strength, int blend);
};

#endif
