"""Bad input to ltx2blas.linear (reliability items 30-37): a clear error of the right kind or a
correct result, inputs unchanged, never a silent downcast."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, linear_layer, reference

from helpers import random_bf16


@pytest.fixture
def arrays(rng):
    x = rng.standard_normal((5, 64), dtype=np.float32)
    w = random_bf16(rng, (12, 64), 0.02)
    b = rng.standard_normal(12, dtype=np.float32)
    return x, w, b


def reference_y(x, w, b=None):
    w64 = reference.bf16_widen(w).astype(np.float64) if w.dtype == np.uint16 else w.astype(np.float64)
    x64 = reference.bf16_widen(x).astype(np.float64) if x.dtype == np.uint16 else x.astype(np.float64)
    y = x64 @ w64.T
    return y if b is None else y + b


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.int16, np.complex64,
                                   object, ">f4", ">u2", np.uint8, bool])
@pytest.mark.parametrize("which", ["x", "weight", "bias"])
def test_wrong_dtypes(arrays, dtype, which):
    x, w, b = arrays
    args = {"x": x, "weight": w, "bias": b}
    args[which] = args[which].astype(dtype)
    with pytest.raises(TypeError, match=which) as info:
        ltx2blas.linear(args["x"], args["weight"], args["bias"])
    assert isinstance(info.value, errors.DTypeError)


@pytest.mark.parametrize("shapes, message", [
    (((5, 63), (12, 64), (12,)), "features"),
    (((5, 64), (12, 64, 1), (12,)), "2-D"),
    (((5, 64), (768,), (12,)), "2-D"),
    (((5, 64), (12, 64), (13,)), "bias"),
    (((5, 64), (12, 64), (12, 1)), "bias"),
])
def test_shape_mismatch(shapes, message):
    x, w, b = (np.zeros(s, np.float32) for s in shapes)
    with pytest.raises(errors.ShapeError, match=message):
        ltx2blas.linear(x, w, b)


def test_zero_d_x():
    with pytest.raises(errors.ShapeError, match="0-d"):
        ltx2blas.linear(np.ones((), np.float32), np.zeros((2, 1), np.float32))


@pytest.mark.parametrize("make", [np.asfortranarray, lambda a: a[:, ::2], lambda a: a[::-1],
                                  lambda a: np.ascontiguousarray(a.T).T],
                         ids=["fortran", "strided", "reversed", "transposed"])
@pytest.mark.parametrize("which", ["x", "weight"])
def test_strided_inputs_are_refused(arrays, make, which):
    x, w, b = arrays
    if which == "x":
        x = make(np.repeat(x, 2, axis=1) if make is not np.asfortranarray else x)
        if x.shape[1] != w.shape[1]:
            x = make(np.ascontiguousarray(np.repeat(arrays[0], 1, axis=1)))
    else:
        w = make(np.repeat(w, 2, axis=1) if "strided" in repr(make) else w)
    if (x if which == "x" else w).flags.c_contiguous:
        pytest.skip("this view is contiguous for this shape")
    with pytest.raises((errors.LayoutError, errors.ShapeError)):
        ltx2blas.linear(x, w, b)


def test_strided_bias_is_fine(arrays):
    x, w, b = arrays
    wide = np.repeat(b, 2)[::2]
    assert not wide.flags.c_contiguous
    assert np.allclose(ltx2blas.linear(x, w, wide), reference_y(x, w, b), rtol=1e-5, atol=1e-5)


def test_read_only_misaligned_and_memmap_inputs(arrays, tmp_path):
    x, w, b = arrays
    expected = ltx2blas.linear(x, w, b)
    for a in (x, w, b):
        a.flags.writeable = False
    assert ltx2blas.linear(x, w, b).tobytes() == expected.tobytes()
    raw = np.zeros(x.nbytes + 1, np.uint8)
    mis = raw[1:].view(np.float32).reshape(x.shape)
    mis[...] = x
    assert ltx2blas.linear(mis, w, b).tobytes() == expected.tobytes()
    path = tmp_path / "w.bin"
    w.tofile(path)
    mapped = np.memmap(path, dtype=np.uint16, mode="r", shape=w.shape)
    assert ltx2blas.linear(x, mapped, b).tobytes() == expected.tobytes()


def test_out_faults(arrays):
    x, w, b = arrays
    before = [a.copy() for a in arrays]
    with pytest.raises(errors.ShapeError):
        ltx2blas.linear(x, w, b, out=np.zeros((5, 13), np.float32))
    with pytest.raises(errors.DTypeError):
        ltx2blas.linear(x, w, b, out=np.zeros((5, 12), np.float64))
    with pytest.raises(errors.LayoutError):
        ltx2blas.linear(x, w, b, out=np.zeros((12, 5), np.float32).T)
    ro = np.zeros((5, 12), np.float32)
    ro.flags.writeable = False
    with pytest.raises(errors.LayoutError, match="read-only"):
        ltx2blas.linear(x, w, b, out=ro)
    holder = np.zeros(5 * 64 + 60, np.float32)
    holder[:320] = x.ravel()
    with pytest.raises(errors.LayoutError, match="overlaps x"):
        ltx2blas.linear(holder[:320].reshape(5, 64), w, b, out=holder[300:360].reshape(5, 12))
    assert all(np.array_equal(a, c) for a, c in zip(arrays, before))
    out = np.zeros((5, 12), np.float32)
    assert ltx2blas.linear(x, w, b, out=out) is out


def test_zero_sizes(arrays):
    x, w, b = arrays
    assert ltx2blas.linear(x[:0], w, b).shape == (0, 12)
    assert ltx2blas.linear(x, w[:0], b[:0]).shape == (5, 0)
    y = ltx2blas.linear(x[:, :0].copy(), w[:, :0].copy(), b)
    assert np.array_equal(y, np.broadcast_to(b, (5, 12)))
    assert np.array_equal(ltx2blas.linear(x[:, :0].copy(), w[:, :0].copy()), np.zeros((5, 12)))


@pytest.mark.parametrize("rows", [3, 70])  # streaming route and sgemm route
@pytest.mark.parametrize("accumulate", ["f32", "f64"])
def test_non_finite_values_propagate_the_same_on_every_path(rng, rows, accumulate):
    x = rng.standard_normal((rows, 300), dtype=np.float32)
    w = random_bf16(rng, (20, 300), 0.02)
    b = rng.standard_normal(20, dtype=np.float32)
    x[1, 7] = np.nan          # row 1: NaN everywhere
    x[2, 9] = np.inf          # row 2: +-inf, or NaN where w = 0 or signs meet
    w[5, 9] = 0               # ... inf * 0 = NaN at column 5
    w[11, 20] = 0x7F80        # column 11: inf in the weight
    b[3] = np.nan             # column 3: NaN bias
    with np.errstate(invalid="ignore", over="ignore"):
        expected = reference_y(x, w, b)
    got = ltx2blas.linear(x, w, b, accumulate=accumulate)
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert np.array_equal(np.isposinf(got), np.isposinf(expected))
    assert np.array_equal(np.isneginf(got), np.isneginf(expected))
    for threads in (1, 2):
        assert ltx2blas.linear(x, w, b, accumulate=accumulate,
                               threads=threads).tobytes() == got.tobytes()


def test_32_bit_blas_limit_is_checked_before_any_call(arrays, monkeypatch):
    x, w, b = arrays
    monkeypatch.setattr(linear_layer, "BLAS_INT_MAX", 63)
    with pytest.raises(errors.ShapeError, match="2\\^31"):
        ltx2blas.linear(x, w, b)


def test_bad_arguments(arrays):
    x, w, b = arrays
    with pytest.raises(ValueError, match="accumulate"):
        ltx2blas.linear(x, w, b, accumulate="f16")
    with pytest.raises(ValueError, match="blocks"):
        ltx2blas.linear(x, w, b, blocks=(0, 8, 8))
    with pytest.raises(ValueError, match="threads"):
        ltx2blas.linear(x, w, b, threads=0)
    with pytest.raises(TypeError, match="numpy array"):
        ltx2blas.linear(x.tolist(), w, b)


def sentinel_out(shape):
    """An out= array of one NaN payload that no result has, to see whether anything was
    written."""
    return np.full(shape, 0x7FC0DEAD, np.uint32).view(np.float32)


def test_progress_is_reported_after_outputs_are_written():
    """The first report comes after a wave has written its outputs: a progress argument found
    bad only when it is called would leave out= part written (1,024 of 16,384 here)."""
    x, w = np.zeros((4, 64), np.float32), np.zeros((4096, 64), np.uint16)
    out = sentinel_out((4, 4096))
    written = []
    ltx2blas.linear(x, w, out=out, threads=2,
                    progress=lambda f: written.append(int(np.count_nonzero(out == 0))))
    assert len(written) > 1 and 0 < written[0] < out.size


@pytest.mark.parametrize("progress", [5, "x", 1.0, [print]])
@pytest.mark.parametrize("cols", [64, 0], ids=["waves", "no-work"])
def test_bad_progress_is_refused_before_out_is_written(progress, cols):
    x, w = np.zeros((4, cols), np.float32), np.zeros((4096, cols), np.uint16)
    b = np.ones(4096, np.float32)  # with cols 0 the result is the bias alone
    out = sentinel_out((4, 4096))
    before = out.tobytes()
    with pytest.raises(errors.ArgumentTypeError, match="progress must be a callable"):
        ltx2blas.linear(x, w, b, out=out, threads=2, progress=progress)
    assert out.tobytes() == before


@pytest.mark.parametrize("kwargs, error, message", [
    ({"threads": True}, errors.ArgumentTypeError, "threads"),
    ({"threads": 2.0}, errors.ArgumentTypeError, "threads"),
    ({"threads": 0}, errors.ArgumentError, "threads"),
    ({"blocks": 5}, errors.ArgumentTypeError, "blocks"),
    ({"blocks": "abc"}, errors.ArgumentTypeError, "blocks"),
    ({"blocks": np.int64(8)}, errors.ArgumentTypeError, "blocks"),
    ({"blocks": (4, 8)}, errors.ArgumentError, "blocks"),
    ({"blocks": (1.5, 8, 8)}, errors.ArgumentTypeError, "blocks\\[0\\]"),
    ({"blocks": (4, True, 8)}, errors.ArgumentTypeError, "blocks\\[1\\]"),
    ({"blocks": (4, 8, 2**21)}, errors.ArgumentError, "blocks\\[2\\]"),
    ({"accumulate": None}, errors.ArgumentError, "accumulate"),
    ({"accumulate": np.array(["f32", "f64"])}, errors.ArgumentError, "accumulate"),
    ({"accumulate": np.array(["f64"])}, errors.ArgumentError, "accumulate"),
    ({"bias": np.ones(4095, np.float32)}, errors.ShapeError, "bias"),
    ({"bias": [0.0] * 4096}, errors.DTypeError, "bias"),
])
def test_every_bad_argument_leaves_out_as_it_was(kwargs, error, message):
    """Each is an Ltx2BlasError raised before anything is computed: never a built-in error from
    deep in the call, nor a float or a bool block taken as an int."""
    x, w = np.zeros((4, 64), np.float32), np.zeros((4096, 64), np.uint16)
    out = sentinel_out((4, 4096))
    before = out.tobytes()
    with pytest.raises(error, match=message):
        ltx2blas.linear(x, w, out=out, **{"threads": 2, **kwargs})
    assert out.tobytes() == before
