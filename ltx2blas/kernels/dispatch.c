/* Picks the kernel table for this CPU, and joins each build of kernels.c with the build of
 * quant.c for the same instruction set into the one table handed out: every per-instruction-set
 * entry point is reached through it, chosen once. Built once, for the baseline instruction set. */
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "quant.h"

/* Each instruction set built in: its builds' pair of tables, and the table joined from them
 * (made when the library is loaded, before any caller can ask for one). */
#define DECLARE(v)                                                                          \
    extern const ltx_kernels ltx_kernels_##v;                                               \
    extern const ltx_layout_passes ltx_layout_##v;                                          \
    static ltx_kernels joined_##v;
DECLARE(base)
#ifdef LTX_HAVE_AVX2
DECLARE(avx2)
#endif
#ifdef LTX_HAVE_AVX512
DECLARE(avx512)
#endif
#ifdef LTX_HAVE_AVX512BF16
DECLARE(avx512bf16)
#endif
#ifdef LTX_HAVE_NEON
DECLARE(neon)
#endif

#define JOIN(v) (joined_##v = ltx_kernels_##v, joined_##v.layout = &ltx_layout_##v)

__attribute__((constructor)) static void join_tables(void)
{
    JOIN(base);
#ifdef LTX_HAVE_AVX2
    JOIN(avx2);
#endif
#ifdef LTX_HAVE_AVX512
    JOIN(avx512);
#endif
#ifdef LTX_HAVE_AVX512BF16
    JOIN(avx512bf16);
#endif
#ifdef LTX_HAVE_NEON
    JOIN(neon);
#endif
}

#if defined(__x86_64__) || defined(__i386__)
static int cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int cpu_has_avx512(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && cpu_has_avx2();
}

#ifdef LTX_HAVE_AVX512BF16
static int cpu_has_avx512bf16(void)
{
    __builtin_cpu_init();
    return cpu_has_avx512() && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bf16");
}
#endif
#endif

const ltx_kernels *ltx_kernels_by_name(const char *name)
{
    if (name == NULL)
        return NULL;
    if (strcmp(name, "base") == 0)
        return &joined_base;
#ifdef LTX_HAVE_AVX2
    if (strcmp(name, "avx2") == 0)
        return cpu_has_avx2() ? &joined_avx2 : NULL;
#endif
#ifdef LTX_HAVE_AVX512
    if (strcmp(name, "avx512") == 0)
        return cpu_has_avx512() ? &joined_avx512 : NULL;
#endif
#ifdef LTX_HAVE_AVX512BF16
    if (strcmp(name, "avx512bf16") == 0)
        return cpu_has_avx512bf16() ? &joined_avx512bf16 : NULL;
#endif
#ifdef LTX_HAVE_NEON
    if (strcmp(name, "neon") == 0)
        return &joined_neon;
#endif
    return NULL;
}

const ltx_kernels *ltx_fast_kernels(void)
{
#ifdef LTX_HAVE_AVX512BF16
    if (cpu_has_avx512bf16())
        return &joined_avx512bf16;
#endif
#ifdef LTX_HAVE_AVX512
    if (cpu_has_avx512())
        return &joined_avx512;
#endif
#ifdef LTX_HAVE_AVX2
    if (cpu_has_avx2())
        return &joined_avx2;
#endif
#ifdef LTX_HAVE_NEON
    return &joined_neon;
#endif
    return &joined_base;
}

const ltx_kernels *ltx_strict_kernels(void) { return &joined_base; }

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
