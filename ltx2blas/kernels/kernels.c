/*
 * One source, compiled once per instruction set (see meson.build): LTX_VARIANT names the build
 * and the register tile.  Arithmetic is written with GCC/Clang vector extensions so the same
 * text serves AVX-512, AVX2 and NEON; the compiler's -ffp-contract setting for the variant
 * decides whether `c + x*y` becomes an FMA (fast variants) or stays mul-then-add (base).
 */
#include <string.h>

#include "kernels.h"

#if defined(LTX_VARIANT_AVX512)
#define VW 16
#define MR 8
#define NRV 2
#define TABLE ltx_kernels_avx512
#define TABLE_NAME "avx512"
#elif defined(LTX_VARIANT_AVX2)
#define VW 8
#define MR 6
#define NRV 2
#define TABLE ltx_kernels_avx2
#define TABLE_NAME "avx2"
#elif defined(LTX_VARIANT_NEON)
#define VW 4
#define MR 8
#define NRV 3
#define TABLE ltx_kernels_neon
#define TABLE_NAME "neon"
#elif defined(LTX_VARIANT_BASE)
#define VW 4
#define MR 4
#define NRV 2
#define TABLE ltx_kernels_base
#define TABLE_NAME "base"
#else
#error "define one LTX_VARIANT_*"
#endif

#define NR (VW * NRV)
/* Depth of one pass over k: keeps the y strip (KC x NR floats) in L1 between row blocks.
 * Splitting k here is harmless: c is stored exactly between passes. */
#define KC 128

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint32_t u32a __attribute__((may_alias));

#define LOADV(p) (*(const vfu *)(p))
#define STOREV(p, v) (*(vfu *)(p) = (v))

/* MR x NR register tile, k sequential per element. */
static inline void seq_tile(ltx_idx k, const float *x, ltx_idx ldx, const float *y, ltx_idx ldy,
                            float *c, ltx_idx ldc)
{
    vf acc[MR][NRV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++)
            acc[r][v] = LOADV(c + r * ldc + v * VW);
    for (ltx_idx p = 0; p < k; p++) {
        vf yv[NRV];
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++)
            yv[v] = LOADV(y + p * ldy + v * VW);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const float xs = x[r * ldx + p];
#pragma GCC unroll 4
            for (int v = 0; v < NRV; v++)
                acc[r][v] = acc[r][v] + yv[v] * xs;
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++)
            STOREV(c + r * ldc + v * VW, acc[r][v]);
}

/* One row, NR columns. */
static inline void seq_row(ltx_idx k, const float *x, const float *y, ltx_idx ldy, float *c)
{
    vf acc[NRV];
#pragma GCC unroll 4
    for (int v = 0; v < NRV; v++)
        acc[v] = LOADV(c + v * VW);
    for (ltx_idx p = 0; p < k; p++) {
        const float xs = x[p];
#pragma GCC unroll 4
        for (int v = 0; v < NRV; v++)
            acc[v] = acc[v] + LOADV(y + p * ldy + v * VW) * xs;
    }
#pragma GCC unroll 4
    for (int v = 0; v < NRV; v++)
        STOREV(c + v * VW, acc[v]);
}

static void seq_gemm(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                     const float *y, ltx_idx ldy, float *c, ltx_idx ldc)
{
    const ltx_idx n_full = n - n % NR;
    for (ltx_idx p0 = 0; p0 < k; p0 += KC) {
        const ltx_idx kc = (k - p0 < KC) ? (k - p0) : KC;
        const float *xp = x + p0;
        const float *yp = y + p0 * ldy;
        for (ltx_idx j = 0; j < n_full; j += NR) {
            ltx_idx i = 0;
            for (; i + MR <= m; i += MR)
                seq_tile(kc, xp + i * ldx, ldx, yp + j, ldy, c + i * ldc + j, ldc);
            for (; i < m; i++)
                seq_row(kc, xp + i * ldx, yp + j, ldy, c + i * ldc + j);
        }
        for (ltx_idx i = 0; i < m; i++) {
            for (ltx_idx j = n_full; j < n; j++) {
                float acc = c[i * ldc + j];
                for (ltx_idx p = 0; p < kc; p++)
                    acc = acc + xp[i * ldx + p] * yp[p * ldy + j];
                c[i * ldc + j] = acc;
            }
        }
    }
}

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bf16(f), nearest-even, as f32 bits (the bf16 in the high half, zeros below). NaN becomes the
 * quiet NaN 0x7FC0 with its sign (the bits ml_dtypes gives); overflow rounds to inf; subnormals
 * are kept. */
static inline uint32_t bf16_high(float f)
{
    const uint32_t u = f32_bits(f);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    const uint32_t qnan = (u & 0x80000000u) | 0x7FC00000u;
    return (f != f) ? qnan : rounded;
}

static void scale_round_widen(const uint16_t *restrict src, float s, float *restrict dst,
                              ltx_idx n)
{
    u32a *d = (u32a *)dst;
    for (ltx_idx i = 0; i < n; i++)
        d[i] = bf16_high(bits_f32((uint32_t)src[i] << 16) * s);
}

static void widen_bf16(const uint16_t *restrict src, float *restrict dst, ltx_idx n)
{
    u32a *d = (u32a *)dst;
    for (ltx_idx i = 0; i < n; i++)
        d[i] = (uint32_t)src[i] << 16;
}

static inline void store_fused_row(const float *restrict acc, const uint16_t *w, uint16_t *out,
                                   ltx_idx n)
{
    /* out may alias w (in-place fuse): each element is read before it is written. */
    for (ltx_idx i = 0; i < n; i++) {
        const float delta = bits_f32(bf16_high(acc[i]));
        const float sum = bits_f32((uint32_t)w[i] << 16) + delta;
        out[i] = (uint16_t)(bf16_high(sum) >> 16);
    }
}

/* Rows of a weight tile come from memory one short run at a time, too short for the hardware
 * prefetcher to get ahead: ask for the run PREFETCH_ROWS ahead while this one is stored. */
#define PREFETCH_ROWS 4

static void store_fused(const float *acc, const uint16_t *w, ltx_idx ldw, uint16_t *out,
                        ltx_idx ldo, ltx_idx rows, ltx_idx cols)
{
    for (ltx_idx r = 0; r < rows; r++) {
        if (r + PREFETCH_ROWS < rows) {
            const char *next = (const char *)(w + (r + PREFETCH_ROWS) * ldw);
            for (ltx_idx b = 0; b < cols * 2; b += 64)
                __builtin_prefetch(next + b, 0, 3);
        }
        store_fused_row(acc + r * cols, w + r * ldw, out + r * ldo, cols);
    }
}

static void accumulate_rounded(const float *restrict acc, float *restrict total, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        total[i] = total[i] + bits_f32(bf16_high(acc[i]));
}

static ltx_idx first_nonfinite_bf16(const uint16_t *src, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        if ((src[i] & 0x7F80u) == 0x7F80u)
            return i;
    return -1;
}

/* One pass over a bf16 array: magnitude bits (x & 0x7FFF, which order like |x|) of the
 * largest element, capped at the largest finite bf16 (0x7F7F) when the array holds inf or NaN,
 * and of the smallest non-zero element; returns the first inf/NaN or -1.  Two plain reductions,
 * which the compiler vectorises (mag - 1 sends 0 to 0xFFFF, out of the minimum's way). */
static ltx_idx scan_bf16(const uint16_t *src, ltx_idx n, uint16_t *max_mag, uint16_t *min_mag)
{
    uint16_t worst = 0, lo_minus_1 = 0xFFFFu;
    for (ltx_idx i = 0; i < n; i++) {
        const uint16_t mag = src[i] & 0x7FFFu;
        const uint16_t m1 = (uint16_t)(mag - 1u);
        worst = mag > worst ? mag : worst;
        lo_minus_1 = m1 < lo_minus_1 ? m1 : lo_minus_1;
    }
    const uint16_t lo = (uint16_t)(lo_minus_1 + 1u);
    *max_mag = worst < 0x7F80u ? worst : 0x7F7Fu;
    *min_mag = lo < 0x7F80u ? lo : 0; /* 0: no finite non-zero element */
    return worst >= 0x7F80u ? first_nonfinite_bf16(src, n) : -1;
}

const ltx_kernels TABLE = {
    TABLE_NAME,         seq_gemm,           widen_bf16,           scale_round_widen,
    store_fused,        accumulate_rounded, first_nonfinite_bf16, scan_bf16,
};
