"""Adapter kinds beyond the plain LoRA pair: full-weight differences in the several-adapter
rules, and DoRA, byte-identical to the reference for every thread count and tile."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference

from helpers import random_bf16


def lora(rng, rows, cols, rank, scale=0.02):
    return random_bf16(rng, (rank, cols), scale), random_bf16(rng, (rows, rank), scale)


@pytest.mark.parametrize("rule", ["addmm", "sum"])
@pytest.mark.parametrize("order", ["diff first", "diff later", "diff alone", "two diffs"])
def test_diffs_in_the_rules(rng, rule, order):
    rows, cols = 97, 300
    weight = random_bf16(rng, (rows, cols), 0.02)
    diff = random_bf16(rng, (rows, cols), 0.001)
    a, b = lora(rng, rows, cols, 140)
    items = {"diff first": [(diff, 0.7), (a, b, 1.3)], "diff later": [(a, b, 1.3), (diff, -0.7)],
             "diff alone": [(diff, 0.7)],
             "two diffs": [(diff, 0.7), (random_bf16(rng, (rows, cols), 0.003), 2.0)]}[order]
    expected = reference.fuse_loras(weight, items, rule)
    for threads, tile in ((1, None), (2, (16, 64)), (3, (7, 33))):
        assert np.array_equal(ltx2blas.fuse_loras(weight, items, rule=rule, threads=threads,
                                                  tile=tile), expected)
    delta = ltx2blas.fuse.aggregate_delta(rows, cols, items, rule=rule)
    want = reference.adapter_delta(items[0]) if len(items) == 1 else reference.aggregate_delta(items, rule)
    assert np.array_equal(delta, want)


def test_diff_in_every_kernel_table(kernel_table, rng):
    weight = random_bf16(rng, (45, 130), 0.02)
    items = [(*lora(rng, 45, 130, 9), 0.5), (random_bf16(rng, (45, 130), 0.002), 1.5)]
    assert np.array_equal(ltx2blas.fuse_loras(weight, items, tile=(16, 32)),
                          reference.fuse_loras(weight, items, "addmm"))


def test_diff_into_fp8_and_quantised_weights(rng):
    codes = reference.fp8_round(rng.standard_normal((128, 256)).astype(np.float32) * 20, "F8_E4M3")
    diff = random_bf16(rng, (128, 256), 0.5)
    items = [(diff, 1.0), (*lora(rng, 128, 256, 4, 0.3), 0.8)]
    assert np.array_equal(ltx2blas.fuse_loras(codes, items, weight_format="F8_E4M3"),
                          reference.fuse_loras_fp8(codes, items, "F8_E4M3"))
    scale = np.array(0.01, np.float32)
    got = ltx2blas.fuse_quantized("fp8_scaled", codes, items, scale=scale)
    want = reference.fuse_quantized("fp8_scaled", codes, (scale,), items)
    assert np.array_equal(got.weight, want[0])


def test_diff_checks(rng):
    weight = random_bf16(rng, (8, 16), 0.02)
    with pytest.raises(errors.ShapeError, match="diff"):
        ltx2blas.fuse_loras(weight, [(random_bf16(rng, (8, 15), 0.1), 1.0)])
    bad = random_bf16(rng, (8, 16), 0.1)
    bad[2, 3] = 0x7FC0
    with pytest.raises(errors.NonFiniteInputError, match=r"diff is non-finite at \(2, 3\)"):
        ltx2blas.fuse_loras(weight, [(bad, 1.0)], check_finite=True)


MAGNITUDES = {"peft": lambda rows, cols: (rows,), "comfy_out": lambda rows, cols: (rows, 1),
              "comfy_in": lambda rows, cols: (1, cols)}


@pytest.mark.parametrize("kind", list(MAGNITUDES))
@pytest.mark.parametrize("strength", [1.0, 0.6, -0.25])
def test_dora_matches_reference(rng, kind, strength):
    rows, cols = 97, 300
    weight = random_bf16(rng, (rows, cols), 0.02)
    a, b = lora(rng, rows, cols, 24)
    style = "peft" if kind == "peft" else "comfy"
    # magnitudes near the weight's own norms, as training leaves them
    w = reference.bf16_widen(weight).astype(np.float64)
    norms = np.sqrt((w ** 2).sum(axis=1 if kind != "comfy_in" else 0))
    m = (norms * rng.uniform(0.9, 1.1, norms.shape)).astype(np.float32).reshape(MAGNITUDES[kind](rows, cols))
    expected = reference.fuse_dora(weight, a, b, m, 0.5, strength, style)
    for threads in (1, 2, 3):
        got = ltx2blas.fuse_dora(weight, a, b, m, scale=0.5, strength=strength, style=style,
                                 threads=threads)
        assert np.array_equal(got, expected)
    again = weight.copy()
    ltx2blas.fuse_dora(again, a, b, reference.bf16_round(m), scale=0.5, strength=strength,
                       style=style, out=again)
    assert np.array_equal(again, reference.fuse_dora(weight, a, b, reference.bf16_round(m), 0.5,
                                                     strength, style))


def test_dora_rescales_rows_to_the_magnitude(rng):
    """At strength 1 (PEFT's merge) every row's norm is the magnitude, up to bf16 rounding."""
    weight = random_bf16(rng, (40, 512), 0.02)
    a, b = lora(rng, 40, 512, 8)
    m = rng.uniform(0.3, 0.6, 40).astype(np.float32)
    got = reference.bf16_widen(ltx2blas.fuse_dora(weight, a, b, m)).astype(np.float64)
    # each element rounds by at most 2^-9 relative: the norm by as much
    assert np.allclose(np.sqrt((got ** 2).sum(axis=1)), m, rtol=2.0 ** -8)


def test_dora_checks(rng):
    weight = random_bf16(rng, (8, 16), 0.02)
    a, b = lora(rng, 8, 16, 2)
    with pytest.raises(errors.ShapeError, match=r"\[8\]"):
        ltx2blas.fuse_dora(weight, a, b, np.ones((8, 1), np.float32))
    with pytest.raises(errors.ShapeError, match=r"\[8, 1\] or \[1, 16\]"):
        ltx2blas.fuse_dora(weight, a, b, np.ones(8, np.float32), style="comfy")
    with pytest.raises(errors.DTypeError):
        ltx2blas.fuse_dora(weight, a, b, np.ones(8, np.float64))
    with pytest.raises(ValueError, match="style"):
        ltx2blas.fuse_dora(weight, a, b, np.ones(8, np.float32), style="lycoris")
    zero = np.zeros((8, 16), np.uint16)
    with pytest.raises(errors.NonFiniteResultError, match="row 0"):
        ltx2blas.fuse_dora(zero, np.zeros_like(a), b, np.ones(8, np.float32))
