"""The text feature extractor: the features are the reference's bit for bit, each projection is
byte-identical to ltx2blas.linear on the materialised features and within the derived bound of
the exact projection, padded rows are skipped and carry the bias (V2) or zeros (V1), as
upstream's Linear gives on their zero features, nothing depends on the thread count,
and the features are never materialised."""
import json
import subprocess
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.linear_layer import error_bound


def hidden(rng, shape, bf16=True, scale=3.0):
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    return reference.bf16_round(x) if bf16 else x


def projections(rng, version, width, outs=None):
    outs = outs or ((24,) if version == "v1" else (24, 12))
    ws = [reference.bf16_round(rng.standard_normal((o, width)).astype(np.float32) * 0.05) for o in outs]
    bs = [None] * len(ws) if version == "v1" else [rng.standard_normal(o).astype(np.float32) for o in outs]
    return list(zip(ws, bs))


def masks(batch, tokens):
    right = np.ones((batch, tokens), bool)
    right[0, tokens * 2 // 3:] = False          # right padding
    left = np.ones((batch, tokens), bool)
    left[-1, : tokens // 3] = False             # left padding
    empty = right.copy()
    empty[-1] = False                           # a sample with no valid token
    return {"right": right, "left": left, "none-valid": empty, "all": np.ones((batch, tokens), bool)}


def within_bound(got, projections_, feats_by_proj, mask):
    """|got - exact| <= the derived bound of the route linear() takes on the bf16 features
    (gamma * sum|f w| (+ |bias|), and on the dot-product route what flushing subnormals can
    lose) + half an ulp, on valid rows; 0 elsewhere."""
    for y, (w, b), f in zip(got, projections_, feats_by_proj):
        x = reference.bf16_widen(f[mask]).astype(np.float64)
        w64 = reference.bf16_widen(w).astype(np.float64)
        exact = x @ w64.T + (0 if b is None else b.astype(np.float64))
        ulp = np.spacing(np.abs(y[mask])).astype(np.float64)
        assert np.all(np.abs(y[mask] - exact) <= error_bound(f[mask], w, b) + ulp / 2)
        padded = np.broadcast_to(np.float32(0) if b is None else b, y[~mask].shape)
        assert np.array_equal(y[~mask], padded)  # F.linear on zero features: the bias


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("mask_kind", ["right", "left", "none-valid", "all"])
@pytest.mark.parametrize("bf16", [True, False])
def test_features_and_projections(rng, version, mask_kind, bf16):
    b_n, t_n, d_n, l_n = 3, 11, 16, 7
    h = hidden(rng, (b_n, t_n, d_n, l_n), bf16)
    mask = masks(b_n, t_n)[mask_kind]
    projs = projections(rng, version, d_n * l_n)
    got = ltx2blas.text_features(h, mask, projs, version=version)
    feats = []
    for (w, b), y in zip(projs, got):
        assert y.shape == (b_n, t_n, w.shape[0]) and y.dtype == np.float32
        f = ltx2blas.normalized_features(h, mask, version=version, out_features=w.shape[0])
        assert np.array_equal(f, reference.text_features_normalized(h, mask, version, w.shape[0]))
        assert np.array_equal(y[mask], ltx2blas.linear(f[mask], w, b))  # same additions, in order
        feats.append(f)
    within_bound(got, projs, feats, mask)


def test_v1_audio_video_returns_one_array_for_both(rng):
    h = hidden(rng, (2, 9, 16, 5))
    mask = masks(2, 9)["right"]
    projs = projections(rng, "v1", 80)
    video, audio = ltx2blas.text_features(h, mask, projs, version="v1", audio_video=True)
    assert audio is video
    assert np.array_equal(video, ltx2blas.text_features(h, mask, projs, version="v1")[0])
    with pytest.raises(ValueError, match="audio_video"):
        ltx2blas.text_features(h, mask, projections(rng, "v2", 80), version="v2", audio_video=True)


def test_v2_padded_rows_are_the_bias(rng):
    """Every padded row, and every row of a sample with no valid token, is the bias exactly."""
    h = hidden(rng, (2, 7, 16, 5))
    mask = masks(2, 7)["none-valid"]
    projs = projections(rng, "v2", 80)
    for (w, b), y in zip(projs, ltx2blas.text_features(h, mask, projs, version="v2")):
        assert np.array_equal(y[~mask], np.broadcast_to(b, y[~mask].shape))
        assert not np.array_equal(y[mask], np.broadcast_to(b, y[mask].shape))


@pytest.mark.parametrize("tokens", [5, 90])  # the streaming route and the sgemm route
def test_thread_count_does_not_change_bytes(rng, tokens):
    h = hidden(rng, (2, tokens, 24, 5))
    mask = masks(2, tokens)["right"]
    projs = projections(rng, "v2", 120, (40, 300))
    first = ltx2blas.text_features(h, mask, projs, version="v2", threads=1)
    for threads in (2, 3):
        again = ltx2blas.text_features(h, mask, projs, version="v2", threads=threads)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


@pytest.mark.parametrize("route_asked", ["sgemm", "panel", "dot"])
def test_projections_cut_into_segments_are_the_linears_bytes(rng, monkeypatch, route_asked):
    """V2 on the sgemm route with in-dimensions cut differently per projection (25 segments of
    two chunks, taken in two steps, for 1300 outputs; 50 of one chunk for 40), on the panel
    route and on the dot-product route where the CPU has it (3 segments each): each
    projection byte-identical to linear() on the materialised features, for 1 and 2 threads."""
    from ltx2blas import _gemm, linear_layer
    from ltx2blas.linear_layer import plan, segments
    if route_asked == "dot" and not _gemm.has_dot_linear():
        pytest.skip(f"the {_gemm.kernel_name()} kernel table has no dot-product Linear "
                    "(it needs AVX512_BF16)")
    if route_asked != "dot":  # the f32-x routes on every table
        monkeypatch.setattr(_gemm, "has_dot_linear", lambda: False)
        monkeypatch.setattr(linear_layer, "panel_above_stream_rows",
                            lambda: route_asked == "panel")
    h = hidden(rng, (1, 520, 64, 400))
    mask = np.ones((1, 520), bool)
    projs = projections(rng, "v2", 25600, (1300, 40))
    route, blocks = plan(520, np.uint16, x_dtype=np.uint16)
    wanted = {"sgemm": ("sgemm", [25, 50]), "panel": ("panel", [3, 3]),
              "dot": ("dot_panel", [3, 3])}[route_asked]
    assert route == wanted[0]
    assert [segments(520, o, 25600, route, blocks)[0] for o in (1300, 40)] == wanted[1]
    got = ltx2blas.text_features(h, mask, projs, version="v2", threads=2)
    again = ltx2blas.text_features(h, mask, projs, version="v2", threads=1)
    for (w, b), y, y1 in zip(projs, got, again):
        f = ltx2blas.normalized_features(h, mask, version="v2", out_features=w.shape[0])
        assert y.tobytes() == y1.tobytes()
        assert y[mask].tobytes() == ltx2blas.linear(f[mask], w, b).tobytes()


def test_the_projections_run_the_linears_tasks_at_every_real_shape(rng, monkeypatch):
    """The feature extractor runs each projection's tasks as linear() cuts them (checked on a
    small call: every pass's tasks, and as many in each pass as linear() runs), so at LTX-2's
    widths (V1: 3840 out; V2: 4096 + 2048) it runs 256 or more."""
    from ltx2blas import _features, _linear, features
    from ltx2blas.linear_layer import plan, segments, segments_per_pass, task_count
    ran = []

    class Recorded(_features.FeaturePlan):
        def __init__(self, *args):
            super().__init__(*args)
            ran.append([self.tasks(s) for s in range(self.steps) if self.ends_pass(s) >= 0])

    monkeypatch.setattr(features._features, "FeaturePlan", Recorded)
    h = hidden(rng, (1, 90, 64, 200))
    projs = projections(rng, "v2", 12800, (300, 40))
    ltx2blas.text_features(h, np.ones((1, 90), bool), projs, version="v2", threads=2)
    bf16 = np.uint16  # the features are bf16
    assert [sum(passes) for passes in ran] == [task_count(90, o, 12800, np.uint16, x_dtype=bf16)
                                               for o in (300, 40)]
    route, blocks = plan(90, np.uint16, x_dtype=bf16)
    for passes, o in zip(ran, (300, 40)):
        count, _ = segments(90, o, 12800, route, blocks)
        per_segment = _linear.block_count(90, o, blocks[0], blocks[1])
        per_pass = segments_per_pass(count, per_segment, route, 2)
        assert passes == [per_segment * min(per_pass, count - i)
                          for i in range(0, count, per_pass)]
    for tokens in (1, 3, 8, 64, 65, 200, 1024, 2048):
        assert task_count(tokens, 3840, 188160, np.uint16, x_dtype=bf16) >= 256
        assert sum(task_count(tokens, o, 188160, np.uint16, x_dtype=bf16)
                   for o in (4096, 2048)) >= 256


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_real_width(rng, version):
    """D = 3840, L = 49: 188,160 features per token."""
    h = hidden(rng, (1, 5, 3840, 49))
    mask = np.array([[True, True, True, True, False]])
    projs = projections(rng, version, 188160, (8,) if version == "v1" else (8, 4))
    got = ltx2blas.text_features(h, mask, projs, version=version)
    feats = [reference.text_features_normalized(h, mask, version, w.shape[0]) for w, _ in projs]
    for (w, _), f in zip(projs, feats):
        assert np.array_equal(ltx2blas.normalized_features(h, mask, version=version, out_features=w.shape[0]), f)
    within_bound(got, projs, feats, mask)


def test_non_finite_hidden_states_propagate_like_the_reference(rng):
    h = hidden(rng, (2, 6, 8, 3))
    h[0, 1, 2, 1] = 0x7FC0   # NaN: V1 spreads it over sample 0's layer 1; V2 over token (0, 1)
    mask = np.ones((2, 6), bool)
    for version in ("v1", "v2"):
        f = ltx2blas.normalized_features(h, mask, version=version, out_features=8)
        fr = reference.text_features_normalized(h, mask, version, 8)
        nan = np.isnan(reference.bf16_widen(fr))
        assert nan.any() and np.array_equal(np.isnan(reference.bf16_widen(f)), nan)
        assert np.array_equal(f[~nan], fr[~nan])


@pytest.mark.parametrize("layers", [7, 49])
@pytest.mark.parametrize("bf16", [True, False])
def test_the_normalisation_is_the_references_on_every_kernel_table(rng, kernel_table, layers,
                                                                    bf16):
    """The normalisation runs a vector of features at a time, each lane with its layer's
    statistics: on every kernel table the CPU runs, the reference's bits for V1 and V2, with
    fewer layers than a vector and more, rows whose length leaves a tail, a zero and a
    subnormal token, negative zeros, an infinity and a NaN (spread as the reference spreads
    them)."""
    x = rng.standard_normal((2, 6, 13, layers)).astype(np.float32) * np.float32(3.0)
    x[0, 1] = 0.0
    x[0, 2, :, ::2] = -0.0
    x[0, 3] = np.float32(3e-39) * np.sign(x[0, 3])      # subnormal in f32 and in bf16
    x[1, 2, 4, 1] = np.inf
    x[1, 4, 0, layers - 1] = np.nan
    h = reference.bf16_round(x) if bf16 else x
    mask = np.ones((2, 6), bool)
    mask[1, 5] = False
    for version in ("v1", "v2"):
        f = ltx2blas.normalized_features(h, mask, version=version, out_features=40)
        fr = reference.text_features_normalized(h, mask, version, 40)
        nan = np.isnan(reference.bf16_widen(fr))
        assert nan.any() and np.array_equal(np.isnan(reference.bf16_widen(f)), nan)
        assert f[~nan].tobytes() == fr[~nan].tobytes()


def test_progress(rng, monkeypatch):
    from ltx2blas import _gemm, _threads, linear_layer
    monkeypatch.setattr(_threads, "MIN_ROUNDS", 1)   # waves of one round: several here
    monkeypatch.setattr(_gemm, "has_dot_linear", lambda: False)  # the sgemm route everywhere
    monkeypatch.setattr(linear_layer, "panel_above_stream_rows", lambda: False)
    h = hidden(rng, (1, 80, 64, 200))   # 12,800 features, 25 segments (sgemm route)
    seen = []
    ltx2blas.text_features(h, np.ones((1, 80), bool), projections(rng, "v1", 12800),
                           progress=seen.append, threads=2)
    # reported after each wave of tasks
    assert seen[-1] == 1.0 and len(seen) >= 4 and all(a < b for a, b in zip(seen, seen[1:]))


def test_bad_input(rng):
    h = hidden(rng, (2, 4, 8, 3))
    mask = np.ones((2, 4), bool)
    projs = projections(rng, "v1", 24)
    with pytest.raises(errors.ShapeError, match="B, T, D, L"):
        ltx2blas.text_features(h[0], mask, projs)
    with pytest.raises(errors.ShapeError, match="attention_mask"):
        ltx2blas.text_features(h, mask[:, :3], projs)
    with pytest.raises(errors.DTypeError, match="attention_mask"):
        ltx2blas.text_features(h, mask.astype(np.float32), projs)
    with pytest.raises(errors.DTypeError, match="hidden_states"):
        ltx2blas.text_features(h.astype(np.float64), mask, projs)
    with pytest.raises(errors.ShapeError, match="expected \\[out, 24\\]"):
        ltx2blas.text_features(h, mask, projections(rng, "v1", 25))
    with pytest.raises(ValueError, match="one projection"):
        ltx2blas.text_features(h, mask, projections(rng, "v2", 24))
    with pytest.raises(ValueError, match="version"):
        ltx2blas.text_features(h, mask, projs, version="v3")
    with pytest.raises(errors.LayoutError):
        ltx2blas.text_features(np.asfortranarray(h), mask, projs)
    with pytest.raises(ValueError, match="out_features"):
        ltx2blas.normalized_features(h, mask, version="v2")


@pytest.mark.parametrize("kwargs, error, message", [
    ({"progress": 5}, errors.ArgumentTypeError, "progress"),
    ({"progress": "x"}, errors.ArgumentTypeError, "progress"),
    ({"audio_video": "yes"}, errors.ArgumentTypeError, "audio_video"),
    ({"audio_video": np.array([1, 0])}, errors.ArgumentTypeError, "audio_video"),
    ({"version": np.array(["v1", "v2"])}, errors.ArgumentError, "version"),
    ({"projections": None}, errors.ArgumentTypeError, "projections"),
    ({"projections": 3}, errors.ArgumentTypeError, "projections"),
    ({"threads": True}, errors.ArgumentTypeError, "threads"),
])
@pytest.mark.parametrize("valid", [True, False], ids=["tokens", "no-valid-token"])
def test_every_bad_argument_is_refused_before_any_work(rng, monkeypatch, kwargs, error, message,
                                                       valid):
    """Each is an Ltx2BlasError raised before the statistics run, with valid tokens or none: a
    progress found bad only when it is called would fail after the first wave, or after the
    bias is in place where no token is valid."""
    from ltx2blas import features

    def work_started(*args):
        raise AssertionError("the statistics ran before the arguments were checked")

    monkeypatch.setattr(features, "_statistics", work_started)
    h = hidden(rng, (2, 4, 8, 3))
    args = {"hidden_states": h, "attention_mask": np.full((2, 4), valid),
            "projections": projections(rng, "v1", 24), **kwargs}
    with pytest.raises(error, match=message):
        ltx2blas.text_features(**args)


@pytest.mark.parametrize("kwargs, error", [
    ({"version": "v2", "out_features": "x"}, errors.ArgumentTypeError),
    ({"version": "v2", "out_features": 2.5}, errors.ArgumentTypeError),
    ({"version": "v2", "out_features": True}, errors.ArgumentTypeError),
    ({"version": "v2", "out_features": -5}, errors.ArgumentError),
    ({"version": "v2", "out_features": 0}, errors.ArgumentError),
    ({"version": "v1", "out_features": "x"}, errors.ArgumentTypeError),
])
@pytest.mark.parametrize("valid", [True, False], ids=["tokens", "no-valid-token"])
def test_normalized_features_checks_out_features(rng, kwargs, error, valid):
    h = hidden(rng, (2, 4, 8, 3))
    with pytest.raises(error, match="out_features"):
        ltx2blas.normalized_features(h, np.full((2, 4), valid), **kwargs)


def test_normalized_features_checks_threads_without_work_to_do(rng):
    h = hidden(rng, (2, 4, 8, 3))
    with pytest.raises(errors.ArgumentError, match="threads"):
        ltx2blas.normalized_features(h, np.zeros((2, 4), bool), threads=0)


SCRIPT = r"""
import json, numpy as np, ltx2blas
def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024
rng = np.random.default_rng(0)
tokens = 256
h = rng.integers(0x3800, 0x4000, size=(1, tokens, 3840, 49), dtype=np.uint16)
mask = np.ones((1, tokens), bool); mask[0, 200:] = False
ws = [rng.integers(0x2000, 0x2400, size=(o, 188160), dtype=np.uint16) for o in (64, 32)]
projs = [(w, np.zeros(w.shape[0], np.float32)) for w in ws]
ltx2blas.text_features(h[:, :20].copy(), mask[:, :20].copy(), projs, version="v2")  # warm up
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS')
ltx2blas.text_features(h, mask, projs, version="v2", threads=2)
# what the feature extractor holds by design: per projection, one chunk of each segment of the
# in-dimension for every valid row (512 f32 features on the sgemm route, 2048 bf16 on the
# dot-product route), and each segment's sums
from ltx2blas.linear_layer import DOT_ROUTES, plan, segments
route, blocks = plan(200, np.uint16, x_dtype=np.uint16)
size = 2 if route in DOT_ROUTES else 4
held = 0
for w in ws:
    count, length = segments(200, w.shape[0], 188160, route, blocks)
    held += count * 200 * min(blocks[2], length) * size + count * 200 * w.shape[0] * 4
print(json.dumps({"growth": status('VmHWM') - before, "features_f32": 200 * 188160 * 4,
                  "held": held}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_features_are_never_materialised():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    # The flattened f32 features of the 200 valid rows alone would be 150 MB; the panels and
    # sums held are a fifth of that at these narrow outputs (34 segments of the sgemm route, or
    # 16 of the dot-product route's bf16), and less at LTX-2's.
    assert m["held"] < m["features_f32"] / 4, m
    assert m["growth"] <= m["held"] + 8 * 2**20, m


@pytest.mark.parametrize("per_pass", [1, 2, 3])
def test_passes_of_segments_keep_the_linears_bytes(rng, monkeypatch, per_pass):
    """The segments a pass at a time (five segments: one a pass; two or three, the last pass
    shorter): each
    projection's bytes are still linear()'s on the materialised features, on 1 and 2 threads,
    and progress still rises to 1.0."""
    from ltx2blas import linear_layer
    from ltx2blas.linear_layer import plan, segments

    h = hidden(rng, (1, 40, 64, 800))
    mask = np.ones((1, 40), bool)
    mask[0, 37:] = False
    projs = projections(rng, "v2", 51200, (130, 40))
    route, blocks = plan(37, np.uint16, x_dtype=np.uint16)
    assert [segments(37, o, 51200, route, blocks)[0] for o in (130, 40)] == [5, 5]
    want = [ltx2blas.linear(ltx2blas.normalized_features(h, mask, version="v2",
                                                         out_features=w.shape[0])[mask], w, b)
            for w, b in projs]
    monkeypatch.setattr(linear_layer, "segments_per_pass", lambda *a: per_pass)
    for threads in (1, 2):
        seen = []
        got = ltx2blas.text_features(h, mask, projs, version="v2", threads=threads,
                                     progress=seen.append)
        for y, y_want, (_, b) in zip(got, want, projs):
            assert y[mask].tobytes() == y_want.tobytes()
            assert y[~mask].tobytes() == np.broadcast_to(b, y[~mask].shape).tobytes()
        assert seen == sorted(seen) and seen[-1] == 1.0 and len(seen) >= 2 * -(-5 // per_pass)


@pytest.mark.parametrize("bf16", [True, False])
def test_row_statistics_are_the_scalar_loop_on_every_table(rng, kernel_table, bf16):
    """Each layer's sum and sum of squares (f64, over d in order from 0.0, each square rounded
    before it is added) and its min and max (NaN wins; of equal values the first), written out
    in plain Python: 13 layers (vectors of layers and the rest one at a time), a NaN in one
    layer, signed zeros, infinities, and rows taken out of order."""
    from ltx2blas import _features

    depth, layers = 37, 13
    h = hidden(rng, (1, 6, depth, layers), bf16)
    flat = h.reshape(6, depth * layers)
    flat[1, 5 * layers + 2] = reference.bf16_round(np.float32(np.nan)) if bf16 else np.nan
    flat[2, layers + 3] = 0x8000 if bf16 else -0.0
    flat[2, 3] = 0
    flat[3, 7 * layers + 11] = reference.bf16_round(np.float32(np.inf)) if bf16 else np.inf
    values = (reference.bf16_widen(flat) if bf16 else flat).astype(np.float32)
    rows = np.array([4, 1, 2, 3, 0], np.int64)
    n = rows.size
    sums, squares = np.empty((n, layers)), np.empty((n, layers))
    lows, highs = np.empty((n, layers), np.float32), np.empty((n, layers), np.float32)
    _features.row_stats(flat, rows, layers, sums, squares, lows, highs, 2)
    for i, r in enumerate(rows):
        for l in range(layers):
            s = q = 0.0
            low = high = values[r, l]
            for d in range(depth):
                f = values[r, d * layers + l]
                v = float(f)
                s, q = s + v, q + v * v
                if np.isnan(f) or np.isnan(low):
                    low = high = np.float32(np.nan)
                else:
                    low, high = (f if f < low else low), (f if f > high else high)
            assert (sums[i, l], squares[i, l]) == (s, q) or (np.isnan(s) and np.isnan(sums[i, l]))
            assert np.float32(lows[i, l]).tobytes() == np.float32(low).tobytes()
            assert np.float32(highs[i, l]).tobytes() == np.float32(high).tobytes()
    assert np.isnan(lows[1, 2]) and np.isnan(highs[1, 2]) and not np.isnan(lows[1, 3])
