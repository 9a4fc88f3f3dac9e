"""Driver of the text feature extractor: per-row statistics, then normalisation a step at a
time (a few chunks of every segment of the in-dimension) straight into each projection's GEMM
panels.

Each projection's in-dimension is cut into segments as ltx2blas.linear cuts it; the panels are
laid out as linear lays out its widened input panels (rows packed, row stride = the chunk's
width), or for the dot-product panel kernel in its strips of pairs, chunk by chunk; every task
adds its segment's chunks with the same products in the same order from the same start, and finish() adds the segments' sums in the same order, so a projection's result is
byte-identical to ``linear(features, weight, bias)`` on the same features -- without the
features ever existing whole.
"""
from cython.parallel cimport parallel, prange
from libc.math cimport NAN, isnan
from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc

from ._gemm cimport (LTX_DOT_PANEL_PAIRS, LTX_DOT_PANEL_SCRATCH, LTX_DOT_PANEL_STRIP,
                     LTX_LAYER_TABLE_PAD, chunk_panel_bytes, chunk_wxt, kernels, pack_x_pairs,
                     packed_chunk_wxt, packs_strips, strip_at, strip_stride, takes_bf16_x)
from ._kernels cimport ltx_kernels
from ._parallel cimport (add_segments, block_bounds, block_offset, ltx_aligned_alloc,
                        omp_get_thread_num, start_block, up64)

import numpy as np


cdef extern from "kernels.h" nogil:
    float ltx_bf16_value(uint16_t h)


cdef inline float load(const void *src, bint bf16, Py_ssize_t i) noexcept nogil:
    if bf16:
        return ltx_bf16_value((<const uint16_t *>src)[i])
    return (<const float *>src)[i]


def row_stats(hidden, const int64_t[::1] rows, int layers, double[:, ::1] sums,
              double[:, ::1] squares, float[:, ::1] lows, float[:, ::1] highs, int threads):
    """For each listed row of ``hidden`` ([rows, D * L], bf16 bits or f32): per layer, the sum
    and the sum of squares over d in order from 0.0 (f64), and the min and max (NaN wins)."""
    cdef bint bf16 = hidden.dtype.itemsize == 2
    cdef const uint16_t[:, ::1] h16
    cdef const float[:, ::1] h32
    cdef const void *base
    cdef Py_ssize_t width = hidden.shape[1], n = rows.shape[0], r, d, l, depth = width // layers
    cdef const void *row
    cdef double v
    cdef float f
    if bf16:
        h16 = hidden
        base = &h16[0, 0]
    else:
        h32 = hidden
        base = &h32[0, 0]
    with nogil:
        # a row at a time to whichever thread is free: cores of unequal speed share it evenly
        for r in prange(n, num_threads=threads, schedule="dynamic"):
            row = <const char *>base + rows[r] * width * (2 if bf16 else 4)
            for l in range(layers):
                sums[r, l] = 0.0
                squares[r, l] = 0.0
                lows[r, l] = load(row, bf16, l)
                highs[r, l] = lows[r, l]
            for d in range(depth):
                for l in range(layers):
                    f = load(row, bf16, d * layers + l)
                    v = f
                    sums[r, l] = sums[r, l] + v
                    squares[r, l] = squares[r, l] + v * v
                    if isnan(f) or isnan(lows[r, l]):
                        lows[r, l] = NAN
                        highs[r, l] = NAN
                    else:
                        if f < lows[r, l]:
                            lows[r, l] = f
                        if f > highs[r, l]:
                            highs[r, l] = f


cdef struct Projection:
    const uint16_t *w16       # [out, F] bf16, or
    const float *w32          # [out, F] f32
    const float *bias         # [out] f32 or NULL
    float *acc                # [segments, n, out]: each task's transposed accumulator, packed
    float *x                  # this projection's panels of the current step: f32, or with
                              # bf16_panels bf16 bits (the features are bf16)
    float scale               # V2: sqrt(out / D) as f32; V1: unused
    Py_ssize_t out, panels, blocks, first_task
    Py_ssize_t segments, seg_len
    int step_chunks           # chunks of every segment a step normalises and adds
    Py_ssize_t slot_len       # elements of one chunk's panel (slot)


cdef struct FeatureJob:
    const void *hidden        # [B * T, F]
    bint bf16
    Py_ssize_t width          # F = D * L
    int layers
    const int64_t *rows       # valid rows (indices into hidden), in order
    const int64_t *sample     # the sample each valid row belongs to
    Py_ssize_t n              # number of valid rows
    bint v2
    const float *mean         # V1: [B, L + LTX_LAYER_TABLE_PAD]
    const float *range_       # V1: [B, L + LTX_LAYER_TABLE_PAD]
    const float *inv          # V2: [n, L + LTX_LAYER_TABLE_PAD]
    Py_ssize_t table_stride   # L + LTX_LAYER_TABLE_PAD: each table's first values again past L
    int count                 # projections
    Projection *proj
    int task_rows, task_feats, chunk
    Py_ssize_t row_blocks
    int product               # chunk_wxt's product (PRODUCT_*)
    bint bf16_panels          # the product takes bf16 x: the panels hold bf16 bits
    bint strip_panels         # ... in the dot-product panel kernel's strips (packs_strips)
    const ltx_kernels *kern


def panel_elements(int product, int task_rows, Py_ssize_t n, Py_ssize_t segments,
                   int step_chunks, int chunk, Py_ssize_t seg_len):
    """f32 elements of one projection's panels: a step's chunks of every segment, each
    [n rows, min(chunk, seg_len)] -- f32, or bf16 two to an element where the product takes
    bf16 x, in strips of pairs (rows rounded up to whole strips) where packs_strips."""
    return segments * step_chunks * slot_elements(product, task_rows, n, min(chunk, seg_len))


cdef Py_ssize_t slot_elements(int product, int task_rows, Py_ssize_t n,
                              Py_ssize_t width) noexcept:
    """f32 elements of a chunk's panel of n rows, width features wide (see panel_elements)."""
    if packs_strips(product, task_rows):
        return ((n + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP * LTX_DOT_PANEL_STRIP
                * LTX_DOT_PANEL_PAIRS(width))
    if takes_bf16_x(product):
        return (n * width + 1) // 2
    return n * width


cdef inline void step_range(const FeatureJob *job, const Projection *pr, Py_ssize_t seg,
                            Py_ssize_t step, Py_ssize_t *s0, Py_ssize_t *s1) noexcept nogil:
    """The features [s0, s1) of segment ``seg`` that step ``step`` takes (empty past its end)."""
    cdef Py_ssize_t first = seg * pr.seg_len
    cdef Py_ssize_t end = min(job.width, first + pr.seg_len)
    s0[0] = min(end, first + step * pr.step_chunks * job.chunk)
    s1[0] = min(end, s0[0] + pr.step_chunks * job.chunk)


cdef inline Py_ssize_t slot(const FeatureJob *job, const Projection *pr, Py_ssize_t seg,
                            Py_ssize_t c) noexcept nogil:
    """Where chunk c of segment ``seg``'s piece starts in the projection's panels, in panel
    elements (bf16 ones with bf16_panels): pieces one after another, each chunk's rows packed
    (row r at r * its width), as linear() packs them, or in strips of pairs."""
    return (seg * pr.step_chunks + c) * pr.slot_len * (2 if job.bf16_panels else 1)


cdef void normalize_piece(const FeatureJob *job, const Projection *pr, Py_ssize_t r,
                          Py_ssize_t c0, int kt, void *dst) noexcept nogil:
    """Row r's features [c0, c0 + kt) for projection pr into dst, one after another: bf16 bits
    with bf16_panels, else f32."""
    cdef const char *row = (<const char *>job.hidden
                            + (job.rows[r] * job.width + c0) * (2 if job.bf16 else 4))
    cdef Py_ssize_t at = (r if job.v2 else job.sample[r]) * job.table_stride
    if job.v2:
        job.kern.normalize_features(row, job.bf16, kt, job.inv + at, NULL, c0 % job.layers,
                                    job.layers, pr.scale, dst, job.bf16_panels)
    else:
        job.kern.normalize_features(row, job.bf16, kt, job.mean + at, job.range_ + at,
                                    c0 % job.layers, job.layers, 1.0, dst, job.bf16_panels)


cdef void normalize_rows(const FeatureJob *job, Py_ssize_t r0, Py_ssize_t r1, Py_ssize_t step,
                         uint16_t *strip_rows) noexcept nogil:
    """Rows [r0, r1)'s features of this step into every projection's panels (see
    normalize_segment)."""
    cdef int p
    cdef Py_ssize_t seg
    for p in range(job.count):
        for seg in range(job.proj[p].segments):
            normalize_segment(job, r0, r1, step, strip_rows, p, seg)


cdef Py_ssize_t segment_count(const FeatureJob *job) noexcept nogil:
    """Segments of all the projections: the pieces a strip's normalisation is cut into."""
    cdef Py_ssize_t total = 0
    cdef int p
    for p in range(job.count):
        total += job.proj[p].segments
    return total


cdef void normalize_segment(const FeatureJob *job, Py_ssize_t r0, Py_ssize_t r1,
                            Py_ssize_t step, uint16_t *strip_rows, int p,
                            Py_ssize_t seg) noexcept nogil:
    """Rows [r0, r1)'s features of this step in one segment of projection p into its panels:
    rows packed, or, with strip_panels, rows [r0, r1) being one strip, each chunk of them
    normalised into strip_rows (a strip's rows of a chunk) and then packed by the kernel's
    transposes (a feature at a time straight into the strip would touch a line for every
    two)."""
    cdef Py_ssize_t c0, s0, s1, c, r, at
    cdef int kt
    cdef Projection *pr = &job.proj[p]
    step_range(job, pr, seg, step, &s0, &s1)
    c0, c = s0, 0
    while c0 < s1:
        kt = <int>min(<Py_ssize_t>job.chunk, s1 - c0)
        at = slot(job, pr, seg, c)
        for r in range(r0, r1):
            if job.strip_panels:
                normalize_piece(job, pr, r, c0, kt, strip_rows + (r - r0) * kt)
            elif job.bf16_panels:
                normalize_piece(job, pr, r, c0, kt, <uint16_t *>pr.x + at + r * kt)
            else:
                normalize_piece(job, pr, r, c0, kt, pr.x + at + r * kt)
        if job.strip_panels:
            pack_x_pairs(job.kern, r1 - r0, kt, strip_rows, kt,
                         strip_at(<uint32_t *>(<uint16_t *>pr.x + at),
                                  strip_stride(kt), r0, 0), strip_stride(kt))
        c0 += kt
        c += 1


cdef inline Py_ssize_t acc_at(const FeatureJob *job, const Projection *pr, Py_ssize_t seg,
                              Py_ssize_t m0, Py_ssize_t o0, int mt) noexcept nogil:
    """The offset of a task's accumulator [ot, mt], laid out as linear() lays out its segments'
    sums."""
    return seg * job.n * pr.out + block_offset(m0, o0, pr.out, mt)


cdef void run_task(const FeatureJob *job, Py_ssize_t task, Py_ssize_t step,
                   float *panel) noexcept nogil:
    """One task's (rows x features of one segment) accumulation over this step's chunks."""
    cdef int p = 0
    while p + 1 < job.count and task >= job.proj[p + 1].first_task:
        p += 1
    cdef Projection *pr = &job.proj[p]
    cdef Py_ssize_t local = task - pr.first_task
    cdef Py_ssize_t seg = local // pr.blocks, m0, o0
    cdef int mt, ot
    m0, o0, mt, ot = block_bounds(local % pr.blocks, pr.panels, job.task_rows, job.task_feats,
                                  job.n, pr.out)
    cdef float *acc = pr.acc + acc_at(job, pr, seg, m0, o0, mt)
    cdef Py_ssize_t c0, s0, s1, c = 0
    cdef int kt
    cdef const void *xp
    if step == 0:  # every segment has a chunk in the first step
        start_block(acc, pr.bias, o0, mt, ot, seg == 0)
    step_range(job, pr, seg, step, &s0, &s1)
    c0 = s0
    while c0 < s1:
        kt = <int>min(<Py_ssize_t>job.chunk, s1 - c0)
        if job.strip_panels:
            packed_chunk_wxt(job.kern, mt, ot, kt,
                             strip_at(<uint32_t *>(<uint16_t *>pr.x + slot(job, pr, seg, c)),
                                      strip_stride(kt), m0, 0), strip_stride(kt),
                             pr.w16 + o0 * job.width + c0, <int>job.width, panel, acc)
            c0 += kt
            c += 1
            continue
        if job.bf16_panels:
            xp = <uint16_t *>pr.x + slot(job, pr, seg, c) + m0 * kt
        else:
            xp = pr.x + slot(job, pr, seg, c) + m0 * kt
        chunk_wxt(job.kern, job.product, mt, ot, kt, xp, kt,
                  pr.w16 + o0 * job.width + c0 if pr.w16 != NULL else NULL,
                  pr.w32 + o0 * job.width + c0 if pr.w32 != NULL else NULL,
                  <int>job.width, panel, acc)
        c0 += kt
        c += 1


def padded_by_layer(table):
    """A per-layer table [rows, L] with LTX_LAYER_TABLE_PAD columns more, the first ones again
    (column i holds column i mod L): the layout normalize_features reads; None stays None."""
    if table is None:
        return None
    layers = table.shape[1]
    wrap = (layers + np.arange(LTX_LAYER_TABLE_PAD)) % layers
    return np.ascontiguousarray(np.concatenate([table, table[:, wrap]], axis=1), np.float32)


cdef class FeaturePlan:
    """One text_features call: normalize(step) writes a step's features (a whole number of
    chunks of every segment) into the panels, run(step, first, stop) adds them into tasks'
    accumulators; finish(outputs) adds up the segments and scatters the results to their
    tokens."""
    cdef FeatureJob job
    cdef Projection *proj
    cdef char *panels
    cdef size_t panel_len
    cdef char *rows_bf16           # per thread with strip_panels: a strip's rows of a chunk
    cdef size_t rows_len
    cdef int threads
    cdef readonly Py_ssize_t tasks
    cdef object keep

    def __init__(self, hidden, const int64_t[::1] rows, const int64_t[::1] sample, bint v2,
                 mean, range_, inv, list weights, list biases, list accs, list xs, list scales,
                 list cuts, int task_rows, int task_feats, int chunk, int product, int threads,
                 int layers):
        """``cuts``: each projection's (segments, segment length, chunks a step); ``accs``:
        [segments * n * out] f32; ``xs``: the panels, f32 arrays of panel_elements(...) each."""
        cdef const uint16_t[:, ::1] h16
        cdef const float[:, ::1] h32
        cdef const uint16_t[:, ::1] w16
        cdef const float[:, ::1] w32
        cdef const float[::1] b32
        cdef float[::1] acc
        cdef float[::1] x
        cdef const float[:, ::1] st
        cdef int p, count = len(weights)
        cdef Py_ssize_t first = 0, needed
        mean, range_, inv = (padded_by_layer(t) for t in (mean, range_, inv))
        self.keep = [hidden, rows, sample, mean, range_, inv, weights, biases, accs, xs]
        self.job.bf16 = hidden.dtype.itemsize == 2
        if self.job.bf16:
            h16 = hidden
            self.job.hidden = &h16[0, 0]
        else:
            h32 = hidden
            self.job.hidden = &h32[0, 0]
        self.job.width = hidden.shape[1]
        self.job.layers = layers
        self.job.table_stride = layers + LTX_LAYER_TABLE_PAD
        self.job.rows = &rows[0]
        self.job.sample = &sample[0]
        self.job.n = rows.shape[0]
        self.job.v2 = v2
        self.job.mean = self.job.range_ = self.job.inv = NULL
        if v2:
            st = inv
            self.job.inv = &st[0, 0]
        else:
            st = mean
            self.job.mean = &st[0, 0]
            st = range_
            self.job.range_ = &st[0, 0]
        self.job.task_rows, self.job.task_feats, self.job.chunk = task_rows, task_feats, chunk
        self.job.row_blocks = (self.job.n + task_rows - 1) // task_rows
        self.job.product = product
        self.job.bf16_panels = takes_bf16_x(product)
        self.job.strip_panels = packs_strips(product, task_rows)
        self.job.kern = kernels(True)
        self.job.count = count
        self.proj = <Projection *>malloc(count * sizeof(Projection))
        if self.proj == NULL:
            raise MemoryError()
        for p in range(count):
            w = weights[p]
            self.proj[p].w16 = NULL
            self.proj[p].w32 = NULL
            if w.dtype.itemsize == 2:
                w16 = w
                self.proj[p].w16 = &w16[0, 0]
            else:
                w32 = w
                self.proj[p].w32 = &w32[0, 0]
            self.proj[p].bias = NULL
            if biases[p] is not None:
                b32 = biases[p]
                self.proj[p].bias = &b32[0]
            self.proj[p].segments, self.proj[p].seg_len, self.proj[p].step_chunks = cuts[p]
            self.proj[p].out = w.shape[0]
            acc = accs[p]
            x = xs[p]
            self.proj[p].slot_len = slot_elements(product, task_rows, self.job.n,
                                                  min(<Py_ssize_t>chunk, self.proj[p].seg_len))
            needed = self.proj[p].segments * self.proj[p].step_chunks * self.proj[p].slot_len
            if (acc.shape[0] < self.proj[p].segments * self.job.n * self.proj[p].out or
                    x.shape[0] < needed):
                raise ValueError("accumulator or panel array too small for the cut")
            self.proj[p].acc = &acc[0]
            self.proj[p].x = &x[0]
            self.proj[p].scale = scales[p]
            self.proj[p].panels = (w.shape[0] + task_feats - 1) // task_feats
            self.proj[p].blocks = self.job.row_blocks * self.proj[p].panels
            self.proj[p].first_task = first
            first += self.proj[p].blocks * self.proj[p].segments
        self.job.proj = self.proj
        self.tasks = first
        self.threads = threads
        # Per thread: the widened weight panel, or on the kernels' routes their scratch.
        if self.job.strip_panels:
            self.panel_len = LTX_DOT_PANEL_SCRATCH(task_rows) * sizeof(float)
        else:
            self.panel_len = chunk_panel_bytes(product, task_rows, task_feats, chunk)
        self.panels = <char *>ltx_aligned_alloc(self.panel_len * threads)
        if self.panels == NULL:
            raise MemoryError("could not allocate the weight panel buffers")
        if self.job.strip_panels:
            self.rows_len = up64(LTX_DOT_PANEL_STRIP * chunk * sizeof(uint16_t))
            self.rows_bf16 = <char *>ltx_aligned_alloc(self.rows_len * threads)
            if self.rows_bf16 == NULL:
                raise MemoryError("could not allocate the normalisation buffers")

    def __dealloc__(self):
        free(self.proj)
        free(self.panels)
        free(self.rows_bf16)

    def normalize(self, Py_ssize_t step):
        """The normalisation of a step's features into the panels."""
        cdef Py_ssize_t r
        cdef int threads = self.threads
        cdef Py_ssize_t strips = (self.job.n + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP
        cdef uint16_t *mine
        if not self.job.strip_panels:
            with nogil:
                for r in prange(self.job.n, num_threads=threads, schedule="dynamic"):
                    normalize_rows(&self.job, r, r + 1, step, NULL)
            return
        # A strip and a segment at a time: few tokens make few strips, and cores of unequal
        # speed need more pieces than threads to share the work evenly.
        cdef Py_ssize_t pieces = segment_count(&self.job), piece, seg
        cdef int p
        with nogil, parallel(num_threads=threads):
            mine = <uint16_t *>(self.rows_bf16 + self.rows_len * omp_get_thread_num())
            for piece in prange(strips * pieces, schedule="dynamic"):
                r, seg, p = piece // pieces, piece % pieces, 0
                while seg >= self.job.proj[p].segments:  # assignments, not reductions
                    seg = seg - self.job.proj[p].segments
                    p = p + 1
                normalize_segment(&self.job, r * LTX_DOT_PANEL_STRIP,
                                  min(self.job.n, (r + 1) * LTX_DOT_PANEL_STRIP), step, mine,
                                  p, seg)

    def run(self, Py_ssize_t step, Py_ssize_t first, Py_ssize_t stop):
        """Tasks [first, stop) of a step, whose features normalize(step) has produced."""
        cdef Py_ssize_t t
        cdef int threads = <int>min(<Py_ssize_t>self.threads, stop - first)
        cdef float *mine
        if threads < 1:
            return
        with nogil, parallel(num_threads=threads):
            mine = <float *>(self.panels + self.panel_len * omp_get_thread_num())
            for t in prange(first, stop, schedule="dynamic"):
                run_task(&self.job, t, step, mine)

    def finish(self, list outputs):
        """Add up each output block's segment sums in segment order, as linear() does, into its
        rows of the outputs ([B * T, out] f32, zero where no valid row lands)."""
        cdef float[:, ::1] y
        cdef int p, mt, ot
        cdef Py_ssize_t block, m0, o0, r, m
        cdef float *acc
        cdef Projection *pr
        for p in range(self.job.count):
            y = outputs[p]
            pr = &self.proj[p]
            with nogil:
                for block in prange(pr.blocks, num_threads=self.threads, schedule="dynamic"):
                    m0, o0, mt, ot = block_bounds(block, pr.panels, self.job.task_rows,
                                                  self.job.task_feats, self.job.n, pr.out)
                    acc = pr.acc + acc_at(&self.job, pr, 0, m0, o0, mt)
                    add_segments(acc, self.job.n * pr.out, pr.segments,
                                     <Py_ssize_t>mt * ot)
                    for m in range(mt):
                        for r in range(ot):
                            y[self.job.rows[m0 + m], o0 + r] = acc[r * mt + m]
