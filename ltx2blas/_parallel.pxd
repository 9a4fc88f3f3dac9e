# Shared by the drivers' parallel loops: aligned per-thread buffers and the OpenMP queries.
cdef extern from "parallel.h" nogil:
    void *ltx_aligned_alloc(size_t bytes)
    int omp_get_thread_num()
    int omp_get_max_threads()
    int LTX_HAVE_OPENMP
