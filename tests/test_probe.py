"""The depth probe: it must tell a textbook-order sgemm from any other order, and the depths it
reports must really be exact."""
import numpy as np
import pytest

import _ltx2blas_hooks as hooks
from ltx2blas import _probe, reference
from ltx2blas._threads import blas_single_threaded

from helpers import random_bf16


def sequential(x, y, k, start=None):
    acc = np.zeros((x.shape[0], y.shape[1]), np.float32) if start is None else start.copy()
    for p in range(k):
        acc = acc + x[:, p:p + 1] * y[p:p + 1, :]
    return acc


def blocked(x, y, k, q):
    """What a BLAS that splits the depth at q computes: C = seq(0..q), then C += seq(q..k)."""
    first = sequential(x[:, :q], y[:q], q)
    second = sequential(x[:, q:k], y[q:k], k - q)
    return first + second


def two_accumulators(x, y, k):
    even = sequential(x[:, 0:k:2], y[0:k:2], len(range(0, k, 2)))
    odd = sequential(x[:, 1:k:2], y[1:k:2], len(range(1, k, 2)))
    return even + odd


def reverse(x, y, k):
    return sequential(x[:, k - 1::-1], y[k - 1::-1], k)


@pytest.mark.parametrize("k", [3, 4, 5, 9, 33, 100, 450])
def test_probe_operands_expose_every_other_order(k):
    """Any split of the depth into two runs (each of two or more terms; a run of one term adds
    in textbook order anyway), two interleaved accumulators, or the reversed order changes the
    bits of at least one element of the probe's result."""
    m, n = 37, 41
    for x, y in _probe._probe_operands(m, n, k, k):
        x = x[:, :k]
        exact = sequential(x, y, k).view(np.uint32)
        for other in [two_accumulators(x, y, k), reverse(x, y, k)]:
            assert not np.array_equal(other.view(np.uint32), exact)
        splits = range(2, k - 1) if k < 40 else np.linspace(2, k - 2, 25).astype(int)
        for q in splits:
            assert not np.array_equal(blocked(x, y, k, q).view(np.uint32), exact), q
        break  # the structured pattern alone must do it; the random one is extra
    # A split that leaves one term at the end is the textbook order: nothing to detect.
    x, y = _probe._probe_operands(m, n, k, k)[0]
    assert np.array_equal(blocked(x[:, :k], y, k, k - 1), sequential(x[:, :k], y, k))


@pytest.mark.parametrize("shape", [(256, 512, 384), (256, 512, 1000), (17, 33, 450), (1, 1, 64),
                                   (300, 7, 700)])
def test_verified_depth_is_exact_on_fresh_data(shape, rng):
    m, n, k = shape
    with blas_single_threaded():
        depth = _probe.verified_depth(m, n, k, k, pin=blas_single_threaded)
        assert 0 <= depth <= k
        if depth == 0:
            return
        for _ in range(3):
            x = reference.bf16_widen(random_bf16(rng, (m, depth)))
            y = reference.bf16_widen(random_bf16(rng, (depth, n)))
            got = hooks.sgemm(x, y)
            assert np.array_equal(got.view(np.uint32), sequential(x, y, depth).view(np.uint32))


def test_depth_is_cached_and_reported():
    with blas_single_threaded():
        first = _probe.verified_depth(64, 96, 200, pin=blas_single_threaded)
        assert _probe.verified_depth(64, 96, 200, pin=blas_single_threaded) == first
    report = _probe.probe_report()
    assert (64, 96, 200, 200) in report or (64, 96, first, 200) in report


def test_zero_sizes():
    assert _probe.verified_depth(0, 5, 5, pin=blas_single_threaded) == 0
    assert _probe.verified_depth(5, 0, 5, pin=blas_single_threaded) == 0
    assert _probe.verified_depth(5, 5, 0, pin=blas_single_threaded) == 0
