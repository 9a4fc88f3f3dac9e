/*
 * One source, compiled once per instruction set (see meson.build): LTX_VARIANT names the build
 * and the register tile.  Arithmetic is written with GCC/Clang vector extensions so the same
 * text serves AVX-512, AVX2 and NEON; the compiler's -ffp-contract setting for the variant
 * decides whether `c + x*y` becomes an FMA (fast variants) or stays mul-then-add (base).
 */
#include <math.h>
#include <string.h>

#include "variant.h"
#include "kernels.h"

#if defined(LTX_VARIANT_AVX512) || defined(LTX_VARIANT_AVX2)
#include <immintrin.h>
#endif
#if defined(LTX_VARIANT_AVX512)
#include "fp8_avx512.h"
#endif
#if defined(LTX_ARM_BF16) || defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(__SSE2__) && !defined(LTX_VARIANT_AVX512) && !defined(LTX_VARIANT_AVX2)
#include <emmintrin.h>
#endif

/* The register tile: VW floats a vector, MR rows by NRV vectors of columns. */
#if defined(LTX_VARIANT_AVX512)
#define VW 16
#define MR 8
#define NRV 2
#elif defined(LTX_VARIANT_AVX2)
#define VW 8
#define MR 6
#define NRV 2
#elif defined(LTX_VARIANT_NEON)
#define VW 4
#define MR 8
#define NRV 3
#else
#define VW 4
#define MR 4
#define NRV 2
#endif

#define NR (VW * NRV)
_Static_assert(MR >= 4 && MR <= 8, "the fuse walk has a block for every last-row count below MR");
_Static_assert(NRV <= 4, "fuse_vecs holds up to 4 vectors");
/* Depth of one pass over k: keeps the y strip (KC x NR floats) in L1 between row blocks.
 * Splitting k here is harmless: c is stored exactly between passes. */
#define KC 128

typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4), may_alias));
typedef uint32_t u32a __attribute__((may_alias));

#define LOADV(p) (*(const vfu *)(p))
#define STOREV(p, v) (*(vfu *)(p) = (v))

/* Hides a value's origin from the compiler, so that a product is rounded on its own before it
 * is added (no contraction into an FMA), whatever -ffp-contract the table is built with. */
#if defined(__x86_64__) || defined(__i386__)
#define NOT_CONTRACTED(v) __asm__("" : "+v"(v))
#define NOT_CONTRACTED_SCALAR(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define NOT_CONTRACTED(v) __asm__("" : "+w"(v))
#define NOT_CONTRACTED_SCALAR(v) __asm__("" : "+w"(v))
#else
#define NOT_CONTRACTED(v) do { volatile __typeof__(v) keep_ = (v); (v) = keep_; } while (0)
#define NOT_CONTRACTED_SCALAR(v) do { volatile float keep_ = (v); (v) = keep_; } while (0)
#endif

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


/* Rows of a weight come from memory one short run at a time, too short for the hardware
 * prefetcher to get ahead: ask for the run PREFETCH_ROWS ahead while this one is processed. */
#define PREFETCH_ROWS 4

static inline void prefetch_run(const void *start, ltx_idx bytes)
{
    for (ltx_idx b = 0; b < bytes; b += 64)
        __builtin_prefetch((const char *)start + b, 0, 3);
}

static void scale_round_widen(const uint16_t *restrict src, float s, float *restrict dst,
                              ltx_idx n)
{
    u32a *d = (u32a *)dst;
    for (ltx_idx i = 0; i < n; i++)
        d[i] = ltx_bf16_high(ltx_bits_f32((uint32_t)src[i] << 16) * s);
}

static void widen_bf16(const uint16_t *restrict src, float *restrict dst, ltx_idx n)
{
    u32a *d = (u32a *)dst;
    for (ltx_idx i = 0; i < n; i++)
        d[i] = (uint32_t)src[i] << 16;
}

static void widen_bf16_rows(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx ldd,
                            ltx_idx rows, ltx_idx cols)
{
    for (ltx_idx r = 0; r < rows; r++) {
        if (r + PREFETCH_ROWS < rows)
            prefetch_run(src + (r + PREFETCH_ROWS) * lds, cols * 2);
        widen_bf16(src + r * lds, dst + r * ldd, cols);
    }
}

/* The bf16 store's overflow count (kernels.h, LTX_BF16_OVERFLOW) over one call: how many, and
 * the least offset among them from the call's weight w0 (r * ldw + i), -1 for none. Results
 * are tested for an all-ones exponent (inf or NaN) as they are made, a test and a branch not
 * taken; only where one is found does the exact test run, lane by lane. */
typedef struct {
    ltx_idx count, first;
    const uint16_t *w0;
} overflow_count;

/* One element: out the result's bf16 bits, wbits the weight's, w where the weight lies. */
static inline void note_overflow(overflow_count *oc, const uint16_t *w, uint32_t wbits,
                                 uint32_t out)
{
    if (LTX_BF16_OVERFLOW(out, wbits)) {
        const ltx_idx at = w - oc->w0;
        oc->count++;
        if (oc->first < 0 || at < oc->first)
            oc->first = at;
    }
}

static inline void store_fused_row(const float *restrict acc, const uint16_t *w, uint16_t *out,
                                   ltx_idx n, overflow_count *oc)
{
    /* out may alias w (in-place fuse): each element is read before it is written. */
    for (ltx_idx i = 0; i < n; i++) {
        const uint32_t wbits = w[i];
        const float delta = ltx_bits_f32(ltx_bf16_high(acc[i]));
        const float sum = ltx_bits_f32(wbits << 16) + delta;
        const uint32_t h = ltx_bf16_high(sum) >> 16;
        out[i] = (uint16_t)h;
        if (__builtin_expect((h & 0x7F80u) == 0x7F80u, 0))
            note_overflow(oc, w + i, wbits, h);
    }
}

/* ---- The fuse of a small-rank adapter, product and rounding in registers ----
 *
 * out[i, j] = bf16(f32(w[i, j]) + f32(bf16(sum_p x[i, p] * y[p, j]))), the sum accumulated from
 * +0.0 in the order p = 0, 1, 2, ...: the same bits as seq_gemm into a zeroed c followed by
 * store_fused. At small ranks (tens of terms per element) the rounding is as much work as the
 * product; done here it costs no store and reload of an f32 tile.
 * Row blocks are the outer loop so that each weight row is read front to back, once. */

typedef uint16_t vu16 __attribute__((vector_size(VW * 2), aligned(2), may_alias));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

/* VW bf16 values widened to f32. Spelled with intrinsics on x86: GCC lowers the generic
 * conversion in 128-bit halves, three extra instructions and a second load per vector. */
static inline vf widen_vec(const uint16_t *p)
{
#if defined(LTX_VARIANT_AVX512)
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)),
                                 16);
#elif defined(LTX_VARIANT_AVX2)
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    const vu32 wide = __builtin_convertvector(*(const vu16 *)p, vu32) << 16;
    return (vf)wide;
#endif
}

/* ltx_bf16_high of each element (kernels.h), lane by lane. */
static inline vu32 bf16_high_vec(vf f)
{
    const vu32 u = (vu32)f;
    const vu32 rounded = LTX_BF16_NEAREST(u);
    const vu32 qnan = LTX_BF16_QNAN(u);
    const vu32 nan = (vu32)(f != f);
    return (rounded & ~nan) | (qnan & nan);
}

/* Stores the low halves of VW 32-bit values (each below 2**16) as VW uint16. */
static inline void store_low16(uint16_t *p, vu32 h)
{
#if defined(LTX_VARIANT_AVX512)
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16((__m512i)h));
#elif defined(LTX_VARIANT_AVX2)
    const __m256i v = (__m256i)h;
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(v),
                                                    _mm256_extracti128_si256(v, 1)));
#else
    *(vu16 *)p = __builtin_convertvector(h, vu16);
#endif
}


/* Whether any lane of v is non-zero. */
static inline int any_lane(vu32 v)
{
#if defined(LTX_VARIANT_AVX512)
    return _mm512_test_epi32_mask((__m512i)v, (__m512i)v) != 0;
#elif defined(LTX_VARIANT_AVX2)
    return !_mm256_testz_si256((__m256i)v, (__m256i)v);
#else
    uint32_t any = 0;
    for (int l = 0; l < VW; l++)
        any |= v[l];
    return any != 0;
#endif
}

/* Whether any lane of a mask (each lane all ones or zero) is set: one instruction where the
 * vector unit has a lane-sign gather or an across-lanes maximum. */
static inline int any_mask(vu32 mask)
{
#if defined(LTX_VARIANT_AVX512) || defined(LTX_VARIANT_AVX2)
    return any_lane(mask);
#elif defined(__SSE2__) && VW == 4
    return _mm_movemask_ps((__m128)mask) != 0;
#elif defined(__aarch64__) && VW == 4
    return vmaxvq_u32((uint32x4_t)mask) != 0;
#else
    return any_lane(mask);
#endif
}

/* The overflow count's exact test of VW results h (ltx_bf16_high bits), wide the widened
 * weight, w where it lies. */
static inline void note_overflow_vec(overflow_count *oc, const uint16_t *w, vf wide, vu32 h)
{
    const vu32 wbits = (vu32)wide;
    for (int l = 0; l < VW; l++)
        note_overflow(oc, w + l, wbits[l] >> 16, h[l] >> 16);
}

/* out[i] = bf16(f32(w[i]) + f32(bf16(acc[v][i]))) for NV vectors of VW elements, vector v at
 * w + v VW and out + v VW; out may equal w: every vector is loaded before any is stored. The
 * overflow test is one branch for the NV vectors. */
static inline __attribute__((always_inline)) void
fuse_vecs(const int NV, const vf *acc, const uint16_t *w, uint16_t *out, overflow_count *oc)
{
    vf wide[4];
    vu32 h[4], special = {0};
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++) {
        wide[v] = widen_vec(w + v * VW);
        h[v] = bf16_high_vec(wide[v] + (vf)bf16_high_vec(acc[v]));
        special |= (vu32)((h[v] & 0x7F800000u) == 0x7F800000u);
    }
    if (__builtin_expect(any_mask(special), 0))
        for (int v = 0; v < NV; v++)
            note_overflow_vec(oc, w + v * VW, wide[v], h[v]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; v++)
        store_low16(out + v * VW, h[v] >> 16);
}

/* out[i] = bf16(f32(w[i]) + f32(bf16(acc[i]))) for VW elements; out may equal w. */
static inline void fuse_vec(vf acc, const uint16_t *w, uint16_t *out, overflow_count *oc)
{
    fuse_vecs(1, &acc, w, out, oc);
}

#if defined(LTX_BF16_CONVERT)

/* out[i] = bf16(f32(w[i]) + f32(bf16(acc[i]))) for 32 elements, acc[0..15] in lo and
 * acc[16..31] in hi; out may equal w.
 * wv holds w[0..31], loaded by the caller.
 * VCVTNE2PS2BF16 rounds to nearest even exactly as ltx_bf16_high does, with two exceptions: it
 * flushes subnormal inputs to zero and it keeps a NaN's payload. Inputs of either kind are
 * found by VFPCLASSPS and the pair goes the generic way (rare: real weights hold neither).
 * The bf16 vectors are widened by even and odd halves of each 32-bit word (a shift and a mask,
 * no cross-lane moves); one word permute restores the order of the result. */
static inline void fuse_pair(vf lo, vf hi, __m512i wv, const uint16_t *w, uint16_t *out,
                             overflow_count *oc)
{
    enum { NAN_OR_SUBNORMAL = 0x01 | 0x20 | 0x80 };
    const __m512i high_half = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10,
                                                25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3,
                                                18, 2, 17, 1, 16, 0);
    const __m512 a0 = (__m512)lo, a1 = (__m512)hi;
    const __m512i delta = (__m512i)_mm512_cvtne2ps_pbh(a1, a0);
    const __m512 even = _mm512_add_ps((__m512)_mm512_slli_epi32(wv, 16),
                                      (__m512)_mm512_slli_epi32(delta, 16));
    const __m512 odd = _mm512_add_ps((__m512)_mm512_and_si512(wv, high_half),
                                     (__m512)_mm512_and_si512(delta, high_half));
    const __mmask16 special = _mm512_fpclass_ps_mask(a0, NAN_OR_SUBNORMAL) |
                              _mm512_fpclass_ps_mask(a1, NAN_OR_SUBNORMAL) |
                              _mm512_fpclass_ps_mask(even, NAN_OR_SUBNORMAL) |
                              _mm512_fpclass_ps_mask(odd, NAN_OR_SUBNORMAL);
    const __m512i sum = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
    /* A result of an all-ones exponent (inf; a NaN is special already) goes the generic way
     * too, which counts the overflows among them. */
    const __m512i exponent = _mm512_set1_epi16(0x7F80);
    const __mmask32 inf = _mm512_cmpeq_epi16_mask(_mm512_and_si512(sum, exponent), exponent);
    if (__builtin_expect((special | inf) != 0, 0)) {
        fuse_vec(lo, w, out, oc);
        fuse_vec(hi, w + 16, out + 16, oc);
        return;
    }
    _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, sum));
}

/* The rounding store of an R x 32 register block (R <= MR): acc[r][0..1] into row r of out.
 * Every row's weight is loaded before any row is stored: rows of a power-of-two width lie a
 * multiple of 32 KiB apart, and a load issued after a store to the same low address bits waits
 * on it. */
static inline __attribute__((always_inline)) void
store_block_rounded(const int R, vf acc[][2], const uint16_t *w, ltx_idx ldw, uint16_t *out,
                    ltx_idx ldo, overflow_count *oc)
{
    __m512i wv[MR];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        wv[r] = _mm512_loadu_si512(w + r * ldw);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        fuse_pair(acc[r][0], acc[r][1], wv[r], w + r * ldw, out + r * ldo, oc);
}
#endif

#if defined(LTX_VARIANT_AVX2)
/* The fuse panel's strips hold their columns in the order AVX2's word unpacks produce (see
 * panel_column): the widened weight then costs one unpack per vector instead of a zero-extend
 * and a shift, and one pack of two rounded vectors puts the 16 results back in column order,
 * with no permute. */
#define FUSE_UNPACK_ORDER
#endif

/* The weight column of position q (0 <= q < NR) in a full strip of the fuse panel. Natural
 * order, or with FUSE_UNPACK_ORDER the order of the two unpacks of 16 bf16 weights: vector
 * v = q / VW lane l = q % VW holds column 8 (l / 4) + 4 v + l % 4. */
static inline int panel_column(int q)
{
#if defined(FUSE_UNPACK_ORDER)
    const int v = q / VW, l = q % VW;
    return (l / 4) * 8 + v * 4 + l % 4;
#else
    return q;
#endif
}

/* dst = the fuse panel of k bf16 rows of n columns (src, row stride lds), widened: strips of NR
 * columns, strip s the k rows of columns s NR .. s NR + NR - 1 one after another (k x NR floats
 * from dst + s k NR), full strips in panel_column order; the last t = n % NR columns, a
 * partial strip, k rows of t in natural order: k x n floats in all. Each block of the fuse
 * then reads its strip front to back: in a row-major panel the rows of one strip lie a panel
 * row apart, a power of two that maps them to a few cache sets. */
static void pack_fuse_panel(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx k, ltx_idx n)
{
    const ltx_idx n_full = n - n % NR;
    u32a *d = (u32a *)dst;
    for (ltx_idx p = 0; p < k; p++) {
        const uint16_t *row = src + p * lds;
        if (p + PREFETCH_ROWS < k)
            prefetch_run(src + (p + PREFETCH_ROWS) * lds, n * 2);
        for (ltx_idx j = 0; j < n_full; j += NR) {
            u32a *strip_row = d + j * k + p * NR;
#if defined(FUSE_UNPACK_ORDER)
            /* The two unpacks of 16 weights are panel_column's order itself. */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(row + j));
            const __m256i zero = _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i *)strip_row, _mm256_unpacklo_epi16(zero, v));
            _mm256_storeu_si256((__m256i *)(strip_row + VW), _mm256_unpackhi_epi16(zero, v));
#else
            for (int q = 0; q < NR; q++)
                strip_row[q] = (uint32_t)row[j + panel_column(q)] << 16;
#endif
        }
        for (ltx_idx j = n_full; j < n; j++)
            d[n_full * k + p * (n - n_full) + (j - n_full)] = (uint32_t)row[j] << 16;
    }
}

#if defined(FUSE_UNPACK_ORDER)
/* Sixteen consecutive columns between column order (lo: columns 0-7, hi: 8-15) and
 * panel_column order (lo: 0-3 and 8-11, hi: 4-7 and 12-15): one exchange of 128-bit halves,
 * its own inverse. */
static inline void swap_strip_order(vf *lo, vf *hi)
{
    const vf a = *lo, b = *hi;
    *lo = (vf)_mm256_permute2f128_ps(a, b, 0x20);
    *hi = (vf)_mm256_permute2f128_ps(a, b, 0x31);
}

/* Lane by lane u + 0x7FFF + bit 16 of u, u the bits of f: its high half is bf16(f),
 * nearest-even, for an f that is not NaN (LTX_BF16_NEAREST before the mask). */
static inline __m256i bf16_carry_not_nan(__m256 f)
{
    const __m256i u = (__m256i)f;
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
}

/* out[c] = bf16(f32(w[c]) + f32(bf16(acc[c]))) for the 16 columns of one row of a full strip,
 * a0 and a1 its two accumulators in panel_column order; out may equal w. One check per row
 * finds a NaN among the products (UNORD is true where either operand is NaN) and a sum that
 * is NaN or rounds to inf (NLT_UQ: not below the least magnitude that rounds to inf, or
 * unordered); such a row is done element by element by the scalar rule, which gives a NaN its
 * quiet, signed form and counts the overflows. Elsewhere no lane is NaN, and the rounding
 * needs no NaN select. */
static inline void fuse_row_unpacked(vf a0, vf a1, const uint16_t *w, uint16_t *out,
                                     overflow_count *oc)
{
    const __m256i wv = _mm256_loadu_si256((const __m256i *)w);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    const __m256 d0 = (__m256)_mm256_and_si256(bf16_carry_not_nan((__m256)a0), high);
    const __m256 d1 = (__m256)_mm256_and_si256(bf16_carry_not_nan((__m256)a1), high);
    const __m256 s0 = _mm256_add_ps((__m256)_mm256_unpacklo_epi16(zero, wv), d0);
    const __m256 s1 = _mm256_add_ps((__m256)_mm256_unpackhi_epi16(zero, wv), d1);
    const __m256 magnitude = (__m256)_mm256_set1_epi32(0x7FFFFFFF);
    const __m256 rounds_to_inf = (__m256)_mm256_set1_epi32(0x7F7F8000);
    const __m256 big0 = _mm256_cmp_ps(_mm256_and_ps(s0, magnitude), rounds_to_inf, _CMP_NLT_UQ);
    const __m256 big1 = _mm256_cmp_ps(_mm256_and_ps(s1, magnitude), rounds_to_inf, _CMP_NLT_UQ);
    const __m256 nan = _mm256_or_ps(_mm256_cmp_ps((__m256)a0, (__m256)a1, _CMP_UNORD_Q),
                                    _mm256_or_ps(big0, big1));
    if (__builtin_expect(_mm256_movemask_ps(nan) != 0, 0)) {
        float a[NR];
        memcpy(a, &a0, sizeof a0);
        memcpy(a + VW, &a1, sizeof a1);
        for (int q = 0; q < NR; q++) {
            const int c = panel_column(q);
            store_fused_row(&a[q], w + c, out + c, 1, oc);
        }
        return;
    }
    _mm256_storeu_si256((__m256i *)out,
                        _mm256_packus_epi32(_mm256_srli_epi32(bf16_carry_not_nan(s0), 16),
                                            _mm256_srli_epi32(bf16_carry_not_nan(s1), 16)));
}

/* fuse_row_unpacked for the R rows of a register block. Not inlined: the accumulators pass
 * through memory (a few stores and loads a block), so that the rounding's constants are not
 * held in registers across the product loop, which has none to spare. */
static __attribute__((noinline)) void store_block_unpacked(int R, const vf acc[][NRV],
                                                           const uint16_t *w, ltx_idx ldw,
                                                           uint16_t *out, ltx_idx ldo,
                                                           overflow_count *oc)
{
    for (int r = 0; r < R; r++)
        fuse_row_unpacked(acc[r][0], acc[r][1], w + r * ldw, out + r * ldo, oc);
}
#endif

static ltx_idx store_fused(const float *acc, const uint16_t *w, ltx_idx ldw, uint16_t *out,
                           ltx_idx ldo, ltx_idx rows, ltx_idx cols, ltx_idx *first_over)
{
    overflow_count count = {0, -1, w}, *oc = &count;
#if defined(LTX_BF16_CONVERT)
    /* Blocks of MR rows, loads before stores within each (see store_block_rounded). */
    const ltx_idx pairs = cols - cols % 32;
    for (ltx_idx r0 = 0; r0 < rows; r0 += MR) {
        const int rb = (rows - r0 < MR) ? (int)(rows - r0) : MR;
        for (ltx_idx r = r0 + MR; r < r0 + 2 * MR && r < rows; r++)
            prefetch_run(w + r * ldw, cols * 2);
        for (ltx_idx i = 0; i < pairs; i += 32) {
            vf block[MR][2];
            for (int r = 0; r < rb; r++) {
                block[r][0] = LOADV(acc + (r0 + r) * cols + i);
                block[r][1] = LOADV(acc + (r0 + r) * cols + i + 16);
            }
            if (rb == MR)
                store_block_rounded(MR, block, w + r0 * ldw + i, ldw, out + r0 * ldo + i, ldo,
                                    oc);
            else
                for (int r = 0; r < rb; r++)
                    store_block_rounded(1, &block[r], w + (r0 + r) * ldw + i, ldw,
                                        out + (r0 + r) * ldo + i, ldo, oc);
        }
        for (ltx_idx r = r0; r < r0 + rb; r++)
            store_fused_row(acc + r * cols + pairs, w + r * ldw + pairs, out + r * ldo + pairs,
                            cols - pairs, oc);
    }
#else
    const ltx_idx full = cols - cols % NR;
    for (ltx_idx r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        if (r + PREFETCH_ROWS < rows)
            prefetch_run(w + (r + PREFETCH_ROWS) * ldw, cols * 2);
#if defined(FUSE_UNPACK_ORDER)
        /* 16 columns at a time, their sums put in panel_column order for fuse_row_unpacked */
        for (ltx_idx i = 0; i < full; i += NR) {
            vf lo = LOADV(a + i), hi = LOADV(a + i + VW);
            swap_strip_order(&lo, &hi);
            fuse_row_unpacked(lo, hi, w + r * ldw + i, out + r * ldo + i, oc);
        }
#else
        for (ltx_idx i = 0; i < full; i += NR) {
            vf sums[NRV];
            for (int v = 0; v < NRV; v++)
                sums[v] = LOADV(a + i + v * VW);
            fuse_vecs(NRV, sums, w + r * ldw + i, out + r * ldo + i, oc);
        }
#endif
        store_fused_row(a + full, w + r * ldw + full, out + r * ldo + full, cols - full, oc);
    }
#endif
    *first_over = count.first;
    return count.count;
}

/* The sums of an R x NR register block (R <= MR), from +0.0 in the order p = 0, 1, ...; y is
 * the block's strip of the fuse panel (row stride ldy = NR), its columns in panel_column
 * order, and so are acc's. */
static inline __attribute__((always_inline)) void
block_sums(const int R, ltx_idx k, const float *x, ltx_idx ldx, const float *y, ltx_idx ldy,
           vf acc[][NRV])
{
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NRV; v++)
            acc[r][v] = (vf){0};
    for (ltx_idx p = 0; p < k; p++) {
        vf yv[NRV];
        for (int v = 0; v < NRV; v++)
            yv[v] = LOADV(y + p * ldy + v * VW);
        for (int r = 0; r < R; r++) {
            const float xs = x[r * ldx + p];
            for (int v = 0; v < NRV; v++)
                acc[r][v] = acc[r][v] + yv[v] * xs;
        }
    }
}

/* The product alone of an R x NR block: c = its sums, row stride ldc, in column order. */
static inline __attribute__((always_inline)) void
product_block(const int R, ltx_idx k, const float *x, ltx_idx ldx, const float *y,
              ltx_idx ldy, float *c, ltx_idx ldc)
{
    vf acc[MR][NRV];
    block_sums(R, k, x, ldx, y, ldy, acc);
    for (int r = 0; r < R; r++) {
#if defined(FUSE_UNPACK_ORDER)
        swap_strip_order(&acc[r][0], &acc[r][1]);
#endif
        for (int v = 0; v < NRV; v++)
            STOREV(c + r * ldc + v * VW, acc[r][v]);
    }
}

/* out[r, v] = bf16(w[r, v] + bf16(acc[r][v])) over a register block: the fuse's last step.
 * out may alias w (in-place fuse): each vector is read before it is written. Unrolled, so
 * that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void
store_block_fused(const int R, vf acc[MR][NRV], const uint16_t *w, ltx_idx ldw, uint16_t *out,
                  ltx_idx ldo, overflow_count *oc)
{
#if defined(LTX_BF16_CONVERT) && NRV == 2
    store_block_rounded(R, acc, w, ldw, out, ldo, oc);
#elif defined(FUSE_UNPACK_ORDER)
    store_block_unpacked(R, acc, w, ldw, out, ldo, oc);
#else
#pragma GCC unroll 16
    for (int r = 0; r < R; r++)
        fuse_vecs(NRV, acc[r], w + r * ldw, out + r * ldo, oc);
#endif
}

/* The fuse of an R x NR block: its sums rounded and added to w, into out. */
static inline __attribute__((always_inline)) void
fuse_block(const int R, ltx_idx k, const float *x, ltx_idx ldx, const float *y, ltx_idx ldy,
           const uint16_t *w, ltx_idx ldw, uint16_t *out, ltx_idx ldo, overflow_count *oc)
{
    vf acc[MR][NRV];
    block_sums(R, k, x, ldx, y, ldy, acc);
    store_block_fused(R, acc, w, ldw, out, ldo, oc);
}

/* How far ahead of the block being fused its weight lines are asked for, in blocks of MR x NR:
 * about FUSE_AHEAD_TERMS terms of product ahead (the time a line takes to arrive from memory),
 * and at least two blocks. The hardware prefetcher does not follow a tile's rows (a few hundred
 * bytes each, then a jump); a whole row block ahead is too far (its lines are evicted before
 * use). */
#define FUSE_AHEAD_TERMS 256
static inline ltx_idx fuse_ahead(ltx_idx k) { return 2 + FUSE_AHEAD_TERMS / (k > 0 ? k : 1); }

/* Asks for the weight lines of the block at column j of row block i, continuing into the row
 * blocks that follow past the end of a row. */
static inline void fuse_prefetch(const uint16_t *w, ltx_idx ldw, ltx_idx m, ltx_idx n_full,
                                 ltx_idx i, ltx_idx j)
{
    if (j >= n_full) {
        i += MR * (j / n_full);
        j %= n_full;
    }
    for (ltx_idx r = i; r < i + MR && r < m; r++) {
        __builtin_prefetch(w + r * ldw + j, 0, 3);
        __builtin_prefetch(w + r * ldw + j + NR - 1, 0, 3);
    }
}

#if defined(LTX_DOT_PAIRS)
/* The register block of the dot-product fuse (and, on x86, Linear): acc[r][v] = the sums, from
 * +0.0 over pairs q = 0 .. kp-1 in order, of row r's pair q (4 bytes at xb + r * row_bytes +
 * 4 q, any alignment) broadcast against vector v of yp's row q (NR columns of pairs, row stride
 * ldyp), the pair's high element's product added first, then the low one's, each rounded:
 * VDPBF16PS on x86 (subnormals flushed), BFMLALT then BFMLALB on Arm (each a fused
 * multiply-add, so the textbook step wherever the product is exact in f32).
 * With `ahead`, the lines of the R rows laid out as xb's at `ahead` are asked for into L1 as
 * the block runs, a line a row every 16 pairs: rows too short a run for the hardware's
 * prefetcher to find (the Linear's weight rows, a chunk at a time). */
static inline __attribute__((always_inline)) void
dot_sums(const int R, ltx_idx kp, const char *xb, ltx_idx row_bytes, const uint32_t *yp,
         ltx_idx ldyp, const char *ahead, vf acc[MR][NRV])
{
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NRV; v++)
            acc[r][v] = (vf){0};
    for (ltx_idx q0 = 0; q0 < kp; q0 += 16) {
        const ltx_idx q1 = kp - q0 < 16 ? kp : q0 + 16;
        if (ahead)
            for (int r = 0; r < R; r++)
                __builtin_prefetch(ahead + r * row_bytes + 4 * q0, 0, 3);
        for (ltx_idx q = q0; q < q1; q++) {
#if defined(LTX_ARM_BF16)
            bfloat16x8_t yv[NRV];
            for (int v = 0; v < NRV; v++)
                yv[v] = vreinterpretq_bf16_u32(vld1q_u32(yp + q * ldyp + v * VW));
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, xb + r * row_bytes + 4 * q, 4);
                const bfloat16x8_t xs = vreinterpretq_bf16_u32(vdupq_n_u32(pair));
                for (int v = 0; v < NRV; v++) {
                    /* the odd bf16 lanes are the pairs' high halves: term 2q first */
                    float32x4_t a = vbfmlaltq_f32((float32x4_t)acc[r][v], xs, yv[v]);
                    acc[r][v] = (vf)vbfmlalbq_f32(a, xs, yv[v]);
                }
            }
#else
            __m512bh yv[NRV];
            for (int v = 0; v < NRV; v++)
                yv[v] = (__m512bh)_mm512_loadu_si512(yp + q * ldyp + v * VW);
            for (int r = 0; r < R; r++) {
                uint32_t pair;
                memcpy(&pair, xb + r * row_bytes + 4 * q, 4);
                const __m512bh xs = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int v = 0; v < NRV; v++)
                    acc[r][v] = (vf)_mm512_dpbf16_ps((__m512)acc[r][v], xs, yv[v]);
            }
#endif
        }
    }
}

/* dot_fuse_bf16's register tile: R rows x NR columns, as fuse_block. */
static inline __attribute__((always_inline)) void
dot_block(const int R, ltx_idx kp, const uint32_t *xp, ltx_idx ldxp, const uint32_t *yp,
          ltx_idx ldyp, const uint16_t *w, ltx_idx ldw, uint16_t *out, ltx_idx ldo,
          overflow_count *oc)
{
    vf acc[MR][NRV];
    dot_sums(R, kp, (const char *)xp, 4 * ldxp, yp, ldyp, NULL, acc);
    store_block_fused(R, acc, w, ldw, out, ldo, oc);
}

/* dot_sums' block stored alone to c (row stride ldc): dot_product_bf16's register tile, and
 * the dot-product Linear's panel block (the weight rows' pairs broadcast where they lie). */
static inline __attribute__((always_inline)) void
dot_sums_to(const int R, ltx_idx kp, const char *xb, ltx_idx row_bytes, const uint32_t *yp,
            ltx_idx ldyp, float *c, ltx_idx ldc)
{
    vf acc[MR][NRV];
    dot_sums(R, kp, xb, row_bytes, yp, ldyp, NULL, acc);
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NRV; v++)
            STOREV(c + r * ldc + v * VW, acc[r][v]);
}
#endif

/* What the walk below does with each block's sums: the fuse from the fuse panel, the fuse
 * from bf16 pairs (dot_block), or the product alone, stored to c, from the fuse panel or from
 * bf16 pairs (dot_sums_to). */
enum walk_kind { WALK_FUSE, WALK_PAIRS, WALK_PRODUCT, WALK_PAIRS_PRODUCT };

static inline __attribute__((always_inline)) void
walk_block(const enum walk_kind kind, const int R, ltx_idx k, const void *x, ltx_idx ldx,
           const void *y, ltx_idx ldy, const uint16_t *w, ltx_idx ldw, uint16_t *out,
           ltx_idx ldo, float *c, ltx_idx ldc, overflow_count *oc)
{
#if defined(LTX_DOT_PAIRS)
    if (kind == WALK_PAIRS) {
        dot_block(R, k, x, ldx, y, ldy, w, ldw, out, ldo, oc);
        return;
    }
    if (kind == WALK_PAIRS_PRODUCT) {
        dot_sums_to(R, k, x, 4 * ldx, y, ldy, c, ldc);
        return;
    }
#endif
    if (kind == WALK_PRODUCT)
        product_block(R, k, x, ldx, y, ldy, c, ldc);
    else
        fuse_block(R, k, x, ldx, y, ldy, w, ldw, out, ldo, oc);
}

/* The walk of a small-rank fuse (or of its product alone) over its tile, row blocks outer:
 * MR x NR register blocks, the last rows one block of their own height, the last columns one
 * element at a time. WALK_PAIRS and WALK_PAIRS_PRODUCT: x and y are bf16 pairs
 * (dot_fuse_bf16's layout, k counting pairs, y row-major with row stride ldy) for the
 * dot-product block; else f32, y the fuse panel (pack_fuse_panel). Both layouts have 4-byte
 * elements, so one pointer arithmetic serves. The products write the sums to c (row stride
 * ldc) and read no w. */
static inline __attribute__((always_inline)) void
fuse_walk(const enum walk_kind kind, ltx_idx m, ltx_idx n, ltx_idx k, const void *x,
          ltx_idx ldx, const void *y, ltx_idx ldy, const uint16_t *w, ltx_idx ldw,
          uint16_t *out, ltx_idx ldo, float *c, ltx_idx ldc, overflow_count *oc)
{
    const int pairs = kind == WALK_PAIRS || kind == WALK_PAIRS_PRODUCT;
    const int product = kind == WALK_PRODUCT || kind == WALK_PAIRS_PRODUCT;
    const float *xf = x, *yf = y;
    const uint32_t *xp = x, *yp = y;
    const ltx_idx n_full = n - n % NR;
    /* The row stride of a block's y: the pairs' row-major panel, or the strip. */
    const ltx_idx ldy_block = pairs ? ldy : NR;
    const ltx_idx ahead = fuse_ahead(pairs ? 2 * k : k);
    for (ltx_idx i = 0; i < m; i += MR) {
        const ltx_idx rows = (m - i < MR) ? m - i : MR;
        for (ltx_idx j = 0; j < n_full; j += NR) {
            const float *yb = pairs ? yf + j : yf + j * k;  /* strip j / NR starts at j k */
            /* the block's place in w and out, or in c */
            const uint16_t *wb = product ? w : w + i * ldw + j;
            uint16_t *ob = product ? out : out + i * ldo + j;
            float *cb = product ? c + i * ldc + j : c;
            if (!product)
                fuse_prefetch(w, ldw, m, n_full, i, j + ahead * NR);
            /* The last rows as one block of their own height: one row at a time has too few
             * independent sums to cover the FMA latency. Every table's MR is 4 to 8. */
            switch (rows) {
#define ROWS_CASE(R)                                                                          \
            case R:                                                                           \
                walk_block(kind, R, k, xf + i * ldx, ldx, yb, ldy_block, wb, ldw, ob, ldo, cb,   \
                           ldc, oc);                                                          \
                break;
                ROWS_CASE(MR)
                ROWS_CASE(1)
                ROWS_CASE(2)
                ROWS_CASE(3)
#if MR > 4
                ROWS_CASE(4)
#endif
#if MR > 5
                ROWS_CASE(5)
#endif
#if MR > 6
                ROWS_CASE(6)
#endif
#if MR > 7
                ROWS_CASE(7)
#endif
#undef ROWS_CASE
            }
        }
        for (ltx_idx r = i; r < i + rows; r++)
            for (ltx_idx j = n_full; j < n; j++) {
                float acc = 0.0f;
                for (ltx_idx p = 0; p < k; p++) {
                    if (pairs) {
                        /* A pair's products, exact in f32, added high then low: the
                         * instruction's arithmetic. */
                        const uint32_t a = xp[r * ldx + p], b = yp[p * ldy + j];
                        acc = acc + ltx_bits_f32(a & 0xFFFF0000u) * ltx_bits_f32(b & 0xFFFF0000u);
                        acc = acc + ltx_bits_f32(a << 16) * ltx_bits_f32(b << 16);
                    } else {
                        /* the partial strip, in natural order */
                        acc = acc + xf[r * ldx + p] *
                                    yf[n_full * k + p * (n - n_full) + (j - n_full)];
                    }
                }
                if (product)
                    c[r * ldc + j] = acc;
                else
                    store_fused_row(&acc, w + r * ldw + j, out + r * ldo + j, 1, oc);
            }
    }
}

/* y: the fuse panel of k rows of n columns (pack_fuse_panel); ldy is not used. */
static ltx_idx seq_fuse_bf16(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                             const float *y, ltx_idx ldy, const uint16_t *w, ltx_idx ldw,
                             uint16_t *out, ltx_idx ldo, ltx_idx *first_over)
{
    overflow_count count = {0, -1, w};
    fuse_walk(WALK_FUSE, m, n, k, x, ldx, y, ldy, w, ldw, out, ldo, NULL, 0, &count);
    *first_over = count.first;
    return count.count;
}

/* c = x @ y, each sum from +0.0 in the order p = 0, 1, ...; y the fuse panel of k rows of n
 * columns (pack_fuse_panel), c with row stride ldc. */
static void seq_product_panel(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                              const float *y, float *c, ltx_idx ldc)
{
    fuse_walk(WALK_PRODUCT, m, n, k, x, ldx, y, 0, NULL, 0, NULL, 0, c, ldc, NULL);
}

static void pack_pairs_rows(const uint16_t *src, ltx_idx lds, uint32_t *dst, ltx_idx rows,
                            ltx_idx cols)
{
    for (ltx_idx q = 0; 2 * q < rows; q++) {
        const uint16_t *hi = src + 2 * q * lds;
        uint32_t *d = dst + q * cols;
        if (2 * q + 1 < rows) {
            const uint16_t *lo = hi + lds;
            for (ltx_idx j = 0; j < cols; j++)
                d[j] = (uint32_t)hi[j] << 16 | lo[j];
        } else {
            for (ltx_idx j = 0; j < cols; j++)
                d[j] = (uint32_t)hi[j] << 16;
        }
    }
}

static void pack_pairs_cols(const float *src, ltx_idx lds, uint32_t *dst, ltx_idx ldd,
                            ltx_idx rows, ltx_idx cols)
{
    for (ltx_idx i = 0; i < rows; i++) {
        const u32a *s = (const u32a *)(src + i * lds);
        for (ltx_idx q = 0; 2 * q < cols; q++) {
            const uint32_t lo = (2 * q + 1 < cols) ? s[2 * q + 1] >> 16 : 0;
            dst[i * ldd + q] = (s[2 * q] & 0xFFFF0000u) | lo;
        }
    }
}

#if defined(LTX_DOT_PAIRS)
static ltx_idx dot_fuse_bf16(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                             ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, const uint16_t *w,
                             ltx_idx ldw, uint16_t *out, ltx_idx ldo, ltx_idx *first_over)
{
    overflow_count count = {0, -1, w};
    fuse_walk(WALK_PAIRS, m, n, kp, xp, ldxp, yp, ldyp, w, ldw, out, ldo, NULL, 0, &count);
    *first_over = count.first;
    return count.count;
}

static void dot_product_bf16(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                             ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, float *c,
                             ltx_idx ldc)
{
    fuse_walk(WALK_PAIRS_PRODUCT, m, n, kp, xp, ldxp, yp, ldyp, NULL, 0, NULL, 0, c, ldc,
              NULL);
}
#endif

/* ---- A Linear's product for a few rows of x, straight from bf16 weight rows ----
 *
 * acc[o * mt + m] += sum_{k < kt} x[m, k] * f32(w[o, k])   for m < mt, o < n.
 *
 * For each (m, o), VW lane sums run over k = j, j + VW, j + 2 VW, ... (lane j), each in k order
 * from +0.0 within blocks of STREAM_BLOCK elements; the blocks' lane sums are added up in order,
 * the lanes combined by a fixed halving tree, the k tail (kt % VW terms) added after them in k
 * order, and the result added to acc. Fixed by the code, so deterministic; the blocks keep each
 * lane's run of sequential additions short (STREAM_BLOCK / VW), as a BLAS's blocking does.
 *
 * Blocks are the outer loop: a block of x (mt x STREAM_BLOCK f32, 16 KiB a row) stays in cache
 * while every weight row's block streams past it once, so x is read from memory once per call
 * rather than once per weight row -- at few rows of x it would otherwise be read more often
 * than the weight itself. The blocks' lane sums wait in `lanes` ([n, mt] vectors).
 * Register tile: R weight rows x MM rows of x; both are compile-time constants per call site. */
/* Weight elements ahead of the one being read that are asked for, into L1 (512 bytes a row, 4 KiB
 * over 8 rows read together); past the end of a row's block it continues into the block
 * of the rows that come next. Far enough ahead to cover the memory latency, near enough that
 * the lines are not evicted before use. */
#define STREAM_AHEAD 256
#define STREAM_BLOCK LTX_STREAM_BLOCK

/* Keeps a loaded vector in a register: x86 compilers otherwise fold the load into every FMA
 * that uses it, loading it once per weight row instead of once. */
#if defined(__x86_64__) || defined(__i386__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) ((void)0)
#endif

static inline float lane_tree(vf v)
{
    float t[VW];
    memcpy(t, &v, sizeof t);
    for (int h = VW / 2; h >= 1; h /= 2)
        for (int i = 0; i < h; i++)
            t[i] = t[i] + t[i + h];
    return t[0];
}

/* The register tile: SR weight rows x SM rows of x, SR * SM accumulators (plus SR + 1 vectors
 * in flight) within 32 registers, or 16 with AVX2. AVX-512 takes 8 rows of x at a time although
 * 32 accumulators leave the compiler a few spills: each widened weight vector then feeds 8
 * FMAs rather than 4, which outweighs the spills. */
#if defined(LTX_VARIANT_AVX2)
#define SM 4
#define SR 3
#elif defined(LTX_VARIANT_AVX512)
#define SM 8
#define SR 4
#else
#define SM 4
#define SR 4
#endif

/* With few rows of x the product is bound by memory, and what bounds one core's read rate is
 * how many weight rows stream at once (each its own run of cache misses), not the arithmetic:
 * 8 rows read together, where their accumulators fit the registers, and 4 up to 4 rows of x.
 * More rows together than the registers hold accumulators for spill and lose more than the
 * extra streams gain. Arm: the same rule by register count, 8 weight rows by 2 rows of x
 * filling 26 of the 32 registers. (The tuning runs: bench/results/amd-epyc-zen4-avx512bf16/
 * tuning.md.) */
#if defined(LTX_VARIANT_AVX2)
#define FEW8 1
#define FEW4 4
#elif defined(LTX_VARIANT_AVX512)
#define FEW8 4
#define FEW4 4
#else
#define FEW8 2
#define FEW4 4
#endif

/* Weight rows in one register tile, by the rows of x in a task. */
static inline int stream_rows(ltx_idx mt) { return mt <= FEW8 ? 8 : mt <= FEW4 ? 4 : SR; }

/* One block (len elements, a multiple of VW) of R weight rows against MM rows of x, its lane
 * sums added into lanes[r * mt + m]; `next` is where the rows read after these start. */
/* Where element `at` of weight row r lies for a lane block of len elements starting at w: in
 * the block, or past its end in the next block's rows (next), as the walk below hands them
 * on -- what the streaming tiles prefetch ahead. */
static inline const uint16_t *row_ahead(const uint16_t *w, const uint16_t *next, int r,
                                        ltx_idx ldw, ltx_idx at, ltx_idx len)
{
    return at < len ? w + r * ldw + at : next + r * ldw + (at - len);
}

static inline __attribute__((always_inline)) void
stream_block(const int MM, const int R, ltx_idx len, const float *x, ltx_idx ldx,
             const uint16_t *w, ltx_idx ldw, const uint16_t *next, float *lanes, ltx_idx mt)
{
    vf s[8][SM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++)
            s[r][m] = (vf){0};
    for (ltx_idx k = 0; k < len; k += VW) {
        vf wv[8];
        const ltx_idx ahead = k + STREAM_AHEAD;
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(row_ahead(w, next, r, ldw, ahead, len), 0, 3);
            wv[r] = widen_vec(w + r * ldw + k);
        }
        for (int m = 0; m < MM; m++) {
            vf xv = LOADV(x + m * ldx + k);
            IN_REGISTER(xv);
            for (int r = 0; r < R; r++)
                s[r][m] = s[r][m] + xv * wv[r];
        }
    }
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) {
            float *lane = lanes + (r * mt + m) * VW;
            STOREV(lane, LOADV(lane) + s[r][m]);
        }
}

#define STREAM_CASE(MM)                                                                       \
    case MM:                                                                                  \
        if (MM <= FEW8 && R == 8)                                                             \
            stream_block(MM, 8, len, xb, ldx, wb, ldw, next, lb, mt);                         \
        else if (MM <= FEW4 && R == 4)                                                        \
            stream_block(MM, 4, len, xb, ldx, wb, ldw, next, lb, mt);                         \
        else if (R == SR)                                                                     \
            stream_block(MM, SR, len, xb, ldx, wb, ldw, next, lb, mt);                        \
        else                                                                                  \
            stream_block(MM, 1, len, xb, ldx, wb, ldw, next, lb, mt);                         \
        break;

/* The cases of a lane-sum tile's switch on its rows of x, up to 4. */
#define TILE_CASES(CASE) CASE(1) CASE(2) CASE(3) CASE(4)

/* One register tile of the streaming kernel: mm rows of x (at most SM) against R weight rows. */
static inline __attribute__((always_inline)) void
stream_tile(ltx_idx mm, ltx_idx R, ltx_idx len, const float *xb, ltx_idx ldx, const uint16_t *wb,
            ltx_idx ldw, const uint16_t *next, float *lb, ltx_idx mt)
{
    switch (mm) {
        TILE_CASES(STREAM_CASE)
#if SM > 4
        STREAM_CASE(5)
        STREAM_CASE(6)
#endif
#if SM > 6
        STREAM_CASE(7)
        STREAM_CASE(8)
#endif
    }
}

#if defined(LTX_DOT_PAIRS)
static inline __attribute__((always_inline)) void
dot_tile(ltx_idx mm, ltx_idx R, ltx_idx len, const uint16_t *xb, ltx_idx ldx, const uint16_t *wb,
         ltx_idx ldw, const uint16_t *next, float *lb, ltx_idx mt);
#endif

/* The walk of the two lane-sum kernels, stream_wxt (f32 x, dot = 0) and dot_stream_wxt (bf16
 * x, dot = 1): lane blocks of `block` elements in vectors of `vec`, tiles of up to `xrows`
 * rows of x by `tile_rows` weight rows. x is held in spans of about `span_rows` rows' worth of
 * blocks (256 KiB for the streaming kernel, 128 KiB for the dot-product one); within one,
 * each weight row is read in one run of up to 16 blocks, long enough for the hardware
 * prefetcher. With 4 rows of x or fewer the product is bound by memory, and the span is the
 * whole row. */
static inline __attribute__((always_inline)) void
lanes_walk(const int dot, ltx_idx vec, ltx_idx block, ltx_idx xrows, ltx_idx span_rows,
           ltx_idx tile_rows, ltx_idx mt, ltx_idx n, ltx_idx kt, const void *x, ltx_idx ldx,
           const uint16_t *w, ltx_idx ldw, float *acc, float *lanes)
{
    const float *xf = x;
    const uint16_t *xh = x;
    const ltx_idx kv = kt - kt % vec;
    const ltx_idx span = mt <= 4 ? kv + block : block * (mt < span_rows ? span_rows / mt : 1);
    for (ltx_idx i = 0; i < n * mt * VW; i++)
        lanes[i] = 0.0f;
    for (ltx_idx s0 = 0; s0 < kv; s0 += span) {
        const ltx_idx s1 = (kv - s0 < span) ? kv : s0 + span;
        /* tile_rows weight rows at a time, the last few one by one. */
        for (ltx_idx o = 0, R; o < n; o += R) {
            R = (n - o >= tile_rows) ? tile_rows : 1;
            for (ltx_idx k0 = s0; k0 < s1; k0 += block) {
                const ltx_idx len = (s1 - k0 < block) ? s1 - k0 : block;
                const uint16_t *wb = w + o * ldw + k0;
                const uint16_t *next = (k0 + len < s1) ? wb + len
                                       : (o + R < n) ? w + (o + R) * ldw + s0
                                                     : w + (s1 < kv ? s1 : s0);
                /* Rows of x xrows at a time; this block of the weight rows stays in cache. */
                for (ltx_idx m0 = 0; m0 < mt; m0 += xrows) {
                    const ltx_idx mm = (mt - m0 < xrows) ? mt - m0 : xrows;
                    float *lb = lanes + (o * mt + m0) * VW;
#if defined(LTX_DOT_PAIRS)
                    if (dot) {
                        dot_tile(mm, R, len, xh + m0 * ldx + k0, ldx, wb, ldw, next, lb, mt);
                        continue;
                    }
#endif
                    stream_tile(mm, R, len, xf + m0 * ldx + k0, ldx, wb, ldw, next, lb, mt);
                }
            }
        }
    }
    for (ltx_idx o = 0; o < n; o++)
        for (ltx_idx m = 0; m < mt; m++) {
            float sum = lane_tree(LOADV(lanes + (o * mt + m) * VW));
            for (ltx_idx k = kv; k < kt; k++)
                sum = sum + (dot ? ltx_bf16_value(xh[m * ldx + k]) : xf[m * ldx + k]) *
                            ltx_bf16_value(w[o * ldw + k]);
            acc[o * mt + m] = acc[o * mt + m] + sum;
        }
}

static void stream_wxt(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                       const uint16_t *w, ltx_idx ldw, float *acc, float *lanes)
{
    lanes_walk(0, VW, STREAM_BLOCK, SM, 16, stream_rows(mt), mt, n, kt, x, ldx, w, ldw, acc,
               lanes);
}

#if defined(LTX_DOT_PAIRS)
/* ---- The Linear on bf16 x: two products per instruction, straight from both operands' rows ----
 *
 * x and the weight both hold k contiguously, and a vector of 2 VW bf16 from each is exactly
 * what the instruction pairs. x86 (VDPBF16PS, 16 lanes): lane j adds x[2j+1] w[2j+1], then
 * x[2j] w[2j], each rounded. Arm (BFDOT, 4 lanes): lane j adds x[2j] w[2j] + x[2j+1] w[2j+1],
 * the exact products' sum rounded to odd, to its sum, rounded to odd again. Both flush
 * subnormal inputs, products and sums. So neither operand is widened or packed; a (weight row,
 * row of x) pair's VW lane sums restart every LTX_DOT_BLOCK elements, as the streaming kernel's
 * restart every LTX_STREAM_BLOCK, and the rest of the order is stream_wxt's. Register tile: DR
 * weight rows x DM rows of x, 16 accumulators (8 loads a 16 instructions; 4 x 6 and 6 x 4 tiles
 * measured slower on x86); up to DOT_FEW8 rows of x, 8 weight rows, for the memory streams, as
 * in stream_wxt (on Arm 8 x 2, the accumulators that 32 registers hold with the loads). (Tuning
 * runs: bench/results/amd-epyc-zen4-avx512bf16/tuning.md.) */
#define DOT_BLOCK LTX_DOT_BLOCK
#define DOT_VEC (2 * VW)
/* kernels.h's dot_pair_units: two nearest-even roundings a pair, or two to odd. */
#if defined(LTX_ARM_BF16)
#define DOT_PAIR_UNITS 4
#else
#define DOT_PAIR_UNITS 2
#endif
#define DR 4
#define DM 4
#if defined(LTX_ARM_BF16)
#define DOT_FEW8 2
#else
#define DOT_FEW8 4
#endif
/* Weight elements ahead asked for into L1, as STREAM_AHEAD; and with more rows of x than
 * DOT_FEW8, also DOT_FAR ahead into L2: the first row group to use a block of weight rows
 * consumes them twice as fast as the streaming kernel does (no widening), in bursts that
 * the hardware prefetcher alone does not keep up with. With few rows the 8 rows' streams
 * suffice and the extra requests only cost. */
#define DOT_AHEAD 256
#define DOT_FAR 2048
_Static_assert(DM == 4, "dot_stream_wxt has a case for every row count up to DM");

static inline __attribute__((always_inline)) void
dot_stream_block(const int MM, const int R, const int FAR, ltx_idx len, const uint16_t *x,
                 ltx_idx ldx, const uint16_t *w, ltx_idx ldw, const uint16_t *next, float *lanes,
                 ltx_idx mt)
{
#if defined(LTX_ARM_BF16)
#define DOT_LOAD(p) vreinterpretq_bf16_u16(vld1q_u16(p))
#define DOT_STEP(s, x, w) vbfdotq_f32(s, x, w)
    typedef float32x4_t sum_t;
    typedef bfloat16x8_t pairs_t;
#else
#define DOT_LOAD(p) ((__m512bh)_mm512_loadu_si512(p))
#define DOT_STEP(s, x, w) _mm512_dpbf16_ps(s, x, w)
    typedef __m512 sum_t;
    typedef __m512bh pairs_t;
#endif
    sum_t s[8][DM];
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++)
            s[r][m] = (sum_t)(vf){0};
    for (ltx_idx k = 0; k < len; k += DOT_VEC) {
        pairs_t wv[8];
        const ltx_idx ahead = k + DOT_AHEAD;
        for (int r = 0; r < R; r++) {
            __builtin_prefetch(row_ahead(w, next, r, ldw, ahead, len), 0, 3);
            if (FAR)
                __builtin_prefetch(row_ahead(w, next, r, ldw, k + DOT_FAR, len), 0, 2);
            wv[r] = DOT_LOAD(w + r * ldw + k);
        }
        for (int m = 0; m < MM; m++) {
            pairs_t xv = DOT_LOAD(x + m * ldx + k);
            IN_REGISTER(xv);
            for (int r = 0; r < R; r++)
                s[r][m] = DOT_STEP(s[r][m], xv, wv[r]);
        }
    }
#undef DOT_LOAD
#undef DOT_STEP
    for (int r = 0; r < R; r++)
        for (int m = 0; m < MM; m++) {
            float *lane = lanes + (r * mt + m) * VW;
            STOREV(lane, LOADV(lane) + (vf)s[r][m]);
        }
}

#define DOT_CASE(MM)                                                                          \
    case MM:                                                                                  \
        if (MM <= DOT_FEW8 && R == 8)                                                         \
            dot_stream_block(MM, 8, 0, len, xb, ldx, wb, ldw, next, lb, mt);                  \
        else if (R == DR)                                                                     \
            dot_stream_block(MM, DR, 1, len, xb, ldx, wb, ldw, next, lb, mt);                 \
        else                                                                                  \
            dot_stream_block(MM, 1, 1, len, xb, ldx, wb, ldw, next, lb, mt);                  \
        break;

static inline __attribute__((always_inline)) void
dot_tile(ltx_idx mm, ltx_idx R, ltx_idx len, const uint16_t *xb, ltx_idx ldx, const uint16_t *wb,
         ltx_idx ldw, const uint16_t *next, float *lb, ltx_idx mt)
{
    switch (mm) {
        TILE_CASES(DOT_CASE)
    }
}

static void dot_stream_wxt(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint16_t *x, ltx_idx ldx,
                           const uint16_t *w, ltx_idx ldw, float *acc, float *lanes)
{
    lanes_walk(1, DOT_VEC, DOT_BLOCK, DM, 64, mt <= DOT_FEW8 ? 8 : DR, mt, n, kt, x, ldx, w, ldw,
               acc, lanes);
}
#undef DOT_CASE

/* The pairs q0 .. kt / 2 - 1 of strip s (rows s LTX_DOT_PANEL_STRIP on, mt in all) laid out a
 * row of the strip's pairs at a time (strip + q LTX_DOT_PANEL_STRIP + j), then an odd last
 * element alone in its pair's low half; zero past row mt: pack_x_pairs' last pairs, which the
 * vector loops leave. */
static void pack_last_pairs(const uint16_t *x, ltx_idx ldx, ltx_idx mt, ltx_idx kt,
                            uint32_t *strip, ltx_idx s, ltx_idx q0)
{
    const ltx_idx S = LTX_DOT_PANEL_STRIP, kp = kt / 2;
    for (ltx_idx j = 0; j < S; j++) {
        const ltx_idx row = s * S + j;
        for (ltx_idx q = q0; q < kp; q++) {
            uint32_t v = 0;
            if (row < mt)
                memcpy(&v, x + row * ldx + 2 * q, 4);
            strip[q * S + j] = v;
        }
        if (kt & 1)
            strip[kp * S + j] = row < mt ? x[row * ldx + kt - 1] : 0;
    }
}
#endif

#if defined(LTX_BF16_CONVERT)
/* ---- The dot-product Linear with many rows of x: x packed, the weight broadcast ----
 *
 * dot_stream_wxt loads a full vector of each operand for every 16 products a lane pair, which
 * L2 cannot feed at the instruction's rate once x no longer fits L1. Here x comes packed into
 * strips of NR rows, pairs transposed (pack_x_pairs: strip s, pair q: the pairs of rows
 * s NR .. s NR + NR - 1), and the fuse's register block runs over it: per pair, NRV vectors of
 * the strip and one broadcast pair of each of MR weight rows, read where they lie -- a row
 * block at a time through the whole call, so that each weight row is read in one run. Each
 * chunk's sum of an output (LTX_DOT_PANEL_CHUNK elements from the call's first) starts from
 * +0.0 and adds its pairs in order (the higher element's product, then the lower's, as the
 * instruction does), then an odd last element, and is added to acc. */

/* r[j] = column j of the 16 x 16 matrix of 32-bit elements whose rows r held. */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int i = 0; i < 4; i++) {
            t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
            t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xDD);
        }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    }
}

/* xs[s lds + q NR + j] = the bf16 pair at x[(s NR + j), 2q] (elements 2q, 2q + 1) for the
 * (kt + 1) / 2 pairs of kt elements; an odd last element alone in its pair's low half; zero
 * rows past mt up to a whole strip. 16 pairs by 16 rows at a time, by transposes (a copy of
 * one pair at a time took a quarter of the Linear's time), the last pairs one at a time. */
static void pack_x_pairs(const uint16_t *x, ltx_idx ldx, ltx_idx mt, ltx_idx kt, uint32_t *xs,
                         ltx_idx lds)
{
    const ltx_idx strips = (mt + NR - 1) / NR, kp = kt / 2, kv = kp - kp % 16;
    for (ltx_idx s = 0; s < strips; s++) {
        uint32_t *strip = xs + s * lds;
        /* Both halves of a pair's line written together: a half-written line left for the
         * other half's pass, a piece later, is read back from memory. */
        for (ltx_idx q0 = 0; q0 < kv; q0 += 16)
            for (ltx_idx h = 0; h < NR; h += 16) {
                __m512i r[16];
                for (int i = 0; i < 16; i++) {
                    const ltx_idx row = s * NR + h + i;
                    r[i] = row < mt ? _mm512_loadu_si512(x + row * ldx + 2 * q0)
                                    : _mm512_setzero_si512();
                }
                transpose16(r);
                for (int j = 0; j < 16; j++)
                    _mm512_storeu_si512(strip + (q0 + j) * NR + h, r[j]);
            }
        pack_last_pairs(x, ldx, mt, kt, strip, s, kv);
    }
}

/* acc[r * lda + j] += c[r][..][j] for the R rows of a register block and its first `cols`
 * columns (at most NR): one rounding each, as the scalar sum acc + c. */
static inline __attribute__((always_inline)) void
add_block_to(const int R, const vf c[MR][NRV], ltx_idx cols, float *acc, ltx_idx lda)
{
    for (int v = 0; v < NRV; v++) {
        const ltx_idx left = cols - v * VW;
        const __mmask16 k = left >= VW ? (__mmask16)0xFFFF
                                       : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) {
            float *p = acc + r * lda + v * VW;
            _mm512_mask_storeu_ps(p, k, _mm512_add_ps(_mm512_maskz_loadu_ps(k, p),
                                                      (__m512)c[r][v]));
        }
    }
}

/* One chunk of len elements (len / 2 pairs from ys, strip-major) of an R-row weight block
 * against every strip: its sums, then, if len is odd, the last element's product (the low
 * half of pair len / 2), added to acc. sums: MR x np floats, used only for an odd len. While
 * the first strip runs, the weight the next chunk takes (at `next`, rows as wb's) is asked
 * for. */
static inline __attribute__((always_inline)) void
dot_panel_chunk(const int R, ltx_idx mt, ltx_idx len, const uint32_t *ys, ltx_idx lds,
                const uint16_t *wb, ltx_idx ldw, const uint16_t *next, float *acc, float *sums)
{
    const ltx_idx strips = (mt + NR - 1) / NR, np = strips * NR, kp = len / 2;
    for (ltx_idx s = 0; s < strips; s++) {
        vf c[MR][NRV];
        dot_sums(R, kp, (const char *)wb, 2 * ldw, ys + s * lds, NR,
                 s == 0 ? (const char *)next : NULL, c);
        if (!(len & 1)) {
            add_block_to(R, c, mt - s * NR, acc + s * NR, mt);
            continue;
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < NRV; v++)
                STOREV(sums + r * np + s * NR + v * VW, c[r][v]);
    }
    if (!(len & 1))
        return;
    for (ltx_idx r = 0; r < R; r++)
        for (ltx_idx m = 0; m < mt; m++) {
            const uint16_t xo = (uint16_t)ys[(m / NR) * lds + kp * NR + m % NR];
            const float sum = sums[r * np + m] +
                              ltx_bf16_value(xo) * ltx_bf16_value(wb[r * ldw + len - 1]);
            acc[r * mt + m] = acc[r * mt + m] + sum;
        }
}

/* xs: pack_x_pairs of the call's x (kt elements from the first); scratch: MR x (mt rounded
 * up to NR) floats. Row blocks outer, so that each weight row is read in one run through the
 * call. */
static void dot_panel_wxt(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint32_t *xs, ltx_idx lds,
                          const uint16_t *w, ltx_idx ldw, float *acc, float *scratch)
{
    for (ltx_idx i = 0; i < n; i += MR) {
        const ltx_idx rows = (n - i < MR) ? n - i : MR;
        for (ltx_idx k0 = 0; k0 < kt; k0 += LTX_DOT_PANEL_CHUNK) {
            const ltx_idx len = (kt - k0 < LTX_DOT_PANEL_CHUNK) ? kt - k0 : LTX_DOT_PANEL_CHUNK;
            const uint32_t *ys = xs + (k0 / 2) * NR;
            const uint16_t *wb = w + i * ldw + k0;
            /* The next chunk of these rows, or the first of the next row block's (none past
             * the last: prefetches past an array are harmless but wasted). */
            const uint16_t *next = k0 + len < kt ? wb + len
                                   : i + MR < n ? w + (i + MR) * ldw : NULL;
            float *ab = acc + i * mt;
            switch (rows) {
#define PANEL_CASE(R)                                                                         \
            case R:                                                                           \
                dot_panel_chunk(R, mt, len, ys, lds, wb, ldw, next, ab, scratch);             \
                break;
                PANEL_CASE(MR)
                PANEL_CASE(1)
                PANEL_CASE(2)
                PANEL_CASE(3)
                PANEL_CASE(4)
                PANEL_CASE(5)
                PANEL_CASE(6)
                PANEL_CASE(7)
#undef PANEL_CASE
            }
        }
    }
}
_Static_assert(MR == 8, "dot_panel_wxt has a case for every row count up to MR");
_Static_assert(NR % 16 == 0, "pack_x_pairs transposes 16 rows at a time");
_Static_assert(NR == LTX_DOT_PANEL_STRIP, "the packed x's strips are the register block's columns");
_Static_assert(LTX_DOT_PANEL_CHUNK % 2 == 0, "a chunk other than the last takes whole pairs");
#endif

#if defined(LTX_ARM_BF16)
/* ---- The dot-product Linear with many rows of x, Arm: BFMMLA on x packed, the weight as it lies
 *
 * BFMMLA multiplies a 2 x 4 block of bf16 by a 4 x 2 one into a 2 x 2 block of f32 sums, each
 * sum taking its first pair, then its second, by BFDOT's step (docs/arithmetic.md, "Arm's BF16
 * instructions"): 16 products an instruction, twice BFDOT's, at the same issue rate. So the
 * order is the x86 panel's, pair by pair: each chunk's sum of an output (LTX_DOT_PANEL_CHUNK
 * elements from the call's first) starts from +0.0 and adds its pairs in order, each pair's
 * exact products' sum rounded to odd and added rounded to odd (the order inside a pair does
 * not matter: its sum is rounded once), then an odd last element's product in f32, and is
 * added to acc -- the bytes BFDOT gives pair by pair.
 *
 * x is packed (pack_x_pairs) so that a 16-byte load is a 2 x 4 block: in a strip of
 * LTX_DOT_PANEL_STRIP = 32 rows, the rows' elements 4g .. 4g + 3 (group g: pairs 2g, 2g + 1)
 * lie at strip + 64 g, row pair by row pair (rows 2h, 2h + 1 at + 4 h), the 4 elements of
 * row 2h, then those of row 2h + 1. The pairs past the last whole group (a last whole pair,
 * an odd last element alone in its pair's low half) lie as x86 lays pairs out, a row of the
 * strip's 32 pairs at strip + 32 q. Pair q of an even q starts at strip + 32 q in both, so a
 * chunk starting at a multiple of 4 elements finds its pairs where a whole x was packed. The
 * weight's 2 x 4 blocks come from two rows' 8-byte runs, as they lie. Register block: a half
 * strip (8 row pairs) by 2 weight-row pairs, 16 accumulators. */
#define DPR 4
#define HALF_PAIRS 8
_Static_assert(LTX_DOT_PANEL_STRIP == 4 * HALF_PAIRS, "a strip is two halves of 8 row pairs");

static void pack_x_pairs(const uint16_t *x, ltx_idx ldx, ltx_idx mt, ltx_idx kt, uint32_t *xs,
                         ltx_idx lds)
{
    const ltx_idx S = LTX_DOT_PANEL_STRIP, strips = (mt + S - 1) / S, kp = kt / 2;
    const ltx_idx groups = kp / 2;
    const uint16x4_t zero = vdup_n_u16(0);
    for (ltx_idx s = 0; s < strips; s++) {
        uint32_t *strip = xs + s * lds;
        for (ltx_idx g = 0; g < groups; g++)
            for (ltx_idx h = 0; h < S / 2; h++) {
                const ltx_idx r0 = s * S + 2 * h, r1 = r0 + 1;
                const uint16x4_t a = r0 < mt ? vld1_u16(x + r0 * ldx + 4 * g) : zero;
                const uint16x4_t b = r1 < mt ? vld1_u16(x + r1 * ldx + 4 * g) : zero;
                vst1q_u16((uint16_t *)(strip + 64 * g + 4 * h), vcombine_u16(a, b));
            }
        pack_last_pairs(x, ldx, mt, kt, strip, s, 2 * groups);
    }
}

/* The 2 x 4 block of weight rows a and b (elements 4g .. 4g + 3 of each): BFMMLA's second
 * operand. */
static inline bfloat16x8_t weight_block(const uint16_t *a, const uint16_t *b, ltx_idx g)
{
    return vreinterpretq_bf16_u16(vcombine_u16(vld1_u16(a + 4 * g), vld1_u16(b + 4 * g)));
}

/* One half strip (8 row pairs of x: `half` of the strip at `strip`) of one chunk (len
 * elements) by R weight rows (wb, row stride ldw): each output's chunk sum, added to acc
 * (rows `cols` valid, at ab, row stride mt). With R odd the last row is read twice, its second
 * sums dropped. The weight's next lines (at `next`, rows as wb's) are asked for when given. */
static inline __attribute__((always_inline)) void
mmla_half_strip(const int R, ltx_idx len, const uint32_t *strip, int half, const uint16_t *wb,
                ltx_idx ldw, const uint16_t *next, float *ab, ltx_idx mt, ltx_idx cols)
{
    const ltx_idx S = LTX_DOT_PANEL_STRIP, kp = len / 2, groups = kp / 2;
    const int OB = (R + 1) / 2;
    const uint16_t *wr[DPR];
    for (int o = 0; o < DPR; o++)
        wr[o] = wb + (o < R ? o : R - 1) * ldw;
    const uint32_t *gx = strip + half * 4 * HALF_PAIRS;
    float32x4_t c[HALF_PAIRS][DPR / 2];
    for (int h = 0; h < HALF_PAIRS; h++)
        for (int b = 0; b < OB; b++)
            c[h][b] = vdupq_n_f32(0.0f);
    for (ltx_idx g = 0; g < groups; g++) {
        bfloat16x8_t wv[DPR / 2];
        for (int b = 0; b < OB; b++) {
            if (next && g % 8 == 0) { /* a line a row every 8 groups */
                __builtin_prefetch(next + 2 * b * ldw + 4 * g, 0, 3);
                __builtin_prefetch(next + (2 * b + 1 < R ? 2 * b + 1 : 2 * b) * ldw + 4 * g, 0, 3);
            }
            wv[b] = weight_block(wr[2 * b], wr[2 * b + 1], g);
        }
        for (int h = 0; h < HALF_PAIRS; h++) {
            const bfloat16x8_t xv = vreinterpretq_bf16_u32(vld1q_u32(gx + 64 * g + 4 * h));
            for (int b = 0; b < OB; b++)
                c[h][b] = vbfmmlaq_f32(c[h][b], xv, wv[b]);
        }
    }
    const uint32_t *row_pairs = strip + half * 2 * HALF_PAIRS;  /* the row layout's rows */
    if (kp & 1) {
        /* The last whole pair (q = 2 groups), by BFDOT on operands laid out as the sums' lanes
         * are: (x row 2h, weight row 2b), (2h, 2b + 1), (2h + 1, 2b), (2h + 1, 2b + 1). */
        const ltx_idx q = 2 * groups;
        for (int b = 0; b < OB; b++) {
            uint32_t w0, w1;
            memcpy(&w0, wr[2 * b] + 2 * q, 4);
            memcpy(&w1, wr[2 * b + 1] + 2 * q, 4);
            const uint32_t wl[4] = {w0, w1, w0, w1};
            const bfloat16x8_t wp = vreinterpretq_bf16_u32(vld1q_u32(wl));
            for (int h = 0; h < HALF_PAIRS; h++) {
                const uint32_t x0 = row_pairs[q * S + 2 * h], x1 = row_pairs[q * S + 2 * h + 1];
                const uint32_t xl[4] = {x0, x0, x1, x1};
                c[h][b] = vbfdotq_f32(c[h][b], vreinterpretq_bf16_u32(vld1q_u32(xl)), wp);
            }
        }
    }
    for (int h = 0; h < HALF_PAIRS; h++)
        for (int b = 0; b < OB; b++) {
            float t[4];
            vst1q_f32(t, c[h][b]);
            for (int i = 0; i < 4; i++) {
                const ltx_idx m = 2 * h + i / 2;
                const int o = 2 * b + i % 2;
                if (m >= cols || o >= R)
                    continue;
                float sum = t[i];
                if (len & 1) /* the odd last element, alone in its pair's low half */
                    sum = sum + ltx_bf16_value((uint16_t)row_pairs[kp * S + m]) *
                                    ltx_bf16_value(wr[o][len - 1]);
                ab[o * mt + m] = ab[o * mt + m] + sum;
            }
        }
}

/* xs: pack_x_pairs of the call's x (kt elements from the first); scratch is not needed. Row
 * blocks outer, so that each weight row is read in one run through the call. */
static void dot_panel_wxt(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint32_t *xs, ltx_idx lds,
                          const uint16_t *w, ltx_idx ldw, float *acc, float *scratch)
{
    (void)scratch;
    const ltx_idx S = LTX_DOT_PANEL_STRIP, H = S / 2;
    for (ltx_idx i = 0; i < n; i += DPR) {
        const ltx_idx rows = (n - i < DPR) ? n - i : DPR;
        for (ltx_idx k0 = 0; k0 < kt; k0 += LTX_DOT_PANEL_CHUNK) {
            const ltx_idx len = (kt - k0 < LTX_DOT_PANEL_CHUNK) ? kt - k0 : LTX_DOT_PANEL_CHUNK;
            const uint16_t *wb = w + i * ldw + k0;
            const uint16_t *next = k0 + len < kt ? wb + len
                                   : i + DPR < n ? w + (i + DPR) * ldw : NULL;
            for (ltx_idx m0 = 0; m0 < mt; m0 += H) {
                const uint32_t *strip = xs + (m0 / S) * lds + (k0 / 2) * S;
                const int half = (int)((m0 % S) / H);
                const ltx_idx cols = (mt - m0 < H) ? mt - m0 : H;
                const uint16_t *ahead = m0 == 0 ? next : NULL;
                float *ab = acc + i * mt + m0;
                switch (rows) {
                case 1: mmla_half_strip(1, len, strip, half, wb, ldw, ahead, ab, mt, cols); break;
                case 2: mmla_half_strip(2, len, strip, half, wb, ldw, ahead, ab, mt, cols); break;
                case 3: mmla_half_strip(3, len, strip, half, wb, ldw, ahead, ab, mt, cols); break;
                default: mmla_half_strip(DPR, len, strip, half, wb, ldw, ahead, ab, mt, cols); break;
                }
            }
        }
    }
}
_Static_assert(DPR == 4, "dot_panel_wxt has a case for every row count up to DPR");
_Static_assert(LTX_DOT_PANEL_CHUNK % 4 == 0, "a chunk other than the last takes whole groups");
#endif

/* ---- The Linear from 48 to 64 rows of x: the fuse's register blocks ----
 *
 * With that many rows the streaming kernel's widening (two vector operations per 8 weights,
 * for 12 FMAs) takes a fifth of the FMA pipes' time. Here each chunk of LTX_PANEL_CHUNK
 * weights of a row is widened once, into a block of MR rows that L1 holds, and feeds the
 * product walk's broadcasts against x transposed into the fuse panel's strips (zero columns
 * past the last row of x), so the widening is shared by every strip. */

/* dst = the fuse panel of the transpose of x's k columns from 0 (mt rows, row stride ldx):
 * np / NR full strips in panel_column order, columns from mt to np zero. */
static void pack_x_strips(const float *x, ltx_idx ldx, ltx_idx mt, ltx_idx np, ltx_idx k,
                          float *dst)
{
    for (ltx_idx j = 0; j < np; j += NR) {
        float *strip = dst + j * k;
        ltx_idx p = 0;
#if defined(FUSE_UNPACK_ORDER)
        /* Two 8 x 8 transposes a step, their halves exchanged into the strip order. */
        for (; j + NR <= mt && p + 8 <= k; p += 8) {
            __m256 u[2][8];
            for (int h = 0; h < 2; h++) {
                const float *s = x + (j + 8 * h) * ldx + p;
                __m256 r[8], t[8];
                for (int i = 0; i < 8; i++)
                    r[i] = _mm256_loadu_ps(s + i * ldx);
                for (int i = 0; i < 4; i++) {
                    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
                }
                for (int i = 0; i < 2; i++) {
                    u[h][4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
                    u[h][4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
                    u[h][4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
                    u[h][4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
                }
            }
            /* u[h][i], i < 4: columns 8h .. 8h + 3 of term p + i (low half) and p + i + 4
             * (high half); u[h][i + 4] the same for columns 8h + 4 .. 8h + 7. */
            for (int i = 0; i < 4; i++) {
                float *lo = strip + (p + i) * NR, *hi = strip + (p + i + 4) * NR;
                _mm256_storeu_ps(lo, _mm256_permute2f128_ps(u[0][i], u[1][i], 0x20));
                _mm256_storeu_ps(lo + 8, _mm256_permute2f128_ps(u[0][i + 4], u[1][i + 4], 0x20));
                _mm256_storeu_ps(hi, _mm256_permute2f128_ps(u[0][i], u[1][i], 0x31));
                _mm256_storeu_ps(hi + 8, _mm256_permute2f128_ps(u[0][i + 4], u[1][i + 4], 0x31));
            }
        }
#endif
        for (; p < k; p++)
            for (int q = 0; q < NR; q++) {
                const ltx_idx col = j + panel_column(q);
                strip[p * NR + q] = col < mt ? x[col * ldx + p] : 0.0f;
            }
    }
}

static void panel_wxt(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                      const uint16_t *w, ltx_idx ldw, float *acc, float *scratch)
{
    const ltx_idx np = (mt + NR - 1) / NR * NR, strips = np / NR;
    float *xs = scratch, *wr = xs + np * LTX_PANEL_CHUNK, *sums = wr + MR * LTX_PANEL_CHUNK;
    for (ltx_idx k0 = 0; k0 < kt; k0 += LTX_PANEL_CHUNK) {
        const ltx_idx len = (kt - k0 < LTX_PANEL_CHUNK) ? kt - k0 : LTX_PANEL_CHUNK;
        const ltx_idx lines = (len * 2 + 63) / 64;
        pack_x_strips(x + k0, ldx, mt, np, len, xs);
        for (ltx_idx i = 0; i < n; i += MR) {
            const ltx_idx rows = (n - i < MR) ? n - i : MR;
            widen_bf16_rows(w + i * ldw + k0, ldw, wr, len, rows, len);
            /* The next row block's weights (past the last, the next chunk's first), asked for
             * a slice a strip while the products run: the hardware prefetcher does not follow
             * runs of 1 KiB a row apart. */
            const ltx_idx ni = (i + MR < n) ? i + MR : 0;
            const ltx_idx nk = (i + MR < n) ? k0 : k0 + len;
            const ltx_idx nrows = (nk < kt) ? ((n - ni < MR) ? n - ni : MR) : 0;
            for (ltx_idx s = 0; s < strips; s++) {
                for (ltx_idx r = 0; r < nrows; r++)
                    for (ltx_idx l = s * lines / strips; l < (s + 1) * lines / strips; l++)
                        __builtin_prefetch(w + (ni + r) * ldw + nk + l * 32, 0, 3);
                /* one row block by one strip: the walk's block of this height */
                seq_product_panel(rows, NR, len, wr, len, xs + s * NR * len, sums + s * NR, np);
            }
            for (ltx_idx r = 0; r < rows; r++)
                for (ltx_idx m = 0; m < mt; m++)
                    acc[(i + r) * mt + m] = acc[(i + r) * mt + m] + sums[r * np + m];
        }
    }
}

/* Measured on an AVX2 core (bench/results/amd-epyc-avx2): faster than the streaming kernel from
 * 48 rows of x, equal at 32 to 40, slower below. Not measured on the other tables. */
#if defined(LTX_VARIANT_AVX2)
#define PANEL_MIN_ROWS 48
#else
#define PANEL_MIN_ROWS 0
#endif

static void widen_bf16_f64(const uint16_t *restrict src, double *restrict dst, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        dst[i] = (double)ltx_bits_f32((uint32_t)src[i] << 16);
}

static void f32_to_f64(const float *restrict src, double *restrict dst, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        dst[i] = (double)src[i];
}

/* ---- fp8 weights (docs/arithmetic.md §2) ----
 * W' = fp8(bf16(f32(bf16(acc)) + f32(W))), W an F8_E4M3 (float8_e4m3fn) or F8_E5M2 code, widened
 * exactly.  Into fp8: nearest-even, as torch casts (upstream's engine): past the largest finite
 * value (inf too) the kind's `over` -- e4m3fn saturates to +-448 (torch from 2.13) or becomes
 * NaN (torch before), e5m2 goes to +-inf; NaN becomes 0x7F with its sign.  Stochastic: the bits below the fp8 precision are compared with random bits from a
 * counter-based generator (splitmix64 of key + the element's index in the whole tensor), so a
 * value rounds up with probability equal to its distance from the lower neighbour, the same
 * way for any tiling and thread count; a finite value is never rounded up past the largest
 * finite fp8 value. */

/* bf16 bits -> fp8 code of an ltx_fp8_kind; rnd (32 random bits) is used when stochastic,
 * which never rounds past the largest finite value. *over is set when a finite value lands
 * past the largest finite fp8 value. */
static inline uint32_t fp8_from_bf16(uint32_t h, int kind, int stochastic, uint32_t rnd, int *over)
{
    const uint32_t sign = (h >> 8) & 0x80u;
    const uint32_t E = (h >> 7) & 0xFFu, M = h & 0x7Fu;
    const int mant = LTX_FP8[kind].mant, bias = LTX_FP8[kind].bias;
    const uint32_t largest = LTX_FP8[kind].largest;
    if (E == 0xFFu)
        return M ? (0x7Fu | sign) : (LTX_FP8[kind].over | sign);
    if (E == 0 && M == 0)
        return sign;
    const uint32_t S = E ? (0x80u | M) : M;              /* significand, 7 fraction bits */
    const int f = (int)(E ? E : 1) - 127 + bias;         /* fp8 exponent field if normal */
    int shift = 7 - mant + (f < 1 ? 1 - f : 0);
    if (shift > 31)
        shift = 31;
    uint32_t R;
    if (stochastic)
        R = (uint32_t)(((uint64_t)S + (rnd & ((1u << shift) - 1u))) >> shift);
    else
        R = (S + (1u << (shift - 1)) - 1u + ((S >> shift) & 1u)) >> shift;
    uint32_t code = f < 1 ? R : (uint32_t)((f - 1) << mant) + R;
    if (code > largest) {
        *over = 1;
        code = stochastic ? largest : LTX_FP8[kind].over;
    }
    return code | sign;
}

typedef int32_t vi32 __attribute__((vector_size(VW * 4)));
typedef uint8_t vu8 __attribute__((vector_size(VW), aligned(1), may_alias));


/* VW bytes widened to 32-bit lanes, and the low bytes of VW lanes (each below 256) stored.
 * Spelled with intrinsics on x86, where GCC builds the generic conversions byte by byte. */
static inline vu32 load_u8_vec(const uint8_t *p)
{
#if defined(LTX_VARIANT_AVX512)
    return (vu32)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif defined(LTX_VARIANT_AVX2)
    return (vu32)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    return __builtin_convertvector(*(const vu8 *)p, vu32);
#endif
}

static inline void store_u8_vec(uint8_t *p, vu32 v)
{
#if defined(LTX_VARIANT_AVX512)
    _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8((__m512i)v));
#elif defined(LTX_VARIANT_AVX2)
    /* byte 0 of each lane to the low 4 bytes of its 128-bit half, then the halves joined */
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, -1, -1, -1);
    const __m256i t = _mm256_shuffle_epi8((__m256i)v, low_bytes);
    _mm_storel_epi64((__m128i *)p, _mm_unpacklo_epi32(_mm256_castsi256_si128(t),
                                                      _mm256_extracti128_si256(t, 1)));
#else
    *(vu8 *)p = __builtin_convertvector(v, vu8);
#endif
}

#if defined(LTX_VARIANT_AVX512)
/* On AVX-512 the two rules below, lane by lane, from fp8_avx512.h: the same functions of the
 * values with the selects made by mask registers, where the generic forms spend about 110
 * vector operations a vector and the rounding store is bound by them. ltx_fp8_round_avx512 is
 * quant.c's rounding; fp8_from_bf16's inf, NaN and overflow are set around it. */
static inline vf fp8_value_vec(vu32 c, int kind)
{
    return (vf)ltx_fp8_value_avx512((__m512i)c, kind);
}

static inline vu32 fp8_nearest_vec(vu32 h, int kind, vu32 *over)
{
    const vu32 u = h << 16;
    const __m512i a = _mm512_and_si512((__m512i)u, _mm512_set1_epi32(0x7FFFFFFF));
    __mmask16 past;
    __m512i code = ltx_fp8_round_avx512((__m512)u, kind, &past);
    /* NaN to 0x7F (its sign kept); inf to the kind's `over`, but not an overflow */
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
    code = _mm512_mask_mov_epi32(code, nan,
                                 _mm512_or_si512(_mm512_and_si512(code, _mm512_set1_epi32(0x80)),
                                                 _mm512_set1_epi32(0x7F)));
    const __mmask16 finite = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
    *over = (vu32)_mm512_maskz_set1_epi32(past & finite, 1);
    return (vu32)code;
}
#else
/* ltx_fp8_value of VW codes (each below 256), lane by lane, without the table: for a normal
 * code its exponent and mantissa bits placed in an f32's and the exponent rebiased (integer
 * operations); for a subnormal code, its mantissa m converted and scaled, m 2**(1 - bias -
 * mant), exact; inf and NaN codes selected, NaN unsigned. No f32 subnormal is formed: an
 * operation on one can take a slow path. */
static inline vf fp8_value_vec(vu32 c, int kind)
{
    const ltx_fp8_format *f = &LTX_FP8[kind];
    const int mant = f->mant, bias = f->bias;
    const float quantum = f->quantum;
    const vu32 mag = c & 0x7Fu;
    const vu32 subnormal = (vu32)((mag >> mant) == 0);
    const vu32 normal_bits = (mag << (23 - mant)) + (uint32_t)((127 - bias) << 23);
    const vu32 subnormal_bits = (vu32)(__builtin_convertvector((vi32)mag, vf) * quantum);
    const vu32 signed_value = ((normal_bits & ~subnormal) | (subnormal_bits & subnormal)) |
                              ((c & 0x80u) << 24);
    const vu32 nan = (vu32)(mag > f->nan_above);
    const vu32 inf = f->inf ? (vu32)(mag == f->inf) : (vu32){0};
    const vu32 value = (signed_value & ~inf) | (inf & (0x7F800000u | ((c & 0x80u) << 24)));
    return (vf)((value & ~nan) | (nan & 0x7FC00000u));
}

/* fp8_from_bf16 with nearest-even rounding, lane by lane, h the bf16 bits (each below
 * 2**16): the same expressions, the branches made masks. Lanes that overflowed are set in
 * *over. */
static inline vu32 fp8_nearest_vec(vu32 h, int kind, vu32 *over)
{
    const int mant = LTX_FP8[kind].mant, bias = LTX_FP8[kind].bias;
    const int32_t largest = (int32_t)LTX_FP8[kind].largest;
    const uint32_t over_code = LTX_FP8[kind].over;
    const vu32 sign = (h >> 8) & 0x80u;
    const vu32 E = (h >> 7) & 0xFFu, M = h & 0x7Fu;
    const vu32 normal = (vu32)(E != 0);
    const vu32 S = (normal & 0x80u) | M;
    const vi32 f = (vi32)(E | (~normal & 1u)) - 127 + bias;
    const vi32 sub = (vi32)(f < 1);
    vi32 shift = (7 - mant) + (sub & (1 - f));
    const vi32 far = (vi32)(shift > 31);
    shift = (shift & ~far) | (far & 31);
    const vu32 sh = (vu32)shift;
    const vu32 one = (vu32){0} + 1u;
    const vu32 R = (S + (one << (sh - 1u)) - 1u + ((S >> sh) & 1u)) >> sh;
    const vu32 normal_code = ((vu32)(f - 1) << mant) + R;
    vu32 code = (R & (vu32)sub) | (normal_code & ~(vu32)sub);
    const vu32 special = (vu32)(E == 0xFFu), nan = (vu32)(M != 0);
    const vu32 o = (vu32)((vi32)code > largest) & ~special;
    code = (code & ~o) | (o & over_code);
    const vu32 special_code = (nan & 0x7Fu) | (~nan & over_code);
    code = (code & ~special) | (special_code & special);
    *over = o;
    return code | sign;
}
#endif

/* The fp8 rounding store. Nearest-even goes VW elements at a time (fp8_value_vec and
 * fp8_nearest_vec, the scalar rules lane by lane); the stochastic rounding and each row's
 * last cols % VW elements, element by element. Overflows are rare: they are counted only in
 * a vector where some lane has one. */
static ltx_idx store_fused_fp8(const float *acc, const uint8_t *w, ltx_idx ldw, uint8_t *out,
                               ltx_idx ldo, ltx_idx rows, ltx_idx cols, int kind,
                               int stochastic, uint64_t key, ltx_idx index0, ltx_idx stride,
                               ltx_idx *first_over)
{
    ltx_idx overflows = 0;
    *first_over = -1;
    const float *table = ltx_fp8_table(kind);
    const ltx_idx full = stochastic ? 0 : cols - cols % VW;
    for (ltx_idx r = 0; r < rows; r++) {
        if (r + PREFETCH_ROWS < rows)
            prefetch_run(w + (r + PREFETCH_ROWS) * ldw, cols);
        for (ltx_idx i = 0; i < full; i += VW) {
            const vf value = fp8_value_vec(load_u8_vec(w + r * ldw + i), kind);
            const vf sum = value + (vf)bf16_high_vec(LOADV(acc + r * cols + i));
            vu32 over;
            const vu32 code = fp8_nearest_vec(bf16_high_vec(sum) >> 16, kind, &over);
            store_u8_vec(out + r * ldo + i, code);
            if (__builtin_expect(any_lane(over), 0))
                for (int l = 0; l < VW; l++)
                    if (over[l]) {
                        if (*first_over < 0)
                            *first_over = r * stride + i + l;
                        overflows++;
                    }
        }
        for (ltx_idx i = full; i < cols; i++) {
            const float delta = ltx_bits_f32(ltx_bf16_high(acc[r * cols + i]));
            const float sum = table[w[r * ldw + i]] + delta;
            const uint32_t rnd =
                stochastic ? (uint32_t)ltx_splitmix64(key + (uint64_t)(index0 + r * stride + i)) : 0;
            int over = 0;
            out[r * ldo + i] = (uint8_t)fp8_from_bf16(ltx_bf16_high(sum) >> 16, kind, stochastic,
                                                      rnd, &over);
            if (over) {
                if (*first_over < 0)
                    *first_over = r * stride + i;
                overflows++;
            }
        }
    }
    return overflows;
}

static void accumulate_rounded(const float *restrict acc, float *restrict total, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        total[i] = total[i] + ltx_bits_f32(ltx_bf16_high(acc[i]));
}

/* Turns one adapter's fuse into the several-adapter rule's: that rule's total, bf16(0.0 +
 * delta), differs from delta only where delta is -0.0, which it makes +0.0, and W + delta is
 * -0.0 only where both are -0.0 (a sum of two bf16 values that is not zero does not round to
 * zero). So the rule's result is the one-adapter result with every -0.0 made +0.0; done on a
 * tile just stored, while it is in cache. */
static void clear_negative_zero_bf16(uint16_t *p, ltx_idx ldp, ltx_idx rows, ltx_idx cols)
{
    for (ltx_idx r = 0; r < rows; r++) {
        uint16_t *row = p + r * ldp;
        for (ltx_idx i = 0; i < cols; i++)
            row[i] = row[i] == 0x8000u ? 0 : row[i];
    }
}

/* The feature extractor's normalisation of n features of one row (docs/arithmetic.md): V2
 * (b NULL) f32(bf16(f32(bf16(x * a[l])) * scale)), V1 f32(bf16(((x - a[l]) / b[l]) * 8)),
 * x a bf16 (src_bf16) or f32 feature, l = (l0 + i) mod layers its layer; a and b hold
 * LTX_LAYER_TABLE_PAD values past their `layers` (a[i] = a[i mod layers]), so that the layers of
 * VW consecutive features are one unaligned load. Each operation rounds once, as the scalar
 * expression: kept out of contraction by the rounding between them (V2) or by having no
 * product to add (V1). dst: bf16 bits (dst_bf16) or f32. */
static void normalize_features(const void *src, int src_bf16, ltx_idx n, const float *a,
                               const float *b, ltx_idx l0, ltx_idx layers, float scale,
                               void *dst, int dst_bf16)
{
    _Static_assert(VW <= LTX_LAYER_TABLE_PAD, "a vector of layers fits the tables' padding");
    const vf sv = (vf){0} + scale, eight = (vf){0} + 8.0f;
    ltx_idx l = l0, i = 0;
    for (; i + VW <= n; i += VW) {
        const vf x = src_bf16 ? widen_vec((const uint16_t *)src + i)
                              : (vf)LOADV((const float *)src + i);
        vf v;
        if (b == NULL) {
            v = (vf)bf16_high_vec(x * (vf)LOADV(a + l));
            v = (vf)bf16_high_vec(v * sv);
        } else {
            v = (vf)bf16_high_vec(((x - (vf)LOADV(a + l)) / (vf)LOADV(b + l)) * eight);
        }
        if (dst_bf16)
            store_low16((uint16_t *)dst + i, (vu32)v >> 16);
        else
            STOREV((float *)dst + i, v);
        l += VW;
        while (l >= layers)
            l -= layers;
    }
    for (; i < n; i++) {
        const float x = src_bf16 ? ltx_bf16_value(((const uint16_t *)src)[i])
                                 : ((const float *)src)[i];
        float v;
        if (b == NULL)
            v = ltx_bf16_round(ltx_bf16_round(x * a[l]) * scale);
        else
            v = ltx_bf16_round(((x - a[l]) / b[l]) * 8.0f);
        if (dst_bf16)
            ((uint16_t *)dst)[i] = ltx_bf16_of(v);
        else
            ((float *)dst)[i] = v;
        if (++l == layers)
            l = 0;
    }
}

/* The feature extractor's statistics of one row of depth x layers features (element
 * d * layers + l), bf16 (src_bf16) or f32: per layer, the sum and the sum of squares over d in
 * order from 0.0, in f64 (each square rounded on its own, then added), and the min and max,
 * NaN winning. The layers go across the lanes, VD doubles a vector, a block of layers at a
 * time through the whole row (the row stays in L2), so that each layer's sums are those of
 * the scalar loop, which takes the last layers (fewer than a vector). */
typedef double vd __attribute__((vector_size(VW * 4)));
typedef float vfh __attribute__((vector_size(VW * 2)));
typedef int32_t vih __attribute__((vector_size(VW * 2)));
typedef uint16_t vu16h __attribute__((vector_size(VW), aligned(2), may_alias));
typedef uint32_t vu32h __attribute__((vector_size(VW * 2)));
typedef float vfhu __attribute__((vector_size(VW * 2), aligned(4), may_alias));
#define VD (VW / 2)

static inline vfh features_at(const void *src, int src_bf16, ltx_idx i)
{
    if (src_bf16)
        return (vfh)(__builtin_convertvector(*(const vu16h *)((const uint16_t *)src + i), vu32h)
                     << 16);
    return *(const vfhu *)((const float *)src + i);
}

static inline float feature_at(const void *src, int src_bf16, ltx_idx i)
{
    return src_bf16 ? ltx_bf16_value(((const uint16_t *)src)[i]) : ((const float *)src)[i];
}

static void layer_stats(const void *src, int src_bf16, ltx_idx depth, ltx_idx layers,
                        double *sums, double *squares, float *lows, float *highs)
{
    const ltx_idx lv = depth > 0 ? layers - layers % VD : 0;
    for (ltx_idx l = 0; l < lv; l += VD) {
        vd sum = {0}, square = {0};
        vfh low = features_at(src, src_bf16, l), high = low;
        vih nan = low != low;
        for (ltx_idx d = 0; d < depth; d++) {
            const vfh f = features_at(src, src_bf16, d * layers + l);
            const vd v = __builtin_convertvector(f, vd);
            vd p = v * v;
            NOT_CONTRACTED(p);
            sum += v;
            square += p;
            const vih below = f < low, above = f > high;
            low = (vfh)(((vih)f & below) | ((vih)low & ~below));
            high = (vfh)(((vih)f & above) | ((vih)high & ~above));
            nan |= f != f;
        }
        for (int j = 0; j < VD; j++) {
            sums[l + j] = sum[j];
            squares[l + j] = square[j];
            lows[l + j] = nan[j] ? NAN : low[j];
            highs[l + j] = nan[j] ? NAN : high[j];
        }
    }
    for (ltx_idx l = lv; l < layers; l++) {
        double sum = 0.0, square = 0.0;
        float low = depth > 0 ? feature_at(src, src_bf16, l) : 0.0f, high = low;
        for (ltx_idx d = 0; d < depth; d++) {
            const float f = feature_at(src, src_bf16, d * layers + l);
            const double v = f;
            double p = v * v;
            NOT_CONTRACTED_SCALAR(p);
            sum = sum + v;
            square = square + p;
            if (isnan(f) || isnan(low)) {
                low = high = NAN;
            } else {
                low = f < low ? f : low;
                high = f > high ? f : high;
            }
        }
        sums[l] = sum;
        squares[l] = square;
        lows[l] = low;
        highs[l] = high;
    }
}

static void round_bf16_f32(const float *restrict src, float *restrict dst, ltx_idx n)
{
    u32a *d = (u32a *)dst;
    for (ltx_idx i = 0; i < n; i++)
        d[i] = ltx_bf16_high(src[i]);
}

/* The product is kept out of the add's reach (NOT_CONTRACTED) so that tables built with
 * contraction do not fuse s * acc + agg into one rounding. */
static void accumulate_addmm(const float *restrict acc, float *restrict agg, float s, ltx_idx n)
{
    ltx_idx i = 0;
    for (; i + VW <= n; i += VW) {
        vf p = LOADV(acc + i) * s;
        NOT_CONTRACTED(p);
        STOREV(agg + i, (vf)bf16_high_vec(LOADV(agg + i) + p));
    }
    for (; i < n; i++) {
        float p = acc[i] * s;
        NOT_CONTRACTED_SCALAR(p);
        ((u32a *)agg)[i] = ltx_bf16_high(agg[i] + p);
    }
}

static void store_rounded(const float *acc, uint16_t *out, ltx_idx ldo, ltx_idx rows,
                          ltx_idx cols)
{
    for (ltx_idx r = 0; r < rows; r++) {
        const float *a = acc + r * cols;
        uint16_t *o = out + r * ldo;
        ltx_idx i = 0;
        for (; i + VW <= cols; i += VW)
            store_low16(o + i, bf16_high_vec(LOADV(a + i)) >> 16);
        for (; i < cols; i++)
            o[i] = (uint16_t)(ltx_bf16_high(a[i]) >> 16);
    }
}

static void multiply_f32(const float *x, const float *y, float *dst, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        dst[i] = x[i] * y[i];
}

static void scale_f32(const float *x, float s, float *dst, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        dst[i] = s * x[i];
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

/* This instruction set's kernels; dispatch.c joins them with quant.c's layout passes of the
 * same build into the table it hands out. */
const ltx_kernels LTX_KERNELS_TABLE = {
    .name = LTX_VARIANT_NAME,
    .seq_gemm = seq_gemm,
    .widen_bf16 = widen_bf16,
    .scale_round_widen = scale_round_widen,
    .store_fused = store_fused,
    .accumulate_rounded = accumulate_rounded,
    .first_nonfinite_bf16 = first_nonfinite_bf16,
    .scan_bf16 = scan_bf16,
    .widen_bf16_f64 = widen_bf16_f64,
    .f32_to_f64 = f32_to_f64,
    .widen_bf16_rows = widen_bf16_rows,
    .stream_wxt = stream_wxt,
    .panel_wxt = panel_wxt,
    .panel_min_rows = PANEL_MIN_ROWS,
    .store_fused_fp8 = store_fused_fp8,
    .seq_fuse_bf16 = seq_fuse_bf16,
    .pack_fuse_panel = pack_fuse_panel,
    .seq_product_panel = seq_product_panel,
#if defined(LTX_DOT_PAIRS)
    .dot_fuse_bf16 = dot_fuse_bf16,  /* NULL in the other tables */
    .dot_product_bf16 = dot_product_bf16,
    .dot_stream_wxt = dot_stream_wxt,
    .dot_panel_wxt = dot_panel_wxt,
    .pack_x_pairs = pack_x_pairs,
    .dot_lanes = VW,
    .dot_pair_units = DOT_PAIR_UNITS,
#endif
    .pack_pairs_rows = pack_pairs_rows,
    .pack_pairs_cols = pack_pairs_cols,
    .clear_negative_zero_bf16 = clear_negative_zero_bf16,
    .round_bf16_f32 = round_bf16_f32,
    .normalize_features = normalize_features,
    .layer_stats = layer_stats,
    .accumulate_addmm = accumulate_addmm,
    .store_rounded = store_rounded,
    .multiply_f32 = multiply_f32,
    .scale_f32 = scale_f32,
};
