"""fp8 rounding (docs/arithmetic.md §2) in the reference: torch's cast (upstream's engine) for every value
where it is defined, under the overflow rule of the installed torch; ml_dtypes' cast, which is
the "nan" rule, on every value."""
import numpy as np
import pytest

from ltx2blas import reference

from helpers import torch_fp8_overflow

FORMATS = ["F8_E4M3", "F8_E5M2"]


def every_bf16():
    return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_widen_round_trips_every_code(fmt):
    codes = np.arange(256, dtype=np.uint8)
    values = reference.fp8_widen(codes, fmt)
    back = reference.fp8_round(values, fmt)
    nan = np.isnan(values)
    assert np.array_equal(back[~nan], codes[~nan])
    assert np.all((back[nan] & 0x7F) == 0x7F)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_matches_torch_on_every_bf16_value(fmt):
    torch = pytest.importorskip("torch")
    dtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[fmt]
    values = every_bf16()
    expected = torch.from_numpy(values.copy()).to(dtype).view(torch.uint8).numpy()
    got = reference.fp8_round(values, fmt, overflow=torch_fp8_overflow(torch))
    assert np.array_equal(got, expected)


def test_overflow_rules_differ_exactly_past_464():
    """The two e4m3 rules give the same code for every bf16 value but those past 464 (464
    itself ties down to 448) and the infinities: 2 x (15255 + 1) values, 30,512."""
    values = every_bf16()
    saturate = reference.fp8_round(values, "F8_E4M3", overflow="saturate")
    nan = reference.fp8_round(values, "F8_E4M3", overflow="nan")
    differ = saturate != nan
    past = (np.abs(values) > 464) & ~np.isnan(values)
    assert np.array_equal(differ, past) and differ.sum() == 30512
    assert set(saturate[past]) == {0x7E, 0xFE} and set(nan[past]) == {0x7F, 0xFF}
    for fmt in FORMATS[1:]:  # e5m2 overflows to inf under both
        assert np.array_equal(reference.fp8_round(values, fmt, overflow="nan"),
                              reference.fp8_round(values, fmt))


def test_nan_rule_matches_ml_dtypes_on_every_bf16_value():
    """ml_dtypes' float8_e4m3fn cast sends overflow and inf to NaN, as torch did up to 2.12:
    an oracle for the "nan" rule that needs no old torch."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = every_bf16()
    with np.errstate(invalid="ignore", over="ignore"):
        expected = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(reference.fp8_round(values, "F8_E4M3", overflow="nan"), expected)


@pytest.mark.parametrize("fmt, mldt", [("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")])
def test_round_matches_ml_dtypes_where_in_range(fmt, mldt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    values = every_bf16()
    with np.errstate(invalid="ignore", over="ignore"):
        expected = values.astype(getattr(ml_dtypes, mldt)).view(np.uint8)
    got = reference.fp8_round(values, fmt)
    largest = reference.FP8_FORMATS[fmt]["largest"]
    # ml_dtypes sends e4m3fn overflow to NaN (torch saturates) and codes e5m2 NaN as 0x7E:
    # compare the finite, in-range values.
    keep = np.isfinite(values) & (np.abs(reference.fp8_widen(got, fmt)) < largest)
    assert np.array_equal(got[keep], expected[keep])


def test_specific_values():
    f = np.array([448, 464, 480, 1e9, np.inf, -np.inf, np.nan, 2.0**-9, 2.0**-10, 1.5 * 2.0**-9,
                  -0.0, 1.0625, 1.1875], np.float32)
    # 464 ties to even (448); beyond, e4m3fn saturates at 448 (0x7E), inf too; 2^-10 ties to
    # 0; 1.5 * 2^-9 ties to even (2 * 2^-9); 1 + 1/16 ties down to 1, 1 + 3/16 up to 1 + 1/4.
    assert reference.fp8_round(f, "F8_E4M3").tolist() == [
        0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x01, 0x00, 0x02, 0x80, 0x38, 0x3A]
    # the "nan" rule (torch up to 2.12): 466, the next bf16 value past 464, and beyond are NaN
    h = np.array([448, 464, 466, 480, 1e9, np.inf, -np.inf, -466, np.nan], np.float32)
    assert reference.fp8_round(h, "F8_E4M3", overflow="nan").tolist() == [
        0x7E, 0x7E, 0x7F, 0x7F, 0x7F, 0x7F, 0xFF, 0xFF, 0x7F]
    assert reference.fp8_round(h, "F8_E4M3").tolist() == [
        0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]
    g = np.array([57344, 61440, 1e9, np.inf, np.nan, 2.0**-16, 2.0**-17], np.float32)
    assert reference.fp8_round(g, "F8_E5M2").tolist() == [0x7B, 0x7C, 0x7C, 0x7C, 0x7F, 0x01, 0x00]


# ---- fusing into fp8 weights -----------------------------------------------------------------

import ltx2blas  # noqa: E402
from ltx2blas import errors  # noqa: E402

import _ltx2blas_hooks as hooks  # noqa: E402
from helpers import random_bf16  # noqa: E402


def fp8_weight(rng, shape, fmt, scale=0.05):
    return reference.fp8_round(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale), fmt)


def stochastic_expected(weight, adapters, fmt, seed, name):
    """The reference pieces, composed: total (bf16), bf16(total + bf16(W)), then stochastic."""
    if len(adapters) == 1:
        total = reference.lora_delta(*adapters[0])
    else:
        acc = np.zeros(weight.shape, np.float32)
        for a, b, s in adapters:
            acc = acc + reference.bf16_widen(reference.lora_delta(a, b, s))
        total = reference.bf16_round(acc)
    summed = reference.bf16_round(reference.bf16_widen(total) + reference.fp8_widen(weight, fmt))
    return reference.fp8_round_stochastic(summed, fmt, reference.stochastic_key(seed, name))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ranks", [[384], [16, 450]])
def test_fuse_into_fp8_matches_reference(rng, fmt, ranks):
    weight = fp8_weight(rng, (70, 130), fmt)
    adapters = [(random_bf16(rng, (r, 130), 0.01), random_bf16(rng, (70, r), 0.01), s)
                for r, s in zip(ranks, [0.8, -1.5])]
    expected = reference.fuse_loras_fp8(weight, adapters, fmt)
    for threads, tile in ((1, None), (3, (16, 32))):
        if len(adapters) == 1:
            got = ltx2blas.fuse_lora(weight, *adapters[0], weight_format=fmt, threads=threads, tile=tile)
        else:
            got = ltx2blas.fuse_loras(weight, adapters, weight_format=fmt, threads=threads, tile=tile)
        assert got.dtype == np.uint8
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fuse_keeps_upstreams_nan_and_inf_codes(rng, fmt):
    """Weight codes that are NaN with either sign bit, and the infinities of e5m2, fused as
    upstream's torch does: a NaN code widens to the positive NaN and comes back as 0x7F."""
    weight = fp8_weight(rng, (9, 40), fmt)
    specials = [0x7F, 0xFF] if fmt == "F8_E4M3" else [0x7C, 0xFC, 0x7D, 0xFE, 0xFF]
    weight[::2, :len(specials)] = specials
    adapters = [(random_bf16(rng, (4, 40), 0.01), random_bf16(rng, (9, 4), 0.01), 0.8)]
    got = ltx2blas.fuse_lora(weight, *adapters[0], weight_format=fmt)
    expected = reference.fuse_loras_fp8(weight, adapters, fmt)
    assert np.array_equal(got, expected)
    assert set(got[::2, :len(specials)].ravel()) <= {0x7F, 0x7C, 0xFC}


#: The rounding store's formats (kernels.h ltx_fp8_kind): (format, overflow rule, kind).
KINDS = [("F8_E4M3", "saturate", 0), ("F8_E5M2", "saturate", 1), ("F8_E4M3", "nan", 2)]


@pytest.mark.parametrize("fmt, rule, kind", KINDS)
def test_kernel_fp8_rounding_of_every_bf16_value(kernel_table, fmt, rule, kind):
    """Each kernel table's rounding store under each rule, on every bf16 value: the weight is
    -0.0, which adds nothing to any value (-0.0 + -0.0 stays -0.0), so every bf16 value of the
    delta is what reaches the rounding; rows of 64 (whole vectors on every table)."""
    values = every_bf16()
    acc = np.ascontiguousarray(values.reshape(-1, 64))
    w = np.full(acc.shape, reference.fp8_round(np.float32(-0.0), fmt), np.uint8)
    got, first, count = hooks.store_fused_fp8(acc, w, kind, kernel_table)
    assert np.array_equal(got[:, :64].ravel(), reference.fp8_round(values, fmt, overflow=rule))
    magnitude = np.abs(values)
    past = np.isfinite(values) & ((magnitude > 464.0) if fmt == "F8_E4M3" else (magnitude >= 61440.0))
    assert count == past.sum() and first == np.flatnonzero(past)[0]


@pytest.mark.parametrize("fmt, rule, kind", KINDS)
def test_kernel_fp8_store_every_code(kernel_table, fmt, rule, kind):
    """The fp8 rounding store of each kernel table (nearest-even) under each overflow rule:
    every code of the format as the weight, against deltas spanning every bf16 exponent, both
    signs, ties, subnormals, inf and NaN; rows of 40 (whole vectors and a tail on every table)
    in a wider weight; the first overflow's index and the overflows' count."""
    rng = np.random.default_rng(11)
    codes = np.arange(256, dtype=np.uint8)
    deltas = np.concatenate([
        (np.arange(0, 65536, 7, dtype=np.uint32) << 16).view(np.float32),   # bf16 values
        (rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)).view(np.float32),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 448.0, 464.0, 57344.0, 61440.0],
                 np.float32)])
    w_flat, acc_flat = (a.ravel() for a in np.meshgrid(codes, deltas))
    n = w_flat.size - w_flat.size % 40
    acc = np.ascontiguousarray(acc_flat[:n].reshape(-1, 40))
    w = np.zeros((acc.shape[0], 45), np.uint8)
    w[:, :40] = w_flat[:n].reshape(-1, 40)
    got, first, count = hooks.store_fused_fp8(acc, w, kind, kernel_table)
    with np.errstate(invalid="ignore", over="ignore"):
        summed = reference.bf16_round(reference.fp8_widen(w[:, :40], fmt) +
                                      reference.bf16_widen(reference.bf16_round(acc)))
        expected = reference.fp8_round(reference.bf16_widen(summed), fmt, overflow=rule)
    # NaN + NaN keeps one of the two NaNs (IEEE leaves which unspecified): compare NaN-ness
    # there, bits everywhere else.
    both_nan = np.isnan(reference.fp8_widen(w[:, :40], fmt)) & np.isnan(acc)
    assert np.array_equal(got[:, :40][~both_nan], expected[~both_nan])
    assert np.all(np.isnan(reference.fp8_widen(got[:, :40][both_nan], fmt)))
    assert np.all(got[:, 40:] == 0xAB)
    # overflow: a finite sum that rounds past the largest finite code. e4m3: 448 + 16 (half
    # its unit) ties down to 448 (even), anything above rounds up; e5m2: 57344 + 4096 ties up.
    magnitude = np.abs(reference.bf16_widen(summed))
    finite = np.isfinite(magnitude)
    over = finite & ((magnitude > 464.0) if fmt == "F8_E4M3" else (magnitude >= 61440.0))
    flat = np.flatnonzero(over.ravel())
    assert flat.size and first == flat[0] and count == flat.size


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding_matches_reference_for_any_tiling(rng, fmt):
    weight = fp8_weight(rng, (50, 90), fmt)
    adapters = [(random_bf16(rng, (8, 90), 0.05), random_bf16(rng, (50, 8), 0.05), 1.0)]
    expected = stochastic_expected(weight, adapters, fmt, 7, "blocks.0.attn1.to_q.weight")
    for threads, tile in ((1, None), (2, (7, 16)), (3, (64, 8))):
        got = ltx2blas.fuse_lora(weight, *adapters[0], weight_format=fmt, threads=threads,
                                 tile=tile, fp8_rounding="stochastic", seed=7,
                                 name="blocks.0.attn1.to_q.weight")
        assert np.array_equal(got, expected)
    other = ltx2blas.fuse_lora(weight, *adapters[0], weight_format=fmt,
                               fp8_rounding="stochastic", seed=8, name="blocks.0.attn1.to_q.weight")
    assert not np.array_equal(other, expected)  # another seed, other bits


def test_stochastic_rounding_is_unbiased():
    """Each value lies between two fp8 neighbours; over many elements, the mean of the rounded
    values approaches the value itself (nearest rounding would always pick one neighbour)."""
    fmt = "F8_E4M3"
    value = np.float32(1.0 + 3 / 64)            # between 1.0 and 1.125: 3/8 of the way up
    bits = np.full(200_000, reference.bf16_round(value), np.uint16)
    codes = reference.fp8_round_stochastic(bits, fmt, reference.stochastic_key(1, "t"))
    mean = reference.fp8_widen(codes, fmt).astype(np.float64).mean()
    # standard error: 0.125 * sqrt(p (1 - p) / n) = 1.4e-4; allow 5 of them
    assert abs(mean - float(value)) < 5 * 0.125 * np.sqrt(0.375 * 0.625 / bits.size)
    assert set(np.unique(reference.fp8_widen(codes, fmt))) == {1.0, 1.125}


def test_fp8_dtype_handling(rng):
    weight = fp8_weight(rng, (10, 20), "F8_E4M3")
    a, b = random_bf16(rng, (3, 20), 0.01), random_bf16(rng, (10, 3), 0.01)
    with pytest.raises(errors.DTypeError, match="weight_format"):
        ltx2blas.fuse_lora(weight, a, b)
    with pytest.raises(ValueError, match="stochastic"):
        ltx2blas.fuse_lora(random_bf16(rng, (10, 20)), a, b, fp8_rounding="stochastic")
    with pytest.raises(ValueError, match="fp8_rounding"):
        ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3", fp8_rounding="up")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    got = ltx2blas.fuse_lora(weight.view(ml_dtypes.float8_e4m3fn), a, b)
    assert got.dtype == ml_dtypes.float8_e4m3fn
    assert np.array_equal(got.view(np.uint8),
                          ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3"))
    with pytest.raises(errors.DTypeError):
        ltx2blas.fuse_lora(weight.view(ml_dtypes.float8_e4m3fn), a, b, weight_format="F8_E5M2")


@pytest.mark.parametrize("rule, made", [("saturate", 0x7E), ("nan", 0x7F)])
def test_fp8_overflow_is_caught_with_check_finite(rng, rule, made):
    weight = fp8_weight(rng, (10, 20), "F8_E4M3")
    weight[2, 3] = 0x7E  # 448, the largest: a positive delta takes it past
    a = np.full((1, 20), 0x3F80, np.uint16)
    b = np.full((10, 1), 0x4200, np.uint16)  # 32.0
    before = weight.copy()
    text = "\\+-448" if rule == "saturate" else "NaN"
    with pytest.raises(errors.NonFiniteResultError,
                       match=rf"overflows F8_E4M3 at \(2, 3\): past 448, which "
                             rf"fp8_overflow='{rule}' makes {text}"):
        ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3", check_finite=True, out=weight,
                           fp8_overflow=rule)
    assert np.array_equal(weight, before)
    got, overflows = ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3", fp8_overflow=rule,
                                        return_overflows=True)
    assert got[2, 3] == made and overflows == 1  # without the check: the rule's code, counted


@pytest.mark.parametrize("fmt, rule", [(f, r) for f, r, _ in KINDS])
@pytest.mark.parametrize("ranks", [[6], [6, 3]])
def test_fp8_overflow_rules_byte_exact_and_counted(rng, fmt, rule, ranks):
    """Weights near the format's largest value and deltas that take about a tenth of them past
    it, ties at 464 among them: every rule's bytes are the reference's for any tiling and
    thread count, and the count is the number of finite sums that rounded past the largest."""
    largest = reference.FP8_FORMATS[fmt]["largest"]
    weight = fp8_weight(rng, (67, 133), fmt, scale=largest / 2)
    weight[5, :8] = reference.fp8_round(np.full(8, 416.0 if fmt == "F8_E4M3" else 49152.0), fmt)
    adapters = [(random_bf16(rng, (r, 133), 1.0), random_bf16(rng, (67, r), 1.0),
                 np.float32(largest / 8)) for r in ranks]
    a, b, s = adapters[0]   # row 5: + 48 (or + 12288) in its first 8 columns, exactly
    a[:, :8], b[5, :] = 0, 0
    a[0, :8], b[5, 0] = 0x3F80, reference.bf16_round(np.float32(48.0 if fmt == "F8_E4M3" else 12288.0) / s)
    expected = reference.fuse_loras_fp8(weight, adapters, fmt, overflow=rule)
    total = (reference.lora_delta(*adapters[0]) if len(ranks) == 1
             else reference.aggregate_delta(adapters, "addmm"))
    summed = reference.bf16_widen(reference.bf16_round(
        reference.fp8_widen(weight, fmt) + reference.bf16_widen(total)))
    # past the largest: e4m3 above 464 (464 ties down to 448), e5m2 from 61440 (ties up to inf)
    mag = np.abs(summed)
    past = ((mag > 464.0) if fmt == "F8_E4M3" else (mag >= 61440.0)) & np.isfinite(summed)
    assert 0.02 < past.mean() < 0.3
    for threads, tile in ((1, None), (3, (16, 32)), (2, (64, 8))):
        got, overflows = ltx2blas.fuse_loras(weight, adapters, weight_format=fmt, threads=threads,
                                             tile=tile, fp8_overflow=rule, return_overflows=True)
        assert np.array_equal(got, expected)
        assert overflows == past.sum()


def test_fp8_overflow_argument(rng):
    weight = fp8_weight(rng, (10, 20), "F8_E4M3")
    a, b = random_bf16(rng, (3, 20), 0.01), random_bf16(rng, (10, 3), 0.01)
    with pytest.raises(errors.ArgumentError, match="fp8_overflow must be 'saturate' or 'nan'"):
        ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3", fp8_overflow="clip")
    with pytest.raises(errors.ArgumentError, match="never rounds past the largest finite"):
        ltx2blas.fuse_lora(weight, a, b, weight_format="F8_E4M3", fp8_rounding="stochastic",
                           fp8_overflow="nan")
    bf16 = random_bf16(rng, (10, 20))  # bf16 weights have no fp8 overflow: the rule is moot
    assert np.array_equal(ltx2blas.fuse_lora(bf16, a, b, fp8_overflow="nan"),
                          ltx2blas.fuse_lora(bf16, a, b))
    assert ltx2blas.fuse_lora(bf16, a, b, return_overflows=True)[1] == 0
