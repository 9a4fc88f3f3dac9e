# The seam: every matrix product ltx2blas computes -- sgemm, dgemm and the kernel table's
# product kernels -- goes through the functions declared here (see _gemm.pyx).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "kernels.h" nogil:
    ctypedef Py_ssize_t ltx_idx
    int LTX_STREAM_LANES
    int LTX_STREAM_BLOCK
    int LTX_PANEL_CHUNK
    int LTX_DOT_BLOCK
    int LTX_DOT_PANEL_CHUNK
    int LTX_DOT_PANEL_STRIP
    size_t LTX_DOT_PANEL_PAIRS(size_t kt)
    size_t LTX_DOT_PANEL_PACKED(size_t mt, size_t kt)
    size_t LTX_DOT_PANEL_SCRATCH(size_t mt)
    size_t LTX_PANEL_SCRATCH(size_t mt)
    int LTX_LAYER_TABLE_PAD
    ctypedef struct ltx_kernels:
        const char *name
        void (*seq_gemm)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                         const float *y, ltx_idx ldy, float *c, ltx_idx ldc) noexcept nogil
        void (*widen_bf16)(const uint16_t *src, float *dst, ltx_idx n) noexcept nogil
        void (*scale_round_widen)(const uint16_t *src, float s, float *dst, ltx_idx n) noexcept nogil
        void (*store_fused)(const float *acc, const uint16_t *w, ltx_idx ldw, uint16_t *out,
                            ltx_idx ldo, ltx_idx rows, ltx_idx cols) noexcept nogil
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
        int panel_min_rows
        ltx_idx (*store_fused_fp8)(const float *acc, const uint8_t *w, ltx_idx ldw,
                                   uint8_t *out, ltx_idx ldo, ltx_idx rows, ltx_idx cols,
                                   int e5m2, int stochastic, uint64_t key, ltx_idx index0,
                                   ltx_idx stride) noexcept nogil
        void (*seq_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                              const float *y, ltx_idx ldy, const uint16_t *w, ltx_idx ldw,
                              uint16_t *out, ltx_idx ldo) noexcept nogil
        void (*pack_fuse_panel)(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx k,
                                ltx_idx n) noexcept nogil
        void (*seq_product_panel)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                                  const float *y, float *c, ltx_idx ldc) noexcept nogil
        void (*dot_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                              ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, const uint16_t *w,
                              ltx_idx ldw, uint16_t *out, ltx_idx ldo) noexcept nogil
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
        void (*accumulate_addmm)(const float *acc, float *agg, float s, ltx_idx n) noexcept nogil
        void (*store_rounded)(const float *acc, uint16_t *out, ltx_idx ldo, ltx_idx rows,
                              ltx_idx cols) noexcept nogil

cdef const ltx_kernels *kernels(bint allow_fma) noexcept nogil

cdef void sgemm_rowmajor(int m, int n, int k, const float *x, int ldx, const float *y, int ldy,
                         float beta, float *c, int ldc) noexcept nogil

cdef void sgemm_wxt(int m, int n, int k, const float *x, int ldx, const float *w, int ldw,
                    float beta, float *c, int ldc) noexcept nogil

cdef void dgemm_wxt(int m, int n, int k, const double *x, int ldx, const double *w, int ldw,
                    double beta, double *c, int ldc) noexcept nogil

cdef void exact_product(const ltx_kernels *kern, int m, int n, int k, const float *x, int ldx,
                        const float *y, float *c, int blas_depth) noexcept nogil

cdef void exact_product_panel(const ltx_kernels *kern, int m, int n, int k, const float *x,
                              int ldx, const float *y, float *c) noexcept nogil

cdef void continue_product(const ltx_kernels *kern, int m, int n, int k, const float *x,
                           Py_ssize_t ldx, const float *y, Py_ssize_t ldy, float *c,
                           Py_ssize_t ldc) noexcept nogil

# How a Linear's chunk is multiplied (chunk_wxt): sgemm on a widened weight panel, or straight
# from the bf16 weight rows by the streaming or the panel kernel, or, on bf16 x, by the
# dot-product kernels (streaming, or on x packed into pairs).
cdef enum:
    PRODUCT_SGEMM = 0
    PRODUCT_STREAM = 1
    PRODUCT_PANEL = 2
    PRODUCT_DOT = 3
    PRODUCT_DOT_PANEL = 4

cdef inline bint takes_bf16_x(int product) noexcept nogil:
    """Whether chunk_wxt's product reads x as bf16 bits (the dot-product kernels)."""
    return product == PRODUCT_DOT or product == PRODUCT_DOT_PANEL

cdef inline bint packs_strips(int product, int task_rows) noexcept nogil:
    """Whether tasks of task_rows rows can take x packed for the dot-product panel kernel
    before them (packed_chunk_wxt), rather than chunk_wxt packing each task's rows a chunk at
    a time: where every task's first row starts a strip."""
    return product == PRODUCT_DOT_PANEL and task_rows % LTX_DOT_PANEL_STRIP == 0

cdef inline Py_ssize_t strip_stride(Py_ssize_t kt) noexcept nogil:
    """Elements between the strips of an x of kt elements packed by pack_x_pairs."""
    return LTX_DOT_PANEL_PAIRS(kt) * LTX_DOT_PANEL_STRIP

cdef inline uint32_t *strip_at(uint32_t *xs, Py_ssize_t lds, Py_ssize_t row,
                               Py_ssize_t col) noexcept nogil:
    """Where element col (even) of row row (a strip's first) lies in an x packed by
    pack_x_pairs with strips lds apart."""
    return xs + (row // LTX_DOT_PANEL_STRIP) * lds + (col // 2) * LTX_DOT_PANEL_STRIP

cdef void chunk_wxt(const ltx_kernels *kern, int product, int mt, int ot, int kt,
                    const void *x, int ldx, const uint16_t *w16, const float *w32, int ldw,
                    float *panel, float *acc) noexcept nogil

cdef size_t chunk_panel_bytes(int product, int mt, int ot, int kt) noexcept nogil

cdef void packed_chunk_wxt(const ltx_kernels *kern, int mt, int ot, int kt, const uint32_t *xs,
                           Py_ssize_t lds, const uint16_t *w16, int ldw, float *scratch,
                           float *acc) noexcept nogil

cdef void pack_x_pairs(const ltx_kernels *kern, Py_ssize_t mt, Py_ssize_t kt,
                       const uint16_t *x, Py_ssize_t ldx, uint32_t *xs,
                       Py_ssize_t lds) noexcept nogil

cdef void exact_product_fused(const ltx_kernels *kern, int m, int n, int k, const float *x,
                              int ldx, const float *y, const uint16_t *w, Py_ssize_t ldw,
                              uint16_t *out, Py_ssize_t ldo) noexcept nogil

cdef void exact_product_fused_pairs(const ltx_kernels *kern, int m, int n, int kp,
                                    const uint32_t *xp, int ldxp, const uint32_t *yp,
                                    const uint16_t *w, Py_ssize_t ldw, uint16_t *out,
                                    Py_ssize_t ldo) noexcept nogil

cdef void exact_product_pairs(const ltx_kernels *kern, int m, int n, int kp, const uint32_t *xp,
                              int ldxp, const uint32_t *yp, float *c) noexcept nogil
