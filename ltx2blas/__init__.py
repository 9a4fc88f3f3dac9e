"""ltx2blas: exact, multi-threaded LoRA fusion and bf16 Linear for LTX-2 models on the CPU.

Public API::

    fuse_lora(weight, lora_a, lora_b, strength=1.0, *, threads=None, out=None)
    fuse_loras(weight, [(lora_a, lora_b, strength), ...], *, rule="addmm", threads=None, out=None)
        (an adapter may also be (diff, strength), LoKr(w1, w2, scale) or
        LoHa(w1_a, w1_b, w2_a, w2_b, scale))
    fuse_dora(weight, lora_a, lora_b, magnitude, *, scale=1.0, strength=1.0, style="peft")
    fuse_quantized(layout, weight, [(lora_a, lora_b, strength), ...], *, scale, scale_2=None)
    linear(x, weight, bias=None, *, accumulate="f32", threads=None, out=None, progress=None)
    fuse_checkpoint(model, [(path, strength), ...], output, *, rule="addmm", threads=None)
    fuse_state_dict(state_dict, [(path, strength), ...], *, threads=None)
    extract_lora(tuned, base, output, *, rank=None, energy=None, keys="ltx", threads=None)
    text_features(hidden_states, attention_mask, [(weight, bias), ...], *, version="v1",
                  audio_video=False)

``ltx2blas.reference`` holds the arithmetic contract as plain numpy loops, the oracle the tests
compare with; the library itself never uses it.  docs/design.md shows how the package is laid out.
"""
import importlib
import importlib.util
from importlib.metadata import PackageNotFoundError, version as _version

from . import errors
from .errors import (
    AlreadyFusedError,
    ArgumentError,
    ArgumentTypeError,
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

try:
    __version__ = _version("ltx2blas")
except PackageNotFoundError:  # running from a build tree
    __version__ = "unknown"

# A checkout's ltx2blas/ folder holds the source but none of the compiled modules, and Python
# run from the checkout's root imports it instead of the installed package; without this, the
# first use fails with "cannot import name '_gemm'" and no hint. find_spec looks the module up
# without loading it (an editable install's finder answers too), so nothing heavy loads here.
if importlib.util.find_spec(__name__ + "._gemm") is None:
    raise ImportError(
        f"ltx2blas was imported from {__path__[0]}, which holds its source but not its compiled "
        "extension modules: a checkout's source folder shadows the installed package when "
        "Python runs from the checkout's root. Run Python from another directory, or install "
        "the package (pip install .); the tests run with `pytest` from the root, which imports "
        "the installed package.",
        name=__name__)

# The compiled parts, numpy and scipy load on first use, not on import: the command line then
# starts (and answers Ctrl-C) before any of them has loaded.
_LAZY = {
    "fuse_lora": ".fuse", "fuse_loras": ".fuse", "fuse_dora": ".fuse",
    "LoKr": ".fuse", "LoHa": ".fuse",
    "fuse_quantized": ".quantized", "QuantizedWeight": ".quantized",
    "quantize_weight": ".quantized",
    "quantize_checkpoint": ".files.quantize", "QuantizeReport": ".files.quantize",
    "normalized_features": ".features", "text_features": ".features",
    "FuseReport": ".files.checkpoint", "fuse_checkpoint": ".files.checkpoint",
    "fuse_state_dict": ".files.checkpoint",
    "verify_checkpoint": ".files.verify", "VerifyReport": ".files.verify",
    "extract_lora": ".files.extract", "ExtractReport": ".files.extract",
    "linear": ".linear_layer",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name in ("reference", "fuse", "quantized", "features", "linear_layer", "files", "extract"):
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'ltx2blas' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "fuse_lora",
    "fuse_loras",
    "fuse_dora",
    "LoKr",
    "LoHa",
    "fuse_quantized",
    "QuantizedWeight",
    "quantize_weight",
    "quantize_checkpoint",
    "QuantizeReport",
    "linear",
    "text_features",
    "normalized_features",
    "fuse_checkpoint",
    "fuse_state_dict",
    "FuseReport",
    "verify_checkpoint",
    "VerifyReport",
    "extract_lora",
    "ExtractReport",
    "reference",
    "errors",
    "Ltx2BlasError",
    "ArgumentError",
    "ArgumentTypeError",
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
