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
