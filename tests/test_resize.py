"""resize_lora_weight: the optimum of Eckart and Young from the factors alone, checked against
an f64 SVD of the formed delta in the test; kohya-ss's dynamic rank rules restated from its
resize_lora.py; the same bytes on any thread count; bad inputs refused."""
import numpy as np
import pytest

from ltx2blas.errors import ArgumentError, NonFiniteInputError, ShapeError
from ltx2blas.resize import lowrank_svd, rank_rule, resize_lora_weight


def lora(rng, out, inn, r, decay=None):
    """Factors of a rank-r product, with singular values decaying as ``decay`` ** i when given
    (a trained LoRA's spectrum falls off; a random one's is flat)."""
    a = rng.standard_normal((r, inn)) * 0.05
    b = rng.standard_normal((out, r)) * 0.05
    if decay is not None:
        b = b * decay ** np.arange(r)
    return a.astype(np.float32), b.astype(np.float32)


def optimum(delta, k):
    s = np.linalg.svd(delta, compute_uv=False)
    return float(np.sqrt(np.sum(s[k:] ** 2))), s


@pytest.mark.parametrize("shape", [(512, 384, 32), (256, 1024, 64), (96, 80, 128)],
                         ids=["512x384-r32", "256x1024-r64", "96x80-r128"])
def test_each_rank_is_the_optimum(shape, rng):
    """||delta - B'A'||_F against sqrt(sum of the squared singular values past k) of an f64 SVD
    of the formed delta: within 1e-9 relative with f64 arithmetic throughout, bounded by the
    f32 factors' rounding (k (out + in) elements of relative error 2^-24, against the
    optimum's size) with f32 storage."""
    out, inn, r = shape
    a, b = lora(rng, out, inn, r, decay=0.93)
    scale = 0.75
    delta = scale * (b.astype(np.float64) @ a.astype(np.float64))
    full = min(r, out, inn)
    for k in sorted({1, 2, full // 3, full - 1, full}):
        z = resize_lora_weight(a, b, scale=scale, rank=k, dtype="f32")
        assert z.rank == k and z.lora_a.shape == (k, inn) and z.lora_b.shape == (out, k)
        best, s = optimum(delta, k)
        got = np.linalg.norm(delta - z.lora_b.astype(np.float64) @ z.lora_a.astype(np.float64))
        # f32 factors: each product element is off by at most about 2^-23 times the sum of
        # |b_ij a_jl|, which sum to at most ||delta_k||-sized terms: 1e-6 of ||delta|| is ample
        assert got <= 1.001 * best + 1e-6 * np.linalg.norm(delta), (k, got, best)
        np.testing.assert_allclose(z.singular_values[:full], s[:full], rtol=1e-10,
                                   atol=1e-12 * s[0])
        assert z.kept == pytest.approx(np.sqrt(np.sum(s[:k] ** 2) / np.sum(s ** 2)), rel=1e-12)
    u, sv, v = lowrank_svd(a, b, scale)
    np.testing.assert_allclose(u @ np.diag(sv) @ v.T, delta, atol=1e-12 * sv[0])
    np.testing.assert_allclose(u.T @ u, np.eye(len(sv)), atol=1e-12)
    np.testing.assert_allclose(v.T @ v, np.eye(len(sv)), atol=1e-12)


def kohya_index(s, rule, target):
    """kohya-ss networks/resize_lora.py (index_sv_ratio, index_sv_fro, index_sv_cumulative,
    then rank_resize's + 1), restated line by line on all min(out, in) singular values."""
    if rule == "sv_ratio":
        index = int(np.sum(s > s[0] / target))
    elif rule == "sv_cumulative":
        cumulative = np.cumsum(s) / float(np.sum(s))
        index = int(np.searchsorted(cumulative, target)) + 1
    else:
        cumulative = np.cumsum(s ** 2) / float(np.sum(s ** 2))
        index = int(np.searchsorted(cumulative, target ** 2)) + 1
    index = max(1, min(index, len(s) - 1))
    return index + 1


@pytest.mark.parametrize("rule,targets", [("sv_ratio", (1.0, 2.0, 10.0, 1e6)),
                                          ("sv_fro", (0.1, 0.5, 0.9, 0.99, 1.0)),
                                          ("sv_cumulative", (0.1, 0.5, 0.9, 1.0))])
def test_kohyas_dynamic_rules(rule, targets, rng):
    """The rank of each dynamic rule is kohya's on the full spectrum (the values past the
    LoRA's rank are zero there), capped by max_rank and by the product's rank; ``energy`` is
    the least rank keeping the fraction of the norm."""
    a, b = lora(rng, 200, 150, 24, decay=0.8)
    delta = b.astype(np.float64) @ a.astype(np.float64)
    s_full = np.linalg.svd(delta, compute_uv=False)
    s_full[24:] = 0.0  # the f64 SVD's rounding noise past the rank: zero in exact arithmetic
    for target in targets:
        z = resize_lora_weight(a, b, **{rule: target})
        assert z.rank == min(kohya_index(s_full, rule, target), 24), target
        capped = resize_lora_weight(a, b, max_rank=3, **{rule: target})
        assert capped.rank == min(z.rank, 3)
    for fraction in (0.3, 0.9, 0.999):
        z = resize_lora_weight(a, b, energy=fraction)
        kept = np.sqrt(np.cumsum(s_full ** 2) / np.sum(s_full ** 2))
        assert z.rank == int(np.flatnonzero(kept >= fraction)[0]) + 1


def test_a_zero_delta(rng):
    """kohya gives a zero delta rank 1; a fixed rank is kept, its factors zero."""
    a = np.zeros((8, 32), np.float32)
    b = rng.standard_normal((16, 8)).astype(np.float32)
    assert resize_lora_weight(a, b, sv_fro=0.9).rank == 1
    z = resize_lora_weight(a, b, rank=4)
    assert z.rank == 4 and not z.lora_a.any() and not z.lora_b.any() and z.kept == 1.0


def test_the_same_bytes_for_any_thread_count(rng):
    """The QR, the SVD and the products run on one BLAS thread whatever the caller's limits,
    the two QR factorisations side by side with ``threads`` >= 2."""
    from threadpoolctl import threadpool_limits

    a, b = lora(rng, 640, 512, 48, decay=0.95)
    first = resize_lora_weight(a, b, rank=16)
    for n in (1, 2, 4):
        with threadpool_limits(n):
            again = resize_lora_weight(a, b, rank=16)
        assert again.lora_a.tobytes() == first.lora_a.tobytes()
        assert again.lora_b.tobytes() == first.lora_b.tobytes()
        again = resize_lora_weight(a, b, rank=16, threads=n)  # the QRs side by side from 2
        assert again.lora_a.tobytes() == first.lora_a.tobytes()
        assert again.lora_b.tobytes() == first.lora_b.tobytes()


def test_refusals(rng):
    a, b = lora(rng, 64, 48, 8)
    with pytest.raises(ShapeError, match="larger than the LoRA's product allows"):
        resize_lora_weight(a, b, rank=9)
    with pytest.raises(ShapeError, match="has rank 8 but lora_b"):
        resize_lora_weight(a, b[:, :7], rank=2)
    with pytest.raises(ArgumentError, match="give one of"):
        resize_lora_weight(a, b)
    with pytest.raises(ArgumentError, match="give one of"):
        resize_lora_weight(a, b, rank=2, energy=0.5)
    for bad in ({"rank": 0}, {"rank": 2.5}, {"energy": 0.0}, {"sv_fro": 1.5},
                {"sv_ratio": 0.5}, {"sv_cumulative": -1}):
        with pytest.raises(ArgumentError):
            resize_lora_weight(a, b, **bad)
    nan = a.copy()
    nan[3, 4] = np.nan
    with pytest.raises(NonFiniteInputError, match=r"\(3, 4\)"):
        resize_lora_weight(nan, b, rank=2)
    with pytest.raises(ArgumentError):
        rank_rule(energy=0.5, max_rank=0)
