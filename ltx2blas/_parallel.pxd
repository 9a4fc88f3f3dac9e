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
