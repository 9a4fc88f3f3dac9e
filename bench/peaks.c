/* Register-only loops: how many of one instruction a core retires a cycle with nothing loaded
 * or stored, the ceiling each kernel is read against (the fuse's FMA table against the FMA
 * peak, its dot-product table against the dot-product peak, beside sgemm).
 *
 * Each loop keeps ACC independent accumulators (more than latency x issue rate on any core
 * measured), repeats the instruction on them `iters` times and stores them once, so that the
 * compiler keeps every step. Each function carries its own target attribute: one build with
 * the default flags holds them all, and bench/harness.py calls only those the CPU runs.
 *
 * Built by bench/harness.py with the system C compiler at -O2. Returns the sum of the lanes
 * (ignored: it keeps the loop alive). */
#include <stddef.h>

#define ACC 24

/* ACC accumulators of type vec from zero, `step` on each of them iters times, then the sum of
 * `sum` over them (a[i] the accumulator). */
#define LOOP(vec, zero, step, sum)                                                            \
    vec a[ACC];                                                                               \
    for (int i = 0; i < ACC; i++)                                                             \
        a[i] = zero;                                                                          \
    for (long n = 0; n < iters; n++)                                                          \
        _Pragma("GCC unroll 24") for (int i = 0; i < ACC; i++)                                \
            a[i] = step;                                                                      \
    float total = 0.0f;                                                                       \
    for (int i = 0; i < ACC; i++)                                                             \
        total += sum;                                                                         \
    return total;

#if defined(__x86_64__)
#include <immintrin.h>

/* 8 lanes x 2 flops an FMA */
__attribute__((target("avx2,fma"))) float fma_avx2(long iters, float x, float y)
{
    const __m256 xv = _mm256_set1_ps(x), yv = _mm256_set1_ps(y);
    LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(a[i], xv, yv),
         _mm256_cvtss_f32(a[i]))
}

/* 16 lanes x 2 flops */
__attribute__((target("avx512f"))) float fma_avx512(long iters, float x, float y)
{
    const __m512 xv = _mm512_set1_ps(x), yv = _mm512_set1_ps(y);
    LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(a[i], xv, yv), _mm512_reduce_add_ps(a[i]))
}

/* 16 lanes x 2 products x 2 flops */
__attribute__((target("avx512f,avx512bf16"))) float dot_avx512bf16(long iters, float x, float y)
{
    const __m512bh xv = _mm512_cvtne2ps_pbh(_mm512_set1_ps(x), _mm512_set1_ps(x));
    const __m512bh yv = _mm512_cvtne2ps_pbh(_mm512_set1_ps(y), _mm512_set1_ps(y));
    LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(a[i], xv, yv), _mm512_reduce_add_ps(a[i]))
}
#endif

#if defined(__aarch64__)
#include <arm_neon.h>

/* 4 lanes x 2 flops */
float fma_neon(long iters, float x, float y)
{
    const float32x4_t xv = vdupq_n_f32(x), yv = vdupq_n_f32(y);
    LOOP(float32x4_t, vdupq_n_f32(0.0f), vfmaq_f32(a[i], xv, yv), vaddvq_f32(a[i]))
}

/* 4 lanes x 2 products x 2 flops */
__attribute__((target("arch=armv8.2-a+bf16"))) float dot_neon_bf16(long iters, float x, float y)
{
    const bfloat16x8_t xv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(x)), vcvt_bf16_f32(vdupq_n_f32(x)));
    const bfloat16x8_t yv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(y)), vcvt_bf16_f32(vdupq_n_f32(y)));
    LOOP(float32x4_t, vdupq_n_f32(0.0f), vbfdotq_f32(a[i], xv, yv), vaddvq_f32(a[i]))
}

/* 2 x 2 sums x 4 products x 2 flops */
__attribute__((target("arch=armv8.2-a+bf16"))) float mmla_neon_bf16(long iters, float x, float y)
{
    const bfloat16x8_t xv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(x)), vcvt_bf16_f32(vdupq_n_f32(x)));
    const bfloat16x8_t yv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(y)), vcvt_bf16_f32(vdupq_n_f32(y)));
    LOOP(float32x4_t, vdupq_n_f32(0.0f), vbfmmlaq_f32(a[i], xv, yv), vaddvq_f32(a[i]))
}

/* 4 lanes x 2 flops (BFMLALB: the even bf16 lanes) */
__attribute__((target("arch=armv8.2-a+bf16"))) float bfmlal_neon_bf16(long iters, float x, float y)
{
    const bfloat16x8_t xv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(x)), vcvt_bf16_f32(vdupq_n_f32(x)));
    const bfloat16x8_t yv = vcombine_bf16(vcvt_bf16_f32(vdupq_n_f32(y)), vcvt_bf16_f32(vdupq_n_f32(y)));
    LOOP(float32x4_t, vdupq_n_f32(0.0f), vbfmlalbq_f32(a[i], xv, yv), vaddvq_f32(a[i]))
}
#endif
