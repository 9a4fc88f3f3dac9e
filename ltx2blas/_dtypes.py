"""bf16 arrays come in two kinds: uint16 bit patterns and ml_dtypes.bfloat16. Both are the same
bytes; results come back as the kind the weight came in."""
import numpy as np

from .errors import DTypeError

_BITS = np.dtype(np.uint16)


#: ml_dtypes' fp8 dtype names -> safetensors dtype names.
ML_FP8 = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def ml_fp8_format(dtype):
    """"F8_E4M3" / "F8_E5M2" for an ml_dtypes fp8 dtype (whatever kind numpy gives it), else None."""
    return ML_FP8.get(dtype.name) if dtype.itemsize == 1 and dtype.kind in "Vf" else None


def is_ml_bfloat16(dtype):
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def bf16_bits(array, name):
    """The uint16 view of a bf16 array, or DTypeError naming the argument."""
    if not isinstance(array, np.ndarray):
        raise DTypeError(f"{name} must be a numpy array, got {type(array).__name__}")
    dtype = array.dtype
    if dtype == _BITS:
        return array
    if is_ml_bfloat16(dtype):
        return array.view(np.uint16)
    raise DTypeError(
        f"{name} must be bfloat16 (ml_dtypes.bfloat16, or uint16 bit patterns in native byte "
        f"order), got {dtype.str} ({dtype})"
    )


def bf16_to_f32(bits):
    """The f32 values of bf16 bits (uint16 or ml_dtypes.bfloat16), exactly, in one new array."""
    return np.left_shift(bits.view(np.uint16), 16, dtype=np.uint32).view(np.float32)


def like(bits, template):
    """View uint16 bits as the bf16 kind of ``template``."""
    return bits.view(template.dtype) if is_ml_bfloat16(template.dtype) else bits
