/* The scaled and quantised layouts' element passes (quant.h). One source, built once per
 * instruction set like kernels.c (the AVX-512 builds take sixteen elements at a time where a
 * pass has a vector form, the same bytes), but always with no contraction: each operation
 * written is one IEEE f32 operation, rounded once. Its table, ltx_layout_<variant>, is joined
 * to the kernel table of the same instruction set by dispatch.c. */
#include <math.h>
#include <string.h>

#include "variant.h"
#include "kernels.h"
#include "quant.h"
#if defined(LTX_VARIANT_AVX512)
#include "fp8_avx512.h"
#endif

static inline float absf(float f) { return ltx_bits_f32(ltx_f32_bits(f) & 0x7FFFFFFFu); }

/* f32 -> fp8 code, nearest-even, past the largest finite code to the format's `over` (e4m3
 * saturates at 448, e5m2 goes to inf), the sign kept: torch's cast on the CPU for finite input.
 * No choice between f32 operations, so that a loop of it vectorises (GCC keeps a loop scalar
 * where an f32 operation could trap only on one side of a choice). Above the smallest normal
 * the f32 bits are rounded nearest-even at the fp8 mantissa and rebiased. Below it the count
 * of subnormal quanta, 2^(1 - bias - mant), is what the f32 sum |x| + 2^23 quantum holds in
 * its low bits: that sum lies in the binade whose ulp is the quantum, so the addition rounds
 * |x| to whole quanta, nearest-even (a count of 2^mant quanta is the smallest normal's code).
 * Both are computed and the code chosen by integers. Finite input only. */
static inline __attribute__((always_inline)) uint32_t fp8_encode(float x, int e5m2)
{
    const uint32_t u = ltx_f32_bits(x), sign = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    const int mant = LTX_FP8[e5m2].mant, bias = LTX_FP8[e5m2].bias;
    const uint32_t min_normal = (uint32_t)(127 - bias + 1) << 23;
    const float magic = LTX_FP8[e5m2].quantum * 0x1p23f;
    const uint32_t sub = ltx_f32_bits(ltx_bits_f32(a) + magic) - ltx_f32_bits(magic);
    const uint32_t shift = 23u - (uint32_t)mant;
    const uint32_t rounded = (a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u)) >> shift;
    const uint32_t normal = rounded - ((uint32_t)(127 - bias) << mant);
    const uint32_t below = 0u - (uint32_t)(a < min_normal);  /* a mask: no branch to sink into */
    uint32_t code = (sub & below) | (normal & ~below);
    code = code > LTX_FP8[e5m2].largest ? LTX_FP8[e5m2].over : code;
    return code | sign;
}

/* The E2M1 grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0-7): a magnitude's code is the number of
 * these midpoints below it; a midpoint itself counts toward the even code, so the comparison
 * is >= below an even code (odd k) and > below an odd one. */
/* All ones where bf16 bits h are not a zero, else 0: a choice made with bit operations, so
 * that the compiler cannot turn it into a branch around an f32 operation (which keeps a loop
 * scalar under -ftrapping-math). */
static inline uint32_t nonzero_mask(uint16_t h) { return 0u - (uint32_t)((h & 0x7FFFu) != 0); }

#if defined(LTX_VARIANT_AVX512)
static const float e2m1_midpoint[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
#endif

/* The midpoints' f32 bits: a non-negative f32 orders as its bits do, so the comparisons are
 * of integers, which loops of them vectorise (GCC keeps a loop with f32 comparisons scalar
 * under -ftrapping-math). Finite input only. */
static const uint32_t e2m1_midpoint_bits[7] = {0x3E800000u, 0x3F400000u, 0x3FA00000u,
                                               0x3FE00000u, 0x40200000u, 0x40600000u,
                                               0x40A00000u};

static inline uint32_t e2m1_from_f32(float x)
{
    const uint32_t u = ltx_f32_bits(x), a = u & 0x7FFFFFFFu;
    uint32_t code = 0;
    for (int k = 0; k < 7; k++)
        code += (k & 1) ? a >= e2m1_midpoint_bits[k] : a > e2m1_midpoint_bits[k];
    return code | ((u >> 28) & 0x8u);
}

/* ---- per-tensor scaled fp8 ---- */

#if defined(LTX_VARIANT_AVX512)
/* Sixteen bf16 values (any alignment) as f32. */
static inline LTX_AVX512_TARGET __m512 widen16_avx512(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* The two passes below, sixteen elements at a time in the AVX-512 builds, with the same f32
 * operations in the same
 * order: the table's entry (the code's value times scale) computed, the delta widened and
 * added; then the magnitude's maximum (which, like the scalar comparison, keeps the running
 * maximum where a value is NaN), or the product by mult clamped by comparisons and rounded by
 * ltx_fp8_round_avx512, fp8_encode's rounding. The last count % 16 elements are left to the
 * scalar loops. Returns how many were done. */
static LTX_AVX512_TARGET ltx_idx scaled_fp8_max_avx512(const uint8_t *codes,
                                                       const uint16_t *delta, ltx_idx count,
                                                       float scale, int e5m2, float *top)
{
    const ltx_idx full = count - count % 16;
    __m512 best = _mm512_set1_ps(*top);
    for (ltx_idx i = 0; i < full; i += 16) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m512 d = widen16_avx512(delta + i);
        const __m512 w = _mm512_mul_ps(ltx_fp8_value_avx512(c, e5m2), _mm512_set1_ps(scale));
        const __m512 n = _mm512_abs_ps(_mm512_add_ps(w, d));
        best = _mm512_max_ps(n, best);
    }
    *top = _mm512_reduce_max_ps(best);
    return full;
}

static LTX_AVX512_TARGET ltx_idx scaled_fp8_store_avx512(uint8_t *codes, const uint16_t *delta,
                                                         ltx_idx count, float scale,
                                                         float mult, float fmax, int e5m2)
{
    const ltx_idx full = count - count % 16;
    for (ltx_idx i = 0; i < full; i += 16) {
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + i)));
        const __m512 d = widen16_avx512(delta + i);
        const __m512 w = _mm512_mul_ps(ltx_fp8_value_avx512(c, e5m2), _mm512_set1_ps(scale));
        __m512 n = _mm512_mul_ps(_mm512_add_ps(w, d), _mm512_set1_ps(mult));
        n = _mm512_mask_mov_ps(n, _mm512_cmp_ps_mask(n, _mm512_set1_ps(-fmax), _CMP_LT_OQ),
                               _mm512_set1_ps(-fmax));
        n = _mm512_mask_mov_ps(n, _mm512_cmp_ps_mask(n, _mm512_set1_ps(fmax), _CMP_GT_OQ),
                               _mm512_set1_ps(fmax));
        __mmask16 past;
        _mm_storeu_si128((__m128i *)(codes + i),
                         _mm512_cvtepi32_epi8(ltx_fp8_round_avx512(n, e5m2, &past)));
    }
    return full;
}
#endif

static float scaled_fp8_max(const uint8_t *codes, const uint16_t *delta, ltx_idx count,
                         float scale, int e5m2)
{
    const float *values = ltx_fp8_table(e5m2);
    float table[256], top = 0.0f;
    for (int c = 0; c < 256; c++)
        table[c] = values[c] * scale;
#if defined(LTX_VARIANT_AVX512)
    {
        const ltx_idx done = scaled_fp8_max_avx512(codes, delta, count, scale, e5m2, &top);
        codes += done, delta += done, count -= done;
    }
#endif
    /* finite codes and delta (the caller checks): the only non-finite sum is an overflow to
     * inf, which a plain maximum keeps */
    for (ltx_idx i = 0; i < count; i++) {
        const float n = absf(table[codes[i]] + ltx_bf16_value(delta[i]));
        top = n > top ? n : top;
    }
    return top;
}

static void scaled_fp8_store(uint8_t *codes, const uint16_t *delta, ltx_idx count, float scale,
                          float mult, float fmax, int e5m2)
{
    const float *values = ltx_fp8_table(e5m2);
    float table[256];
    const int finite = mult - mult == 0.0f;
    for (int c = 0; c < 256; c++)
        table[c] = values[c] * scale;
    if (!finite) { /* an all-zero tensor: the zeros themselves */
        for (ltx_idx i = 0; i < count; i++)
            codes[i] = (uint8_t)fp8_encode(table[codes[i]] + ltx_bf16_value(delta[i]), e5m2);
        return;
    }
#if defined(LTX_VARIANT_AVX512)
    {
        const ltx_idx done = scaled_fp8_store_avx512(codes, delta, count, scale, mult, fmax,
                                                     e5m2);
        codes += done, delta += done, count -= done;
    }
#endif
    for (ltx_idx i = 0; i < count; i++) {
        float n = (table[codes[i]] + ltx_bf16_value(delta[i])) * mult;
        n = n < -fmax ? -fmax : n > fmax ? fmax : n;
        codes[i] = (uint8_t)fp8_encode(n, e5m2);
    }
}

/* ---- blockwise fp8 / fp6 ---- */

#define BLOCK 128

static inline uint32_t fp6_code(const uint8_t *row, ltx_idx i)
{
    /* 4 six-bit codes in 3 bytes, big-endian; e4m3's bits 6 and 5 are 0 */
    const uint8_t *p = row + (i / 4) * 3;
    const uint32_t word = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
    const uint32_t six = (word >> (18 - 6 * (i % 4))) & 0x3Fu;
    return ((six >> 5) << 7) | (six & 0x1Fu);
}

#if defined(LTX_VARIANT_AVX512)
/* ltx_bf16_high of sixteen f32 values, lane by lane (the same macros), on AVX-512. */
static inline LTX_AVX512_TARGET __m512i bf16_high_avx512(__m512 f)
{
    typedef uint32_t v16u __attribute__((vector_size(64)));
    const v16u u = (v16u)_mm512_castps_si512(f);
    const v16u nearest = LTX_BF16_NEAREST(u), qnan = LTX_BF16_QNAN(u);
    return _mm512_mask_mov_epi32((__m512i)nearest, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                                 (__m512i)qnan);
}

/* The merge of sixteen dequantised values w into the delta at d, in place: d = bf16(w + d);
 * returns the running maximum of |merged| (kept where a value is NaN, as the scalar
 * comparison keeps it). */
static inline LTX_AVX512_TARGET __m512 merge16_avx512(__m512 w, uint16_t *d, __m512 best)
{
    const __m512i m = bf16_high_avx512(_mm512_add_ps(w, widen16_avx512(d)));
    _mm256_storeu_si256((__m256i *)d, _mm512_cvtepi32_epi16(_mm512_srli_epi32(m, 16)));
    return _mm512_max_ps(_mm512_abs_ps(_mm512_castsi512_ps(m)), best);
}

/* The blockwise fp8 passes below in the AVX-512 builds, sixteen elements at a time, with the
 * same f32 operations in the same
 * order: the merge of rows r0 .. r1 (returns their max |merged|, the running maximum kept
 * where a value is NaN, as the scalar comparison does), and one block's requantisation by
 * ltx_fp8_round_avx512, fp8_encode's rounding. fp6 keeps the scalar loops. */
static LTX_AVX512_TARGET float block_merge_rows_avx512(const uint8_t *codes, const float *scales,
                                                       uint16_t *delta, ltx_idx cols,
                                                       ltx_idx r0, ltx_idx r1)
{
    const ltx_idx blocks = cols / BLOCK;
    __m512 best = _mm512_setzero_ps();
    for (ltx_idx r = r0; r < r1; r++)
        for (ltx_idx bj = 0; bj < blocks; bj++) {
            const __m512 scale = _mm512_set1_ps(scales[(r / BLOCK) * blocks + bj]);
            for (ltx_idx i = bj * BLOCK; i < (bj + 1) * BLOCK; i += 16) {
                const __m512i c = _mm512_cvtepu8_epi32(
                    _mm_loadu_si128((const __m128i *)(codes + r * cols + i)));
                const __m512 w = _mm512_castsi512_ps(
                    bf16_high_avx512(_mm512_mul_ps(ltx_fp8_value_avx512(c, 0), scale)));
                best = merge16_avx512(w, delta + r * cols + i, best);
            }
        }
    return _mm512_reduce_max_ps(best);
}

static LTX_AVX512_TARGET void block_quantize_avx512(const uint16_t *m, ltx_idx cols,
                                                    uint8_t *codes, ltx_idx ldc, float *scale)
{
    __m512 best = _mm512_setzero_ps();
    for (ltx_idx r = 0; r < BLOCK; r++)
        for (ltx_idx i = 0; i < BLOCK; i += 16) {
            best = _mm512_max_ps(_mm512_abs_ps(widen16_avx512(m + r * cols + i)), best);
        }
    const float top = _mm512_reduce_max_ps(best);
    const float mult = (1.0f / top) * 448.0f; /* inf for an all-zero block */
    const int zero = top == 0.0f;
    *scale = 1.0f / mult;
    for (ltx_idx r = 0; r < BLOCK; r++)
        for (ltx_idx i = 0; i < BLOCK; i += 16) {
            __m512 v = widen16_avx512(m + r * cols + i);
            if (!zero) /* a zero stays itself where mult is inf (a block below 2^-126 * 448) */
                v = _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(),
                                                             _CMP_NEQ_UQ),
                                       v, _mm512_set1_ps(mult));
            __mmask16 past;
            _mm_storeu_si128((__m128i *)(codes + r * ldc + i),
                             _mm512_cvtepi32_epi8(ltx_fp8_round_avx512(v, 0, &past)));
        }
}
#endif

static float block_merge_rows(const uint8_t *codes, int fp6, const float *scales, uint16_t *delta,
                           ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
    const ltx_idx ldc = fp6 ? cols / 4 * 3 : cols, blocks = cols / BLOCK;
    const float *values = ltx_fp8_table(0);
    float top = 0.0f;
#if defined(LTX_VARIANT_AVX512)
    if (!fp6)
        return block_merge_rows_avx512(codes, scales, delta, cols, r0, r1);
#endif
    for (ltx_idx r = r0; r < r1; r++) {
        const uint8_t *row = codes + r * ldc;
        uint16_t *d = delta + r * cols;
        for (ltx_idx bj = 0; bj < blocks; bj++) {
            const float scale = scales[(r / BLOCK) * blocks + bj];
            for (ltx_idx i = bj * BLOCK; i < (bj + 1) * BLOCK; i++) {
                const uint32_t code = fp6 ? fp6_code(row, i) : row[i];
                const float w = ltx_bf16_round(values[code] * scale);
                const uint16_t m = ltx_bf16_of(w + ltx_bf16_value(d[i]));
                d[i] = m;
                const float a = absf(ltx_bf16_value(m));
                top = a > top ? a : top;
            }
        }
    }
    return top;
}

/* Block (bi, bj) alone: fp6, and fp8 in the AVX-512 builds (block_quantize takes the other
 * builds' fp8 a row of blocks at a time). */
static void block_quantize_one(const uint16_t *merged, ltx_idx cols, ltx_idx bi, ltx_idx bj,
                               int fp6, uint8_t *codes, float *scales)
{
    const ltx_idx ldc = fp6 ? cols / 4 * 3 : cols;
    const uint16_t *m = merged + bi * BLOCK * cols + bj * BLOCK;
#if defined(LTX_VARIANT_AVX512)
    if (!fp6) {
        block_quantize_avx512(m, cols, codes + bi * BLOCK * ldc + bj * BLOCK, ldc,
                              scales + bi * (cols / BLOCK) + bj);
        return;
    }
#endif
    /* the largest magnitude by the bf16 bits (finite input: they order as the values do) */
    uint32_t top_bits = 0;
    for (ltx_idx r = 0; r < BLOCK; r++)
        for (ltx_idx i = 0; i < BLOCK; i++) {
            const uint32_t a = m[r * cols + i] & 0x7FFFu;
            top_bits = a > top_bits ? a : top_bits;
        }
    const float top = ltx_bf16_value((uint16_t)top_bits);
    const float mult = (1.0f / top) * (fp6 ? 0.1172f : 448.0f); /* inf for an all-zero block */
    const int zero = top == 0.0f;
    scales[bi * (cols / BLOCK) + bj] = 1.0f / mult;
    for (ltx_idx r = 0; r < BLOCK; r++) {
        uint8_t *row = codes + (bi * BLOCK + r) * ldc + (fp6 ? bj * BLOCK / 4 * 3 : bj * BLOCK);
        for (ltx_idx i = 0; i < BLOCK; i += 4) {
            uint32_t c[4];
            for (int j = 0; j < 4; j++) {
                const float v = ltx_bf16_value(m[r * cols + i + j]);
                /* upstream's all-zero block quantises to NaN (0x7F): kept for fp6, whose
                 * packed 0x1F then dequantises to zero; the zeros themselves for fp8 */
                c[j] = zero ? (fp6 ? 0x7Fu : fp8_encode(v, 0))
                            : fp8_encode(v == 0.0f ? v : v * mult, 0);  /* 0 x inf: the 0 */
            }
            if (fp6) {
                uint32_t word = 0;
                for (int j = 0; j < 4; j++)
                    word |= ((((c[j] >> 7) & 1u) << 5) | (c[j] & 0x1Fu)) << (18 - 6 * j);
                uint8_t *p = row + i / 4 * 3;
                p[0] = (uint8_t)(word >> 16);
                p[1] = (uint8_t)(word >> 8);
                p[2] = (uint8_t)word;
            } else {
                for (int j = 0; j < 4; j++)
                    row[i + j] = (uint8_t)c[j];
            }
        }
    }
}

#define BLOCK_RUN 32 /* blocks a call takes at most: their tops and factors on the stack */

/* Blocks bj0..bj1 of block row bi. The fp8 case reads the 128 rows through all the blocks at
 * once, two passes (the tops, then the codes), each row's run contiguous; the same operations
 * per element as block_quantize_one, so the same bytes. */
static void block_quantize(const uint16_t *merged, ltx_idx cols, ltx_idx bi, ltx_idx bj0,
                           ltx_idx bj1, int fp6, uint8_t *codes, float *scales)
{
#if defined(LTX_VARIANT_AVX512)
    const int own = 1;
#else
    const int own = fp6;
#endif
    if (own) {
        for (ltx_idx bj = bj0; bj < bj1; bj++)
            block_quantize_one(merged, cols, bi, bj, fp6, codes, scales);
        return;
    }
    for (; bj1 - bj0 > BLOCK_RUN; bj0 += BLOCK_RUN)  /* at most BLOCK_RUN blocks a run */
        block_quantize(merged, cols, bi, bj0, bj0 + BLOCK_RUN, 0, codes, scales);
    const ltx_idx n = bj1 - bj0;
    uint32_t top[BLOCK_RUN];
    float mult[BLOCK_RUN];
    for (ltx_idx j = 0; j < n; j++)
        top[j] = 0;
    const uint16_t *m = merged + bi * BLOCK * cols + bj0 * BLOCK;
    for (ltx_idx r = 0; r < BLOCK; r++)
        for (ltx_idx j = 0; j < n; j++) {
            const uint16_t *x = m + r * cols + j * BLOCK;
            uint32_t best = top[j];
            for (ltx_idx i = 0; i < BLOCK; i++) {
                const uint32_t a = x[i] & 0x7FFFu;
                best = a > best ? a : best;
            }
            top[j] = best;
        }
    for (ltx_idx j = 0; j < n; j++) {
        /* inf for an all-zero block: its zeros are kept by the mask below (0 x inf would be
         * NaN: the product is taken for every element and chosen by integers, a loop that
         * vectorises) */
        mult[j] = (1.0f / ltx_bf16_value((uint16_t)top[j])) * 448.0f;
        scales[bi * (cols / BLOCK) + bj0 + j] = 1.0f / mult[j];
    }
    for (ltx_idx r = 0; r < BLOCK; r++) {
        const uint16_t *x = m + r * cols;
        uint8_t *row = codes + (bi * BLOCK + r) * cols + bj0 * BLOCK;
        for (ltx_idx j = 0; j < n; j++) {
            const float f = mult[j];
            for (ltx_idx i = j * BLOCK; i < (j + 1) * BLOCK; i++) {
                const float v = ltx_bf16_value(x[i]);
                const uint32_t p = ltx_f32_bits(v * f), keep = nonzero_mask(x[i]);
                row[i] = (uint8_t)fp8_encode(ltx_bits_f32((p & keep) | (ltx_f32_bits(v) & ~keep)),
                                             0);
            }
        }
    }
}

/* ---- NVFP4 ---- */

#define GROUP 16


static const float e2m1_value[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* A group's scale code from its largest magnitude and the tensor's scale t -- E4M3 of
 * (top / 6) / t, at most 448 (zero where t is) -- and 1 / (t * that scale's value), 0 for a
 * zero scale. */
static inline float nvfp4_group_scale(float top, float t, uint32_t *code)
{
    float s = 0.0f;
    if (t > 0.0f) {
        s = (top / 6.0f) / t;
        s = s < 448.0f ? s : 448.0f;
    }
    *code = fp8_encode(s, 0);
    const float total = t * ltx_fp8_table(0)[*code];
    return total > 0.0f ? 1.0f / total : 0.0f;
}

/* The value of an E4M3 code of a scale (0 to 0x7E, never NaN), by integer operations and one
 * exact conversion, so that a loop of it vectorises (a table lookup would not). */
static inline float e4m3_scale_value(uint32_t code)
{
    const uint32_t e = code >> 3, m = code & 7u;
    const float sub = (float)m * 0x1p-9f;
    const uint32_t normal = ((e + 120u) << 23) | (m << 20), keep_sub = 0u - (uint32_t)(e == 0);
    return ltx_bits_f32((ltx_f32_bits(sub) & keep_sub) | (normal & ~keep_sub));
}

/* Groups a chunk of an NVFP4 row's pass takes at once: their scales are computed side by side
 * (a loop over groups, which vectorises), then their codes. */
#define NVFP4_CHUNK 256

/* For groups 0..n-1 of largest magnitudes top[g] (f32 bits; finite) and the tensor's scale t
 * > 0: code[g] = e4m3(min(f32(f32(top / 6) / t), 448)) and step[g] = f32(t * that code's
 * value); NaN where both t and top are 0 is not possible here (t > 0). */
static inline void nvfp4_group_steps(const uint32_t *top, ltx_idx n, float t, uint32_t *code,
                                     float *step)
{
    for (ltx_idx g = 0; g < n; g++) {
        const float s = (ltx_bits_f32(top[g]) / 6.0f) / t;
        uint32_t a = ltx_f32_bits(s);
        a = a > 0x43E00000u ? 0x43E00000u : a;  /* 448; s >= 0 */
        code[g] = fp8_encode(ltx_bits_f32(a), 0);
        step[g] = t * e4m3_scale_value(code[g]);
    }
}

/* Sixteen E2M1 codes (one a uint32) into eight bytes, element 2j in byte j's high nibble. */
static inline void nvfp4_pack16(const uint32_t *c, uint8_t *out)
{
    for (int j = 0; j < GROUP / 2; j++)
        out[j] = (uint8_t)(c[2 * j] << 4 | c[2 * j + 1]);
}

#if defined(LTX_VARIANT_AVX512)
/* The NVFP4 passes below in the AVX-512 builds, a group of 16 elements -- one vector -- at a
 * time, with the same f32
 * operations in the same order: the nibbles' values from the table by a permute, the merge
 * and its maximum (the running maximum kept where a value is NaN, as the scalar comparison
 * does); the group's maximum, scale and code by the scalar rules, then the E2M1 codes by the
 * same seven comparisons, counted. */
static LTX_AVX512_TARGET float nvfp4_merge_rows_avx512(const uint8_t *packed,
                                                       const uint8_t *scales,
                                                       ltx_idx padded_cols, float scale_2,
                                                       uint16_t *delta, ltx_idx cols,
                                                       ltx_idx r0, ltx_idx r1)
{
    const __m512 values = _mm512_loadu_ps(e2m1_value);
    __m512 best = _mm512_setzero_ps();
    for (ltx_idx r = r0; r < r1; r++)
        for (ltx_idx g = 0; g < cols / GROUP; g++) {
            const float total = scale_2 * ltx_fp8_table(0)[scales[ltx_nvfp4_scale_offset(
                r, g, padded_cols)]];
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(packed + r * (cols / 2) +
                                                                    g * GROUP / 2));
            /* element 2j is byte j's high nibble, element 2j + 1 its low one */
            const __m128i nibbles = _mm_unpacklo_epi8(
                _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F)),
                _mm_and_si128(bytes, _mm_set1_epi8(0x0F)));
            const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), values);
            const __m512 w = _mm512_castsi512_ps(
                bf16_high_avx512(_mm512_mul_ps(v, _mm512_set1_ps(total))));
            best = merge16_avx512(w, delta + r * cols + g * GROUP, best);
        }
    return _mm512_reduce_max_ps(best);
}

static LTX_AVX512_TARGET void nvfp4_quantize_rows_avx512(const uint16_t *merged, float t,
                                                         uint8_t *packed, uint8_t *scales,
                                                         ltx_idx padded_cols, ltx_idx cols,
                                                         ltx_idx r0, ltx_idx r1)
{
    for (ltx_idx r = r0; r < r1; r++)
        for (ltx_idx g = 0; g < cols / GROUP; g++) {
            const __m512 v = widen16_avx512(merged + r * cols + g * GROUP);
            const float top = _mm512_reduce_max_ps(
                _mm512_max_ps(_mm512_abs_ps(v), _mm512_setzero_ps()));
            uint32_t sf;
            const float inv = nvfp4_group_scale(top, t, &sf);
            scales[ltx_nvfp4_scale_offset(r, g, padded_cols)] = (uint8_t)sf;
            /* a zero stays itself where inv is inf (a total below 2^-128) */
            const __m512 x = _mm512_mask_mul_ps(v, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(),
                                                                     _CMP_NEQ_UQ),
                                                v, _mm512_set1_ps(inv));
            const __m512 a = _mm512_abs_ps(x);
            const __m512i one = _mm512_set1_epi32(1);
            __m512i code = _mm512_setzero_si512();
            for (int k = 0; k < 7; k++) {  /* ltx_e2m1_from_f32's count */
                const __mmask16 past = _mm512_cmp_ps_mask(a, _mm512_set1_ps(e2m1_midpoint[k]),
                                                          (k & 1) ? _CMP_GE_OQ : _CMP_GT_OQ);
                code = _mm512_mask_add_epi32(code, past, code, one);
            }
            code = _mm512_or_si512(code, _mm512_and_si512(
                _mm512_srli_epi32(_mm512_castps_si512(x), 28), _mm512_set1_epi32(0x8)));
            /* 16 codes -> 8 bytes, element 2j in byte j's high nibble */
            const __m128i c = _mm512_cvtepi32_epi8(code);
            const __m128i pairs = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(
                c, _mm_set1_epi16(0x00FF)), 4), _mm_srli_epi16(c, 8));
            _mm_storel_epi64((__m128i *)(packed + r * (cols / 2) + g * GROUP / 2),
                             _mm_packus_epi16(pairs, pairs));
        }
}
#endif

static float nvfp4_merge_rows(const uint8_t *packed, const uint8_t *scales, ltx_idx padded_cols,
                           float scale_2, uint16_t *delta, ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
    float top = 0.0f;
#if defined(LTX_VARIANT_AVX512)
        return nvfp4_merge_rows_avx512(packed, scales, padded_cols, scale_2, delta, cols, r0, r1);
#endif
    for (ltx_idx r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * (cols / 2);
        uint16_t *d = delta + r * cols;
        for (ltx_idx g = 0; g < cols / GROUP; g++) {
            const float total = scale_2 * ltx_fp8_table(0)[scales[ltx_nvfp4_scale_offset(r, g, padded_cols)]];
            for (ltx_idx j = 0; j < GROUP; j++) {
                const ltx_idx i = g * GROUP + j;
                const uint8_t byte = row[i / 2];
                const float v = e2m1_value[(i % 2) ? (byte & 0xFu) : (byte >> 4)];
                const float w = ltx_bf16_round(v * total);
                const uint16_t m = ltx_bf16_of(w + ltx_bf16_value(d[i]));
                d[i] = m;
                const float a = absf(ltx_bf16_value(m));
                top = a > top ? a : top;
            }
        }
    }
    return top;
}

static void nvfp4_quantize_rows(const uint16_t *merged, float t, uint8_t *packed, uint8_t *scales,
                             ltx_idx padded_cols, ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
#if defined(LTX_VARIANT_AVX512)
    {
        nvfp4_quantize_rows_avx512(merged, t, packed, scales, padded_cols, cols, r0, r1);
        return;
    }
#endif
    if (!(t > 0.0f)) {  /* an all-zero tensor: scales 0, each code its zero (sign kept) */
        for (ltx_idx r = r0; r < r1; r++)
            for (ltx_idx g = 0; g < cols / GROUP; g++) {
                uint32_t c[GROUP];
                for (int j = 0; j < GROUP; j++)
                    c[j] = e2m1_from_f32(ltx_bf16_value(merged[r * cols + g * GROUP + j]));
                scales[ltx_nvfp4_scale_offset(r, g, padded_cols)] = 0;
                nvfp4_pack16(c, packed + r * (cols / 2) + g * GROUP / 2);
            }
        return;
    }
    uint32_t top[NVFP4_CHUNK], code[NVFP4_CHUNK];
    float step[NVFP4_CHUNK];
    for (ltx_idx r = r0; r < r1; r++) {
        const uint16_t *m = merged + r * cols;
        uint8_t *row = packed + r * (cols / 2);
        for (ltx_idx g0 = 0; g0 < cols / GROUP; g0 += NVFP4_CHUNK) {
            const ltx_idx n = cols / GROUP - g0 < NVFP4_CHUNK ? cols / GROUP - g0 : NVFP4_CHUNK;
            for (ltx_idx g = 0; g < n; g++) {  /* finite bf16: bits order as magnitudes */
                const uint16_t *x = m + (g0 + g) * GROUP;
                uint32_t best = 0;
                for (int j = 0; j < GROUP; j++) {
                    const uint32_t a = x[j] & 0x7FFFu;
                    best = a > best ? a : best;
                }
                top[g] = best << 16;
            }
            nvfp4_group_steps(top, n, t, code, step);
            for (ltx_idx g = 0; g < n; g++) {
                scales[ltx_nvfp4_scale_offset(r, g0 + g, padded_cols)] = (uint8_t)code[g];
                /* inv = 1 / total, 0 for a zero total: the quotient taken for every group
                 * and chosen by bits */
                const uint32_t live = 0u - (uint32_t)(ltx_f32_bits(step[g]) != 0);
                const float inv = ltx_bits_f32(ltx_f32_bits(1.0f / step[g]) & live);
                const uint16_t *x = m + (g0 + g) * GROUP;
                uint32_t c[GROUP];
                for (int j = 0; j < GROUP; j++) {
                    /* a zero stays itself where inv is inf (a total below 2^-128) */
                    const float v = ltx_bf16_value(x[j]);
                    const uint32_t p = ltx_f32_bits(v * inv), keep = nonzero_mask(x[j]);
                    c[j] = e2m1_from_f32(ltx_bits_f32((p & keep) | (ltx_f32_bits(v) & ~keep)));
                }
                nvfp4_pack16(c, row + (g0 + g) * GROUP / 2);
            }
        }
    }
}

/* ---- ComfyUI's nvfp4, mxfp8 and int8 ---- */

/* The larger of a running maximum and a magnitude, a NaN kept once it comes (a NaN merge must
 * show in the maximum the caller checks). */
static inline float max_nan(float top, float a)
{
    if (top != top)
        return top;
    return (a > top || a != a) ? a : top;
}

static float comfy_nvfp4_max_rows(const uint8_t *packed, const uint8_t *scales, ltx_idx padded_cols,
                               float scale_2, const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                               ltx_idx r1)
{
    float top = 0.0f;
    for (ltx_idx r = r0; r < r1; r++) {
        const uint8_t *row = packed + r * (cols / 2);
        const uint16_t *d = delta + r * cols;
        for (ltx_idx g = 0; g < cols / GROUP; g++) {
            const float total = scale_2 * ltx_fp8_table(0)[scales[ltx_nvfp4_scale_offset(r, g, padded_cols)]];
            for (ltx_idx i = g * GROUP; i < (g + 1) * GROUP; i++) {
                const uint8_t byte = row[i / 2];
                const float w = e2m1_value[(i % 2) ? (byte & 0xFu) : (byte >> 4)] * total;
                top = max_nan(top, absf(w + ltx_bf16_value(d[i])));
            }
        }
    }
    return top;
}

static void comfy_nvfp4_quantize_rows(uint8_t *packed, const uint8_t *old_scales, uint8_t *scales,
                                   ltx_idx padded_cols, float scale_2, const uint16_t *delta,
                                   float t, ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
    /* a chunk of groups at a time: their merged values, then their scales side by side, then
     * their codes */
    float n[NVFP4_CHUNK * GROUP], step[NVFP4_CHUNK];
    uint32_t top[NVFP4_CHUNK], code[NVFP4_CHUNK];
    for (ltx_idx r = r0; r < r1; r++) {
        uint8_t *row = packed + r * (cols / 2);
        const uint16_t *d = delta + r * cols;
        for (ltx_idx g0 = 0; g0 < cols / GROUP; g0 += NVFP4_CHUNK) {
            const ltx_idx count = cols / GROUP - g0 < NVFP4_CHUNK ? cols / GROUP - g0
                                                                  : NVFP4_CHUNK;
            for (ltx_idx g = 0; g < count; g++) {
                float *v = n + g * GROUP;
                const ltx_idx i0 = (g0 + g) * GROUP;
                if (old_scales) {
                    const ltx_idx at = ltx_nvfp4_scale_offset(r, g0 + g, padded_cols);
                    const float total = scale_2 * ltx_fp8_table(0)[old_scales[at]];
                    for (int j = 0; j < GROUP; j++) {
                        const uint8_t byte = row[(i0 + j) / 2];
                        v[j] = e2m1_value[(j % 2) ? (byte & 0xFu) : (byte >> 4)] * total +
                               ltx_bf16_value(d[i0 + j]);
                    }
                } else { /* a bf16 weight quantised: its values, -0.0 kept */
                    for (int j = 0; j < GROUP; j++)
                        v[j] = ltx_bf16_value(d[i0 + j]);
                }
                uint32_t best = 0;  /* finite: the bits order as the magnitudes */
                for (int j = 0; j < GROUP; j++) {
                    const uint32_t a = ltx_f32_bits(v[j]) & 0x7FFFFFFFu;
                    best = a > best ? a : best;
                }
                top[g] = best;
            }
            for (ltx_idx g = 0; g < count; g++) {
                /* t is 0 only for a bf16 weight whose scale_2 rounded to 0: a block of zeros
                 * (0 / 0, NaN) takes scale 0, any other (x / 0) the largest */
                const uint32_t a = ltx_f32_bits((ltx_bits_f32(top[g]) / 6.0f) / t);
                const uint32_t nan = 0u - (uint32_t)(a > 0x7F800000u);
                const uint32_t sat = a > 0x43E00000u ? 0x43E00000u : a;  /* 448 */
                code[g] = fp8_encode(ltx_bits_f32(sat & ~nan), 0);
                step[g] = t * e4m3_scale_value(code[g]);
            }
            for (ltx_idx g = 0; g < count; g++) {
                scales[ltx_nvfp4_scale_offset(r, g0 + g, padded_cols)] = (uint8_t)code[g];
                /* a zero step gives +0 codes: the quotients are dropped */
                const uint32_t live = 0u - (uint32_t)(ltx_f32_bits(step[g]) != 0);
                const float *v = n + g * GROUP;
                uint32_t c[GROUP];
                for (int j = 0; j < GROUP; j++)
                    c[j] = e2m1_from_f32(v[j] / step[g]) & live;
                nvfp4_pack16(c, row + (g0 + g) * GROUP / 2);
            }
        }
    }
}

#define MX_GROUP 32

/* 2^(e - 127) of an E8M0 byte e in 0..254, 0 for e = 0 (comfy-kitchen's decoding). */
static inline float e8m0_value(uint32_t e) { return e ? ltx_bits_f32(e << 23) : 0.0f; }

static float comfy_mxfp8_max_rows(const uint8_t *codes, const uint8_t *scales, ltx_idx padded_cols,
                               const uint16_t *delta, ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
    const float *value = ltx_fp8_table(0);
    float top = 0.0f;
    for (ltx_idx r = r0; r < r1; r++)
        for (ltx_idx g = 0; g < cols / MX_GROUP; g++) {
            const float scale = e8m0_value(scales[ltx_nvfp4_scale_offset(r, g, padded_cols)]);
            for (ltx_idx i = r * cols + g * MX_GROUP; i < r * cols + (g + 1) * MX_GROUP; i++)
                top = max_nan(top, absf(value[codes[i]] * scale + ltx_bf16_value(delta[i])));
        }
    return top;
}

/* The E8M0 exponent of a group of largest magnitude top > 0, by comfy-kitchen's f32 steps:
 * ceil(f32(log2(needed))), the log2 correctly rounded to f32 (taken in double and rounded
 * once). With needed = (1 + mant 2^-23) 2^k normal, that is k where mant = 0, and k + 1 where
 * mant >= 64: log2 then exceeds k by at least log2(1 + 2^-17) > 1.1e-5, more than half an f32
 * ulp (3.8e-6) of any value below 128 in magnitude, so its rounding stays above k. Only the
 * rest (a mantissa within 63 units of a power of two, or a subnormal needed) takes the log2. */
static inline uint32_t e8m0_for(float top)
{
    float needed = top / 448.0f;
    needed = needed > 0x1p-127f ? needed : 0x1p-127f;
    const uint32_t u = ltx_f32_bits(needed), mant = u & 0x7FFFFFu, biased = u >> 23;
    const int e = biased != 0 && (mant == 0 || mant >= 64)
                      ? (int)biased + (mant != 0)
                      : (int)ceilf((float)log2((double)needed)) + 127;
    return (uint32_t)(e < 0 ? 0 : e > 254 ? 254 : e);
}

/* 1 / e8m0_value(e) exactly, 2^(127 - e) (2^-127 a subnormal), 0 for e = 0: a quotient by
 * a power of two and the product by its reciprocal round the same real number, so they are
 * the same f32. */
static inline float e8m0_reciprocal(uint32_t e)
{
    return e == 0 ? 0.0f : e == 254 ? ltx_bits_f32(0x00400000u) : ltx_bits_f32((254u - e) << 23);
}

static void comfy_mxfp8_quantize_rows(uint8_t *codes, const uint8_t *old_scales, uint8_t *scales,
                                   ltx_idx padded_cols, const uint16_t *delta, ltx_idx cols,
                                   ltx_idx r0, ltx_idx r1)
{
    const float *value = ltx_fp8_table(0);
    float n[MX_GROUP];
    for (ltx_idx r = r0; r < r1; r++)
        for (ltx_idx g = 0; g < cols / MX_GROUP; g++) {
            const ltx_idx at = ltx_nvfp4_scale_offset(r, g, padded_cols);
            uint8_t *c = codes + r * cols + g * MX_GROUP;
            const uint16_t *d = delta + r * cols + g * MX_GROUP;
            float top = 0.0f;
            if (old_scales) {
                const float scale = e8m0_value(old_scales[at]);
                for (int j = 0; j < MX_GROUP; j++)
                    n[j] = value[c[j]] * scale + ltx_bf16_value(d[j]);
            } else { /* a bf16 weight quantised: its values, -0.0 kept */
                for (int j = 0; j < MX_GROUP; j++)
                    n[j] = ltx_bf16_value(d[j]);
            }
            uint32_t top_bits = 0;  /* finite: the bits order as the magnitudes */
            for (int j = 0; j < MX_GROUP; j++) {
                const uint32_t a = ltx_f32_bits(n[j]) & 0x7FFFFFFFu;
                top_bits = a > top_bits ? a : top_bits;
            }
            top = ltx_bits_f32(top_bits);
            const uint32_t e = top > 0.0f ? e8m0_for(top) : 0u;
            scales[at] = (uint8_t)e;
            const float inverse = e8m0_reciprocal(e);
            /* e = 0: zero codes, the products (by 0) dropped; else clamped to 448 by the
             * magnitude's bits */
            for (int j = 0; j < MX_GROUP; j++) {
                const uint32_t q = ltx_f32_bits(n[j] * inverse), sign = q & 0x80000000u;
                uint32_t a = q & 0x7FFFFFFFu;
                a = a > 0x43E00000u ? 0x43E00000u : a;  /* 448 */
                const uint32_t code = fp8_encode(ltx_bits_f32(a | sign), 0);
                c[j] = (uint8_t)(e ? code : 0u);
            }
        }
}

static float comfy_int8_max_rows(const int8_t *codes, const float *scale, int per_row,
                              const uint16_t *delta, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                              float *row_top)
{
    float top = 0.0f;
    for (ltx_idx r = r0; r < r1; r++) {
        const float s = scale[per_row ? r : 0];
        float rtop = 0.0f;
        for (ltx_idx i = r * cols; i < (r + 1) * cols; i++)
            rtop = max_nan(rtop, absf((float)codes[i] * s + ltx_bf16_value(delta[i])));
        if (row_top)
            row_top[r] = rtop;
        top = max_nan(top, rtop);
    }
    return top;
}

static void comfy_int8_quantize_rows(int8_t *codes, const float *scale, const float *new_scale,
                                  int per_row, const uint16_t *delta, ltx_idx cols, ltx_idx r0,
                                  ltx_idx r1)
{
    for (ltx_idx r = r0; r < r1; r++) {
        const float s = scale[per_row ? r : 0], s_new = new_scale[per_row ? r : 0];
        for (ltx_idx i = r * cols; i < (r + 1) * cols; i++) {
            /* rintf rounds half to even in the default rounding mode */
            float q = rintf(((float)codes[i] * s + ltx_bf16_value(delta[i])) / s_new);
            q = q > 127.0f ? 127.0f : q < -128.0f ? -128.0f : q;
            codes[i] = (int8_t)q;
        }
    }
}

/* ---- Quantising a bf16 weight ---- */

static uint16_t bf16_absmax_rows(const uint16_t *w, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                                 uint16_t *row_top)
{
    uint16_t top = 0;
    for (ltx_idx r = r0; r < r1; r++) {
        const uint16_t *x = w + r * cols;
        uint16_t best = 0;
        for (ltx_idx i = 0; i < cols; i++) {
            const uint16_t a = x[i] & 0x7FFFu;
            best = a > best ? a : best;
        }
        if (row_top)
            row_top[r] = best;
        top = best > top ? best : top;
    }
    return top;
}

/* One element of scaled_fp8_quantize; e5m2 and round_bf16 are constants where it is inlined,
 * so that each of the four loops below is one straight vectorisable body. */
static inline __attribute__((always_inline)) uint8_t scaled_fp8_code(uint16_t w, float mult,
                                                                     float fmax, int e5m2,
                                                                     int round_bf16)
{
    /* the product is finite or +-inf (never NaN: a zero meets an infinite mult only in the
     * caller's other loop), so bf16 rounding and the clamp work on its bits: integers, which
     * vectorise */
    uint32_t u = ltx_f32_bits(ltx_bf16_value(w) * mult);
    if (round_bf16)
        u = LTX_BF16_NEAREST(u);  /* +-inf stays itself */
    const uint32_t sign = u & 0x80000000u, top = ltx_f32_bits(fmax);
    uint32_t a = u & 0x7FFFFFFFu;
    a = a > top ? top : a;
    return (uint8_t)fp8_encode(ltx_bits_f32(a | sign), e5m2);
}

#define SCALED_FP8_LOOP(E5M2, ROUND)                                                       \
    for (ltx_idx i = 0; i < count; i++)                                                    \
        codes[i] = scaled_fp8_code(w[i], mult, fmax, E5M2, ROUND);

static void scaled_fp8_quantize(const uint16_t *w, uint8_t *codes, ltx_idx count, float mult,
                                float fmax, int e5m2, int round_bf16)
{
    if (mult - mult != 0.0f) {
        /* a scale of 0 (an all-zero weight): the owners' 0 * inf is NaN, ltx2blas keeps the
         * zeros (their signs too); any other element saturates */
        for (ltx_idx i = 0; i < count; i++)
            codes[i] = ltx_bf16_value(w[i]) == 0.0f
                           ? (uint8_t)fp8_encode(ltx_bf16_value(w[i]), e5m2)
                           : scaled_fp8_code(w[i], mult, fmax, e5m2, round_bf16);
        return;
    }
    if (e5m2) {
        if (round_bf16) { SCALED_FP8_LOOP(1, 1) } else { SCALED_FP8_LOOP(1, 0) }
    } else {
        if (round_bf16) { SCALED_FP8_LOOP(0, 1) } else { SCALED_FP8_LOOP(0, 0) }
    }
}

static void int8_quantize_rows(const uint16_t *w, int8_t *codes, const float *scale,
                               int per_row, ltx_idx cols, ltx_idx r0, ltx_idx r1)
{
    for (ltx_idx r = r0; r < r1; r++) {
        const float s = scale[per_row ? r : 0];
        const uint16_t *x = w + r * cols;
        int8_t *c = codes + r * cols;
        for (ltx_idx i = 0; i < cols; i++) {
            /* rintf rounds half to even in the default rounding mode; |q| <= 128 is a bf16
             * integer, so rounding the bf16 quotient's value is torch's round of a bf16 */
            float q = rintf(ltx_bf16_round(ltx_bf16_value(x[i]) / s));
            q = q > 127.0f ? 127.0f : q < -128.0f ? -128.0f : q;
            c[i] = (int8_t)q;
        }
    }
}

/* ---- DoRA ---- */

static void dora_merge_rows(const uint16_t *w, uint16_t *delta, ltx_idx cols, ltx_idx r0,
                         ltx_idx r1, double *row_sq)
{
    for (ltx_idx r = r0; r < r1; r++) {
        const uint16_t *wr = w + r * cols;
        uint16_t *d = delta + r * cols;
        double acc = 0.0;
        for (ltx_idx i = 0; i < cols; i++) {
            const uint16_t v = ltx_bf16_of(ltx_bf16_value(wr[i]) + ltx_bf16_value(d[i]));
            const double x = ltx_bf16_value(v);
            d[i] = v;
            acc = acc + x * x;
        }
        if (row_sq)
            row_sq[r] = acc;
    }
}

static void sum_squares_rows(const uint16_t *x, ltx_idx cols, ltx_idx r0, ltx_idx r1, double *out)
{
    for (ltx_idx r = r0; r < r1; r++) {
        double acc = 0.0;
        for (ltx_idx i = 0; i < cols; i++) {
            const double v = ltx_bf16_value(x[r * cols + i]);
            acc = acc + v * v;
        }
        out[r] = acc;
    }
}

static void sum_squares_cols(const uint16_t *x, ltx_idx rows, ltx_idx cols, ltx_idx c0, ltx_idx c1,
                          double *out)
{
    for (ltx_idx c = c0; c < c1; c++)
        out[c] = 0.0;
    for (ltx_idx r = 0; r < rows; r++) /* rows in order: the reference's order */
        for (ltx_idx c = c0; c < c1; c++) {
            const double v = ltx_bf16_value(x[r * cols + c]);
            out[c] = out[c] + v * v;
        }
}

static void dora_store_rows(const uint16_t *v, const float *row_factor, const float *col_factor,
                         const uint16_t *w, uint16_t *out, ltx_idx cols, ltx_idx r0, ltx_idx r1,
                         float strength, int blend)
{
    for (ltx_idx r = r0; r < r1; r++) {
        for (ltx_idx i = 0; i < cols; i++) {
            const float f = row_factor ? row_factor[r] : col_factor[i];
            const float full = ltx_bf16_round(ltx_bf16_value(v[r * cols + i]) * f);
            if (blend) {
                const float base = ltx_bf16_value(w[r * cols + i]);
                out[r * cols + i] = ltx_bf16_of(base + strength * (full - base));
            } else {
                out[r * cols + i] = ltx_bf16_of(full);
            }
        }
    }
}

const ltx_layout_passes LTX_LAYOUT_TABLE = {
    .scaled_fp8_max = scaled_fp8_max,
    .scaled_fp8_store = scaled_fp8_store,
    .block_merge_rows = block_merge_rows,
    .block_quantize = block_quantize,
    .nvfp4_merge_rows = nvfp4_merge_rows,
    .nvfp4_quantize_rows = nvfp4_quantize_rows,
    .comfy_nvfp4_max_rows = comfy_nvfp4_max_rows,
    .comfy_nvfp4_quantize_rows = comfy_nvfp4_quantize_rows,
    .comfy_mxfp8_max_rows = comfy_mxfp8_max_rows,
    .comfy_mxfp8_quantize_rows = comfy_mxfp8_quantize_rows,
    .comfy_int8_max_rows = comfy_int8_max_rows,
    .comfy_int8_quantize_rows = comfy_int8_quantize_rows,
    .bf16_absmax_rows = bf16_absmax_rows,
    .scaled_fp8_quantize = scaled_fp8_quantize,
    .int8_quantize_rows = int8_quantize_rows,
    .dora_merge_rows = dora_merge_rows,
    .sum_squares_rows = sum_squares_rows,
    .sum_squares_cols = sum_squares_cols,
    .dora_store_rows = dora_store_rows,
};
