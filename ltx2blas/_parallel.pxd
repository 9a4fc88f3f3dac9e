# Shared by the drivers' parallel loops: aligned per-thread buffers and the OpenMP queries.
cdef extern from "parallel.h" nogil:
    void *ltx_aligned_alloc(size_t bytes)
    int omp_get_thread_num()
    int omp_get_max_threads()
    int LTX_HAVE_OPENMP


cdef inline size_t up64(size_t n) noexcept nogil:
    """``n`` bytes rounded up to whole cache lines, so that each thread's buffers start on one."""
    return (n + 63) & ~(<size_t>63)


# The segments' sums of a task's output block, as the Linear and the feature extractor keep them:
# segment after segment, ``stride`` elements apart, each block [ot, mt] packed at the same
# offset (rows * out elements a segment, a row block's blocks one after another).
cdef inline Py_ssize_t block_offset(Py_ssize_t m0, Py_ssize_t o0, Py_ssize_t out,
                                    Py_ssize_t mt) noexcept nogil:
    """Where the block of rows [m0, m0 + mt) x outputs from o0 starts within a segment."""
    return m0 * out + o0 * mt


ctypedef fused accumulation:
    float
    double


cdef inline void add_segments(accumulation *block, Py_ssize_t stride, Py_ssize_t count,
                              Py_ssize_t n) noexcept nogil:
    """The first segment's block becomes the sum of every segment's, added in segment order, in
    the accumulation's own type."""
    cdef Py_ssize_t s, i
    for s in range(1, count):
        for i in range(n):
            block[i] = block[i] + block[s * stride + i]


cdef inline (Py_ssize_t, Py_ssize_t, int, int) block_bounds(
        Py_ssize_t block, Py_ssize_t panels, int task_rows, int task_feats, Py_ssize_t rows,
        Py_ssize_t out) noexcept nogil:
    """Output block ``block`` (row blocks of ``panels`` feature panels each): its first row and
    output, and its rows and outputs (fewer at the edges)."""
    cdef Py_ssize_t m0 = block // panels * task_rows, o0 = block % panels * task_feats
    return m0, o0, <int>min(<Py_ssize_t>task_rows, rows - m0), <int>min(<Py_ssize_t>task_feats,
                                                                        out - o0)


cdef inline void start_block(accumulation *acc, const accumulation *bias, Py_ssize_t o0, int mt,
                             int ot, bint first_segment) noexcept nogil:
    """A task's accumulator [ot, mt] at its start: the bias in the first segment (where there
    is one), +0.0 elsewhere."""
    cdef Py_ssize_t r, m
    for r in range(ot):
        for m in range(mt):
            acc[r * mt + m] = bias[o0 + r] if bias != NULL and first_segment else 0.0
