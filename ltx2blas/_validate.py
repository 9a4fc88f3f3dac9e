"""What the array API accepts, checked in one place: the dtypes an array may have, how it must be
laid out, and what an ``out=`` must be.  Every refusal is an :class:`~ltx2blas.Ltx2BlasError`
naming the argument.

bf16 arrays come in two kinds, uint16 bit patterns and ``ml_dtypes.bfloat16``: the same bytes.
fp8 arrays are uint8 codes or the ml_dtypes fp8 dtypes.  Results come back as the kind the
weight came in.
"""
import numbers
from typing import NamedTuple

import numpy as np

from .errors import (ArgumentError, ArgumentTypeError, DTypeError, LayoutError,
                     NonFiniteInputError, ShapeError)


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
    """The f32 values of bf16 bits (uint16 or ml_dtypes.bfloat16), exactly, in one new array."""
    return np.left_shift(bits.view(np.uint16), 16, dtype=np.uint32).view(np.float32)


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
    """``value``, or ArgumentError when it is not one of ``choices``."""
    if value not in choices:
        raise ArgumentError(f"{name} must be {' or '.join(repr(c) for c in choices)}, got "
                            f"{value!r}")
    return value


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
