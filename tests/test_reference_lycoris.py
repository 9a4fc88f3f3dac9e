"""The LoKr and LoHa rules of docs/arithmetic.md §1, as ltx2blas.reference states them, against
an independent statement: products taken exactly in f64 (a product of two bf16 values, or of
two f32 values, fits in f64's 53 bits) and each rounding done once with ml_dtypes, where the
factors leave no order of additions to choose (whole factors, rank-1 pairs); and, where torch is
installed, against ComfyUI's own expressions in torch (comfy/weight_adapter/lokr.py, loha.py)."""
import numpy as np
import pytest

from ltx2blas import reference

from helpers import random_bf16

ml_dtypes = pytest.importorskip("ml_dtypes")


def f32_of_exact(x):
    """An exact f64 value rounded once to f32."""
    return np.asarray(x, np.float64).astype(np.float32)


def bf16_bits(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def widen(bits):
    return reference.bf16_widen(bits).astype(np.float64)


def test_the_scale_is_the_f64_expression_rounded_once():
    assert reference.lycoris_scale(0.8, 16.0, 6) == np.float32(0.8 * (16.0 / 6))
    assert reference.lycoris_scale(0.8) == np.float32(0.8)
    assert reference.lycoris_scale(0.8, None, 4) == np.float32(0.8)
    # not f32(s) * f32(alpha / dim): that rounds twice
    s, alpha, dim = 0.7, 3.0, 7
    assert reference.lycoris_scale(s, alpha, dim) == np.float32(s * (alpha / dim))


def test_lokr_with_a_whole_factor_and_a_rank_one_pair(rng):
    """1,048,576 elements: enough that rounding in another order (the scale into w1 first)
    changes some of them, which this test would see."""
    w1 = rng.standard_normal((16, 16)).astype(np.float32)         # stored whole, f32
    a, b = random_bf16(rng, (64, 1), 0.5), random_bf16(rng, (1, 64), 0.5)  # w2 = a @ b
    c = reference.lycoris_scale(0.7, 3.0, 7)
    got = reference.lokr_delta(reference.lokr_factor(whole=w1),
                               reference.lokr_factor(a=a, b=b), c)
    w2 = f32_of_exact(widen(a) @ widen(b))                       # one exact product each
    prod = f32_of_exact(np.kron(w1.astype(np.float64), w2.astype(np.float64)))
    want = bf16_bits(f32_of_exact(np.float64(c) * prod.astype(np.float64)))
    assert np.array_equal(got, want)
    scaled_first = f32_of_exact(np.kron(f32_of_exact(np.float64(c) * w1).astype(np.float64),
                                        w2.astype(np.float64)))
    assert not np.array_equal(bf16_bits(scaled_first), want)


def test_loha_with_rank_one_pairs(rng):
    w1_a, w1_b = random_bf16(rng, (512, 1), 0.5), random_bf16(rng, (1, 512), 0.5)
    w2_a, w2_b = random_bf16(rng, (512, 1), 0.5), random_bf16(rng, (1, 512), 0.5)
    c = reference.lycoris_scale(-1.25, 3.0, 7)
    got = reference.loha_delta(w1_a, w1_b, w2_a, w2_b, c)
    m1 = f32_of_exact(widen(w1_a) @ widen(w1_b))
    m2 = f32_of_exact(widen(w2_a) @ widen(w2_b))
    prod = f32_of_exact(m1.astype(np.float64) * m2.astype(np.float64))
    want = bf16_bits(f32_of_exact(np.float64(c) * prod.astype(np.float64)))
    assert np.array_equal(got, want)
    # the scale into m1 first rounds differently somewhere among these 262,144 elements
    scaled_first = f32_of_exact(f32_of_exact(np.float64(c) * m1).astype(np.float64)
                                * m2.astype(np.float64))
    assert not np.array_equal(bf16_bits(scaled_first), want)


def test_the_low_rank_products_take_the_textbook_order(rng):
    """At rank 8 the f32 sums have an order: the factor is lora_product's, term by term."""
    a, b = random_bf16(rng, (6, 8), 0.5), random_bf16(rng, (8, 5), 0.5)
    acc = np.zeros((6, 5), np.float32)
    for k in range(8):
        acc = acc + reference.bf16_widen(a[:, k])[:, None] * reference.bf16_widen(b[k])[None, :]
    assert np.array_equal(reference.lokr_factor(a=a, b=b), acc)


def test_comfyuis_expressions_in_torch_give_the_same_bytes(rng):
    """Whole factors and rank-1 pairs leave torch no order to choose: ComfyUI's
    ((strength * alpha) * diff).to(bf16) equals the rule byte for byte."""
    torch = pytest.importorskip("torch", reason="ComfyUI's expressions are written in torch")

    def t(bits):
        return torch.from_numpy(reference.bf16_widen(bits).copy())

    w1 = rng.standard_normal((3, 4)).astype(np.float32)
    a, b = random_bf16(rng, (8, 1), 0.5), random_bf16(rng, (1, 16), 0.5)
    strength, alpha, dim = 0.6, 4.0, 1
    diff = torch.kron(torch.from_numpy(w1), torch.mm(t(a), t(b)))
    comfy = ((strength * (alpha / dim)) * diff).to(torch.bfloat16).view(torch.int16).numpy()
    ours = reference.lokr_delta(w1, reference.lokr_factor(a=a, b=b),
                                reference.lycoris_scale(strength, alpha, dim))
    assert np.array_equal(ours, comfy.view(np.uint16))
    h = [random_bf16(rng, shape, 0.5) for shape in ((12, 1), (1, 10), (12, 1), (1, 10))]
    diff = torch.mm(t(h[0]), t(h[1])) * torch.mm(t(h[2]), t(h[3]))
    comfy = ((0.9 * (2.0 / 1)) * diff).to(torch.bfloat16).view(torch.int16).numpy()
    ours = reference.loha_delta(*h, reference.lycoris_scale(0.9, 2.0, 1))
    assert np.array_equal(ours, comfy.view(np.uint16))
