/*
 * Element kernels of ltx2blas, compiled once per instruction set and chosen at run time.
 *
 * Every routine here is exact in the sense of docs/exactness.md: it performs the IEEE f32
 * operations written beside it, in the order written, one rounding per operation.  The only
 * freedom taken is fusing `c + x*y` into an FMA in the "fast" tables, which is exact only when
 * the product x*y is exact in f32 (bf16 x bf16 products are, unless they underflow or
 * overflow); callers that cannot rule that out use the strict table, which never contracts.
 */
#ifndef LTX2BLAS_KERNELS_H
#define LTX2BLAS_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef ptrdiff_t ltx_idx;

/* ---- The library's scalar rules, each defined once: the kernels (kernels.c, quant.c) and the
 * Cython drivers use these ---- */

static inline uint32_t ltx_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float ltx_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* bf16(f) of f32 bits u, nearest-even, as f32 bits (the bf16 in the high half, zeros below);
 * overflow rounds to inf and subnormals are kept. Macros so that the vector kernels apply the
 * same expression lane by lane. A NaN is not rounded: it becomes the quiet NaN with its sign
 * (the bits ml_dtypes gives), LTX_BF16_QNAN. */
#define LTX_BF16_NEAREST(u) (((u) + 0x7FFFu + (((u) >> 16) & 1u)) & 0xFFFF0000u)
#define LTX_BF16_QNAN(u) (((u) & 0x80000000u) | 0x7FC00000u)

static inline uint32_t ltx_bf16_high(float f)
{
    const uint32_t u = ltx_f32_bits(f);
    return (f != f) ? LTX_BF16_QNAN(u) : LTX_BF16_NEAREST(u);
}

/* Whether a bf16 store's result (bf16 bits out) overflowed, the weight's element being w: the
 * result is +-inf and the weight element is finite. The fuse's overflow count is of these,
 * whatever step reached inf (the product in f32, its bf16 rounding, or the sum with the
 * weight): the adapters' own elements are finite where the fuse is asked to check them, and
 * an inf already in the weight, or a NaN anywhere, is not an overflow (docs/arithmetic.md). */
#define LTX_BF16_OVERFLOW(out, w) (((out) & 0x7FFFu) == 0x7F80u && ((w) & 0x7F80u) != 0x7F80u)

/* bf16 bits of f, and f32(bf16(f)). */
static inline uint16_t ltx_bf16_of(float f) { return (uint16_t)(ltx_bf16_high(f) >> 16); }
static inline float ltx_bf16_round(float f) { return ltx_bits_f32(ltx_bf16_high(f)); }
/* The value of bf16 bits, exactly. */
static inline float ltx_bf16_value(uint16_t h) { return ltx_bits_f32((uint32_t)h << 16); }

/* The fp8 formats, each described once, indexed by an ltx_fp8_kind: F8_E4M3 (float8_e4m3fn: no
 * inf, NaN x111_1111, largest 448) in its two casts, and F8_E5M2 (IEEE-like: exponent 31 is
 * inf, or NaN with a mantissa). Codes are sign | magnitude code. A value that rounds past the
 * largest finite one becomes the row's `over`: e4m3 saturates at 448 as torch casts from 2.13
 * on, or becomes NaN as torch cast before (LTX_FP8_E4M3_NAN; the codes read the same); e5m2
 * goes to inf in both. docs/arithmetic.md §2. */
typedef enum { LTX_FP8_E4M3 = 0, LTX_FP8_E5M2 = 1, LTX_FP8_E4M3_NAN = 2, LTX_FP8_KINDS } ltx_fp8_kind;

typedef struct {
    int mant, bias;       /* mantissa bits, exponent bias */
    uint32_t largest;     /* the magnitude code of the largest finite value */
    uint32_t over;        /* what a value past it (inf included) rounds to */
    uint32_t nan_above;   /* magnitude codes above this are NaN */
    uint32_t inf;         /* the magnitude code of inf, 0 where the format has none */
    float quantum;        /* the subnormal step, 2^(1 - bias - mant) */
} ltx_fp8_format;

static const ltx_fp8_format LTX_FP8[LTX_FP8_KINDS] = {
    [LTX_FP8_E4M3] = {.mant = 3, .bias = 7, .largest = 0x7Eu, .over = 0x7Eu, .nan_above = 0x7Eu,
                      .inf = 0, .quantum = 0x1p-9f},
    [LTX_FP8_E5M2] = {.mant = 2, .bias = 15, .largest = 0x7Bu, .over = 0x7Cu, .nan_above = 0x7Cu,
                      .inf = 0x7Cu, .quantum = 0x1p-16f},
    [LTX_FP8_E4M3_NAN] = {.mant = 3, .bias = 7, .largest = 0x7Eu, .over = 0x7Fu,
                          .nan_above = 0x7Eu, .inf = 0, .quantum = 0x1p-9f},
};

/* Value of an fp8 code of one ltx_fp8_kind, exactly. Every NaN code, whatever its
 * sign bit, is the positive quiet NaN: torch widens them so, and upstream fuses through it. */
static inline float ltx_fp8_value(uint32_t code, int kind)
{
    const ltx_fp8_format *f = &LTX_FP8[kind];
    const uint32_t mag = code & 0x7Fu, e = mag >> f->mant, m = code & ((1u << f->mant) - 1u);
    float v;
    if (mag > f->nan_above)
        return __builtin_nanf("");
    else if (f->inf && mag == f->inf)
        v = __builtin_inff();
    else if (e == 0)
        v = (float)m * f->quantum;
    else
        v = (1.0f + (float)m / (float)(1u << f->mant)) * __builtin_ldexpf(1.0f, (int)e - f->bias);
    return (code & 0x80u) ? -v : v;
}

/* ltx_fp8_value of every code of one ltx_fp8_kind, a table built once (common.c, the unit
 * every kernel build shares). */
const float *ltx_fp8_table(int kind);
/* dst[i] = bf16(src[i]): the library's bf16 rounding, for arrays the Python layers round. */
void ltx_round_bf16(const float *src, uint16_t *dst, ltx_idx n);
/* The stochastic rounding's per-tensor key (docs/arithmetic.md §2): splitmix64(seed) xor the
 * 64-bit FNV-1a hash of the tensor's name (len bytes of UTF-8). */
uint64_t ltx_stochastic_key(uint64_t seed, const unsigned char *name, size_t len);

/* The stochastic rounding's generator (docs/arithmetic.md §2): splitmix64, wrapping. */
static inline uint64_t ltx_splitmix64(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Floats of stream_wxt scratch per (weight row, row of x): the widest vector of any table. */
#define LTX_STREAM_LANES 16

/* The streaming kernel's lane sums restart every this many elements of k (see stream_wxt);
 * the Linear's segments are cut at multiples of it. */
#define LTX_STREAM_BLOCK 4096

/* The dot-product Linear's lane sums restart every this many elements of k (see
 * dot_stream_wxt). */
#define LTX_DOT_BLOCK 2048

/* The dot-product panel Linear's sums restart every this many elements of k (see
 * dot_panel_wxt). Its x packed (pack_x_pairs) for mt rows and kt elements of k: strips of
 * LTX_DOT_PANEL_STRIP rows, each LTX_DOT_PANEL_PAIRS(kt) pairs long; its scratch: one row
 * block's sums, LTX_DOT_PANEL_SCRATCH(mt) floats. */
#define LTX_DOT_PANEL_CHUNK 512
#define LTX_DOT_PANEL_STRIP 32
#define LTX_DOT_PANEL_PAIRS(kt) (((kt) + 1) / 2)
#define LTX_DOT_PANEL_PACKED(mt, kt)                                                        \
    ((((mt) + LTX_DOT_PANEL_STRIP - 1) / LTX_DOT_PANEL_STRIP * LTX_DOT_PANEL_STRIP) *       \
     LTX_DOT_PANEL_PAIRS(kt))
#define LTX_DOT_PANEL_SCRATCH(mt)                                                           \
    (8 * (((mt) + LTX_DOT_PANEL_STRIP - 1) / LTX_DOT_PANEL_STRIP * LTX_DOT_PANEL_STRIP))

/* The panel Linear's sums restart every this many elements of k (see panel_wxt). */
#define LTX_PANEL_CHUNK 512

/* Floats of panel_wxt scratch for mt rows of x: one chunk of x in strips (mt columns rounded
 * up to a table's strip width, at most 32), one row block (at most 8 rows) of the chunk's
 * weight widened, and that block's sums. */
/* Values past its layers that a per-layer table of the feature extractor holds (the first
 * ones again), so that a vector of consecutive features finds its layers in one load. */
#define LTX_LAYER_TABLE_PAD 16

#define LTX_PANEL_SCRATCH(mt) (((mt) + 40) * (LTX_PANEL_CHUNK + 8))

/* The scaled and quantised layouts' passes of one instruction set (quant.h). */
typedef struct ltx_layout_passes ltx_layout_passes;

typedef struct {
    const char *name;
    /* c[m x n] (ldc) = c + sum_p x[i,p] * y[p,j], p = 0 .. k-1 in order, one element at a time:
     * the textbook accumulation, continued from whatever c holds. Row-major operands. */
    void (*seq_gemm)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                     const float *y, ltx_idx ldy, float *c, ltx_idx ldc);
    /* dst[i] = f32(src[i]) */
    void (*widen_bf16)(const uint16_t *src, float *dst, ltx_idx n);
    /* dst[i] = f32(bf16(f32(src[i]) * s)) */
    void (*scale_round_widen)(const uint16_t *src, float s, float *dst, ltx_idx n);
    /* out[r, i] = bf16(f32(w[r, i]) + f32(bf16(acc[r, i]))) over a rows x cols tile; acc is
     * packed (row stride cols), w and out have row strides ldw and ldo; out may equal w.
     * Returns how many results overflowed (LTX_BF16_OVERFLOW: +-inf where the weight element
     * was finite) and sets *first_over to the least offset r * ldw + i among them, or -1. */
    ltx_idx (*store_fused)(const float *acc, const uint16_t *w, ltx_idx ldw, uint16_t *out,
                           ltx_idx ldo, ltx_idx rows, ltx_idx cols, ltx_idx *first_over);
    /* total[i] = total[i] + f32(bf16(acc[i])) */
    void (*accumulate_rounded)(const float *acc, float *total, ltx_idx n);
    /* index of the first bf16 element that is inf or NaN, or -1 */
    ltx_idx (*first_nonfinite_bf16)(const uint16_t *src, ltx_idx n);
    /* magnitude bits (x & 0x7FFF) of the largest element (capped at 0x7F7F, the largest
     * finite, when inf/NaN are present: an upper bound on the finite ones) and of the smallest
     * non-zero finite element (0 when none), and the index of the first inf/NaN or -1 */
    ltx_idx (*scan_bf16)(const uint16_t *src, ltx_idx n, uint16_t *max_mag, uint16_t *min_mag);
    /* dst[i] = f64(f32(src[i])), exact */
    void (*widen_bf16_f64)(const uint16_t *src, double *dst, ltx_idx n);
    /* dst[i] = f64(src[i]), exact */
    void (*f32_to_f64)(const float *src, double *dst, ltx_idx n);
    /* dst[r, i] = f32(src[r, i]) over a rows x cols block (row strides lds, ldd), prefetching
     * the source rows ahead */
    void (*widen_bf16_rows)(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx ldd,
                            ltx_idx rows, ltx_idx cols);
    /* acc[o * mt + m] += sum_k x[m, k] * f32(w[o, k]) (k < kt, m < mt, o < n) straight from
     * bf16 weight rows, in a fixed order (lane sums, a halving tree, then the tail); for a
     * Linear with few rows of x, where a BLAS would spend more on packing than on arithmetic;
     * lanes: scratch of n * mt * LTX_STREAM_LANES floats */
    void (*stream_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                       const uint16_t *w, ltx_idx ldw, float *acc, float *lanes);
    /* acc[o * mt + m] += sum_k x[m, k] * f32(w[o, k]) as stream_wxt computes it, in another
     * fixed order: k cut into chunks of LTX_PANEL_CHUNK from 0, each chunk's sum from +0.0 in
     * the order k = 0, 1, ... (one FMA a term where the table contracts), the chunks' sums
     * added to acc in order. The fuse's register blocks, on weight rows widened a block at a
     * time and x transposed into strips: for 48 to 64 rows of x, where the streaming kernel's
     * widening shares the FMA pipes. scratch: LTX_PANEL_SCRATCH(mt) floats */
    void (*panel_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const float *x, ltx_idx ldx,
                      const uint16_t *w, ltx_idx ldw, float *acc, float *scratch);
    /* acc[o * mt + m] += sum_k f32(x[m, k]) * f32(w[o, k]) from bf16 rows of both, two terms
     * per instruction (VDPBF16PS: lane j of a 32-element vector adds the products of elements
     * 2j + 1, then 2j, each rounded, subnormal inputs, products and sums flushed to zero), lane
     * sums restarting every LTX_DOT_BLOCK elements, then stream_wxt's tree and in-order tail;
     * lanes: scratch of n * mt * LTX_STREAM_LANES floats. NULL in tables without the
     * instruction. */
    void (*dot_stream_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint16_t *x, ltx_idx ldx,
                           const uint16_t *w, ltx_idx ldw, float *acc, float *lanes);
    /* The same sum in another fixed order: k cut into chunks of LTX_DOT_PANEL_CHUNK from 0,
     * each chunk's sum from +0.0 adding its pairs in order (VDPBF16PS: the higher element's
     * product, then the lower's, subnormals flushed; BFDOT's step, by BFMMLA: the pair's sum
     * and the addition rounded to odd), then an odd last element, the chunks' sums added to
     * acc in order; against x packed by pack_x_pairs (strip s of LTX_DOT_PANEL_STRIP rows at
     * xs + s * lds, its pairs from the call's first element), for many rows of x. scratch:
     * LTX_DOT_PANEL_SCRATCH(mt) floats. NULL where dot_stream_wxt is. */
    void (*dot_panel_wxt)(ltx_idx mt, ltx_idx n, ltx_idx kt, const uint32_t *xs, ltx_idx lds,
                          const uint16_t *w, ltx_idx ldw, float *acc, float *scratch);
    /* The LTX_DOT_PANEL_PAIRS(kt) pairs (elements 2q, 2q + 1) of kt elements of mt rows of x
     * (row stride ldx), an odd last element alone in the low half, in strips of
     * LTX_DOT_PANEL_STRIP rows lds apart, zero rows past mt up to a whole strip, laid out as
     * this table's dot_panel_wxt reads them: x86, xs[s * lds + q * LTX_DOT_PANEL_STRIP + j] =
     * the pair q of row s * LTX_DOT_PANEL_STRIP + j; Arm, groups of two pairs as BFMMLA's 2 x 4
     * blocks (kernels.c). Either way pair q of an even q starts at q * LTX_DOT_PANEL_STRIP, so
     * x packed in pieces of a multiple of 4 elements reads as x packed whole. NULL where
     * dot_stream_wxt is. */
    void (*pack_x_pairs)(const uint16_t *x, ltx_idx ldx, ltx_idx mt, ltx_idx kt, uint32_t *xs,
                         ltx_idx lds);
    /* The dot-product Linear's arithmetic, which its error bound counts: dot_stream_wxt's
     * lanes (a vector of pairs holds 2 * dot_lanes elements), and how many unit roundoffs
     * (2^-24) one pair's step can add to a term's error: 2 where the step rounds twice to
     * nearest (VDPBF16PS), 4 where it rounds twice to odd, each error below one unit in the
     * last place, twice nearest's (BFDOT). 0 where dot_stream_wxt is NULL. */
    int dot_lanes, dot_pair_units;
    /* The fewest rows of x for which this table's Linear takes panel_wxt (0: never; the
     * tables where it was not measured faster keep the streaming kernel) */
    int panel_min_rows;
    /* out[r, i] = fp8(bf16(f32(w[r, i]) + f32(bf16(acc[r, i])))) over a rows x cols tile of an
     * fp8 weight of one ltx_fp8_kind; nearest-even, or stochastic with random bits from
     * splitmix64(key + index0 + r * stride + i).  Returns how many finite sums landed past the
     * largest finite fp8 value, and sets *first_over to the offset (r * stride + i) of the
     * first of them, or -1. */
    ltx_idx (*store_fused_fp8)(const float *acc, const uint8_t *w, ltx_idx ldw, uint8_t *out,
                               ltx_idx ldo, ltx_idx rows, ltx_idx cols, int kind, int stochastic,
                               uint64_t key, ltx_idx index0, ltx_idx stride,
                               ltx_idx *first_over);
    /* out[i, j] = bf16(f32(w[i, j]) + f32(bf16(sum_p x[i, p] * y[p, j]))) over an m x n tile,
     * the sum from +0.0 in the order p = 0 .. k-1: seq_gemm into a zeroed c, then store_fused,
     * in registers. x row-major; y the [k, n] fuse panel made by this table's pack_fuse_panel
     * (ldy unused); out may equal w. Returns store_fused's overflow count and first offset. */
    ltx_idx (*seq_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                             const float *y, ltx_idx ldy, const uint16_t *w, ltx_idx ldw,
                             uint16_t *out, ltx_idx ldo, ltx_idx *first_over);
    /* dst = f32 of k bf16 rows of n columns (row stride lds), as seq_fuse_bf16 reads them: in
     * strips of the table's register block width, a layout private to the table, k * n
     * floats as a row-major panel would be */
    void (*pack_fuse_panel)(const uint16_t *src, ltx_idx lds, float *dst, ltx_idx k, ltx_idx n);
    /* c[m x n] (ldc) = x @ y, each element's sum from +0.0 in the order p = 0 .. k-1: the
     * product alone of seq_fuse_bf16, from the same fuse panel y */
    void (*seq_product_panel)(ltx_idx m, ltx_idx n, ltx_idx k, const float *x, ltx_idx ldx,
                              const float *y, float *c, ltx_idx ldc);
    /* The same fuse from bf16 operands packed in pairs of consecutive terms, two terms per
     * instruction (VDPBF16PS): xp[i, q] = x[i, 2q] << 16 | x[i, 2q + 1] and likewise yp[q, j]
     * (bf16 bits; a zero after the last term of an odd depth), kp = ceil(k / 2) pairs. The
     * instruction adds the high product, then the low one, each rounded: the textbook order,
     * provided no input, product or partial sum is subnormal (it flushes them) and none is
     * inf or NaN, which the caller rules out. Returns store_fused's overflow count and first
     * offset. NULL in tables without the instruction. */
    ltx_idx (*dot_fuse_bf16)(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                             ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, const uint16_t *w,
                             ltx_idx ldw, uint16_t *out, ltx_idx ldo, ltx_idx *first_over);
    /* c[m x n] (ldc) = xp @ yp from the same pairs, each sum from +0.0 in the textbook order,
     * under the same conditions: the product alone of dot_fuse_bf16, stored where it is
     * rounded and added later (several adapters, fp8 weights, a bare delta). NULL where
     * dot_fuse_bf16 is. */
    void (*dot_product_bf16)(ltx_idx m, ltx_idx n, ltx_idx kp, const uint32_t *xp,
                             ltx_idx ldxp, const uint32_t *yp, ltx_idx ldyp, float *c,
                             ltx_idx ldc);
    /* dst[q, j] = src[2q, j] << 16 | src[2q + 1, j] (0 past the last row) for a rows x cols
     * block of bf16 (row stride lds) into ceil(rows / 2) rows of cols pairs */
    void (*pack_pairs_rows)(const uint16_t *src, ltx_idx lds, uint32_t *dst, ltx_idx rows,
                            ltx_idx cols);
    /* dst[i, q] = hi(src[i, 2q]) << 16 | hi(src[i, 2q + 1]) (0 past the last column), hi the
     * high half of an f32 holding a bf16 value, over rows x cols (row strides lds, ldd) */
    void (*pack_pairs_cols)(const float *src, ltx_idx lds, uint32_t *dst, ltx_idx ldd,
                            ltx_idx rows, ltx_idx cols);
    /* p[r, i] = +0.0 where it is -0.0 (bits 0x8000), over rows x cols (row stride ldp) */
    void (*clear_negative_zero_bf16)(uint16_t *p, ltx_idx ldp, ltx_idx rows, ltx_idx cols);
    /* dst[i] = f32(bf16(src[i])) */
    void (*round_bf16_f32)(const float *src, float *dst, ltx_idx n);
    /* The feature extractor's normalisation of n features of a row into dst (bf16 bits if
     * dst_bf16, else f32), from bf16 (src_bf16) or f32 features, the first of layer l0: V2
     * with b NULL (a: the row's 1 / rms by layer, scale), V1 otherwise (a: mean, b: range);
     * each table has LTX_LAYER_TABLE_PAD values past its `layers`, a[i] = a[i mod layers]. */
    void (*normalize_features)(const void *src, int src_bf16, ltx_idx n, const float *a,
                               const float *b, ltx_idx l0, ltx_idx layers, float scale,
                               void *dst, int dst_bf16);
    /* Per layer l of one row of depth x layers features (element d * layers + l), bf16
     * (src_bf16) or f32: sums[l] and squares[l], the sum and the sum of squares over d in order
     * from 0.0 in f64 (each square rounded, then added), lows[l] and highs[l], the min and max
     * (NaN where any is NaN) */
    void (*layer_stats)(const void *src, int src_bf16, ltx_idx depth, ltx_idx layers,
                        double *sums, double *squares, float *lows, float *highs);
    /* agg[i] = f32(bf16(agg[i] + f32(s * acc[i]))): the product rounded to f32 before the add,
     * never contracted into an FMA (upstream's addmm_(B, A, alpha=s) into a bf16 aggregate) */
    void (*accumulate_addmm)(const float *acc, float *agg, float s, ltx_idx n);
    /* out[r, i] = bf16(acc[r, i]) over a rows x cols tile; acc packed (row stride cols), out
     * with row stride ldo: a bare delta, for layouts whose rule needs all of it first */
    void (*store_rounded)(const float *acc, uint16_t *out, ltx_idx ldo, ltx_idx rows,
                          ltx_idx cols);
    /* dst[i] = x[i] * y[i], one f32 rounding each (dst may be x or y): a LoHa's two low-rank
     * products multiplied element by element */
    void (*multiply_f32)(const float *x, const float *y, float *dst, ltx_idx n);
    /* dst[i] = s * x[i], one f32 rounding each (dst may be x): a run of a LoKr's Kronecker
     * product (one element of w1 times a run of a row of w2), and the LoKr/LoHa scale */
    void (*scale_f32)(const float *x, float s, float *dst, ltx_idx n);
    /* The layouts' passes of the same instruction set (quant.h); set by dispatch.c, which
     * joins each build of kernels.c with the build of quant.c for its instruction set. */
    const ltx_layout_passes *layout;
} ltx_kernels;

/* The tables dispatch.c hands out, each with its layout passes. The fastest this CPU runs (may
 * contract into FMA). */
const ltx_kernels *ltx_fast_kernels(void);
/* Never contracts: mul then add, as the reference loop does. */
const ltx_kernels *ltx_strict_kernels(void);
/* A table by name ("avx512bf16", "avx512", "avx2", "neon_bf16", "neon", "base"), or NULL if absent or unsupported here. */
const ltx_kernels *ltx_kernels_by_name(const char *name);
/* Names of the tables built into this module, comma separated. */
const char *ltx_kernels_built(void);

#endif
