/*
 * What the Cython drivers share around their parallel loops: 64-byte aligned buffers (whole
 * cache lines per thread, so threads never write the same line) and the OpenMP queries, with
 * single-thread stand-ins when the build has no OpenMP.
 */
#ifndef LTX2BLAS_PARALLEL_H
#define LTX2BLAS_PARALLEL_H

#include <stdlib.h>

static inline void *ltx_aligned_alloc(size_t bytes)
{
    void *p = NULL;
    if (bytes == 0)
        bytes = 64;
    if (posix_memalign(&p, 64, (bytes + 63) & ~(size_t)63) != 0)
        return NULL;
    return p;
}

#ifdef _OPENMP
#include <omp.h>
#define LTX_HAVE_OPENMP 1
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_max_threads(void) { return 1; }
#define LTX_HAVE_OPENMP 0
#endif

#endif
