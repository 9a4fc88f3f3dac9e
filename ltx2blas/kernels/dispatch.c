/* Picks the kernel table for this CPU, and joins each build of kernels.c with the build of
 * quant.c for the same instruction set into the one table handed out: every per-instruction-set
 * entry point is reached through it, chosen once. Built once, for the baseline instruction set.
 *
 * The instruction sets built in are listed once, in `builds` below, best first, each with the
 * test of whether this CPU runs it; a new instruction set is one DECLARE and one entry. */
#include <stdlib.h>
#include <string.h>
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#include "kernels.h"
#include "quant.h"

#define DECLARE(v)                                                                          \
    extern const ltx_kernels ltx_kernels_##v;                                               \
    extern const ltx_layout_passes ltx_layout_##v;
#define BUILD(v, runs_here) {#v, &ltx_kernels_##v, &ltx_layout_##v, runs_here, {0}}

typedef struct {
    const char *name;
    const ltx_kernels *kernels;      /* kernels.c's table of this instruction set */
    const ltx_layout_passes *layout; /* quant.c's passes of the same build */
    int (*runs_here)(void);          /* whether this CPU has every instruction the build uses */
    ltx_kernels joined;              /* the two joined: the table handed out */
} build;

static int always(void) { return 1; }

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

#ifdef LTX_HAVE_NEON_BF16
/* The kernel's word for FEAT_BF16 (BFMLALB/T, BFDOT, BFMMLA, BFCVT): bit 14 of AT_HWCAP2. */
#define ARM_HWCAP2_BF16 (1ul << 14)
static int cpu_has_arm_bf16(void)
{
#if defined(__linux__)
    return (getauxval(AT_HWCAP2) & ARM_HWCAP2_BF16) != 0;
#else
    return 0;
#endif
}
#endif

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
#ifdef LTX_HAVE_NEON_BF16
DECLARE(neon_bf16)
#endif
#ifdef LTX_HAVE_NEON
DECLARE(neon)
#endif

/* Best first; the baseline last, which every CPU runs and which is the strict table. */
static build builds[] = {
#ifdef LTX_HAVE_AVX512BF16
    BUILD(avx512bf16, cpu_has_avx512bf16),
#endif
#ifdef LTX_HAVE_AVX512
    BUILD(avx512, cpu_has_avx512),
#endif
#ifdef LTX_HAVE_AVX2
    BUILD(avx2, cpu_has_avx2),
#endif
#ifdef LTX_HAVE_NEON_BF16
    BUILD(neon_bf16, cpu_has_arm_bf16),
#endif
#ifdef LTX_HAVE_NEON
    BUILD(neon, always),
#endif
    BUILD(base, always),
};
#define BUILDS ((int)(sizeof builds / sizeof builds[0]))

/* "base,avx2,...": the names, baseline first. */
static char built_names[128];

/* Made when the library is loaded, before any caller can ask for a table. */
__attribute__((constructor)) static void join_tables(void)
{
    for (int i = BUILDS - 1; i >= 0; i--) {
        builds[i].joined = *builds[i].kernels;
        builds[i].joined.layout = builds[i].layout;
        if (i < BUILDS - 1)
            strcat(built_names, ",");
        strcat(built_names, builds[i].name);
    }
}

const ltx_kernels *ltx_kernels_by_name(const char *name)
{
    for (int i = 0; name != NULL && i < BUILDS; i++)
        if (strcmp(name, builds[i].name) == 0)
            return builds[i].runs_here() ? &builds[i].joined : NULL;
    return NULL;
}

const ltx_kernels *ltx_fast_kernels(void)
{
    for (int i = 0; i < BUILDS - 1; i++)
        if (builds[i].runs_here())
            return &builds[i].joined;
    return ltx_strict_kernels();
}

const ltx_kernels *ltx_strict_kernels(void) { return &builds[BUILDS - 1].joined; }

const char *ltx_kernels_built(void) { return built_names; }
