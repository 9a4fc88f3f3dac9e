"""The arithmetic contract as plain numpy loops: the oracle for tests and goldens.

Nothing here is fast and nothing here calls ltx2blas's own kernels.  Each function is the
textbook loop of docs (spec §1): one IEEE f32 operation per step, in the order written, with
numpy's elementwise float32 ``*`` and ``+`` (numpy never fuses them into an FMA).

bf16 values are uint16 bit patterns throughout; fp8 values uint8 codes.
"""
import numpy as np


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
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def lora_delta(lora_a, lora_b, strength):
    """delta[o, i] = bf16(sum_k bf16(B[o, k] * s) * A[k, i]), f32 sum from 0.0 in k order."""
    lora_a = np.asarray(lora_a, dtype=np.uint16)
    lora_b = np.asarray(lora_b, dtype=np.uint16)
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
    """W'[o, i] = bf16(f32(W[o, i]) + f32(delta[o, i])) -- one adapter (spec §1)."""
    delta = lora_delta(lora_a, lora_b, strength)
    return bf16_round(bf16_widen(weight) + bf16_widen(delta))


def fuse_loras(weight, adapters):
    """Several adapters (spec §1): total = bf16(0.0 + delta_1 + delta_2 + ...) in f32, adapter
    order, then W' = bf16(W + total).  ``adapters`` is a sequence of (lora_a, lora_b, strength)."""
    weight = np.asarray(weight, dtype=np.uint16)
    total = np.zeros(weight.shape, dtype=np.float32)
    for lora_a, lora_b, strength in adapters:
        total = total + bf16_widen(lora_delta(lora_a, lora_b, strength))
    return bf16_round(bf16_widen(weight) + bf16_widen(bf16_round(total)))


# --------------------------------------------------------------------------------------------
# fp8 (spec §2): F8_E4M3 is float8_e4m3fn (no inf, NaN = 0x7F/0xFF, largest 448), F8_E5M2 is
# float8_e5m2 (IEEE-like: inf and NaN).  Rounding follows torch's cast, upstream's engine:
# nearest-even; past the largest finite value, e4m3fn saturates to +-448 (inf too) and e5m2
# goes to +-inf; NaN becomes the code 0x7F with its sign.
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
    return table[np.asarray(codes, dtype=np.uint8)]


def fp8_round(x, fmt):
    """f32 values -> fp8 codes, by the rule above."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN payloads, huge codes masked below
        return _fp8_round(np.asarray(x, dtype=np.float32).astype(np.float64), FP8_FORMATS[fmt])


def _fp8_round(x, spec):
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
    over_code = 0x7E if spec["saturates"] else 0x7C   # +-448, or +-inf
    code = np.where(overflow, over_code, code)
    code = np.where(np.isnan(x), 0x7F, code)
    return (code | sign).astype(np.uint8)


def fuse_loras_fp8(weight, adapters, fmt):
    """fp8 weight (spec §2): W' = fp8(bf16(f32(total) + f32(bf16(W)))), total the bf16 delta of
    one adapter (fuse_lora's) or the several-adapter sum (fuse_loras's, when given a list of
    more than one); nearest-even into fp8."""
    weight = np.asarray(weight, dtype=np.uint8)
    if len(adapters) == 1:
        total = lora_delta(*adapters[0])
    else:
        acc = np.zeros(weight.shape, dtype=np.float32)
        for lora_a, lora_b, strength in adapters:
            acc = acc + bf16_widen(lora_delta(lora_a, lora_b, strength))
        total = bf16_round(acc)
    w_bf16 = bf16_round(fp8_widen(weight, fmt))       # exact
    return fp8_round(bf16_widen(bf16_round(bf16_widen(total) + bf16_widen(w_bf16))), fmt)


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
# The text feature extractor (spec §4).  Gemma's hidden states [B, T, D, L] (D = 3840 wide,
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
    """spec §4: the projected features, one f64 array [B, T, out] per (weight, bias) projection,
    padded rows zero; the projection is the exact (f64) sum of the bf16 features times the
    weight (see text_features_normalized for the features)."""
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
        y[~mask] = 0.0
        outs.append(y)
    return outs
