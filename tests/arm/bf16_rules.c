/*
 * What Arm's BF16 instructions compute, element by element, against IEEE f32 steps written in C
 * (docs/arithmetic.md, "Arm's BF16 instructions").  Built and run by tests/test_arm_bf16.py on
 * aarch64 where the CPU has BF16 (HWCAP2_BF16); prints one line per rule:
 *
 *   <rule> <cases> <mismatches> [<first mismatch>]
 *
 * The rules checked:
 *   bfmlalb, bfmlalt   acc + a*b, a and b the even (odd) bf16 lanes: the product exact in f32,
 *                      one round-to-nearest-even -- the fuse's textbook step, subnormals kept
 *   bfcvt              f32 -> bf16 round-to-nearest-even (ltx2blas's bf16 rounding)
 *   bfdot_textbook     acc + a0*b0 + a1*b1 as two textbook steps, in order (expected to differ)
 *   bfdot_ro           the Armv8.6 pseudo-code without FEAT_EBF16 (BFDotAdd): both products
 *                      exact, their sum rounded to odd, added to acc rounded to odd, every
 *                      subnormal input and output flushed to zero, NaN the default NaN
 *   bfmmla_ro          BFMMLA, the same rule per pair of products, the two pairs in order
 *
 * Cases: random bf16 bits of every exponent and sign, plus values near the f32 subnormal and
 * overflow edges, ties, zeros of both signs, infinities and NaNs.
 */
#include <arm_neon.h>
#include <fenv.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static float bf(uint16_t h) { return u2f((uint32_t)h << 16); }

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint64_t next(void)
{
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A bf16 value: random bits four times in five, else one of the edge values. */
static uint16_t pick(void)
{
    static const uint16_t edge[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x0081,
                                    0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
                                    0x1F80, 0x2000, 0x5F80, 0x6000, 0x3F81, 0x3C00};
    uint64_t r = next();
    if (r % 5)
        return (uint16_t)(r >> 16);
    return edge[(r >> 8) % (sizeof edge / sizeof edge[0])];
}

static int same(float x, float y) { return (isnan(x) && isnan(y)) || f2u(x) == f2u(y); }

/* Flush an f32 subnormal to zero of its sign. */
static float ftz(float x)
{
    return (fpclassify(x) == FP_SUBNORMAL) ? u2f(f2u(x) & 0x80000000u) : x;
}

/* x + y rounded to odd: toward zero, then the last bit set if the result was inexact. */
static float add_round_odd(float x, float y)
{
    if (isnan(x) || isnan(y))
        return u2f(0x7FC00000u);
    if (isinf(x) || isinf(y))
        return x + y;
    int mode = fegetround();
    fesetround(FE_TOWARDZERO);
    feclearexcept(FE_INEXACT | FE_OVERFLOW);
    volatile float s = x + y;
    int inexact = fetestexcept(FE_INEXACT), overflow = fetestexcept(FE_OVERFLOW);
    fesetround(mode);
    float r = s;
    if (overflow)   /* the pseudo-code's FPRound: round-to-odd overflows to infinity */
        return copysignf(INFINITY, r);
    if (inexact)
        r = u2f(f2u(r) | 1u);
    return r;
}

/* BFDotAdd without FEAT_EBF16, as the pseudo-code states it. */
static float dot_ro(float acc, uint16_t a0, uint16_t b0, uint16_t a1, uint16_t b1)
{
    float p0 = ftz(ftz(bf(a0)) * ftz(bf(b0)));
    float p1 = ftz(ftz(bf(a1)) * ftz(bf(b1)));
    float r = ftz(add_round_odd(ftz(acc), ftz(add_round_odd(p0, p1))));
    return isnan(r) ? u2f(0x7FC00000u) : r;
}

/* Whether a*b of two finite bf16 values is exact in f32: its significand has at most 16 bits,
 * so it is unless it falls below the normal range (or overflows). */
static int exact_product(uint16_t a, uint16_t b)
{
    float x = bf(a), y = bf(b), p = x * y;
    if (!isfinite(p) || !isfinite(x) || !isfinite(y))
        return 0;
    return p == 0 ? (x == 0 || y == 0) : fabsf(p) >= 0x1p-126f;
}

static uint16_t bf16_rne(float f)
{
    uint32_t u = f2u(f);
    if (isnan(f))
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

typedef struct {
    const char *name;
    long cases, bad;
    char first[160];
} tally;

static void note(tally *t, int ok, const char *fmt, float got, float want, float acc,
                 uint16_t a0, uint16_t b0, uint16_t a1, uint16_t b1)
{
    t->cases++;
    if (ok)
        return;
    if (!t->bad++)
        snprintf(t->first, sizeof t->first, fmt, f2u(acc), a0, b0, a1, b1, f2u(got), f2u(want));
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 100000;
    tally lalb = {"bfmlalb"}, lalt = {"bfmlalt"}, cvt = {"bfcvt"}, dot_tb = {"bfdot_textbook"},
          dot = {"bfdot_ro"}, mmla = {"bfmmla_ro"}, lalb_tb = {"bfmlalb_textbook_exact"};
    const char *fmt = "acc %08x a %04x %04x b %04x %04x got %08x want %08x";
    for (long k = 0; k < rounds; k++) {
        uint16_t a[8], b[8];
        float acc[4];
        for (int i = 0; i < 8; i++) {
            a[i] = pick();
            b[i] = pick();
        }
        for (int i = 0; i < 4; i++) {
            uint16_t h = pick(), l = (uint16_t)next();
            acc[i] = u2f(((uint32_t)h << 16) | (next() % 3 ? l : 0));
        }
        bfloat16x8_t va = vreinterpretq_bf16_u16(vld1q_u16(a));
        bfloat16x8_t vb = vreinterpretq_bf16_u16(vld1q_u16(b));
        float32x4_t vacc = vld1q_f32(acc);
        float r_b[4], r_t[4], r_d[4], r_m[4];
        vst1q_f32(r_b, vbfmlalbq_f32(vacc, va, vb));
        vst1q_f32(r_t, vbfmlaltq_f32(vacc, va, vb));
        vst1q_f32(r_d, vbfdotq_f32(vacc, va, vb));
        vst1q_f32(r_m, vbfmmlaq_f32(vacc, va, vb));
        for (int i = 0; i < 4; i++) {
            uint16_t a0 = a[2 * i], a1 = a[2 * i + 1], b0 = b[2 * i], b1 = b[2 * i + 1];
            float want = fmaf(bf(a0), bf(b0), acc[i]);
            note(&lalb, same(r_b[i], want), fmt, r_b[i], want, acc[i], a0, b0, 0, 0);
            want = fmaf(bf(a1), bf(b1), acc[i]);
            note(&lalt, same(r_t[i], want), fmt, r_t[i], want, acc[i], a1, b1, 0, 0);
            want = acc[i] + bf(a0) * bf(b0);   /* two roundings: equal where a*b is exact */
            note(&lalb_tb, same(r_b[i], want) || !exact_product(a0, b0), fmt, r_b[i], want,
                 acc[i], a0, b0, 0, 0);
            want = (acc[i] + bf(a0) * bf(b0)) + bf(a1) * bf(b1);
            note(&dot_tb, same(r_d[i], want), fmt, r_d[i], want, acc[i], a0, b0, a1, b1);
            want = dot_ro(acc[i], a0, b0, a1, b1);
            note(&dot, same(r_d[i], want), fmt, r_d[i], want, acc[i], a0, b0, a1, b1);
        }
        /* BFMMLA: acc is a 2x2 matrix [r][c] (lanes r*2+c); a 2x4 (rows of 4), b 2x4 (rows
         * of 4, used transposed): acc[r][c] + sum_k a[r][k] b[c][k], as two pairs in order */
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < 2; c++) {
                const uint16_t *x = a + 4 * r, *y = b + 4 * c;
                float want = dot_ro(dot_ro(acc[2 * r + c], x[0], y[0], x[1], y[1]), x[2], y[2],
                                    x[3], y[3]);
                note(&mmla, same(r_m[2 * r + c], want), fmt, r_m[2 * r + c], want,
                     acc[2 * r + c], x[0], y[0], x[1], y[1]);
            }
        for (int i = 0; i < 4; i++) {
            float x = u2f((uint32_t)next());
            uint16_t got = vgetq_lane_u16(vreinterpretq_u16_bf16(vcombine_bf16(
                               vcvt_bf16_f32(vdupq_n_f32(x)), vcvt_bf16_f32(vdupq_n_f32(x)))), 0);
            uint16_t want = bf16_rne(x);
            cvt.cases++;
            if (!(got == want || (isnan(x) && (got & 0x7F80) == 0x7F80 && (got & 0x7F)))) {
                if (!cvt.bad++)
                    snprintf(cvt.first, sizeof cvt.first, "f32 %08x got %04x want %04x",
                             f2u(x), got, want);
            }
        }
    }
    tally *all[] = {&lalb, &lalt, &lalb_tb, &cvt, &dot_tb, &dot, &mmla};
    for (int i = 0; i < 7; i++)
        printf("%s %ld %ld %s\n", all[i]->name, all[i]->cases, all[i]->bad,
               all[i]->bad ? all[i]->first : "");
    return 0;
}
