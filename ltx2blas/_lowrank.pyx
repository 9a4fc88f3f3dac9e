"""Driver of the low-rank extraction (ltx2blas.extract): a weight difference D [m, n] in f32,
and its products with thin matrices, ``D @ X`` and ``Y^T @ D`` (= (D^T Y)^T), for the
randomized range finder.

Each product is cut into fixed blocks -- of D's rows for ``D @ X``, of its columns for
``Y^T @ D`` -- and each block is one sgemm call (the seam's) with the BLAS on one thread; the
threads share the blocks out.  An output element is computed by one call whose shape depends on
the block size alone, so the bytes never depend on the thread count.
"""
from cython.parallel cimport prange
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from ._gemm cimport sgemm_rowmajor

import numpy as np

#: Rows of D one sgemm call of ``D @ X`` takes: large enough that each call runs near the
#: BLAS's rate on a thin X, small enough to share a 4096-row weight among tens of threads.
BLOCK = 256
#: Columns of D one sgemm call of ``Y^T @ D`` takes.  Each call packs all of Y^T (the thin
#: operand, [width, rows]) for the BLAS's kernel, a copy as large as a quarter of a 256-column
#: block of D at rank 64; 1024 columns make that copy a sixteenth, at the price of fewer blocks
#: to share (four on a 4096-column weight: more threads than that are for weights side by
#: side).
COLUMN_BLOCK = 1024

ctypedef fused stored:
    uint16_t    # bf16 bits
    float


cdef inline float widened(stored v) noexcept nogil:
    cdef uint32_t bits
    cdef float f
    if stored is uint16_t:
        bits = (<uint32_t>v) << 16
        memcpy(&f, &bits, 4)
        return f
    else:
        return v


def difference(const stored[:, ::1] tuned, const stored[:, ::1] base, float[:, ::1] out,
               double[::1] row_squares, int threads):
    """out = f32(tuned) - f32(base), one f32 subtraction an element, and each row's sum of
    squares of out in f64 (row_squares[r]): four partial sums from 0.0, of the columns c with
    c % 4 = 0, 1, 2, 3, each in column order, added as (s0 + s1) + (s2 + s3) -- four chains,
    so the additions' latency does not bound the pass."""
    cdef Py_ssize_t rows = out.shape[0], cols = out.shape[1], r, c
    cdef double s0, s1, s2, s3
    cdef float v0, v1, v2, v3
    if tuned.shape[0] != rows or base.shape[0] != rows or tuned.shape[1] != cols or \
            base.shape[1] != cols or row_squares.shape[0] != rows:
        raise ValueError("shapes differ")
    for r in prange(rows, nogil=True, num_threads=max(threads, 1), schedule="static"):
        # the row's difference first (a loop the compiler vectorises), then its squares from L1
        for c in range(cols):
            out[r, c] = widened(tuned[r, c]) - widened(base[r, c])
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        c = 0
        while c + 4 <= cols:
            v0 = out[r, c]
            v1 = out[r, c + 1]
            v2 = out[r, c + 2]
            v3 = out[r, c + 3]
            s0 = s0 + <double>v0 * <double>v0
            s1 = s1 + <double>v1 * <double>v1
            s2 = s2 + <double>v2 * <double>v2
            s3 = s3 + <double>v3 * <double>v3
            c = c + 4
        while c < cols:
            v0 = out[r, c]
            if c % 4 == 0:
                s0 = s0 + <double>v0 * <double>v0
            elif c % 4 == 1:
                s1 = s1 + <double>v0 * <double>v0
            else:
                s2 = s2 + <double>v0 * <double>v0
            c = c + 1
        row_squares[r] = (s0 + s1) + (s2 + s3)


def d_times(const float[:, ::1] d, const float[:, ::1] x, float[:, ::1] out, int threads,
            int block=BLOCK):
    """out[m, l] = d[m, n] @ x[n, l], one sgemm call per block of ``block`` rows of d; the
    caller holds the BLAS to one thread."""
    cdef int m = <int>d.shape[0], n = <int>d.shape[1], l = <int>x.shape[1]
    cdef Py_ssize_t blocks = (m + block - 1) // block, b
    cdef int r0, rb
    if x.shape[0] != n or out.shape[0] != m or out.shape[1] != l:
        raise ValueError("shapes differ")
    if m == 0 or l == 0:
        return
    if n == 0:
        out[:, :] = 0
        return
    for b in prange(blocks, nogil=True, num_threads=max(threads, 1), schedule="dynamic"):
        r0 = <int>b * block
        rb = min(block, m - r0)
        sgemm_rowmajor(rb, l, n, &d[r0, 0], n, &x[0, 0], l, 0.0, &out[r0, 0], l)


def dt_times(const float[:, ::1] d, const float[:, ::1] yt, float[:, ::1] out, int threads,
             int block=COLUMN_BLOCK):
    """out[l, n] = yt[l, m] @ d[m, n] -- that is (d^T @ y)^T for y = yt^T -- one sgemm call
    per block of ``block`` columns of d; the caller holds the BLAS to one thread.  Column-major
    the block's call is out^T = d_block^T yt^T with d's block entering untransposed, which the
    BLAS packs with its plain copy: a transposed d_block, read row by row across 4096-float
    strides, packs at about two thirds of the speed."""
    cdef int m = <int>d.shape[0], n = <int>d.shape[1], l = <int>yt.shape[0]
    cdef Py_ssize_t blocks = (n + block - 1) // block, b
    cdef int c0, cb
    if yt.shape[1] != m or out.shape[0] != l or out.shape[1] != n:
        raise ValueError("shapes differ")
    if n == 0 or l == 0:
        return
    if m == 0:
        out[:, :] = 0
        return
    for b in prange(blocks, nogil=True, num_threads=max(threads, 1), schedule="dynamic"):
        c0 = <int>b * block
        cb = min(block, n - c0)
        sgemm_rowmajor(l, cb, m, &yt[0, 0], m, &d[0, c0], n, 0.0, &out[0, c0], n)


cdef extern from "kernels.h" nogil:
    uint64_t ltx_splitmix64(uint64_t x)


def rademacher(uint64_t key, float[:, ::1] out):
    """The range finder's test matrix: out[i, j] = +1 or -1 by the top bit of
    splitmix64(key + i * cols + j), wrapping -- exact, the same on every machine."""
    cdef Py_ssize_t rows = out.shape[0], cols = out.shape[1], i, j
    with nogil:
        for i in range(rows):
            for j in range(cols):
                out[i, j] = -1.0 if ltx_splitmix64(key + <uint64_t>(i * cols + j)) >> 63 else 1.0


def lu_basis(const float[::1, :] lu, const int[::1] pivots, float[:, ::1] out, bint transposed):
    """A basis of the columns of a [m, w] matrix from its LU factorisation with partial
    pivoting (LAPACK's getrf: ``lu`` in Fortran order, ``pivots`` 0-based): P L, the unit lower
    trapezoidal L with its rows put back in a's order -- the same column space as a (L has full
    column rank), entries at most 1 in magnitude.  Written to out [m, w], or its transpose
    [w, m] where ``transposed``."""
    cdef Py_ssize_t m = lu.shape[0], w = lu.shape[1], i, j, t, row
    if pivots.shape[0] != min(m, w) or w > m:
        raise ValueError("lu and pivots differ in shape")
    if (transposed and (out.shape[0] != w or out.shape[1] != m)) or \
            (not transposed and (out.shape[0] != m or out.shape[1] != w)):
        raise ValueError("out has the wrong shape")
    cdef Py_ssize_t[::1] where = np.arange(m, dtype=np.intp)
    with nogil:
        # where[i]: the row of a that row i of L belongs to, after the interchanges in order
        for i in range(w):
            t = where[i]
            where[i] = where[pivots[i]]
            where[pivots[i]] = t
        if transposed:   # down lu's columns (its storage order), along out's rows
            for j in range(w):
                for i in range(m):
                    out[j, where[i]] = lu[i, j] if j < i else (1.0 if j == i else 0.0)
        else:
            for i in range(m):
                row = where[i]
                for j in range(w):
                    out[row, j] = lu[i, j] if j < i else (1.0 if j == i else 0.0)
