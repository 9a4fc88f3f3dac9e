/* Picks the kernel table for this CPU. Built once, for the baseline instruction set. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"

extern const ltx_kernels ltx_kernels_base;
#ifdef LTX_HAVE_AVX2
extern const ltx_kernels ltx_kernels_avx2;
#endif
#ifdef LTX_HAVE_AVX512
extern const ltx_kernels ltx_kernels_avx512;
#endif
#ifdef LTX_HAVE_AVX512BF16
extern const ltx_kernels ltx_kernels_avx512bf16;
#endif
#ifdef LTX_HAVE_NEON
extern const ltx_kernels ltx_kernels_neon;
#endif

static int cpu_has_avx2(void)
{
#if defined(LTX_HAVE_AVX2) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

static int cpu_has_avx512(void)
{
#if defined(LTX_HAVE_AVX512) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && cpu_has_avx2();
#else
    return 0;
#endif
}

static int cpu_has_avx512bf16(void)
{
#if defined(LTX_HAVE_AVX512BF16) && (defined(__x86_64__) || defined(__i386__))
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

const ltx_kernels *ltx_kernels_by_name(const char *name)
{
    if (name == NULL)
        return NULL;
    if (strcmp(name, "base") == 0)
        return &ltx_kernels_base;
#ifdef LTX_HAVE_AVX2
    if (strcmp(name, "avx2") == 0)
        return cpu_has_avx2() ? &ltx_kernels_avx2 : NULL;
#endif
#ifdef LTX_HAVE_AVX512
    if (strcmp(name, "avx512") == 0)
        return cpu_has_avx512() ? &ltx_kernels_avx512 : NULL;
#endif
#ifdef LTX_HAVE_AVX512BF16
    if (strcmp(name, "avx512bf16") == 0)
        return cpu_has_avx512bf16() ? &ltx_kernels_avx512bf16 : NULL;
#endif
#ifdef LTX_HAVE_NEON
    if (strcmp(name, "neon") == 0)
        return &ltx_kernels_neon;
#endif
    return NULL;
}

const ltx_kernels *ltx_fast_kernels(void)
{
#ifdef LTX_HAVE_AVX512BF16
    if (cpu_has_avx512bf16())
        return &ltx_kernels_avx512bf16;
#endif
#ifdef LTX_HAVE_AVX512
    if (cpu_has_avx512())
        return &ltx_kernels_avx512;
#endif
#ifdef LTX_HAVE_AVX2
    if (cpu_has_avx2())
        return &ltx_kernels_avx2;
#endif
#ifdef LTX_HAVE_NEON
    return &ltx_kernels_neon;
#endif
    return &ltx_kernels_base;
}

const ltx_kernels *ltx_strict_kernels(void) { return &ltx_kernels_base; }

const char *ltx_kernels_built(void)
{
    return "base"
#ifdef LTX_HAVE_AVX2
           ",avx2"
#endif
#ifdef LTX_HAVE_AVX512
           ",avx512"
#endif
#ifdef LTX_HAVE_AVX512BF16
           ",avx512bf16"
#endif
#ifdef LTX_HAVE_NEON
           ",neon"
#endif
        ;
}
