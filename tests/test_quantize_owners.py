"""The quantising rules of ltx2blas.reference against their owners' own code, byte for byte.

The tests at the top need only numpy: shapes, padding, the rules' departures and a few values
worked by hand.  The rest need torch and run the owners' code on the CPU: comfy-kitchen's
layouts (``pip install comfy-kitchen==0.2.40``, its torch path, forced with
``use_backend("eager")``) and, for upstream LTX-2, its torch quantisers and the arithmetic of
its CUDA nvfp4 kernel transcribed below into f32 torch operations.
"""
import numpy as np
import pytest

from ltx2blas import reference as ref
from helpers import random_bf16

F32 = np.float32


def bf16(values):
    return ref.bf16_round(np.asarray(values, F32))


def amax_weight(v_bits, shape=(3, 40), rng=None):
    """A bf16 weight whose largest magnitude is the bf16 value ``v_bits``, at a place that is
    not the first, with smaller values around it (and -v somewhere when there is room)."""
    v = ref.bf16_widen(np.uint16(v_bits))
    rng = rng or np.random.default_rng(int(v_bits))
    x = (rng.uniform(-1, 1, shape) * v).astype(F32)
    w = bf16(x)
    w = np.where(np.abs(ref.bf16_widen(w)) > v, np.uint16(v_bits), w)
    w.flat[min(5, w.size - 1)] = v_bits
    return w


# ---------------------------------------------------------------- without torch

def test_formats_and_dispatch():
    assert ref.QUANTIZE_FORMATS == ("fp8_scaled", "comfy_fp8", "fp8_block", "nvfp4",
                                    "comfy_nvfp4", "comfy_mxfp8", "comfy_int8")
    w = bf16(np.arange(-8, 8).reshape(1, 16) / 4)
    for fmt in ref.QUANTIZE_FORMATS:
        if fmt != "fp8_block":
            got = ref.quantize_weight(fmt, w)
            want = getattr(ref, "quantize_" + fmt)(w)
            assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="format must be one of"):
        ref.quantize_weight("fp6_block", w)
    with pytest.raises(ValueError, match="multiple of 16"):
        ref.quantize_nvfp4(bf16(np.ones((2, 24))))
    with pytest.raises(ValueError, match="multiples of 128"):
        ref.quantize_fp8_block(bf16(np.ones((128, 192))))


@pytest.mark.parametrize("shape", [(33, 40), (17, 48), (128, 256), (3, 16), (1, 1)])
def test_shapes_and_padding(rng, shape):
    rows, cols = shape
    w = random_bf16(rng, shape, 0.05)
    up = lambda n, m: -(-n // m) * m   # noqa: E731

    for fmt in ("F8_E4M3", "F8_E5M2"):
        codes, scale = ref.quantize_comfy_fp8(w, fmt)
        assert (codes.dtype, codes.shape, scale.dtype, scale.shape) == (np.uint8, shape, F32, ())
    codes, scale = ref.quantize_fp8_scaled(w)
    assert (codes.dtype, codes.shape, scale.dtype, scale.shape) == (np.uint8, shape, F32, ())
    codes, scale = ref.quantize_comfy_int8(w)
    assert (codes.dtype, codes.shape, scale.shape) == (np.int8, shape, ())
    codes, scale = ref.quantize_comfy_int8(w, per_row=True)
    assert (codes.dtype, codes.shape, scale.dtype, scale.shape) == (np.int8, shape, F32, (rows, 1))

    r16, c16 = up(rows, 16), up(cols, 16)
    packed, scales, scale_2 = ref.quantize_comfy_nvfp4(w)
    assert packed.shape == (r16, c16 // 2) and scale_2.shape == ()
    assert scales.shape == (up(r16, 128), up(c16 // 16, 4)) and scales.dtype == np.uint8
    codes = ref.nvfp4_unpack(packed)
    assert not codes[rows:].any() and not codes[:, cols:].any()       # +0 padding
    full = np.zeros(scales.size, bool)
    r, c = np.meshgrid(np.arange(r16), np.arange(c16 // 16), indexing="ij")
    full[ref.nvfp4_scale_offset(r, c, scales.shape[1])] = True
    assert not scales.reshape(-1)[~full].any()                         # tile padding is 0

    r32, c32 = up(rows, 32), up(cols, 32)
    codes, e = ref.quantize_comfy_mxfp8(w)
    assert codes.shape == (r32, c32) and e.shape == (up(r32, 128), up(c32 // 32, 4))
    assert not codes[rows:].any() and not codes[:, cols:].any()

    if cols % 16 == 0:
        packed, scales, scale_2 = ref.quantize_nvfp4(w)
        assert packed.shape == (rows, cols // 2) and scale_2.shape == ()
        assert scales.shape == (up(rows, 128), up(cols // 16, 4))
    if rows % 128 == 0 and cols % 128 == 0:
        codes, scales = ref.quantize_fp8_block(w)
        assert codes.shape == shape and scales.shape == (rows // 128, cols // 128)
        assert scales.dtype == F32


def test_fp8_scaled_by_hand():
    """max 2: m = f32(1 / 2) * 448 = 224; 1 -> 224, -2 -> -448, 0.5 -> 112, -0 stays -0."""
    codes, scale = ref.quantize_fp8_scaled(bf16([[1.0, -2.0, 0.5, -0.0]]))
    assert codes.tolist() == [[0x76, 0xFE, 0x6E, 0x80]]
    assert scale == F32(1) / F32(224)


def test_comfy_fp8_by_hand():
    """max 448: scale = bf16(448 / 448) = 1, so the codes are the values' own e4m3 codes;
    1.0625 lies halfway between 1 and 1.125 and goes to the even 1."""
    codes, scale = ref.quantize_comfy_fp8(bf16([[448.0, -1.0, 0.5, -0.0, 3.0, 1.0625]]))
    assert codes.tolist() == [[0x7E, 0xB8, 0x30, 0x80, 0x44, 0x38]] and scale == 1
    # the scale is the bf16 quotient: 2 / 448 = 0.0044642857... -> bf16 0.00445556640625
    _, scale = ref.quantize_comfy_fp8(bf16([[2.0]]))
    assert scale == F32(0.00445556640625)


def test_comfy_int8_by_hand():
    """max 127: scale 1; 63.5 and 0.5 and 1.5 are ties, to even."""
    codes, scale = ref.quantize_comfy_int8(bf16([[127.0, -63.5, 0.5, 1.5, -0.0]]))
    assert codes.tolist() == [[127, -64, 0, 2, 0]] and scale == 1
    # the quotient is rounded to bf16 first: max 1, scale f32(1 / 127), bf16 0.007873535;
    # 0.011779785 (0x3C41) / that = 1.496124, bf16 1.5, to even 2 (f32 alone would give 1)
    codes, scale = ref.quantize_comfy_int8(np.array([[0x3F80, 0x3C41]], np.uint16))
    assert codes.tolist() == [[127, 2]] and scale == F32(1) / F32(127)


def test_nvfp4_by_hand():
    """One block of 16, max 6: the block scale clamps to 448 and total is within an f32 step
    of 1, so 6, 0.5, -0, 3 keep their own e2m1 codes 7, 1, 8, 5; element 2j is the high
    nibble."""
    row = np.zeros((1, 16), F32)
    row[0, :4] = [6.0, 0.5, -0.0, 3.0]
    for rule in (ref.quantize_nvfp4, ref.quantize_comfy_nvfp4):
        packed, scales, scale_2 = rule(bf16(row))
        assert packed[0, :2].tolist() == [0x71, 0x85] and not packed[0, 2:].any()
        assert scales[0, 0] == 0x7E
    # scale_2: upstream multiplies by f32(1 / 2688); comfy-kitchen divides, in bf16
    assert ref.quantize_nvfp4(bf16(row))[2] == F32(6) * F32(1 / 2688)
    assert ref.quantize_comfy_nvfp4(bf16(row))[2] == F32(0.002227783203125)


def test_comfy_mxfp8_by_hand():
    """max 448 takes exponent 127 (scale 1); max 450 (the next bf16) exponent 128 (scale 2)."""
    row = np.zeros((1, 32), F32)
    row[0, :3] = [448.0, -1.0, 0.5]
    codes, e = ref.quantize_comfy_mxfp8(bf16(row))
    assert codes[0, :3].tolist() == [0x7E, 0xB8, 0x30] and e[0, 0] == 127
    row[0, 0] = 450.0
    codes, e = ref.quantize_comfy_mxfp8(bf16(row))
    assert codes[0, :3].tolist() == [0x76, 0xB0, 0x28] and e[0, 0] == 128


def test_all_zero_departure():
    """An all-zero weight: where the owners write NaN codes (0 x inf, 0 / 0) the codes are the
    zeros themselves with a zero scale (docs/arithmetic.md, "Where ltx2blas departs from the
    owners")."""
    w = np.zeros((128, 128), np.uint16)
    w[0, 1] = w[5, 7] = 0x8000                                        # -0.0
    neg = np.zeros((128, 128), bool)
    neg[0, 1] = neg[5, 7] = True
    signed = np.where(neg, 0x80, 0)
    for codes, scale in (ref.quantize_fp8_scaled(w), ref.quantize_comfy_fp8(w),
                         ref.quantize_comfy_fp8(w, "F8_E5M2"), ref.quantize_fp8_block(w)):
        assert np.array_equal(codes, signed) and not np.any(scale)
    packed, scales, scale_2 = ref.quantize_nvfp4(w)                  # the owner's own zeros
    assert np.array_equal(ref.nvfp4_unpack(packed), np.where(neg, 8, 0))
    assert not scales.any() and scale_2 == 0
    packed, scales, scale_2 = ref.quantize_comfy_nvfp4(w)
    assert not packed.any() and not scales.any() and scale_2 == 0
    codes, e = ref.quantize_comfy_mxfp8(w)
    assert not codes.any() and not e.any()
    codes, scale = ref.quantize_comfy_int8(w)                        # no division by zero
    assert not codes.any() and scale == F32(1e-30)


def test_tiny_weights_departure():
    """A weight so small that the owner's scale is 0 or its reciprocal inf: the nonzero values
    get the owner's codes, its zeros stay zeros (no NaN codes); every scale is the owner's."""
    w = np.zeros((128, 128), np.uint16)
    w[0, :4] = [0x0001, 0x8001, 0x8000, 0x0000]    # +-2^-133 (the smallest bf16), -0, +0
    codes, scale = ref.quantize_fp8_scaled(w)
    assert codes[0, :4].tolist() == [0x7E, 0xFE, 0x80, 0x00] and scale == 0
    codes, scale = ref.quantize_fp8_block(w)
    assert codes[0, :4].tolist() == [0x7E, 0xFE, 0x80, 0x00] and scale[0, 0] == 0
    codes, scale = ref.quantize_comfy_fp8(w)
    assert codes[0, :4].tolist() == [0x7E, 0xFE, 0x80, 0x00] and scale == 0
    packed, scales, scale_2 = ref.quantize_comfy_nvfp4(w)
    assert not packed.any() and scale_2 == 0
    assert ref.from_tiled(scales, 128, 8)[:2, :2].tolist() == [[0x7E, 0], [0, 0]]
    codes, e = ref.quantize_comfy_mxfp8(w)
    assert not codes.any() and not e.any()


# ---------------------------------------------------------------- against the owners (torch)

def _torch():
    return pytest.importorskip("torch", reason="the owners' code runs in torch")


def _ck():
    _torch()
    ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen is not installed")
    return ck


def t_bf16(w_bits):
    torch = _torch()
    return torch.from_numpy(np.array(w_bits, np.uint16).view(np.int16)).view(torch.bfloat16)


def to_np(t):
    """A stored torch tensor as the numpy array of its bytes (uint8 for fp8 and E8M0 bytes)."""
    torch = _torch()
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.uint8):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    diff = a.view(np.uint8) != b.view(np.uint8) if a.dtype.itemsize == 1 else \
        a.view(f"u{a.dtype.itemsize}") != b.view(f"u{a.dtype.itemsize}")
    assert not diff.any(), f"{int(diff.sum())} of {a.size} differ, first at {np.argwhere(diff)[0]}"


def weights(seed, shape):
    """bf16 weights that exercise the rules: random at several scales, with zero blocks
    (16, 32 and 128 wide), -0.0, subnormals, the largest finite values, and ties."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    out = {}
    out["normal"] = random_bf16(rng, shape, 0.03)
    out["wide"] = bf16(rng.standard_normal(shape) * np.exp(rng.uniform(-12, 12, shape)))
    z = random_bf16(rng, shape, 1.0)
    z[: min(rows, 16), : min(cols, 32)] = 0
    z[rows // 2:, cols // 2:] = 0
    z[rng.random(shape) < 0.1] = 0x8000
    z[-1, -1] = 0x3F80                  # never all zero (that is the departure, tested above)
    out["zero_blocks"] = z
    sub = rng.integers(1, 0x80, shape, dtype=np.uint16) | (rng.integers(0, 2, shape, dtype=np.uint16) << 15)
    out["subnormal"] = sub.astype(np.uint16)
    mixed = random_bf16(rng, shape, 1e-3)
    pick = rng.random(shape) < 0.2
    mixed[pick] = sub[pick]
    out["subnormal_mixed"] = mixed
    big = rng.integers(0x7F00, 0x7F80, shape, dtype=np.uint16)
    big |= rng.integers(0, 2, shape, dtype=np.uint16) << 15
    big.flat[0] = 0x7F7F
    out["largest"] = big.astype(np.uint16)
    # ties: max 448 (comfy_fp8 scale 1), values on the e4m3 midpoints, half-integers
    # (int8 at scale 1 after max 127), e2m1 midpoints; each with a random sign
    mids = np.concatenate([(2 * np.arange(8, 16) + 1) / 16 * 2.0 ** k for k in range(-6, 8)]
                          + [np.arange(0, 128) + 0.5, [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]])
    t = rng.choice(mids, shape) * rng.choice([-1.0, 1.0], shape)
    t.flat[0] = 448.0
    out["ties_448"] = bf16(t)
    t2 = np.clip(t, -127, 127)
    t2.flat[0] = 127.0
    out["ties_127"] = bf16(t2)
    t3 = rng.choice([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0], shape) * rng.choice([-1.0, 1.0], shape)
    t3.flat[0] = 2688.0                 # scale_2 near 1, the other blocks' scales small
    out["ties_e2m1"] = bf16(t3)
    return out


SHAPES = [(33, 40), (17, 48), (128, 256), (3, 16), (64, 96)]
CASES = ["normal", "wide", "zero_blocks", "subnormal", "subnormal_mixed", "largest",
         "ties_448", "ties_127", "ties_e2m1"]


@pytest.fixture
def eager():
    ck = _ck()
    with ck.use_backend("eager"):
        yield ck


def comfy_stored(layout, w_bits, **kw):
    qdata, params = layout.quantize(t_bf16(w_bits), **kw)
    return {k: to_np(v) for k, v in layout.state_dict_tensors(qdata, params).items()}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_comfy_fp8_equals_comfy_kitchen(eager, shape, fmt):
    torch = _torch()
    from comfy_kitchen.tensor import TensorCoreFP8Layout
    dtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[fmt]
    for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
        theirs = comfy_stored(TensorCoreFP8Layout, w, dtype=dtype)
        codes, scale = ref.quantize_comfy_fp8(w, fmt)
        same(codes, theirs[""])
        same(scale, theirs["_scale"])


@pytest.mark.parametrize("shape", SHAPES)
def test_comfy_nvfp4_equals_comfy_kitchen(eager, shape):
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout
    for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
        theirs = comfy_stored(TensorCoreNVFP4Layout, w)
        if theirs["_scale_2"] == 0:   # the stated departure, tested below
            continue
        packed, scales, scale_2 = ref.quantize_comfy_nvfp4(w)
        same(packed, theirs[""])
        same(scales, theirs["_scale"])
        same(scale_2, theirs["_scale_2"])


@pytest.mark.parametrize("shape", SHAPES)
def test_comfy_mxfp8_equals_comfy_kitchen(eager, shape):
    from comfy_kitchen.tensor import TensorCoreMXFP8Layout
    for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
        if name == "subnormal":   # every block below 448 x 2^-127: the stated departure
            continue
        theirs = comfy_stored(TensorCoreMXFP8Layout, w)
        codes, e = ref.quantize_comfy_mxfp8(w)
        same(codes, theirs[""])
        same(e, theirs["_scale"])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("per_row", [False, True])
def test_comfy_int8_equals_comfy_kitchen(eager, shape, per_row):
    from comfy_kitchen.tensor import TensorWiseINT8Layout
    for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
        theirs = comfy_stored(TensorWiseINT8Layout, w, per_channel=per_row)
        codes, scale = ref.quantize_comfy_int8(w, per_row=per_row)
        same(codes, theirs[""])
        same(scale, theirs["_scale"])


def test_comfy_nvfp4_departure_against_comfy_kitchen(eager):
    """Where scale_2 comes out 0 (a weight below 2688 x 2^-134), comfy-kitchen divides a zero
    block's maximum by it: NaN block scales and codes made from NaN.  Those blocks are here
    scale 0 and +0 codes; every other block is the owner's, byte for byte."""
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout
    w = np.zeros((33, 40), np.uint16)
    w[0, :4] = [0x0001, 0x8003, 0x8000, 0x0040]
    w[20, 17] = 0x8010
    theirs = comfy_stored(TensorCoreNVFP4Layout, w)
    packed, scales, scale_2 = ref.quantize_comfy_nvfp4(w)
    same(scale_2, theirs["_scale_2"])
    assert scale_2 == 0
    nan = np.isnan(ref.fp8_widen(ref.from_tiled(theirs["_scale"], 48, 3), "F8_E4M3"))
    assert nan.any() and not nan.all()
    ours_s, their_s = ref.from_tiled(scales, 48, 3), ref.from_tiled(theirs["_scale"], 48, 3)
    assert np.array_equal(ours_s[~nan], their_s[~nan]) and not ours_s[nan].any()
    block = np.repeat(nan, 8, axis=1)
    assert np.array_equal(packed[~block], theirs[""][~block]) and not packed[block].any()


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_comfy_fp8_departure_against_comfy_kitchen(eager, fmt):
    """A weight whose scale rounds to 0 in bf16: the owner's codes for its nonzero values
    (+-fmax), and its zeros, where the owner writes NaN, are zeros with their sign."""
    torch = _torch()
    from comfy_kitchen.tensor import TensorCoreFP8Layout
    dtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[fmt]
    for w in (np.array([[0x0001, 0x8003, 0x8000, 0x0000, 0x0040]], np.uint16),
              np.array([[0x8000, 0x0000, 0x0000]], np.uint16)):
        theirs = comfy_stored(TensorCoreFP8Layout, w, dtype=dtype)
        codes, scale = ref.quantize_comfy_fp8(w, fmt)
        same(scale, theirs["_scale"])
        nan = np.isnan(ref.fp8_widen(theirs[""], fmt))
        assert np.array_equal(codes[~nan], theirs[""][~nan])
        assert np.array_equal(codes[nan], np.where(w[nan] & 0x8000, 0x80, 0))


# Every positive finite bf16 value, as the largest magnitude of a weight.
POSITIVE = np.arange(1, 0x7F80, dtype=np.uint16)
SAMPLE = np.concatenate([POSITIVE[:40], POSITIVE[::997], POSITIVE[-40:],
                         [0x3F80, 0x43E0, 0x4428, 0x4528, 0x4780]]).astype(np.uint16)


def _one(v):
    return np.array([[v]], np.uint16)


def _sweep(owner_scales, rule):
    """owner_scales: f32 scales for every value of POSITIVE, computed by the owner's expression
    on a tensor of them; rule(v) the reference's scale for a weight of largest magnitude v."""
    ours = np.array([rule(v) for v in POSITIVE.tolist()], F32)
    same(ours, owner_scales)


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_comfy_fp8_scale_for_every_bf16_max(eager, fmt):
    torch = _torch()
    from comfy_kitchen.tensor import TensorCoreFP8Layout
    dtype = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}[fmt]

    def owner(amax):   # TensorCoreFP8Layout.quantize's expression, on a tensor of maxima
        return (amax / torch.finfo(dtype).max).to(dtype=torch.float32).numpy()

    for v in SAMPLE.tolist():   # the expression is what the layout does on real weights
        theirs = comfy_stored(TensorCoreFP8Layout, amax_weight(v), dtype=dtype)
        same(theirs["_scale"], owner(t_bf16(np.array(v, np.uint16))))
    _sweep(owner(t_bf16(POSITIVE)), lambda v: ref.quantize_comfy_fp8(_one(v), fmt)[1])


def test_comfy_nvfp4_scale_2_for_every_bf16_max(eager):
    from comfy_kitchen.float_utils import F4_E2M1_MAX, F8_E4M3_MAX
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout

    def owner(amax):   # TensorCoreNVFP4Layout.quantize's expression
        return (amax / (F8_E4M3_MAX * F4_E2M1_MAX)).to(dtype=_torch().float32).numpy()

    for v in SAMPLE.tolist():
        theirs = comfy_stored(TensorCoreNVFP4Layout, amax_weight(v, (3, 40)))
        same(theirs["_scale_2"], owner(t_bf16(np.array(v, np.uint16))))
    _sweep(owner(t_bf16(POSITIVE)), lambda v: ref.quantize_comfy_nvfp4(_one(v))[2])


def test_comfy_int8_scale_for_every_bf16_max(eager):
    from comfy_kitchen.tensor import TensorWiseINT8Layout

    def owner(amax):   # quantize_int8_tensorwise's expression
        return (amax.float() / 127.0).clamp(min=1e-30).numpy()

    for v in SAMPLE.tolist():
        theirs = comfy_stored(TensorWiseINT8Layout, amax_weight(v))
        same(theirs["_scale"], owner(t_bf16(np.array(v, np.uint16))))
    _sweep(owner(t_bf16(POSITIVE)), lambda v: ref.quantize_comfy_int8(_one(v))[1])
    # one weight row per value: the per-row rule, all of it, against the layout itself
    col = POSITIVE.reshape(-1, 1)
    col = np.concatenate([col, col | 0x8000, bf16(ref.bf16_widen(col) * F32(0.37))], axis=1)
    theirs = comfy_stored(TensorWiseINT8Layout, col, per_channel=True)
    codes, scale = ref.quantize_comfy_int8(col, per_row=True)
    same(codes, theirs[""])
    same(scale, theirs["_scale"])


def test_comfy_mxfp8_for_every_bf16_max(eager):
    """One 32-wide block per positive bf16 value (its maximum), codes and exponents against the
    layout itself; blocks at most 448 x 2^-127 are the stated departure (+0 codes there)."""
    from comfy_kitchen.tensor import TensorCoreMXFP8Layout
    rng = np.random.default_rng(7)
    v = ref.bf16_widen(POSITIVE)[:, None]
    w = bf16(rng.uniform(-1, 1, (POSITIVE.size, 32)).astype(F32) * v)
    w[:, 9] = POSITIVE
    theirs = comfy_stored(TensorCoreMXFP8Layout, w)
    codes, e = ref.quantize_comfy_mxfp8(w)
    same(e, theirs["_scale"])
    rows = POSITIVE.size
    tiny = ref.from_tiled(e, rows, 1)[:, 0] == 0
    assert tiny.sum() == np.sum(ref.bf16_widen(POSITIVE) <= F32(448) * F32(2.0 ** -127))
    same(codes[:rows][~tiny], theirs[""][:rows][~tiny])
    assert not codes[:rows][tiny].any()


# ---------------------------------------------------------------- upstream LTX-2 (torch)

def upstream_fp8_per_tensor(weight):
    """packages/ltx-core/src/ltx_core/quantization/fp8_scaled_mm.py,
    quantize_weight_to_fp8_per_tensor (Lightricks/LTX-2 at 400fd310), its lines as written."""
    torch = _torch()
    weight_fp32 = weight.to(torch.float32)
    fp8_min = torch.finfo(torch.float8_e4m3fn).min
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    max_abs = torch.amax(torch.abs(weight_fp32))
    scale = fp8_max / max_abs
    quantized_weight = torch.clamp(weight_fp32 * scale, min=fp8_min, max=fp8_max).to(torch.float8_e4m3fn)
    weight_scale = scale.reciprocal()
    return quantized_weight, weight_scale


def upstream_blockwise(w, block_size=128, scale_max=448.0):
    """packages/ltx-kernels/src/ltx_kernels/blockwise/functional.py, blockwise_quantize_weights
    (Lightricks/LTX-2 at 400fd310), its lines as written."""
    torch = _torch()
    w = w.view(w.shape[0]//block_size, block_size, w.shape[1]//block_size, block_size).transpose(1, 2).contiguous()  # noqa: E501
    w_absmax = w.float().abs().view(w.shape[0], w.shape[1], block_size*block_size).max(dim=-1, keepdim=False).values  # noqa: E501
    w_scales = scale_max/w_absmax
    w_quant = (w.float()*w_scales[:, :, None, None].float()).to(torch.float8_e4m3fn)  # noqa: E501
    w_quant = w_quant.transpose(1, 2).contiguous()
    w_quant = w_quant.view(w.shape[0]*block_size, -1)
    return w_quant, (1/w_scales).contiguous()


def upstream_nvfp4_kernel(w):
    """The arithmetic of packages/ltx-kernels/csrc/nvfp4/quantize.cu (Lightricks/LTX-2 at
    400fd310) for a bf16 weight, one f32 torch operation per line of the kernel:
    amax_scale_kernel (block_max * inv_divisor, inv_divisor = (float)(1.0 / 2688)),
    block_scale_e4m3 (fminf((amax / 6) / pts, 448), __nv_cvt_float_to_fp8 satfinite),
    total = pts * e4m3_decode(sf), inv = __frcp_rn(total), __nv_cvt_float2_to_fp4x2 of
    (v[2j] * inv, v[2j+1] * inv) nearest-even, saturating, element 2j in the high nibble,
    and the scales at swizzled_offset."""
    torch = _torch()
    x = w.float()
    rows, cols = x.shape
    groups = cols // 16
    inv_divisor = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    pts = x.abs().amax() * inv_divisor
    xb = x.view(rows, groups, 16)
    amax = xb.abs().amax(dim=-1)
    if pts > 0:
        scaled = torch.clamp((amax / torch.tensor(6.0)) / pts, max=448.0)
    else:
        scaled = torch.zeros_like(amax)
    sf = scaled.to(torch.float8_e4m3fn)
    total = pts * sf.float()
    inv = torch.where(total > 0, torch.reciprocal(total), torch.zeros_like(total))
    q = xb * inv[..., None]
    a = q.abs()
    code = torch.zeros(q.shape, dtype=torch.int32)
    for k, mid in enumerate([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]):
        upper_even = (k + 1) % 2 == 0        # a tie goes to the even code
        code += (a > mid).int() + ((a == mid) & upper_even).int()
    code = (code | torch.signbit(q).int() * 8).view(rows, cols)
    packed = ((code[:, 0::2] << 4) | code[:, 1::2]).to(torch.uint8)
    prow, pcol = -(-rows // 128) * 128, -(-groups // 4) * 4
    r = torch.arange(rows)[:, None]
    c = torch.arange(groups)[None, :]
    tile = (r >> 7) * (pcol >> 2) + (c >> 2)
    rr = r & 127
    offset = tile * 512 + (rr & 31) * 16 + (rr >> 5) * 4 + (c & 3)
    tiled = torch.zeros(prow * pcol, dtype=torch.uint8)
    tiled[offset.reshape(-1)] = sf.view(torch.uint8).reshape(-1)
    return packed, tiled.view(prow, pcol), pts


def test_fp8_scaled_equals_upstream():
    for shape in SHAPES:
        for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
            codes, scale = upstream_fp8_per_tensor(t_bf16(w))
            ours = ref.quantize_fp8_scaled(w)
            same(ours[0], to_np(codes))
            same(ours[1], to_np(scale))


def test_fp8_block_equals_upstream():
    for shape in [(128, 256), (256, 384)]:
        for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
            codes, scales = upstream_blockwise(t_bf16(w))
            ours = ref.quantize_fp8_block(w)
            same(ours[0], to_np(codes))
            same(ours[1], to_np(scales))


def test_nvfp4_equals_upstream_kernel():
    for shape in [s for s in SHAPES if s[1] % 16 == 0] + [(129, 80)]:
        for name, w in weights(shape[0] * 1000 + shape[1], shape).items():
            packed, scales, scale_2 = upstream_nvfp4_kernel(t_bf16(w))
            ours = ref.quantize_nvfp4(w)
            same(ours[0], to_np(packed))
            same(ours[1], to_np(scales))
            same(ours[2], to_np(scale_2))


def test_nvfp4_all_zero_is_the_kernel_own():
    """The kernel guards both divisions (pts > 0, total > 0): an all-zero weight needs no
    departure, and -0.0 keeps its sign (0 x -0.0)."""
    w = np.zeros((4, 32), np.uint16)
    w[1, 3] = 0x8000
    packed, scales, scale_2 = upstream_nvfp4_kernel(t_bf16(w))
    ours = ref.quantize_nvfp4(w)
    same(ours[0], to_np(packed))
    same(ours[1], to_np(scales))
    same(ours[2], to_np(scale_2))


def test_upstream_departures():
    """An all-zero weight or 128 x 128 block: upstream writes NaN codes (0 x inf) beside a
    zero scale; here the codes are the zeros themselves, and everything else is upstream's."""
    w = random_bf16(np.random.default_rng(3), (256, 256), 0.1)
    w[128:, :128] = 0
    w[130, 5] = 0x8000
    tiny = np.zeros((256, 256), np.uint16)
    tiny[0, :3] = [0x0001, 0x8002, 0x8000]
    for weight in (w, tiny, np.zeros((128, 128), np.uint16)):
        for mine, theirs in ((ref.quantize_fp8_block, upstream_blockwise),
                             (ref.quantize_fp8_scaled, upstream_fp8_per_tensor)):
            if mine is ref.quantize_fp8_scaled and weight is w:
                continue
            codes, scale = theirs(t_bf16(weight))
            codes = to_np(codes)
            ours = mine(weight)
            same(ours[1], to_np(scale))
            nan = np.isnan(ref.fp8_widen(codes, "F8_E4M3"))
            assert nan.any()
            assert np.array_equal(ours[0][~nan], codes[~nan])
            assert np.array_equal(ours[0][nan], np.where(weight[nan] & 0x8000, 0x80, 0))
