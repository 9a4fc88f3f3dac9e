"""The GEMM seam: every matrix product in ltx2blas is computed here, by sgemm or dgemm
(scipy.linalg.cython_blas) or by one of the kernel table's product kernels.  The drivers
(_fuse, _linear, _features, _probe) reach them through the functions _gemm.pxd declares.

The fuse's contract: ``c[i, j] = sum_p x[i, p] * y[p, j]`` accumulated in f32 from +0.0 in the
order p = 0, 1, 2, ... (the textbook loop, docs/arithmetic.md §1).

* sgemm reproduces that order only up to a depth the probe (:mod:`ltx2blas._probe`) has
  verified for the exact call shape.
* The terms beyond that depth are added by the sequential kernel (``continue_product``), which
  continues the accumulation element by element, in order, from what sgemm left in ``c``.

The Linear's products (``sgemm_wxt``, ``dgemm_wxt``, ``chunk_wxt``'s kernels) have no order
contract; their order is fixed by the blocks the driver cuts, so results repeat exactly.
"""
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer
from cython.parallel cimport prange
from libc.stdint cimport uint16_t, uint32_t
from libc.string cimport memset

from ._parallel cimport LTX_HAVE_OPENMP, omp_get_max_threads, up64

import os
import time

import numpy as np

cdef extern from "kernels.h" nogil:
    const ltx_kernels *ltx_fast_kernels()
    const ltx_kernels *ltx_strict_kernels()
    const ltx_kernels *ltx_kernels_by_name(const char *name)
    const char *ltx_kernels_built()

ctypedef void (*sgemm_fn)(char *, char *, int *, int *, int *, float *, const float *, int *,
                          const float *, int *, float *, float *, int *) noexcept nogil
ctypedef void (*dgemm_fn)(char *, char *, int *, int *, int *, double *, const double *, int *,
                          const double *, int *, double *, double *, int *) noexcept nogil

ctypedef void (*dsyrk_fn)(char *, char *, int *, int *, double *, const double *, int *,
                          double *, double *, int *) noexcept nogil
ctypedef void (*dtrsm_fn)(char *, char *, char *, char *, int *, int *, double *,
                          const double *, int *, double *, int *) noexcept nogil

cdef sgemm_fn _sgemm = NULL
cdef dgemm_fn _dgemm = NULL
cdef dsyrk_fn _dsyrk = NULL
cdef dtrsm_fn _dtrsm = NULL
cdef const ltx_kernels *_fast = ltx_fast_kernels()
cdef const ltx_kernels *_strict = ltx_strict_kernels()


cdef void *_capsule_pointer(object capsule, str name) except NULL:
    """The function pointer in one of cython_blas's capsules, refusing an integer ABI we do not
    call correctly (the capsule's name is the C signature, and names the integer type)."""
    cdef const char *signature = PyCapsule_GetName(capsule)
    # the first argument that is not a character (a flag) is a size
    int_type = next(a.strip() for a in signature.decode().split("(", 1)[1].split(",")
                    if a.strip() != "char *")
    if int_type != "int *":
        raise ImportError(
            f"scipy.linalg.cython_blas.{name} takes {int_type!r} sizes; ltx2blas calls "
            "BLAS with 32-bit int sizes (LP64) and cannot use this SciPy build"
        )
    return PyCapsule_GetPointer(capsule, signature)


def _bind_blas():
    """Take sgemm, dgemm, dsyrk and dtrsm from scipy.linalg.cython_blas."""
    global _sgemm, _dgemm, _dsyrk, _dtrsm
    from scipy.linalg import cython_blas

    _sgemm = <sgemm_fn>_capsule_pointer(cython_blas.__pyx_capi__["sgemm"], "sgemm")
    _dgemm = <dgemm_fn>_capsule_pointer(cython_blas.__pyx_capi__["dgemm"], "dgemm")
    _dsyrk = <dsyrk_fn>_capsule_pointer(cython_blas.__pyx_capi__["dsyrk"], "dsyrk")
    _dtrsm = <dtrsm_fn>_capsule_pointer(cython_blas.__pyx_capi__["dtrsm"], "dtrsm")


_bind_blas()


cdef const ltx_kernels *kernels(bint allow_fma) noexcept nogil:
    return _fast if allow_fma else _strict


cdef void sgemm_rowmajor(int m, int n, int k, const float *x, int ldx, const float *y, int ldy,
                         float beta, float *c, int ldc) noexcept nogil:
    """c[m, n] = x[m, k] @ y[k, n] + beta * c, all row-major.

    Row-major C = X Y is column-major C^T = Y^T X^T, so the operands swap and nothing is
    transposed or copied."""
    cdef float alpha = 1.0
    _sgemm(b"N", b"N", &n, &m, &k, &alpha, y, &ldy, x, &ldx, &beta, c, &ldc)


cdef void sgemm_wxt(int n, int m, int k, const float *w, int ldw, const float *x, int ldx,
                    float beta, float *c, int ldc) noexcept nogil:
    """c[n, m] = w[n, k] @ x[m, k]^T + beta * c, row-major: a Linear's output, transposed (the
    operands and their sizes in the order the name gives them).

    Column-major that is c^T = x w^T, with x entering transposed and w not: the BLAS then packs
    the weight panel with its plain copy, cheaper than its transposing one, which matters when
    x has few rows and the packing is most of the work."""
    cdef float alpha = 1.0
    _sgemm(b"T", b"N", &m, &n, &k, &alpha, x, &ldx, w, &ldw, &beta, c, &ldc)


cdef void dgemm_wxt(int n, int m, int k, const double *w, int ldw, const double *x, int ldx,
                    double beta, double *c, int ldc) noexcept nogil:
    """f64 twin of sgemm_wxt."""
    cdef double alpha = 1.0
    _dgemm(b"T", b"N", &m, &n, &k, &alpha, x, &ldx, w, &ldw, &beta, c, &ldc)


cdef void exact_product(const ltx_kernels *kern, int m, int n, int k, const float *x, int ldx,
                        const float *y, float *c, int blas_depth) noexcept nogil:
    """c[m, n] = textbook sum over p < k of x[i, p] * y[p, j], from +0.0, in order.

    Layout: x is [m, >=k] with row stride ldx; y is [k, n] and c is [m, n], both packed
    (row stride n) -- the layout the probe checks.  ``blas_depth`` must come from
    ``_probe.blas_depth(m, n, k, ldx)`` (0 means no sgemm)."""
    cdef int d = blas_depth if blas_depth < k else k
    cdef Py_ssize_t i
    if m <= 0 or n <= 0:
        return
    if d > 0:
        sgemm_rowmajor(m, n, d, x, ldx, y, n, 0.0, c, n)
    else:
        memset(c, 0, <size_t>m * n * sizeof(float))
    if d < k:
        kern.seq_gemm(m, n, k - d, x + d, ldx, y + <Py_ssize_t>d * n, n, c, n)


cdef void exact_product_panel(const ltx_kernels *kern, int m, int n, int k, const float *x,
                              int ldx, const float *y, float *c) noexcept nogil:
    """As :func:`exact_product` with no sgemm, y the table's fuse panel
    (``kern.pack_fuse_panel``) instead of a row-major one: the one-pass fuse's register blocks,
    storing the product where it is rounded and added later (several adapters, fp8 weights)."""
    if m > 0 and n > 0:
        kern.seq_product_panel(m, n, k, x, ldx, y, c, n)


cdef void continue_product(const ltx_kernels *kern, int m, int n, int k, const float *x,
                           Py_ssize_t ldx, const float *y, Py_ssize_t ldy, float *c,
                           Py_ssize_t ldc) noexcept nogil:
    """c[m, n] += sum over p < k of x[i, p] * y[p, j], element by element in the order
    p = 0, 1, ..., continuing whatever c holds (row strides ldx, ldy, ldc)."""
    if m > 0 and n > 0 and k > 0:
        kern.seq_gemm(m, n, k, x, ldx, y, ldy, c, ldc)


cdef void chunk_wxt(const ltx_kernels *kern, int product, int mt, int ot, int kt,
                    const void *x, int ldx, const uint16_t *w16, const float *w32, int ldw,
                    float *panel, float *acc) noexcept nogil:
    """acc[ot, mt] += w[ot, kt] @ x[mt, kt]^T: one chunk of a Linear's task, the weight bf16
    (w16) or f32 (w32), rows of stride ldw; x f32, or bf16 bits where takes_bf16_x(product).
    PRODUCT_SGEMM: a bf16 weight is widened into ``panel`` (ot x kt floats) and multiplied by
    sgemm.  PRODUCT_STREAM / PRODUCT_PANEL / PRODUCT_DOT / PRODUCT_DOT_PANEL: a bf16 weight is
    read straight from its rows by the streaming, the panel or a dot-product kernel (``panel``
    then holds the kernel's scratch; the dot-product kernels must exist in the table).  The
    Linear and the feature extractor both add their chunks here, so their results are the
    same bytes."""
    cdef Py_ssize_t lds
    if mt <= 0 or ot <= 0 or kt <= 0:
        return
    if product == PRODUCT_STREAM:
        kern.stream_wxt(mt, ot, kt, <const float *>x, ldx, w16, ldw, acc, panel)
    elif product == PRODUCT_PANEL:
        kern.panel_wxt(mt, ot, kt, <const float *>x, ldx, w16, ldw, acc, panel)
    elif product == PRODUCT_DOT:
        kern.dot_stream_wxt(mt, ot, kt, <const uint16_t *>x, ldx, w16, ldw, acc, panel)
    elif product == PRODUCT_DOT_PANEL:  # x packed here, for this chunk
        lds = strip_stride(kt)
        kern.pack_x_pairs(<const uint16_t *>x, ldx, mt, kt, <uint32_t *>panel, lds)
        kern.dot_panel_wxt(mt, ot, kt, <const uint32_t *>panel, lds, w16, ldw, acc,
                           panel + LTX_DOT_PANEL_PACKED(mt, kt))
    elif w16 != NULL:
        kern.widen_bf16_rows(w16, ldw, panel, kt, ot, kt)
        sgemm_wxt(ot, mt, kt, panel, kt, <const float *>x, ldx, 1.0, acc, mt)
    else:
        sgemm_wxt(ot, mt, kt, w32, ldw, <const float *>x, ldx, 1.0, acc, mt)


cdef size_t chunk_panel_bytes(int product, int mt, int ot, int kt) noexcept nogil:
    """Bytes of the ``panel`` scratch :func:`chunk_wxt` needs for a bf16 weight: the widened
    weight panel [ot, kt], the streaming or dot-product kernel's lane sums, or the panel
    kernel's scratch."""
    if product == PRODUCT_STREAM or product == PRODUCT_DOT:
        return <size_t>ot * mt * LTX_STREAM_LANES * sizeof(float)
    if product == PRODUCT_PANEL:
        return up64(LTX_PANEL_SCRATCH(mt) * sizeof(float))
    if product == PRODUCT_DOT_PANEL:
        return up64((LTX_DOT_PANEL_PACKED(mt, kt) + LTX_DOT_PANEL_SCRATCH(mt)) * sizeof(float))
    return up64(<size_t>ot * kt * sizeof(float))


cdef void packed_chunk_wxt(const ltx_kernels *kern, int mt, int ot, int kt, const uint32_t *xs,
                           Py_ssize_t lds, const uint16_t *w16, int ldw, float *scratch,
                           float *acc) noexcept nogil:
    """chunk_wxt's PRODUCT_DOT_PANEL on an x packed before (pack_x_pairs: xs at the chunk's
    first pair of its first strip, strips lds apart), the same bytes; scratch:
    LTX_DOT_PANEL_SCRATCH(mt) floats."""
    if mt > 0 and ot > 0 and kt > 0:
        kern.dot_panel_wxt(mt, ot, kt, xs, lds, w16, ldw, acc, scratch)


cdef void pack_x_pairs(const ltx_kernels *kern, Py_ssize_t mt, Py_ssize_t kt,
                       const uint16_t *x, Py_ssize_t ldx, uint32_t *xs,
                       Py_ssize_t lds) noexcept nogil:
    """xs = mt rows of the bf16 x (kt elements each, row stride ldx) packed for
    packed_chunk_wxt: strips of LTX_DOT_PANEL_STRIP rows lds apart."""
    if mt > 0 and kt > 0:
        kern.pack_x_pairs(x, ldx, mt, kt, xs, lds)


cdef Py_ssize_t exact_product_fused(const ltx_kernels *kern, int m, int n, int k,
                                    const float *x, int ldx, const float *y, const uint16_t *w,
                                    Py_ssize_t ldw, uint16_t *out, Py_ssize_t ldo,
                                    Py_ssize_t *first_over) noexcept nogil:
    """out[m, n] = bf16(w + bf16(textbook x @ y)), w and out bf16 with row strides ldw and ldo
    (out may be w), x row-major with row stride ldx and y the table's fuse panel
    (``kern.pack_fuse_panel``): the fuse of one adapter, product and rounding in one pass, for a
    product that sgemm is not used for. Returns how many results overflowed to +-inf from a
    finite weight element, the least offset among them (r * ldw + i) in *first_over, or -1."""
    first_over[0] = -1
    if m > 0 and n > 0:
        return kern.seq_fuse_bf16(m, n, k, x, ldx, y, n, w, ldw, out, ldo, first_over)
    return 0


cdef Py_ssize_t exact_product_fused_pairs(const ltx_kernels *kern, int m, int n, int kp,
                                          const uint32_t *xp, int ldxp, const uint32_t *yp,
                                          const uint16_t *w, Py_ssize_t ldw, uint16_t *out,
                                          Py_ssize_t ldo, Py_ssize_t *first_over) noexcept nogil:
    """As :func:`exact_product_fused`, from bf16 operands packed in pairs of terms (xp [m, kp]
    with row stride ldxp, yp [kp, n] packed), by the table's dot-product kernel, which must
    exist. The caller has ruled out inf, NaN and subnormal inputs, products and partial sums
    (see ``fuse._pairs_exact``)."""
    first_over[0] = -1
    if m > 0 and n > 0:
        return kern.dot_fuse_bf16(m, n, kp, xp, ldxp, yp, n, w, ldw, out, ldo, first_over)
    return 0


cdef void exact_product_pairs(const ltx_kernels *kern, int m, int n, int kp, const uint32_t *xp,
                              int ldxp, const uint32_t *yp, float *c) noexcept nogil:
    """c[m, n] (packed) = the product alone of :func:`exact_product_fused_pairs`, under the
    same conditions: each sum from +0.0 in the textbook order, two terms per instruction."""
    if m > 0 and n > 0:
        kern.dot_product_bf16(m, n, kp, xp, ldxp, yp, n, c, n)


# --------------------------------------------------------------------------------------------
# The kernel tables, and products for the Python layers
# --------------------------------------------------------------------------------------------

#: The streaming kernel's lane-block length in elements of k (kernels.h).
STREAM_BLOCK = LTX_STREAM_BLOCK
#: The panel kernel's chunk, in elements of k: each chunk's sums start from +0.0.
PANEL_CHUNK = LTX_PANEL_CHUNK
#: The dot-product Linear's lane-block length in elements of k (kernels.h).
DOT_BLOCK = LTX_DOT_BLOCK
#: The dot-product panel Linear's chunk, in elements of k: each chunk's sums start from +0.0.
DOT_PANEL_CHUNK = LTX_DOT_PANEL_CHUNK
#: chunk_wxt's products by the Linear's route name (the f64 route's dgemm panels take the
#: sgemm route's place).
PRODUCTS = {"sgemm": PRODUCT_SGEMM, "f64": PRODUCT_SGEMM, "stream": PRODUCT_STREAM,
            "panel": PRODUCT_PANEL, "dot": PRODUCT_DOT, "dot_panel": PRODUCT_DOT_PANEL}


def panel_min_rows():
    """The fewest rows of x for which the kernel table in use takes the panel kernel for a
    Linear (0: this table keeps the streaming kernel)."""
    return _fast.panel_min_rows


def kernel_name(bint allow_fma=True):
    """Name of the kernel table used: 'avx512bf16', 'avx512', 'avx2', 'neon_bf16', 'neon' or
    'base'."""
    return kernels(allow_fma).name.decode()


def kernels_built():
    return ltx_kernels_built().decode().split(",")


def use_kernels(name=None):
    """Use the named kernel table for every later call (a diagnostic: the results are the same
    bytes on every table this CPU runs).  None restores the automatic choice.  Raises
    ValueError for a table this build or CPU lacks.  The environment variable
    ``LTX2BLAS_KERNELS`` does the same when the module loads."""
    global _fast
    if name is None:
        _fast = ltx_fast_kernels()
        return kernel_name()
    cdef const ltx_kernels *table = ltx_kernels_by_name(name.encode())
    if table == NULL:
        raise ValueError(f"kernel table {name!r} is not available here: it was not built "
                         f"(built: {', '.join(kernels_built())}) or this CPU lacks its "
                         f"instructions")
    _fast = table
    return kernel_name()


if os.environ.get("LTX2BLAS_KERNELS"):
    use_kernels(os.environ["LTX2BLAS_KERNELS"])


def omp_max_threads():
    return omp_get_max_threads()


def have_openmp():
    return bool(LTX_HAVE_OPENMP)


def has_pairs_kernel():
    """Whether the kernel table in use has the bf16 dot-product fuse."""
    return has_dot_products(_fast)


def has_dot_linear():
    """Whether the kernel table in use has the dot-product Linear (bf16 x and weight)."""
    return has_dot_products(_fast)


def dot_rule():
    """(lanes, units) of the dot-product Linear of the table in use, which its error bound
    counts: the streaming kernel's lane sums, and the unit roundoffs one pair's step can add to
    a term's error (2: two roundings to nearest, x86; 4: two to odd, Arm).  (0, 0) where the
    table has none."""
    if not has_dot_products(_fast):
        return 0, 0
    return _fast.dot_lanes, _fast.dot_pair_units


#: The in-cache fuse fuse_rates times: a tile of RATE_ROWS x RATE_COLS, depth RATE_DEPTH (x
#: 32 KiB, the f32 panel 128 KiB, the pairs half that, the weight 32 KiB: L2 on any CPU).
RATE_ROWS, RATE_COLS, RATE_DEPTH = 64, 256, 128
#: fuse_rates' interleaved rounds, and the calls of each kernel a round times.
RATE_ROUNDS, RATE_CALLS = 7, 4
_fuse_rates = {}


def fuse_rates():
    """(dot, fma): GFLOP/s of the table in use's two one-adapter fuse kernels on an in-cache
    tile -- the dot-product kernel (dot_fuse_bf16, bf16 pairs) and the f32 FMA kernel
    (seq_fuse_bf16, the fuse panel) -- the best of RATE_ROUNDS interleaved rounds, measured
    once per process and table (a few milliseconds).  dot is 0.0 where the table has no
    dot-product kernel.  Both give the textbook bytes where the fuse takes them; only the
    rate differs, by CPU: VDPBF16PS runs at twice the FMA rate on AMD Zen 4 and 5 and at half
    of it on Intel Xeon."""
    cdef const ltx_kernels *kern = _fast
    name = kern.name.decode()
    if name in _fuse_rates:
        return _fuse_rates[name]
    cdef int m = RATE_ROWS, n = RATE_COLS, k = RATE_DEPTH, kp = RATE_DEPTH // 2, i
    rng = np.random.default_rng(0)
    # bf16 values of ordinary magnitude: no subnormal or overflowing product or sum
    x16 = (rng.integers(0x3E00, 0x3F80, (m, k)) | (rng.integers(0, 2, (m, k)) << 15)).astype(np.uint16)
    y16 = (rng.integers(0x3E00, 0x3F80, (k, n)) | (rng.integers(0, 2, (k, n)) << 15)).astype(np.uint16)
    cdef float[:, ::1] x = (x16.astype(np.uint32) << 16).view(np.float32)
    cdef uint16_t[:, ::1] y = y16
    cdef float[::1] panel = np.empty(k * n, np.float32)
    cdef uint32_t[:, ::1] xp = np.empty((m, kp), np.uint32)
    cdef uint32_t[:, ::1] yp = np.empty((kp, n), np.uint32)
    cdef uint16_t[:, ::1] w = np.zeros((m, n), np.uint16)
    cdef uint16_t[:, ::1] out = np.empty((m, n), np.uint16)
    kern.pack_fuse_panel(&y[0, 0], n, &panel[0], k, n)
    has_dot = kern.dot_fuse_bf16 != NULL
    if has_dot:
        kern.pack_pairs_rows(&y[0, 0], n, &yp[0, 0], k, n)
        kern.pack_pairs_cols(&x[0, 0], k, &xp[0, 0], kp, m, k)
    best = [float("inf"), float("inf")]
    cdef int which, calls = RATE_CALLS
    cdef Py_ssize_t first
    for _ in range(RATE_ROUNDS):
        for which in range(0 if has_dot else 1, 2):
            t0 = time.perf_counter()
            with nogil:
                for i in range(calls):
                    if which == 0:
                        kern.dot_fuse_bf16(m, n, kp, &xp[0, 0], kp, &yp[0, 0], n, &w[0, 0], n,
                                           &out[0, 0], n, &first)
                    else:
                        kern.seq_fuse_bf16(m, n, k, &x[0, 0], k, &panel[0], n, &w[0, 0], n,
                                           &out[0, 0], n, &first)
            best[which] = min(best[which], time.perf_counter() - t0)
    flops = 2.0 * m * n * k * RATE_CALLS / 1e9
    rates = (flops / best[0] if has_dot else 0.0, flops / best[1])
    _fuse_rates[name] = rates
    return rates


def scan_bf16(const uint16_t[::1] bits):
    """(largest finite magnitude bits, smallest non-zero magnitude bits, first inf/NaN index or
    -1) of a flat bf16 array, in one pass without the GIL."""
    cdef uint16_t hi = 0, lo = 0
    cdef Py_ssize_t first = -1
    if bits.shape[0]:
        with nogil:
            first = _fast.scan_bf16(&bits[0], bits.shape[0], &hi, &lo)
    return hi, lo, first


def dgemm_xwt(const double[:, ::1] x, const double[:, ::1] w):
    """x @ w^T in f64 by one dgemm call ([m, k] by [n, k] to [m, n]; the operands in the order
    the name gives them); the caller holds the BLAS to one thread.  For the Linear's error
    bound, whose magnitudes need no particular order."""
    cdef int m = <int>x.shape[0], k = <int>x.shape[1], n = <int>w.shape[0]
    if w.shape[1] != k:
        raise ValueError("shape mismatch")
    out = np.empty((m, n), np.float64)
    cdef double[:, ::1] c = out
    # dgemm_wxt(N, M, K, w', ., x', .) writes c[N, M] = w' x'^T; with w' = x and x' = w, N = m
    # and M = n, that is x w^T.
    if m and n and k:
        with nogil:
            dgemm_wxt(m, n, k, &x[0, 0], k, &w[0, 0], k, 0.0, &c[0, 0], n)
    return out


# ---- f64 products of the low-rank factorisations (ltx2blas.extract) ----
# Level-3 BLAS calls on Fortran-ordered f64 arrays, cut into blocks of rows fixed by the shape
# alone, one call a block with the BLAS on one thread (the caller holds it there), the blocks
# shared among the threads: the same bytes for any thread count, as the f32 products'.

cdef enum:
    # Rows of a block: enough for each call to run near the BLAS's rate at widths of tens of
    # columns, few enough to share a 4096-row factor among several threads.
    F64_BLOCK = 512


cdef inline int _blocks(Py_ssize_t rows) noexcept nogil:
    return <int>((rows + F64_BLOCK - 1) // F64_BLOCK)


def gram_f64(const double[::1, :] a, int threads=1):
    """a^T a for a [m, w] f64 array in Fortran order: [w, w] in Fortran order, its upper
    triangle set (what dpotrf and eigh(lower=False) read), the lower one zero.  One dsyrk call
    per block of F64_BLOCK rows, into a Gram matrix of its own; those added in block order."""
    cdef int m = <int>a.shape[0], w = <int>a.shape[1], blocks = _blocks(a.shape[0]), b, r0, rb
    cdef int i, j
    cdef double one = 1.0, zero = 0.0
    parts_array = np.zeros((max(blocks, 1), w, w), np.float64)
    cdef double[:, :, ::1] parts = parts_array
    if m and w:
        for b in prange(blocks, nogil=True, num_threads=max(threads, 1), schedule="dynamic"):
            r0 = b * F64_BLOCK
            rb = min(F64_BLOCK, m - r0)
            # each part's [w, w] buffer, C-ordered, is read by the BLAS as its transpose: the
            # upper triangle asked for lands in the buffer's lower one, transposed below
            _dsyrk(b"U", b"T", &w, &rb, &one, &a[r0, 0], &m, &zero, &parts[b, 0, 0], &w)
        with nogil:
            for b in range(1, blocks):
                for i in range(w):
                    for j in range(i + 1):
                        parts[0, i, j] = parts[0, i, j] + parts[b, i, j]
    # parts[0] holds (column-major) the upper triangle: as a C array, the lower; its transpose
    # is the Fortran-ordered upper triangle
    return np.asfortranarray(np.tril(parts_array[0]).T)


def solve_upper_right(double[::1, :] y, const double[::1, :] r, int threads=1):
    """y r^-1 in place, for r [w, w] upper triangular (Fortran order) and y [m, w] f64 in
    Fortran order: each row of the result depends on that row of y alone, so the blocks of
    F64_BLOCK rows are solved apart, one dtrsm call each."""
    cdef int m = <int>y.shape[0], w = <int>y.shape[1], blocks = _blocks(y.shape[0]), b, r0, rb
    cdef double one = 1.0
    if r.shape[0] != w or r.shape[1] != w:
        raise ValueError("shape mismatch")
    if m and w:
        for b in prange(blocks, nogil=True, num_threads=max(threads, 1), schedule="dynamic"):
            r0 = b * F64_BLOCK
            rb = min(F64_BLOCK, m - r0)
            _dtrsm(b"R", b"U", b"N", b"N", &rb, &w, &one, &r[0, 0], &w, &y[r0, 0], &m)
    return np.asarray(y)


def product_f64(const double[::1, :] a, const double[::1, :] b, int threads=1):
    """a @ b for a [m, k] and b [k, n], f64 in Fortran order: [m, n] in Fortran order, one
    dgemm call per block of F64_BLOCK rows of a."""
    cdef int m = <int>a.shape[0], k = <int>a.shape[1], n = <int>b.shape[1]
    cdef int blocks = _blocks(a.shape[0]), i, r0, rb
    cdef double one = 1.0, zero = 0.0
    if b.shape[0] != k:
        raise ValueError("shape mismatch")
    out = np.zeros((m, n), np.float64, order="F")
    cdef double[::1, :] c = out
    if m and n and k:
        for i in prange(blocks, nogil=True, num_threads=max(threads, 1), schedule="dynamic"):
            r0 = i * F64_BLOCK
            rb = min(F64_BLOCK, m - r0)
            _dgemm(b"N", b"N", &rb, &n, &k, &one, &a[r0, 0], &m, &b[0, 0], &k, &zero, &c[r0, 0],
                   &m)
    return out
