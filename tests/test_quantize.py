"""quantize_weight (the kernels of every instruction set this CPU runs, on any thread count)
against reference.quantize_weight, byte for byte; the owners' own quantisers are compared with
the reference in test_quantize_owners.py."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import reference as ref
from ltx2blas.errors import ArgumentError, NonFiniteWeightError, ShapeError
from ltx2blas.quantized import QUANTIZE_FORMATS, quantize_weight, quantized_shapes

FORMATS = [(f, {}) for f in QUANTIZE_FORMATS] + [("comfy_fp8", {"fp8_format": "F8_E5M2"}),
                                                  ("comfy_int8", {"per_row": True})]


def bf16(values):
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def weight(rng, rows, cols, kind="normal"):
    """bf16 bits of a test weight: ``normal`` values of LTX-2's magnitudes, with zeros (both
    signs), exact ties of the grids, whole zero rows and blocks; ``tiny`` values among the
    subnormals; ``huge`` values near bf16's largest; ``wide`` a spread of exponents."""
    if kind == "tiny":
        x = rng.standard_normal((rows, cols)).astype(np.float32) * np.float32(1e-39)
    elif kind == "huge":
        x = rng.uniform(-3.38e38, 3.38e38, (rows, cols)).astype(np.float32)
    elif kind == "wide":
        x = (rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-40, 40, (rows, cols)))
             ).astype(np.float32)
    else:
        x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
        x.reshape(-1)[::7] = 0.0
        x.reshape(-1)[3::11] = -0.0
        x.reshape(-1)[5::13] = 0.0125   # a tie on coarse grids once scaled
        if rows > 2:
            x[1] = 0.0
        if rows >= 32 and cols >= 32:
            x[:32, :32] = 0.0
    return bf16(x)


def same(ours, theirs):
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (a.shape, b.shape)
        assert a.tobytes() == b.tobytes()


def expected(fmt, w, kw):
    if "fp8_format" in kw:
        return ref.quantize_comfy_fp8(w, fmt=kw["fp8_format"])
    return ref.quantize_weight(fmt, w, **kw)


def result(q):
    return [q.weight, q.scale] + ([] if q.scale_2 is None else [q.scale_2])


SHAPES = [(256, 256), (128, 384), (33, 48), (17, 16), (3, 32), (130, 160)]


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=[f + "".join(f"-{v}" for v in kw.values())
                                                 for f, kw in FORMATS])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_every_format_is_the_reference_rule_on_every_kernel_table(fmt, kw, shape, rng,
                                                                  kernel_table):
    rows, cols = shape
    w = weight(rng, rows, cols)
    try:
        want = expected(fmt, w, kw)
    except ValueError:  # a shape the format cannot hold: refused alike
        with pytest.raises(ShapeError):
            quantize_weight(fmt, w, **kw)
        return
    for threads in (1, 3):
        same(result(quantize_weight(fmt, w, threads=threads, **kw)), want)


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=[f + "".join(f"-{v}" for v in kw.values())
                                                 for f, kw in FORMATS])
@pytest.mark.parametrize("kind", ["tiny", "huge", "wide", "zero"])
def test_edges_are_the_reference_rule(fmt, kw, kind, rng, kernel_table):
    """Subnormal weights, the largest finite bf16 values, a spread of exponents, an all-zero
    weight (the documented departure: zero codes, as the reference states it)."""
    w = np.zeros((128, 256), np.uint16) if kind == "zero" else weight(rng, 128, 256, kind)
    if kind == "zero":
        w[5, 7] = 0x8000   # a -0.0 keeps its sign where the owner keeps signs
    same(result(quantize_weight(fmt, w, threads=2, **kw)), expected(fmt, w, kw))


@pytest.mark.parametrize("fmt,kw", FORMATS, ids=[f + "".join(f"-{v}" for v in kw.values())
                                                 for f, kw in FORMATS])
@pytest.mark.parametrize("shape", [(640, 256), (384, 160), (300, 48)],
                         ids=["640x256", "384x160", "300x48"])
def test_codes_over_the_weights_own_memory_are_the_reference_rule(fmt, kw, shape, rng,
                                                                 kernel_table):
    """``out`` sharing the weight's memory, from its first byte or a few before (the checkpoint
    quantiser's one buffer a weight): the stripes' codes land only on rows already read, for
    stripes of 128, 256 and more rows, on every kernel table; maxima given as the reader
    takes them piece by piece.  Codes starting after the weight are refused (but for a weight
    padded first, whose copy is quantised)."""
    import ltx2blas.quantized as qz

    rows, cols = shape
    w = weight(rng, rows, cols)
    try:
        want = expected(fmt, w, kw)
    except ValueError:
        return
    for threads, before in ((1, 0), (3, 1), (2, 7)):
        memory = np.zeros(w.nbytes + 16, np.uint8)
        held = memory[8:8 + w.nbytes].view(np.uint16).reshape(rows, cols)
        held[...] = w
        pieces = [qz.weight_maxima(held[r:r + 100], 1)[1] for r in range(0, rows, 100)]
        row_tops = np.concatenate(pieces)
        q = quantize_weight(fmt, held, threads=threads, out=memory[8 - before:],
                            maxima=(row_tops.max(), row_tops), **kw)
        same(result(q), want)
    group = qz.COMFY_PAD.get(fmt)
    if group and (rows % group or cols % group):
        return  # quantised from a padded copy: the codes may go anywhere
    held[...] = w
    with pytest.raises(ArgumentError, match="from its start"):
        quantize_weight(fmt, held, out=memory[10:], **kw)


def test_the_stored_shapes_are_those_written(rng):
    w = weight(rng, 33, 48)
    for fmt, kw in FORMATS:
        try:
            shapes = quantized_shapes(fmt, 33, 48, per_row=kw.get("per_row", False))
        except ShapeError:
            continue
        q = quantize_weight(fmt, w, **kw)
        for part, (dtype, shape) in shapes.items():
            assert getattr(q, part if part != "weight" else "weight").shape == tuple(shape)


def test_padding_is_zero_and_shapes_follow_the_owners(rng):
    w = weight(rng, 17, 40)
    q = quantize_weight("comfy_nvfp4", w)
    assert q.weight.shape == (32, 24) and q.scale.shape == (128, 4)
    assert not q.weight[17:].any() and not q.weight[:, 20:].any()
    q = quantize_weight("comfy_mxfp8", w)
    assert q.weight.shape == (32, 64) and q.scale.shape == (128, 4)
    assert not q.weight[17:].any() and not q.weight[:, 40:].any()
    q = quantize_weight("nvfp4", weight(rng, 17, 48))
    assert q.weight.shape == (17, 24) and q.scale.shape == (128, 4)
    assert quantize_weight("comfy_int8", w, per_row=True).scale.shape == (17, 1)


def test_what_a_format_cannot_hold_is_refused(rng):
    with pytest.raises(ShapeError, match="16-element"):
        quantize_weight("nvfp4", weight(rng, 16, 40))
    with pytest.raises(ShapeError, match="128 x 128"):
        quantize_weight("fp8_block", weight(rng, 128, 200))
    w = weight(rng, 16, 32)
    for bad in (0x7F80, 0xFF80, 0x7FC1):
        v = w.copy()
        v[3, 5] = bad
        with pytest.raises(NonFiniteWeightError, match=r"\(3, 5\)"):
            quantize_weight("comfy_fp8", v)
    with pytest.raises(ArgumentError):
        quantize_weight("fp8_scaled", w, fp8_format="F8_E5M2")
    with pytest.raises(ArgumentError):
        quantize_weight("nvfp4", w, per_row=True)
    with pytest.raises(ArgumentError):
        quantize_weight("fp6_block", w)


def test_the_package_names_it():
    assert ltx2blas.quantize_weight is quantize_weight


@pytest.mark.parametrize("fmt,fmax", [("F8_E4M3", 448.0), ("F8_E5M2", 57344.0)])
def test_the_fp8_encoder_on_every_bf16_value(fmt, fmax, kernel_table):
    """Every finite bf16 value times multipliers whose products carry full f32 mantissas (and
    fall among the subnormals, the normals and past the largest value), clamped and encoded by
    the kernels, against reference.fp8_round: the encoder's subnormal step (one f32 addition)
    and its normal rounding, whole."""
    from ltx2blas import _quant

    w = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    w = w[(w & 0x7F80) != 0x7F80]
    values = (w.astype(np.uint32) << 16).view(np.float32)
    for mult in (1.0, 0.7071067690849304, 3.0000002384185791, 1e-3, 123.456, 2.0 ** -20,
                 2.0 ** 30):
        codes = np.empty(w.size, np.uint8)
        _quant.scaled_fp8_quantize(w, codes, np.float32(mult), np.float32(fmax),
                                   fmt == "F8_E5M2", False, 2)
        with np.errstate(over="ignore"):
            product = np.clip(values * np.float32(mult), -fmax, fmax).astype(np.float32)
        want = np.asarray(ref.fp8_round(product, fmt)).view(np.uint8)
        assert np.array_equal(codes, want), mult
