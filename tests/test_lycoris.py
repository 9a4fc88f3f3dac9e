"""LoKr and LoHa adapters through the array API, byte for byte against ltx2blas.reference
(docs/arithmetic.md §1, "LoKr and LoHa"): alone and mixed with LoRAs and differences, by both
several-adapter rules, on every kernel table, for any thread count and tile, into bf16, fp8 and
scaled or quantised weights; and every malformed adapter refused before anything is written."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import LoHa, LoKr, fuse, reference
from ltx2blas.errors import (LayoutError, NonFiniteInputError, NonFiniteResultError, ShapeError,
                             ArgumentTypeError)

from helpers import random_bf16


def loha(rng, rows, cols, ranks=(8, 4), scale=0.37, magnitude=0.3):
    r1, r2 = ranks
    return LoHa(random_bf16(rng, (rows, r1), magnitude), random_bf16(rng, (r1, cols), magnitude),
                random_bf16(rng, (rows, r2), magnitude), random_bf16(rng, (r2, cols), magnitude),
                scale)


def lokr(rng, rows, cols, m1, n1, ranks=(None, 3), scale=0.8, magnitude=0.5):
    """A LoKr with w1 [m1, n1] and w2 [rows / m1, cols / n1], each whole (rank None) or a pair
    of that rank."""
    def factor(m, n, rank):
        if rank is None:
            return random_bf16(rng, (m, n), magnitude)
        return random_bf16(rng, (m, rank), magnitude), random_bf16(rng, (rank, n), magnitude)
    return LoKr(factor(m1, n1, ranks[0]), factor(rows // m1, cols // n1, ranks[1]), scale)


def lora(rng, rows, cols, rank=16, strength=0.6):
    return random_bf16(rng, (rank, cols), 0.3), random_bf16(rng, (rows, rank), 0.3), strength


def assert_same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    differ = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
    assert differ.size == 0, f"{differ.size} elements differ, first at {differ[0]}"


LOKR_FACTORS = [(None, None), (None, 3), (2, None), (5, 7)]


@pytest.mark.parametrize("ranks", LOKR_FACTORS, ids=lambda r: f"w1-{r[0]}-w2-{r[1]}")
@pytest.mark.parametrize("shape, m1, n1", [((96, 160), 4, 8), ((130, 77), 2, 7),
                                           ((64, 64), 8, 8), ((33, 40), 1, 1)])
def test_a_lokr_matches_reference(rng, shape, m1, n1, ranks):
    w = random_bf16(rng, shape)
    ad = lokr(rng, *shape, m1, n1, ranks)
    assert_same(ltx2blas.fuse_loras(w, [ad]), reference.fuse_loras(w, [ad]))


@pytest.mark.parametrize("ranks", [(8, 4), (1, 1), (32, 384), (130, 7)])
@pytest.mark.parametrize("shape", [(96, 160), (130, 77), (1, 33), (70, 1)])
def test_a_loha_matches_reference(rng, shape, ranks):
    w = random_bf16(rng, shape)
    ad = loha(rng, *shape, ranks)
    assert_same(ltx2blas.fuse_loras(w, [ad]), reference.fuse_loras(w, [ad]))


def mixed(rng, rows, cols):
    """A LoRA, a LoHa, a difference and two LoKrs, in that order."""
    return [lora(rng, rows, cols), loha(rng, rows, cols),
            (random_bf16(rng, (rows, cols), 0.01), -0.7),
            lokr(rng, rows, cols, 4, 8, (None, 3)), lokr(rng, rows, cols, 2, 4, (3, None), -1.3)]


@pytest.mark.parametrize("rule", ["addmm", "sum"])
@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4], [1, 0], [3, 1, 4], [4, 2, 0, 1], [1, 1]])
def test_several_adapters_of_mixed_kinds_by_each_rule(rng, rule, order):
    """As a later addmm term a LoKr or LoHa adds f32(c * its product), unrounded; first, or
    under the sum rule, its bf16 delta."""
    w = random_bf16(rng, (128, 192))
    pool = mixed(rng, 128, 192)
    adapters = [pool[i] for i in order]
    assert_same(ltx2blas.fuse_loras(w, adapters, rule=rule),
                reference.fuse_loras(w, adapters, rule=rule))


def test_the_rules_differ_for_these_kinds(rng):
    w = random_bf16(rng, (128, 192))
    adapters = mixed(rng, 128, 192)[1:]
    assert not np.array_equal(ltx2blas.fuse_loras(w, adapters, rule="addmm"),
                              ltx2blas.fuse_loras(w, adapters, rule="sum"))


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("tile", [(7, 16), (64, 96), None])
def test_threads_and_tiles_do_not_change_bytes(rng, threads, tile):
    w = random_bf16(rng, (130, 200))
    adapters = [loha(rng, 130, 200), lokr(rng, 130, 200, 13, 8, (None, 3)), lora(rng, 130, 200)]
    want = reference.fuse_loras(w, adapters)
    assert_same(ltx2blas.fuse_loras(w, adapters, threads=threads, tile=tile), want)


@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_every_kernel_table(kernel_table, rng, rule):
    w = random_bf16(rng, (96, 160))
    adapters = mixed(rng, 96, 160)
    for kept in ([1], [3], adapters):
        items = [adapters[i] for i in kept] if kept != adapters else adapters
        assert_same(ltx2blas.fuse_loras(w, items, rule=rule),
                    reference.fuse_loras(w, items, rule=rule))


def test_loha_pairs_on_the_dot_product_kernel(pairs_table, rng):
    """A LoHa's two pairs each take the dot-product kernel where their magnitudes allow it
    (never the one-pass fused route, which is a single LoRA's)."""
    w = random_bf16(rng, (96, 160))
    ad = loha(rng, 96, 160, (32, 7))
    route = fuse._choose_route(fuse.adapters_for([ad], 96, 160), "bf16", "addmm", False)
    assert route.pairs == [True, True] and not route.fused_pairs
    assert_same(ltx2blas.fuse_loras(w, [ad]), reference.fuse_loras(w, [ad]))
    both = [lora(rng, 96, 160), ad]
    assert_same(ltx2blas.fuse_loras(w, both), reference.fuse_loras(w, both))


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("kinds", [[1], [3], [0, 1, 4]])
def test_fp8_weights(rng, fmt, kinds):
    w = rng.integers(0, 256, (96, 160), dtype=np.uint8)
    w[(w & 0x7F) >= (0x7F if fmt == "F8_E4M3" else 0x7C)] = 0   # finite codes
    pool = mixed(rng, 96, 160)
    adapters = [pool[i] for i in kinds]
    assert_same(ltx2blas.fuse_loras(w, adapters, weight_format=fmt),
                reference.fuse_loras_fp8(w, adapters, fmt))


@pytest.mark.parametrize("layout, fmt", [("fp8_scaled", "F8_E4M3"), ("comfy_int8", None),
                                         ("nvfp4", None)])
def test_scaled_and_quantised_layouts(rng, layout, fmt):
    """The layouts add the adapters' aggregate delta, whatever the kinds."""
    from test_quantized import COLS, ROWS, case, same  # the layouts' own test data

    weight, scales, kwargs = case(rng, layout, fmt or "F8_E4M3")
    adapters = [loha(rng, ROWS, COLS, magnitude=0.05),
                lokr(rng, ROWS, COLS, 4, 8, (None, 3), magnitude=0.05), lora(rng, ROWS, COLS)]
    for rule in ("addmm", "sum"):
        want = reference.fuse_quantized(layout, weight, scales, adapters, rule, fmt or "F8_E4M3")
        same(ltx2blas.fuse_quantized(layout, weight, adapters, rule=rule, **kwargs), want)


def test_the_bare_delta(rng):
    adapters = mixed(rng, 72, 96)
    assert_same(fuse.aggregate_delta(72, 96, adapters),
                reference.aggregate_delta(adapters))


@pytest.mark.parametrize("shape, rank", [((6, 5), 8), ((64, 96), 1), ((40, 33), 384),
                                         ((17, 100), 130)])
def test_a_low_rank_factor_is_the_textbook_product(rng, shape, rank):
    a, b = random_bf16(rng, (rank, shape[1])), random_bf16(rng, (shape[0], rank))
    got = fuse.pair_product(a, b)
    assert got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), reference.lora_product(a, b).view(np.uint32))


def test_a_loha_rank_past_one_pass(rng):
    """Past PASS_DEPTH terms a pair's product runs in passes, as a LoRA's does."""
    rank = fuse._fuse.PASS_DEPTH + 5
    w = random_bf16(rng, (9, 20))
    ad = loha(rng, 9, 20, (rank, 3), magnitude=0.05)
    assert_same(ltx2blas.fuse_loras(w, [ad]), reference.fuse_loras(w, [ad]))


def test_products_outside_the_normal_range_stay_exact(rng):
    """Pairs whose products may be subnormal take the strict table (no contraction)."""
    w = random_bf16(rng, (64, 80))
    tiny = loha(rng, 64, 80, (16, 16), scale=2.0**100, magnitude=2.0**-64)
    route = fuse._choose_route(fuse.adapters_for([tiny], 64, 80), "bf16", "addmm", False)
    assert not route.fma
    both = [tiny, lora(rng, 64, 80)]
    assert_same(ltx2blas.fuse_loras(w, both), reference.fuse_loras(w, both))


def test_non_finite_values_propagate_like_the_reference(rng):
    w = random_bf16(rng, (32, 48))
    ad = loha(rng, 32, 48)
    ad.w2_b[1, 5] = 0x7FC0                      # NaN
    kr = lokr(rng, 32, 48, 4, 4, (None, None))
    kr.w1[0, 0] = 0x7F80                        # inf
    for items in ([ad], [kr], [kr, ad]):
        got, want = ltx2blas.fuse_loras(w, items), reference.fuse_loras(w, items)
        nan_g, nan_w = np.isnan(reference.bf16_widen(got)), np.isnan(reference.bf16_widen(want))
        assert np.array_equal(nan_g, nan_w)
        assert_same(got[~nan_g], want[~nan_w])


def test_check_finite_names_the_adapter_and_tensor(rng):
    w = random_bf16(rng, (32, 48))
    before = w.copy()
    ad = loha(rng, 32, 48)
    ad.w1_b[2, 3] = 0x7F80
    with pytest.raises(NonFiniteInputError, match=r"adapter 1 w1_b is non-finite at \(2, 3\)"):
        ltx2blas.fuse_loras(w, [lora(rng, 32, 48), ad], check_finite=True, out=w)
    kr = lokr(rng, 32, 48, 4, 4, (None, 2))
    kr.w2[0][1, 1] = 0x7FC0
    with pytest.raises(NonFiniteInputError, match=r"adapter 0 w2_a is non-finite at \(1, 1\)"):
        ltx2blas.fuse_loras(w, [kr], check_finite=True, out=w)
    assert np.array_equal(w, before)


def test_an_overflowing_product_is_refused_before_anything_is_written(rng):
    w = random_bf16(rng, (32, 48))
    before = w.copy()
    big = loha(rng, 32, 48, (4, 4), scale=1.0, magnitude=2.0**40)
    with pytest.raises(NonFiniteResultError, match="overflows bf16"):
        ltx2blas.fuse_loras(w, [big], check_finite=True, out=w)
    assert np.array_equal(w, before)


def test_malformed_adapters_are_refused(rng):
    w = random_bf16(rng, (32, 48))
    good = loha(rng, 32, 48)
    cases = [
        (LoKr(random_bf16(rng, (4, 8)), random_bf16(rng, (3, 6)), 1.0), ShapeError,
         r"Kronecker product of w1 \[4, 8\] and w2 \[3, 6\] is \[12, 48\], the weight \[32, 48\]"),
        (good._replace(w1_b=random_bf16(rng, (5, 48))), ShapeError,
         "ranks disagree: w1_a has 8 columns, w1_b 5 rows"),
        (good._replace(w2_a=random_bf16(rng, (31, 4))), ShapeError,
         r"w2_a @ w2_b is \[31, 48\], the weight \[32, 48\]"),
        (good._replace(w1_a=random_bf16(rng, (32, 0)), w1_b=random_bf16(rng, (0, 48))),
         ShapeError, "rank 0"),
        (LoKr((random_bf16(rng, (4, 2)),), random_bf16(rng, (8, 6)), 1.0), ArgumentTypeError,
         "an array or a pair"),
        (LoKr(random_bf16(rng, (4, 8, 1)), random_bf16(rng, (8, 6)), 1.0), ShapeError, "2-D"),
        (good._replace(w1_a=random_bf16(rng, (8, 32)).T), LayoutError, "C-contiguous"),
        (good._replace(scale=float("nan")), Exception, "scale"),
    ]
    for ad, error, message in cases:
        with pytest.raises(error, match=message):
            ltx2blas.fuse_loras(w, [ad])


def test_routes_name_the_kinds(rng):
    prepared = fuse.adapters_for([lokr(rng, 64, 64, 8, 8), loha(rng, 64, 64, (32, 7))], 64, 64)
    fuse._lokr_factors(prepared, 1)
    route = fuse._choose_route(prepared, "bf16", "addmm", False)
    w = random_bf16(rng, (64, 64))
    names = fuse._plan(w, w.copy(), "bf16", prepared, route, fuse.Tile(64, 64), 1).routes()
    assert names[0] == "Kronecker" and len(names) == 3


def test_a_quantised_layout_names_a_non_finite_input_of_any_kind(rng):
    from test_quantized import case

    weight, _, kwargs = case(rng, "fp8_scaled")
    rows, cols = weight.shape
    diff = random_bf16(rng, (rows, cols), 0.01)
    diff[3, 4] = 0x7F80
    with pytest.raises(NonFiniteInputError, match=r"adapter 1 diff is non-finite at \(3, 4\)"):
        ltx2blas.fuse_quantized("fp8_scaled", weight, [lora(rng, rows, cols), (diff, 0.5)],
                                **kwargs)
    ad = loha(rng, rows, cols)
    ad.w2_a[7, 1] = 0xFFC0
    with pytest.raises(NonFiniteInputError, match=r"adapter 0 w2_a is non-finite at \(7, 1\)"):
        ltx2blas.fuse_quantized("fp8_scaled", weight, [ad], **kwargs)
