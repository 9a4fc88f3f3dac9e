"""Knowing when sgemm is exact: the depth probe.

sgemm reproduces the textbook order (docs/arithmetic.md §1) only while it does not split the
depth internally, and where it splits depends on the BLAS build, the CPU and the operand shape.
So nothing is assumed: :func:`verified_depth` runs the exact call shape on probe data and
compares it bit for bit with the sequential kernel, and the drivers hand sgemm only a depth
that passed.

The probe calls sgemm, so it must run with the BLAS held to one thread, as every call of the
drivers does: the caller says how, by passing its pin (``ltx2blas._threads.blas_single_threaded``).
"""
from ._gemm cimport continue_product, kernels, sgemm_rowmajor

import threading

import numpy as np

# Up to this depth the sequential kernel is used alone, sgemm neither probed nor called: at a
# few dozen terms a BLAS call's fixed costs (zeroing c, packing both operands) outweigh its
# speed, and the fuse's rounding runs in the kernel's registers instead of over a stored f32
# tile.  Larger depths go to sgemm, the route each CPU's BLAS tunes (bench/bench_fuse.py
# measures both sides of this line).
SEQUENTIAL_DEPTH = 128


# sgemm is handed a product only where its verified depth covers at least this share of the
# terms. A BLAS whose kernel departs from the textbook order after a few terms (OpenBLAS's
# Haswell kernels: 7) would carry almost none of the work, yet its call still zeroes and
# stores an f32 tile that the sequential kernel then reads, continues and rounds: the one-pass
# kernel does all of it in registers (bench/bench_routes.py measures both routes).
BLAS_MIN_SHARE = 0.5


def blas_depth(int m, int n, int k, int ldx=-1, *, pin):
    """The depth an exact product of shape (m, n, k) hands to sgemm: 0 up to SEQUENTIAL_DEPTH
    or where :func:`verified_depth` is below BLAS_MIN_SHARE of k, else the verified depth."""
    if k <= SEQUENTIAL_DEPTH:
        return 0
    depth = verified_depth(m, n, k, ldx, pin=pin)
    return depth if depth >= BLAS_MIN_SHARE * k else 0


_probe_lock = threading.Lock()
_exact_cache = {}
_depth_cache = {}
_last_depth = [0]


def _bf16_exact(values):
    """Round-toward-zero to bf16-representable f32: probe data must have exact products."""
    return (np.asarray(values, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _probe_operands(int m, int n, int k, int ldx):
    """Operands on which any accumulation order other than p = 0, 1, 2, ... shows.

    Pattern 1 gives row i the product 1.0 at p = i % k and 2**-24 (half an ulp of 1) at every
    other p, with some doubled: summing two small terms before they meet the large one, or
    meeting it early or late, changes the bits.  Pattern 2 is random bf16 data, with one row of
    zeros against a column of negatives (an order that starts from the first product instead of
    +0.0 turns +0.0 into -0.0 there)."""
    rng = np.random.default_rng(0x17B)
    x1 = np.full((m, ldx), 2.0 ** -12, np.float32)
    x1[np.arange(m), np.arange(m) % k] = 2.0 ** 12
    y1 = np.full((k, n), 2.0 ** -12, np.float32)
    y1[np.arange(n) % k, np.arange(n)] = 2.0 ** -11
    x2 = _bf16_exact(rng.standard_normal((m, ldx)))
    y2 = _bf16_exact(rng.standard_normal((k, n)))
    x2[0, :] = 0.0
    y2[:, 0] = -np.abs(y2[:, 0]) - 1.0
    return [(x1, y1), (x2, y2)]


def _sgemm_is_sequential(int m, int n, int k, int ldx, pin):
    """Whether sgemm over k terms, at this exact call shape, matches the sequential kernel bit
    for bit on the probe operands."""
    cdef float[:, ::1] xv
    cdef float[:, ::1] yv
    cdef float[:, ::1] cb
    cdef float[:, ::1] cs
    key = (m, n, k, ldx)
    if key in _exact_cache:
        return _exact_cache[key]
    exact = True
    with pin():
        for x, y in _probe_operands(m, n, k, ldx):
            blas = np.empty((m, n), np.float32)
            seq = np.zeros((m, n), np.float32)
            xv, yv, cb, cs = x, y, blas, seq
            with nogil:
                sgemm_rowmajor(m, n, k, &xv[0, 0], ldx, &yv[0, 0], n, 0.0, &cb[0, 0], n)
                continue_product(kernels(False), m, n, k, &xv[0, 0], ldx, &yv[0, 0], n,
                                 &cs[0, 0], n)
            if not np.array_equal(blas.view(np.uint32), seq.view(np.uint32)):
                exact = False
                break
    _exact_cache[key] = exact
    return exact


def verified_depth(int m, int n, int k, int ldx=-1, *, pin):
    """The largest depth d <= k for which one sgemm call of shape (m, n, d), with x's row stride
    ldx (default k) and y, c packed, was verified on probe data to add the terms in the
    textbook order.  0 means sgemm is not used for this shape.  ``pin``: the caller's context
    manager holding the BLAS to one thread.

    Probes are cached for the life of the process.  Exactness is checked at each depth used,
    never inferred: a bisection only chooses which depths to check."""
    if ldx < 0:
        ldx = k
    if m <= 0 or n <= 0 or k <= 0:
        return 0
    key = (m, n, k, ldx)
    with _probe_lock:
        if key in _depth_cache:
            return _depth_cache[key]
        if _sgemm_is_sequential(m, n, k, ldx, pin):
            depth = k
        else:
            lo, hi = 0, k  # invariant: depth lo verified (0 trivially), depth hi not exact
            hint = _last_depth[0]
            if 0 < hint < k and _sgemm_is_sequential(m, n, hint, ldx, pin):
                lo = hint
                if not _sgemm_is_sequential(m, n, hint + 1, ldx, pin):
                    hi = hint + 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _sgemm_is_sequential(m, n, mid, ldx, pin):
                    lo = mid
                else:
                    hi = mid
            depth = lo
            if depth:
                _last_depth[0] = depth
        _depth_cache[key] = depth
        return depth


def probe_report():
    """Every depth probe run in this process: {(m, n, k, ldx): exact}."""
    with _probe_lock:
        return dict(_exact_cache)
