"""ltx2blas: exact, multi-threaded LoRA fusion and bf16 Linear for LTX-2 models on the CPU.

Public API::

    fuse_lora(weight, lora_a, lora_b, strength=1.0, *, threads=None, out=None)
    fuse_loras(weight, [(lora_a, lora_b, strength), ...], *, rule="addmm", threads=None, out=None)
    fuse_quantized(layout, weight, [(lora_a, lora_b, strength), ...], *, scale, scale_2=None)
    linear(x, weight, bias=None, *, accumulate="f32", threads=None, out=None, progress=None)
    fuse_checkpoint(model, [(path, strength), ...], output, *, rule="addmm", threads=None)
    fuse_state_dict(state_dict, [(path, strength), ...], *, threads=None)
    text_features(hidden_states, attention_mask, [(weight, bias), ...], *, version="v1",
                  audio_video=False)

``ltx2blas.reference`` holds the arithmetic contract as plain numpy loops.
"""
from importlib.metadata import PackageNotFoundError, version as _version

from . import errors, reference
from .errors import (
    AlreadyFusedError,
    DTypeError,
    FormatError,
    KeyMatchError,
    Ltx2IOError,
    LayoutError,
    Ltx2BlasError,
    NonFiniteInputError,
    NonFiniteResultError,
    NonFiniteWeightError,
    NumericsError,
    ShapeError,
)
from .fuse import fuse_dora, fuse_lora, fuse_loras
from .quantized import QuantizedWeight, fuse_quantized
from .features import normalized_features, text_features
from .files.checkpoint import FuseReport, fuse_checkpoint, fuse_state_dict
from .linear_layer import linear

try:
    __version__ = _version("ltx2blas")
except PackageNotFoundError:  # running from a build tree
    __version__ = "unknown"

__all__ = [
    "fuse_lora",
    "fuse_loras",
    "fuse_dora",
    "fuse_quantized",
    "QuantizedWeight",
    "linear",
    "text_features",
    "normalized_features",
    "fuse_checkpoint",
    "fuse_state_dict",
    "FuseReport",
    "reference",
    "errors",
    "Ltx2BlasError",
    "ShapeError",
    "DTypeError",
    "LayoutError",
    "NumericsError",
    "NonFiniteInputError",
    "NonFiniteWeightError",
    "NonFiniteResultError",
    "FormatError",
    "Ltx2IOError",
    "KeyMatchError",
    "AlreadyFusedError",
    "__version__",
]
