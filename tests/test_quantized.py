"""Scaled and quantised layouts: fuse_quantized is byte-identical to reference.fuse_quantized
(the owners' rules written as plain loops) for every layout, rule and thread count, and refuses
what its rules cannot compute before writing anything."""
import numpy as np
import pytest

from ltx2blas import errors, quantized, reference

from helpers import random_bf16

ROWS, COLS = 256, 384


def adapters(rng, rows, cols, ranks=(16, 140, 3), strengths=(0.8, -0.5, 1.7), scale=0.02):
    return [(random_bf16(rng, (r, cols), scale), random_bf16(rng, (rows, r), scale), s)
            for r, s in zip(ranks, strengths)]


def per_tensor_case(rng, fmt="F8_E4M3", rows=ROWS, cols=COLS):
    scale = np.array(0.0005 if fmt == "F8_E4M3" else 0.00002, np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(0.02)
    return reference.fp8_round(w / scale, fmt), scale


def block_case(rng, fp6=False, rows=ROWS, cols=COLS):
    scales = rng.uniform(1e-5, 1e-4, (rows // 128, cols // 128)).astype(np.float32)
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    if fp6:
        codes = reference.fp8_round(np.clip(w * np.float32(0.03), -0.117, 0.117), "F8_E4M3")
        return reference.fp6_pack(codes), scales
    return reference.fp8_round(w * np.float32(60), "F8_E4M3"), scales


def nvfp4_case(rng, rows=ROWS, cols=COLS):
    scales = tiled_scales(rng, rows, cols // 16, 0x28, 0x60)
    packed = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    return packed, scales, np.array(0.0007, np.float32)


def tiled_scales(rng, rows, groups, low, high):
    """Block scale bytes drawn from [low, high) in the tiled layout, zeros in its padding."""
    return reference.to_tiled(rng.integers(low, high, (rows, groups)))


def mxfp8_case(rng, rows=ROWS, cols=COLS):
    """e4m3 codes of every finite value and E8M0 exponents around 2^-10 (weights of 0.02)."""
    finite = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    return finite[rng.integers(0, finite.size, (rows, cols))], tiled_scales(
        rng, rows, cols // 32, 112, 121)


def int8_case(rng, per_row=False, rows=ROWS, cols=COLS):
    codes = rng.integers(-128, 128, (rows, cols)).astype(np.int8)
    if per_row:
        return codes, rng.uniform(1e-4, 3e-4, (rows, 1)).astype(np.float32)
    return codes, np.array(0.0002, np.float32)


def case(rng, layout, fmt="F8_E4M3"):
    """(weight, scales tuple, keyword arguments) of a random weight in ``layout`` (fmt "rows"
    for comfy_int8: one scale per row)."""
    if layout in ("fp8_scaled", "comfy_fp8"):
        w, s = per_tensor_case(rng, fmt)
        return w, (s,), {"scale": s, "fmt": fmt}
    if layout in ("fp8_block", "fp6_block"):
        w, s = block_case(rng, layout == "fp6_block")
        return w, (s,), {"scale": s}
    if layout == "comfy_mxfp8":
        w, s = mxfp8_case(rng)
        return w, (s,), {"scale": s}
    if layout == "comfy_int8":
        w, s = int8_case(rng, fmt == "rows")
        return w, (s,), {"scale": s}
    w, s, s2 = nvfp4_case(rng)
    return w, (s, s2), {"scale": s, "scale_2": s2}


def same(got, expected):
    assert np.array_equal(np.asarray(got.weight).view(np.uint8), expected[0].view(np.uint8))
    assert np.array_equal(np.asarray(got.scale).reshape(-1).view(np.uint8),
                          np.asarray(expected[1], got.scale.dtype).reshape(-1).view(np.uint8))
    if len(expected) > 2:
        assert np.float32(got.scale_2.reshape(-1)[0]).view(np.uint32) == \
            np.float32(expected[2]).view(np.uint32)


LAYOUT_FORMATS = [("fp8_scaled", "F8_E4M3"), ("comfy_fp8", "F8_E4M3"), ("comfy_fp8", "F8_E5M2"),
                  ("fp8_block", "F8_E4M3"), ("fp6_block", None), ("nvfp4", None),
                  ("comfy_nvfp4", None), ("comfy_mxfp8", "F8_E4M3"), ("comfy_int8", None),
                  ("comfy_int8", "rows")]


@pytest.mark.parametrize("layout, fmt", LAYOUT_FORMATS)
@pytest.mark.parametrize("count, rule", [(1, "addmm"), (2, "addmm"), (3, "addmm"), (3, "sum")])
def test_matches_reference(rng, layout, fmt, count, rule):
    weight, scales, kwargs = case(rng, layout, fmt or "F8_E4M3")
    ads = adapters(rng, ROWS, COLS)[:count]
    expected = reference.fuse_quantized(layout, weight, scales, ads, rule, fmt or "F8_E4M3")
    before = [weight.copy()] + [s.copy() for s in scales]
    for threads in (1, 2, 3):
        got = quantized.fuse_quantized(layout, weight, ads, rule=rule, threads=threads, **kwargs)
        same(got, expected)
    assert all(np.array_equal(b, a) for b, a in zip(before, [weight, *scales]))  # not in place


@pytest.mark.parametrize("layout, fmt", [("fp8_scaled", "F8_E4M3"), ("comfy_fp8", "F8_E4M3"),
                                         ("comfy_fp8", "F8_E5M2")])
def test_per_tensor_passes_every_code_on_every_table(kernel_table, rng, layout, fmt):
    """The per-tensor passes (the maximum, then the rounding store) of each kernel table --
    sixteen elements at a time on the AVX-512 ones, one at a time elsewhere -- on every finite
    code of the format beside deltas of every size from far below the codes' quantum to past
    the largest, exact multiples of it among them (ties), given as a full-weight difference
    (whose delta is itself); rows of 103 elements, so that runs end in a scalar tail."""
    rows, cols = 96, 103
    nan = (lambda c: (c & 0x7F) == 0x7F) if fmt == "F8_E4M3" else (lambda c: (c & 0x7C) == 0x7C)
    finite = np.array([c for c in range(256) if not nan(c)], np.uint8)
    codes = finite[rng.integers(0, finite.size, (rows, cols))]
    scale = np.array(0.0005 if fmt == "F8_E4M3" else 0.00002, np.float32)
    exponents = rng.integers(-30, 4, (rows, cols)).astype(np.float32)
    values = rng.choice(np.float32([1.0, 1.5, 1.25, 1.0625, 1.03125]), (rows, cols))
    diff = reference.bf16_round(values * np.exp2(exponents) * scale
                                * rng.choice(np.float32([-1, 1]), (rows, cols)))
    diff[::7, ::5] = 0x0000
    expected = reference.fuse_quantized(layout, codes, (scale,), [(diff, 1.0)], "addmm", fmt)
    got = quantized.fuse_quantized(layout, codes, [(diff, 1.0)], scale=scale, fmt=fmt)
    same(got, expected)


def test_block_passes_every_code_on_every_table(kernel_table, rng):
    """The blockwise fp8 passes (the merge, then each block's requantisation) of each kernel
    table -- sixteen elements at a time on the AVX-512 ones -- on every finite e4m3 code with
    per-block scales, beside deltas of every size, ties among them, and one all-zero block."""
    rows, cols = 256, 384
    finite = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], np.uint8)
    codes = finite[rng.integers(0, finite.size, (rows, cols))]
    scales = rng.uniform(1e-5, 1e-3, (rows // 128, cols // 128)).astype(np.float32)
    exponents = rng.integers(-40, -2, (rows, cols)).astype(np.float32)
    values = rng.choice(np.float32([1.0, 1.5, 1.25, 1.0625, 1.03125]), (rows, cols))
    diff = reference.bf16_round(values * np.exp2(exponents)
                                * rng.choice(np.float32([-1, 1]), (rows, cols)))
    codes[128:, 256:] = 0                                  # with a zero delta: a zero block
    diff[128:, 256:] = 0
    expected = reference.fuse_quantized("fp8_block", codes, (scales,), [(diff, 1.0)], "addmm")
    got = quantized.fuse_quantized("fp8_block", codes, [(diff, 1.0)], scale=scales)
    same(got, expected)


def test_nvfp4_passes_on_every_table(kernel_table, rng):
    """The NVFP4 passes (the merge, then each group's scale and E2M1 codes) of each kernel
    table -- a group of 16 at a time on the AVX-512 ones -- on every byte of packed codes,
    beside deltas of every size from far below the codes' steps to past them, and a group
    whose merged values are all zero."""
    packed, scales, scale_2 = nvfp4_case(rng)
    exponents = rng.integers(-30, -3, (ROWS, COLS)).astype(np.float32)
    signs = rng.choice(np.float32([-1, 1]), (ROWS, COLS))
    diff = reference.bf16_round(rng.choice(np.float32([1.0, 1.5, 1.25, 1.75]), (ROWS, COLS))
                                * np.exp2(exponents) * signs)
    packed[5, :8] = 0                                      # one group of zero codes
    diff[5, :16] = 0                                       # and zero deltas
    expected = reference.fuse_quantized("nvfp4", packed, (scales, scale_2), [(diff, 1.0)])
    got = quantized.fuse_quantized("nvfp4", packed, [(diff, 1.0)], scale=scales, scale_2=scale_2)
    same(got, expected)


@pytest.mark.parametrize("layout, fmt", LAYOUT_FORMATS)
def test_in_place_and_tiles(rng, layout, fmt):
    weight, scales, kwargs = case(rng, layout, fmt or "F8_E4M3")
    ads = adapters(rng, ROWS, COLS)[:2]
    expected = reference.fuse_quantized(layout, weight, scales, ads, "addmm", fmt or "F8_E4M3")
    got = quantized.fuse_quantized(layout, weight, ads, in_place=True, tile=(32, 48), **kwargs)
    assert got.weight is weight or np.shares_memory(got.weight, weight)
    same(got, expected)
    assert np.array_equal(weight, expected[0])


def test_rules_differ_on_quantised_layouts(rng):
    weight, scales, kwargs = case(rng, "fp8_block")
    ads = adapters(rng, ROWS, COLS, ranks=(384, 32), scale=0.05)
    a = reference.fuse_quantized("fp8_block", weight, scales, ads, "addmm")[0]
    b = reference.fuse_quantized("fp8_block", weight, scales, ads, "sum")[0]
    assert np.any(a != b)
    same(quantized.fuse_quantized("fp8_block", weight, ads, rule="sum", **kwargs),
         reference.fuse_quantized("fp8_block", weight, scales, ads, "sum"))


@pytest.mark.parametrize("layout", ["fp8_scaled", "comfy_fp8"])
def test_all_zero_tensor_keeps_zero_codes(layout):
    """The owners' rules divide by max|n| = 0 and would write NaN codes with a zero scale; the
    codes are the signed zeros instead, the scale the owner's zero."""
    weight = np.zeros((8, 16), np.uint8)
    weight[::2] = 0x80  # -0.0, plus a +0.0 delta: +0.0
    ads = [(np.zeros((2, 16), np.uint16), np.zeros((8, 2), np.uint16), 1.0)]
    got = quantized.fuse_quantized(layout, weight, ads, scale=np.array(0.01, np.float32))
    assert np.all(got.weight == 0) and got.scale == 0
    same(got, reference.fuse_quantized(layout, weight, (np.array(0.01, np.float32),), ads))


@pytest.mark.parametrize("layout", ["fp8_block", "fp6_block"])
def test_all_zero_blocks(rng, layout):
    weight, scales, kwargs = case(rng, layout)
    ldc = COLS if layout == "fp8_block" else COLS * 3 // 4
    weight[:128, :ldc // 3] = 0  # block (0, 0) and not all of (0, 1): zero only with a zero delta
    ads = [(random_bf16(rng, (4, COLS), 0.02), random_bf16(rng, (ROWS, 4), 0.02), 1.0)]
    ads[0][0][:, :128] = 0
    expected = reference.fuse_quantized(layout, weight, scales, ads)
    assert expected[1][0, 0] == 0
    got = quantized.fuse_quantized(layout, weight, ads, **kwargs)
    same(got, expected)
    if layout == "fp8_block":
        assert np.all(got.weight[:128, :128] & 0x7F == 0)  # zeros, not NaN
    else:
        assert np.all(reference.fp6_unpack(got.weight, COLS)[:128, :128] == 0x1F)


@pytest.mark.parametrize("layout, fmt", LAYOUT_FORMATS)
def test_non_finite_inputs_are_refused_before_writing(rng, layout, fmt):
    weight, scales, kwargs = case(rng, layout, fmt or "F8_E4M3")
    ads = adapters(rng, ROWS, COLS)[:1]
    ads[0][1][3, 0] = 0x7FC0  # NaN in B
    before = weight.copy()
    with pytest.raises(errors.NonFiniteInputError, match="adapter 0 lora_b"):
        quantized.fuse_quantized(layout, weight, ads, in_place=True, **kwargs)
    assert np.array_equal(weight, before)
    if layout in ("fp8_scaled", "comfy_fp8", "fp8_block", "comfy_mxfp8"):
        weight[1, 2] = 0x7F if fmt == "F8_E4M3" else 0x7E  # NaN codes
        with pytest.raises(errors.NonFiniteWeightError, match=r"\(1, 2\)"):
            quantized.fuse_quantized(layout, weight, adapters(rng, ROWS, COLS)[:1], **kwargs)
    bad = dict(kwargs)
    if layout in ("nvfp4", "comfy_nvfp4"):
        bad["scale_2"] = np.array(np.inf, np.float32)
    elif layout == "comfy_mxfp8":
        bad["scale"] = kwargs["scale"].copy()
        bad["scale"][0, 0] = 0xFF                          # E8M0's NaN
    else:
        bad["scale"] = np.full_like(kwargs["scale"], np.nan)
    with pytest.raises(errors.NonFiniteWeightError):
        quantized.fuse_quantized(layout, before, adapters(rng, ROWS, COLS)[:1], **bad)


def test_comfy_passes_every_code(rng):
    """ComfyUI's nvfp4, mxfp8 and int8 passes on every code (every byte of packed E2M1, every
    finite e4m3 code, every int8) beside deltas of every size from far below a code's step to
    past it, exact ties among them, and a group (nvfp4: 16, mxfp8: 32 elements) that merges to
    zero."""
    exponents = rng.integers(-30, -3, (ROWS, COLS)).astype(np.float32)
    diff = reference.bf16_round(rng.choice(np.float32([1.0, 1.5, 1.25, 1.75]), (ROWS, COLS))
                                * np.exp2(exponents) * rng.choice(np.float32([-1, 1]), (ROWS, COLS)))
    diff[5, :32] = 0
    packed, scales, scale_2 = nvfp4_case(rng)
    packed[5, :8] = 0
    codes, mx = mxfp8_case(rng)
    codes[5, :32] = 0
    q, s = int8_case(rng)
    for layout, weight, all_scales in (("comfy_nvfp4", packed, (scales, scale_2)),
                                       ("comfy_mxfp8", codes, (mx,)), ("comfy_int8", q, (s,))):
        expected = reference.fuse_quantized(layout, weight, all_scales, [(diff, 1.0)])
        kwargs = dict(zip(("scale", "scale_2"), all_scales))
        got = quantized.fuse_quantized(layout, weight, [(diff, 1.0)], **kwargs)
        same(got, expected)
    assert expected[0].min() == -128 or expected[0].max() == 127  # the int8 range reached


def test_comfy_zero_tensors_and_groups():
    """An all-zero nvfp4 tensor (the owner's 0 / 0 would make NaN scales): zero codes, zero
    scales and scale_2; an mxfp8 group of zeros: zero codes and exponent 0, as the owner
    writes; an mxfp8 group too small for any exponent (max below 448 * 2^-127, where the
    owner divides by a zero scale): zeros too; an int8 zero tensor: the owner's 1e-30 scale."""
    rows, cols = 128, 64
    zero = [(np.zeros((2, cols), np.uint16), np.zeros((rows, 2), np.uint16), 1.0)]
    packed = np.zeros((rows, cols // 2), np.uint8)
    scales = np.full(quantized.tiled_shape("comfy_nvfp4", rows, cols), 0x38, np.uint8)
    got = quantized.fuse_quantized("comfy_nvfp4", packed, zero, scale=scales,
                                   scale_2=np.array(0.5, np.float32))
    assert not got.weight.any() and not got.scale.any() and got.scale_2 == 0
    same(got, reference.fuse_quantized("comfy_nvfp4", packed, (scales, np.float32(0.5)), zero))
    codes = np.full((rows, cols), 0x38, np.uint8)                  # 1.0
    mx = np.full(quantized.tiled_shape("comfy_mxfp8", rows, cols), 127, np.uint8)
    mx.reshape(-1)[reference.nvfp4_scale_offset(0, 0, mx.shape[1])] = 0   # a zero scale
    mx.reshape(-1)[reference.nvfp4_scale_offset(1, 1, mx.shape[1])] = 1   # 2^-126: tiny values
    got = quantized.fuse_quantized("comfy_mxfp8", codes, zero, scale=mx)
    assert not got.weight[0, :32].any() and not got.weight[1, 32:].any()
    assert got.scale.reshape(-1)[reference.nvfp4_scale_offset(1, 1, mx.shape[1])] == 0
    # the other groups of 1.0 requantise to exponent ceil(log2(1 / 448)) = -8: codes of 256
    assert np.all(reference.fp8_widen(got.weight[2:], "F8_E4M3") == 256)
    assert got.scale.reshape(-1)[reference.nvfp4_scale_offset(2, 0, mx.shape[1])] == 127 - 8
    same(got, reference.fuse_quantized("comfy_mxfp8", codes, (mx,), zero))
    q = np.zeros((rows, cols), np.int8)
    got = quantized.fuse_quantized("comfy_int8", q, zero, scale=np.array(0.1, np.float32))
    assert not got.weight.any() and got.scale == np.float32(1e-30)


def test_comfy_int8_scale_shapes(rng):
    """One scale (shape []) or one per row ([rows, 1]) are ComfyUI's shapes, kept; [1] is
    refused, as ComfyUI would requantise it per row into another shape."""
    q, _ = int8_case(rng)
    ads = adapters(rng, ROWS, COLS)[:1]
    with pytest.raises(errors.ShapeError, match="per row"):
        quantized.fuse_quantized("comfy_int8", q, ads, scale=np.ones(1, np.float32))
    with pytest.raises(errors.DTypeError, match="int8"):
        quantized.fuse_quantized("comfy_int8", q.view(np.uint8), ads,
                                 scale=np.array(0.1, np.float32))
    got = quantized.fuse_quantized("comfy_int8", q, ads, scale=np.full((ROWS, 1), 2e-4, np.float32))
    assert got.scale.shape == (ROWS, 1) and got.weight.dtype == np.int8


def test_overflowing_merge_is_refused(rng):
    weight, scale = per_tensor_case(rng)
    big = [(np.full((1, COLS), 0x7F00, np.uint16), np.full((ROWS, 1), 0x7F00, np.uint16), 1.0)]
    with pytest.raises(errors.NonFiniteResultError):
        quantized.fuse_quantized("fp8_scaled", weight, big, scale=scale)


def test_shapes_and_dtypes_are_checked(rng):
    weight, scale = per_tensor_case(rng)
    ads = adapters(rng, ROWS, COLS)[:1]
    with pytest.raises(ValueError, match="layout"):
        quantized.fuse_quantized("int8", weight, ads, scale=scale)
    with pytest.raises(errors.ShapeError, match="one value"):
        quantized.fuse_quantized("fp8_scaled", weight, ads, scale=np.ones(3, np.float32))
    with pytest.raises(errors.DTypeError, match="float32"):
        quantized.fuse_quantized("fp8_scaled", weight, ads, scale=np.ones(1, np.float64))
    with pytest.raises(errors.DTypeError, match="F8_E4M3"):
        quantized.fuse_quantized("fp8_scaled", weight, ads, scale=scale, fmt="F8_E5M2")
    with pytest.raises(errors.ShapeError, match="128 x 128"):
        quantized.fuse_quantized("fp8_block", weight[:100], ads, scale=np.ones((1, 3), np.float32))
    with pytest.raises(errors.ShapeError):
        quantized.fuse_quantized("fp8_block", weight, ads, scale=np.ones((2, 2), np.float32))
    packed, scales, s2 = nvfp4_case(rng)
    with pytest.raises(errors.ShapeError, match="tiled"):
        quantized.fuse_quantized("nvfp4", packed, ads, scale=np.ascontiguousarray(scales[:, :4]), scale_2=s2)
    with pytest.raises(ValueError, match="scale_2"):
        quantized.fuse_quantized("nvfp4", packed, ads, scale=scales)
    with pytest.raises(errors.ShapeError):  # adapters that do not fit the logical shape
        quantized.fuse_quantized("nvfp4", packed, adapters(rng, ROWS, COLS // 2)[:1],
                                 scale=scales, scale_2=s2)


def test_ml_dtypes_fp8_weights(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    weight, scale = per_tensor_case(rng, "F8_E5M2")
    ads = adapters(rng, ROWS, COLS)[:2]
    got = quantized.fuse_quantized("comfy_fp8", weight.view(ml_dtypes.float8_e5m2), ads, scale=scale)
    assert got.weight.dtype == ml_dtypes.float8_e5m2
    same(got, reference.fuse_quantized("comfy_fp8", weight, (scale,), ads, fmt="F8_E5M2"))


def test_reference_fp6_and_nvfp4_packing_round_trip(rng):
    codes = rng.integers(0, 256, (4, 64)).astype(np.uint8) & 0x9F
    assert np.array_equal(reference.fp6_unpack(reference.fp6_pack(codes), 64), codes)
    nib = rng.integers(0, 16, (4, 64)).astype(np.uint8)
    assert np.array_equal(reference.nvfp4_unpack(reference.nvfp4_pack(nib)), nib)
    # the tiled offsets are a permutation of the padded array
    r, c = np.meshgrid(np.arange(256), np.arange(8), indexing="ij")
    assert sorted(reference.nvfp4_scale_offset(r, c, 8).reshape(-1)) == list(range(256 * 8))


def test_e2m1_rounding_grid():
    values = np.array([0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 6, 7, 1e9, -0.0,
                       -0.1, -2.5, -5.5], np.float32)
    expected = [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7, 8, 8, 12, 15]
    assert list(reference.e2m1_round(values)) == expected


@pytest.mark.parametrize("layout", quantized.DEQUANTIZED_TO_BF16)
def test_dequantized_values_are_the_owners(rng, layout):
    """What a fuse adds a delta to, alone: the reference's dequantisation, byte for byte."""
    weight, scales, kwargs = case(rng, layout)
    got = quantized.dequantized(layout, weight, **kwargs)
    if layout == "nvfp4":
        want = reference.dequantize_nvfp4(weight, *scales)
    else:
        codes = reference.fp6_unpack(weight, COLS) if layout == "fp6_block" else weight
        want = reference.dequantize_block(codes, scales[0])
    zero = reference.bf16_widen(want) == 0          # -0.0 comes back +0.0 (0 + delta)
    assert np.array_equal(got[~zero], want[~zero]) and np.all(got[zero] == 0)
    with pytest.raises(errors.ArgumentError, match="dequantized reads"):
        quantized.dequantized("comfy_int8", weight, **kwargs)


def test_comfy_mxfp8_exponents_just_above_a_power_of_two(rng):
    """Groups whose largest merged value is 448 * 2^s times 1 + a few 2^-23 (a bf16 delta of m
    2^(s - 14) on a code of 448): the exponent is the ceiling of log2 rounded to f32, which for
    |s| >= 4 is s itself, not s + 1, where the excess is below half an ulp; the kernel takes
    these from the log2 and the rest from the bits, byte for byte with the reference."""
    rows, cols = 128, 256
    groups = cols // 32
    codes = np.full((rows, cols), 0x38, np.uint8)                  # 1.0 a code
    codes[:, ::32] = 0x7E                                          # 448, each group's largest
    s = rng.integers(-40, 20, (rows, groups))
    m = rng.integers(-70, 71, (rows, groups))
    mx = reference.to_tiled((s + 127).astype(np.int64))
    delta = np.zeros((rows, cols), np.float32)
    delta[:, ::32] = m * np.exp2(s - 14.0)
    d = (delta.view(np.uint32) >> 16).astype(np.uint16)            # exact: m has < 8 bits
    assert np.array_equal((d.astype(np.uint32) << 16).view(np.float32), delta)
    adapters = [(d, 1.0)]                                          # a difference
    got = quantized.fuse_quantized("comfy_mxfp8", codes, adapters, scale=mx)
    same(got, reference.fuse_quantized("comfy_mxfp8", codes, (mx,), adapters))
