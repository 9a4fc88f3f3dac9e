"""The arithmetic contract as plain numpy loops: the oracle for tests and goldens.

Nothing here is fast and nothing here calls ltx2blas's own kernels.  Each function is the
textbook loop of docs/arithmetic.md §1: one IEEE f32 operation per step, in the order written, with
numpy's elementwise float32 ``*`` and ``+`` (numpy never fuses them into an FMA).

bf16 values are uint16 bit patterns throughout; fp8 values uint8 codes.
"""
import numpy as np


def bits(x, dtype):
    """The stored bits of ``x`` as ``dtype`` (uint16 for bf16, uint8 for fp8 codes): an
    ml_dtypes bfloat16 / float8 array is viewed, never converted by value; integer codes are
    taken as they are; anything else is refused (a float array is not a bit pattern)."""
    x = np.asarray(x)
    want = np.dtype(dtype)
    if x.dtype == want:
        return x
    if x.dtype.itemsize == want.itemsize and x.dtype.name in ("bfloat16", "float8_e4m3fn",
                                                              "float8_e5m2"):
        return x.view(want)
    if x.dtype.kind in "iu":
        return x.astype(want)
    raise TypeError(f"expected {want} bit patterns (or an ml_dtypes array of them), got {x.dtype}")


def bf16_round(x):
    """f32 -> bf16 bits, round to nearest even.

    NaN becomes the quiet NaN 0x7FC0 with its sign kept (what ml_dtypes gives); values past the
    largest bf16 round to +-inf; subnormals are kept."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    rounded = ((u + 0x7FFF + lsb) >> 16) & 0xFFFF
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = ((u >> 16) & 0x8000) | 0x7FC0
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def bf16_widen(h):
    """bf16 bits -> f32, exact."""
    return (bits(h, np.uint16).astype(np.uint32) << 16).view(np.float32)


def lora_delta(lora_a, lora_b, strength):
    """delta[o, i] = bf16(sum_k bf16(B[o, k] * s) * A[k, i]), f32 sum from 0.0 in k order."""
    lora_a = bits(lora_a, np.uint16)
    lora_b = bits(lora_b, np.uint16)
    rank, cols = lora_a.shape
    rows = lora_b.shape[0]
    s = np.float32(strength)
    bs = bf16_round(bf16_widen(lora_b) * s)  # strength rounds into B first
    a = bf16_widen(lora_a)
    acc = np.zeros((rows, cols), dtype=np.float32)
    for k in range(rank):
        acc = acc + bf16_widen(bs[:, k])[:, None] * a[k][None, :]
    return bf16_round(acc)


def fuse_lora(weight, lora_a, lora_b, strength=1.0):
    """W'[o, i] = bf16(f32(W[o, i]) + f32(delta[o, i])) -- one adapter (docs/arithmetic.md §1)."""
    delta = lora_delta(lora_a, lora_b, strength)
    return bf16_round(bf16_widen(weight) + bf16_widen(delta))


#: The several-adapter rules, by name: "addmm" is upstream LTX-2's today (the default), "sum"
#: its first release.
RULES = ("addmm", "sum")


def lora_product(lora_a, lora_b):
    """acc[o, i] = sum_k f32(B[o, k]) * f32(A[k, i]) in f32 from 0.0 in k order (B unscaled)."""
    a = bf16_widen(lora_a)
    b = bf16_widen(lora_b)
    acc = np.zeros((b.shape[0], a.shape[1]), dtype=np.float32)
    for k in range(a.shape[0]):
        acc = acc + b[:, k][:, None] * a[k][None, :]
    return acc


def diff_delta(diff, strength):
    """A full-weight difference as a delta: bf16(f32(s) * f32(diff)), diff in bf16 bits."""
    return bf16_round(np.float32(strength) * bf16_widen(diff))


def lycoris_scale(strength, alpha=None, dim=None):
    """A LoKr's or LoHa's scale as ComfyUI computes it: s * (alpha / dim) in f64 (Python
    floats), rounded once to f32; f32(s) where the file has no alpha or the adapter no
    low-rank factor (docs/arithmetic.md §1, LoKr and LoHa)."""
    if alpha is None or dim is None:
        return np.float32(strength)
    return np.float32(float(strength) * (float(alpha) / float(dim)))


def lokr_factor(whole=None, a=None, b=None):
    """One Kronecker factor of a LoKr as f32: stored whole (values, taken as f32), or the
    product a @ b of its low-rank halves (bf16 bits: a [m, r], b [r, n]), f32 from 0.0 in k
    order (lora_product's order)."""
    if whole is not None:
        return np.asarray(whole, dtype=np.float32)
    return lora_product(b, a)


def lokr_delta(w1, w2, scale):
    """A LoKr's delta: delta[p, q] = bf16(f32(c) * f32(w1[p // m2, q // n2] * w2[p % m2,
    q % n2])) for f32 factors w1 [m1, n1] and w2 [m2, n2]: each element of the Kronecker
    product one f32 product, then the scale, then one rounding."""
    return bf16_round(np.float32(scale) * _kron(w1, w2))


def _kron(w1, w2):
    """The Kronecker product of two f32 factors, each element one f32 product."""
    w1 = np.asarray(w1, dtype=np.float32)
    w2 = np.asarray(w2, dtype=np.float32)
    (m1, n1), (m2, n2) = w1.shape, w2.shape
    return (w1[:, None, :, None] * w2[None, :, None, :]).reshape(m1 * m2, n1 * n2)


def loha_delta(w1_a, w1_b, w2_a, w2_b, scale):
    """A LoHa's delta: bf16(f32(c) * f32(m1 * m2)), m1 = w1_a @ w1_b and m2 = w2_a @ w2_b
    (bf16 bits: *_a [out, r], *_b [r, in]) each f32 from 0.0 in k order."""
    m1 = lora_product(w1_b, w1_a)
    m2 = lora_product(w2_b, w2_a)
    return bf16_round(np.float32(scale) * (m1 * m2))


def _lokr_factors(item):
    """A LoKr item's two factors in f32: each bf16 bits (stored whole) or a pair (a, b)."""
    return [lokr_factor(a=f[0], b=f[1]) if isinstance(f, tuple) else bf16_widen(f)
            for f in (item.w1, item.w2)]


def _kind(item):
    """"lokr" (an item with w1, w2, scale), "loha" (w1_a, w1_b, w2_a, w2_b, scale), "diff"
    ((diff, s)) or "lora" ((A, B, s))."""
    if hasattr(item, "w2"):
        return "lokr"
    if hasattr(item, "w2_a"):
        return "loha"
    return "diff" if len(item) == 2 else "lora"


def adapter_delta(item):
    """The bf16 delta of one adapter: (A, B, s), a LoRA (lora_delta); (diff, s), a
    full-weight difference (diff_delta); a LoKr (w1, w2, scale; each factor bf16 bits or a
    pair (a, b)) or a LoHa (w1_a, w1_b, w2_a, w2_b, scale), as ltx2blas.LoKr and LoHa."""
    kind = _kind(item)
    if kind == "lokr":
        return lokr_delta(*_lokr_factors(item), item.scale)
    if kind == "loha":
        return loha_delta(item.w1_a, item.w1_b, item.w2_a, item.w2_b, item.scale)
    return diff_delta(*item) if kind == "diff" else lora_delta(*item)


def later_term(item):
    """(acc, s): what a later addmm term adds, f32(s * acc), acc unscaled in f32: a LoRA's
    lora_product(A, B) (B unscaled), a difference's f32(diff), a LoKr's Kronecker product, a
    LoHa's m1 * m2."""
    kind = _kind(item)
    if kind == "lokr":
        return _kron(*_lokr_factors(item)), item.scale
    if kind == "loha":
        return (lora_product(item.w1_b, item.w1_a) * lora_product(item.w2_b, item.w2_a),
                item.scale)
    if kind == "diff":
        return bf16_widen(item[0]), item[1]
    return lora_product(item[0], item[1]), item[2]


def aggregate_delta(adapters, rule="addmm"):
    """The bf16 delta of one or more adapters on one weight, by a named rule.  Each adapter is
    (A, B, s), a LoRA, (diff, s), a full-weight difference, a LoKr or a LoHa (adapter_delta).

    "sum":   total = bf16(0.0 + f32(delta_1) + f32(delta_2) + ...), f32, in adapter order.
    "addmm": agg = delta_1; then for each later adapter i, in order,
             agg = bf16(f32(agg) + f32(f32(s_i) * acc_i)), (acc_i, s_i) = later_term(i):
             lora_product(A_i, B_i) for a LoRA (B unscaled), f32(diff_i) for a difference,
             the unscaled Kronecker or element-wise product for a LoKr or LoHa.
    Each delta_i is adapter_delta's (a LoRA's strength rounded into B first)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    adapters = list(adapters)
    if rule == "sum":
        total = np.float32(0.0)
        for item in adapters:
            total = total + bf16_widen(adapter_delta(item))
        return bf16_round(total)
    agg = adapter_delta(adapters[0])
    for item in adapters[1:]:
        acc, s = later_term(item)
        agg = bf16_round(bf16_widen(agg) + np.float32(s) * acc)
    return agg


def fuse_loras(weight, adapters, rule="addmm"):
    """Several adapters (docs/arithmetic.md §1): W' = bf16(f32(W) + f32(agg)), agg = aggregate_delta(adapters,
    rule).  ``adapters`` is a sequence of (lora_a, lora_b, strength)."""
    agg = aggregate_delta(adapters, rule)
    return bf16_round(bf16_widen(weight) + bf16_widen(agg))


def fuse_bias(bias, items):
    """Bias terms (docs/arithmetic.md §1): acc = f32(bias); acc = acc + f32(f32(s) * f32(b)) for each (b, s)
    in order; rounded once into the bias's dtype (bf16 bits, float16, float32).  b is bf16
    bits, float16 or float32."""
    def f32(x):
        x = np.asarray(x)
        return bf16_widen(x) if x.dtype == np.uint16 else x.astype(np.float32)

    bias = np.asarray(bias)
    acc = f32(bias)
    for b, s in items:
        acc = acc + np.float32(s) * f32(b)
    if bias.dtype == np.uint16:
        return bf16_round(acc)
    return acc.astype(bias.dtype)


DORA_EPS = np.float32(2.0 ** -23)  # ComfyUI's eps: f32's machine epsilon (its CPU dtype)


def _sum_squares(v, axis):
    """sqrt of the sum of squares of f32 values along an axis, in f64, in index order from 0.0,
    rounded once to f32."""
    v = np.asarray(v, np.float64)
    v = v if axis == 1 else v.T
    acc = np.zeros(v.shape[0], np.float64)
    for i in range(v.shape[1]):
        acc = acc + v[:, i] * v[:, i]
    return np.sqrt(acc).astype(np.float32)


def fuse_dora(weight, lora_a, lora_b, magnitude, scale=1.0, strength=1.0, style="peft"):
    """DoRA (docs/arithmetic.md §1): the LoRA-fused weight rescaled to the adapter's magnitudes.

        V  = bf16(f32(W) + f32(delta)),  delta = lora_delta(A, B, scale)   (scale = alpha/rank)
        "peft"  (lora_magnitude_vector, [out]):  n_o = ||V[o, :]||;  f = f32(m_o / n_o) per row
        "comfy" (dora_scale [out, 1]): n_o = f32(||W[o, :]|| + eps) per row, as ComfyUI takes
                 the unpatched weight's norm on this axis;
                (dora_scale [1, in]):  n_i = f32(||V[:, i]|| + eps) per column
        full = bf16(f32(V) * f)
        W'   = full if strength == 1, else bf16(f32(W) + f32(f32(s) * f32(f32(full) - f32(W))))
    Norms: the sum of squares in f64 in index order, its sqrt rounded to f32; eps = 2^-23.
    ``magnitude`` is f32 or bf16 bits."""
    w = bf16_widen(weight)
    v = bf16_widen(bf16_round(w + bf16_widen(lora_delta(lora_a, lora_b, scale))))
    m = np.asarray(magnitude)
    m = bf16_widen(m) if m.dtype == np.uint16 else m.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        if style == "peft":
            f = (m.reshape(-1) / _sum_squares(v, 1))[:, None]
        elif m.shape[0] == w.shape[0]:
            f = m.reshape(-1, 1) / (_sum_squares(w, 1) + DORA_EPS)[:, None]
        else:
            f = m.reshape(1, -1) / (_sum_squares(v, 0) + DORA_EPS)[None, :]
        full = bf16_round(v * f.astype(np.float32))
        if np.float32(strength) == 1:
            return full
        return bf16_round(w + np.float32(strength) * (bf16_widen(full) - w))


# --------------------------------------------------------------------------------------------
# fp8 (docs/arithmetic.md §2): F8_E4M3 is float8_e4m3fn (no inf, NaN = 0x7F/0xFF, largest 448), F8_E5M2 is
# float8_e5m2 (IEEE-like: inf and NaN).  Rounding follows torch's cast, upstream's engine:
# nearest-even; past the largest finite value (inf too) e5m2 goes to +-inf, and e4m3fn by one
# of two rules: overflow="saturate", +-448, as torch casts from 2.13 on; overflow="nan", the
# NaN code 0x7F/0xFF, as torch cast up to 2.12.  NaN becomes the code 0x7F with its sign.
# --------------------------------------------------------------------------------------------

FP8_FORMATS = {
    "F8_E4M3": {"mantissa": 3, "bias": 7, "largest": 448.0, "saturates": True},
    "F8_E5M2": {"mantissa": 2, "bias": 15, "largest": 57344.0, "saturates": False},
}


def fp8_widen(codes, fmt):
    """fp8 codes -> f32 values, exact (every fp8 value is a bf16 and an f32 value)."""
    spec = FP8_FORMATS[fmt]
    mant, bias = spec["mantissa"], spec["bias"]
    table = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        exponent = (code >> mant) & ((1 << (7 - mant)) - 1)
        fraction = code & ((1 << mant) - 1)
        if fmt == "F8_E4M3" and (code & 0x7F) == 0x7F:
            value = np.nan
        elif fmt == "F8_E5M2" and exponent == 31:
            value = np.inf if fraction == 0 else np.nan
        elif exponent == 0:
            value = fraction * 2.0 ** (1 - bias - mant)
        else:
            value = (1 + fraction / 2**mant) * 2.0 ** (exponent - bias)
        table[code] = sign * value
    return table[bits(codes, np.uint8)]


def fp8_round(x, fmt, overflow="saturate"):
    """f32 values -> fp8 codes, by the rule above."""
    if overflow not in ("saturate", "nan"):
        raise ValueError(f"overflow is 'saturate' or 'nan', not {overflow!r}")
    with np.errstate(invalid="ignore", over="ignore"):  # NaN payloads, huge codes masked below
        return _fp8_round(np.asarray(x, dtype=np.float32).astype(np.float64), FP8_FORMATS[fmt],
                          overflow)


def _fp8_round(x, spec, overflow_rule):
    mant, bias, largest = spec["mantissa"], spec["bias"], spec["largest"]
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.int64)
    a = np.abs(x)
    finite = np.isfinite(a)
    safe = np.where(finite & (a > 0), a, 1.0)
    exponent = np.frexp(safe)[1] - 1                  # a = 1.f * 2^exponent
    exponent = np.maximum(exponent, 1 - bias)         # below that, the subnormal spacing
    quantum = np.ldexp(1.0, exponent - mant)
    q = np.rint(safe / quantum) * quantum             # np.rint rounds half to even
    q = np.where(finite & (a > 0), q, 0.0)
    overflow = ~finite | (q > largest)
    # encode q
    q_exp = np.frexp(np.where(q > 0, q, 1.0))[1] - 1
    normal = q >= 2.0 ** (1 - bias)
    code_normal = ((q_exp + bias) << mant) + np.rint(
        (q / np.ldexp(1.0, q_exp) - 1) * 2**mant).astype(np.int64)
    code_sub = np.rint(q / 2.0 ** (1 - bias - mant)).astype(np.int64)
    code = np.where(normal, code_normal, code_sub)
    if not spec["saturates"]:
        over_code = 0x7C                              # +-inf
    else:
        over_code = 0x7E if overflow_rule == "saturate" else 0x7F    # +-448, or NaN
    code = np.where(overflow, over_code, code)
    code = np.where(np.isnan(x), 0x7F, code)
    return (code | sign).astype(np.uint8)


def fuse_loras_fp8(weight, adapters, fmt, rule="addmm", overflow="saturate"):
    """fp8 weight (docs/arithmetic.md §2): W' = fp8(bf16(f32(total) + f32(bf16(W)))), total the bf16 delta of
    one adapter (fuse_lora's) or aggregate_delta's of several; nearest-even into fp8, past the
    largest finite value by the ``overflow`` rule (fp8_round)."""
    weight = bits(weight, np.uint8)
    total = adapter_delta(adapters[0]) if len(adapters) == 1 else aggregate_delta(adapters, rule)
    w_bf16 = bf16_round(fp8_widen(weight, fmt))       # exact
    return fp8_round(bf16_widen(bf16_round(bf16_widen(total) + bf16_widen(w_bf16))), fmt, overflow)


# --------------------------------------------------------------------------------------------
# Scaled and quantised layouts (docs/arithmetic.md §2).  Each is fused as its owner fuses it: dequantise, add
# the bf16 aggregate delta, requantise into the same layout, with new scales where the owner's
# rule computes new ones.  Written as torch evaluates the owners' expressions: a Python number
# divided by a tensor is the tensor's reciprocal times the number (two roundings), a tensor
# divided by a number one division; every f32 operation rounds once.  Where the owner's rule
# divides by a zero maximum (an all-zero tensor or block) and would write NaN codes with a zero
# scale, the codes here are the zeros themselves and the scale the same zero.
# --------------------------------------------------------------------------------------------

E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
FP6_SCALE_MAX = np.float32(0.1172)   # upstream's blockwise fp6: largest magnitude after scaling
BLOCK = 128                          # blockwise fp8 / fp6: 128 x 128 blocks, one f32 scale each
NVFP4_GROUP = 16                     # NVFP4: 16 consecutive elements of a row per block scale


def _recip(x):
    """torch's ``x.reciprocal()`` (and ``1 / x``) in f32: one correctly rounded division."""
    with np.errstate(divide="ignore"):
        return np.float32(1.0) / np.asarray(x, np.float32)


def _max_abs(x):
    return np.float32(np.max(np.abs(np.asarray(x, np.float32)))) if np.size(x) else np.float32(0)


def fuse_scaled_fp8(codes, scale, delta, fmt="F8_E4M3", owner="ltx"):
    """Per-tensor scaled fp8: codes [out, in] with one f32 ``scale``; returns (codes, scale).

    Both owners merge in f32:  n = f32(f32(code) * scale) + f32(delta).
    "ltx" (upstream LTX-2's fp8_scaled_mm rule, e4m3 only):
        m = 448 * f32(1 / max|n|);  code' = fp8(clamp(f32(n * m), -448, 448));  scale' = f32(1 / m)
    "comfy" (ComfyUI's requantisation with a recalculated scale, nearest rounding):
        scale' = f32(max|n| / fmax);  code' = fp8(clamp(f32(n * f32(1 / scale')), -fmax, fmax))
    fmax is the format's largest finite value (448, or 57344 for F8_E5M2)."""
    fmax = np.float32(FP8_FORMATS[fmt]["largest"])
    n = fp8_widen(codes, fmt) * np.float32(scale) + bf16_widen(delta)
    amax = _max_abs(n)
    if owner == "ltx":
        mult = _recip(amax) * E4M3_MAX
        new_scale = _recip(mult)
    else:
        new_scale = amax / fmax
        mult = _recip(new_scale)
    if amax == 0:
        return fp8_round(n, fmt), np.float32(new_scale)
    return fp8_round(np.clip(n * np.float32(mult), -fmax, fmax), fmt), np.float32(new_scale)


def _blocks(x):
    """[out, in] -> [out/128, in/128, 128, 128] view of 128 x 128 blocks."""
    o, i = x.shape
    return x.reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK).swapaxes(1, 2)


def _unblocks(b):
    ob, ib = b.shape[:2]
    return b.swapaxes(1, 2).reshape(ob * BLOCK, ib * BLOCK)


def dequantize_block(codes, scales):
    """Blockwise fp8's values as upstream dequantises them: bf16(f32(code) * scale[block]), e4m3
    codes [out, in], f32 scales [out/128, in/128]; bf16 bits."""
    s = np.asarray(scales, np.float32)
    return bf16_round(fp8_widen(codes, "F8_E4M3") * np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1))


def fuse_block_fp8(codes, scales, delta, scale_max=E4M3_MAX):
    """Blockwise fp8 (upstream's blockwise policy): e4m3 codes [out, in], f32 scales
    [out/128, in/128]; returns (codes, scales).

        w      = bf16(f32(code) * scale[block])            # dequantise
        merged = bf16(f32(w) + f32(delta))
        per block: m = scale_max * f32(1 / max|merged|)
        code'  = e4m3(f32(merged * m));  scale'[block] = f32(1 / m)"""
    w = dequantize_block(codes, scales)
    merged = bf16_widen(bf16_round(bf16_widen(w) + bf16_widen(delta)))
    blocks = _blocks(merged)
    absmax = np.max(np.abs(blocks), axis=(2, 3))
    mult = _recip(absmax) * np.float32(scale_max)
    new_scales = _recip(mult)
    with np.errstate(invalid="ignore", over="ignore"):
        scaled = blocks * mult[:, :, None, None]
    # a zero where mult is inf (an all-zero block, or one below 448 x 2^-128) is itself
    scaled = np.where(blocks == 0, blocks, scaled)
    return fp8_round(_unblocks(scaled), "F8_E4M3"), new_scales


def fp6_unpack(packed, cols):
    """Upstream's fp6: each group of 4 six-bit codes s e e m m m (the e4m3 code's sign, its two
    low exponent bits and its mantissa) packed big-endian into 3 bytes; unpacked to e4m3 codes
    whose two high exponent bits are 0."""
    p = bits(packed, np.uint8).reshape(packed.shape[0], -1, 3).astype(np.uint32)
    word = (p[..., 0] << 16) | (p[..., 1] << 8) | p[..., 2]
    six = np.stack([(word >> s) & 0x3F for s in (18, 12, 6, 0)], axis=-1).reshape(p.shape[0], cols)
    return (((six >> 5) << 7) | (six & 0x1F)).astype(np.uint8)


def fp6_pack(codes):
    """e4m3 codes [out, in] -> upstream's packed fp6 [out, in * 3 / 4] (drops bits 6 and 5)."""
    c = bits(codes, np.uint8).astype(np.uint32)
    six = (((c >> 7) & 1) << 5) | (c & 0x1F)
    six = six.reshape(c.shape[0], -1, 4)
    word = (six[..., 0] << 18) | (six[..., 1] << 12) | (six[..., 2] << 6) | six[..., 3]
    out = np.stack([(word >> 16) & 0xFF, (word >> 8) & 0xFF, word & 0xFF], axis=-1)
    return out.reshape(c.shape[0], -1).astype(np.uint8)


def fuse_block_fp6(packed, scales, delta):
    """Blockwise fp6 (upstream): unpack to e4m3, fuse_block_fp8 with the fp6 scale maximum
    (0.1172, so that no code needs the dropped exponent bits), pack again.  An all-zero block
    quantises upstream to NaN codes, whose packed fp6 is 0x1F, with a zero scale: kept as is, it
    dequantises to zero."""
    cols = packed.shape[1] * 4 // 3
    codes, new_scales = fuse_block_fp8(fp6_unpack(packed, cols), scales, delta, FP6_SCALE_MAX)
    zero = np.repeat(np.repeat(new_scales == 0, BLOCK, 0), BLOCK, 1)
    codes = np.where(zero, np.uint8(0x7F), codes)
    return fp6_pack(codes), new_scales


E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def e2m1_round(x):
    """f32 -> FP4 E2M1 codes (sign bit 8), nearest-even on the grid, saturating at +-6."""
    x = np.asarray(x, np.float32)
    a = np.abs(x).astype(np.float64)
    code = np.zeros(x.shape, np.int64)
    for c in range(1, 8):   # the nearest grid value, ties to the even code
        lo, hi = E2M1_VALUES[c - 1], E2M1_VALUES[c]
        mid = (lo + hi) / 2
        code = np.where((a > mid) | ((a == mid) & (c % 2 == 0)), c, code)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


def e2m1_widen(codes):
    codes = bits(codes, np.uint8)
    v = E2M1_VALUES[codes & 7]
    return np.where(codes & 8, -v, v).astype(np.float32)


def nvfp4_scale_offset(row, col, padded_cols):
    """Where block scale (row, col) lies in the cuBLAS 128 x 4 tiled layout of a
    [roundup(rows, 128), padded_cols] array (padded_cols a multiple of 4)."""
    tile = (row // 128) * (padded_cols // 4) + col // 4
    r = row % 128
    return tile * 512 + (r % 32) * 16 + (r // 32) * 4 + col % 4


def nvfp4_unpack(packed):
    p = bits(packed, np.uint8)
    return np.stack([p >> 4, p & 0xF], axis=-1).reshape(p.shape[0], -1)


def nvfp4_pack(codes):
    c = bits(codes, np.uint8).reshape(codes.shape[0], -1, 2)
    return ((c[..., 0] << 4) | c[..., 1]).astype(np.uint8)


def from_tiled(tiled, rows, groups):
    """The [rows, groups] block scale bytes out of an array in the 128 x 4 tiled layout."""
    flat = bits(tiled, np.uint8).reshape(-1)
    r, c = np.meshgrid(np.arange(rows), np.arange(groups), indexing="ij")
    return flat[nvfp4_scale_offset(r, c, tiled.shape[1])]


def to_tiled(values, shape=None):
    """[rows, groups] block scale bytes placed in an array of the 128 x 4 tiled layout, of
    ``shape`` (by default rows rounded up to 128, groups to 4), zeros in its padding."""
    rows, groups = values.shape
    if shape is None:
        shape = (-(-rows // 128) * 128, -(-groups // 4) * 4)
    out = np.zeros(int(np.prod(shape)), np.uint8)
    r, c = np.meshgrid(np.arange(rows), np.arange(groups), indexing="ij")
    out[nvfp4_scale_offset(r, c, shape[1])] = values
    return out.reshape(shape)


def dequantize_nvfp4(packed, block_scales, scale_2):
    """NVFP4's values as upstream dequantises them: bf16(f32(e2m1) * f32(scale_2 * f32(block
    scale))), the block scales in the tiled layout; bf16 bits."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    bs = fp8_widen(from_tiled(block_scales, rows, cols // NVFP4_GROUP), "F8_E4M3")
    total = np.float32(scale_2) * bs
    return bf16_round(e2m1_widen(nvfp4_unpack(packed)) * np.repeat(total, NVFP4_GROUP, 1))


def fuse_nvfp4(packed, block_scales, scale_2, delta):
    """NVFP4 (upstream's rule, its CUDA kernels written out): packed E2M1 [out, in/2] (element
    2j in the high nibble), E4M3 block scales in the tiled layout, one f32 ``scale_2``; returns
    (packed, block scales (uint8 codes), scale_2).

        w      = bf16(f32(e2m1) * f32(scale_2 * f32(block scale)))
        merged = bf16(f32(w) + f32(delta))
        t      = f32(max|merged| * f32(1 / 2688))                  # the new scale_2
        block: s = e4m3(min(f32(f32(max|block| / 6) / t), 448)) if t > 0 else 0
               total = f32(t * f32(s));  inv = f32(1 / total) if total > 0 else 0
        code   = e2m1(f32(merged * inv))"""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    groups = cols // NVFP4_GROUP
    w = dequantize_nvfp4(packed, block_scales, scale_2)
    merged = bf16_widen(bf16_round(bf16_widen(w) + bf16_widen(delta)))
    t = np.float32(_max_abs(merged) * np.float32(1.0 / 2688.0))
    g = merged.reshape(rows, groups, NVFP4_GROUP)
    bmax = np.max(np.abs(g), axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.minimum((bmax / E2M1_MAX) / t, E4M3_MAX) if t > 0 else np.zeros_like(bmax)
    s_codes = fp8_round(s, "F8_E4M3")
    tot = t * fp8_widen(s_codes, "F8_E4M3")
    with np.errstate(over="ignore"):
        inv = np.where(tot > 0, _recip(np.where(tot > 0, tot, 1)), 0).astype(np.float32)
    # a zero where inv is inf (a total below 2^-128) is itself
    codes = e2m1_round(_times(g, inv[:, :, None])).reshape(rows, cols)
    return nvfp4_pack(codes), to_tiled(s_codes, block_scales.shape), t


# --------------------------------------------------------------------------------------------
# ComfyUI's per-layer layouts beyond per-tensor fp8 (a ``comfy_quant`` marker naming nvfp4,
# mxfp8 or int8_tensorwise), fused as ComfyUI fuses them on the CPU: comfy-kitchen dequantises
# into f32 (its eager arithmetic, every step one f32 operation), the delta is added in f32, and
# the sum is requantised with new scales by comfy-kitchen's quantiser.  ComfyUI's LoRA path adds
# noise before rounding (stochastic rounding from torch's generator); the rules here round to
# nearest, as that quantiser does without the noise.  As above, where the owner's rule would
# divide by a zero maximum, the codes are zeros and the scale zero.
# --------------------------------------------------------------------------------------------

MXFP8_GROUP = 32      # MXFP8: 32 consecutive elements of a row per E8M0 exponent
INT8_MAX = np.float32(127.0)
INT8_SCALE_MIN = np.float32(1e-30)   # comfy-kitchen's floor on an int8 scale


def fuse_comfy_nvfp4(packed, block_scales, scale_2, delta):
    """ComfyUI's nvfp4 (the same storage as upstream's: packed E2M1, E4M3 block scales of 16
    in the tiled layout, one f32 ``scale_2``); returns (packed, block scales, scale_2).

        w      = f32(e2m1 * f32(scale_2 * f32(block scale)))
        n      = f32(w + f32(delta))
        t      = f32(max|n| / 2688)                                   # the new scale_2
        block: s = e4m3(min(f32(f32(max|block| / 6) / t), 448));  total = f32(t * f32(s))
        code   = e2m1(f32(n / total)), or +0 where total is 0
    Upstream's rule differs: it rounds w and n to bf16, and multiplies by f32(1 / 2688) and by
    f32(1 / total) where ComfyUI divides."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    groups = cols // NVFP4_GROUP
    bs = fp8_widen(from_tiled(block_scales, rows, groups), "F8_E4M3")
    w = e2m1_widen(nvfp4_unpack(packed)) * np.repeat(np.float32(scale_2) * bs, NVFP4_GROUP, 1)
    n = w + bf16_widen(delta)
    t = np.float32(_max_abs(n) / np.float32(2688.0))
    g = n.reshape(rows, groups, NVFP4_GROUP)
    if t == 0:   # all zero: the owner's 0 / 0 would make NaN scales
        return nvfp4_pack(np.zeros((rows, cols), np.uint8)), np.zeros_like(
            bits(block_scales, np.uint8)), t
    s = np.minimum((np.max(np.abs(g), axis=2) / np.float32(6.0)) / t, E4M3_MAX)
    s_codes = fp8_round(s, "F8_E4M3")
    total = t * fp8_widen(s_codes, "F8_E4M3")
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(total[:, :, None] > 0, g / total[:, :, None], np.float32(0.0))
    codes = e2m1_round(q.astype(np.float32)).reshape(rows, cols)
    return nvfp4_pack(codes), to_tiled(s_codes, block_scales.shape), t


def e8m0_widen(codes):
    """E8M0 exponent bytes -> f32 scales 2^(e - 127), byte 0 read as 0 (comfy-kitchen's
    decoding) and 255 as NaN."""
    e = bits(codes, np.uint8).astype(np.int64)
    v = np.ldexp(np.float32(1.0), np.clip(e, 1, 254) - 127).astype(np.float32)
    return np.where(e == 0, np.float32(0.0), np.where(e == 255, np.float32(np.nan), v))


def e8m0_for(top):
    """The E8M0 exponent of a block of largest magnitude ``top`` (f32, > 0):
    ceil(log2(max(f32(top / 448), 2^-127))) + 127, clamped to 0 .. 254, with the log2 rounded
    to f32 as comfy-kitchen computes it (correctly rounded here), so that a quotient a few f32
    steps above a power of two takes the power's exponent."""
    needed = np.maximum(np.asarray(top, np.float32) / E4M3_MAX, np.float32(2.0 ** -127))
    log2 = np.log2(needed.astype(np.float64)).astype(np.float32)
    return np.clip(np.ceil(log2).astype(np.int64) + 127, 0, 254)


def fuse_comfy_mxfp8(codes, block_scales, delta):
    """ComfyUI's mxfp8: e4m3 codes [out, in] and an E8M0 exponent per 32 elements of a row in
    the tiled layout; returns (codes, block scales).

        w     = f32(f32(code) * 2^(e - 127))
        n     = f32(w + f32(delta))
        block: e' = e8m0_for(max|block|);  code' = e4m3(clamp(f32(n / 2^(e' - 127)), -448, 448))
    A block whose maximum is 0, or below 448 * 2^-127 (so that e' is 0, a zero scale), is
    written as zero codes with e' = 0; the owner's rule divides by that zero."""
    rows, cols = codes.shape
    groups = cols // MXFP8_GROUP
    scale = e8m0_widen(from_tiled(block_scales, rows, groups))
    w = fp8_widen(codes, "F8_E4M3") * np.repeat(scale, MXFP8_GROUP, 1)
    n = (w + bf16_widen(delta)).reshape(rows, groups, MXFP8_GROUP)
    top = np.max(np.abs(n), axis=2)
    e = np.where(top > 0, e8m0_for(np.where(top > 0, top, 1)), 0)
    zero = e == 0
    e = np.where(zero, 0, e)
    step = np.ldexp(np.float32(1.0), np.where(zero, 127, e) - 127).astype(np.float32)
    q = np.clip(n / step[:, :, None], -E4M3_MAX, E4M3_MAX)
    out = np.where(zero[:, :, None], np.uint8(0), fp8_round(q, "F8_E4M3"))
    return out.reshape(rows, cols), to_tiled(e.astype(np.uint8), block_scales.shape)


def fuse_comfy_int8(codes, scale, delta):
    """ComfyUI's int8_tensorwise: int8 codes [out, in] with one f32 scale (0-d), or one per
    row ([out, 1], as ComfyUI requantises a weight whose scale has dimensions); returns
    (codes, scale).

        w      = f32(f32(code) * scale)
        n      = f32(w + f32(delta))
        scale' = max(f32(max|n| / 127), 1e-30)       (the tensor's maximum, or the row's)
        code'  = clamp(round_half_even(f32(n / scale')), -128, 127)"""
    s = np.asarray(scale, np.float32)
    n = bits(codes, np.int8).astype(np.float32) * s + bf16_widen(delta)
    top = np.max(np.abs(n), axis=1, keepdims=True) if s.ndim == 2 else _max_abs(n)
    new = np.maximum(np.asarray(top, np.float32) / INT8_MAX, INT8_SCALE_MIN)
    q = np.clip(np.rint(n / new), -128, 127).astype(np.int8)
    return q, new.reshape(s.shape)


#: Layout name -> the rule above that fuses it.
LAYOUTS = ("fp8_scaled", "comfy_fp8", "fp8_block", "fp6_block", "nvfp4", "comfy_nvfp4",
           "comfy_mxfp8", "comfy_int8")


def fuse_quantized(layout, weight, scales, adapters, rule="addmm", fmt="F8_E4M3"):
    """One of LAYOUTS fused with adapters [(A, B, strength)]: the aggregate delta of
    aggregate_delta (one adapter: lora_delta), then the layout's rule.  ``scales`` is (scale,)
    or, for the nvfp4 layouts, (block scales, scale_2); returns (weight, *scales)."""
    agg = adapter_delta(adapters[0]) if len(adapters) == 1 else aggregate_delta(adapters, rule)
    if layout == "fp8_scaled":
        return fuse_scaled_fp8(weight, scales[0], agg, fmt, "ltx")
    if layout == "comfy_fp8":
        return fuse_scaled_fp8(weight, scales[0], agg, fmt, "comfy")
    if layout == "fp8_block":
        return fuse_block_fp8(weight, scales[0], agg)
    if layout == "fp6_block":
        return fuse_block_fp6(weight, scales[0], agg)
    if layout == "nvfp4":
        return fuse_nvfp4(weight, scales[0], scales[1], agg)
    if layout == "comfy_nvfp4":
        return fuse_comfy_nvfp4(weight, scales[0], scales[1], agg)
    if layout == "comfy_mxfp8":
        return fuse_comfy_mxfp8(weight, scales[0], agg)
    if layout == "comfy_int8":
        return fuse_comfy_int8(weight, scales[0], agg)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


# --------------------------------------------------------------------------------------------
# Quantising a bf16 weight (docs/arithmetic.md §2, "Quantising bf16 weights").  Each rule takes
# a bf16 weight w [rows, cols] (bits; every value finite) and returns the arrays its owner
# stores, in the owner's order: codes, then scales.  The arithmetic is the owner's own, written
# as in the fuse rules above: every f32 operation rounds once; bf16(v) marks where the owner
# computes in the weight's dtype and so rounds to bf16.  The one departure: where the owner
# computes 0 x inf or 0 / 0 (a zero element under a scale that is zero or so small that its
# reciprocal is inf: an all-zero tensor or block, or one whose largest magnitude is below
# about 2^-119) and would write a NaN code, the code here is that zero itself, with its sign.
# comfy_mxfp8 keeps fuse_comfy_mxfp8's departure instead (zero codes in any block of exponent
# 0), and comfy_nvfp4 the owner's treatment of a zero block (zero scale, +0 codes) wherever its
# block scale would be NaN.
# --------------------------------------------------------------------------------------------

QUANTIZE_FORMATS = ("fp8_scaled", "comfy_fp8", "fp8_block", "nvfp4", "comfy_nvfp4",
                    "comfy_mxfp8", "comfy_int8")


def _roundup(n, m):
    return -(-n // m) * m


def _padded(x, rows, cols):
    """f32 values zero-padded (+0) at the end of each axis to [rows, cols]."""
    out = np.zeros((rows, cols), np.float32)
    out[:x.shape[0], :x.shape[1]] = x
    return out


def _times(x, m):
    """f32(x * m), where 0 x inf (NaN) is the zero x itself."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = (x * m).astype(np.float32)
    return np.where(np.isnan(p), x, p)


def quantize_fp8_scaled(w):
    """Per-tensor scaled e4m3 (upstream LTX-2's quantize_weight_to_fp8_per_tensor); returns
    (codes uint8 [rows, cols], scale f32 ()).

        m     = f32(1 / max|w|) * 448
        code  = e4m3(clamp(f32(w * m), -448, 448));   scale = f32(1 / m)
    The fuse_scaled_fp8 "ltx" rule on the bf16 weight itself.  An all-zero weight (m = inf,
    scale 0) keeps its zeros as codes (-0.0 stays 0x80) where the owner writes NaN."""
    w = bits(w, np.uint16)
    x = bf16_widen(w)
    with np.errstate(over="ignore"):
        m = np.float32(_recip(_max_abs(x)) * E4M3_MAX)
    codes = fp8_round(np.clip(_times(x, m), -E4M3_MAX, E4M3_MAX), "F8_E4M3")
    return codes, np.array(_recip(m), np.float32)


def quantize_comfy_fp8(w, fmt="F8_E4M3"):
    """Per-tensor scaled fp8 as comfy-kitchen 0.2.40 quantises a bf16 weight
    (TensorCoreFP8Layout.quantize, then its eager quantize_per_tensor_fp8); returns
    (codes uint8 [rows, cols], scale f32 ()).

        scale = f32(bf16(max|w| / fmax))          the quotient taken in the weight's dtype
        code  = fp8(clamp(bf16(w * bf16(f32(1 / scale))), -fmax, fmax))
    fmax is 448 (F8_E4M3) or 57344 (F8_E5M2).  An all-zero weight (scale 0, 1 / scale = inf)
    keeps its zeros as codes where the owner writes NaN."""
    w = bits(w, np.uint16)
    fmax = np.float32(FP8_FORMATS[fmt]["largest"])
    x = bf16_widen(w)
    scale = bf16_widen(bf16_round(_max_abs(x) / fmax))
    with np.errstate(over="ignore"):                   # 1 / scale is inf below 2^-128
        inv = bf16_widen(bf16_round(_recip(scale)))
    q = bf16_widen(bf16_round(_times(x, inv)))
    return fp8_round(np.clip(q, -fmax, fmax), fmt), np.array(scale, np.float32)


def quantize_fp8_block(w):
    """Blockwise e4m3, one f32 scale per 128 x 128 block (upstream LTX-2's
    blockwise_quantize_weights); rows and cols multiples of 128; returns
    (codes uint8 [rows, cols], scales f32 [rows / 128, cols / 128]).

        per block:  m = f32(1 / max|block|) * 448
        code  = e4m3(f32(w * m))   (no clamp);   scale[block] = f32(1 / m)
    An all-zero block keeps its zeros as codes where the owner writes NaN, with scale 0."""
    w = bits(w, np.uint16)
    rows, cols = np.shape(w)
    if rows % BLOCK or cols % BLOCK:
        raise ValueError(f"fp8_block needs rows and cols that are multiples of {BLOCK}, "
                         f"got {rows} x {cols}")
    blocks = _blocks(bf16_widen(w))
    with np.errstate(over="ignore"):
        m = (_recip(np.max(np.abs(blocks), axis=(2, 3))) * E4M3_MAX).astype(np.float32)
    codes = fp8_round(_unblocks(_times(blocks, m[:, :, None, None])), "F8_E4M3")
    return codes, _recip(m)


def quantize_nvfp4(w):
    """NVFP4 as upstream LTX-2's CUDA kernel quantises a bf16 weight (ltx-kernels
    csrc/nvfp4/quantize.cu: amax_scale with divisor 2688, then the quantise kernel); cols a
    multiple of 16; returns (packed uint8 [rows, cols / 2], block scales uint8 (E4M3 codes)
    tiled [roundup(rows, 128), roundup(cols / 16, 4)], scale_2 f32 ()).

        g      = f32(max|w| * f32(1 / 2688))                           scale_2
        block of 16:  s = e4m3(min(f32(f32(max|block| / 6) / g), 448))   (0 if g = 0)
                      total = f32(g * f32(s));  inv = f32(1 / total)    (0 if total = 0)
        code   = e2m1(f32(w * inv))        nearest-even, saturating at 6, sign kept
    Element 2j of a row goes in the high nibble of byte j.  An all-zero weight needs no
    departure: g = 0, every s and inv 0, and each code is its zero times 0, sign kept.  A
    block whose total is below 2^-128 has inv = inf; a zero there (0 x inf, NaN, whose e2m1
    conversion the kernel leaves unknown here) is written as the zero itself."""
    w = bits(w, np.uint16)
    rows, cols = np.shape(w)
    if cols % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs cols that are a multiple of {NVFP4_GROUP}, got {cols}")
    groups = cols // NVFP4_GROUP
    x = bf16_widen(w).reshape(rows, groups, NVFP4_GROUP)
    g = np.float32(_max_abs(x) * np.float32(1.0 / 2688.0))
    top = np.max(np.abs(x), axis=2) if x.size else np.zeros((rows, groups), np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.minimum((top / E2M1_MAX) / g, E4M3_MAX) if g > 0 else np.zeros_like(top)
    s_codes = fp8_round(s, "F8_E4M3")
    total = (g * fp8_widen(s_codes, "F8_E4M3")).astype(np.float32)
    with np.errstate(over="ignore"):
        inv = np.where(total > 0, _recip(np.where(total > 0, total, 1)), 0).astype(np.float32)
    codes = e2m1_round(_times(x, inv[:, :, None])).reshape(rows, cols)
    return nvfp4_pack(codes), to_tiled(s_codes), np.array(g, np.float32)


def quantize_comfy_nvfp4(w):
    """NVFP4 as comfy-kitchen 0.2.40 quantises a bf16 weight (TensorCoreNVFP4Layout.quantize,
    then its eager quantize_nvfp4); rows and cols are padded with +0 to R16, C16 (multiples of
    16); returns (packed uint8 [R16, C16 / 2], block scales uint8 (E4M3 codes) tiled
    [roundup(R16, 128), roundup(C16 / 16, 4)], scale_2 f32 ()).

        t      = f32(bf16(max|w| / 2688))                 scale_2, the quotient in bf16
        block of 16:  s = e4m3(min(f32(f32(max|block| / 6) / t), 448));  total = f32(t * f32(s))
        code   = e2m1(clamp(f32(w / total), -6, 6)), or +0 in a block whose total is 0
    Element 2j of a row goes in the high nibble of byte j.  Where t is 0 (an all-zero weight,
    or one below 2688 x 2^-134), a block of zeros gets scale 0 and +0 codes (the owner's 0 / 0
    would make its scale and codes NaN); a block with a nonzero value gets, as from the owner,
    scale 448 and +0 codes."""
    w = bits(w, np.uint16)
    rows, cols = np.shape(w)
    r16, c16 = _roundup(rows, NVFP4_GROUP), _roundup(cols, NVFP4_GROUP)
    groups = c16 // NVFP4_GROUP
    x = _padded(bf16_widen(w), r16, c16).reshape(r16, groups, NVFP4_GROUP)
    t = bf16_widen(bf16_round(_max_abs(x) / np.float32(2688.0)))
    top = np.max(np.abs(x), axis=2) if x.size else np.zeros((r16, groups), np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.minimum((top / E2M1_MAX) / t, E4M3_MAX)
    s = np.where(np.isnan(s), np.float32(0), s)        # 0 / 0 where t is 0: the zero block
    s_codes = fp8_round(s, "F8_E4M3")
    total = (t * fp8_widen(s_codes, "F8_E4M3")).astype(np.float32)
    safe = np.where(total == 0, np.float32(1), total)
    with np.errstate(over="ignore"):
        q = np.where(total[:, :, None] == 0, np.float32(0), x / safe[:, :, None])
    codes = e2m1_round(np.clip(q, -E2M1_MAX, E2M1_MAX)).reshape(r16, c16)
    return nvfp4_pack(codes), to_tiled(s_codes), np.array(t, np.float32)


def quantize_comfy_mxfp8(w):
    """MXFP8 as comfy-kitchen 0.2.40 quantises a bf16 weight (TensorCoreMXFP8Layout.quantize,
    then its eager quantize_mxfp8); rows and cols are padded with +0 to R32, C32 (multiples of
    32); returns (codes uint8 [R32, C32], E8M0 exponent bytes tiled
    [roundup(R32, 128), roundup(C32 / 32, 4)]).

        block of 32:  e = ceil(log2(max(f32(max|block| / 448), 2^-127))) + 127, clamped to 0 .. 254
        code  = e4m3(clamp(f32(w / 2^(e - 127)), -448, 448))
    A block of zeros gets e = 0 and +0 codes, as from the owner.  A block whose maximum is
    nonzero but at most 448 x 2^-127 also takes e = 0, a zero scale the owner divides by (+-448
    codes, NaN for its zeros); here its codes are +0, as fuse_comfy_mxfp8 writes them."""
    w = bits(w, np.uint16)
    rows, cols = np.shape(w)
    r32, c32 = _roundup(rows, MXFP8_GROUP), _roundup(cols, MXFP8_GROUP)
    groups = c32 // MXFP8_GROUP
    x = _padded(bf16_widen(w), r32, c32).reshape(r32, groups, MXFP8_GROUP)
    top = np.max(np.abs(x), axis=2) if x.size else np.zeros((r32, groups), np.float32)
    e = np.where(top > 0, e8m0_for(np.where(top > 0, top, 1)), 0)
    zero = e == 0
    step = np.ldexp(np.float32(1.0), np.where(zero, 127, e) - 127).astype(np.float32)
    q = np.clip(x / step[:, :, None], -E4M3_MAX, E4M3_MAX)
    codes = np.where(zero[:, :, None], np.uint8(0), fp8_round(q, "F8_E4M3"))
    return codes.reshape(r32, c32), to_tiled(e.astype(np.uint8))


def quantize_comfy_int8(w, per_row=False):
    """int8 as comfy-kitchen 0.2.40 quantises a bf16 weight (TensorWiseINT8Layout.quantize:
    quantize_int8_tensorwise, or with per_channel quantize_int8_rowwise), without its
    stochastic rounding; returns (codes int8 [rows, cols], scale f32 () or [rows, 1]).

        scale = max(f32(max|w| / 127), 1e-30)        over the tensor, or over each row
        code  = clamp(round_half_even(bf16(w / bf16(scale))), -128, 127)
    The owner divides in the weight's dtype: the scale is rounded to bf16 and the quotient too,
    before the rounding to an integer.  The floor 1e-30 keeps every divisor nonzero, so an
    all-zero weight needs no departure (codes 0, scale 1e-30)."""
    w = bits(w, np.uint16)
    x = bf16_widen(w)
    if per_row:
        top = np.max(np.abs(x), axis=1, keepdims=True) if x.size else np.zeros((len(x), 1))
    else:
        top = _max_abs(x)
    scale = np.maximum(np.asarray(top, np.float32) / INT8_MAX, INT8_SCALE_MIN)
    q = bf16_widen(bf16_round(x / bf16_widen(bf16_round(scale))))
    return np.clip(np.rint(q), -128, 127).astype(np.int8), np.asarray(scale, np.float32)


def quantize_weight(fmt, w, **kw):
    """A bf16 weight quantised into one of QUANTIZE_FORMATS by the rule above; ``kw`` goes to
    it (``fmt="F8_E5M2"`` for comfy_fp8, ``per_row=True`` for comfy_int8)."""
    rules = {"fp8_scaled": quantize_fp8_scaled, "comfy_fp8": quantize_comfy_fp8,
             "fp8_block": quantize_fp8_block, "nvfp4": quantize_nvfp4,
             "comfy_nvfp4": quantize_comfy_nvfp4, "comfy_mxfp8": quantize_comfy_mxfp8,
             "comfy_int8": quantize_comfy_int8}
    if fmt not in rules:
        raise ValueError(f"format must be one of {QUANTIZE_FORMATS}, got {fmt!r}")
    return rules[fmt](bits(w, np.uint16), **kw)


# --------------------------------------------------------------------------------------------
# Deterministic stochastic rounding into fp8 (ltx2blas's own option; upstream's CUDA path and
# ComfyUI round stochastically too, with other generators).  For each element, 32 random bits
# r = splitmix64(key + i) (i the element's index in the tensor, key from the seed and the
# tensor's name); the significand bits below fp8 precision are added to r's low bits and the
# sum truncated, so a value rounds up with probability equal to its distance from the lower
# fp8 neighbour.  A finite value never rounds past the largest finite fp8 value.
# --------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def splitmix64(x):
    """splitmix64 on uint64 numpy arrays (or Python ints), wrapping modulo 2^64."""
    with np.errstate(over="ignore"):  # the wrap-around is the point
        x = np.asarray(x, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def stochastic_key(seed, name):
    """The per-tensor key: splitmix64(seed) xor the FNV-1a hash of the tensor's name (UTF-8)."""
    h = 0xCBF29CE484222325
    for byte in name.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) & _MASK64
    return int(splitmix64(np.uint64(seed & _MASK64))) ^ h


def fp8_round_stochastic(bf16_bits, fmt, key, index0=0):
    """bf16 bits (any shape, C order) -> fp8 codes by the stochastic rule above; element i of
    the array has index index0 + i in its tensor."""
    spec = FP8_FORMATS[fmt]
    mant, bias = spec["mantissa"], spec["bias"]
    largest = 0x7B if fmt == "F8_E5M2" else 0x7E
    h = np.asarray(bf16_bits, dtype=np.uint16).astype(np.int64)
    index = np.arange(h.size, dtype=np.uint64).reshape(h.shape) + np.uint64(index0)
    with np.errstate(over="ignore"):
        rnd = (splitmix64(np.uint64(key) + index) & np.uint64(0xFFFFFFFF)).astype(np.int64)
    sign = (h >> 8) & 0x80
    E, M = (h >> 7) & 0xFF, h & 0x7F
    significand = np.where(E > 0, 0x80 | M, M)           # 7 fraction bits
    field = np.maximum(E, 1) - 127 + bias                 # fp8 exponent field, if normal
    shift = np.minimum(7 - mant + np.where(field < 1, 1 - field, 0), 31)
    rounded = (significand + (rnd & ((1 << shift) - 1))) >> shift
    code = np.where(field < 1, rounded, ((field - 1) << mant) + rounded)
    code = np.minimum(code, largest)                      # never past the largest finite
    code = np.where((E == 0) & (M == 0), 0, code)
    special = np.where(M != 0, 0x7F, 0x7C if fmt == "F8_E5M2" else 0x7E)  # NaN; inf
    code = np.where(E == 0xFF, special, code)
    return (code | sign).astype(np.uint8)


# --------------------------------------------------------------------------------------------
# The text feature extractor (docs/arithmetic.md §4).  Gemma's hidden states [B, T, D, L] (D = 3840 wide,
# L = 49 layers; f32 or bf16) are normalised per sample (V1) or per token (V2), flattened so the
# feature index is d * L + l, cast to bf16, and projected; padded rows are zero.  The statistics
# are sums in f64 taken in a fixed order (over d for each token, then over tokens in order), so
# that anyone can reproduce them bit for bit; upstream computes them in the hidden states' own
# dtype on the GPU.
# --------------------------------------------------------------------------------------------

def _hidden_f32(hidden):
    hidden = np.asarray(hidden)
    return bf16_widen(hidden) if hidden.dtype == np.uint16 else hidden.astype(np.float32)


def _row_sums(x_t):
    """x_t [D, L] f32 -> (sum over d, in order, f64, from 0.0; the same of squares)."""
    s = np.zeros(x_t.shape[1], np.float64)
    q = np.zeros(x_t.shape[1], np.float64)
    for d in range(x_t.shape[0]):
        v = x_t[d].astype(np.float64)
        s = s + v
        q = q + v * v
    return s, q


def text_feature_stats(hidden, mask, version):
    """V1: (mean32, range32), each [B, L]; V2: inv32 [B, T, L].  See text_features."""
    x = _hidden_f32(hidden)
    b_n, t_n, d_n, l_n = x.shape
    mask = np.asarray(mask).astype(bool)
    if version == "v1":
        mean = np.zeros((b_n, l_n), np.float32)
        rng = np.ones((b_n, l_n), np.float32)
        for b in range(b_n):
            valid = np.flatnonzero(mask[b])
            if valid.size == 0:
                continue
            total = np.zeros(l_n, np.float64)
            for t in valid:                       # tokens in order
                total = total + _row_sums(x[b, t])[0]
            mean[b] = (total / (valid.size * d_n + 1e-6)).astype(np.float32)
            lo = x[b, valid].min(axis=(0, 1))
            hi = x[b, valid].max(axis=(0, 1))
            rng[b] = (hi - lo) + np.float32(1e-6)   # f32 subtraction, then f32 addition
        return mean, rng
    inv = np.zeros((b_n, t_n, l_n), np.float32)
    for b in range(b_n):
        for t in range(t_n):
            q = _row_sums(x[b, t])[1]
            inv[b, t] = (1.0 / np.sqrt(q / d_n + 1e-6)).astype(np.float32)
    return inv


def text_features_normalized(hidden, mask, version="v1", out_features=None):
    """The bf16 features [B, T, D * L] a projection multiplies (padded rows +0.0).

    V1: f = bf16(f32(f32(x - mean) / range) * 8), mean and range per sample and layer over the
        valid tokens x hidden dim: mean = f32(sum / (n * D + 1e-6)), range = f32(max - min) +
        f32(1e-6).
    V2: n = bf16(x * inv), inv = f32(1 / sqrt(sum_d x^2 / D + 1e-6)) per token and layer; then
        f = bf16(f32(n) * f32(sqrt(out_features / D))) -- one set of features per projection."""
    x = _hidden_f32(hidden)
    b_n, t_n, d_n, l_n = x.shape
    mask = np.asarray(mask).astype(bool)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if version == "v1":
            mean, rng = text_feature_stats(hidden, mask, "v1")
            normed = ((x - mean[:, None, None, :]) / rng[:, None, None, :]) * np.float32(8)
            feats = bf16_round(normed)
        else:
            inv = text_feature_stats(hidden, mask, "v2")
            n = bf16_round(x * inv[:, :, None, :])
            c = np.float32(np.sqrt(out_features / d_n))
            feats = bf16_round(bf16_widen(n) * c)
    feats = feats.reshape(b_n, t_n, d_n * l_n)
    feats[~mask] = 0
    return feats


def text_features(hidden, mask, projections, version="v1"):
    """docs/arithmetic.md §4: the projected features, one f64 array [B, T, out] per (weight, bias) projection:
    the exact (f64) sum of the bf16 features times the weight, plus the bias (see
    text_features_normalized for the features).  A padded row's features are zero, so its
    output is the bias (zeros without one), as upstream's Linear gives."""
    outs = []
    mask = np.asarray(mask).astype(bool)
    for weight, bias in projections:
        w = np.asarray(weight)
        w64 = (bf16_widen(w) if w.dtype == np.uint16 else w.astype(np.float32)).astype(np.float64)
        feats = text_features_normalized(hidden, mask, version, w.shape[0])
        y = bf16_widen(feats).astype(np.float64) @ w64.T
        if bias is not None:
            b = np.asarray(bias)
            y = y + (bf16_widen(b) if b.dtype == np.uint16 else b.astype(np.float32)).astype(np.float64)
        outs.append(y)
    return outs
