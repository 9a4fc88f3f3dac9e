# The seam: every matrix product ltx2blas computes -- sgemm, dgemm and the kernel table's
# product kernels -- goes through the functions declared here (see _gemm.pyx), and the drivers
# ask it which table serves them (kernels()) and what that table can do.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

from ._kernels cimport ltx_idx, ltx_kernels

cdef extern from "kernels.h" nogil:
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

cdef const ltx_kernels *kernels(bint allow_fma) noexcept nogil

cdef inline bint has_dot_products(const ltx_kernels *kern) noexcept nogil:
    """Whether the table multiplies bf16 pairs two terms per instruction (the dot-product fuse
    and Linear kernels; VDPBF16PS)."""
    return kern.dot_product_bf16 != NULL and kern.dot_stream_wxt != NULL

cdef void sgemm_rowmajor(int m, int n, int k, const float *x, int ldx, const float *y, int ldy,
                         float beta, float *c, int ldc) noexcept nogil

cdef void sgemm_wxt(int n, int m, int k, const float *w, int ldw, const float *x, int ldx,
                    float beta, float *c, int ldc) noexcept nogil

cdef void dgemm_wxt(int n, int m, int k, const double *w, int ldw, const double *x, int ldx,
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

cdef Py_ssize_t exact_product_fused(const ltx_kernels *kern, int m, int n, int k,
                                    const float *x, int ldx, const float *y, const uint16_t *w,
                                    Py_ssize_t ldw, uint16_t *out, Py_ssize_t ldo,
                                    Py_ssize_t *first_over) noexcept nogil

cdef Py_ssize_t exact_product_fused_pairs(const ltx_kernels *kern, int m, int n, int kp,
                                          const uint32_t *xp, int ldxp, const uint32_t *yp,
                                          const uint16_t *w, Py_ssize_t ldw, uint16_t *out,
                                          Py_ssize_t ldo, Py_ssize_t *first_over) noexcept nogil

cdef void exact_product_pairs(const ltx_kernels *kern, int m, int n, int kp, const uint32_t *xp,
                              int ldxp, const uint32_t *yp, float *c) noexcept nogil
