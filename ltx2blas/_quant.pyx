"""Driver of the scaled and quantised layouts' element passes (kernels/quant.c): each pass
shares rows (or blocks) of one weight out among threads with the GIL released.

The passes only read what earlier passes finished, and each element's result depends on its
inputs alone, so the bytes are the same for any thread count.  Validation happens in
:mod:`ltx2blas.quantized`; these trust shapes, dtypes and contiguity.
"""
from cython.parallel cimport prange
from libc.stdint cimport int8_t, uint8_t, uint16_t, uint64_t

from ._gemm cimport kernels
from ._kernels cimport ltx_idx, ltx_layout_passes

cdef extern from "kernels.h" nogil:
    const float *ltx_fp8_table(int e5m2)
    void ltx_round_bf16(const float *src, uint16_t *dst, ltx_idx n)
    uint64_t ltx_stochastic_key(uint64_t seed, const unsigned char *name, size_t len)

import numpy as np

# Rows per task: enough work per task to hide the scheduling, and hundreds of tasks for a
# weight of LTX-2's sizes, so that many cores share it evenly.
cdef enum:
    ROWS_PER_TASK = 16


cdef inline Py_ssize_t row_tasks(Py_ssize_t rows) noexcept nogil:
    return (rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK


cdef float[::1] task_tops(Py_ssize_t rows):
    """A slot for each row task's running maximum, for _max to join (one when there are no
    rows)."""
    return np.zeros(max(row_tasks(rows), 1), np.float32)


cdef inline float fmax_nan(float a, float b) noexcept nogil:
    """max that lets a NaN through (a NaN anywhere must show in the result)."""
    if a != a or b != b:
        return a + b
    return a if a > b else b


def scaled_fp8_max(const uint8_t[::1] codes, const uint16_t[::1] delta, float scale, bint e5m2,
                   int threads):
    """max |f32(f32(code) * scale) + f32(delta)| over the tensor."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t n = codes.shape[0], chunk = 1 << 16, tasks = (n + chunk - 1) // chunk, t
    cdef float[::1] tops = np.zeros(max(tasks, 1), np.float32)
    cdef Py_ssize_t a
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            a = t * chunk
            tops[t] = passes.scaled_fp8_max(&codes[a], &delta[a], min(chunk, n - a), scale, e5m2)
    return _max(tops)


def scaled_fp8_store(uint8_t[::1] codes, const uint16_t[::1] delta, float scale, float mult,
                     float fmax, bint e5m2, int threads):
    """codes = fp8(clamp(f32(n * mult), -fmax, fmax)) in place (fp8(n) for an infinite mult)."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t n = codes.shape[0], chunk = 1 << 16, tasks = (n + chunk - 1) // chunk, t, a
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            a = t * chunk
            passes.scaled_fp8_store(&codes[a], &delta[a], min(chunk, n - a), scale, mult, fmax,
                                 e5m2)


def block_merge(const uint8_t[:, ::1] codes, bint fp6, const float[:, ::1] scales,
                uint16_t[:, ::1] delta, int threads):
    """delta = bf16(bf16(code * scale) + delta) in place; returns max |merged|."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], t, r0
    cdef float[::1] tops = task_tops(rows)
    with nogil:
        for t in prange(row_tasks(rows), num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            tops[t] = passes.block_merge_rows(&codes[0, 0], fp6, &scales[0, 0], &delta[0, 0], cols,
                                           r0, min(r0 + ROWS_PER_TASK, rows))
    return _max(tops)


def block_quantize(const uint16_t[:, ::1] merged, bint fp6, uint8_t[:, ::1] codes,
                   float[:, ::1] scales, int threads):
    """Each 128 x 128 block of merged requantised into codes and its scale."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t cols = merged.shape[1], nb = scales.shape[1], t, b0
    # a task: up to 32 blocks of one block row, read row by row (a block's own 128 x 128 would
    # take 128 runs of 256 bytes, a page apart)
    cdef Py_ssize_t per_task = 32, chunks = (nb + per_task - 1) // per_task
    cdef Py_ssize_t tasks = scales.shape[0] * chunks
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            b0 = (t % chunks) * per_task
            passes.block_quantize(&merged[0, 0], cols, t // chunks, b0, min(b0 + per_task, nb),
                                  fp6, &codes[0, 0], &scales[0, 0])


def nvfp4_merge(const uint8_t[:, ::1] packed, const uint8_t[:, ::1] scales, float scale_2,
                uint16_t[:, ::1] delta, int threads):
    """delta = bf16(bf16(e2m1 * f32(scale_2 * block scale)) + delta) in place; returns
    max |merged|."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], t, r0
    cdef Py_ssize_t padded = scales.shape[1]
    cdef float[::1] tops = task_tops(rows)
    with nogil:
        for t in prange(row_tasks(rows), num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            tops[t] = passes.nvfp4_merge_rows(&packed[0, 0], &scales[0, 0], padded, scale_2,
                                           &delta[0, 0], cols, r0, min(r0 + ROWS_PER_TASK, rows))
    return _max(tops)


def nvfp4_quantize(const uint16_t[:, ::1] merged, float t, uint8_t[:, ::1] packed,
                   uint8_t[:, ::1] scales, int threads):
    """merged requantised with the new scale_2 ``t``: packed codes and block scales (padding
    zeroed)."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = merged.shape[0], cols = merged.shape[1], task, r0
    cdef Py_ssize_t padded = scales.shape[1]
    cdef Py_ssize_t tasks = row_tasks(rows)
    scales[:, :] = 0
    with nogil:
        for task in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = task * ROWS_PER_TASK
            passes.nvfp4_quantize_rows(&merged[0, 0], t, &packed[0, 0], &scales[0, 0], padded,
                                    cols, r0, min(r0 + ROWS_PER_TASK, rows))


def comfy_tiled_max(const uint8_t[:, ::1] codes, const uint8_t[:, ::1] scales, bint nvfp4,
                    float scale_2, const uint16_t[:, ::1] delta, int threads):
    """max |n| over ComfyUI's nvfp4 (packed codes, E4M3 block scales and ``scale_2``) or mxfp8
    (e4m3 codes, E8M0 exponents) weight merged with delta in f32 (NaN if an n is NaN)."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], t, r0, r1
    cdef Py_ssize_t padded = scales.shape[1]
    cdef float[::1] tops = task_tops(rows)
    with nogil:
        for t in prange(row_tasks(rows), num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            r1 = min(r0 + ROWS_PER_TASK, rows)
            if nvfp4:
                tops[t] = passes.comfy_nvfp4_max_rows(&codes[0, 0], &scales[0, 0], padded, scale_2,
                                                   &delta[0, 0], cols, r0, r1)
            else:
                tops[t] = passes.comfy_mxfp8_max_rows(&codes[0, 0], &scales[0, 0], padded,
                                                   &delta[0, 0], cols, r0, r1)
    return _max(tops)


def comfy_tiled_quantize(uint8_t[:, ::1] codes, uint8_t[:, ::1] scales, bint nvfp4,
                         float scale_2, const uint16_t[:, ::1] delta, float t, int threads):
    """ComfyUI's nvfp4 (with the new scale_2 ``t`` > 0) or mxfp8 weight, read as it is,
    requantised in place with delta; the scales' padding zeroed."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], task, r0, r1
    cdef Py_ssize_t padded = scales.shape[1]
    cdef Py_ssize_t tasks = row_tasks(rows)
    cdef uint8_t[:, ::1] old = np.array(scales, copy=True)
    scales[:, :] = 0
    with nogil:
        for task in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = task * ROWS_PER_TASK
            r1 = min(r0 + ROWS_PER_TASK, rows)
            if nvfp4:
                passes.comfy_nvfp4_quantize_rows(&codes[0, 0], &old[0, 0], &scales[0, 0], padded,
                                              scale_2, &delta[0, 0], t, cols, r0, r1)
            else:
                passes.comfy_mxfp8_quantize_rows(&codes[0, 0], &old[0, 0], &scales[0, 0], padded,
                                              &delta[0, 0], cols, r0, r1)


def comfy_int8_max(const int8_t[:, ::1] codes, const float[::1] scale, bint per_row,
                   const uint16_t[:, ::1] delta, int threads):
    """(max |f32(f32(code) * scale) + f32(delta)| over the tensor, the same per row); one
    scale, or one a row with ``per_row``."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], t, r0
    cdef float[::1] tops = task_tops(rows)
    row_tops = np.zeros(rows, np.float32)
    cdef float[::1] rt = row_tops
    if rows == 0:
        return 0.0, row_tops
    with nogil:
        for t in prange(row_tasks(rows), num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            tops[t] = passes.comfy_int8_max_rows(&codes[0, 0], &scale[0], per_row, &delta[0, 0],
                                              cols, r0, min(r0 + ROWS_PER_TASK, rows), &rt[0])
    return _max(tops), row_tops


def comfy_int8_quantize(int8_t[:, ::1] codes, const float[::1] scale,
                        const float[::1] new_scale, bint per_row, const uint16_t[:, ::1] delta,
                        int threads):
    """codes requantised in place with the new scale(s), one a row with ``per_row``."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], task, r0
    cdef Py_ssize_t tasks = row_tasks(rows)
    if rows == 0:
        return
    with nogil:
        for task in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = task * ROWS_PER_TASK
            passes.comfy_int8_quantize_rows(&codes[0, 0], &scale[0], &new_scale[0], per_row,
                                         &delta[0, 0], cols, r0, min(r0 + ROWS_PER_TASK, rows))


def fp8_values(bint e5m2):
    """The 256 values of an fp8 format's codes (f32)."""
    out = np.empty(256, np.float32)
    cdef float[::1] o = out
    cdef int c
    for c in range(256):
        o[c] = ltx_fp8_table(e5m2)[c]
    return out


def comfy_tiled_quantize_weight(const uint16_t[:, ::1] weight, uint8_t[:, ::1] codes,
                                uint8_t[:, ::1] scales, bint nvfp4, float t, int threads):
    """A bf16 weight quantised by ComfyUI's nvfp4 (with scale_2 ``t`` > 0; packed codes) or
    mxfp8 rule into ``codes`` and ``scales`` (padding zeroed)."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = weight.shape[0], cols = weight.shape[1], task, r0, r1
    cdef Py_ssize_t padded = scales.shape[1]
    cdef Py_ssize_t tasks = row_tasks(rows)
    scales[:, :] = 0
    if rows == 0 or cols == 0:
        return
    with nogil:
        for task in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = task * ROWS_PER_TASK
            r1 = min(r0 + ROWS_PER_TASK, rows)
            if nvfp4:
                passes.comfy_nvfp4_quantize_rows(&codes[0, 0], NULL, &scales[0, 0], padded,
                                                 0.0, &weight[0, 0], t, cols, r0, r1)
            else:
                passes.comfy_mxfp8_quantize_rows(&codes[0, 0], NULL, &scales[0, 0], padded,
                                                 &weight[0, 0], cols, r0, r1)


def bf16_absmax(const uint16_t[:, ::1] weight, bint per_row, int threads):
    """(max |w| over the finite bf16 weight, as f32; with ``per_row``, each row's as an f32
    array, else None)."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = weight.shape[0], cols = weight.shape[1], t, r0
    cdef Py_ssize_t tasks = row_tasks(rows)
    tops_bits = np.zeros(max(tasks, 1), np.uint16)
    rows_bits = np.zeros(max(rows, 1), np.uint16)
    cdef uint16_t[::1] tb = tops_bits, rb = rows_bits
    cdef uint16_t *row_top = &rb[0] if per_row else NULL
    if rows and cols:
        with nogil:
            for t in prange(tasks, num_threads=threads, schedule="dynamic"):
                r0 = t * ROWS_PER_TASK
                tb[t] = passes.bf16_absmax_rows(&weight[0, 0], cols, r0,
                                                min(r0 + ROWS_PER_TASK, rows), row_top)
    widen = lambda b: (b.astype(np.uint32) << 16).view(np.float32)
    top = widen(np.array([tops_bits.max()]))[0]
    return top, (widen(rows_bits[:rows]) if per_row else None)


def scaled_fp8_quantize(const uint16_t[::1] weight, uint8_t[::1] codes, float mult, float fmax,
                        bint e5m2, bint round_bf16, int threads):
    """codes = fp8(clamp(f32(w * mult), -fmax, fmax)) (the product rounded to bf16 first where
    ``round_bf16``); fp8(w) for an infinite mult."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t n = weight.shape[0], chunk = 1 << 16, tasks = (n + chunk - 1) // chunk, t, a
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            a = t * chunk
            passes.scaled_fp8_quantize(&weight[a], &codes[a], min(chunk, n - a), mult, fmax,
                                       e5m2, round_bf16)


def int8_quantize(const uint16_t[:, ::1] weight, int8_t[:, ::1] codes, const float[::1] scale,
                  bint per_row, int threads):
    """codes = clamp(rint(bf16(w / s)), -128, 127), s one bf16 value or one a row."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = weight.shape[0], cols = weight.shape[1], task, r0
    cdef Py_ssize_t tasks = row_tasks(rows)
    if rows == 0 or cols == 0:
        return
    with nogil:
        for task in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = task * ROWS_PER_TASK
            passes.int8_quantize_rows(&weight[0, 0], &codes[0, 0], &scale[0], per_row, cols, r0,
                                      min(r0 + ROWS_PER_TASK, rows))


def _max(float[::1] tops):
    cdef float top = 0.0
    cdef Py_ssize_t i
    for i in range(tops.shape[0]):
        top = fmax_nan(top, tops[i])
    return top


def dora_merge(const uint16_t[:, ::1] weight, uint16_t[:, ::1] delta, int norm_of, int threads):
    """delta = V = bf16(W + delta) in place; returns the f64 sums of squares DoRA's norms take:
    norm_of 0, V's rows; 1, W's rows; 2, V's columns."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = delta.shape[0], cols = delta.shape[1], t, r0, c0
    cdef Py_ssize_t tasks = row_tasks(rows)
    out = np.zeros(cols if norm_of == 2 else rows, np.float64)
    cdef double[::1] sq = out
    cdef Py_ssize_t col_tasks = (cols + 63) // 64
    if rows == 0 or cols == 0:
        return out
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            passes.dora_merge_rows(&weight[0, 0], &delta[0, 0], cols, r0,
                                min(r0 + ROWS_PER_TASK, rows), &sq[0] if norm_of == 0 else NULL)
            if norm_of == 1:
                passes.sum_squares_rows(&weight[0, 0], cols, r0, min(r0 + ROWS_PER_TASK, rows),
                                     &sq[0])
    if norm_of == 2:
        with nogil:
            for t in prange(col_tasks, num_threads=threads, schedule="dynamic"):
                c0 = t * 64
                passes.sum_squares_cols(&delta[0, 0], rows, cols, c0, min(c0 + 64, cols), &sq[0])
    return out


def dora_store(const uint16_t[:, ::1] v, const float[::1] factor, bint per_row,
               const uint16_t[:, ::1] weight, uint16_t[:, ::1] out, float strength, bint blend,
               int threads):
    """out = bf16(V * factor) (per row or per column), blended with the weight by strength."""
    cdef const ltx_layout_passes *passes = kernels(True).layout
    cdef Py_ssize_t rows = v.shape[0], cols = v.shape[1], t, r0
    cdef Py_ssize_t tasks = row_tasks(rows)
    if rows == 0 or cols == 0:
        return
    cdef const float *row_factor = &factor[0] if per_row else NULL
    cdef const float *col_factor = &factor[0] if not per_row else NULL
    with nogil:
        for t in prange(tasks, num_threads=threads, schedule="dynamic"):
            r0 = t * ROWS_PER_TASK
            passes.dora_store_rows(&v[0, 0], row_factor, col_factor, &weight[0, 0], &out[0, 0],
                                   cols, r0, min(r0 + ROWS_PER_TASK, rows), strength, blend)


def round_bf16(const float[::1] values):
    """bf16 bits of f32 values, nearest-even (NaN to the quiet NaN with its sign)."""
    out = np.empty(values.shape[0], np.uint16)
    cdef uint16_t[::1] o = out
    if values.shape[0]:
        with nogil:
            ltx_round_bf16(&values[0], &o[0], values.shape[0])
    return out


def stochastic_key(seed, str name):
    """The stochastic rounding's per-tensor key for ``seed`` (an int, taken modulo 2**64) and
    the tensor's ``name``."""
    cdef bytes raw = name.encode("utf-8")
    return ltx_stochastic_key(<uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF), raw, len(raw))
