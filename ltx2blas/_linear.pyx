"""Task driver of the Linear, y = x @ W^T + bias: bf16 weight panels widened a block at a time,
multiplied through the seam, with the GIL released.

The output is cut into tasks of [mb rows of x] x [ob output features]; each task starts from
the bias and walks the in-dimension in chunks of kb, in order, adding every chunk's product
into an accumulator (held transposed, [ob, mb], the layout that makes the BLAS pack the weight
panel cheaply), then writes its block of y.
Every sgemm call's shape is fixed by (mb, ob, kb) and the input's shape -- never by the thread
count -- so the bytes of y do not depend on how many threads ran or which ran what.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport uint16_t
from libc.stdlib cimport free, malloc

from ._gemm cimport (LTX_STREAM_LANES, dgemm_wxt, kernels, ltx_kernels, sgemm_wxt,
                     stream_product)
from ._parallel cimport ltx_aligned_alloc, omp_get_thread_num


cdef struct Job:
    Py_ssize_t rows, cols, feats   # M, in, out
    const float *x32               # exactly one of x32 / x16 is set
    const uint16_t *x16
    const float *w32               # exactly one of w32 / w16 is set
    const uint16_t *w16
    const float *bias32            # f32 bias (widened), or NULL
    const double *bias64           # the same in f64, or NULL
    float *y
    int mb, ob, kb
    Py_ssize_t panels              # output-feature panels per row block
    bint f64
    bint stream                    # few rows, bf16 weight, f32 x: the streaming kernel
    const ltx_kernels *kern


cdef struct Slot:
    void *w_panel                  # [ob, kb] widened weight (f32 or f64)
    void *x_panel                  # [mb, kb] widened input (f32 or f64)
    void *acc                      # [ob, mb] accumulator, y's block transposed (f32 or f64)


cdef void linear_task(const Job *job, Py_ssize_t task, Slot *slot) noexcept nogil:
    cdef Py_ssize_t mi = task // job.panels, oi = task % job.panels
    cdef Py_ssize_t m0 = mi * job.mb, o0 = oi * job.ob
    cdef int mt = <int>min(<Py_ssize_t>job.mb, job.rows - m0)
    cdef int ot = <int>min(<Py_ssize_t>job.ob, job.feats - o0)
    cdef const ltx_kernels *kern = job.kern
    cdef Py_ssize_t c0, r, m
    cdef int kt
    cdef float *y = job.y + m0 * job.feats + o0
    cdef float *acc32 = <float *>slot.acc
    cdef double *acc64 = <double *>slot.acc
    cdef const float *wp32
    cdef const float *xp32
    cdef int ldw, ldx
    cdef double *wp64 = <double *>slot.w_panel
    cdef double *xp64 = <double *>slot.x_panel

    for r in range(ot):
        for m in range(mt):
            if job.f64:
                acc64[r * mt + m] = job.bias64[o0 + r] if job.bias64 != NULL else 0.0
            else:
                acc32[r * mt + m] = job.bias32[o0 + r] if job.bias32 != NULL else 0.0

    c0 = 0
    while c0 < job.cols:
        kt = <int>min(<Py_ssize_t>job.kb, job.cols - c0)
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
            dgemm_wxt(mt, ot, kt, xp64, kt, wp64, kt, 1.0, acc64, mt)
        elif job.stream:
            stream_product(kern, mt, ot, kt, job.x32 + m0 * job.cols + c0, job.cols,
                           job.w16 + o0 * job.cols + c0, job.cols, acc32, <float *>slot.w_panel)
        else:
            if job.w16 != NULL:
                kern.widen_bf16_rows(job.w16 + o0 * job.cols + c0, job.cols,
                                     <float *>slot.w_panel, kt, ot, kt)
                wp32, ldw = <float *>slot.w_panel, kt
            else:
                wp32, ldw = job.w32 + o0 * job.cols + c0, <int>job.cols
            if job.x16 != NULL:
                kern.widen_bf16_rows(job.x16 + m0 * job.cols + c0, job.cols,
                                     <float *>slot.x_panel, kt, mt, kt)
                xp32, ldx = <float *>slot.x_panel, kt
            else:
                xp32, ldx = job.x32 + m0 * job.cols + c0, <int>job.cols
            sgemm_wxt(mt, ot, kt, xp32, ldx, wp32, ldw, 1.0, acc32, mt)
        c0 += kt

    for m in range(mt):
        for r in range(ot):
            if job.f64:
                y[m * job.feats + r] = <float>acc64[r * mt + m]
            else:
                y[m * job.feats + r] = acc32[r * mt + m]


cdef inline size_t up64(size_t n) noexcept nogil:
    return (n + 63) & ~(<size_t>63)


cdef (size_t, size_t, size_t) buffer_layout(int mb, int ob, int kb, bint f64, bint stream,
                                            bint bf16_weight, bint bf16_x) noexcept:
    """One thread's buffers: the widened weight panel [ob, kb] (unless the weight is f32 and
    the accumulation f32; on the streaming route, the kernel's lane sums instead), the widened
    input panel [mb, kb] (unless likewise), and the accumulator [ob, mb]."""
    cdef size_t elem = sizeof(double) if f64 else sizeof(float)
    cdef size_t w_len = 0, x_len = 0
    if stream:
        w_len = <size_t>ob * mb * LTX_STREAM_LANES * sizeof(float)
    elif f64 or bf16_weight:
        w_len = up64(<size_t>ob * kb * elem)
    if f64 or bf16_x:
        x_len = up64(<size_t>mb * kb * elem)
    return w_len, x_len, up64(<size_t>mb * ob * elem)


def thread_buffer_bytes(int mb, int ob, int kb, bint f64, bint stream, bint bf16_weight,
                        bint bf16_x):
    """Bytes of one thread's buffers, as LinearPlan allocates them."""
    w_len, x_len, acc_len = buffer_layout(mb, ob, kb, f64, stream, bf16_weight, bf16_x)
    return w_len + x_len + acc_len


cdef class LinearPlan:
    """The arrays, block sizes and per-thread buffers of one linear() call; run(first, stop)
    computes tasks [first, stop) in parallel and can be called wave after wave (progress,
    interrupts) with the same result as one call for all."""
    cdef Job job
    cdef Slot *slots
    cdef char *buffers
    cdef int threads
    cdef readonly Py_ssize_t tasks
    cdef object keep

    def __cinit__(self):
        self.slots = NULL
        self.buffers = NULL

    def __init__(self, x, w, bias32, bias64, float[:, ::1] y, int mb, int ob, int kb,
                 int threads, bint f64, bint stream):
        cdef const float[:, ::1] x32
        cdef const uint16_t[:, ::1] x16
        cdef const float[:, ::1] w32
        cdef const uint16_t[:, ::1] w16
        cdef const float[::1] b32
        cdef const double[::1] b64
        cdef size_t w_len, x_len, acc_len, slot_len
        cdef int s
        self.keep = (x, w, bias32, bias64, y)
        self.job.rows, self.job.cols = x.shape[0], x.shape[1]
        self.job.feats = w.shape[0]
        self.job.x32 = NULL
        self.job.x16 = NULL
        self.job.w32 = NULL
        self.job.w16 = NULL
        self.job.bias32 = NULL
        self.job.bias64 = NULL
        if x.dtype.itemsize == 2:
            x16 = x
            self.job.x16 = &x16[0, 0]
        else:
            x32 = x
            self.job.x32 = &x32[0, 0]
        if w.dtype.itemsize == 2:
            w16 = w
            self.job.w16 = &w16[0, 0]
        else:
            w32 = w
            self.job.w32 = &w32[0, 0]
        if bias32 is not None:
            b32 = bias32
            self.job.bias32 = &b32[0]
        if bias64 is not None:
            b64 = bias64
            self.job.bias64 = &b64[0]
        self.job.y = &y[0, 0]
        self.job.mb, self.job.ob, self.job.kb = mb, ob, kb
        self.job.panels = (self.job.feats + ob - 1) // ob
        self.job.f64 = f64
        self.job.stream = stream and not f64 and self.job.w16 != NULL
        if self.job.stream and self.job.x16 != NULL:
            raise ValueError("the streaming route takes an f32 x: widen a bf16 x once, before")
        self.job.kern = kernels(True)
        self.tasks = (self.job.rows + mb - 1) // mb * self.job.panels
        self.threads = threads

        w_len, x_len, acc_len = buffer_layout(mb, ob, kb, f64, self.job.stream,
                                              self.job.w16 != NULL, self.job.x16 != NULL)
        slot_len = w_len + x_len + acc_len
        self.buffers = <char *>ltx_aligned_alloc(slot_len * threads)
        self.slots = <Slot *>malloc(threads * sizeof(Slot))
        if self.buffers == NULL or self.slots == NULL:
            raise MemoryError(f"could not allocate {slot_len * threads} bytes of panel buffers")
        for s in range(threads):
            self.slots[s].w_panel = self.buffers + slot_len * s
            self.slots[s].x_panel = self.buffers + slot_len * s + w_len
            self.slots[s].acc = self.buffers + slot_len * s + w_len + x_len

    def __dealloc__(self):
        free(self.buffers)
        free(self.slots)

    def run(self, Py_ssize_t first, Py_ssize_t stop):
        cdef Py_ssize_t t
        cdef int threads = <int>min(<Py_ssize_t>self.threads, stop - first)
        if threads < 1:
            return
        with nogil, parallel(num_threads=threads):
            for t in prange(first, stop, schedule="dynamic"):
                linear_task(&self.job, t, &self.slots[omp_get_thread_num()])
