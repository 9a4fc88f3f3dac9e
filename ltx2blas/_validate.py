"""What the array API accepts, checked in one place: the dtypes an array may have, how it must be
laid out, and what an ``out=`` must be.  Every refusal is an :class:`~ltx2blas.Ltx2BlasError`
naming the argument.

bf16 arrays come in two kinds, uint16 bit patterns and ``ml_dtypes.bfloat16``: the same bytes.
fp8 arrays are uint8 codes or the ml_dtypes fp8 dtypes.  Results come back as the kind the
weight came in.
"""
import numbers
import operator
import struct
from typing import NamedTuple

import numpy as np

from .errors import (ArgumentError, ArgumentTypeError, DTypeError, LayoutError,
                     NonFiniteInputError, NonFiniteWeightError, ShapeError)


class Fp8Format(NamedTuple):
    name: str        # as ml_dtypes, torch and ComfyUI's metadata spell it
    largest: float   # the largest finite value
    e5m2: bool


#: The fp8 formats, by their safetensors dtype names.
FP8 = {"F8_E4M3": Fp8Format("float8_e4m3fn", 448.0, False),
       "F8_E5M2": Fp8Format("float8_e5m2", 57344.0, True)}
#: ml_dtypes / torch / ComfyUI name -> safetensors dtype name.
FP8_BY_NAME = {f.name: key for key, f in FP8.items()}

#: The several-adapter rules, and the roundings into plain fp8 (docs/arithmetic.md §1, §2).
RULES = ("addmm", "sum")
FP8_ROUNDINGS = ("nearest", "stochastic")
#: What a nearest rounding into F8_E4M3 makes of a value past 448 (inf too), by rule: "saturate",
#: +-448, as torch casts from 2.13 on, or "nan", the NaN code, as torch cast up to 2.12.
FP8_OVERFLOWS = {"saturate": "+-448", "nan": "NaN"}
#: The BLAS takes 32-bit int sizes.
BLAS_INT_MAX = 2**31 - 1

_BITS = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)


def ml_fp8_format(dtype):
    """"F8_E4M3" / "F8_E5M2" for an ml_dtypes fp8 dtype (whatever kind numpy gives it), else
    None."""
    return FP8_BY_NAME.get(dtype.name) if dtype.itemsize == 1 and dtype.kind in "Vf" else None


def is_ml_bfloat16(dtype):
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_bf16(dtype):
    """uint16 bits or ml_dtypes.bfloat16."""
    return dtype == _BITS or is_ml_bfloat16(dtype)


def ndarray(x, name):
    """``x``, or DTypeError when it is not a numpy array."""
    if not isinstance(x, np.ndarray):
        raise DTypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    return x


def bf16_bits(x, name):
    """The uint16 view of a bf16 array, or DTypeError naming the argument."""
    dtype = ndarray(x, name).dtype
    if dtype == _BITS:
        return x
    if is_ml_bfloat16(dtype):
        return x.view(np.uint16)
    raise DTypeError(
        f"{name} must be bfloat16 (ml_dtypes.bfloat16, or uint16 bit patterns in native byte "
        f"order), got {dtype.str} ({dtype})")


def bf16_or_f32(x, name):
    """("bf16", uint16 view) or ("f32", the array), or DTypeError naming the argument."""
    dtype = ndarray(x, name).dtype
    if dtype == _F32:
        return "f32", x
    if is_bf16(dtype):
        return "bf16", bf16_bits(x, name)
    raise DTypeError(
        f"{name} must be float32 or bfloat16 (ml_dtypes.bfloat16, or uint16 bit patterns), in "
        f"native byte order; got {dtype.str} ({dtype})")


def bf16_to_f32(bits):
    """The f32 values of bf16 bits (uint16 or ml_dtypes.bfloat16; an array or one value),
    exactly, in one new array."""
    bits = np.asarray(bits)
    bits = bits.view(np.uint16) if bits.dtype.itemsize == 2 else bits.astype(np.uint16)
    return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)


def f32_values(x, name):
    """The f32 values of a bf16 or float32 array (a new array for bf16, ``x`` itself else)."""
    kind, bits = bf16_or_f32(x, name)
    return bf16_to_f32(bits) if kind == "bf16" else x


def contiguous(x, name):
    """``x``, or LayoutError when it is not C-contiguous."""
    if not x.flags.c_contiguous:
        raise LayoutError(
            f"{name} must be C-contiguous (row-major, unit stride); pass "
            f"np.ascontiguousarray({name}) to copy it")
    return x


def output(out, shape, inputs, *, same_as=None, name="out"):
    """Check an ``out=`` array (already viewed as its element kind): the shape, C-contiguous,
    writeable, and overlapping none of ``inputs`` ({name: array or None}) -- except that it may
    be exactly ``same_as`` (an in-place call)."""
    if out.shape != tuple(shape):
        raise ShapeError(f"{name} has shape {out.shape}, expected {tuple(shape)}")
    contiguous(out, name)
    if not out.flags.writeable:
        raise LayoutError(f"{name} is read-only")
    if same_as is not None and np.shares_memory(out, same_as) and not _same_memory(out, same_as):
        raise LayoutError(f"{name} partially overlaps weight; pass {name}=weight or a "
                          "separate array")
    for what, other in inputs.items():
        if other is not None and np.shares_memory(out, other):
            raise LayoutError(f"{name} overlaps {what}")
    return out


def _same_memory(a, b):
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.nbytes == b.nbytes)


def as_kind(bits, template):
    """``bits`` viewed as the kind ``template`` came in (bf16 kind, or fp8 dtype)."""
    return bits.view(template.dtype) if template.dtype.itemsize == bits.dtype.itemsize else bits


def choice(value, choices, name):
    """``value``, or ArgumentError when it is not one of ``choices`` (option names): anything
    but a str is refused before it is compared, as an array's ``==`` gives an array."""
    if not isinstance(value, str) or value not in choices:
        raise ArgumentError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got "
                            f"{value!r}")
    return value


def integer(value, name, low, high):
    """``value`` as an int in [low, high]: ArgumentTypeError for what is not an integer (a bool,
    a float, a string), ArgumentError for one out of the range."""
    if isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {value!r}") from None
    if not low <= value <= high:
        raise ArgumentError(f"{name} must be between {low} and {high}, got {number_text(value)}")
    return value


def flag(value, name):
    """``value`` as a bool: ArgumentTypeError for anything but a bool (a string or an array
    would be taken by its truth value, or fail on it)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def progress_arg(progress):
    """``progress``, or ArgumentTypeError when it is neither None nor a callable: checked
    before any work, as it is first called once some output is written."""
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(f"progress must be a callable or None, got {progress!r}")
    return progress


def where(index, shape):
    """A flat index as the tuple of indices an error message names."""
    return tuple(int(v) for v in np.unravel_index(index, shape))


def first_nonfinite_fp8(codes, fmt):
    """Flat index of the first fp8 code that is inf or NaN, or -1 (F8_E4M3 has no inf: its NaN
    is x111_1111; F8_E5M2's inf and NaN are x111_11xx)."""
    bad = (codes & 0x7F) == 0x7F if fmt == "F8_E4M3" else (codes & 0x7C) == 0x7C
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else -1


def number_text(value):
    """A number as a message shows it: an integer of many digits shortened."""
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}... ({len(text)} digits)"


def strength_f32(strength, what):
    """A strength (or any scale the caller names ``what``) as the f32 the arithmetic uses:
    ArgumentTypeError for what is not a real number, NonFiniteInputError for a value that is
    not finite as f32 (inf, NaN, and magnitudes past f32's range, 1e40 or 10**400 alike)."""
    if isinstance(strength, (bool, np.bool_)) or not isinstance(strength, numbers.Real):
        raise ArgumentTypeError(f"{what} must be a real number, got {strength!r}")
    try:
        with np.errstate(over="ignore"):
            s = np.float32(strength)
    except OverflowError:  # an int past float's range
        s = np.float32(np.inf)
    if not np.isfinite(s):
        raise NonFiniteInputError(f"{what} {number_text(strength)} is not finite as f32")
    return s


def first_nonfinite(array):
    """Flat index of the first inf or NaN of a bf16 (uint16 bits), float16 or float32 array,
    or -1: one pass, without the GIL for bf16."""
    if array.dtype == _BITS:
        from ._gemm import scan_bf16

        return scan_bf16(np.ascontiguousarray(array).reshape(-1))[2]
    bad = np.flatnonzero(~np.isfinite(array.reshape(-1)))
    return int(bad[0]) if bad.size else -1


def round_up(n, to):
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def contiguous_array(x, name):
    """``x``, a C-contiguous numpy array, or the error naming what it is not."""
    return contiguous(ndarray(x, name), name)


def f32_array(x, name, shape=None):
    """A float32 array of ``shape`` (None: one value, any shape) with finite values: a scale."""
    x = contiguous_array(x, name)
    if x.dtype != np.float32:
        raise DTypeError(f"{name} must be float32, got {x.dtype}")
    if shape is None and x.size != 1:
        raise ShapeError(f"{name} must hold one value (a per-tensor scale), got shape {x.shape}")
    if shape is not None and x.shape != shape:
        raise ShapeError(f"{name} has shape {x.shape}, expected {shape}")
    if not np.all(np.isfinite(x)):
        raise NonFiniteWeightError(f"{name} is not finite")
    return x


def bias_f32(x, name):
    """(f32 values, dtype name "BF16" / "F16" / "F32") of a bias-like vector."""
    if is_bf16(ndarray(x, name).dtype):
        return bf16_to_f32(np.ascontiguousarray(x)), "BF16"
    if x.dtype in (np.float16, np.float32):
        return x.astype(np.float32), "F16" if x.dtype == np.float16 else "F32"
    raise DTypeError(f"{name} must be bf16, float16 or float32, got {x.dtype}")


# ---- the fuse's operands ----

#: The formats a fused weight may hold ("delta": the bare bf16 aggregate delta, for the layouts
#: whose rule needs all of it first).
WEIGHT_FORMATS = ("bf16", "F8_E4M3", "F8_E5M2", "delta")


def weight_bits(weight, weight_format, name="weight"):
    """(format, bits view: uint16 for bf16, uint8 for fp8) of a weight, or DTypeError."""
    dt = ndarray(weight, name).dtype
    inferred = ml_fp8_format(dt)
    if weight_format is None:
        if inferred:
            weight_format = inferred
        elif dt == np.dtype(np.uint8):
            raise DTypeError(f"{name} holds uint8 codes: pass weight_format='F8_E4M3' or "
                             "'F8_E5M2' to say which fp8 format they are")
        else:
            return "bf16", bf16_bits(weight, name)
    if weight_format not in WEIGHT_FORMATS:
        raise ArgumentError(f"weight_format must be one of {sorted(WEIGHT_FORMATS)}, got "
                            f"{weight_format!r}")
    if weight_format in ("bf16", "delta"):
        return weight_format, bf16_bits(weight, name)
    if not (dt == np.dtype(np.uint8) or inferred == weight_format):
        raise DTypeError(f"{name} must hold {weight_format} codes (uint8, or the ml_dtypes fp8 "
                         f"dtype of that format), got {dt}")
    return weight_format, weight.view(np.uint8)


def fp8_rounding_rule(fp8_rounding, fp8_overflow):
    """Checks a rounding into plain fp8 and its overflow rule, alone and together: the
    stochastic rounding never rounds past the largest finite value, so it has no NaN rule."""
    choice(fp8_rounding, FP8_ROUNDINGS, "fp8_rounding")
    choice(fp8_overflow, FP8_OVERFLOWS, "fp8_overflow")
    if fp8_rounding == "stochastic" and fp8_overflow == "nan":
        raise ArgumentError("fp8_overflow='nan' is torch's nearest cast up to 2.12; "
                            "fp8_rounding='stochastic' never rounds past the largest finite "
                            "value, so it takes fp8_overflow='saturate'")


def fuse_weight(weight, weight_format, fp8_rounding, fp8_overflow="saturate"):
    """(format, bits) of the weight a fuse writes into: 2-D, C-contiguous, a format it takes,
    and a rounding that applies to it."""
    fmt, w = weight_bits(weight, weight_format)
    fp8_rounding_rule(fp8_rounding, fp8_overflow)
    if fp8_rounding == "stochastic" and fmt in ("bf16", "delta"):
        raise ArgumentError("fp8_rounding='stochastic' applies to fp8 weights; this one is bf16")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D [out, in], got shape {w.shape}")
    contiguous(w, "weight")
    return fmt, w


def tile_arg(tile):
    """(rows, cols) of a ``tile=`` argument: two ints in [1, 65536]."""
    try:
        rows, cols = tile
        rows, cols = operator.index(rows), operator.index(cols)
    except (TypeError, ValueError):
        raise ArgumentError(f"tile must be two ints in [1, 65536], got {tile!r}") from None
    if not (1 <= rows <= 65536 and 1 <= cols <= 65536):
        raise ArgumentError(f"tile must be two ints in [1, 65536], got {tile!r}")
    return rows, cols


def nonfinite_weight(index, bits, fmt):
    """The NonFiniteWeightError of a weight (bits of format ``fmt``) whose flat element
    ``index`` is inf or NaN: the one message for every fuse and layout."""
    at = where(index, bits.shape)
    return NonFiniteWeightError(f"weight ({fmt}) is already non-finite at {at} (code "
                                f"{int(bits[at]):#x}) before fusing")


#: Two u32 bit patterns, and the same bytes read as two f32: Magnitudes' values.
_TWO_U32, _TWO_F32 = struct.Struct("=II"), struct.Struct("=ff")


class Magnitudes:
    """Largest finite and smallest non-zero magnitude of a bf16 array, and where its first
    inf/NaN is (flat index, or -1): one pass, without the GIL."""

    def __init__(self, bits):
        from ._gemm import scan_bf16

        hi, lo, self.first_nonfinite = scan_bf16(bits.reshape(-1))
        # from the bits by struct: numpy's scalar conversions cost more than the scan of a
        # rank-32 adapter, and every fuse call makes two of these
        self.max, self.min = _TWO_F32.unpack(_TWO_U32.pack(hi << 16, lo << 16))


def finite_weight_largest(bits, fmt):
    """The largest finite magnitude of a bf16 or fp8 weight's bits, or NonFiniteWeightError at
    its first inf/NaN."""
    if fmt == "bf16":
        mag = Magnitudes(bits)
        first, largest = mag.first_nonfinite, mag.max
    else:
        from ._quant import fp8_values

        values = fp8_values(FP8[fmt].e5m2)
        present = np.bincount(bits.reshape(-1), minlength=256) > 0  # the codes that occur
        largest = float(np.nanmax(np.abs(values[present & np.isfinite(values)]), initial=0.0))
        first = first_nonfinite_fp8(bits.reshape(-1), fmt)
    if first >= 0:
        raise nonfinite_weight(first, bits, fmt)
    return largest


class LoKr(NamedTuple):
    """A LoKr (LyCORIS) adapter, for :func:`ltx2blas.fuse_loras`: its delta is
    ``bf16(c * f32(w1 (x) w2))``, the Kronecker product of two factors w1 [m1, n1] and
    w2 [m2, n2], m1 m2 the weight's rows and n1 n2 its columns (docs/arithmetic.md §1).

    ``w1``, ``w2``: each a bf16 array (the factor stored whole) or a pair ``(a, b)`` of bf16
    arrays, a [m, r] and b [r, n], whose product ``a @ b`` (f32, §1's order) is the factor.
    ``scale``: c, the strength times alpha / dim as the file gives them
    (:func:`ltx2blas.reference.lycoris_scale`)."""
    w1: object
    w2: object
    scale: float = 1.0


class LoHa(NamedTuple):
    """A LoHa (LyCORIS) adapter, for :func:`ltx2blas.fuse_loras`: its delta is
    ``bf16(c * f32(m1 * m2))``, the element-wise product of ``m1 = w1_a @ w1_b`` and
    ``m2 = w2_a @ w2_b`` (each f32, §1's order; w*_a [rows, r], w*_b [r, cols], bf16).
    ``scale``: c, as for :class:`LoKr`."""
    w1_a: object
    w1_b: object
    w2_a: object
    w2_b: object
    scale: float = 1.0


class Adapter:
    """One validated adapter, with its f32 strength (a LoKr's or LoHa's scale c) and its
    ``index`` among the adapters given (rank-0 LoRAs are left out, so it may differ from its
    place among those kept).  Its low-rank pairs are ``pairs``, each (A [r, n], B [m, r]) as a
    LoRA's: a LoRA's one (``a`` = A, ``b`` = B), a LoHa's two (w1_b, w1_a), (w2_b, w2_a);
    a difference has ``a`` = the difference, ``b`` None.  A LoKr's factors are ``factors``,
    each ("whole", bits) or ("pair", A, B); the fuse sets ``f1``, ``f2`` to them in f32."""

    def __init__(self, kind, a, b, s, index, pairs=None, factors=None, arrays=None):
        self.kind, self.a, self.b, self.s, self.index = kind, a, b, s, index
        self.rank = a.shape[0] if kind == "lora" else 0
        self.pairs = [(a, b)] if kind == "lora" else (pairs or [])
        self.factors = factors
        self.f1 = self.f2 = None
        self.arrays = arrays or {"": a, " lora_b": b}   # by name, for errors and overlaps
        self._magnitudes = {}

    def magnitudes(self, array):
        """Magnitudes of one of the adapter's arrays, scanned once however often asked (the
        finiteness check and the route both read them)."""
        if id(array) not in self._magnitudes:
            self._magnitudes[id(array)] = Magnitudes(array)
        return self._magnitudes[id(array)]


def _low_rank_pair(i, names, up, down, rows=None, cols=None):
    """A low-rank pair checked: ``up`` [m, r] and ``down`` [r, n], bf16, 2-D, C-contiguous, of
    one rank r > 0, m = rows and n = cols where given; returned as (A, B) = (down, up)."""
    b = bf16_bits(up, f"adapter {i} {names[0]}")
    a = bf16_bits(down, f"adapter {i} {names[1]}")
    if a.ndim != 2 or b.ndim != 2:
        raise ShapeError(f"adapter {i}: {names[0]} and {names[1]} must be 2-D, got {b.shape} "
                         f"and {a.shape}")
    if b.shape[1] != a.shape[0]:
        raise ShapeError(f"adapter {i}: ranks disagree: {names[0]} has {b.shape[1]} columns, "
                         f"{names[1]} {a.shape[0]} rows")
    if a.shape[0] == 0:
        raise ShapeError(f"adapter {i}: {names[0]} and {names[1]} have rank 0")
    if a.shape[0] > BLAS_INT_MAX:
        raise ShapeError(f"adapter {i}: rank {a.shape[0]} exceeds the BLAS integer range")
    if rows is not None and (b.shape[0] != rows or a.shape[1] != cols):
        raise ShapeError(f"adapter {i}: {names[0]} @ {names[1]} is [{b.shape[0]}, "
                         f"{a.shape[1]}], the weight [{rows}, {cols}]")
    contiguous(b, f"adapter {i} {names[0]}")
    contiguous(a, f"adapter {i} {names[1]}")
    return a, b


def _lokr_factor(i, name, factor):
    """("whole", bits) or ("pair", A, B), and its shape."""
    if isinstance(factor, (tuple, list)):
        if len(factor) != 2:
            raise ArgumentTypeError(f"adapter {i}: LoKr {name} must be an array or a pair "
                                    f"(a, b), got {len(factor)} items")
        a, b = _low_rank_pair(i, (f"{name}_a", f"{name}_b"), *factor)
        return ("pair", a, b), (b.shape[0], a.shape[1])
    bits = bf16_bits(factor, f"adapter {i} {name}")
    if bits.ndim != 2:
        raise ShapeError(f"adapter {i}: LoKr {name} must be 2-D, got shape {bits.shape}")
    return ("whole", contiguous(bits, f"adapter {i} {name}")), bits.shape


def _lycoris_adapter(item, i, rows, cols):
    s = strength_f32(item.scale, f"adapter {i}: scale")
    if isinstance(item, LoHa):
        first = _low_rank_pair(i, ("w1_a", "w1_b"), item.w1_a, item.w1_b, rows, cols)
        second = _low_rank_pair(i, ("w2_a", "w2_b"), item.w2_a, item.w2_b, rows, cols)
        arrays = {" w1_a": first[1], " w1_b": first[0], " w2_a": second[1],
                  " w2_b": second[0]}
        return Adapter("loha", *first, s, i, pairs=[first, second], arrays=arrays)
    (w1, shape1), (w2, shape2) = (_lokr_factor(i, "w1", item.w1), _lokr_factor(i, "w2", item.w2))
    if shape1[0] * shape2[0] != rows or shape1[1] * shape2[1] != cols:
        raise ShapeError(f"adapter {i}: the Kronecker product of w1 {list(shape1)} and w2 "
                         f"{list(shape2)} is [{shape1[0] * shape2[0]}, {shape1[1] * shape2[1]}], "
                         f"the weight [{rows}, {cols}]")
    arrays, pairs = {}, []
    for name, factor in (("w1", w1), ("w2", w2)):
        if factor[0] == "whole":
            arrays[f" {name}"] = factor[1]
        else:
            arrays[f" {name}_a"], arrays[f" {name}_b"] = factor[2], factor[1]
            pairs.append(factor[1:])
    return Adapter("lokr", None, None, s, i, pairs=pairs, factors=(w1, w2), arrays=arrays)


def refuse_nonfinite_adapter(ad, check=True):
    """With ``check``, NonFiniteInputError at the first inf/NaN of an adapter's arrays."""
    if not check:
        return
    for name, arr in ad.arrays.items():
        if arr is None:
            continue
        mag = ad.magnitudes(arr)
        if mag.first_nonfinite >= 0:
            at = where(mag.first_nonfinite, arr.shape)
            what = name.strip() or ("diff" if ad.kind == "diff" else "lora_a")
            raise NonFiniteInputError(
                f"adapter {ad.index} {what} is non-finite at {at} (value "
                f"{float(bf16_to_f32(arr[at]))!r})", adapter=ad.index, tensor=what)


def adapter_items(adapters):
    """The adapters as fuse_loras takes them: LoKr and LoHa as they are, every other item a
    tuple of 2 or 3."""
    try:
        items = [item if isinstance(item, (LoKr, LoHa)) else tuple(item) for item in adapters]
    except TypeError:
        raise ArgumentTypeError("adapters must be a sequence of (lora_a, lora_b, strength), "
                                "(diff, strength), LoKr or LoHa") from None
    for i, item in enumerate(items):
        if not isinstance(item, (LoKr, LoHa)) and len(item) not in (2, 3):
            raise ArgumentTypeError(f"adapters[{i}] must be (lora_a, lora_b, strength), (diff, "
                                    f"strength), LoKr or LoHa, got {len(item)} items")
    return items


def adapters_for(adapters, rows, cols):
    """[Adapter] of ``adapters`` -- (lora_a, lora_b, strength), (diff, strength), LoKr or
    LoHa -- checked against a [rows, cols] weight; rank-0 LoRAs, which add nothing, are left
    out."""
    prepared = []
    for i, item in enumerate(adapters):
        if isinstance(item, (LoKr, LoHa)):
            prepared.append(_lycoris_adapter(item, i, rows, cols))
            continue
        if len(item) == 2:
            s = strength_f32(item[1], f"adapter {i}: strength")
            diff = bf16_bits(item[0], f"adapter {i} diff")
            if diff.shape != (rows, cols):
                raise ShapeError(f"adapter {i}: diff {diff.shape} does not fit weight "
                                 f"({rows}, {cols})")
            contiguous(diff, f"adapter {i} diff")
            prepared.append(Adapter("diff", diff, None, s, i, arrays={"": diff}))
            continue
        lora_a, lora_b, strength = item
        a = bf16_bits(lora_a, f"adapter {i} lora_a")
        b = bf16_bits(lora_b, f"adapter {i} lora_b")
        if a.ndim != 2 or b.ndim != 2:
            raise ShapeError(
                f"adapter {i}: lora_a and lora_b must be 2-D, got {a.shape} and {b.shape}")
        if a.shape[1] != cols:
            raise ShapeError(f"adapter {i}: lora_a {a.shape} does not fit weight ({rows}, "
                             f"{cols}): expected [rank, {cols}]")
        if b.shape[0] != rows:
            raise ShapeError(f"adapter {i}: lora_b {b.shape} does not fit weight ({rows}, "
                             f"{cols}): expected [{rows}, rank]")
        if a.shape[0] != b.shape[1]:
            raise ShapeError(f"adapter {i}: ranks disagree: lora_a has {a.shape[0]} rows, "
                             f"lora_b {b.shape[1]} columns")
        if a.shape[0] > BLAS_INT_MAX:
            raise ShapeError(f"adapter {i}: rank {a.shape[0]} exceeds the BLAS integer range")
        contiguous(a, f"adapter {i} lora_a")
        contiguous(b, f"adapter {i} lora_b")
        s = strength_f32(strength, f"adapter {i}: strength")
        if a.shape[0] > 0:
            prepared.append(Adapter("lora", a, b, s, i))
    return prepared


def fuse_output(out, w, fmt, prepared):
    """(the array a fuse writes, whether it was given): a new one like ``w``, or ``out``
    checked -- its kind, shape and layout, and overlapping no adapter."""
    if out is None:
        return np.empty_like(w), False
    inputs = {f"adapter {ad.index}{name}": array
              for ad in prepared for name, array in ad.arrays.items()}
    return output(weight_bits(out, fmt, "out")[1], w.shape, inputs, same_as=w), True


def layout_codes(weight, layout, codes, fmt):
    """(the 2-D codes of a quantised weight, their fp8 format or None) for a layout whose
    ``codes`` are a tuple of fp8 formats (``fmt`` picks one, or the dtype says it; default the
    first), "packed" bytes (uint8) or "int8"."""
    w = contiguous_array(weight, "weight")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D, got shape {w.shape}")
    if codes == "int8":
        if w.dtype != np.int8:
            raise DTypeError(f"a {layout} weight holds int8 codes, got {w.dtype}")
        return w, None
    inferred = ml_fp8_format(w.dtype)
    if inferred is None and w.dtype != np.uint8:
        raise DTypeError(f"weight must hold uint8 codes (or an ml_dtypes fp8 dtype), got {w.dtype}")
    if codes == "packed":
        if inferred:
            raise DTypeError(f"a {layout} weight is packed uint8, got {w.dtype}")
        return w.view(np.uint8), None
    fmt = inferred or fmt or codes[0]
    if inferred and fmt != inferred:
        raise DTypeError(f"weight is {w.dtype} but fmt is {fmt!r}")
    if fmt not in codes:
        raise DTypeError(f"a {layout} weight holds {' or '.join(codes)} codes, not {fmt}")
    return w.view(np.uint8), fmt
