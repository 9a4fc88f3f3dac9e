"""The GEMM seam: every matrix product in ltx2blas is computed here.

Two routes, one contract for the fuse: ``c[i, j] = sum_p x[i, p] * y[p, j]`` accumulated in f32
from +0.0 in the order p = 0, 1, 2, ... (the textbook loop of the spec).

* sgemm (scipy.linalg.cython_blas) reproduces that order only while it does not split the
  depth internally, and where it splits depends on the BLAS build, the CPU and the operand
  shape.  So nothing is assumed: :func:`verified_depth` runs the exact call shape on probe data
  and compares it bit for bit with the sequential kernel, and sgemm is used only up to a depth
  that passed.
* The terms beyond that depth are added by ``seq_gemm`` (kernels/kernels.c), which continues
  the accumulation element by element, in order, from what sgemm left in ``c``.
"""
from cpython.pycapsule cimport PyCapsule_GetName, PyCapsule_GetPointer
from libc.stdint cimport uint16_t, uint32_t
from libc.string cimport memset

from ._parallel cimport LTX_HAVE_OPENMP, omp_get_max_threads

import threading

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

cdef sgemm_fn _sgemm = NULL
cdef dgemm_fn _dgemm = NULL
cdef const ltx_kernels *_fast = ltx_fast_kernels()
cdef const ltx_kernels *_strict = ltx_strict_kernels()


cdef void *_capsule_pointer(object capsule, str name) except NULL:
    """The function pointer in one of cython_blas's capsules, refusing an integer ABI we do not
    call correctly (the capsule's name is the C signature, and names the integer type)."""
    cdef const char *signature = PyCapsule_GetName(capsule)
    int_type = signature.decode().split(",")[2].strip()
    if int_type != "int *":
        raise ImportError(
            f"scipy.linalg.cython_blas.{name} takes {int_type!r} sizes; ltx2blas calls "
            "BLAS with 32-bit int sizes (LP64) and cannot use this SciPy build"
        )
    return PyCapsule_GetPointer(capsule, signature)


def _bind_blas():
    """Take sgemm and dgemm from scipy.linalg.cython_blas."""
    global _sgemm, _dgemm
    from scipy.linalg import cython_blas

    _sgemm = <sgemm_fn>_capsule_pointer(cython_blas.__pyx_capi__["sgemm"], "sgemm")
    _dgemm = <dgemm_fn>_capsule_pointer(cython_blas.__pyx_capi__["dgemm"], "dgemm")


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


cdef void sgemm_wxt(int m, int n, int k, const float *x, int ldx, const float *w, int ldw,
                    float beta, float *c, int ldc) noexcept nogil:
    """c[n, m] = w[n, k] @ x[m, k]^T + beta * c, row-major: a Linear's output, transposed.

    Column-major that is c^T = x w^T, with x entering transposed and w not: the BLAS then packs
    the weight panel with its plain copy, which costs ~2.5x less than the transposing one when
    x has few rows (OpenBLAS 0.3.30, 64 x 2048 panel, 8 rows)."""
    cdef float alpha = 1.0
    _sgemm(b"T", b"N", &m, &n, &k, &alpha, x, &ldx, w, &ldw, &beta, c, &ldc)


cdef void dgemm_wxt(int m, int n, int k, const double *x, int ldx, const double *w, int ldw,
                    double beta, double *c, int ldc) noexcept nogil:
    """f64 twin of sgemm_wxt."""
    cdef double alpha = 1.0
    _dgemm(b"T", b"N", &m, &n, &k, &alpha, x, &ldx, w, &ldw, &beta, c, &ldc)


cdef void exact_product(const ltx_kernels *kern, int m, int n, int k, const float *x, int ldx,
                        const float *y, float *c, int blas_depth) noexcept nogil:
    """c[m, n] = textbook sum over p < k of x[i, p] * y[p, j], from +0.0, in order.

    Layout: x is [m, >=k] with row stride ldx; y is [k, n] and c is [m, n], both packed
    (row stride n) -- the layout :func:`verified_depth` probes.  ``blas_depth`` must come from
    verified_depth(m, n, k, ldx) (0 means no sgemm)."""
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


cdef void exact_product_fused(const ltx_kernels *kern, int m, int n, int k, const float *x,
                              int ldx, const float *y, const uint16_t *w, Py_ssize_t ldw,
                              uint16_t *out, Py_ssize_t ldo) noexcept nogil:
    """out[m, n] = bf16(w + bf16(textbook x @ y)), w and out bf16 with row strides ldw and ldo
    (out may be w), x and y laid out as for :func:`exact_product`: the fuse of one adapter,
    product and rounding in one pass, for a product that sgemm is not used for."""
    if m > 0 and n > 0:
        kern.seq_fuse_bf16(m, n, k, x, ldx, y, n, w, ldw, out, ldo)


cdef void exact_product_fused_pairs(const ltx_kernels *kern, int m, int n, int kp,
                                    const uint32_t *xp, int ldxp, const uint32_t *yp,
                                    const uint16_t *w, Py_ssize_t ldw, uint16_t *out,
                                    Py_ssize_t ldo) noexcept nogil:
    """As :func:`exact_product_fused`, from bf16 operands packed in pairs of terms (xp [m, kp]
    with row stride ldxp, yp [kp, n] packed), by the table's dot-product kernel, which must
    exist. The caller has ruled out inf, NaN and subnormal inputs, products and partial sums
    (see ``fuse._pairs_exact``)."""
    if m > 0 and n > 0:
        kern.dot_fuse_bf16(m, n, kp, xp, ldxp, yp, n, w, ldw, out, ldo)


# Up to this depth the sequential kernel is used alone, sgemm neither probed nor called: at a
# few dozen terms a BLAS call's fixed costs (zeroing c, packing both operands) dominate, and
# the fuse's rounding runs in the kernel's registers instead of over a stored f32 tile.
# Measured (bench/bench_fuse.py --ranks 32,64,128; OpenBLAS 0.3.30 SkylakeX kernels, Zen 4),
# the whole fuse this way takes less time than sgemm of the same product alone: 1.2-2.0x at
# rank 32, 1.1-1.8x at 64, 1.05-1.3x at 128. Larger ranks go to sgemm, the route the design
# rests on and the one each CPU's BLAS tunes.
SEQUENTIAL_DEPTH = 128


def blas_depth(int m, int n, int k, int ldx=-1):
    """The depth an exact product of shape (m, n, k) hands to sgemm: 0 up to SEQUENTIAL_DEPTH,
    else :func:`verified_depth`."""
    return 0 if k <= SEQUENTIAL_DEPTH else verified_depth(m, n, k, ldx)


# --------------------------------------------------------------------------------------------
# Knowing when sgemm is exact
# --------------------------------------------------------------------------------------------

_probe_lock = threading.Lock()
_exact_cache = {}
_depth_cache = {}
_last_depth = [0]


def _bf16_exact(values):
    """Round-toward-zero to bf16-representable f32: probe data must have exact products."""
    return (np.asarray(values, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _probe_operands(int m, int n, int k, int ldx):
    """Operands on which any accumulation order other than p = 0, 1, 2, ... shows.

    Pattern 1 gives row i the product 1.0 at p = i % k and 2**-24 (half an ulp of 1) at every
    other p, with some doubled: summing two small terms before they meet the large one, or
    meeting it early or late, changes the bits.  Pattern 2 is random bf16 data, with one row of
    zeros against a column of negatives (an order that starts from the first product instead of
    +0.0 turns +0.0 into -0.0 there)."""
    rng = np.random.default_rng(0x17B)
    x1 = np.full((m, ldx), 2.0 ** -12, np.float32)
    x1[np.arange(m), np.arange(m) % k] = 2.0 ** 12
    y1 = np.full((k, n), 2.0 ** -12, np.float32)
    y1[np.arange(n) % k, np.arange(n)] = 2.0 ** -11
    x2 = _bf16_exact(rng.standard_normal((m, ldx)))
    y2 = _bf16_exact(rng.standard_normal((k, n)))
    x2[0, :] = 0.0
    y2[:, 0] = -np.abs(y2[:, 0]) - 1.0
    return [(x1, y1), (x2, y2)]


def _sgemm_is_sequential(int m, int n, int k, int ldx):
    """Whether sgemm over k terms, at this exact call shape, matches the sequential kernel bit
    for bit on the probe operands."""
    cdef float[:, ::1] xv
    cdef float[:, ::1] yv
    cdef float[:, ::1] cb
    cdef float[:, ::1] cs
    key = (m, n, k, ldx)
    if key in _exact_cache:
        return _exact_cache[key]
    from ._threads import blas_single_threaded

    exact = True
    with blas_single_threaded():
        for x, y in _probe_operands(m, n, k, ldx):
            blas = np.empty((m, n), np.float32)
            seq = np.zeros((m, n), np.float32)
            xv, yv, cb, cs = x, y, blas, seq
            with nogil:
                sgemm_rowmajor(m, n, k, &xv[0, 0], ldx, &yv[0, 0], n, 0.0, &cb[0, 0], n)
                _strict.seq_gemm(m, n, k, &xv[0, 0], ldx, &yv[0, 0], n, &cs[0, 0], n)
            if not np.array_equal(blas.view(np.uint32), seq.view(np.uint32)):
                exact = False
                break
    _exact_cache[key] = exact
    return exact


def verified_depth(int m, int n, int k, int ldx=-1):
    """The largest depth d <= k for which one sgemm call of shape (m, n, d), with x's row stride
    ldx (default k) and y, c packed, was verified on probe data to add the terms in the
    textbook order.  0 means sgemm is not used for this shape.

    Probes are cached for the life of the process.  Exactness is checked at each depth used,
    never inferred: a bisection only chooses which depths to check."""
    if ldx < 0:
        ldx = k
    if m <= 0 or n <= 0 or k <= 0:
        return 0
    key = (m, n, k, ldx)
    with _probe_lock:
        if key in _depth_cache:
            return _depth_cache[key]
        if _sgemm_is_sequential(m, n, k, ldx):
            depth = k
        else:
            lo, hi = 0, k  # invariant: depth lo verified (0 trivially), depth hi not exact
            hint = _last_depth[0]
            if 0 < hint < k and _sgemm_is_sequential(m, n, hint, ldx):
                lo = hint
                if not _sgemm_is_sequential(m, n, hint + 1, ldx):
                    hi = hint + 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _sgemm_is_sequential(m, n, mid, ldx):
                    lo = mid
                else:
                    hi = mid
            depth = lo
            if depth:
                _last_depth[0] = depth
        _depth_cache[key] = depth
        return depth


def probe_report():
    """Every depth probe run in this process: {(m, n, k, ldx): exact}."""
    with _probe_lock:
        return dict(_exact_cache)


# --------------------------------------------------------------------------------------------
# Introspection and testing hooks
# --------------------------------------------------------------------------------------------

def kernel_name(bint allow_fma=True):
    """Name of the kernel table used: 'avx512bf16', 'avx512', 'avx2', 'neon' or 'base'."""
    return kernels(allow_fma).name.decode()


def kernels_built():
    return ltx_kernels_built().decode().split(",")


def use_kernels(name=None):
    """Force a kernel table for the fast path (tests and diagnostics). None restores the
    automatic choice. Raises ValueError for a table this build or CPU lacks."""
    global _fast
    if name is None:
        _fast = ltx_fast_kernels()
        return kernel_name()
    cdef const ltx_kernels *table = ltx_kernels_by_name(name.encode())
    if table == NULL:
        raise ValueError(f"kernel table {name!r} is not available here (built: {kernels_built()})")
    _fast = table
    return kernel_name()


def omp_max_threads():
    return omp_get_max_threads()


def have_openmp():
    return bool(LTX_HAVE_OPENMP)


cdef const ltx_kernels *_table(name) except NULL:
    if name is None:
        return _fast
    cdef const ltx_kernels *table = ltx_kernels_by_name(name.encode())
    if table == NULL:
        raise ValueError(f"kernel table {name!r} is not available here")
    return table


def _store_fused(const float[::1] acc, const uint16_t[::1] w, table=None):
    """bf16(w + bf16(acc)) elementwise by one kernel table; for tests."""
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty(acc.shape[0], np.uint16)
    cdef uint16_t[::1] o = out
    if acc.shape[0] != w.shape[0]:
        raise ValueError("length mismatch")
    if acc.shape[0]:
        kern.store_fused(&acc[0], &w[0], 0, &o[0], 0, 1, acc.shape[0])
    return out


def _scale_round_widen(const uint16_t[::1] bits, float s, table=None):
    """f32(bf16(f32(bits) * s)) elementwise by one kernel table; for tests."""
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty(bits.shape[0], np.float32)
    cdef float[::1] o = out
    if bits.shape[0]:
        kern.scale_round_widen(&bits[0], s, &o[0], bits.shape[0])
    return out


def _accumulate_rounded(const float[::1] acc, float[::1] total, table=None):
    """total += f32(bf16(acc)) elementwise by one kernel table; for tests."""
    cdef const ltx_kernels *kern = _table(table)
    if acc.shape[0] != total.shape[0]:
        raise ValueError("length mismatch")
    if acc.shape[0]:
        kern.accumulate_rounded(&acc[0], &total[0], acc.shape[0])


def seq_gemm(const float[:, ::1] x, const float[:, ::1] y, float[:, ::1] c, table=None):
    """c += x @ y accumulated in order (the sequential kernel alone); for tests."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k or c.shape[0] != m or c.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    if m == 0 or n == 0 or k == 0:
        return
    with nogil:
        kern.seq_gemm(m, n, k, &x[0, 0], k, &y[0, 0], n, &c[0, 0], n)


def seq_fuse_bf16(const float[:, ::1] x, const float[:, ::1] y, const uint16_t[:, ::1] w,
                  table=None):
    """bf16(w + bf16(x @ y)), the product accumulated in order, by the fused kernel of one
    table; for tests."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k or w.shape[0] != m or w.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty((m, n), np.uint16)
    cdef uint16_t[:, ::1] o = out
    if m and n:
        with nogil:
            kern.seq_fuse_bf16(m, n, k, &x[0, 0] if k else NULL, k, &y[0, 0] if k else NULL,
                               n, &w[0, 0], n, &o[0, 0], n)
    return out


def has_pairs_kernel(table=None):
    """Whether a kernel table (default: the one in use) has the bf16 dot-product fuse."""
    return _table(table).dot_fuse_bf16 != NULL


def dot_fuse_bf16(const uint16_t[:, ::1] x, const uint16_t[:, ::1] y, const uint16_t[:, ::1] w,
                  table=None):
    """bf16(w + bf16(x @ y)) for bf16 x and y, packed in pairs by the table's pack kernels and
    multiplied by its dot-product fuse; for tests."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    cdef Py_ssize_t kp = (k + 1) // 2
    if y.shape[0] != k or w.shape[0] != m or w.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    if kern.dot_fuse_bf16 == NULL:
        raise ValueError("this kernel table has no dot-product fuse")
    xf = np.ascontiguousarray((np.asarray(x).astype(np.uint32) << 16).view(np.float32))
    cdef const float[:, ::1] xv = xf
    xp_arr = np.zeros((m, max(kp, 1)), np.uint32)
    yp_arr = np.zeros((max(kp, 1), n), np.uint32)
    cdef uint32_t[:, ::1] xp = xp_arr
    cdef uint32_t[:, ::1] yp = yp_arr
    out = np.empty((m, n), np.uint16)
    cdef uint16_t[:, ::1] o = out
    if m and n:
        with nogil:
            if k:
                kern.pack_pairs_cols(&xv[0, 0], k, &xp[0, 0], xp.shape[1], m, k)
                kern.pack_pairs_rows(&y[0, 0], n, &yp[0, 0], k, n)
            kern.dot_fuse_bf16(m, n, kp, &xp[0, 0], xp.shape[1], &yp[0, 0], n, &w[0, 0], n,
                               &o[0, 0], n)
    return out


def scan_bf16(const uint16_t[::1] bits):
    """(largest finite magnitude bits, smallest non-zero magnitude bits, first inf/NaN index or
    -1) of a flat bf16 array, in one pass without the GIL."""
    cdef uint16_t hi = 0, lo = 0
    cdef Py_ssize_t first = -1
    if bits.shape[0]:
        with nogil:
            first = _fast.scan_bf16(&bits[0], bits.shape[0], &hi, &lo)
    return hi, lo, first


def sgemm(const float[:, ::1] x, const float[:, ::1] y, out=None):
    """x @ y by one sgemm call (into ``out`` when given); for tests and benchmarks."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k:
        raise ValueError("shape mismatch")
    if out is None:
        out = np.zeros((m, n), np.float32)
    elif out.shape != (m, n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError("out must be a C-contiguous float32 array of the product's shape")
    cdef float[:, ::1] c = out
    if m and n and k:
        with nogil:
            sgemm_rowmajor(m, n, k, &x[0, 0], k, &y[0, 0], n, 0.0, &c[0, 0], n)
    return out
