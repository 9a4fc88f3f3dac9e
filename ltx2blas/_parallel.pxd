# Shared by the drivers' parallel loops: aligned per-thread buffers and the OpenMP queries.
cdef extern from "parallel.h" nogil:
    void *ltx_aligned_alloc(size_t bytes)
    int omp_get_thread_num()
    int omp_get_max_threads()
    int LTX_HAVE_OPENMP


cdef inline size_t up64(size_t n) noexcept nogil:
    """``n`` bytes rounded up to whole cache lines, so that each thread's buffers start on one."""
    return (n + 63) & ~(<size_t>63)
