"""Task driver of the Linear, y = x @ W^T + bias: bf16 weight panels widened a block at a time,
multiplied through the seam, with the GIL released.

The in-dimension is cut into segments (linear_layer.segments), and the output into blocks of
[task_rows rows of x] x [task_feats output features]; a task is one block of one segment.  It
starts from the bias (first segment) or +0.0, walks its segment in chunks of ``chunk`` features,
in order, adding every chunk's product into an accumulator (held transposed,
[task_feats, task_rows], the layout that makes the BLAS pack the weight panel cheaply).

The segments run a pass at a time, in order (linear_layer.segments_per_pass): a pass's tasks
write their segments' sums, and at its end each output block of y becomes y (or nothing, in the
first pass) plus the pass's sums, added in segment order; with one segment a pass the tasks add
their sums to y themselves.  Either way y is the segments' sums added in segment order, and
only one pass's sums and packed x exist at a time.  Every product's shape is fixed by the
blocks, the segments and the input's shape -- never by the thread count or the passes -- so
the bytes of y do not depend on how many threads ran or which ran what.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport uint16_t, uint32_t
from libc.stdlib cimport free, malloc

from ._gemm cimport (LTX_DOT_PANEL_SCRATCH, LTX_DOT_PANEL_STRIP,
                     PRODUCT_SGEMM, chunk_panel_bytes, chunk_wxt, dgemm_wxt, has_dot_products,
                     kernels, pack_x_pairs, packed_chunk_wxt, packs_strips, strip_at,
                     strip_stride, takes_bf16_x)
from ._kernels cimport ltx_kernels
from ._parallel cimport (add_segments, block_bounds, block_offset, ltx_aligned_alloc,
                        omp_get_thread_num, start_block, up64)

import numpy as np

# Elements of a row packed by one task of LinearPlan.pack_x: a multiple of 4, so that every
# piece starts a group of two pairs.
cdef enum:
    PACK_PIECE = 16384


cdef struct LinearJob:
    Py_ssize_t rows, cols, feats   # M, in, out
    const float *x32               # exactly one of x32 / x16 is set
    const uint16_t *x16
    const float *w32               # exactly one of w32 / w16 is set
    const uint16_t *w16
    const float *bias32            # f32 bias (widened), or NULL
    const double *bias64           # the same in f64, or NULL
    float *y
    void *partial                  # the pass's segments' sums (f32 or f64), rows x feats a
                                   # segment, the tasks' accumulators in place; or NULL (one
                                   # segment a pass)
    int task_rows, task_feats, chunk
    Py_ssize_t panels              # output-feature panels per row block
    Py_ssize_t blocks              # output blocks: tasks per segment
    Py_ssize_t segments, seg_len
    Py_ssize_t pass_segs           # segments a pass
    Py_ssize_t pass_cols           # in-features a pass: pass_segs * seg_len
    bint f64
    int product                    # chunk_wxt's product (PRODUCT_*); the streaming and panel
                                   # kernels take f32 x, the dot-product kernels bf16 x
    uint32_t *xs                   # with takes_packed_x: the pass's in-features of x packed
    Py_ssize_t xs_stride           # for the dot-product panel kernel (strips xs_stride
                                   # apart), or NULL
    const ltx_kernels *kern


def takes_packed_x(int product, int task_rows, int chunk, Py_ssize_t seg_len):
    """Whether a call packs its bf16 x once, a pass at a time, for the dot-product panel
    kernel, rather than every task packing its rows for every chunk (once per block of output
    features): where its tasks' rows start strips (packs_strips) and every chunk and pass
    starts a group of two pairs (kernels.h, pack_x_pairs). The bytes are the same."""
    return packs_strips(product, task_rows) and chunk % 4 == 0 and seg_len % 4 == 0


def packed_x_bytes(Py_ssize_t rows, Py_ssize_t cols):
    """Bytes of cols in-features of x packed for the dot-product panel kernel (see
    takes_packed_x)."""
    return ((rows + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP * strip_stride(cols)
            * sizeof(uint32_t))


cdef struct TaskBuffers:
    void *w_panel                  # [task_feats, chunk] widened weight (f32 or f64)
    void *x_panel                  # [task_rows, chunk] widened input (f32 or f64)
    void *acc                      # [task_feats, task_rows] accumulator: y's block,
                                   # transposed (f32 or f64)


cdef void linear_task(const LinearJob *job, Py_ssize_t task, TaskBuffers *buf) noexcept nogil:
    cdef Py_ssize_t seg = task // job.blocks, m0, o0
    cdef int mt, ot
    m0, o0, mt, ot = block_bounds(task % job.blocks, job.panels, job.task_rows, job.task_feats,
                                  job.rows, job.feats)
    cdef const ltx_kernels *kern = job.kern
    cdef Py_ssize_t first = seg * job.seg_len, end = min(job.cols, first + job.seg_len)
    cdef Py_ssize_t pass_first = seg // job.pass_segs * job.pass_cols
    cdef float *y = job.y + m0 * job.feats + o0
    cdef Py_ssize_t at = (seg % job.pass_segs) * job.rows * job.feats + block_offset(
        m0, o0, job.feats, mt)
    cdef Py_ssize_t c0, r, m
    cdef int kt
    # With several segments a pass the task accumulates in place, in its block of its
    # segment's sums.
    cdef float *acc32 = <float *>job.partial + at if job.partial != NULL else <float *>buf.acc
    cdef double *acc64 = <double *>job.partial + at if job.partial != NULL else <double *>buf.acc
    cdef const void *xp
    cdef int ldx
    cdef double *wp64 = <double *>buf.w_panel
    cdef double *xp64 = <double *>buf.x_panel

    if job.f64:
        start_block(acc64, job.bias64, o0, mt, ot, seg == 0)
    else:
        start_block(acc32, job.bias32, o0, mt, ot, seg == 0)

    c0 = first
    while c0 < end:
        kt = <int>min(<Py_ssize_t>job.chunk, end - c0)
        if job.f64:
            for r in range(ot):
                if job.w16 != NULL:
                    kern.widen_bf16_f64(job.w16 + (o0 + r) * job.cols + c0, wp64 + r * kt, kt)
                else:
                    kern.f32_to_f64(job.w32 + (o0 + r) * job.cols + c0, wp64 + r * kt, kt)
            for r in range(mt):
                if job.x16 != NULL:
                    kern.widen_bf16_f64(job.x16 + (m0 + r) * job.cols + c0, xp64 + r * kt, kt)
                else:
                    kern.f32_to_f64(job.x32 + (m0 + r) * job.cols + c0, xp64 + r * kt, kt)
            dgemm_wxt(ot, mt, kt, wp64, kt, xp64, kt, 1.0, acc64, mt)
        else:
            if job.xs != NULL:  # packed once, for the pass
                packed_chunk_wxt(kern, mt, ot, kt,
                                 strip_at(job.xs, job.xs_stride, m0, c0 - pass_first),
                                 job.xs_stride,
                                 job.w16 + o0 * job.cols + c0, <int>job.cols,
                                 <float *>buf.w_panel, acc32)
                c0 += kt
                continue
            if takes_bf16_x(job.product):  # bf16 x, read in place
                xp, ldx = job.x16 + m0 * job.cols + c0, <int>job.cols
            elif job.x16 != NULL:  # the sgemm route: widened a panel at a time
                kern.widen_bf16_rows(job.x16 + m0 * job.cols + c0, job.cols,
                                     <float *>buf.x_panel, kt, mt, kt)
                xp, ldx = buf.x_panel, kt
            else:
                xp, ldx = job.x32 + m0 * job.cols + c0, <int>job.cols
            chunk_wxt(kern, job.product, mt, ot, kt, xp, ldx,
                      job.w16 + o0 * job.cols + c0 if job.w16 != NULL else NULL,
                      job.w32 + o0 * job.cols + c0 if job.w32 != NULL else NULL,
                      <int>job.cols, <float *>buf.w_panel, acc32)
        c0 += kt

    if job.partial != NULL:  # end_pass() adds up the pass's segments
        return
    # One segment a pass: y holds the sum of the segments before this one (f32 only: an f64
    # accumulation takes every segment in one pass).
    for m in range(mt):
        for r in range(ot):
            if job.f64:
                y[m * job.feats + r] = <float>acc64[r * mt + m]
            elif seg == 0:
                y[m * job.feats + r] = acc32[r * mt + m]
            else:
                y[m * job.feats + r] = y[m * job.feats + r] + acc32[r * mt + m]


cdef void add_block_segments(const LinearJob *job, Py_ssize_t block,
                             Py_ssize_t pass_) noexcept nogil:
    """One output block of y at the end of a pass: the pass's segments' sums added in segment
    order, in the accumulation's type, onto y (after the first pass) or onto each other (in
    place, in the first segment's block), and written to y."""
    cdef Py_ssize_t m0, o0, r, m, s
    cdef int mt, ot
    m0, o0, mt, ot = block_bounds(block, job.panels, job.task_rows, job.task_feats, job.rows,
                                  job.feats)
    cdef Py_ssize_t at = block_offset(m0, o0, job.feats, mt), step = job.rows * job.feats
    cdef Py_ssize_t count = min(job.pass_segs, job.segments - pass_ * job.pass_segs)
    cdef float *p32 = <float *>job.partial + at
    cdef double *p64 = <double *>job.partial + at
    cdef float *y = job.y + m0 * job.feats + o0
    cdef float v
    if pass_ > 0:  # f32 only: an f64 accumulation takes every segment in one pass
        for m in range(mt):
            for r in range(ot):
                v = y[m * job.feats + r]
                for s in range(count):
                    v = v + p32[s * step + r * mt + m]
                y[m * job.feats + r] = v
        return
    if job.f64:
        add_segments(p64, step, count, <Py_ssize_t>mt * ot)
    else:
        add_segments(p32, step, count, <Py_ssize_t>mt * ot)
    for m in range(mt):
        for r in range(ot):
            y[m * job.feats + r] = <float>p64[r * mt + m] if job.f64 else p32[r * mt + m]


cdef (size_t, size_t, size_t) buffer_layout(int task_rows, int task_feats, int chunk, bint f64,
                                            int product, bint bf16_weight, bint bf16_x,
                                            bint packed_x) noexcept:
    """One thread's buffers: the widened weight panel [task_feats, chunk] (unless the weight is
    f32 and the accumulation f32; on the kernels' routes, their scratch instead, without x's
    packing where x is packed once), the widened input panel [task_rows, chunk] (f64, or bf16
    x on the sgemm route), and the accumulator [task_feats, task_rows]."""
    cdef size_t elem = sizeof(double) if f64 else sizeof(float)
    cdef size_t w_len = 0, x_len = 0
    if f64:
        w_len = up64(<size_t>task_feats * chunk * elem)
    elif packed_x:
        w_len = up64(LTX_DOT_PANEL_SCRATCH(task_rows) * sizeof(float))
    elif product != PRODUCT_SGEMM or bf16_weight:
        w_len = chunk_panel_bytes(product, task_rows, task_feats, chunk)
    if f64 or (bf16_x and product == PRODUCT_SGEMM):  # the kernels read x in place
        x_len = up64(<size_t>task_rows * chunk * elem)
    return w_len, x_len, up64(<size_t>task_rows * task_feats * elem)


def thread_buffer_bytes(int task_rows, int task_feats, int chunk, bint f64, int product,
                        bint bf16_weight, bint bf16_x, bint packed_x=False):
    """Bytes of one thread's buffers, as LinearPlan allocates them (product: a value of
    ``_gemm.PRODUCTS``; packed_x: takes_packed_x)."""
    w_len, x_len, acc_len = buffer_layout(task_rows, task_feats, chunk, f64, product,
                                          bf16_weight, bf16_x, packed_x)
    return w_len + x_len + acc_len


cdef void bf16_or_f32(a, const uint16_t **bf16, const float **f32):
    """Points *bf16 at a C-contiguous bf16 (uint16) matrix's first element, or *f32 at an f32
    one's; the other is NULL."""
    cdef const uint16_t[:, ::1] a16
    cdef const float[:, ::1] a32
    bf16[0], f32[0] = NULL, NULL
    if a.dtype.itemsize == 2:
        a16 = a
        bf16[0] = &a16[0, 0]
    else:
        a32 = a
        f32[0] = &a32[0, 0]


cdef class LinearPlan:
    """The arrays, block sizes and per-thread buffers of one linear() call; run(first, stop)
    computes tasks [first, stop) in parallel and can be called wave after wave, in order
    (progress, interrupts), with the same result as one call for all."""
    cdef LinearJob job
    cdef TaskBuffers *per_thread
    cdef char *buffers
    cdef Py_ssize_t packed_pass    # the pass whose x job.xs (the caller's array) holds, or -1
    cdef int threads
    cdef readonly Py_ssize_t tasks
    cdef object keep

    def __init__(self, x, w, bias32, bias64, float[:, ::1] y, int task_rows, int task_feats,
                 int chunk, int threads, bint f64, int product, Py_ssize_t seg_len,
                 Py_ssize_t pass_segs, partial, packed=None):
        cdef const float[::1] b32
        cdef const double[::1] b64
        cdef size_t w_len, x_len, acc_len, buffer_len
        cdef int s
        self.keep = (x, w, bias32, bias64, y, partial, packed)
        self.job.rows, self.job.cols = x.shape[0], x.shape[1]
        self.job.feats = w.shape[0]
        bf16_or_f32(x, &self.job.x16, &self.job.x32)
        bf16_or_f32(w, &self.job.w16, &self.job.w32)
        self.job.bias32 = NULL
        self.job.bias64 = NULL
        if bias32 is not None:
            b32 = bias32
            self.job.bias32 = &b32[0]
        if bias64 is not None:
            b64 = bias64
            self.job.bias64 = &b64[0]
        self.job.y = &y[0, 0]
        self.job.partial = NULL
        self.job.seg_len = seg_len
        self.job.segments = (self.job.cols + seg_len - 1) // seg_len
        if not 1 <= pass_segs <= self.job.segments or (f64 and pass_segs != self.job.segments):
            raise ValueError("a pass takes 1 to every segment (every one where f64)")
        self.job.pass_segs, self.job.pass_cols = pass_segs, pass_segs * seg_len
        if partial is not None:
            if partial.shape != (pass_segs, self.job.rows, self.job.feats) or pass_segs < 2 or \
                    partial.dtype != (np.float64 if f64 else np.float32) or \
                    not partial.flags.c_contiguous:
                raise ValueError("partial must be C-contiguous [segments a pass (2 or more), "
                                 "rows, feats] in the accumulation's type (its blocks packed, "
                                 "not row-major)")
            self.job.partial = <void *><size_t>partial.ctypes.data
        elif pass_segs > 1:
            raise ValueError("several segments a pass need their partial sums' array")
        self.job.task_rows, self.job.task_feats, self.job.chunk = task_rows, task_feats, chunk
        self.job.panels = (self.job.feats + task_feats - 1) // task_feats
        self.job.f64 = f64
        self.job.product = product if (not f64 and self.job.w16 != NULL) else PRODUCT_SGEMM
        self.job.kern = kernels(True)
        if takes_bf16_x(self.job.product):
            if self.job.x16 == NULL or not has_dot_products(self.job.kern):
                raise ValueError("the dot-product route takes a bf16 x, on a table with the "
                                 "dot-product kernel")
        elif self.job.product != PRODUCT_SGEMM and self.job.x16 != NULL:
            raise ValueError("the kernels' routes take an f32 x: widen a bf16 x once, before")
        self.job.blocks = block_count(self.job.rows, self.job.feats, task_rows, task_feats)
        self.tasks = self.job.blocks * self.job.segments
        self.threads = threads
        self.job.xs = NULL
        self.packed_pass = -1
        cdef bint packed_x = takes_packed_x(self.job.product, task_rows, chunk, seg_len)
        cdef Py_ssize_t pass_width = min(self.job.cols, self.job.pass_cols)
        if packed_x:
            # A numpy array: numpy asks the kernel for huge pages, without which first touching
            # a fresh buffer this size took longer than packing it.
            if packed is None or packed.dtype != np.uint32 or not packed.flags.c_contiguous or \
                    packed.nbytes != packed_x_bytes(self.job.rows, pass_width):
                raise ValueError("this product packs x a pass at a time: packed must be a "
                                 "C-contiguous uint32 array of packed_x_bytes(rows, "
                                 "min(cols, pass_segs * seg_len)) bytes")
            self.job.xs_stride = strip_stride(pass_width)
            self.job.xs = <uint32_t *><size_t>packed.ctypes.data

        w_len, x_len, acc_len = buffer_layout(task_rows, task_feats, chunk, f64, self.job.product,
                                              self.job.w16 != NULL, self.job.x16 != NULL,
                                              packed_x)
        buffer_len = w_len + x_len + acc_len
        self.buffers = <char *>ltx_aligned_alloc(buffer_len * threads)
        self.per_thread = <TaskBuffers *>malloc(threads * sizeof(TaskBuffers))
        if self.buffers == NULL or self.per_thread == NULL:
            raise MemoryError(f"could not allocate {buffer_len * threads} bytes of panel buffers")
        for s in range(threads):
            self.per_thread[s].w_panel = self.buffers + buffer_len * s
            self.per_thread[s].x_panel = self.buffers + buffer_len * s + w_len
            self.per_thread[s].acc = self.buffers + buffer_len * s + w_len + x_len

    def __dealloc__(self):
        free(self.buffers)
        free(self.per_thread)

    cdef void pack_pass(self, Py_ssize_t pass_) noexcept nogil:
        """The pass's in-features of x into job.xs, a strip and PACK_PIECE elements at a time,
        in parallel."""
        cdef Py_ssize_t first = pass_ * self.job.pass_cols
        cdef Py_ssize_t width = min(self.job.cols - first, self.job.pass_cols)
        cdef Py_ssize_t strips = (self.job.rows + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP
        cdef Py_ssize_t pieces = (width + PACK_PIECE - 1) // PACK_PIECE, p, s, k0
        cdef int threads = <int>min(<Py_ssize_t>self.threads, strips * pieces)
        for p in prange(strips * pieces, num_threads=threads, schedule="dynamic"):
            s, k0 = p // pieces, (p % pieces) * PACK_PIECE
            pack_x_pairs(self.job.kern,
                         min(<Py_ssize_t>LTX_DOT_PANEL_STRIP,
                             self.job.rows - s * LTX_DOT_PANEL_STRIP),
                         min(<Py_ssize_t>PACK_PIECE, width - k0),
                         self.job.x16 + s * LTX_DOT_PANEL_STRIP * self.job.cols + first + k0,
                         self.job.cols,
                         strip_at(self.job.xs, self.job.xs_stride, s * LTX_DOT_PANEL_STRIP, k0),
                         self.job.xs_stride)

    cdef void end_pass(self, Py_ssize_t pass_) noexcept nogil:
        """The pass's segments' sums added onto y, an output block a task, in parallel."""
        cdef Py_ssize_t b
        cdef int threads = <int>min(<Py_ssize_t>self.threads, self.job.blocks)
        for b in prange(self.job.blocks, num_threads=threads, schedule="dynamic"):
            add_block_segments(&self.job, b, pass_)

    def run(self, Py_ssize_t first, Py_ssize_t stop):
        """Tasks [first, stop), after every task before first: a pass at a time, its x packed
        before its first task and its sums added onto y after its last."""
        cdef Py_ssize_t t, pass_, end, pass_end
        cdef Py_ssize_t per_pass = self.job.blocks * self.job.pass_segs
        cdef int threads
        stop = min(stop, self.tasks)
        with nogil:
            while first < stop:
                pass_ = first // per_pass
                pass_end = min(self.tasks, (pass_ + 1) * per_pass)
                end = min(stop, pass_end)
                if self.job.xs != NULL and self.packed_pass != pass_:
                    self.pack_pass(pass_)
                    self.packed_pass = pass_
                threads = <int>min(<Py_ssize_t>self.threads, end - first)
                with parallel(num_threads=threads):
                    for t in prange(first, end, schedule="dynamic"):
                        linear_task(&self.job, t, &self.per_thread[omp_get_thread_num()])
                if end == pass_end and self.job.partial != NULL:
                    self.end_pass(pass_)
                first = end


def block_count(Py_ssize_t rows, Py_ssize_t feats, Py_ssize_t task_rows, Py_ssize_t task_feats):
    """How many blocks these task blocks cut the output of a Linear of ``rows`` rows of x and
    ``feats`` output features into: its tasks per segment."""
    return (rows + task_rows - 1) // task_rows * ((feats + task_feats - 1) // task_feats)
