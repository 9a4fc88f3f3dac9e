"""The contract: fuse_lora / fuse_loras are byte-identical to ltx2blas.reference, the textbook
loop of docs/arithmetic.md §1, for every rank, shape, strength, thread count, tile size and kernel table."""
import numpy as np
import pytest

import ltx2blas
import _ltx2blas_hooks as hooks
from ltx2blas import _gemm, _probe, reference
from ltx2blas import fuse as fuse_module
from ltx2blas._threads import blas_single_threaded

from helpers import random_bf16

# 128 and 129: the last rank the sequential fused kernels take alone, the first through sgemm
# (up to 128, where the CPU has one, the dot-product fuse on ordinary inputs)
RANKS = [1, 7, 32, 128, 129, 384, 450, 512, 1024, 1500]
SHAPES = [(1, 1), (7, 13), (97, 101), (16, 700), (700, 16), (333, 777)]


def adapter(rng, rows, cols, rank, scale=0.01):
    return random_bf16(rng, (rank, cols), scale), random_bf16(rng, (rows, rank), scale)


def textbook_product(x, y):
    """x @ y for f32 x [m, k] and y [k, n], each element from +0.0 in the order p = 0, 1, ...
    (mul, then add), as f32."""
    acc = np.zeros((x.shape[0], y.shape[1]), np.float32)
    for p in range(x.shape[1]):
        acc = acc + x[:, p:p + 1] * y[p:p + 1, :]
    return acc


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fuse_lora_matches_reference(rng, shape, rank):
    rows, cols = shape
    weight = random_bf16(rng, shape, 0.02)
    lora_a, lora_b = adapter(rng, rows, cols, rank)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8)
    assert got.dtype == np.uint16 and got.shape == shape
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.8))


@pytest.mark.parametrize("strength", [0.8, -1.25, 0.0, 1.0, 3.0, -0.0, 1e-3, 7])
def test_strengths(rng, strength):
    weight = random_bf16(rng, (61, 130), 0.02)
    lora_a, lora_b = adapter(rng, 61, 130, 450)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, strength)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, strength))


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("tile", [(7, 16), (64, 96), None])
def test_threads_and_tiles_do_not_change_bytes(rng, threads, tile):
    weight = random_bf16(rng, (203, 517), 0.02)
    lora_a, lora_b = adapter(rng, 203, 517, 460)
    expected = reference.fuse_lora(weight, lora_a, lora_b, 0.8)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads, tile=tile)
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("rank", [5, 128, 384, 600])
def test_every_kernel_table(kernel_table, rng, rank):
    weight = random_bf16(rng, (45, 300), 0.02)
    lora_a, lora_b = adapter(rng, 45, 300, rank)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, -0.7, threads=2, tile=(16, 64))
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, -0.7))


@pytest.mark.parametrize("shape", [(13, 29), (8, 64), (1, 33), (70, 1)])
def test_sequential_kernel_alone(kernel_table, rng, shape):
    """The kernel that carries the terms sgemm cannot: c + x @ y, each element in k order."""
    m, n = shape
    k = 300
    x = reference.bf16_widen(random_bf16(rng, (m, k)))
    y = reference.bf16_widen(random_bf16(rng, (k, n)))
    c0 = reference.bf16_widen(random_bf16(rng, (m, n)))
    expected = c0.copy()
    for p in range(k):
        expected = expected + x[:, p:p + 1] * y[p:p + 1, :]
    c = c0.copy()
    hooks.seq_gemm(x, y, c, kernel_table)
    assert np.array_equal(c.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("shape", [(13, 29), (8, 64), (1, 33), (70, 1), (17, 100), (9, 48),
                                   (5, 16), (3, 16)])
@pytest.mark.parametrize("k", [1, 31, 130])
def test_fused_kernel_alone(kernel_table, rng, shape, k):
    """The kernel that fuses small ranks in one pass: bf16(w + bf16(x @ y)), the product
    accumulated from +0.0 in k order, for tiles with and without row and column remainders
    (every height of a last row block from 1 to 5, and whole strips of columns only)."""
    m, n = shape
    x = reference.bf16_widen(random_bf16(rng, (m, k)))
    y = reference.bf16_widen(random_bf16(rng, (k, n)))
    w = random_bf16(rng, (m, n))
    acc = textbook_product(x, y)
    expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
        reference.bf16_round(acc)))
    assert np.array_equal(hooks.seq_fuse_bf16(x, y, w, kernel_table), expected)


@pytest.mark.parametrize("shape", [(13, 29), (8, 64), (1, 33), (70, 1), (17, 100), (9, 48),
                                   (5, 16), (3, 16)])
@pytest.mark.parametrize("k", [0, 1, 31, 130])
def test_product_kernel_alone(kernel_table, rng, shape, k):
    """The one-pass kernel's product alone, stored for a later rounding (several adapters, fp8
    weights): x @ y accumulated from +0.0 in k order, in column order, bit for bit, and
    nothing written past each row of the tile."""
    m, n = shape
    x = reference.bf16_widen(random_bf16(rng, (m, k)))
    y = reference.bf16_widen(random_bf16(rng, (k, n)))
    acc = textbook_product(x, y)
    got = hooks.seq_product_panel(x, y, kernel_table)
    assert np.array_equal(got[:, :n].view(np.uint32), acc.view(np.uint32))
    assert np.all(np.isnan(got[:, n:]))


@pytest.mark.parametrize("shape", [(13, 29), (8, 64), (1, 33), (70, 1), (17, 100)])
@pytest.mark.parametrize("k", [1, 2, 31, 32, 130, 384, 451])
def test_pairs_kernel_alone(pairs_table, rng, shape, k):
    """The dot-product fuse (two terms per instruction) against the textbook loop, for odd and
    even depths and tiles with row and column remainders, on inputs its guard admits."""
    m, n = shape
    x, y = random_bf16(rng, (m, k)), random_bf16(rng, (k, n))
    w = rng.integers(0, 65536, size=(m, n), dtype=np.uint16)  # every kind, NaN and inf too
    xf, yf = reference.bf16_widen(x), reference.bf16_widen(y)
    acc = textbook_product(xf, yf)
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference.bf16_round(reference.bf16_widen(w) + reference.bf16_widen(
            reference.bf16_round(acc)))
    assert np.array_equal(hooks.dot_fuse_bf16(x, y, w, pairs_table), expected)


@pytest.mark.parametrize("shape", [(13, 29), (8, 64), (1, 33), (70, 1), (17, 100)])
@pytest.mark.parametrize("k", [1, 2, 31, 130, 451])
def test_pairs_product_alone(pairs_table, rng, shape, k):
    """The dot-product kernel's product alone (several adapters, fp8 weights, a bare delta)
    against the textbook loop, bit for bit, and nothing written past each row of c."""
    m, n = shape
    x, y = random_bf16(rng, (m, k)), random_bf16(rng, (k, n))
    xf, yf = reference.bf16_widen(x), reference.bf16_widen(y)
    acc = textbook_product(xf, yf)
    got = hooks.dot_product_bf16(x, y, pairs_table)
    assert np.array_equal(got[:, :n].view(np.uint32), acc.view(np.uint32))
    assert np.all(np.isnan(got[:, n:]))


def _recording_fuse_plans(monkeypatch):
    """The plans the fuses make (their decided routes, as run)."""
    from ltx2blas import _fuse

    seen = []

    class Recording(_fuse.FusePlan):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(_fuse, "FusePlan", Recording)
    return seen


@pytest.mark.parametrize("rank", [32, 384, 450, 1500])
def test_pairs_route_is_taken_for_ordinary_adapters(rng, monkeypatch, rank):
    """An adapter of ordinary magnitudes goes to the dot-product fuse at every rank where the
    CPU has one, and no sgemm depth is probed for it; the same bytes as the reference either
    way, on edge tiles and two threads."""
    seen = _recording_fuse_plans(monkeypatch)
    weight = random_bf16(rng, (70, 100), 0.02)
    lora_a, lora_b = adapter(rng, 70, 100, rank)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=2, tile=(32, 64))
    assert [plan.pairs for plan in seen] == [[fuse_module.dot_fuse_chosen()]]
    if fuse_module.dot_fuse_chosen():
        assert not seen[0].depths.any()
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.8))


@pytest.mark.parametrize("rule", ["addmm", "sum"])
@pytest.mark.parametrize("ranks", [[32, 384], [450, 7, 1500]])
def test_pairs_serve_every_adapter_of_several(rng, monkeypatch, rule, ranks):
    """Several adapters: each LoRA of ordinary magnitudes has its product from the dot-product
    kernel where the CPU has one (no sgemm probe for it), the bytes the reference's, on edge
    tiles and two threads; a LoRA whose sums could be subnormal keeps the f32 kernels beside
    them."""
    seen = _recording_fuse_plans(monkeypatch)
    weight = random_bf16(rng, (70, 100), 0.02)
    items = [(*adapter(rng, 70, 100, r), s) for r, s in zip(ranks, (0.8, -1.5, 0.3))]
    # |products| in [2**-118, 2**-116): normal, so exact in f32, but their sums are multiples
    # of 2**-132 and may be subnormal, which the instruction would flush
    tiny = [reference.bf16_round(np.float32(2.0**-59) * rng.uniform(1, 2, size).astype(
        np.float32) * rng.choice(np.float32([-1, 1]), size)) for size in ((5, 100), (70, 5))]
    items.insert(1, (*tiny, 1.0))
    got = ltx2blas.fuse_loras(weight, items, rule=rule, threads=2, tile=(32, 64))
    assert np.array_equal(got, reference.fuse_loras(weight, items, rule))
    paired = fuse_module.dot_fuse_chosen()
    assert seen[0].pairs == [paired, False] + [paired] * (len(ranks) - 1)
    if paired:
        assert not seen[0].depths[[i for i, p in enumerate(seen[0].pairs) if p]].any()


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
@pytest.mark.parametrize("rank", [32, 450])
def test_pairs_serve_fp8_weights(rng, monkeypatch, fmt, rank):
    """An fp8 weight: the adapter's product from the dot-product kernel where the CPU has one,
    then the fp8 rounding, the reference's bytes."""
    seen = _recording_fuse_plans(monkeypatch)
    codes = rng.integers(0, 256, size=(70, 100), dtype=np.uint8)
    codes[(codes & 0x7F) >= (0x7F if fmt == "F8_E4M3" else 0x7C)] = 0x10  # finite codes
    lora_a, lora_b = adapter(rng, 70, 100, rank)
    items = [(lora_a, lora_b, 0.8)]
    got = ltx2blas.fuse_loras(codes, items, weight_format=fmt, threads=2, tile=(32, 64))
    assert np.array_equal(got, reference.fuse_loras_fp8(codes, items, fmt))
    assert seen[0].pairs == [fuse_module.dot_fuse_chosen()]


def test_pairs_serve_the_bare_delta(rng, monkeypatch):
    """The bare delta (DoRA and the quantised layouts start from it) from the dot-product
    kernel where the CPU has one, the reference's bytes."""
    from ltx2blas.fuse import aggregate_delta

    seen = _recording_fuse_plans(monkeypatch)
    items = [(*adapter(rng, 70, 100, 384), 0.8), (*adapter(rng, 70, 100, 32), -1.5)]
    for rule in ("addmm", "sum"):
        got = aggregate_delta(70, 100, items, rule=rule, threads=2, tile=(32, 64))
        assert np.array_equal(got, reference.aggregate_delta(items, rule))
    assert [plan.pairs for plan in seen] == [[fuse_module.dot_fuse_chosen()] * 2] * 2


def test_pairs_guard():
    from ltx2blas import _fuse
    from ltx2blas.fuse import _pairs_exact

    assert _pairs_exact(32, 1e-3, 1e-4, 1.0)
    assert _pairs_exact(128, 0.0, 1e-30, 1.0)                # B all zero: only zeros are added
    assert _pairs_exact(_fuse.PASS_DEPTH, 1e-3, 1e-4, 1.0)   # the rank does not matter
    assert not _pairs_exact(_fuse.PASS_DEPTH + 1, 1e-3, 1e-4, 1.0)  # past one pass: passes
    assert not _pairs_exact(32, 2.0**-127, 1.0, 1.0)         # a subnormal input
    assert not _pairs_exact(32, 2.0**-60, 2.0**-55, 1.0)     # sums could be subnormal
    assert _pairs_exact(32, 2.0**-55, 2.0**-55, 1.0)
    assert not _pairs_exact(32, 1.0, 1.0, 2.0**127)          # sums could reach inf


def test_subnormal_partial_sums_stay_exact():
    """Two normal products whose sum is subnormal: the textbook loop keeps it, the dot-product
    instruction would flush it to zero, so the guard sends this adapter the FMA way."""
    e = reference.bf16_round(np.float32([1.5 * 2.0**-63, -1.25 * 2.0**-63, 2.0**-63]))
    lora_b = e[None, :2].copy()                          # [1, 2]: bf16(B * 1.0) = B
    lora_a = np.full((2, 32), e[2], np.uint16)           # 32 columns: one whole vector
    weight = np.zeros((1, 32), np.uint16)
    expected = reference.fuse_lora(weight, lora_a, lora_b, 1.0)
    assert np.all(expected == 0x0020)                    # bf16(2**-128): subnormal, kept
    assert np.array_equal(ltx2blas.fuse_lora(weight, lora_a, lora_b, 1.0), expected)
    if _gemm.kernel_name() == "avx512bf16":
        flushed = hooks.dot_fuse_bf16(lora_b, lora_a, weight)
        assert np.all(flushed == 0x0000)                 # what the unguarded instruction gives
    elif _gemm.kernel_name() == "neon_bf16":   # BFMLALT/B flush only under FPCR.FZ, unset
        assert np.array_equal(hooks.dot_fuse_bf16(lora_b, lora_a, weight), expected)


def test_small_ranks_never_call_sgemm():
    """Up to SEQUENTIAL_DEPTH the product is the sequential kernel's alone: no probe, depth 0;
    above it, the probed depth where it covers half the terms."""
    k = _probe.SEQUENTIAL_DEPTH
    assert _probe.blas_depth(256, 512, k, k, pin=blas_single_threaded) == 0
    assert (256, 512, k, k) not in _probe.probe_report()
    verified = _probe.verified_depth(64, 96, k + 1, k + 1, pin=blas_single_threaded)
    assert _probe.blas_depth(64, 96, k + 1, k + 1, pin=blas_single_threaded) == \
        (verified if verified >= _probe.BLAS_MIN_SHARE * (k + 1) else 0)
    assert (64, 96, k + 1, k + 1) in _probe.probe_report()


@pytest.mark.parametrize("verified, handed", [(130, 130), (65, 65), (64, 0), (7, 0), (0, 0)])
def test_sgemm_takes_a_product_only_where_it_is_exact_for_half_of_it(monkeypatch, verified,
                                                                     handed):
    """A BLAS exact for a few terms only (OpenBLAS's Haswell kernels: 7) is not called: the
    one-pass kernel takes every term."""
    monkeypatch.setattr(_probe, "verified_depth", lambda *args, **kw: verified)
    assert _probe.blas_depth(64, 96, 130, 130, pin=blas_single_threaded) == handed


def test_in_place_fuse(rng):
    weight = random_bf16(rng, (300, 520), 0.02)
    lora_a, lora_b = adapter(rng, 300, 520, 384)
    expected = reference.fuse_lora(weight, lora_a, lora_b, 0.8)
    result = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, out=weight)
    assert result is weight
    assert np.array_equal(weight, expected)


def test_out_argument(rng):
    weight = random_bf16(rng, (40, 50), 0.02)
    before = weight.copy()
    lora_a, lora_b = adapter(rng, 40, 50, 3)
    out = np.zeros_like(weight)
    result = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, out=out)
    assert result is out
    assert np.array_equal(out, reference.fuse_lora(weight, lora_a, lora_b, 0.8))
    assert np.array_equal(weight, before)


def test_ml_dtypes_kind_round_trips(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    weight = random_bf16(rng, (33, 70), 0.02)
    lora_a, lora_b = adapter(rng, 33, 70, 9)
    expected = reference.fuse_lora(weight, lora_a, lora_b, 0.5)
    got = ltx2blas.fuse_lora(weight.view(ml_dtypes.bfloat16), lora_a.view(ml_dtypes.bfloat16),
                             lora_b, 0.5)
    assert got.dtype == ml_dtypes.bfloat16
    assert np.array_equal(got.view(np.uint16), expected)
    got = ltx2blas.fuse_lora(weight, lora_a.view(ml_dtypes.bfloat16), lora_b, 0.5)
    assert got.dtype == np.uint16 and np.array_equal(got, expected)


@pytest.mark.parametrize("rule", ["addmm", "sum"])
@pytest.mark.parametrize("ranks", [[450], [16, 450], [1024, 7, 384], [32, 32]])
def test_fuse_loras_matches_reference(rng, ranks, rule):
    weight = random_bf16(rng, (150, 333), 0.02)
    adapters = [(*adapter(rng, 150, 333, r), s) for r, s in zip(ranks, [0.8, -1.0, 2.0])]
    expected = reference.fuse_loras(weight, adapters, rule)
    for threads in (1, 3):
        got = ltx2blas.fuse_loras(weight, adapters, rule=rule, threads=threads, tile=(64, 128))
        assert np.array_equal(got, expected)


def test_default_rule_is_addmm_and_the_rules_differ(rng):
    """The default is upstream's addmm; on ordinary adapters it differs from the sum rule in a
    few percent of the elements, so a swapped rule cannot pass for the other."""
    weight = random_bf16(rng, (128, 256), 0.02)
    adapters = [(*adapter(rng, 128, 256, 384), 0.8), (*adapter(rng, 128, 256, 32), 1.2)]
    addmm = reference.fuse_loras(weight, adapters, "addmm")
    summed = reference.fuse_loras(weight, adapters, "sum")
    assert 0.001 < np.mean(addmm != summed) < 0.2
    assert np.array_equal(ltx2blas.fuse_loras(weight, adapters), addmm)
    assert np.array_equal(ltx2blas.fuse_loras(weight, adapters, rule="sum"), summed)
    with pytest.raises(ValueError, match="rule"):
        ltx2blas.fuse_loras(weight, adapters, rule="stack")


@pytest.mark.parametrize("ranks", [[5, 600], [130, 7, 3]])
def test_addmm_every_kernel_table(kernel_table, rng, ranks):
    """The addmm product of later adapters: B unscaled, the f32 product scaled and added to the
    rounded aggregate without contraction, in every table (the fast ones build with FMA)."""
    weight = random_bf16(rng, (45, 300), 0.02)
    adapters = [(*adapter(rng, 45, 300, r), s) for r, s in zip(ranks, [-0.7, 1.3, 0.1])]
    got = ltx2blas.fuse_loras(weight, adapters, threads=2, tile=(16, 64))
    assert np.array_equal(got, reference.fuse_loras(weight, adapters, "addmm"))


def test_addmm_product_is_not_contracted(kernel_table):
    """addmm rounds s * acc to f32 before adding it to the aggregate; an FMA rounds once.  Here
    (found by search) the two give different bf16 results, in every lane and the tail of a
    35-wide row, so a table that contracted the pair would fail."""
    cols = 35
    weight = np.zeros((1, cols), np.uint16)
    adapters = [(np.full((1, cols), 0x3F80, np.uint16), np.array([[0xBFA5]], np.uint16), 1.0),
                (np.full((1, cols), 0x3FE8, np.uint16), np.array([[0x3F57]], np.uint16),
                 0.8468105792999268)]
    expected = reference.fuse_loras(weight, adapters, "addmm")
    assert np.all(expected == 0xB80C)  # one rounding of agg + s * acc would give 0xB80B
    got = ltx2blas.fuse_loras(weight, adapters, tile=(8, 32))
    assert np.array_equal(got, expected)


@pytest.mark.parametrize("rank", [1, 7, 32, 384])
def test_one_adapter_by_the_several_adapter_rules(rng, rank):
    """fuse_loras with one adapter takes the one-adapter routes; under the sum rule it clears
    -0.0 from each tile: that rule's bf16(W + bf16(0.0 + delta)) differs from fuse_lora's
    bf16(W + delta) exactly where W and delta are both -0.0 (there -0.0 against +0.0).  Under
    addmm one adapter is fuse_lora exactly."""
    rows, cols = 70, 300
    weight = random_bf16(rng, (rows, cols), 0.02)
    lora_a, lora_b = adapter(rng, rows, cols, rank)
    # bf16(B) = -2^-72 on rows 0-9 and A = 2^-73 on columns 0-99: there the sum is
    # -rank * 2^-145, below half the smallest bf16 subnormal (2^-134), so the delta is -0.0.
    lora_b[:10] = 0x9B80
    lora_a[:, :100] = 0x1B00
    weight[:10, :50] = 0x8000
    weight[:10, 50:60] = 0x0000
    one = reference.fuse_lora(weight, lora_a, lora_b, 1.0)
    expected = reference.fuse_loras(weight, [(lora_a, lora_b, 1.0)], "sum")
    assert np.array_equal(reference.fuse_loras(weight, [(lora_a, lora_b, 1.0)], "addmm"), one)
    assert np.all(one[:10, :50] == 0x8000) and np.all(expected[:10, :50] == 0x0000)
    assert np.array_equal(one[:, 50:], expected[:, 50:]) and np.array_equal(one[10:], expected[10:])
    for threads in (1, 2):
        got = ltx2blas.fuse_loras(weight, [(lora_a, lora_b, 1.0)], rule="sum", threads=threads,
                                  tile=(32, 64))
        assert np.array_equal(got, expected)
        got = ltx2blas.fuse_loras(weight, [(lora_a, lora_b, 1.0)], threads=threads, tile=(32, 64))
        assert np.array_equal(got, one)
        assert np.array_equal(ltx2blas.fuse_lora(weight, lora_a, lora_b, 1.0, threads=threads), one)


@pytest.mark.parametrize("rank", [32, 384])
def test_one_adapter_by_the_rule_takes_the_one_adapter_routes(rng, monkeypatch, rank):
    """Ordinary magnitudes: the one-adapter routes (the dot-product kernel where the CPU has
    it, else the one-pass kernel or sgemm), with the -0.0 pass; signed zeros in W come out as the
    reference's."""
    from ltx2blas import _fuse

    seen = _recording_fuse_plans(monkeypatch)
    weight = random_bf16(rng, (100, 140), 0.02)
    weight[::3, ::5] = 0x8000
    weight[1::3, ::7] = 0x0000
    lora_a, lora_b = adapter(rng, 100, 140, rank)
    lora_b[::4] = 0  # deltas of +0.0
    got = ltx2blas.fuse_loras(weight, [(lora_a, lora_b, 0.8)], rule="sum", threads=2)
    assert np.array_equal(got, reference.fuse_loras(weight, [(lora_a, lora_b, 0.8)], "sum"))
    rule, pairs, plus_zero = seen[0].rule, seen[0].pairs, seen[0].plus_zero
    assert (rule, plus_zero) == (_fuse.RULES["one"], True)
    assert pairs == [fuse_module.dot_fuse_chosen()]


def test_products_outside_the_normal_range_take_the_strict_path(rng):
    """Products that underflow are not exact in f32, so an FMA (and any BLAS) could round them
    differently from the textbook mul-then-add; such inputs are detected and computed strictly."""
    weight = random_bf16(rng, (30, 70), 1e-30)
    lora_a = random_bf16(rng, (40, 70), 1e-19)
    lora_b = random_bf16(rng, (30, 40), 1e-19)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 1.0)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 1.0))
    big_a = random_bf16(rng, (40, 70), 1e19)
    big_b = random_bf16(rng, (30, 40), 1e19)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = reference.fuse_lora(weight, big_a, big_b, 1.0)
    got = ltx2blas.fuse_lora(weight, big_a, big_b, 1.0)
    nan = np.isnan(reference.bf16_widen(expected))
    assert np.array_equal(got[~nan], expected[~nan])
    assert np.all(np.isnan(reference.bf16_widen(got[nan])))


def test_special_values_in_weight_propagate(rng):
    weight = random_bf16(rng, (24, 40), 0.02)
    weight[0, :6] = [0x7FC0, 0xFFC0, 0x7F80, 0xFF80, 0x8000, 0x0000]  # NaN, -NaN, inf, -inf, -0, 0
    weight[1, :3] = [0x0001, 0x8001, 0x7F7F]  # subnormals and the largest bf16
    lora_a, lora_b = adapter(rng, 24, 40, 450)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8)
    assert np.array_equal(got, reference.fuse_lora(weight, lora_a, lora_b, 0.8))


def test_non_finite_adapter_values_propagate_like_the_reference(rng):
    weight = random_bf16(rng, (24, 40), 0.02)
    lora_a, lora_b = adapter(rng, 24, 40, 20)
    lora_a[3, 5] = 0x7FC0  # NaN in A: column 5 of every row
    lora_b[7, 2] = 0x7F80  # inf in B: row 7 (inf * 0 -> NaN where A is 0)
    lora_a[2, 9] = 0x0000
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference.fuse_lora(weight, lora_a, lora_b, 0.8)
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8)
    nan = np.isnan(reference.bf16_widen(expected))
    assert np.array_equal(np.isnan(reference.bf16_widen(got)), nan)
    assert np.array_equal(got[~nan], expected[~nan])


@pytest.mark.parametrize("special", [(0x7F80, 0xFF80), (0x7FC0, 0x7FC0), None])  # inf, NaN
def test_rank_past_one_pass_with_non_finite_factors(rng, special):
    """A rank beyond one pass of the tile driver whose factors hold inf or NaN: sgemm is then
    not used at all (depth 0), and the product must still run in passes, not in the one-pass
    kernel, whose buffers hold one pass."""
    from ltx2blas import _fuse

    rank = _fuse.PASS_DEPTH + 100
    weight = random_bf16(rng, (16, 40), 0.02)
    lora_a, lora_b = random_bf16(rng, (rank, 40), 0.02), random_bf16(rng, (16, rank), 0.02)
    if special is not None:
        lora_a[rank - 3, 7] = special[0]  # in the second pass
        lora_b[2, 5] = special[1]
    got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=2)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf and inf * 0 in the oracle
        expected = reference.fuse_lora(weight, lora_a, lora_b, 0.8)
    assert got.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


@pytest.mark.parametrize("dot, fma, chosen", [(200.0, 110.0, True), (60.0, 95.0, False)])
def test_the_fuse_takes_the_faster_kernel_by_measured_rate(monkeypatch, dot, fma, chosen):
    """With the rates injected (as on AMD Zen, where VDPBF16PS runs at twice the FMA rate, and
    on Intel Xeon, where it runs at half), the fuse takes the dot-product kernel exactly where
    it measured faster, and the routes info reports follow."""
    from ltx2blas import fuse
    if not _gemm.has_pairs_kernel():
        pytest.skip(f"the {_gemm.kernel_name()} kernel table has no dot-product fuse")
    monkeypatch.setattr(_gemm, "fuse_rates", lambda: (dot, fma))
    monkeypatch.setattr(fuse, "_forced_fuse_kernel", None)   # as without LTX2BLAS_FUSE_KERNEL
    assert fuse.dot_fuse_chosen() is chosen
    assert (fuse.route_of(384) == "dot-product") is chosen
    assert (fuse.route_of(32) == "dot-product") is chosen
    fuse.use_fuse_kernel("dot" if not chosen else "fma")   # forcing overrides the rates
    assert fuse.dot_fuse_chosen() is not chosen


def test_fuse_rates_are_measured_once_and_forcing_is_checked(monkeypatch):
    from ltx2blas import fuse
    from ltx2blas.errors import ArgumentError
    monkeypatch.setattr(fuse, "_forced_fuse_kernel", None)
    rates = _gemm.fuse_rates()
    assert rates is _gemm.fuse_rates()                      # cached for the process
    assert rates[1] > 0 and (rates[0] > 0) == _gemm.has_pairs_kernel()
    with pytest.raises(ArgumentError, match="fuse kernel must be 'dot' or 'fma'"):
        fuse.use_fuse_kernel("avx")
    assert fuse.forced_fuse_kernel() is None
