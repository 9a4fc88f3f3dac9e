"""A LoRA from the difference of two weights: ``tuned - base ~ lora_B @ lora_A`` of a chosen
rank, by a randomized range finder (Halko, Martinsson and Tropp 2011, algorithm 4.4: a random
test matrix, power iterations with a fresh basis between them, then the SVD of a small matrix).

What is promised (docs/extract.md): the same bytes for any thread count; on another machine the
same bytes wherever its BLAS and LAPACK compute the same products (the same library build and
kernels).  The test matrix has +-1 entries from a seed and the tensor's name, the same
everywhere; the products with the difference go through the seam's sgemm in fixed blocks
(:mod:`ltx2blas._lowrank`); the factorisations between them (LU, CholeskyQR, the small Gram
matrix's eigenvectors) are LAPACK's on one thread and the seam's f64 BLAS calls in fixed blocks
of rows (docs/extract.md, "How").
"""
from typing import NamedTuple

import numpy as np

from . import _gemm, _lowrank, _quant
from ._threads import blas_single_threaded, resolve_threads
from ._validate import bf16_bits, bf16_to_f32, choice, contiguous, is_bf16, ndarray
from .errors import ArgumentError, DTypeError, NonFiniteInputError, NumericsError, ShapeError

__all__ = ["LowRank", "extract_lora_weight", "OVERSAMPLE", "POWER_ITERATIONS",
           "MAX_POWER_ITERATIONS", "DTYPES"]

#: Columns of the test matrix beyond the rank (at least; see range_width), and the power
#: iterations: Halko et al.'s usual oversampling, and the iterations that keep the error within
#: 2 % of the optimum on fine-tuning differences (docs/extract.md gives the measurement).
OVERSAMPLE = 10
POWER_ITERATIONS = 2
#: The most power iterations taken: each costs two more passes over the weight, and two already
#: keep the error within 2 % of the optimum (docs/extract.md); a bound keeps a mistyped count
#: from running for days.
MAX_POWER_ITERATIONS = 16
#: The products with D stay finite while sqrt(max(out, in)) * ||D||_F (which bounds every entry
#: of D X and Q^T D, with X of +-1 entries or orthonormal columns, and of their partial sums)
#: is at most 2^SAFE_EXPONENT, well inside f32's 2^128.  A larger difference (entries near f32's
#: limit) is scaled down by a power of two first: exact, and only then, so that any ordinary
#: difference is computed as before.
SAFE_EXPONENT = 120
#: The range finder's width is a multiple of this: the BLAS's register block of f32 columns
#: (16 on AVX-512), whose partial blocks run the products at two thirds of the rate.
WIDTH_STEP = 16


def range_width(rank, oversample=OVERSAMPLE, largest=None):
    """The range finder's columns for a rank: rank + the larger of ``oversample`` and a tenth
    of the rank (slow spectra need more at large ranks), rounded up to a multiple of
    WIDTH_STEP, at most ``largest`` (the weight's smaller side)."""
    width = rank + max(int(oversample), -(-rank // 10))
    width = -(-width // WIDTH_STEP) * WIDTH_STEP
    return width if largest is None else min(width, largest)
#: The factors' storage: bf16 (the default, what upstream's trainer writes) or f32.
DTYPES = ("bf16", "f32")


class LowRank(NamedTuple):
    """An extracted LoRA: ``lora_b @ lora_a`` approximates the difference."""
    lora_a: np.ndarray          # [rank, in]: sqrt(s) * V^T
    lora_b: np.ndarray          # [out, rank]: U * sqrt(s)
    rank: int
    kept: float                 # ||D_r||_F / ||D||_F, the fraction of the norm kept (1 for D = 0)
    norm: float                 # ||D||_F
    singular_values: np.ndarray  # the range finder's estimates, largest first (f64)

    @property
    def error(self):
        """||D - D_r||_F / ||D||_F, the truncation's relative error (before any rounding)."""
        return float(np.sqrt(max(0.0, 1.0 - self.kept ** 2)))


def _as_stored(x, name):
    """A 2-D C-contiguous array as the driver reads it: bf16 bits (uint16) or float32 (float16
    is widened, exactly)."""
    a = ndarray(x, name)
    if is_bf16(a.dtype):
        a = bf16_bits(a, name)
    elif a.dtype == np.float16:
        a = a.astype(np.float32)
    elif a.dtype != np.float32:
        raise DTypeError(f"{name} must be bf16, float16 or float32, got {a.dtype}")
    if a.ndim != 2:
        raise ShapeError(f"{name} must be 2-D [out, in], got shape {a.shape}")
    return contiguous(a, name)


def difference(tuned, base, threads=None):
    """(D, ||D||_F^2): ``D = f32(tuned) - f32(base)`` (one f32 subtraction an element) and its
    squared norm in f64: each row's in four interleaved partial sums (_lowrank.difference), the
    rows added in order."""
    t, b = _as_stored(tuned, "tuned"), _as_stored(base, "base")
    if t.shape != b.shape:
        raise ShapeError(f"tuned {list(t.shape)} and base {list(b.shape)} differ in shape")
    if t.dtype != b.dtype:  # one reads bf16 bits, the other f32 values: widen both
        t = t if t.dtype == np.float32 else bf16_to_f32(t)
        b = b if b.dtype == np.float32 else bf16_to_f32(b)
    d = np.empty(t.shape, np.float32)
    squares = np.empty(t.shape[0], np.float64)
    _lowrank.difference(t, b, d, squares, resolve_threads(threads))
    total = 0.0
    for v in squares:  # in row order, a fixed order for any thread count
        total += float(v)
    return d, total


def check_counts(oversample, power_iterations):
    """ArgumentError unless ``oversample`` is a whole number of at least 0 and
    ``power_iterations`` one from 0 to MAX_POWER_ITERATIONS."""
    for value, what, most in ((oversample, "oversample", None),
                              (power_iterations, "power_iterations", MAX_POWER_ITERATIONS)):
        try:
            whole = int(value) == value
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole or value < 0 or (most is not None and value > most):
            raise ArgumentError(f"{what} must be a whole number from 0"
                                + (f" to {most}" if most is not None else "")
                                + f", got {value!r}")


def _scale_exponent(norm_sq, rows, cols):
    """An even k such that D * 2^-k keeps the products finite (see SAFE_EXPONENT); 0 where D
    needs no scaling, as every difference of weights of ordinary magnitudes."""
    bound = np.sqrt(float(max(rows, cols)) * norm_sq)
    if bound <= 2.0 ** SAFE_EXPONENT:
        return 0
    # even, so that sqrt(s) -- each factor's share -- scales back by 2^(k/2) exactly
    k = int(np.ceil(np.log2(bound))) - (SAFE_EXPONENT - 8)
    return k + (k & 1)


#: CholeskyQR is taken while the diagonal of its R spans at most this ratio (a lower bound of
#: the columns' condition number); beyond it, or where the Cholesky factorisation fails (the
#: columns dependent to f64 rounding: a difference of lower rank than the range finder's width),
#: Householder QR.  CholeskyQR2 orthonormalises to f64 rounding up to a condition of about
#: 2^26 (Yamamoto, Nakatsukasa, Yanagisawa and Fukaya 2015); 2^20 leaves room for the diagonal
#: under-estimating the condition.
CHOLESKY_MAX_SPREAD = 2.0 ** 20


def _cholesky_r(q, threads=1):
    """R of q = Q R, upper triangular, from the Cholesky factorisation of the Gram matrix q^T q
    (f64); None where the factorisation fails or R is too ill-conditioned to trust."""
    from scipy.linalg import lapack

    r, info = lapack.dpotrf(_gemm.gram_f64(q, threads), lower=0, clean=1, overwrite_a=1)
    if info != 0:
        return None
    diag = np.abs(np.diagonal(r))
    if not diag.min() * CHOLESKY_MAX_SPREAD >= diag.max():
        return None
    return r


def _orthonormal(y, threads=1):
    """An orthonormal basis of the columns of y [m, w] (f32): Q [m, w], f64 in Fortran order.

    CholeskyQR2 (the Gram matrix, its Cholesky factor R, Q = y R^-1, twice: the second pass
    takes the first's error, f64 rounding times the condition squared, down to f64 rounding;
    level-3 BLAS, a fraction of Householder's time), or where y is too ill-conditioned for it,
    Householder QR (LAPACK's geqrf and orgqr)."""
    q = np.array(y, np.float64, order="F")
    for _ in range(2):
        r = _cholesky_r(q, threads)
        if r is None:
            from scipy.linalg import qr

            return np.asfortranarray(qr(np.asarray(y, np.float64), mode="economic",
                                        check_finite=False)[0])
        q = _gemm.solve_upper_right(q, r, threads)
    return q


def _lu_basis(a, out, transposed):
    """A basis of the columns of a [m, w] (f32, Fortran order; overwritten) for a power
    iteration, into out [m, w] (or its transpose [w, m]): P L of a's LU factorisation with
    partial pivoting (LAPACK's getrf, a quarter of the work of a Householder QR and its Q).
    The same columns' span, entries at most 1 in magnitude (so the products' bound of
    SAFE_EXPONENT holds as for +-1 entries); the power iterations need a well-conditioned basis,
    not an orthonormal one (Li, Linderman, Szlam, Stanton, Kluger and Tygert 2017)."""
    from scipy.linalg import lapack

    lu, pivots, info = lapack.sgetrf(a, overwrite_a=1)
    if info < 0:
        raise NumericsError(f"LAPACK sgetrf refused its argument {-info}")
    # info > 0: a zero pivot (a column dependent on those before it); L's column there is
    # still its unit diagonal, so the basis keeps full rank
    _lowrank.lu_basis(lu, np.asarray(pivots, np.int32), out, transposed)


def _projected_svd(b, threads=1):
    """(Ub, s, W) for b = Q^T D [w, n] (f32): the eigenvectors Ub of the Gram matrix b b^T (f64,
    largest first), W = b^T Ub [n, w] and s its column norms, so that b ~ Ub diag(s) (W / s)^T.

    Ub Ub^T b is an orthogonal projection of b whatever the rounding of the eigenvalues, so the
    truncation keeps the range finder's optimum; the singular values are taken as the norms of
    b^T Ub rather than as square roots of eigenvalues, which lose their digits below
    sqrt(eps) of the largest.  Far cheaper than an SVD of the wide b (no bidiagonalisation of
    it)."""
    from scipy.linalg import eigh

    bt = np.asarray(b.T, np.float64)                       # [n, w], Fortran order
    _, ub = eigh(_gemm.gram_f64(bt, threads), lower=False, driver="evd", check_finite=False)
    ub = np.asfortranarray(ub[:, ::-1])                   # largest eigenvalue first
    w = _gemm.product_f64(bt, ub, threads)
    s = np.sqrt(np.einsum("ij,ij->j", w, w))
    order = np.argsort(-s, kind="stable")
    return np.asfortranarray(ub[:, order]), s[order], w[:, order]


def extract_lora_weight(tuned, base, *, rank=None, energy=None, max_rank=256,
                        oversample=OVERSAMPLE, power_iterations=POWER_ITERATIONS, seed=0,
                        name="", dtype="bf16", threads=None):
    """A LoRA of one weight's difference, ``tuned - base ~ lora_b @ lora_a``.

    Parameters
    ----------
    tuned, base : arrays [out, in]
        bf16 (uint16 bits or ml_dtypes.bfloat16), float16 or float32 (dequantised weights).
    rank : int, optional
        The rank kept; or
    energy : float in (0, 1], optional
        the least rank whose factors keep this fraction of ``||tuned - base||_F``, up to
        ``max_rank``.
    oversample, power_iterations : int
        The range finder's extra columns and power iterations (Halko et al.; at most
        MAX_POWER_ITERATIONS iterations).
    seed, name : the test matrix's random bits (the tensor's name makes each weight's its own).
    dtype : "bf16" (default) or "f32"
        The factors' storage.
    threads : int or None

    Returns
    -------
    LowRank
        ``lora_a = sqrt(s) V^T`` [rank, in], ``lora_b = U sqrt(s)`` [out, rank] (the singular
        values split evenly, so the two factors have like magnitudes and round alike), the rank,
        the fraction of the norm kept, the norm and the singular value estimates.  Equal
        weights give rank-0 factors.
    """
    choice(dtype, DTYPES, "dtype")
    if (rank is None) == (energy is None):
        raise ArgumentError("give rank or energy, one of them")
    check_counts(oversample, power_iterations)
    threads = resolve_threads(threads)
    d, norm_sq = difference(tuned, base, threads)
    rows, cols = d.shape
    if not np.isfinite(norm_sq):
        bad = np.flatnonzero(~np.isfinite(d.reshape(-1)))[0]
        at = (int(bad // cols), int(bad % cols))
        raise NonFiniteInputError(f"{name or 'the weight'}: the difference is not finite at {at}")
    largest = min(rows, cols)
    if rank is not None:
        if int(rank) != rank or rank < 1:
            raise ArgumentError(f"rank must be a positive integer, got {rank!r}")
        if rank > largest:
            raise ShapeError(f"{name or 'the weight'}: rank {rank} is larger than the weight "
                             f"[{rows}, {cols}] allows ({largest})")
        wanted = int(rank)
    else:
        energy = float(energy)
        if not 0.0 < energy <= 1.0:
            raise ArgumentError(f"energy must be in (0, 1], got {energy!r}")
        if int(max_rank) != max_rank or max_rank < 1:
            raise ArgumentError(f"max_rank must be a positive integer, got {max_rank!r}")
        wanted = min(int(max_rank), largest)
    if norm_sq == 0.0:
        empty = np.zeros(0, np.float64)
        return _factors(np.zeros((rows, 0)), empty, np.zeros((cols, 0)), 0, 1.0, 0.0, dtype,
                        empty)
    width = range_width(wanted, oversample, largest)
    shift = _scale_exponent(norm_sq, rows, cols)
    if shift:  # entries near f32's limit: D * 2^-shift, exact (but for far smaller entries)
        np.ldexp(d, -shift, out=d)
    key = _quant.stochastic_key(int(seed), str(name))
    iterations = int(power_iterations)
    with blas_single_threaded():
        omega = np.empty((cols, width), np.float32)
        _lowrank.rademacher(key, omega)
        y = np.empty((rows, width), np.float32)       # D X, [rows, width]
        zt = np.empty((width, cols), np.float32)      # Q^T D = (D^T Q)^T, [width, cols]
        _lowrank.d_times(d, omega, y, threads)
        x = np.empty((cols, width), np.float32)       # the next product's basis
        qt = np.empty((width, rows), np.float32)      # a basis of D X's columns, transposed
        for _ in range(iterations):
            _lu_basis(np.asfortranarray(y), qt, transposed=True)
            _lowrank.dt_times(d, qt, zt, threads)
            _lu_basis(zt.T, x, transposed=False)      # zt^T: a Fortran-ordered [cols, width]
            _lowrank.d_times(d, x, y, threads)
        qt[:] = _orthonormal(y, threads).T            # the projection's basis: orthonormal
        _lowrank.dt_times(d, qt, zt, threads)   # B = Q^T D
        if not np.all(np.isfinite(zt)):  # the scaling above keeps them finite; LAPACK would
            raise NumericsError(        # only say "A has a NaN entry"
                f"{name or 'the weight'}: the range finder's products are not finite "
                f"(||D||_F = {np.sqrt(norm_sq):.6g})")
        # B ~ Ub S V^T with V = W / s, so D ~ Q B = (Q Ub) S V^T
        ub, s, w = _projected_svd(zt, threads)
        u = _gemm.product_f64(np.asarray(qt.T, np.float64), ub[:, :wanted], threads)
    v = w[:, :wanted] / np.where(s[:wanted] > 0.0, s[:wanted], 1.0)
    if shift:
        s = s * 2.0 ** shift    # f64: the singular values of D itself
    if rank is None:
        kept_sq = np.cumsum(s ** 2)
        enough = np.flatnonzero(kept_sq >= (energy ** 2) * norm_sq)
        wanted = min(wanted, int(enough[0]) + 1 if enough.size else wanted)
    kept = float(np.sqrt(min(1.0, float(np.sum(s[:wanted] ** 2)) / norm_sq)))
    return _factors(u, s, v, wanted, kept, float(np.sqrt(norm_sq)), dtype, s)


def _factors(u, s, v, rank, kept, norm, dtype, estimates):
    root = np.sqrt(s[:rank])
    b = np.ascontiguousarray((u[:, :rank] * root).astype(np.float32))
    a = np.ascontiguousarray((v[:, :rank] * root).T.astype(np.float32))
    if dtype == "bf16":
        a = _quant.round_bf16(a.reshape(-1)).reshape(a.shape)
        b = _quant.round_bf16(b.reshape(-1)).reshape(b.shape)
    return LowRank(a, b, rank, kept, norm, estimates)
