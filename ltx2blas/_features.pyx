"""Driver of the text feature extractor: per-row statistics, then, a projection at a time,
normalisation a step at a time (a few chunks of every segment of a pass) straight into the
projection's GEMM panels.

Each projection's in-dimension is cut into segments, and the segments into passes, as
ltx2blas.linear cuts them; the panels are laid out as linear lays out its widened input panels
(rows packed, row stride = the chunk's width), or for the dot-product panel kernel in its
strips of pairs, chunk by chunk; every task adds its segment's chunks with the same products
in the same order from the same start, and each pass's end adds its segments' sums onto the
output in the same order, so a projection's result is byte-identical to
``linear(features, weight, bias)`` on the same features -- without the features ever existing
whole.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport int64_t, uint16_t, uint32_t
from libc.stdlib cimport free, malloc

from ._gemm cimport (LTX_DOT_PANEL_PAIRS, LTX_DOT_PANEL_SCRATCH, LTX_DOT_PANEL_STRIP,
                     LTX_LAYER_TABLE_PAD, chunk_panel_bytes, chunk_wxt, kernels, pack_x_pairs,
                     packed_chunk_wxt, packs_strips, strip_at, strip_stride, takes_bf16_x)
from ._kernels cimport ltx_kernels
from ._parallel cimport (add_segments, block_bounds, block_offset, ltx_aligned_alloc,
                        omp_get_thread_num, start_block, up64)

import numpy as np


def row_stats(hidden, const int64_t[::1] rows, int layers, double[:, ::1] sums,
              double[:, ::1] squares, float[:, ::1] lows, float[:, ::1] highs, int threads):
    """For each listed row of ``hidden`` ([rows, D * L], bf16 bits or f32): per layer, the sum
    and the sum of squares over d in order from 0.0 (f64), and the min and max (NaN wins)."""
    cdef bint bf16 = hidden.dtype.itemsize == 2
    cdef const uint16_t[:, ::1] h16
    cdef const float[:, ::1] h32
    cdef const void *base
    cdef Py_ssize_t width = hidden.shape[1], n = rows.shape[0], r, depth = width // layers
    cdef const ltx_kernels *kern = kernels(True)
    if bf16:
        h16 = hidden
        base = &h16[0, 0]
    else:
        h32 = hidden
        base = &h32[0, 0]
    with nogil:
        # a row at a time to whichever thread is free: cores of unequal speed share it evenly
        for r in prange(n, num_threads=threads, schedule="dynamic"):
            kern.layer_stats(<const char *>base + rows[r] * width * (2 if bf16 else 4), bf16,
                             depth, layers, &sums[r, 0], &squares[r, 0], &lows[r, 0],
                             &highs[r, 0])


cdef struct Projection:
    const uint16_t *w16       # [out, F] bf16, or
    const float *w32          # [out, F] f32
    const float *bias         # [out] f32 or NULL
    float *acc                # [pass_segs, n, out]: each task's transposed accumulator,
                              # packed, for the pass's segments
    float *x                  # the panels of the current step: f32, or with bf16_panels
                              # bf16 bits (the features are bf16)
    float scale               # V2: sqrt(out / D) as f32; V1: unused
    Py_ssize_t out, panels, blocks
    Py_ssize_t segments, seg_len
    Py_ssize_t pass_segs      # segments a pass
    int step_chunks           # chunks of every segment of the pass a step normalises and adds
    Py_ssize_t pass_steps     # steps a pass
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
    Projection proj
    int task_rows, task_feats, chunk
    Py_ssize_t row_blocks
    int product               # chunk_wxt's product (PRODUCT_*)
    bint bf16_panels          # the product takes bf16 x: the panels hold bf16 bits
    bint strip_panels         # ... in the dot-product panel kernel's strips (packs_strips)
    const ltx_kernels *kern


def panel_elements(int product, int task_rows, Py_ssize_t n, Py_ssize_t pass_segs,
                   int step_chunks, int chunk, Py_ssize_t seg_len):
    """f32 elements of a projection's panels: a step's chunks of every segment of a pass, each
    [n rows, min(chunk, seg_len)] -- f32, or bf16 two to an element where the product takes
    bf16 x, in strips of pairs (rows rounded up to whole strips) where packs_strips."""
    return pass_segs * step_chunks * slot_elements(product, task_rows, n, min(chunk, seg_len))


cdef Py_ssize_t slot_elements(int product, int task_rows, Py_ssize_t n,
                              Py_ssize_t width) noexcept:
    """f32 elements of a chunk's panel of n rows, width features wide (see panel_elements)."""
    if packs_strips(product, task_rows):
        return ((n + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP * LTX_DOT_PANEL_STRIP
                * LTX_DOT_PANEL_PAIRS(width))
    if takes_bf16_x(product):
        return (n * width + 1) // 2
    return n * width


cdef inline Py_ssize_t pass_segments(const Projection *pr, Py_ssize_t pass_) noexcept nogil:
    """How many segments pass ``pass_`` takes (the last may take fewer)."""
    return min(pr.pass_segs, pr.segments - pass_ * pr.pass_segs)


cdef inline void step_range(const FeatureJob *job, const Projection *pr, Py_ssize_t local,
                            Py_ssize_t step, Py_ssize_t *s0, Py_ssize_t *s1) noexcept nogil:
    """The features [s0, s1) of the pass's segment ``local`` (its index within the pass) that
    step ``step`` (of the call) takes (empty past its end)."""
    cdef Py_ssize_t seg = step // pr.pass_steps * pr.pass_segs + local
    cdef Py_ssize_t first = seg * pr.seg_len
    cdef Py_ssize_t end = min(job.width, first + pr.seg_len)
    s0[0] = min(end, first + step % pr.pass_steps * pr.step_chunks * job.chunk)
    s1[0] = min(end, s0[0] + pr.step_chunks * job.chunk)


cdef inline Py_ssize_t slot(const FeatureJob *job, const Projection *pr, Py_ssize_t local,
                            Py_ssize_t c) noexcept nogil:
    """Where chunk c of the pass's segment ``local``'s piece starts in the panels, in panel
    elements (bf16 ones with bf16_panels): pieces one after another, each chunk's rows packed
    (row r at r * its width), as linear() packs them, or in strips of pairs."""
    return (local * pr.step_chunks + c) * pr.slot_len * (2 if job.bf16_panels else 1)


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


cdef void normalize_segment(const FeatureJob *job, Py_ssize_t r0, Py_ssize_t r1,
                            Py_ssize_t step, uint16_t *strip_rows,
                            Py_ssize_t local) noexcept nogil:
    """Rows [r0, r1)'s features of this step in the pass's segment ``local`` into the panels:
    rows packed, or, with strip_panels, rows [r0, r1) being one strip, each chunk of them
    normalised into strip_rows (a strip's rows of a chunk) and then packed by the kernel's
    transposes (a feature at a time straight into the strip would touch a line for every
    two)."""
    cdef Py_ssize_t c0, s0, s1, c, r, at
    cdef int kt
    cdef const Projection *pr = &job.proj
    step_range(job, pr, local, step, &s0, &s1)
    c0, c = s0, 0
    while c0 < s1:
        kt = <int>min(<Py_ssize_t>job.chunk, s1 - c0)
        at = slot(job, pr, local, c)
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


cdef void run_task(const FeatureJob *job, Py_ssize_t task, Py_ssize_t step,
                   float *panel) noexcept nogil:
    """One task's (rows x features of one of the pass's segments) accumulation over this
    step's chunks."""
    cdef const Projection *pr = &job.proj
    cdef Py_ssize_t local = task // pr.blocks, m0, o0
    cdef Py_ssize_t seg = step // pr.pass_steps * pr.pass_segs + local
    cdef int mt, ot
    m0, o0, mt, ot = block_bounds(task % pr.blocks, pr.panels, job.task_rows, job.task_feats,
                                  job.n, pr.out)
    cdef float *acc = pr.acc + local * job.n * pr.out + block_offset(m0, o0, pr.out, mt)
    cdef Py_ssize_t c0, s0, s1, c = 0
    cdef int kt
    cdef const void *xp
    if step % pr.pass_steps == 0:  # every segment has a chunk in a pass's first step
        start_block(acc, pr.bias, o0, mt, ot, seg == 0)
    step_range(job, pr, local, step, &s0, &s1)
    c0 = s0
    while c0 < s1:
        kt = <int>min(<Py_ssize_t>job.chunk, s1 - c0)
        if job.strip_panels:
            packed_chunk_wxt(job.kern, mt, ot, kt,
                             strip_at(<uint32_t *>(<uint16_t *>pr.x + slot(job, pr, local, c)),
                                      strip_stride(kt), m0, 0), strip_stride(kt),
                             pr.w16 + o0 * job.width + c0, <int>job.width, panel, acc)
            c0 += kt
            c += 1
            continue
        if job.bf16_panels:
            xp = <uint16_t *>pr.x + slot(job, pr, local, c) + m0 * kt
        else:
            xp = pr.x + slot(job, pr, local, c) + m0 * kt
        chunk_wxt(job.kern, job.product, mt, ot, kt, xp, kt,
                  pr.w16 + o0 * job.width + c0 if pr.w16 != NULL else NULL,
                  pr.w32 + o0 * job.width + c0 if pr.w32 != NULL else NULL,
                  <int>job.width, panel, acc)
        c0 += kt
        c += 1


cdef void end_block(const FeatureJob *job, Py_ssize_t block, Py_ssize_t pass_, float *y,
                    Py_ssize_t ldy) noexcept nogil:
    """One output block at a pass's end: the pass's segments' sums added in segment order
    onto the block's rows of y (after the first pass) or onto each other (the first pass, in
    place), as linear() adds them, into the block's tokens' rows of y."""
    cdef const Projection *pr = &job.proj
    cdef Py_ssize_t m0, o0, r, m, s, step = job.n * pr.out
    cdef Py_ssize_t count = pass_segments(pr, pass_)
    cdef int mt, ot
    cdef float v
    m0, o0, mt, ot = block_bounds(block, pr.panels, job.task_rows, job.task_feats, job.n,
                                  pr.out)
    cdef float *acc = pr.acc + block_offset(m0, o0, pr.out, mt)
    if pass_ == 0:
        add_segments(acc, step, count, <Py_ssize_t>mt * ot)
        for m in range(mt):
            for r in range(ot):
                y[job.rows[m0 + m] * ldy + o0 + r] = acc[r * mt + m]
        return
    for m in range(mt):
        for r in range(ot):
            v = y[job.rows[m0 + m] * ldy + o0 + r]
            for s in range(count):
                v = v + acc[s * step + r * mt + m]
            y[job.rows[m0 + m] * ldy + o0 + r] = v


def padded_by_layer(table):
    """A per-layer table [rows, L] with LTX_LAYER_TABLE_PAD columns more, the first ones again
    (column i holds column i mod L): the layout normalize_features reads; None stays None."""
    if table is None:
        return None
    layers = table.shape[1]
    wrap = (layers + np.arange(LTX_LAYER_TABLE_PAD)) % layers
    return np.ascontiguousarray(np.concatenate([table, table[:, wrap]], axis=1), np.float32)


cdef class FeaturePlan:
    """One projection of a text_features call: its segments a pass at a time, each pass a
    number of steps. normalize(step) writes a step's features (a whole number of chunks of
    every segment of its pass) into the panels, run(step, first, stop) adds them into tasks'
    accumulators, and end_pass(pass, y) adds the pass's segments' sums onto y's valid rows."""
    cdef FeatureJob job
    cdef char *panels
    cdef size_t panel_len
    cdef char *rows_bf16           # per thread with strip_panels: a strip's rows of a chunk
    cdef size_t rows_len
    cdef int threads
    cdef object keep

    def __init__(self, hidden, const int64_t[::1] rows, const int64_t[::1] sample, bint v2,
                 mean, range_, inv, weight, bias, acc_array, x_array, float scale, cut,
                 int task_rows, int task_feats, int chunk, int product, int threads,
                 int layers):
        """``cut``: (segments, segment length, segments a pass, chunks a step); ``acc_array``:
        [segments a pass * n * out] f32; ``x_array``: the panels, f32, of panel_elements(...)."""
        cdef const uint16_t[:, ::1] h16
        cdef const float[:, ::1] h32
        cdef const uint16_t[:, ::1] w16
        cdef const float[:, ::1] w32
        cdef const float[::1] b32
        cdef float[::1] acc = acc_array
        cdef float[::1] x = x_array
        cdef const float[:, ::1] st
        cdef Py_ssize_t needed, per_segment
        cdef Projection *pr = &self.job.proj
        mean, range_, inv = (padded_by_layer(t) for t in (mean, range_, inv))
        self.keep = [hidden, rows, sample, mean, range_, inv, weight, bias, acc_array, x_array]
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
        pr.w16 = NULL
        pr.w32 = NULL
        if weight.dtype.itemsize == 2:
            w16 = weight
            pr.w16 = &w16[0, 0]
        else:
            w32 = weight
            pr.w32 = &w32[0, 0]
        pr.bias = NULL
        if bias is not None:
            b32 = bias
            pr.bias = &b32[0]
        pr.segments, pr.seg_len, pr.pass_segs, pr.step_chunks = cut
        if not 1 <= pr.pass_segs <= pr.segments or pr.step_chunks < 1:
            raise ValueError("a pass takes 1 to every segment, a step 1 chunk or more")
        per_segment = (min(pr.seg_len, self.job.width) + chunk - 1) // chunk
        pr.pass_steps = (per_segment + pr.step_chunks - 1) // pr.step_chunks
        pr.out = weight.shape[0]
        pr.slot_len = slot_elements(product, task_rows, self.job.n,
                                    min(<Py_ssize_t>chunk, pr.seg_len))
        needed = pr.pass_segs * pr.step_chunks * pr.slot_len
        if acc.shape[0] < pr.pass_segs * self.job.n * pr.out or x.shape[0] < needed:
            raise ValueError("accumulator or panel array too small for the cut")
        pr.acc = &acc[0]
        pr.x = &x[0]
        pr.scale = scale
        pr.panels = (pr.out + task_feats - 1) // task_feats
        pr.blocks = self.job.row_blocks * pr.panels
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
        free(self.panels)
        free(self.rows_bf16)

    @property
    def steps(self):
        """Steps of the call: each pass's, one pass after another."""
        cdef const Projection *pr = &self.job.proj
        return (pr.segments + pr.pass_segs - 1) // pr.pass_segs * pr.pass_steps

    def tasks(self, Py_ssize_t step):
        """How many tasks step ``step`` runs: its pass's segments' blocks."""
        cdef const Projection *pr = &self.job.proj
        return pass_segments(pr, step // pr.pass_steps) * pr.blocks

    def ends_pass(self, Py_ssize_t step):
        """The pass that step ``step`` is the last of, or -1."""
        cdef const Projection *pr = &self.job.proj
        return step // pr.pass_steps if (step + 1) % pr.pass_steps == 0 else -1

    def normalize(self, Py_ssize_t step):
        """The normalisation of a step's features into the panels."""
        cdef Py_ssize_t r
        cdef int threads = self.threads
        cdef Py_ssize_t strips = (self.job.n + LTX_DOT_PANEL_STRIP - 1) // LTX_DOT_PANEL_STRIP
        cdef Py_ssize_t pieces = pass_segments(&self.job.proj, step // self.job.proj.pass_steps)
        cdef Py_ssize_t piece, local
        cdef uint16_t *mine
        if not self.job.strip_panels:
            with nogil:
                for r in prange(self.job.n, num_threads=threads, schedule="dynamic"):
                    for local in range(pieces):
                        normalize_segment(&self.job, r, r + 1, step, NULL, local)
            return
        # A strip and a segment at a time: few tokens make few strips, and cores of unequal
        # speed need more pieces than threads to share the work evenly.
        with nogil, parallel(num_threads=threads):
            mine = <uint16_t *>(self.rows_bf16 + self.rows_len * omp_get_thread_num())
            for piece in prange(strips * pieces, schedule="dynamic"):
                r, local = piece // pieces, piece % pieces
                normalize_segment(&self.job, r * LTX_DOT_PANEL_STRIP,
                                  min(self.job.n, (r + 1) * LTX_DOT_PANEL_STRIP), step, mine,
                                  local)

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

    def end_pass(self, Py_ssize_t pass_, float[:, ::1] y):
        """After a pass's last step: its segments' sums added in segment order onto y's valid
        rows ([B * T, out] f32), as linear() adds them; the first pass writes them."""
        cdef Py_ssize_t block
        if y.shape[1] != self.job.proj.out:
            raise ValueError("y must have the projection's out features")
        cdef float *yp = &y[0, 0]
        cdef Py_ssize_t ldy = y.shape[1]
        with nogil:
            for block in prange(self.job.proj.blocks, num_threads=self.threads,
                                schedule="dynamic"):
                end_block(&self.job, block, pass_, yp, ldy)
