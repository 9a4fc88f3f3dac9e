"""Entry points into the kernel tables and the seam's sgemm, for the test suite and the
benchmarks: each runs one element kernel of a named table on numpy arrays, so that every table
the CPU can run is checked on its own.  Built with ltx2blas and installed beside it as its own
top-level module; ltx2blas never imports it.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t

from ltx2blas._gemm cimport sgemm_rowmajor
from ltx2blas._kernels cimport ltx_kernels

import numpy as np

from ltx2blas import _gemm

cdef extern from "kernels.h" nogil:
    const ltx_kernels *ltx_kernels_by_name(const char *name)


cdef const ltx_kernels *_table(name) except NULL:
    """A kernel table by name (None: the one the library uses for its fast path)."""
    cdef const ltx_kernels *table = ltx_kernels_by_name(
        (name if name is not None else _gemm.kernel_name()).encode())
    if table == NULL:
        raise ValueError(f"kernel table {name!r} is not available here")
    return table


def store_fused(const float[::1] acc, const uint16_t[::1] w, table=None):
    """bf16(w + bf16(acc)) elementwise by one kernel table."""
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty(acc.shape[0], np.uint16)
    cdef uint16_t[::1] o = out
    cdef Py_ssize_t first
    if acc.shape[0] != w.shape[0]:
        raise ValueError("length mismatch")
    if acc.shape[0]:
        kern.store_fused(&acc[0], &w[0], 0, &o[0], 0, 1, acc.shape[0], &first)
    return out


def _tile_shape(acc, w):
    """(rows, cols, ldw) of a store hook's tile: acc [rows, cols], w rows of at least cols."""
    rows, cols, ldw = acc.shape[0], acc.shape[1], w.shape[1]
    if w.shape[0] != rows or ldw < cols:
        raise ValueError("shape mismatch")
    return rows, cols, ldw


def store_fused_tile(const float[:, ::1] acc, const uint16_t[:, ::1] w, table=None,
                     bint counted=False):
    """bf16(w + bf16(acc)) over a tile by one kernel table: acc [rows, cols] packed, w's rows
    (row stride w.shape[1] >= cols) and the output's (row stride w.shape[1] + 5) longer than
    the tile; the output's elements past the tile hold 0xABCD and must keep it. With
    ``counted``, (out, the overflows' count, the least r * ldw + i among them or -1)."""
    cdef Py_ssize_t rows, cols, ldw
    rows, cols, ldw = _tile_shape(acc, w)
    cdef const ltx_kernels *kern = _table(table)
    out = np.full((rows, ldw + 5), 0xABCD, np.uint16)
    cdef uint16_t[:, ::1] o = out
    cdef Py_ssize_t first = -1, count = 0
    if rows and cols:
        count = kern.store_fused(&acc[0, 0], &w[0, 0], ldw, &o[0, 0], ldw + 5, rows, cols,
                                 &first)
    return (out, count, first) if counted else out


def store_fused_fp8(const float[:, ::1] acc, const uint8_t[:, ::1] w, int kind, table=None):
    """fp8(bf16(f32(w) + f32(bf16(acc)))), nearest-even into the ltx_fp8_kind ``kind`` (0
    F8_E4M3 saturating, 1 F8_E5M2, 2 F8_E4M3 NaN past 448), over a tile by one kernel table,
    w's rows (row stride w.shape[1] >= cols) and the output's (row stride w.shape[1] + 3)
    longer than the tile, whose elements past the tile hold 0xAB and must keep it. Returns
    (out, the kernel's r * cols + i of the first overflow or -1, the overflows' count)."""
    cdef Py_ssize_t rows, cols, ldw
    rows, cols, ldw = _tile_shape(acc, w)
    cdef const ltx_kernels *kern = _table(table)
    out = np.full((rows, ldw + 3), 0xAB, np.uint8)
    cdef uint8_t[:, ::1] o = out
    cdef Py_ssize_t first = -1, count = 0
    if rows and cols:
        count = kern.store_fused_fp8(&acc[0, 0], &w[0, 0], ldw, &o[0, 0], ldw + 3, rows, cols,
                                     kind, 0, 0, 0, cols, &first)
    return out, first, count


def scale_round_widen(const uint16_t[::1] bits, float s, table=None):
    """f32(bf16(f32(bits) * s)) elementwise by one kernel table."""
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty(bits.shape[0], np.float32)
    cdef float[::1] o = out
    if bits.shape[0]:
        kern.scale_round_widen(&bits[0], s, &o[0], bits.shape[0])
    return out


def accumulate_rounded(const float[::1] acc, float[::1] total, table=None):
    """total += f32(bf16(acc)) elementwise by one kernel table."""
    cdef const ltx_kernels *kern = _table(table)
    if acc.shape[0] != total.shape[0]:
        raise ValueError("length mismatch")
    if acc.shape[0]:
        kern.accumulate_rounded(&acc[0], &total[0], acc.shape[0])


def seq_gemm(const float[:, ::1] x, const float[:, ::1] y, float[:, ::1] c, table=None):
    """c += x @ y accumulated in order (the sequential kernel alone)."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k or c.shape[0] != m or c.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    if m == 0 or n == 0 or k == 0:
        return
    with nogil:
        kern.seq_gemm(m, n, k, &x[0, 0], k, &y[0, 0], n, &c[0, 0], n)


def _bf16_bits(y_in):
    """The bf16 bits of f32 values that must be bf16 values, as a contiguous uint16 array."""
    y_f32 = np.ascontiguousarray(y_in, dtype=np.float32)
    if np.any(y_f32.view(np.uint32) & 0xFFFF):
        raise ValueError("y must hold bf16 values")
    return np.ascontiguousarray(y_f32.view(np.uint32) >> 16, dtype=np.uint16)


cdef object _fuse_panel(const ltx_kernels *kern, const uint16_t[:, ::1] y):
    """y [k, n] packed by the table's pack_fuse_panel (at least one float)."""
    cdef Py_ssize_t k = y.shape[0], n = y.shape[1]
    panel_array = np.empty(max(k * n, 1), np.float32)
    cdef float[::1] panel = panel_array
    if k and n:
        with nogil:
            kern.pack_fuse_panel(&y[0, 0], n, &panel[0], k, n)
    return panel_array


def seq_fuse_bf16(const float[:, ::1] x, y_in, const uint16_t[:, ::1] w, table=None,
                  bint counted=False):
    """bf16(w + bf16(x @ y)), the product accumulated in order, by the fused kernel of one
    table, y (f32 holding bf16 values) packed by the same table's pack_fuse_panel. With
    ``counted``, (out, the overflows' count, the least r * n + i among them or -1)."""
    cdef const uint16_t[:, ::1] y = _bf16_bits(y_in)
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k or w.shape[0] != m or w.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    out = np.empty((m, n), np.uint16)
    cdef float[::1] panel = _fuse_panel(kern, y)
    cdef uint16_t[:, ::1] o = out
    cdef Py_ssize_t first = -1, count = 0
    if m and n:
        with nogil:
            count = kern.seq_fuse_bf16(m, n, k, &x[0, 0] if k else NULL, k, &panel[0], n,
                                       &w[0, 0], n, &o[0, 0], n, &first)
    return (out, count, first) if counted else out


def seq_product_panel(const float[:, ::1] x, y_in, table=None):
    """x @ y, each sum from +0.0 in order, by one table's product kernel from its fuse panel,
    y (f32 holding bf16 values) packed by the same table's pack_fuse_panel. The result's rows
    lie 3 floats apart beyond its n columns, which must stay as they were (NaN)."""
    cdef const uint16_t[:, ::1] y = _bf16_bits(y_in)
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    if y.shape[0] != k:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    out = np.full((m, n + 3), np.nan, np.float32)
    cdef float[::1] panel = _fuse_panel(kern, y)
    cdef float[:, ::1] c = out
    if m and n:
        with nogil:
            kern.seq_product_panel(m, n, k, &x[0, 0] if k else NULL, k, &panel[0], &c[0, 0],
                                   n + 3)
    return out


def has_pairs_kernel(table=None):
    """Whether a kernel table (default: the one in use) has the bf16 dot-product fuse."""
    return _table(table).dot_fuse_bf16 != NULL


cdef object pairs_of(const uint16_t[:, ::1] x, const uint16_t[:, ::1] y,
                     const ltx_kernels *kern):
    """(x's columns, y's rows) packed in pairs of terms by the table's pack kernels, as the
    fuse driver packs bf16(B*s) and A; at least one pair wide."""
    cdef Py_ssize_t m = x.shape[0], k = x.shape[1], n = y.shape[1]
    cdef Py_ssize_t kp = (k + 1) // 2
    if y.shape[0] != k:
        raise ValueError("shape mismatch")
    xf = np.ascontiguousarray((np.asarray(x).astype(np.uint32) << 16).view(np.float32))
    cdef const float[:, ::1] xv = xf
    xp_arr = np.zeros((m, max(kp, 1)), np.uint32)
    yp_arr = np.zeros((max(kp, 1), n), np.uint32)
    cdef uint32_t[:, ::1] xp = xp_arr
    cdef uint32_t[:, ::1] yp = yp_arr
    if m and n and k:
        with nogil:
            kern.pack_pairs_cols(&xv[0, 0], k, &xp[0, 0], xp.shape[1], m, k)
            kern.pack_pairs_rows(&y[0, 0], n, &yp[0, 0], k, n)
    return xp_arr, yp_arr


def dot_fuse_bf16(const uint16_t[:, ::1] x, const uint16_t[:, ::1] y, const uint16_t[:, ::1] w,
                  table=None, bint counted=False):
    """bf16(w + bf16(x @ y)) for bf16 x and y, packed in pairs by the table's pack kernels and
    multiplied by its dot-product fuse. With ``counted``, (out, the overflows' count, the
    least r * n + i among them or -1)."""
    cdef Py_ssize_t m = x.shape[0], n = y.shape[1], kp = (x.shape[1] + 1) // 2
    if w.shape[0] != m or w.shape[1] != n:
        raise ValueError("shape mismatch")
    cdef const ltx_kernels *kern = _table(table)
    if kern.dot_fuse_bf16 == NULL:
        raise ValueError("this kernel table has no dot-product fuse")
    xp_arr, yp_arr = pairs_of(x, y, kern)
    cdef uint32_t[:, ::1] xp = xp_arr
    cdef uint32_t[:, ::1] yp = yp_arr
    out = np.empty((m, n), np.uint16)
    cdef uint16_t[:, ::1] o = out
    cdef Py_ssize_t first = -1, count = 0
    if m and n:
        with nogil:
            count = kern.dot_fuse_bf16(m, n, kp, &xp[0, 0], xp.shape[1], &yp[0, 0], n,
                                       &w[0, 0], n, &o[0, 0], n, &first)
    return (out, count, first) if counted else out


def dot_product_bf16(const uint16_t[:, ::1] x, const uint16_t[:, ::1] y, table=None):
    """f32 x @ y for bf16 x and y by the table's dot-product kernel, the product alone, into
    rows of n + 3 floats first filled with NaN (so that a write past a row shows)."""
    cdef Py_ssize_t m = x.shape[0], n = y.shape[1], kp = (x.shape[1] + 1) // 2
    cdef const ltx_kernels *kern = _table(table)
    if kern.dot_product_bf16 == NULL:
        raise ValueError("this kernel table has no dot-product kernel")
    xp_arr, yp_arr = pairs_of(x, y, kern)
    cdef uint32_t[:, ::1] xp = xp_arr
    cdef uint32_t[:, ::1] yp = yp_arr
    out = np.full((m, n + 3), np.nan, np.float32)
    cdef float[:, ::1] c = out
    if m and n:
        with nogil:
            kern.dot_product_bf16(m, n, kp, &xp[0, 0], xp.shape[1], &yp[0, 0], n, &c[0, 0],
                                  n + 3)
    return out


def sgemm(const float[:, ::1] x, const float[:, ::1] y, out=None):
    """x @ y by one sgemm call through the seam (into ``out`` when given): the ceiling the
    benchmarks divide by, and the call the probe tests check."""
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
