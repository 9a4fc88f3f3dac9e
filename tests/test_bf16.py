"""f32 -> bf16 rounding, against ml_dtypes, in the reference and in every kernel table."""
import numpy as np
import pytest

import _ltx2blas_hooks as hooks
from helpers import random_bf16
from ltx2blas import _gemm, reference

ml_dtypes = pytest.importorskip("ml_dtypes")

NEG_ZERO = np.uint16(0x8000)


def ml_round(f32):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.asarray(f32, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def edge_f32():
    """Ties, near-ties, overflow boundary, NaN payloads, infinities, zeros and subnormals."""
    bits = []
    for hi in (0x0000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0x4049, 0x7F7E, 0x7F7F, 0x7F80,
               0x7FC0, 0x7FFF):
        for lo in (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF):
            for sign in (0, 0x80000000):
                bits.append(sign | (hi << 16) | lo)
    bits += [0x7F800001, 0x7FBFFFFF, 0xFF800001, 0x7FC00001, 0x00000001, 0x80000001,
             0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000, 0x00008000, 0x00018000]
    return np.array(bits, dtype=np.uint32).view(np.float32)


def every_bf16_as_f32():
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


def random_f32(n=1 << 20):
    return np.random.default_rng(7).integers(0, 2**32, size=n, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("values", [every_bf16_as_f32(), edge_f32(), random_f32()],
                         ids=["all-65536-bf16", "edge-cases", "random-f32-bits"])
def test_reference_rounding_matches_ml_dtypes(values):
    assert np.array_equal(reference.bf16_round(values), ml_round(values))


def test_reference_rounding_specific_values():
    bits = np.array([0x3F808000, 0x3F818000, 0x7F7F7FFF, 0x7F7F8000, 0xFF7F8000, 0x7FC12345,
                     0xFF800001, 0x00008000, 0x00018000], dtype=np.uint32)
    got = reference.bf16_round(bits.view(np.float32))
    # 1 + 2^-8 is a tie: to even (1.0); 1 + 3*2^-8 ties up to 1 + 2^-6.  Just below the tie past
    # the largest bf16 (0x7F7F) stays there; the tie itself goes to even, which is inf.  NaN:
    # the quiet NaN with the sign kept, payload dropped.  Subnormal ties go to even too.
    assert got.tolist() == [0x3F80, 0x3F82, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x0000,
                            0x0002]


def test_widen_is_exact_and_round_trips():
    h = np.arange(65536, dtype=np.uint16)
    widened = reference.bf16_widen(h)
    assert np.array_equal(widened.view(np.uint32) >> 16, h.astype(np.uint32))
    nan = np.isnan(widened)
    back = reference.bf16_round(widened)
    assert np.array_equal(back[~nan], h[~nan])
    assert np.array_equal(back[nan], np.where(h[nan] & 0x8000, 0xFFC0, 0x7FC0).astype(np.uint16))


@pytest.mark.parametrize("values", [every_bf16_as_f32(), edge_f32(), random_f32()],
                         ids=["all-65536-bf16", "edge-cases", "random-f32-bits"])
def test_kernel_rounding_matches_ml_dtypes(kernel_table, values):
    # store_fused with w = -0.0 computes bf16(-0.0 + bf16(x)) = bf16(x): -0.0 is the identity
    # of IEEE addition (x + -0.0 = x for every x, +0.0 included).
    w = np.full(values.shape, NEG_ZERO, dtype=np.uint16)
    assert np.array_equal(hooks.store_fused(values, w, kernel_table), ml_round(values))


def test_kernel_store_matches_reference(kernel_table):
    rng = np.random.default_rng(3)
    acc = random_f32(1 << 16)
    w = rng.integers(0, 65536, size=acc.shape, dtype=np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
            reference.bf16_round(acc)))
    got = hooks.store_fused(acc, w, kernel_table)
    # NaN + NaN keeps one of the two NaNs (IEEE leaves which unspecified): compare NaN-ness
    # there, bits everywhere else.
    both_nan = np.isnan(reference.bf16_widen(w)) & np.isnan(acc)
    assert np.array_equal(got[~both_nan], expected[~both_nan])
    assert np.all(np.isnan(reference.bf16_widen(got[both_nan])))


@pytest.mark.parametrize("cols", [1, 15, 16, 17, 40, 257])
def test_kernel_store_tile(kernel_table, cols):
    """The rounding store over a tile whose rows lie apart in w and in the output (a tile of a
    larger weight), for whole vectors, a tail and both; nothing written past the tile."""
    rng = np.random.default_rng(cols)
    acc = rng.standard_normal((7, cols), dtype=np.float32) * np.float32(0.01)
    w = random_bf16(rng, (7, cols + 9))
    got = hooks.store_fused_tile(acc, w, kernel_table)
    assert np.array_equal(got[:, :cols], expected_fuse(w[:, :cols], acc))
    assert np.all(got[:, cols:] == 0xABCD)


@pytest.mark.parametrize("s", [0.8, -1.5, 0.0, 1e30, 3.0e-39, 1.0])
def test_kernel_scale_round_widen(kernel_table, s):
    h = np.arange(65536, dtype=np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference.bf16_widen(
            reference.bf16_round(reference.bf16_widen(h) * np.float32(s)))
    got = hooks.scale_round_widen(h, s, kernel_table)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def test_kernel_accumulate_rounded(kernel_table):
    acc = random_f32(1 << 16)
    total = np.random.default_rng(4).standard_normal(acc.shape).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = total + reference.bf16_widen(reference.bf16_round(acc))
    hooks.accumulate_rounded(acc, total, kernel_table)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(total), nan)
    assert np.array_equal(total[~nan].view(np.uint32), expected[~nan].view(np.uint32))


@pytest.mark.parametrize("values", [every_bf16_as_f32(), edge_f32(), random_f32(1 << 16)],
                         ids=["all-65536-bf16", "edge-cases", "random-f32-bits"])
def test_fused_kernel_rounding(kernel_table, values):
    """The fuse kernel that rounds in registers: x = the values, one term (k = 1) against
    y = 1.0 over 40 columns (whole vectors and a scalar tail for every table's tile width),
    so each product is its value and each column meets a different weight element."""
    rng = np.random.default_rng(5)
    x = np.ascontiguousarray(values[:, None])
    y = np.ones((1, 40), np.float32)
    w = rng.integers(0, 65536, size=(values.size, 40), dtype=np.uint16)
    with np.errstate(invalid="ignore", over="ignore"):
        acc = np.float32(0.0) + x * y            # the textbook sum starts from +0.0
        expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
            reference.bf16_round(acc)))
    got = hooks.seq_fuse_bf16(x, y, w, kernel_table)
    # NaN + NaN keeps one of the two NaNs (IEEE leaves which unspecified): compare NaN-ness
    # there, bits everywhere else.
    both_nan = np.isnan(reference.bf16_widen(w)) & np.isnan(acc)
    assert np.array_equal(got[~both_nan], expected[~both_nan])
    assert np.all(np.isnan(reference.bf16_widen(got[both_nan])))


def near_subnormal_sets():
    """Weights and products around the bottom of the normal range, where a conversion that
    flushes subnormals (VCVTNE2PS2BF16 does, for inputs) would differ: every bf16 below 2**-124
    in magnitude as a weight, against products of the same range and their near-ties, so that
    two normal operands can sum to a subnormal and a subnormal can sum to a normal."""
    small = np.concatenate([np.arange(0x0000, 0x0200), np.arange(0x8000, 0x8200)]).astype(np.uint16)
    bits = small.astype(np.uint32) << 16
    bits = np.concatenate([bits, bits | 0x8000, bits | 0x7FFF, bits | 0x0001])
    return small, bits.view(np.float32)


def expected_fuse(w, acc):
    with np.errstate(invalid="ignore", over="ignore"):
        return reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
            reference.bf16_round(acc)))


def test_kernel_store_near_subnormals(kernel_table):
    small, products = near_subnormal_sets()
    w, acc = (np.ascontiguousarray(a.ravel()) for a in np.meshgrid(small, products))
    assert np.array_equal(hooks.store_fused(acc, w, kernel_table), expected_fuse(w, acc))


def test_fused_kernel_near_subnormals(kernel_table):
    small, products = near_subnormal_sets()
    # One term (k = 1) against y = 1.0: row i's products are all products[i], and its columns
    # meet every small weight.
    x = np.ascontiguousarray(products[:, None])
    w = np.ascontiguousarray(np.broadcast_to(small, (products.size, small.size)))
    got = hooks.seq_fuse_bf16(x, np.ones((1, small.size), np.float32), w, kernel_table)
    assert np.array_equal(got, expected_fuse(w, np.float32(0.0) + x))


def test_bf16_conversion_table_is_chosen_where_the_cpu_has_it():
    """On a CPU with AVX512_BF16 the fuse uses the table built on its conversions, so the
    tests above exercise what users run."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    have = all(f in flags.split() for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl",
                                             "avx512_bf16"))
    if not have or "avx512bf16" not in _gemm.kernels_built():
        pytest.skip("CPU or build without AVX512_BF16")
    assert _gemm.kernel_name() == "avx512bf16"
