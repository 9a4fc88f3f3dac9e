/* The loops the reports measured, as they describe them: the "before" figures.
 *
 * lora_scalar: the fuse's (B * s) @ A product, one thread, a non-inlined bf16 -> f32 call per
 * multiply, the inner operand strided by cols (every load a separate cache line), f32
 * accumulator, bf16 store.  linear_scalar: the text tower's Linear, one thread, both operands
 * widened to double per multiply, double accumulator.
 *
 * Built by bench/peers.py with the system C compiler at -O2; timed on a slice of the rows.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

__attribute__((noinline)) float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

__attribute__((noinline)) uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void lora_scalar(const uint16_t *bs, const uint16_t *a, uint16_t *agg, ptrdiff_t rows,
                 ptrdiff_t cols, ptrdiff_t rank)
{
    for (ptrdiff_t o = 0; o < rows; ++o) {
        const uint16_t *brow = bs + o * rank;
        for (ptrdiff_t i = 0; i < cols; ++i) {
            float acc = 0.0f;
            for (ptrdiff_t k = 0; k < rank; ++k)
                acc += bf16_to_f32(brow[k]) * bf16_to_f32(a[k * cols + i]);
            agg[o * cols + i] = f32_to_bf16(acc);
        }
    }
}

void linear_scalar(const float *x, const float *w, const float *bias, float *out,
                   ptrdiff_t rows, ptrdiff_t in_features, ptrdiff_t out_features)
{
    for (ptrdiff_t r = 0; r < rows; ++r) {
        const float *xr = x + r * in_features;
        for (ptrdiff_t o = 0; o < out_features; ++o) {
            const float *wr = w + o * in_features;
            double acc = bias ? (double)bias[o] : 0.0;
            for (ptrdiff_t i = 0; i < in_features; ++i)
                acc += (double)xr[i] * (double)wr[i];
            out[r * out_features + o] = (float)acc;
        }
    }
}
