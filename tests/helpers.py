"""Helpers shared by the tests (importable because conftest.py puts this folder on sys.path)."""
import numpy as np

from ltx2blas import reference


def random_bf16(rng, shape, scale=1.0):
    """Gaussian values rounded to bf16 bits by the reference rule."""
    return reference.bf16_round(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))


def torch_fp8_overflow(torch):
    """The F8_E4M3 overflow rule of the installed torch's cast (docs/arithmetic.md §2): up to
    2.12 a value past 448 became NaN; 2.13 saturates it (pytorch/pytorch#178817)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return "saturate" if (major, minor) >= (2, 13) else "nan"


TINY_F32 = 2.0**-126  # the smallest normal f32


def _flush(v):
    """Subnormal values to zero of their sign, as Arm's BF16 dot products treat them."""
    return np.where(np.abs(v) < TINY_F32, np.copysign(0.0, v), v)


def round_to_odd_f32(a, b):
    """f32 round-to-odd of the exact a + b (f64 arrays, each an exact value), then flushed: the
    truncation toward zero, its last bit set when the sum is not exact (Arm's FPRound with
    FPRounding_ODD). Written from IEEE steps: TwoSum gives the exact sum as s + e."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    r = s.astype(np.float32)                                   # nearest, then toward zero
    over = np.abs(r.astype(np.float64)) > np.abs(s)
    r = np.where(over, np.nextafter(r, np.float32(0)), r)
    on_r = r.astype(np.float64) == s
    # s is an f32 value: the exact sum lies beyond it (same sign as e) or short of it
    short = on_r & (e != 0) & (np.sign(e) != np.sign(s))
    r = np.where(short, np.nextafter(r, np.float32(0)), r)
    inexact = ~on_r | (e != 0)
    bits = r.view(np.uint32) | np.where(inexact, np.uint32(1), np.uint32(0))
    return _flush(bits.view(np.float32).astype(np.float64)).astype(np.float32)


def bfdot_step(acc, x0, w0, x1, w1):
    """One lane of Arm's BFDOT (docs/arithmetic.md, "Arm's BF16 instructions"): acc + (x0 w0 +
    x1 w1), the exact products' sum rounded to odd, then added rounded to odd; subnormal
    inputs, products, sums and results flushed. f32 arrays in, f32 out."""
    f = [_flush(np.asarray(v, np.float64)) for v in (acc, x0, w0, x1, w1)]
    pair = round_to_odd_f32(_flush(f[1] * f[2]), _flush(f[3] * f[4]))
    return round_to_odd_f32(f[0], pair.astype(np.float64))
