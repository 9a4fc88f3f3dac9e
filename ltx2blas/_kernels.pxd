# The kernel table (kernels.h) and the layouts' passes it carries (quant.h), as Cython sees
# them: one table per instruction set, chosen by dispatch.c, handed out by _gemm.kernels().
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "quant.h" nogil:
    ctypedef Py_ssize_t ltx_idx
    ctypedef struct ltx_layout_passes:
        float (*scaled_fp8_max)(const uint8_t *codes, const uint16_t *delta, ltx_idx count,
                                float scale, int e5m2) noexcept nogil
        void (*scaled_fp8_store)(uint8_t *codes, const uint16_t *delta, ltx_idx count,
                                 float scale, float mult, float fmax, int e5m2) noexcept nogil
        float (*block_merge_rows)(const uint8_t *codes, int fp6, const float *scales,
                                  uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                  ltx_idx r1) noexcept nogil
        void (*block_quantize)(const uint16_t *merged, ltx_idx cols, ltx_idx bi, ltx_idx bj0,
                               ltx_idx bj1, int fp6, uint8_t *codes,
                               float *scales) noexcept nogil
        float (*nvfp4_merge_rows)(const uint8_t *packed, const uint8_t *scales,
                                  ltx_idx padded_cols, float scale_2, uint16_t *delta,
                                  ltx_idx cols, ltx_idx r0, ltx_idx r1) noexcept nogil
        void (*nvfp4_quantize_rows)(const uint16_t *merged, float t, uint8_t *packed,
                                    uint8_t *scales, ltx_idx padded_cols, ltx_idx cols,
                                    ltx_idx r0, ltx_idx r1) noexcept nogil
        float (*comfy_nvfp4_max_rows)(const uint8_t *packed, const uint8_t *scales,
                                      ltx_idx padded_cols, float scale_2, const uint16_t *delta,
                                      ltx_idx cols, ltx_idx r0, ltx_idx r1) noexcept nogil
        void (*comfy_nvfp4_quantize_rows)(uint8_t *packed, const uint8_t *old_scales,
                                          uint8_t *scales, ltx_idx padded_cols, float scale_2,
                                          const uint16_t *delta, float t, ltx_idx cols,
                                          ltx_idx r0, ltx_idx r1) noexcept nogil
        float (*comfy_mxfp8_max_rows)(const uint8_t *codes, const uint8_t *scales,
                                      ltx_idx padded_cols, const uint16_t *delta, ltx_idx cols,
                                      ltx_idx r0, ltx_idx r1) noexcept nogil
        void (*comfy_mxfp8_quantize_rows)(uint8_t *codes, const uint8_t *old_scales,
                                          uint8_t *scales, ltx_idx padded_cols,
                                          const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                          ltx_idx r1) noexcept nogil
        float (*comfy_int8_max_rows)(const int8_t *codes, const float *scale, int per_row,
                                     const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                     ltx_idx r1, float *row_top) noexcept nogil
        void (*comfy_int8_quantize_rows)(int8_t *codes, const float *scale,
                                         const float *new_scale, int per_row,
                                         const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                         ltx_idx r1) noexcept nogil
        uint16_t (*bf16_absmax_rows)(const uint16_t *w, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                                     uint16_t *row_top) noexcept nogil
        void (*scaled_fp8_quantize)(const uint16_t *w, uint8_t *codes, ltx_idx count,
                                    float mult, float fmax, int e5m2,
                                    int round_bf16) noexcept nogil
        void (*int8_quantize_rows)(const uint16_t *w, int8_t *codes, const float *scale,
                                   int per_row, ltx_idx cols, ltx_idx r0,
                                   ltx_idx r1) noexcept nogil
        void (*dora_merge_rows)(const uint16_t *w, uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                ltx_idx r1, double *row_sq) noexcept nogil
        void (*sum_squares_rows)(const uint16_t *x, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                                 double *out) noexcept nogil
        void (*sum_squares_cols)(const uint16_t *x, ltx_idx rows, ltx_idx cols, ltx_idx c0,
                                 ltx_idx c1, double *out) noexcept nogil
        void (*dora_store_rows)(const uint16_t *v, const float *row_factor,
                                const float *col_factor, const uint16_t *w, uint16_t *out,
                                ltx_idx cols, ltx_idx r0, ltx_idx r1, float strength,
                                int blend) noexcept nogil

cdef extern from "kernels.h" nogil:
    # The fp8 rounding store's formats: e4m3 saturating or NaN past 448, e5m2.
    ctypedef enum ltx_fp8_kind:
        LTX_FP8_E4M3
        LTX_FP8_E5M2
        LTX_FP8_E4M3_NAN

    ctypedef struct ltx_kernels:
        const char *name
        void (*seq_gemm)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                         const float *y, ltx_idx ldy, float *c, ltx_idx ldc) noexcept nogil
        void (*widen_bf16)(const uint16_t *src, float *dst, ltx_idx n) noexcept nogil
        void (*scale_round_widen)(const uint16_t *src, float s, float *dst, ltx_idx n) noexcept nogil
        ltx_idx (*store_fused)(const float *acc, const uint16_t *w, ltx_idx ldw,
                               uint16_t *out, ltx_idx ldo, ltx_idx rows, ltx_idx cols,
                               ltx_idx *first_over) noexcept nogil
        void (*accumulate_rounded)(const float *acc, float *total, ltx_idx n) noexcept nogil
        ltx_idx (*first_nonfinite_bf16)(const uint16_t *src, ltx_idx n) noexcept nogil
        ltx_idx (*scan_bf16)(const uint16_t *src, ltx_idx n, uint16_t *max_mag,
                             uint16_t *min_mag) noexcept nogil
        void (*widen_bf16_f64)(const uint16_t *src, double *dst, ltx_idx n) noexcept nogil
        void (*f32_to_f64)(const float *src, double *dst, ltx_idx n) noexcept nogil
        void (*widen_bf16_rows)(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx ldd,
                                ltx_idx rows, ltx_idx cols) noexcept nogil
        void (*stream_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                           const uint16_t *w, ltx_idx ldw, float *acc,
                           float *lanes) noexcept nogil
        void (*panel_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                          const uint16_t *w, ltx_idx ldw, float *acc,
                          float *scratch) noexcept nogil
        void (*dot_stream_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint16_t *x,
                               ltx_idx ldx, const uint16_t *w, ltx_idx ldw, float *acc,
                               float *lanes) noexcept nogil
        void (*dot_panel_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint32_t *xs,
                              ltx_idx lds, const uint16_t *w, ltx_idx ldw, float *acc,
                              float *scratch) noexcept nogil
        void (*pack_x_pairs)(const uint16_t *x, ltx_idx ldx, ltx_idx mt, ltx_idx kt,
                             uint32_t *xs, ltx_idx lds) noexcept nogil
        int dot_lanes, dot_pair_units
        int panel_min_rows
        ltx_idx (*store_fused_fp8)(const float *acc, const uint8_t *w, ltx_idx ldw,
                                   uint8_t *out, ltx_idx ldo, ltx_idx rows, ltx_idx cols,
                                   int kind, int stochastic, uint64_t key, ltx_idx index0,
                                   ltx_idx stride, ltx_idx *first_over) noexcept nogil
        ltx_idx (*seq_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x,
                                 ltx_idx ldx, const float *y, ltx_idx ldy, const uint16_t *w,
                                 ltx_idx ldw, uint16_t *out, ltx_idx ldo,
                                 ltx_idx *first_over) noexcept nogil
        void (*pack_fuse_panel)(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx k,
                                ltx_idx n) noexcept nogil
        void (*seq_product_panel)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                                  const float *y, float *c, ltx_idx ldc) noexcept nogil
        ltx_idx (*dot_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                                 ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp,
                                 const uint16_t *w, ltx_idx ldw, uint16_t *out, ltx_idx ldo,
                                 ltx_idx *first_over) noexcept nogil
        void (*dot_product_bf16)(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                                 ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, float *c,
                                 ltx_idx ldc) noexcept nogil
        void (*pack_pairs_rows)(const uint16_t *src, ltx_idx lds, uint32_t *dst, ltx_idx rows,
                                ltx_idx cols) noexcept nogil
        void (*pack_pairs_cols)(const float *src, ltx_idx lds, uint32_t *dst, ltx_idx ldd,
                                ltx_idx rows, ltx_idx cols) noexcept nogil
        void (*clear_negative_zero_bf16)(uint16_t *p, ltx_idx ldp, ltx_idx rows,
                                         ltx_idx cols) noexcept nogil
        void (*round_bf16_f32)(const float *src, float *dst, ltx_idx n) noexcept nogil
        void (*normalize_features)(const void *src, int src_bf16, ltx_idx n, const float *a,
                                   const float *b, ltx_idx l0, ltx_idx layers, float scale,
                                   void *dst, int dst_bf16) noexcept nogil
        void (*layer_stats)(const void *src, int src_bf16, ltx_idx depth, ltx_idx layers,
                            double *sums, double *squares, float *lows,
                            float *highs) noexcept nogil
        void (*accumulate_addmm)(const float *acc, float *agg, float s, ltx_idx n) noexcept nogil
        void (*store_rounded)(const float *acc, uint16_t *out, ltx_idx ldo, ltx_idx rows,
                              ltx_idx cols) noexcept nogil
        void (*multiply_f32)(const float *x, const float *y, float *dst, ltx_idx n) noexcept nogil
        void (*scale_f32)(const float *x, float s, float *dst, ltx_idx n) noexcept nogil
        const ltx_layout_passes *layout
