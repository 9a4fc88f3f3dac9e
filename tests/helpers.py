"""Helpers shared by the tests (importable because conftest.py puts this folder on sys.path)."""
import numpy as np

from ltx2blas import reference


def random_bf16(rng, shape, scale=1.0):
    """Gaussian values rounded to bf16 bits by the reference rule."""
    return reference.bf16_round(rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
