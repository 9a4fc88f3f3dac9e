"""ltx2blas against its owners' arithmetic run in torch (tests/upstream_rules.py), on the same
bytes.  Runs where torch is installed (``pip install torch==2.13.0``; an fp8 cast past 448
is checked under the installed torch's own rule, so torch 2.11 and 2.12 pass too); skipped
elsewhere.

Two kinds of check:
* the layout rules given the same bf16 aggregate delta are byte-identical to the owners' (the
  one stated exception: an all-zero fp8 block or tensor, where the owner writes NaN codes);
* the aggregate itself: torch's bf16 matmul does not promise the textbook order, so at ranks
  past a few terms it differs in a small fraction of elements; at ranks 1 to 8 (where this
  CPU's torch adds in order) the rules agree exactly, which pins down addmm_'s separate
  rounding of s * acc and the first release's stacked sum.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ltx2blas  # noqa: E402
from ltx2blas import quantized, reference  # noqa: E402

import upstream_rules as up  # noqa: E402
from helpers import random_bf16, torch_fp8_overflow  # noqa: E402
from test_quantized import (block_case, int8_case, mxfp8_case, nvfp4_case,  # noqa: E402
                            per_tensor_case)

ROWS, COLS = 256, 384


def adapters(rng, ranks, strengths=(0.8, 1.3, -0.45), scale=0.02):
    return [(random_bf16(rng, (r, COLS), scale), random_bf16(rng, (ROWS, r), scale), s)
            for r, s in zip(ranks, strengths)]


@pytest.mark.parametrize("rule", ["addmm", "sum"])
@pytest.mark.parametrize("ranks", [[1, 1], [8, 2, 5], [4, 3]])
def test_aggregate_rules_equal_upstream_at_small_ranks(rng, rule, ranks):
    ads = adapters(rng, ranks)
    agg = up.aggregate(ads, rule)
    assert np.array_equal(up.bits(agg), reference.aggregate_delta(ads, rule))
    weight = random_bf16(rng, (ROWS, COLS), 0.02)
    assert np.array_equal(up.bits(up.fuse_bf16(weight, agg)),
                          ltx2blas.fuse_loras(weight, ads, rule=rule))


@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_aggregate_rules_near_upstream_at_ltx_ranks(rng, rule):
    """Rank 384 and 32: torch's bf16 matmul adds in its own order, so the bf16 results differ
    in a small fraction of elements (measured well under 1e-3), each by a rounding of the
    f32 sum: within 2^-7 of the larger magnitude plus the f32 accumulation error."""
    ads = adapters(rng, [384, 32])
    theirs = up.bits(up.aggregate(ads, rule))
    ours = reference.aggregate_delta(ads, rule)
    assert np.mean(theirs != ours) < 1e-3
    t, o = reference.bf16_widen(theirs), reference.bf16_widen(ours)
    # Two f32 sums of the same products, in different orders, each within k * 2^-24 * M of the
    # exact one (M = sum_k |s b_k a_k| per element, k = 416 terms), then rounded to bf16 (at
    # most 2^-8 relative each, twice over the addmm steps): the difference is bounded by
    mag = sum(abs(s) * (np.abs(reference.bf16_widen(b)).astype(np.float64) @
                        np.abs(reference.bf16_widen(a)).astype(np.float64)) for a, b, s in ads)
    bound = 2 * 416 * 2.0 ** -24 * mag + 2 * 2.0 ** -8 * (np.maximum(np.abs(t), np.abs(o)) + mag)
    assert np.all(np.abs(t - o) <= bound)


def test_rules_differ_as_the_report_says(rng):
    """The two rules are not the same arithmetic: with a rank-384 and a rank-32 adapter they
    differ in a few percent of elements (the report measured 5.9 % on 4096 x 4096)."""
    ads = adapters(rng, [384, 32])
    weight = random_bf16(rng, (ROWS, COLS), 0.02)
    a = up.bits(up.fuse_bf16(weight, up.aggregate(ads, "addmm")))
    b = up.bits(up.fuse_bf16(weight, up.aggregate(ads, "sum")))
    assert 0.005 < np.mean(a != b) < 0.2


def _agg(rng, count=2):
    ads = adapters(rng, [24, 160, 5][:count], scale=0.03)
    ours = reference.aggregate_delta(ads, "addmm") if count > 1 else reference.lora_delta(*ads[0])
    return ads, ours, up.bf16_tensor(ours)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_fp8_cast_rule(rng, fmt):
    codes, _ = per_tensor_case(rng, fmt)
    ads, agg, agg_t = _agg(rng)
    want = up.fuse_fp8_cast(codes, agg_t, fmt)
    assert np.array_equal(ltx2blas.fuse_loras(codes, ads, weight_format=fmt,
                                              fp8_overflow=torch_fp8_overflow(torch)), want)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_fp8_cast_rule_past_the_largest_value(rng, fmt):
    """Weights near the largest fp8 value and deltas that take some past it: what the fused
    weight holds there is the installed torch's cast -- +-448 from torch 2.13, NaN before, inf
    for e5m2 -- under the fp8_overflow rule named for that torch."""
    largest = reference.FP8_FORMATS[fmt]["largest"]
    codes = reference.fp8_round(rng.standard_normal((ROWS, COLS), dtype=np.float32)
                                * np.float32(largest / 2), fmt)
    ads = adapters(rng, [6, 3], scale=1.0, strengths=(largest / 8, -largest / 9))
    rule = torch_fp8_overflow(torch)
    want = up.fuse_fp8_cast(codes, up.bf16_tensor(reference.aggregate_delta(ads, "addmm")), fmt)
    got, overflows = ltx2blas.fuse_loras(codes, ads, weight_format=fmt, fp8_overflow=rule,
                                         return_overflows=True)
    assert np.array_equal(got, want)
    made = reference.fp8_round(np.float32(np.inf), fmt, overflow=rule) & 0x7F  # inf overflows too
    assert 100 < overflows <= np.sum((got & 0x7F) == made)


def test_fp8_scaled_mm_rule(rng):
    codes, scale = per_tensor_case(rng)
    ads, agg, agg_t = _agg(rng)
    want_codes, want_scale = up.fuse_fp8_scaled_mm(codes, scale, agg_t)
    got = reference.fuse_scaled_fp8(codes, scale, agg, "F8_E4M3", "ltx")
    assert np.array_equal(got[0], want_codes)
    assert np.float32(got[1]).view(np.uint32) == want_scale.view(np.uint32)
    fused = quantized.fuse_quantized("fp8_scaled", codes, ads, scale=scale)
    assert np.array_equal(fused.weight, want_codes) and fused.scale.view(np.uint32) == want_scale.view(np.uint32)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_comfy_fp8_rule(rng, fmt):
    codes, scale = per_tensor_case(rng, fmt)
    ads, agg, agg_t = _agg(rng)
    want_codes, want_scale = up.fuse_comfy_fp8(codes, scale, agg_t, fmt)
    fused = quantized.fuse_quantized("comfy_fp8", codes, ads, scale=scale, fmt=fmt)
    assert np.array_equal(fused.weight, want_codes)
    assert fused.scale.view(np.uint32) == want_scale.view(np.uint32)


def test_block_fp8_rule(rng):
    codes, scales = block_case(rng)
    ads, agg, agg_t = _agg(rng)
    want_codes, want_scales = up.fuse_block_fp8(codes, scales, agg_t)
    fused = quantized.fuse_quantized("fp8_block", codes, ads, scale=scales)
    assert np.array_equal(fused.weight, want_codes)
    assert np.array_equal(fused.scale.view(np.uint32), want_scales.view(np.uint32))


def test_block_fp8_zero_block_is_the_stated_exception(rng):
    codes, scales = block_case(rng)
    codes[:128, :128] = 0
    ads = [(random_bf16(rng, (4, COLS), 0.02), random_bf16(rng, (ROWS, 4), 0.02), 1.0)]
    ads[0][0][:, :128] = 0
    want_codes, want_scales = up.fuse_block_fp8(codes, scales, up.bf16_tensor(
        reference.lora_delta(*ads[0])))
    fused = quantized.fuse_quantized("fp8_block", codes, ads, scale=scales)
    assert np.all((want_codes[:128, :128] & 0x7F) == 0x7F)   # upstream: NaN codes ...
    assert want_scales[0, 0] == 0 == fused.scale[0, 0]       # ... with a zero scale
    assert np.all(fused.weight[:128, :128] == 0)             # ltx2blas: the zeros
    assert np.array_equal(fused.weight[128:], want_codes[128:])
    assert np.array_equal(fused.weight[:, 128:], want_codes[:, 128:])


def test_block_fp6_rule_zero_block_included(rng):
    packed, scales = block_case(rng, fp6=True)
    packed[:128, :96] = 0
    ads, agg, agg_t = _agg(rng, 1)
    ads[0][0][:, :128] = 0
    agg = reference.lora_delta(*ads[0])
    want_packed, want_scales = up.fuse_block_fp6(packed, scales, up.bf16_tensor(agg))
    fused = quantized.fuse_quantized("fp6_block", packed, ads, scale=scales)
    assert np.array_equal(fused.weight, want_packed)
    assert np.array_equal(fused.scale.view(np.uint32), want_scales.view(np.uint32))
    assert up.fp6_unpack(packed, COLS).numpy().tolist() == reference.fp6_unpack(packed, COLS).tolist()


def test_nvfp4_rule(rng):
    packed, block, scale_2 = nvfp4_case(rng)
    ads, agg, agg_t = _agg(rng)
    want_packed, want_block, want_t = up.fuse_nvfp4(packed, block, scale_2, agg_t)
    fused = quantized.fuse_quantized("nvfp4", packed, ads, scale=block, scale_2=scale_2)
    assert np.array_equal(fused.weight, want_packed)
    assert np.array_equal(fused.scale, want_block)
    assert fused.scale_2.view(np.uint32) == want_t.view(np.uint32)


def test_comfy_nvfp4_rule(rng):
    """ComfyUI's nvfp4 in torch (comfy-kitchen's eager arithmetic, f32) given the same delta:
    the same codes, block scales and scale_2; and not upstream's rule, which rounds to bf16."""
    packed, block, scale_2 = nvfp4_case(rng)
    ads, agg, agg_t = _agg(rng)
    want = up.comfy_nvfp4(packed, block, scale_2, agg_t)
    fused = quantized.fuse_quantized("comfy_nvfp4", packed, ads, scale=block, scale_2=scale_2)
    assert np.array_equal(fused.weight, want[0])
    assert np.array_equal(fused.scale, want[1])
    assert fused.scale_2.view(np.uint32) == want[2].view(np.uint32)
    upstream = quantized.fuse_quantized("nvfp4", packed, ads, scale=block, scale_2=scale_2)
    assert not np.array_equal(upstream.weight, fused.weight)


def test_comfy_mxfp8_rule(rng):
    codes, block = mxfp8_case(rng)
    ads, agg, agg_t = _agg(rng)
    want = up.comfy_mxfp8(codes, block, agg_t)
    fused = quantized.fuse_quantized("comfy_mxfp8", codes, ads, scale=block)
    assert np.array_equal(fused.weight, want[0])
    assert np.array_equal(fused.scale, want[1])


@pytest.mark.parametrize("per_row", [False, True])
def test_comfy_int8_rule(rng, per_row):
    codes, scale = int8_case(rng, per_row)
    ads, agg, agg_t = _agg(rng)
    want = up.comfy_int8(codes, scale, agg_t)
    fused = quantized.fuse_quantized("comfy_int8", codes, ads, scale=scale)
    assert np.array_equal(fused.weight, want[0])
    assert np.array_equal(fused.scale.view(np.uint32), want[1].view(np.uint32))


def test_comfy_mxfp8_tiny_group_is_the_stated_exception():
    """A group whose maximum is below 448 * 2^-127 takes exponent 0, a zero scale: the owner
    divides by it (its codes become +-448, or NaN for zeros), ltx2blas writes zeros."""
    rows, cols = 128, 64
    codes = np.full((rows, cols), 0x38, np.uint8)
    block = np.full(quantized.tiled_shape("comfy_mxfp8", rows, cols), 127, np.uint8)
    block.reshape(-1)[reference.nvfp4_scale_offset(0, 0, block.shape[1])] = 1  # 2^-126
    zero = [(np.zeros((1, cols), np.uint16), np.zeros((rows, 1), np.uint16), 1.0)]
    want = up.comfy_mxfp8(codes, block, up.bf16_tensor(reference.lora_delta(*zero[0])))
    fused = quantized.fuse_quantized("comfy_mxfp8", codes, zero, scale=block)
    assert np.all(want[0][0, :32] == 0x7E) and want[1].reshape(-1)[0] == 0   # +448, exponent 0
    assert np.all(fused.weight[0, :32] == 0) and fused.scale.reshape(-1)[0] == 0
    assert np.array_equal(fused.weight[1:], want[0][1:])


def test_fp8_casts_agree_with_torch():
    """The f32 -> fp8 rounding the layouts use, against torch's cast on the CPU, on f32 values
    around every fp8 step, midpoint and the saturation edge."""
    for fmt, dtype in (("F8_E4M3", torch.float8_e4m3fn), ("F8_E5M2", torch.float8_e5m2)):
        values = reference.fp8_widen(np.arange(256, dtype=np.uint8), fmt)
        values = values[np.isfinite(values)].astype(np.float64)
        grid = np.unique(np.concatenate([values, (values[:-1] + np.sort(values)[1:]) / 2]))
        x = np.concatenate([grid, np.nextafter(grid, np.inf), np.nextafter(grid, -np.inf)])
        x = x[np.abs(x) < (460 if fmt == "F8_E4M3" else 57000)].astype(np.float32)
        theirs = torch.from_numpy(x).to(dtype).view(torch.uint8).numpy()
        assert np.array_equal(reference.fp8_round(x, fmt), theirs)
