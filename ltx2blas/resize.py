"""A LoRA re-factored at a smaller rank, at the optimum, without forming its delta.

``scale * lora_b @ lora_a`` has rank at most r (the factors' inner size): its thin SVD comes
from a QR factorisation of each factor and the SVD of an r x r matrix,

    B = Qb Rb,  A^T = Qa Ra,  scale * B A = Qb (scale * Rb Ra^T) Qa^T = (Qb Um) S (Qa Vm)^T

-- O((out + in) r^2) work, no out x in matrix.  Keeping the k largest singular values is the
best rank-k approximation of the delta in the Frobenius norm (Eckart and Young), up to the f64
rounding of these steps: an exact optimum, not an estimate.  The work is LAPACK's and the BLAS's
in f64, each call on one BLAS thread (:func:`ltx2blas._threads.blas_single_threaded`; the two
QR factorisations side by side on two threads): the same bytes for any thread count.

The rank is given (``rank``), or chosen per weight: ``energy`` (the least rank keeping that
fraction of the Frobenius norm, as ``extract``), or kohya-ss's dynamic rules as its
``networks/resize_lora.py`` computes them (``sv_ratio``, ``sv_fro``, ``sv_cumulative``; their
rank is one more than the least that reaches the target -- docs/resize.md).
"""
from typing import NamedTuple

import numpy as np

from . import _quant
from ._threads import blas_single_threaded, resolve_threads
from ._validate import bf16_bits, bf16_to_f32, choice, contiguous, is_bf16, ndarray
from .errors import ArgumentError, DTypeError, NonFiniteInputError, ShapeError

__all__ = ["Resized", "resize_lora_weight", "lowrank_svd", "rank_rule", "choose_rank",
           "RANK_RULES"]

#: The ways a new rank is chosen, each a keyword of resize_lora_weight.
RANK_RULES = ("rank", "energy", "sv_ratio", "sv_fro", "sv_cumulative")
#: kohya-ss's resize_lora: a delta whose largest singular value is at most this is given rank 1.
KOHYA_MIN_SV = 1e-6


class Resized(NamedTuple):
    """``lora_b @ lora_a`` is the best rank-``rank`` approximation of the input's delta."""
    lora_a: np.ndarray           # [rank, in]: sqrt(s) V^T
    lora_b: np.ndarray           # [out, rank]: U sqrt(s)
    rank: int
    kept: float                  # ||delta_rank||_F / ||delta||_F (1 for a zero delta)
    norm: float                  # ||delta||_F
    singular_values: np.ndarray  # every singular value of the delta, largest first (f64)

    @property
    def error(self):
        """||delta - lora_b lora_a||_F / ||delta||_F before the factors' rounding: the
        optimum's, sqrt(1 - kept^2)."""
        return float(np.sqrt(max(0.0, 1.0 - self.kept ** 2)))


def _f64(x, name):
    a = ndarray(x, name)
    if is_bf16(a.dtype):
        a = bf16_to_f32(contiguous(bf16_bits(a, name), name))
    elif a.dtype not in (np.float16, np.float32, np.float64):
        raise DTypeError(f"{name} must be bf16, float16, float32 or float64, got {a.dtype}")
    if a.ndim != 2:
        raise ShapeError(f"{name} must be 2-D, got shape {a.shape}")
    a = a.astype(np.float64, copy=False)   # read only: f64 factors (merge's) are not copied
    if not np.all(np.isfinite(a)):
        bad = np.argwhere(~np.isfinite(a))[0]
        raise NonFiniteInputError(f"{name} is not finite at {tuple(int(i) for i in bad)}")
    return a


def _factored(lora_a, lora_b, scale, threads):
    """(Qb, Um, s, Vm^T, Qa) with scale * B A = (Qb Um) diag(s) (Qa Vm)^T; Qb and Qa as LAPACK's
    Householder reflectors (geqrf), applied by _times_q, never formed.  The two factorisations
    run side by side where ``threads`` > 1, each on one BLAS thread: the same bytes either way."""
    from scipy.linalg import qr, svd

    a, b = _f64(lora_a, "lora_a"), _f64(lora_b, "lora_b")
    if a.shape[0] != b.shape[1]:
        raise ShapeError(f"lora_a {list(a.shape)} has rank {a.shape[0]} but lora_b "
                         f"{list(b.shape)} has rank {b.shape[1]}")
    scale = float(scale)
    if not np.isfinite(scale):
        raise ArgumentError(f"scale must be finite, got {scale!r}")

    def qr_of(x):
        (reflectors, tau), r = qr(x, mode="raw", check_finite=False)
        return (reflectors, tau), r[:min(x.shape)]

    with blas_single_threaded():
        if resolve_threads(threads) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2) as pool:
                (qb, rb), (qa, ra) = pool.map(qr_of, (b, a.T))
        else:
            (qb, rb), (qa, ra) = qr_of(b), qr_of(a.T)
        um, s, vmt = svd(scale * (rb @ ra.T), full_matrices=False, check_finite=False,
                         lapack_driver="gesdd")
    return qb, um, s, vmt, qa


def _times_q(q, c):
    """Q @ c for the thin Q [m, n] of a geqrf (its reflectors and tau) and c [n, k]: c padded
    with zero rows to m and the reflectors applied (LAPACK's ormqr), O(m n k)."""
    from scipy.linalg import lapack

    reflectors, tau = q
    m = reflectors.shape[0]
    padded = np.zeros((m, c.shape[1]), np.float64, order="F")
    padded[:c.shape[0]] = c
    if c.shape[1] == 0 or tau.size == 0:
        return np.array(padded)
    # a wide factor (more columns than rows) has min(m, n) reflectors, in its first columns
    out, _, info = lapack.dormqr("L", "N", reflectors[:, :tau.size], tau, padded,
                                 lwork=max(1, 64 * c.shape[1]), overwrite_c=1)
    if info != 0:
        raise ArgumentError(f"LAPACK dormqr failed (info {info})")
    return np.asarray(out)


def lowrank_svd(lora_a, lora_b, scale=1.0, threads=None):
    """(U [out, k], s [k], V [in, k]) with ``scale * lora_b @ lora_a = U diag(s) V^T``, s
    descending, k = min(r, out, in): the thin SVD from the factors (f64)."""
    qb, um, s, vmt, qa = _factored(lora_a, lora_b, scale, threads)
    with blas_single_threaded():
        return _times_q(qb, um), s, _times_q(qa, vmt.T)


def _kohya_rank(s, rule, target):
    """kohya-ss resize_lora's rank for a dynamic rule: its index function (the least count of
    singular values whose normalised cumulative sum, of squares for sv_fro, reaches the target;
    for sv_ratio the count above s[0] / target), held to [1, len - 1], plus one.  ``s`` holds
    every singular value of the delta: min(out, in) of them, the ones past the LoRA's rank 0."""
    n = len(s)
    if rule == "sv_ratio":
        index = int(np.sum(s > s[0] / target))
    else:
        values = s ** 2 if rule == "sv_fro" else s
        cumulative = np.cumsum(values) / float(np.sum(values))
        index = int(np.searchsorted(cumulative, target ** 2 if rule == "sv_fro" else target,
                                    side="left")) + 1
    return max(1, min(index, n - 1)) + 1


def rank_rule(rank=None, energy=None, sv_ratio=None, sv_fro=None, sv_cumulative=None,
              max_rank=None):
    """(rule, value) of the one rule given, its value checked; ArgumentError otherwise."""
    given = {k: v for k, v in (("rank", rank), ("energy", energy), ("sv_ratio", sv_ratio),
                               ("sv_fro", sv_fro), ("sv_cumulative", sv_cumulative))
             if v is not None}
    if len(given) != 1:
        raise ArgumentError(f"give one of {', '.join(RANK_RULES)}, got "
                            f"{', '.join(given) or 'none'}")
    (rule, value), = given.items()
    if rule == "rank":
        if isinstance(value, bool) or int(value) != value or value < 1:
            raise ArgumentError(f"rank must be a positive integer, got {value!r}")
        return rule, int(value)
    value = float(value)
    if rule in ("energy", "sv_fro", "sv_cumulative") and not 0.0 < value <= 1.0:
        raise ArgumentError(f"{rule} must be in (0, 1], got {value!r}")
    if rule == "sv_ratio" and not value >= 1.0:
        raise ArgumentError(f"sv_ratio must be at least 1, got {value!r}")
    if max_rank is not None and (isinstance(max_rank, bool) or int(max_rank) != max_rank
                                 or max_rank < 1):
        raise ArgumentError(f"max_rank must be a positive integer, got {max_rank!r}")
    return rule, value


def choose_rank(s, norm_sq, full, rule, value, max_rank=None):
    """The new rank for singular values ``s`` (descending) of a delta of squared norm
    ``norm_sq`` whose full SVD has ``full`` values (min(out, in); those past len(s) are 0), by
    a rank_rule; ``max_rank`` caps the dynamic rules."""
    if rule == "rank":
        return value
    if rule == "energy":
        if norm_sq == 0.0:
            return 0
        enough = np.flatnonzero(np.cumsum(s ** 2) >= (value ** 2) * norm_sq)
        k = int(enough[0]) + 1 if enough.size else len(s)
    else:
        if len(s) == 0 or s[0] <= KOHYA_MIN_SV:
            return 1 if len(s) else 0
        padded = np.zeros(max(full, len(s)))
        padded[:len(s)] = s
        k = _kohya_rank(padded, rule, value)
    return k if max_rank is None else min(k, int(max_rank))


def resize_lora_weight(lora_a, lora_b, *, scale=1.0, rank=None, energy=None, sv_ratio=None,
                       sv_fro=None, sv_cumulative=None, max_rank=None, dtype="bf16",
                       threads=None):
    """One LoRA module re-factored at a new rank: the best approximation of its delta
    ``scale * lora_b @ lora_a`` at that rank, from the factors alone.

    Parameters
    ----------
    lora_a : [r, in], lora_b : [out, r]
        bf16 (uint16 bits or ml_dtypes.bfloat16), float16, float32 or float64; finite.
    scale : float
        What the loader multiplies the product by (alpha / r, times a strength): folded into
        the new factors, which are meant for a scale of 1 (alpha = the new rank).
    rank, energy, sv_ratio, sv_fro, sv_cumulative : one of them
        ``rank``: at most the delta's rank bound, min(r, out, in).  ``energy`` in (0, 1]: the
        least rank keeping that fraction of ||delta||_F.  ``sv_ratio`` (>= 1), ``sv_fro`` and
        ``sv_cumulative`` (in (0, 1]): kohya-ss resize_lora's dynamic rules, its rank exactly.
    max_rank : int, optional
        A cap on the dynamic rules' rank (kohya's ``--new_rank`` in dynamic mode).
    dtype : "bf16" (default) or "f32"
        The new factors' storage.
    threads : int or None
        Two or more: the two factors' QR factorisations side by side.

    Returns
    -------
    Resized
        ``lora_a = sqrt(s) V^T`` [k, in] and ``lora_b = U sqrt(s)`` [out, k] (the singular
        values split evenly), k, the fraction of the norm kept, the norm and the singular
        values.  A rule's rank past the delta's rank bound is held to it (the values there are
        0).  Byte for byte the same for any thread count.
    """
    choice(dtype, ("bf16", "f32"), "dtype")
    rule, value = rank_rule(rank, energy, sv_ratio, sv_fro, sv_cumulative, max_rank)
    qb, um, s, vmt, qa = _factored(lora_a, lora_b, scale, threads)
    out_f, in_f = qb[0].shape[0], qa[0].shape[0]
    r = np.shape(lora_a)[0]
    norm_sq = float(np.sum(s ** 2))
    k = choose_rank(s, norm_sq, min(out_f, in_f), rule, value, max_rank)
    if rule == "rank" and k > len(s):
        raise ShapeError(f"rank {k} is larger than the LoRA's product allows: "
                         f"min(rank {r}, out {out_f}, in {in_f}) = {len(s)}")
    k = min(k, len(s))
    kept = 1.0 if norm_sq == 0.0 else float(np.sqrt(min(1.0, float(np.sum(s[:k] ** 2)) / norm_sq)))
    root = np.sqrt(s[:k])
    with blas_single_threaded():  # only the k columns kept: (Qb Um)[:, :k] = Qb Um[:, :k]
        u, v = _times_q(qb, um[:, :k]), _times_q(qa, vmt[:k].T)
    # + 0.0: a zero singular value's column is +0, not the -0 of a negative vector entry
    b = np.ascontiguousarray((u * root + 0.0).astype(np.float32))
    a = np.ascontiguousarray((v * root + 0.0).T.astype(np.float32))
    if dtype == "bf16":
        a = _quant.round_bf16(a.reshape(-1)).reshape(a.shape)
        b = _quant.round_bf16(b.reshape(-1)).reshape(b.shape)
    return Resized(a, b, k, kept, float(np.sqrt(norm_sq)), s)
