/* What every kernel build shares, built once: the fp8 value table, the bf16 rounding of whole
 * arrays (for the Python layers), and the stochastic rounding's per-tensor key. Built with no
 * contraction: each operation written is one IEEE f32 operation. */
#include "kernels.h"

/* Built on first use; threads racing there write identical values. The flag is published
 * with release and read with acquire, so that a thread that sees it set sees the whole table
 * (on weakly ordered CPUs too). */
static float fp8_table[LTX_FP8_KINDS][256];
static int fp8_table_ready;

const float *ltx_fp8_table(int kind)
{
    if (!__atomic_load_n(&fp8_table_ready, __ATOMIC_ACQUIRE)) {
        for (int f = 0; f < LTX_FP8_KINDS; f++)
            for (uint32_t c = 0; c < 256; c++)
                fp8_table[f][c] = ltx_fp8_value(c, f);
        __atomic_store_n(&fp8_table_ready, 1, __ATOMIC_RELEASE);
    }
    return fp8_table[kind];
}

void ltx_round_bf16(const float *src, uint16_t *dst, ltx_idx n)
{
    for (ltx_idx i = 0; i < n; i++)
        dst[i] = ltx_bf16_of(src[i]);
}

uint64_t ltx_stochastic_key(uint64_t seed, const unsigned char *name, size_t len)
{
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ name[i]) * 0x100000001B3ull;
    return ltx_splitmix64(seed) ^ h;
}
