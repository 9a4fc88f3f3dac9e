"""ltx2blas.linear: F.linear semantics, a derived error bound against an exact reference, the
same bytes for any thread count and run, progress, and the f64 mode's one-ulp promise at the
real width."""
import math
import threading

import numpy as np
import pytest

import ltx2blas
from ltx2blas import _gemm, linear_layer, reference
from ltx2blas.linear_layer import (BLOCKS, STREAM_FEW_BLOCKS, STREAM_FEW_ROWS, STREAM_SEGMENT,
                                   STREAM_WIDE_BLOCKS, error_bound, gamma, plan, segments,
                                   task_count)

from helpers import bfdot_step, random_bf16

REAL_WIDTH = 49 * 3840  # 188,160: the caption projection's in_features


def as_f64(a):
    return reference.bf16_widen(a).astype(np.float64) if a.dtype == np.uint16 else a.astype(np.float64)


def exact(x, w, bias=None):
    """The exact sum of the f64 products (each exact: 24 x 8 or 24 x 24 significant bits fit in
    53), correctly rounded by math.fsum -- then the one rounding to f32 is the only error."""
    x64 = as_f64(x).reshape(-1, w.shape[1])
    w64 = as_f64(w)
    out = np.empty((x64.shape[0], w64.shape[0]))
    for m in range(x64.shape[0]):
        for o in range(w64.shape[0]):
            terms = list(x64[m] * w64[o])
            if bias is not None:
                terms.append(float(as_f64(bias)[o]))
            out[m, o] = math.fsum(terms)
    return out.reshape(x.shape[:-1] + (w.shape[0],))


def f32_ulp(values):
    v = np.abs(np.asarray(values, np.float32))
    return np.spacing(np.maximum(v, np.float32(np.finfo(np.float32).tiny)))


def case(rng, rows, cols, feats, x_bf16=False, w_bf16=True, bias="f32"):
    x = rng.standard_normal((rows, cols), dtype=np.float32)
    if x_bf16:
        x = reference.bf16_round(x)
    w = rng.standard_normal((feats, cols), dtype=np.float32) * np.float32(0.02)
    if w_bf16:
        w = reference.bf16_round(w)
    b = None
    if bias == "f32":
        b = rng.standard_normal(feats, dtype=np.float32)
    elif bias == "bf16":
        b = random_bf16(rng, (feats,))
    return x, w, b


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40, 70])
@pytest.mark.parametrize("x_bf16, w_bf16, bias", [(False, True, "f32"), (True, True, "bf16"),
                                                   (False, False, None), (True, False, "f32")])
def test_within_the_derived_bound(rng, rows, x_bf16, w_bf16, bias):
    x, w, b = case(rng, rows, 3001, 37, x_bf16, w_bf16, bias)
    y = ltx2blas.linear(x, w, b)
    assert y.dtype == np.float32 and y.shape == (rows, 37)
    err = np.abs(y.astype(np.float64) - exact(x, w, b))
    bound = error_bound(x, w, b)
    assert np.all(err <= bound + f32_ulp(y) / 2)  # + the final rounding to f32


def test_bound_is_not_vacuous(rng):
    """The bound must be far below the values themselves, and the errors must actually reach a
    fair part of f32 precision (or the test would prove nothing)."""
    x, w, b = case(rng, 12, 5000, 20)
    y = ltx2blas.linear(x, w, b)
    ref = exact(x, w, b)
    assert np.median(error_bound(x, w, b) / np.abs(ref)) < 0.02
    assert np.max(np.abs(y - ref)) > 0


@pytest.mark.parametrize("rows", [2, 40])
def test_f64_mode_is_within_one_ulp_at_the_real_width(rng, rows):
    x, w, b = case(rng, rows, REAL_WIDTH, 6)
    y = ltx2blas.linear(x, w, b, accumulate="f64")
    ref = exact(x, w, b)
    assert np.all(np.abs(y - ref) <= f32_ulp(ref))


def test_f32_mode_at_the_real_width(rng):
    x, w, b = case(rng, 3, REAL_WIDTH, 8)
    for rows in (3, 40, 70):  # the streaming route (both block shapes) and the sgemm route
        xr = np.ascontiguousarray(np.resize(x, (rows, REAL_WIDTH)))
        y = ltx2blas.linear(xr, w, b)
        assert np.all(np.abs(y - exact(xr, w, b)) <= error_bound(xr, w, b) + f32_ulp(y) / 2)


@pytest.mark.parametrize("rows", [1, 5, 16, 33, 300])
@pytest.mark.parametrize("accumulate", ["f32", "f64"])
def test_same_bytes_for_every_thread_count_and_run(rng, rows, accumulate):
    x, w, b = case(rng, rows, 2100, 150)
    first = ltx2blas.linear(x, w, b, accumulate=accumulate, threads=1)
    for threads in (1, 2, 3):
        again = ltx2blas.linear(x, w, b, accumulate=accumulate, threads=threads)
        assert again.tobytes() == first.tobytes()


@pytest.mark.parametrize("rows, cols, feats", [(11, 1000, 33), (13, 2 * 4096 + 37, 9), (1, 4099, 2),
                                              (1, 4099, 21), (2, 1000, 21), (4, 3000, 13)])
def test_streaming_kernel_in_every_table(kernel_table, rng, rows, cols, feats):
    # Row groups of 8 and a tail, an odd count of weight rows, several blocks of 4096 and a k
    # tail shorter than a vector; with 1 to 4 rows of x, register tiles of 8 or 4 weight rows
    # and a tail, against one weight row at a time (the blocks below).
    x, w, b = case(rng, rows, cols, feats)
    assert plan(rows, w.dtype)[0] == "stream"
    y = ltx2blas.linear(x, w, b, threads=2)
    assert np.all(np.abs(y - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)
    assert ltx2blas.linear(x, w, b, threads=1).tobytes() == y.tobytes()
    # The task blocks cut the output features differently: each output's sum is the same.
    for blocks in ((5, 3, 1 << 18), (5, 2, 1 << 18), (7, 1, 1 << 18)):
        other = ltx2blas.linear(x, w, b, blocks=blocks)
        assert other.tobytes() == y.tobytes()


def test_leading_dimensions_and_1d(rng):
    x, w, b = case(rng, 6, 200, 9)
    y = ltx2blas.linear(x, w, b)
    assert np.array_equal(ltx2blas.linear(x.reshape(2, 3, 200), w, b), y.reshape(2, 3, 9))
    assert np.array_equal(ltx2blas.linear(x[2], w, b), y[2])  # 1-D x: one row
    assert ltx2blas.linear(x.reshape(1, 2, 3, 200), w, b).shape == (1, 2, 3, 9)


def test_ml_dtypes_inputs(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x, w, b = case(rng, 4, 300, 7, x_bf16=True, bias="bf16")
    y = ltx2blas.linear(x, w, b)
    same = ltx2blas.linear(x.view(ml_dtypes.bfloat16), w.view(ml_dtypes.bfloat16),
                           b.view(ml_dtypes.bfloat16))
    assert same.tobytes() == y.tobytes()


def test_matches_torch_within_the_bound(rng):
    torch = pytest.importorskip("torch")
    x, w, b = case(rng, 24, 4096, 64, w_bf16=False)
    y = ltx2blas.linear(x, w, b)
    ty = torch.nn.functional.linear(torch.from_numpy(x), torch.from_numpy(w),
                                    torch.from_numpy(b)).numpy()
    # Both are within their own bound of the exact result, so within the sum of the two.
    assert np.all(np.abs(y - ty) <= 2 * error_bound(x, w, b) + f32_ulp(y))


def test_progress_is_reported_and_increasing(rng, monkeypatch):
    from ltx2blas import _threads
    monkeypatch.setattr(_threads, "MIN_ROUNDS", 1)   # waves of one round: several here
    x, w, b = case(rng, 300, 1000, 2600)  # 11 tasks of 256 features: several waves
    seen = []
    y = ltx2blas.linear(x, w, b, threads=2, progress=seen.append)
    assert len(seen) >= 2 and seen[-1] == 1.0
    assert all(0 < a < b for a, b in zip(seen, seen[1:]))
    assert y.tobytes() == ltx2blas.linear(x, w, b, threads=2).tobytes()


def test_progress_exception_stops_the_call(rng):
    x, w, b = case(rng, 300, 1000, 2600)

    def stop(fraction):
        if fraction > 0.2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ltx2blas.linear(x, w, b, progress=stop)


def test_eight_python_threads_at_once(rng):
    x, w, b = case(rng, 40, 2000, 100)
    expected = ltx2blas.linear(x, w, b)
    results, errors = [None] * 8, []

    def work(i):
        try:
            results[i] = ltx2blas.linear(x, w, b, threads=2)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors
    assert all(r.tobytes() == expected.tobytes() for r in results)


def test_blocks_are_fixed_by_shape_not_threads():
    for rows, route in ((5, "stream"), (16, "stream")):
        assert plan(rows, np.uint16) == (route, BLOCKS[route])
    for rows in (65, 1024):  # beside a BLAS of narrower vectors than the table's, the panel
        above = linear_layer.panel_above_stream_rows()
        assert plan(rows, np.uint16) == (("panel", STREAM_WIDE_BLOCKS) if above
                                         else ("sgemm", BLOCKS["sgemm"]))
    for rows in (1, 4):
        assert plan(rows, np.uint16) == ("stream", STREAM_FEW_BLOCKS)
    panel_rows = _gemm.panel_min_rows()  # 48 on the AVX2 table, where it was measured; else 0
    for rows in (17, 47, 48, 64):
        route = "panel" if 0 < panel_rows <= rows else "stream"
        assert plan(rows, np.uint16) == (route, STREAM_WIDE_BLOCKS)
    assert plan(4, np.float32)[0] == "sgemm"  # an f32 weight has nothing to stream
    assert plan(4, np.uint16, "f64")[0] == "f64"


@pytest.mark.parametrize("rows", [5, 20])
def test_streaming_segments_are_summed_on_their_own_then_added_in_order(rng, rows):
    """The streaming route's cut, written out: every 12,288 in-features' sum is the kernel's on
    that slice alone (a call that short has one segment), and y is their sums added in segment
    order in f32, the first starting from the bias."""
    cols = 3 * STREAM_SEGMENT + 100
    x, w, b = case(rng, rows, cols, 19)
    assert segments(rows, 19, cols, *plan(rows, w.dtype)) == (4, STREAM_SEGMENT)
    y = ltx2blas.linear(x, w, b, threads=2)
    cuts = range(0, cols, STREAM_SEGMENT)
    parts = [ltx2blas.linear(np.ascontiguousarray(x[:, c:c + STREAM_SEGMENT]),
                             np.ascontiguousarray(w[:, c:c + STREAM_SEGMENT]),
                             b if c == 0 else None) for c in cuts]
    total = parts[0]
    for part in parts[1:]:
        total = total + part  # f32 + f32, rounded once each
    assert total.dtype == np.float32 and total.tobytes() == y.tobytes()
    assert ltx2blas.linear(x, w, b, threads=1).tobytes() == y.tobytes()
    assert np.all(np.abs(y - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)


def test_few_rows_read_whole_weight_rows(rng):
    """Up to 4 rows: one segment, the bytes the same as one call per row block of outputs."""
    x, w, b = case(rng, 3, 3 * STREAM_SEGMENT + 100, 19)
    assert segments(3, 19, x.shape[1], *plan(3, w.dtype))[0] == 1
    y = ltx2blas.linear(x, w, b, threads=2)
    assert ltx2blas.linear(x, w, b, blocks=(4, 19, 1 << 18)).tobytes() == y.tobytes()


@pytest.mark.parametrize("rows, cols, feats", [(3, 30000, 50), (20, 30000, 50), (300, 9000, 300)])
def test_the_driver_runs_the_tasks_task_count_gives(rng, monkeypatch, rows, cols, feats):
    from ltx2blas import linear_layer
    ran = []
    original = linear_layer._run_in_waves
    monkeypatch.setattr(linear_layer, "_run_in_waves",
                        lambda tasks, *a: (ran.append(tasks.tasks), original(tasks, *a)))
    x, w, b = case(rng, rows, cols, feats)
    ltx2blas.linear(x, w, b)
    assert ran == [task_count(rows, feats, cols, w.dtype)]


def test_every_real_shape_is_cut_into_256_tasks():
    """Out 2048, 3840 and 4096 at 1 to 2048 rows: at least 256 independent tasks, from the output
    blocks times the in-dimension's segments, whatever the thread count."""
    for feats in (2048, 3840, 4096):
        for rows in (1, 2, 4, 8, 16, 17, 32, 64, 65, 128, 256, 512, 513, 1024, 2048):
            for x_dtype in (np.float32, np.uint16):  # bf16 x: the dot-product route, if any
                route, blocks = plan(rows, np.uint16, x_dtype=x_dtype)
                count, length = segments(rows, feats, REAL_WIDTH, route, blocks)
                assert count == -(-REAL_WIDTH // length) and count <= 2 * 34
                assert task_count(rows, feats, REAL_WIDTH, np.uint16,
                                  x_dtype=x_dtype) >= 256, (rows, feats, route)


needs_dot = pytest.mark.skipif(
    not _gemm.has_dot_linear(),
    reason=f"the {_gemm.kernel_name()} kernel table has no dot-product Linear (x86's "
           f"AVX512_BF16 or Arm's BF16)")


def dot_pair(acc, x0, w0, x1, w1):
    """One pair's step of the dot-product instruction of the table in use, in numpy, from its
    stated rule (docs/arithmetic.md): VDPBF16PS adds the higher element's product (x1 w1), then
    the lower's, each rounded to nearest; BFDOT adds their exact sum, rounded to odd, rounded
    to odd again (and flushes subnormals, which the inputs here avoid)."""
    if _gemm.dot_rule()[1] == 4:
        return bfdot_step(acc, x0, w0, x1, w1)
    return (acc + x1 * w1) + x0 * w0


@needs_dot
@pytest.mark.parametrize("rows", [1, 5, 8, 17, 64, 70, 130])
def test_dot_route_on_bf16_x_within_its_bound_and_thread_independent(rng, rows):
    """bf16 x and weight take a dot-product route at every row count (the panel one from 32
    rows), with in-dimensions that leave partial vectors, blocks, chunks and segments; within
    the derived bound, the same bytes for 1 and 2 threads and from run to run."""
    x, w, b = case(rng, rows, 2 * 12288 + 4096 + 37, 45, True, True, "f32")
    assert plan(rows, w.dtype, x_dtype=x.dtype)[0] == ("dot_panel" if rows >= 32 else "dot")
    y = ltx2blas.linear(x, w, b, threads=2)
    assert np.all(np.abs(y - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)
    assert y.tobytes() == ltx2blas.linear(x, w, b, threads=1).tobytes()
    assert y.tobytes() == ltx2blas.linear(x, w, b, threads=2).tobytes()


def dot_route_model(x, w, bias, seg_len):
    """The dot-product route's stated order, in numpy f32 (each operation one rounding), for
    bf16 x and weight whose products and sums stay normal: per segment of seg_len in-features,
    L lanes (the table's), lane j of each vector of 2L elements taking the pair of elements 2j,
    2j + 1 (dot_pair); the lanes' sums restarting every DOT_BLOCK elements, each block's sums
    added to the lanes; the halving tree over the lanes; the last elements in order; that sum
    added to the segment's start (the f32 bias in the first, +0.0 after); the segments added in
    order."""
    xf, wf = reference.bf16_widen(x), reference.bf16_widen(w)
    rows, cols = xf.shape
    nl = _gemm.dot_rule()[0]
    y = None
    for s0 in range(0, cols, seg_len):
        xs, ws = xf[:, s0:s0 + seg_len], wf[:, s0:s0 + seg_len]
        kt = xs.shape[1]
        kv = kt - kt % (2 * nl)
        lanes = np.zeros((rows, ws.shape[0], nl), np.float32)
        for b0 in range(0, kv, _gemm.DOT_BLOCK):
            block = np.zeros_like(lanes)
            for v in range(b0, min(kv, b0 + _gemm.DOT_BLOCK), 2 * nl):
                xv, wv = xs[:, None, v:v + 2 * nl], ws[None, :, v:v + 2 * nl]
                block = dot_pair(block, xv[..., 0::2], wv[..., 0::2], xv[..., 1::2],
                                 wv[..., 1::2])
            lanes = lanes + block
        h = nl // 2
        while h >= 1:
            lanes = lanes[..., :h] + lanes[..., h:2 * h]
            h //= 2
        total = lanes[..., 0]
        for k in range(kv, kt):
            total = total + xs[:, None, k] * ws[None, :, k]
        seg = (bias if s0 == 0 and bias is not None else np.float32(0.0)) + total
        y = seg if y is None else y + seg
    return y


@needs_dot
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 12, 17, 31])
def test_dot_route_bytes_are_its_stated_order(rng, rows):
    """Byte for byte, the dot-product route equals its order written out in numpy (one rounding
    an operation, or the instruction's rule): whatever its tiles -- 8 weight rows by up to 4 (2
    on Arm) rows of x over whole rows, or 4 by 4 over spans of blocks -- each lane adds its
    pairs in k order. 47 outputs leave weight rows past the last whole tile; the in-dimension
    leaves a partial block, a tail of 5 and, above 4 rows, segments of 12288."""
    cols = 2 * 12288 + 4096 + 37
    x, w, b = case(rng, rows, cols, 47, True, True, "f32")
    route, blocks = plan(rows, w.dtype, x_dtype=x.dtype)
    seg_len = STREAM_SEGMENT if rows > STREAM_FEW_ROWS else cols
    assert route == "dot" and segments(rows, 47, cols, route, blocks)[1] == seg_len
    want = dot_route_model(x, w, b, seg_len)
    assert ltx2blas.linear(x, w, b, threads=2).tobytes() == want.tobytes()
    # the task's rows fix the tiles, not the order
    for other in ((2, 5, blocks[2]), (8, 47, blocks[2]), (16, 9, blocks[2])):
        assert ltx2blas.linear(x, w, b, blocks=other).tobytes() == want.tobytes(), other


@needs_dot
@pytest.mark.parametrize("rows", [33, 70, 130])
def test_dot_panel_bytes_do_not_depend_on_where_x_is_packed(rng, rows):
    """The dot-product panel route packs x whole, once, where its tasks' rows start strips of
    32 (the default blocks), and each task's rows a chunk at a time where not: the same sums
    in the same order either way, so the same bytes, with an odd in-dimension (the last pair
    holds one element) and task rows cutting strips or not."""
    from ltx2blas import _linear
    x, w, b = case(rng, rows, 2 * 12288 + 4096 + 37, 45, True, True, "f32")
    route, blocks = plan(rows, w.dtype, x_dtype=x.dtype)
    product = _gemm.PRODUCTS[route]
    _, length = segments(rows, 45, x.shape[1], route, blocks)
    assert route == "dot_panel" and _linear.takes_packed_x(product, *blocks[::2], length)
    assert not _linear.takes_packed_x(product, 48, blocks[2], length)
    y = ltx2blas.linear(x, w, b, threads=2)
    for other in ((48, 40, blocks[2]), (96, 8, blocks[2]), (32, 128, blocks[2])):
        assert ltx2blas.linear(x, w, b, blocks=other, threads=2).tobytes() == y.tobytes(), other


def dot_panel_model(x, w, bias, seg_len):
    """The dot-product panel route's stated order in numpy, for bf16 x and weight whose
    products and sums stay normal: per segment of seg_len in-features, from the segment's start
    (the f32 bias in the first, +0.0 after), each chunk of DOT_PANEL_CHUNK in-features summed
    from +0.0 pair by pair in order (dot_pair), an odd last element's product added in f32,
    the chunk's sum added; the segments added in order."""
    xf, wf = reference.bf16_widen(x), reference.bf16_widen(w)
    cols = xf.shape[1]
    y = None
    for s0 in range(0, cols, seg_len):
        acc = np.zeros((xf.shape[0], wf.shape[0]), np.float32)
        if s0 == 0 and bias is not None:
            acc = acc + bias
        for c0 in range(s0, min(cols, s0 + seg_len), _gemm.DOT_PANEL_CHUNK):
            c1 = min(cols, s0 + seg_len, c0 + _gemm.DOT_PANEL_CHUNK)
            c = np.zeros_like(acc)
            for k in range(c0, c1 - 1, 2):
                c = dot_pair(c, xf[:, None, k], wf[None, :, k], xf[:, None, k + 1],
                             wf[None, :, k + 1])
            if (c1 - c0) % 2:
                c = c + xf[:, None, c1 - 1] * wf[None, :, c1 - 1]
            acc = acc + c
        y = acc if y is None else y + acc
    return y


@needs_dot
@pytest.mark.parametrize("rows", [33, 70])
def test_dot_panel_bytes_are_its_stated_order(rng, rows):
    """Byte for byte, the dot-product panel route equals its order written out in numpy, with
    strips cut by the rows (33: one row past a strip; 70: past two), a last row block shorter
    than the kernel's (13 outputs), a last chunk of odd length and two segments."""
    cols = STREAM_SEGMENT + 1024 + 37
    x, w, b = case(rng, rows, cols, 13, True, True, "f32")
    route, blocks = plan(rows, w.dtype, x_dtype=x.dtype)
    _, seg_len = segments(rows, 13, cols, route, blocks)
    assert route == "dot_panel" and seg_len == STREAM_SEGMENT
    want = dot_panel_model(x, w, b, seg_len)
    assert ltx2blas.linear(x, w, b, threads=2).tobytes() == want.tobytes()


def adversarial_bf16(rng, rows, cols, feats, kind):
    """bf16 x and weight (as uint16 bits) made to stress a dot-product route's additions:
    "cancellation" -- every pair of terms nearly cancels (x[2i + 1] = x[2i], w[2i + 1] close to
    -w[2i]), so the sums are tiny beside the terms' magnitudes; "near_overflow" -- terms of about
    2^112 whose magnitudes add up to within a few binades of the largest f32."""
    xr = rng.standard_normal((rows, cols), dtype=np.float32)
    wr = rng.standard_normal((feats, cols), dtype=np.float32)
    if kind == "cancellation":
        xr[:, 1::2] = xr[:, 0::2][:, :xr[:, 1::2].shape[1]]
        pairs = wr[:, 1::2].shape[1]
        wr[:, 1::2] = -wr[:, 0::2][:, :pairs] * np.float32(1 + 2.0**-7) + np.float32(1e-3) * wr[:, 1::2]
    else:
        scale = np.float32(2.0**56)
        xr, wr = xr * scale, wr * scale
    return reference.bf16_round(xr), reference.bf16_round(wr)


@needs_dot
@pytest.mark.parametrize("kind", ["cancellation", "near_overflow"])
@pytest.mark.parametrize("rows", [3, 9, 40])
def test_dot_routes_on_adversarial_sums_within_the_bound_for_every_thread_count(rng, kind,
                                                                                rows):
    """Sums that cancel and sums near the top of the f32 range, on both dot-product routes (3
    and 9 rows stream, 40 take the panel): within the derived bound, and the same bytes on 1,
    2, 3 and 4 threads."""
    cols = 2 * 12288 + 2048 + 21
    x, w = adversarial_bf16(rng, rows, cols, 11, kind)
    y = ltx2blas.linear(x, w, threads=1)
    assert np.all(np.isfinite(y))
    err = np.abs(y - exact(x, w))
    assert np.all(err <= error_bound(x, w) + f32_ulp(y) / 2)
    for threads in (2, 3, 4):
        assert ltx2blas.linear(x, w, threads=threads).tobytes() == y.tobytes(), threads


@needs_dot
@pytest.mark.parametrize("rows", [6, 40])
def test_dot_route_flushes_subnormals_within_the_bound(rng, rows):
    """VDPBF16PS treats subnormal inputs as zero and flushes subnormal products and sums: on
    terms made of them the result departs from the exact sum by what error_bound adds for the
    dot-product routes, and no more."""
    cols = 4096 + 41
    x, w, _ = case(rng, rows, cols, 9, True, True, None)
    x[:, ::7] = 0x0040                  # 2**-127 * 1.0 (bf16 subnormal) ...
    w[:, ::7] = 0x7E80                  # ... times 2**126: a product of 0.5 that is flushed
    x[:, 3::11] = 0x0F80                # 2**-96 x 2**-40: a subnormal product
    w[:, 3::11] = 0x2B80
    y = ltx2blas.linear(x, w)
    err = np.abs(y - exact(x, w))
    bound = error_bound(x, w)
    assert np.all(err <= bound + f32_ulp(y) / 2)
    gamma_only = gamma(rows, cols, w.dtype, feats=9, x_dtype=x.dtype) * (
        np.abs(as_f64(x)) @ np.abs(as_f64(w)).T)
    assert np.any(err > gamma_only)     # the flushing is real, and the bound carries it


@pytest.mark.parametrize("rows", [70, 600])
@pytest.mark.parametrize("accumulate", ["f32", "f64"])
def test_segments_of_the_sgemm_routes_keep_bytes_and_bound(rng, monkeypatch, rows, accumulate):
    """Several segments on the sgemm and f64 routes (6 and 2 output blocks here): the same bytes
    for any thread count, within the derived bound, which counts the segments' additions."""
    monkeypatch.setattr(linear_layer, "panel_above_stream_rows", lambda: False)
    x, w, b = case(rng, rows, 9000, 300)
    route, blocks = plan(rows, w.dtype, accumulate)
    count, _ = segments(rows, 300, 9000, route, blocks)
    assert count > 1
    y = ltx2blas.linear(x, w, b, accumulate=accumulate, threads=2)
    assert ltx2blas.linear(x, w, b, accumulate=accumulate, threads=1).tobytes() == y.tobytes()
    sample = slice(0, rows, max(1, rows // 12))
    ref = exact(x[sample], w, b)
    if accumulate == "f64":  # the exact sum, rounded once
        assert np.all(np.abs(y[sample] - ref) <= f32_ulp(ref) / 2)
    else:  # gamma of this call's cut (error_bound on the sampled rows would plan other blocks)
        g = gamma(rows, 9000, w.dtype, feats=300)
        assert g <= gamma(rows, 9000, w.dtype)  # no more additions along a segment than along all
        magnitude = np.abs(as_f64(x[sample])) @ np.abs(as_f64(w)).T + np.abs(as_f64(b))
        assert np.all(np.abs(y[sample] - ref) <= g * magnitude + f32_ulp(y[sample]) / 2)


def panel_order(x, w, b, seg_len, chunk=_gemm.PANEL_CHUNK):
    """The panel route's sums written out with mul then add, each rounded to f32 (the base
    table's arithmetic): every chunk of ``chunk`` in-features from +0.0 in order, the chunks
    added to the segment's sum (the first segment's starting from the bias), then the
    segments added in order."""
    x32, w32 = as_f64(x).astype(np.float32), as_f64(w).astype(np.float32)
    segs = []
    for s0 in range(0, x32.shape[1], seg_len):
        acc = np.zeros((x32.shape[0], w32.shape[0]), np.float32)
        if s0 == 0 and b is not None:
            acc = acc + b.astype(np.float32)
        for c0 in range(s0, min(x32.shape[1], s0 + seg_len), chunk):
            s = np.zeros_like(acc)
            for k in range(c0, min(x32.shape[1], s0 + seg_len, c0 + chunk)):
                s = s + np.outer(x32[:, k], w32[:, k])  # f32 products, f32 sums
            acc = acc + s
        segs.append(acc)
    y = segs[0]
    for part in segs[1:]:
        y = y + part
    return y


@pytest.mark.parametrize("rows, cols, feats", [(48, 1100, 13), (19, 1030, 7), (1, 517, 9),
                                              (64, STREAM_SEGMENT + 700, 11)])
def test_panel_kernel_in_every_table(kernel_table, rng, monkeypatch, rows, cols, feats):
    # Every table's panel kernel, whatever rows it is the default for: partial strips (19, 1
    # rows), a last row block shorter than the table's (7, 9, 11, 13 features), chunks of 512
    # with a tail that is not a multiple of 8, and two segments.
    monkeypatch.setattr(linear_layer, "_panel_min_rows", lambda: 1)
    x, w, b = case(rng, rows, cols, feats)
    assert plan(rows, w.dtype)[0] == "panel"
    y = ltx2blas.linear(x, w, b, threads=2)
    assert np.all(np.abs(y - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)
    assert ltx2blas.linear(x, w, b, threads=1).tobytes() == y.tobytes()
    # The tasks' row and feature blocks do not change any output's sum.
    for blocks in ((5, 3, 1 << 18), (16, 6, 1 << 18), (rows, 1, 1 << 18)):
        assert ltx2blas.linear(x, w, b, blocks=blocks).tobytes() == y.tobytes()
    if kernel_table == "base":  # no contraction: the order written out, byte for byte
        seg_len = segments(rows, feats, cols, *plan(rows, w.dtype))[1]
        assert y.tobytes() == panel_order(x, w, b, seg_len).tobytes()


@pytest.mark.parametrize("core, table, above", [
    ("Haswell", "avx512bf16", True), ("Zen", "avx512", True), ("SkylakeX", "avx512bf16", False),
    ("SapphireRapids", "avx512", False), ("Haswell", "avx2", False), (None, "avx512bf16", False),
    ("neoversen2", "neon", False)])
def test_panel_route_above_stream_rows_where_the_blas_is_narrower(monkeypatch, core, table,
                                                                  above):
    # Only an AVX-512 table beside a BLAS core known to run narrower sgemm vectors takes the
    # panel route above STREAM_ROWS rows; an unknown BLAS keeps sgemm, as does an f32 weight.
    monkeypatch.setattr(linear_layer, "_blas_core", lambda: core)
    monkeypatch.setattr(linear_layer._gemm, "kernel_name", lambda allow_fma=True: table)
    assert linear_layer.panel_above_stream_rows() is above
    assert plan(65, np.uint16) == (("panel", STREAM_WIDE_BLOCKS) if above
                                   else ("sgemm", BLOCKS["sgemm"]))
    assert plan(64, np.uint16)[0] != "sgemm"
    assert plan(65, np.float32)[0] == "sgemm"
    assert plan(65, np.uint16, "f64")[0] == "f64"


@pytest.mark.parametrize("rows", [65, 200])
def test_panel_route_above_stream_rows_in_every_table(kernel_table, rng, monkeypatch, rows):
    # Row blocks of STREAM_ROWS and a shorter last one, two segments: within the bound, the
    # same bytes on one and two threads and for any task blocks, and the sgemm route's
    # result within its own bound beside it.
    monkeypatch.setattr(linear_layer, "panel_above_stream_rows", lambda: True)
    x, w, b = case(rng, rows, STREAM_SEGMENT + 900, 21)
    assert plan(rows, w.dtype) == ("panel", STREAM_WIDE_BLOCKS)
    y = ltx2blas.linear(x, w, b, threads=2)
    assert np.all(np.abs(y - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)
    assert ltx2blas.linear(x, w, b, threads=1).tobytes() == y.tobytes()
    assert ltx2blas.linear(x, w, b, blocks=(16, 5, 1 << 18)).tobytes() == y.tobytes()
    monkeypatch.setattr(linear_layer, "panel_above_stream_rows", lambda: False)
    assert plan(rows, w.dtype)[0] == "sgemm"
    y_sgemm = ltx2blas.linear(x, w, b, threads=2)
    assert np.all(np.abs(y_sgemm - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(y) / 2)


def test_panel_route_agrees_with_the_streaming_route_within_both_bounds(rng, monkeypatch):
    # 64 rows at two segments' width on the table in use, by both routes.
    x, w, b = case(rng, 64, 2 * STREAM_SEGMENT, 24)
    routes = {}
    for rows_from in (1, 0):  # panel, then never panel: the streaming kernel
        monkeypatch.setattr(linear_layer, "_panel_min_rows", lambda r=rows_from: r)
        routes[plan(64, w.dtype)[0]] = (ltx2blas.linear(x, w, b), error_bound(x, w, b))
    assert set(routes) == {"panel", "stream"}
    sample = slice(0, 64, 9)
    ref = exact(x[sample], w, b)
    for y, bound in routes.values():
        assert np.all(np.abs(y[sample] - ref) <= bound[sample] + f32_ulp(y[sample]) / 2)


@pytest.mark.parametrize("route", ["stream", "dot_panel", "sgemm"])
def test_passes_of_segments_keep_the_bytes(rng, monkeypatch, route):
    """The segments run in passes (one segment a pass, two with a shorter last pass, three,
    every one): the same bytes as every segment in one pass, on 1 and 2 threads and with
    progress cutting the call into waves across the passes; each pass's buffers sized for the
    pass alone."""
    if route == "dot_panel" and not _gemm.has_dot_linear():
        pytest.skip("the kernel table in use has no dot-product Linear")
    rows = {"stream": 20, "dot_panel": 40, "sgemm": 80}[route]
    cols = 4 * STREAM_SEGMENT + 300 if route != "sgemm" else 9000
    x, w, b = case(rng, rows, cols, 45, route == "dot_panel", True, "f32")
    got_route, blocks = plan(rows, w.dtype, x_dtype=x.dtype)
    if got_route != route:
        pytest.skip(f"{rows} rows take the {got_route} route on this kernel table and BLAS")
    count, _ = segments(rows, 45, cols, route, blocks)
    assert count >= 4
    whole = ltx2blas.linear(x, w, b, threads=2)  # the default passes
    sizes = {}
    real_empty = np.empty

    def empty(shape, *args, **kwargs):  # the partial sums' shape, as linear() allocates it
        if isinstance(shape, tuple) and len(shape) == 3:
            sizes.setdefault(per_pass[0], []).append(shape[0])
        return real_empty(shape, *args, **kwargs)

    per_pass = [count]
    monkeypatch.setattr(linear_layer, "segments_per_pass", lambda *a: per_pass[0])
    # waves of 3 tasks, which start and stop inside passes
    monkeypatch.setattr(linear_layer, "waves",
                        lambda tasks, threads: [(f, min(tasks, f + 3)) for f in range(0, tasks, 3)])
    monkeypatch.setattr(linear_layer.np, "empty", empty)
    every = ltx2blas.linear(x, w, b, threads=2)
    assert every.tobytes() == whole.tobytes()
    for n in (1, 2, 3):
        per_pass[0] = n
        for threads in (1, 2):
            seen = []
            y = ltx2blas.linear(x, w, b, threads=threads, progress=seen.append)
            assert y.tobytes() == every.tobytes(), (n, threads)
            assert len(seen) > 1
    assert sizes == {count: [count], 2: [2, 2], 3: [3, 3]}  # none where a pass is one segment
    assert np.all(np.abs(every - exact(x, w, b)) <= error_bound(x, w, b) + f32_ulp(every) / 2)
