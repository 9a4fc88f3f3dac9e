"""LoRA fusion into scaled and quantised weights: validation and the passes around the delta.

Each layout is fused as its owner fuses it (the rules are written out in
:mod:`ltx2blas.reference`, "Scaled and quantised layouts"): the adapters' bf16 aggregate delta
comes from the GEMM seam (:func:`ltx2blas.fuse.aggregate_delta`), then the weight is
dequantised, the delta added and the sum requantised into the same layout, with new scales
where the owner's rule computes them.  Results are byte-identical to
:func:`ltx2blas.reference.fuse_quantized` for any thread count.

Layouts:

``fp8_scaled``  F8_E4M3 codes [out, in] and one f32 ``scale``: upstream LTX-2's fp8_scaled_mm
                rule (new per-tensor scale).
``comfy_fp8``   F8_E4M3 or F8_E5M2 codes and one f32 ``scale``: ComfyUI's requantisation
                with a recalculated scale, nearest rounding.
``fp8_block``   F8_E4M3 codes [out, in] and f32 ``scale`` [out/128, in/128]: upstream's
                blockwise fp8 (new block scales).
``fp6_block``   packed fp6 [out, in*3/4] and f32 ``scale`` [out/128, in/128]: upstream's
                blockwise fp6.
``nvfp4``       packed E2M1 [out, in/2], E4M3 block scales ``scale`` in the cuBLAS 128 x 4
                tiled layout [roundup(out, 128), roundup(in/16, 4)] and one f32 ``scale_2``:
                upstream's NVFP4 rule (new block scales and scale_2).
``comfy_nvfp4`` stored as ``nvfp4``: ComfyUI's nvfp4 rule (merged in f32, new block scales
                and scale_2).
``comfy_mxfp8`` F8_E4M3 codes [out, in] and E8M0 exponent bytes ``scale``, one per 32
                elements of a row, in the tiled layout [roundup(out, 128), roundup(in/32, 4)]:
                ComfyUI's mxfp8 rule (new exponents).
``comfy_int8``  int8 codes [out, in] and an f32 ``scale`` of one value (0-d) or one per row
                ([out, 1]): ComfyUI's int8_tensorwise rule (new scale, or scales per row).

The rules need every value of the merged weight before they requantise (its largest magnitude
sets the scale), so the delta is held whole: 2 bytes per weight element of extra memory.
"""
from typing import NamedTuple, Optional

import numpy as np

from . import _gemm, _quant
from ._validate import (FP8, Magnitudes, adapter_items, adapters_for, bf16_bits, bf16_to_f32,
                        contiguous, contiguous_array, f32_array, first_nonfinite_fp8, layout_codes,
                        nonfinite_weight, refuse_nonfinite_adapter, round_up, where)
from ._threads import resolve_threads
from .errors import (
    ArgumentError,
    DTypeError,
    LayoutError,
    NonFiniteResultError,
    NonFiniteWeightError,
    ShapeError,
)
from .fuse import aggregate_delta

__all__ = ["fuse_quantized", "dequantized", "quantize_weight", "QuantizedWeight", "LAYOUTS",
           "QUANTIZE_FORMATS", "logical_shape"]

LAYOUTS = ("fp8_scaled", "comfy_fp8", "fp8_block", "fp6_block", "nvfp4", "comfy_nvfp4",
           "comfy_mxfp8", "comfy_int8")

BLOCK = 128
NVFP4_GROUP = 16
MXFP8_GROUP = 32
#: The layouts whose block scales lie in the cuBLAS tiled layout, and their group sizes.
TILED = {"nvfp4": NVFP4_GROUP, "comfy_nvfp4": NVFP4_GROUP, "comfy_mxfp8": MXFP8_GROUP}


class QuantizedWeight(NamedTuple):
    """A fused quantised weight: its codes and its scales (``scale_2`` for nvfp4 only)."""
    weight: np.ndarray
    scale: np.ndarray
    scale_2: Optional[np.ndarray] = None


def logical_shape(layout, stored_shape):
    """(out, in) of a weight stored as ``stored_shape`` in ``layout``."""
    rows, cols = stored_shape
    if layout == "fp6_block":
        return rows, cols * 4 // 3
    if layout in ("nvfp4", "comfy_nvfp4"):
        return rows, cols * 2
    return rows, cols


def tiled_shape(layout, rows, cols):
    """The shape of a tiled layout's block scales for a [rows, cols] weight: [roundup(rows,
    128), roundup(cols / group, 4)]."""
    return round_up(rows, 128), round_up(cols // TILED[layout], 4)


#: The codes each layout stores: fp8 formats, or "packed" bytes, or "int8".
CODES = {"fp8_scaled": ("F8_E4M3",), "comfy_fp8": ("F8_E4M3", "F8_E5M2"),
         "fp8_block": ("F8_E4M3",), "fp6_block": "packed", "nvfp4": "packed",
         "comfy_nvfp4": "packed", "comfy_mxfp8": ("F8_E4M3",), "comfy_int8": "int8"}


def _check_shapes(layout, w, rows, cols):
    if layout in ("fp8_block", "fp6_block") and (rows % BLOCK or cols % BLOCK):
        raise ShapeError(f"a {layout} weight of [{rows}, {cols}] is not made of 128 x 128 blocks")
    if layout == "fp6_block" and w.shape[1] * 4 != cols * 3:
        raise ShapeError(f"packed fp6 weight {w.shape}: columns not a multiple of 3")
    if layout in TILED and cols % TILED[layout]:
        raise ShapeError(f"a {layout} weight of {cols} columns is not made of "
                         f"{TILED[layout]}-element blocks")


def _delta(rows, cols, adapters, rule, threads, tile, out):
    delta = aggregate_delta(rows, cols, adapters, rule=rule, threads=threads, tile=tile, out=out)
    _, _, first = _gemm.scan_bf16(delta.reshape(-1))
    if first < 0:
        return delta
    for ad in adapters_for(adapters, rows, cols):
        refuse_nonfinite_adapter(ad)
    at = where(first, (rows, cols))
    raise NonFiniteResultError(f"the adapters' delta overflows bf16 at {at}")


def _operands(layout, weight, scale, scale_2, fmt):
    """(codes, fp8 format, scale, scale_2, rows, cols) of a quantised weight, every one checked:
    dtypes, shapes, and NaN or inf in the codes and scales (which the rules cannot fuse)."""
    if layout not in LAYOUTS:
        raise ArgumentError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    codes, fmt = layout_codes(weight, layout, CODES[layout], fmt)
    rows, cols = logical_shape(layout, codes.shape)
    _check_shapes(layout, codes, rows, cols)
    second = None
    if layout in TILED:
        what = "E8M0 exponents" if layout == "comfy_mxfp8" else "E4M3 codes"
        block = contiguous_array(scale, "scale")
        if block.dtype.itemsize != 1 or block.dtype.kind not in "uVf":
            raise DTypeError(f"{layout} block scales are {what} (uint8), got {block.dtype}")
        block = block.view(np.uint8)
        want = tiled_shape(layout, rows, cols)
        if block.shape != want:
            raise ShapeError(f"{layout} block scales have shape {block.shape}; the tiled layout "
                             f"of a [{rows}, {cols}] weight is {want}")
        bad = (np.flatnonzero(block.reshape(-1) == 0xFF) if layout == "comfy_mxfp8" else
               [i for i in [first_nonfinite_fp8(block.reshape(-1), "F8_E4M3")] if i >= 0])
        if len(bad):
            raise NonFiniteWeightError(f"{layout} block scales hold a NaN code at flat index "
                                       f"{int(bad[0])}")
        if layout != "comfy_mxfp8":
            if scale_2 is None:
                raise ArgumentError(f"{layout} needs scale_2, the per-tensor f32 scale")
            second = f32_array(scale_2, "scale_2")
    elif layout == "comfy_int8":
        block = contiguous_array(scale, "scale")
        if block.shape not in ((), (rows, 1)):
            raise ShapeError(
                f"a comfy_int8 scale is one f32 value of shape () or one per row, [{rows}, 1]; got "
                f"{list(block.shape)}" + (" (ComfyUI requantises a scale with dimensions as one "
                                          "per row, a different shape)" if block.size == 1 else ""))
        block = f32_array(block, "scale", block.shape)
    else:
        block = f32_array(scale, "scale", (rows // BLOCK, cols // BLOCK)
                          if layout.endswith("_block") else None)
    if scale_2 is not None and second is None:
        raise ArgumentError(f"scale_2 belongs to the nvfp4 layouts, not {layout}")
    if fmt is not None:
        first = first_nonfinite_fp8(codes.reshape(-1), fmt)
        if first >= 0:
            raise nonfinite_weight(first, codes, fmt)
    return codes, fmt, block, second, rows, cols


def check_weight(layout, weight, *, scale, scale_2=None, fmt=None):
    """Raise what :func:`fuse_quantized` raises for the weight and scales alone (dtypes, shapes,
    NaN or inf codes and scales), computing nothing: a dry run's check."""
    _operands(layout, weight, scale, scale_2, fmt)


def fuse_quantized(layout, weight, adapters, *, scale, scale_2=None, fmt=None, rule="addmm",
                   threads=None, in_place=False, tile=None, delta_buffer=None):
    """Fold adapters into a scaled or quantised weight, by the layout owner's rule.

    Parameters
    ----------
    layout : str
        One of ``LAYOUTS`` (see the module docstring).
    weight : uint8 array
        The stored codes (an ml_dtypes fp8 array is taken as its codes; int8 for comfy_int8).
    adapters : sequence
        As for :func:`ltx2blas.fuse_loras` (LoRA pairs, differences, LoKr, LoHa); ``rule``
        names how several combine.
    scale, scale_2 : arrays
        The layout's scales (f32; the nvfp4 layouts' block scales uint8 E4M3 codes, their
        ``scale_2`` f32; comfy_mxfp8's uint8 E8M0 exponents).
    fmt : "F8_E4M3" or "F8_E5M2", optional
        The codes' fp8 format (``comfy_fp8`` takes both; default F8_E4M3 or the dtype's).
    in_place : bool
        Write the results into ``weight``, ``scale`` and ``scale_2``; else into copies.
    delta_buffer : uint16 array [out, in], optional
        Memory for the delta (reused across calls by the checkpoint fuse).

    Returns
    -------
    QuantizedWeight
        Byte-identical to :func:`ltx2blas.reference.fuse_quantized`.

    Raises
    ------
    NonFiniteWeightError, NonFiniteResultError
        inf or NaN in the codes, scales or delta, or a merged weight that overflows: the scales
        derive from the values, so these cannot be fused.  Nothing is written then.
    """
    codes, fmt, block, second, rows, cols = _operands(layout, weight, scale, scale_2, fmt)
    if in_place and not (codes.flags.writeable and block.flags.writeable and
                         (second is None or second.flags.writeable)):
        raise LayoutError("in_place needs writeable weight and scales")
    threads = resolve_threads(threads)
    adapters = adapter_items(adapters)
    if rows == 0 or cols == 0:
        copies = (codes, block, second) if in_place else (
            codes.copy(), block.copy(), None if second is None else second.copy())
        return QuantizedWeight(*copies)
    delta = _delta(rows, cols, adapters, rule, threads, tile, delta_buffer)

    out_codes = codes if in_place else codes.copy()
    out_scale = block if in_place else block.copy()
    out_second = second if (in_place or second is None) else second.copy()
    with np.errstate(divide="ignore", over="ignore"):
        if layout in ("fp8_scaled", "comfy_fp8"):
            s = np.float32(block.reshape(-1)[0])
            e5m2 = fmt == "F8_E5M2"
            top = np.float32(_quant.scaled_fp8_max(codes.reshape(-1), delta.reshape(-1), s, e5m2,
                                                   threads))
            _check_merged(top)
            if layout == "fp8_scaled":   # upstream: scale = 448 / amax; weight_scale = 1 / scale
                mult = (np.float32(1.0) / top) * np.float32(448.0)
                new_scale = np.float32(1.0) / mult
            else:                         # ComfyUI: scale = amax / fmax; codes = x * (1 / scale)
                new_scale = top / np.float32(FP8[fmt].largest)
                mult = np.float32(1.0) / new_scale
            _quant.scaled_fp8_store(out_codes.reshape(-1), delta.reshape(-1), s, mult,
                                    np.float32(FP8[fmt].largest), e5m2, threads)
            out_scale.reshape(-1)[0] = new_scale
        elif layout in ("fp8_block", "fp6_block"):
            fp6 = layout == "fp6_block"
            _check_merged(np.float32(_quant.block_merge(codes, fp6, block, delta, threads)))
            _quant.block_quantize(delta, fp6, out_codes, out_scale, threads)
        elif layout == "nvfp4":
            top = np.float32(_quant.nvfp4_merge(codes, block, np.float32(second.reshape(-1)[0]),
                                                delta, threads))
            _check_merged(top)
            t = np.float32(top * np.float32(1.0 / 2688.0))
            _quant.nvfp4_quantize(delta, t, out_codes, out_scale, threads)
            out_second.reshape(-1)[0] = t
        elif layout in ("comfy_nvfp4", "comfy_mxfp8"):
            nvfp4 = layout == "comfy_nvfp4"
            s2 = np.float32(second.reshape(-1)[0]) if nvfp4 else np.float32(0)
            top = np.float32(_quant.comfy_tiled_max(codes, block, nvfp4, s2, delta, threads))
            _check_merged(top)
            # ComfyUI's nvfp4 scale_2 is amax / (448 * 6), a division
            t = np.float32(top / np.float32(2688.0)) if nvfp4 else np.float32(1)
            if t > 0:
                _quant.comfy_tiled_quantize(out_codes, out_scale, nvfp4, s2, delta, t, threads)
            else:  # all zero: the owner's 0 / 0 would make NaN scales
                out_codes[...] = 0
                out_scale[...] = 0
            if nvfp4:
                out_second.reshape(-1)[0] = t
        else:                             # ComfyUI: scale = max(amax / 127, 1e-30)
            per_row = block.ndim == 2
            top, row_tops = _quant.comfy_int8_max(codes, block.reshape(-1), per_row, delta,
                                                  threads)
            _check_merged(np.float32(top))
            tops = row_tops if per_row else np.array([top], np.float32)
            new = np.maximum(tops / np.float32(127.0), np.float32(1e-30)).astype(np.float32)
            _quant.comfy_int8_quantize(out_codes, block.reshape(-1), new, per_row, delta, threads)
            out_scale.reshape(-1)[:] = new
    weight_out = out_codes if weight.dtype == np.uint8 else out_codes.view(weight.dtype)
    scale_out = out_scale if scale.dtype == out_scale.dtype else out_scale.view(scale.dtype)
    return QuantizedWeight(weight_out, scale_out, out_second)


def _check_merged(top):
    if not np.isfinite(top):
        raise NonFiniteResultError("the merged weight overflows: its scales cannot be computed")


#: The layouts whose owner dequantises to bf16 before adding a delta (upstream LTX-2's), which
#: :func:`dequantized` reads.
DEQUANTIZED_TO_BF16 = ("fp8_block", "fp6_block", "nvfp4")


def dequantized(layout, weight, *, scale, scale_2=None, threads=None):
    """The weight's values as its owner's rule dequantises them before a fuse adds a delta:
    ``bf16(f32(code) * scale)`` per block (fp8_block, fp6_block; NVFP4 with the block scale
    times ``scale_2``), by the same passes a fuse runs, with a delta of +0.0 (which turns a
    -0.0 into +0.0 and changes nothing else).

    Returns
    -------
    uint16 array [rows, cols]: bf16 bits.
    """
    if layout not in DEQUANTIZED_TO_BF16:
        raise ArgumentError(f"dequantized reads the layouts {DEQUANTIZED_TO_BF16}, not "
                            f"{layout!r}")
    codes, _, block, second, rows, cols = _operands(layout, weight, scale, scale_2, None)
    threads = resolve_threads(threads)
    values = np.zeros((rows, cols), np.uint16)
    if rows and cols:
        if layout == "nvfp4":
            _quant.nvfp4_merge(codes, block, np.float32(second.reshape(-1)[0]), values, threads)
        else:
            _quant.block_merge(codes, layout == "fp6_block", block, values, threads)
    return values


# --------------------------------------------------------------------------------------------
# Quantising a bf16 weight: each format as its owner's quantiser writes it
# (reference.quantize_*, docs/arithmetic.md "Quantising bf16 weights")
# --------------------------------------------------------------------------------------------

#: The formats a bf16 weight is quantised into: the layouts above that their owners write from
#: bf16 (fp6_block has no owner's quantiser to follow).
QUANTIZE_FORMATS = ("fp8_scaled", "comfy_fp8", "fp8_block", "nvfp4", "comfy_nvfp4",
                    "comfy_mxfp8", "comfy_int8")
#: ComfyUI's nvfp4 and mxfp8 pad a weight with zeros to whole groups of rows and columns.
COMFY_PAD = {"comfy_nvfp4": NVFP4_GROUP, "comfy_mxfp8": MXFP8_GROUP}


def round_bf16_bits(values):
    """f32 values rounded to bf16 (nearest-even) as bits, uint16 in their shape."""
    values = np.asarray(values, np.float32)  # (ascontiguousarray would make a scalar 1-d)
    return _quant.round_bf16(np.ascontiguousarray(values.reshape(-1))).reshape(values.shape)


def _bf16_of(value):
    """f32 ``value`` rounded to bf16 (nearest-even), as an f32: what torch's arithmetic in a
    bf16 tensor's dtype stores."""
    return bf16_to_f32(round_bf16_bits(value))[()]


def quantized_shapes(fmt, rows, cols, per_row=False):
    """{"weight": (dtype, shape), "scale": ..., "scale_2": ...} of a [rows, cols] weight
    quantised into ``fmt`` (what quantize_weight returns, as safetensors dtypes), or ShapeError
    where the format cannot hold that shape."""
    _check_quantize_shape(fmt, rows, cols)
    if fmt in COMFY_PAD:
        rows, cols = round_up(rows, COMFY_PAD[fmt]), round_up(cols, COMFY_PAD[fmt])
    if fmt in ("fp8_scaled", "comfy_fp8"):
        return {"weight": ("F8_E4M3", (rows, cols)), "scale": ("F32", ())}
    if fmt == "fp8_block":
        return {"weight": ("F8_E4M3", (rows, cols)),
                "scale": ("F32", (rows // BLOCK, cols // BLOCK))}
    if fmt in ("nvfp4", "comfy_nvfp4"):
        return {"weight": ("U8", (rows, cols // 2)),
                "scale": ("F8_E4M3", tiled_shape("nvfp4", rows, cols)), "scale_2": ("F32", ())}
    if fmt == "comfy_mxfp8":
        return {"weight": ("F8_E4M3", (rows, cols)),
                "scale": ("U8", tiled_shape("comfy_mxfp8", rows, cols))}
    return {"weight": ("I8", (rows, cols)), "scale": ("F32", (rows, 1) if per_row else ())}


def check_quantize_options(fmt, fp8_format="F8_E4M3", per_row=False):
    """ArgumentError unless ``fmt`` is one of QUANTIZE_FORMATS and takes the options given."""
    if fmt not in QUANTIZE_FORMATS:
        raise ArgumentError(f"format must be one of {QUANTIZE_FORMATS}, got {fmt!r}")
    if fp8_format not in ("F8_E4M3", "F8_E5M2") or (fp8_format != "F8_E4M3" and
                                                     fmt != "comfy_fp8"):
        raise ArgumentError(f"fp8_format F8_E5M2 is comfy_fp8's only, and the formats are "
                            f"F8_E4M3 and F8_E5M2; got {fp8_format!r} for {fmt}")
    if per_row and fmt != "comfy_int8":
        raise ArgumentError(f"per_row is comfy_int8's, not {fmt}'s")


def _check_quantize_shape(fmt, rows, cols):
    check_quantize_options(fmt)
    if fmt == "fp8_block" and (rows % BLOCK or cols % BLOCK):
        raise ShapeError(f"a fp8_block weight of [{rows}, {cols}] is not made of 128 x 128 "
                         "blocks")
    if fmt == "nvfp4" and cols % NVFP4_GROUP:
        raise ShapeError(f"an nvfp4 weight of {cols} columns is not made of "
                         f"{NVFP4_GROUP}-element blocks (upstream pads none)")


def quantize_weight(fmt, weight, *, threads=None, fp8_format="F8_E4M3", per_row=False,
                    out=None, maxima=None):
    """A bf16 weight quantised into ``fmt`` by its owner's quantiser.

    Parameters
    ----------
    fmt : str
        One of ``QUANTIZE_FORMATS``: ``fp8_scaled`` (upstream LTX-2's per-tensor scaled e4m3),
        ``comfy_fp8`` (ComfyUI's per-tensor scaled fp8, ``fp8_format`` F8_E4M3 or F8_E5M2),
        ``fp8_block`` (upstream's blockwise e4m3, 128 x 128 blocks), ``nvfp4`` (upstream's
        NVFP4, as its CUDA quantiser writes it), ``comfy_nvfp4``, ``comfy_mxfp8`` (padded with
        zeros to whole groups, as ComfyUI pads them) and ``comfy_int8`` (one scale, or one a
        row with ``per_row``).
    weight : bf16 array [rows, cols]
        ml_dtypes.bfloat16 or uint16 bit patterns; finite.
    out : uint8 array, optional
        Memory for the codes (C-contiguous, at least their bytes): the returned codes are a
        view of it.  It may be the weight's own memory, from its first byte or before it (the
        checkpoint quantiser's one buffer a weight): the rows are then quantised in stripes
        whose codes land only on rows already read, and the weight is lost.

    Returns
    -------
    QuantizedWeight
        ``weight``: the codes as stored (uint8; int8 for comfy_int8); ``scale``: the scale(s)
        (f32, or uint8 E4M3 / E8M0 block scales in the tiled layout); ``scale_2``: the nvfp4
        formats' per-tensor f32 scale.  Byte-identical to ``reference.quantize_weight`` for
        any thread count.

    Raises
    ------
    NonFiniteWeightError
        an inf or NaN in the weight (its scale would be inf or NaN).
    ShapeError
        a shape the format cannot hold (fp8_block: 128 x 128 blocks; nvfp4: columns a
        multiple of 16).
    """
    w = contiguous(bf16_bits(weight, "weight"), "weight")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D, got shape {w.shape}")
    rows, cols = w.shape
    check_quantize_options(fmt, fp8_format, per_row)
    _check_quantize_shape(fmt, rows, cols)
    threads = resolve_threads(threads)
    # the largest magnitude on every thread; an inf or NaN shows as a largest magnitude that
    # is not finite, and only then is the first one looked for
    if maxima is None:
        top, row_tops = _quant.bf16_absmax(w, per_row, threads)
    else:
        top, row_tops = maxima
        if row_tops is None or np.shape(row_tops) != (rows,):
            raise ArgumentError(f"maxima must be weight_maxima() of the [{rows}, {cols}] weight")
    top = np.float32(top)
    if not np.isfinite(top):
        raise nonfinite_weight(Magnitudes(w).first_nonfinite, w, "bf16")
    shapes = quantized_shapes(fmt, rows, cols, per_row)
    if fmt in COMFY_PAD:
        group = COMFY_PAD[fmt]
        if rows % group or cols % group:  # the owner pads with zeros before quantising
            padded = np.zeros((round_up(rows, group), round_up(cols, group)), np.uint16)
            padded[:rows, :cols] = w
            w = padded
    code_type = np.int8 if fmt == "comfy_int8" else np.uint8
    size = int(np.prod(shapes["weight"][1], dtype=np.int64))
    if out is None:
        codes = np.empty(shapes["weight"][1], code_type)
    else:
        if not (isinstance(out, np.ndarray) and out.dtype == np.uint8 and
                out.flags.c_contiguous and out.size >= size):
            raise ArgumentError(f"out must be a C-contiguous uint8 array of at least {size} "
                                "bytes")
        codes = out.reshape(-1)[:size].view(code_type).reshape(shapes["weight"][1])
    scale_2 = None
    # each format's pass, on a run of whole rows: its bf16 rows, their codes and scales
    with np.errstate(divide="ignore", over="ignore"):
        if fmt == "fp8_scaled":       # upstream: m = f32(1 / amax) * 448; scale = 1 / m
            mult = (np.float32(1.0) / top) * np.float32(448.0)
            scales = np.array(np.float32(1.0) / mult, np.float32)

            def run(wp, cp, sp):
                _quant.scaled_fp8_quantize(wp.reshape(-1), cp.reshape(-1), mult,
                                           np.float32(448.0), False, False, threads)
        elif fmt == "comfy_fp8":      # ComfyUI: scale = bf16(amax / fmax), codes of bf16(w * r)
            fmax = np.float32(FP8[fp8_format].largest)
            scales = np.array(_bf16_of(top / fmax), np.float32)
            recip = _bf16_of(np.float32(1.0) / scales[()])

            def run(wp, cp, sp):
                _quant.scaled_fp8_quantize(wp.reshape(-1), cp.reshape(-1), recip, fmax,
                                           fp8_format == "F8_E5M2", True, threads)
        elif fmt == "fp8_block":
            scales = np.empty(shapes["scale"][1], np.float32)

            def run(wp, cp, sp):
                _quant.block_quantize(wp, False, cp, sp, threads)
        elif fmt == "nvfp4":          # upstream's CUDA quantiser: t = amax * f32(1 / 2688)
            t = np.float32(top * np.float32(1.0 / 2688.0))
            scales, scale_2 = np.zeros(shapes["scale"][1], np.uint8), np.array(t, np.float32)

            def run(wp, cp, sp):
                _quant.nvfp4_quantize(wp, t, cp, sp, threads)
        elif fmt in COMFY_PAD:
            nvfp4 = fmt == "comfy_nvfp4"
            scales = np.zeros(shapes["scale"][1], np.uint8)
            # scale_2 may round to 0 (an all-zero weight): the kernel gives a block of zeros
            # scale 0 and +0 codes there, where the owner's 0 / 0 makes them NaN
            t = _bf16_of(top / np.float32(2688.0)) if nvfp4 else np.float32(1)
            scale_2 = np.array(t, np.float32) if nvfp4 else None

            def run(wp, cp, sp):
                _quant.comfy_tiled_quantize_weight(wp, cp, sp, nvfp4, t, threads)
        else:  # comfy_int8: scale = max(f32(amax / 127), 1e-30), codes of bf16(w / bf16(scale))
            if per_row:
                scales = np.maximum(np.asarray(row_tops, np.float32)[:rows] / np.float32(127.0),
                                    np.float32(1e-30)).astype(np.float32).reshape(rows, 1)
            else:
                scales = np.array(max(top / np.float32(127.0), np.float32(1e-30)), np.float32)
            divisor = (_quant.round_bf16(scales.reshape(-1)).astype(np.uint32) << 16).view(
                np.float32)

            def run(wp, cp, sp):
                _quant.int8_quantize(wp, cp, sp, per_row, threads)
        # the scales a run of rows r0:r1 takes (through the padding rows, for the last run)
        by_rows = {"fp8_block": lambda r0, r1: scales[r0 // BLOCK:r1 // BLOCK],
                   "comfy_int8": lambda r0, r1: divisor[r0:r1] if per_row else divisor}
        part = by_rows.get(fmt, lambda r0, r1: scales[r0:r1 if r1 < rows else None]
                           if scales.ndim == 2 else scales)
        if np.may_share_memory(codes, w):
            _over_itself(run, part, w, codes)
        else:
            run(w, codes, part(0, w.shape[0]))
    return QuantizedWeight(codes, scales, scale_2)


def _over_itself(run, part, w, codes):
    """``run`` over the rows of ``w`` in stripes whose codes land only on the memory of rows
    already quantised: ``codes`` starts no later than ``w``, so the codes of rows r0:r1 may
    be written once the bf16 of every row before r1 * (bytes of a row's codes) / (bytes of its
    bf16) is read -- at least r1 / 2.  The stripes double (r1 = 2 r0 for fp8, 4 r0 for FP4:
    a few parallel passes a weight, not one per fixed-size piece); the first one's codes
    would overwrite its own unread rows, so they go aside and are copied in once it is done."""
    rows, cols = w.shape
    if codes.ctypes.data > w.ctypes.data:
        raise ArgumentError("out may share the weight's memory only from its start or before")
    growth = max(2, (2 * cols) // max(1, codes.strides[0]))
    r1 = min(rows, BLOCK)  # whole 128-row blocks: fp8_block's and the tiled scales' rows
    first = np.empty_like(codes[:r1])
    run(w[:r1], first, part(0, r1))
    codes[:r1] = first
    while r1 < rows:
        r0, r1 = r1, min(rows, r1 * growth)
        run(w[r0:r1], codes[r0:r1], part(r0, r1))


def weight_maxima(weight, threads=None):
    """(max |w|, each row's max |w|) of a bf16 weight [rows, cols], as f32 (an inf or NaN shows
    as a maximum that is not finite): where :func:`quantize_weight`'s scales start."""
    w = contiguous(bf16_bits(weight, "weight"), "weight")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D, got shape {w.shape}")
    top, row_tops = _quant.bf16_absmax(w, True, resolve_threads(threads))
    return np.float32(top), row_tops


_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _tiled_rows(tiled, rows, groups):
    """The [len(rows), groups] block scale bytes of ``rows`` in a 128 x 4 tiled array."""
    r = np.asarray(rows)[:, None]
    c = np.arange(groups)[None, :]
    tile = (r // 128) * (tiled.shape[1] // 4) + c // 4
    return tiled.reshape(-1)[tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4]


def error_rows(weight, samples=16):
    """(row indices, those rows' bf16 bits, copied) of ``samples`` evenly spaced rows of a
    weight: what :func:`quantization_error` compares, taken before the weight's memory takes
    its codes."""
    w = bf16_bits(weight, "weight")
    rows = w.shape[0]
    at = np.unique(np.linspace(0, rows - 1, min(samples, rows)).astype(np.int64))
    return at, w[at].copy()


def quantization_error(fmt, weight, q, samples=16, fp8_format="F8_E4M3", rows=None):
    """max |w - dequantised| / max |w| over ``samples`` evenly spaced rows of a weight and its
    quantize_weight result ``q``, each format dequantised by its owner's rule in f32 (0 where
    those rows are all zero): the summary's measure of what quantising cost, from a few rows
    so that it costs no pass over the weight.  ``rows``: error_rows(weight, samples), where
    the weight's memory holds its codes now."""
    w = bf16_bits(weight, "weight")
    if not w.shape[0] or not w.shape[1]:
        return 0.0
    cols = w.shape[1]
    at, sampled = error_rows(w, samples) if rows is None else rows
    values = bf16_to_f32(sampled)
    top = float(np.max(np.abs(values)))
    if top == 0:
        return 0.0
    codes = q.weight.view(np.uint8)[at]
    if fmt in ("fp8_scaled", "comfy_fp8", "fp8_block", "comfy_mxfp8"):
        table = _quant.fp8_values(fmt == "comfy_fp8" and fp8_format == "F8_E5M2")
        got = table[codes[:, :cols]]
        if fmt == "fp8_block":
            got = got * np.repeat(q.scale[at // BLOCK], BLOCK, 1)
        elif fmt == "comfy_mxfp8":
            e = _tiled_rows(q.scale, at, q.weight.shape[1] // MXFP8_GROUP).astype(np.int64)
            scale = np.where(e == 0, 0.0, np.ldexp(1.0, e - 127)).astype(np.float32)
            got = got * np.repeat(scale, MXFP8_GROUP, 1)[:, :cols]
        else:
            got = got * np.float32(q.scale)
    elif fmt in ("nvfp4", "comfy_nvfp4"):
        nibbles = np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(len(at), -1)
        block = _quant.fp8_values(False)[_tiled_rows(q.scale, at, nibbles.shape[1] //
                                                     NVFP4_GROUP)]
        total = np.float32(q.scale_2) * block
        got = (_E2M1[nibbles] * np.repeat(total, NVFP4_GROUP, 1))[:, :cols]
    else:
        scale = q.scale.reshape(-1)[at] if q.scale.ndim == 2 else np.float32(q.scale)
        got = q.weight[at].astype(np.float32) * (scale[:, None] if np.ndim(scale) else scale)
    return float(np.max(np.abs(got.astype(np.float32) - values)) / top)


#: The layouts (and plain fp8 casts) a quantised weight is read back from for quantising
#: anew, each into bf16 by its owner's dequantisation (dequantize_bf16).
DEQUANTIZED = ("fp8", "fp8_scaled", "comfy_fp8", "fp8_block", "fp6_block", "nvfp4",
               "comfy_nvfp4", "comfy_mxfp8", "comfy_int8")


def dequantize_bf16(layout, weight, *, scale=None, scale_2=None, fmt=None, threads=None):
    """A stored weight's bf16 values as its owner's loader dequantises it (bf16 bits, uint16,
    the stored shape; packed layouts unpacked):

    ``fp8``         a plain F8_E4M3 / F8_E5M2 cast: bf16(code), exact
    ``fp8_scaled``  upstream's fp8 cast: bf16(f32(code) * scale)
    ``comfy_fp8``   comfy-kitchen: bf16(f32(code) * f32(bf16(scale)))
    ``fp8_block``, ``fp6_block``, ``nvfp4``: upstream's rules, as :func:`dequantized`
    ``comfy_nvfp4`` comfy-kitchen: t = bf16(f32(bf16(scale_2)) * f32(bf16(block scale))),
                    bf16(e2m1 * f32(t))
    ``comfy_mxfp8`` comfy-kitchen: bf16(f32(code) * 2^(e - 127)), 0 for e = 0
    ``comfy_int8``  comfy-kitchen: bf16(f32(code) * scale), the scale one value or one a row
    """
    if layout not in DEQUANTIZED:
        raise ArgumentError(f"layout must be one of {DEQUANTIZED}, got {layout!r}")
    if layout in DEQUANTIZED_TO_BF16:
        return dequantized(layout, weight, scale=scale, scale_2=scale_2, threads=threads)
    if layout == "fp8":
        codes, fmt = layout_codes(weight, layout, ("F8_E4M3", "F8_E5M2"), fmt)
        values = _quant.fp8_values(fmt == "F8_E5M2")[codes]
        return round_bf16_bits(values)
    codes, fmt, block, second, rows, cols = _operands(layout, weight, scale, scale_2, fmt)
    if layout in ("fp8_scaled", "comfy_fp8"):
        s = np.float32(block.reshape(-1)[0])
        if layout == "comfy_fp8":
            s = _bf16_of(s)
        return round_bf16_bits(_quant.fp8_values(fmt == "F8_E5M2")[codes] * s)
    if layout == "comfy_int8":
        s = block.reshape(-1, 1) if block.ndim == 2 else np.float32(block.reshape(-1)[0])
        return round_bf16_bits(codes.view(np.int8).astype(np.float32) * s)
    if layout == "comfy_mxfp8":
        e = _tiled_rows(block, np.arange(rows), cols // MXFP8_GROUP).astype(np.int64)
        step = np.where(e == 0, 0.0, np.ldexp(1.0, e - 127)).astype(np.float32)
        return round_bf16_bits(_quant.fp8_values(False)[codes] * np.repeat(step, MXFP8_GROUP, 1))
    # comfy_nvfp4
    nibbles = np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(rows, cols)
    blocks = _quant.fp8_values(False)[_tiled_rows(block, np.arange(rows), cols // NVFP4_GROUP)]
    s2 = _bf16_of(np.float32(second.reshape(-1)[0]))
    total = bf16_to_f32(round_bf16_bits(s2 * bf16_to_f32(round_bf16_bits(blocks))))
    return round_bf16_bits(_E2M1[nibbles] * np.repeat(total, NVFP4_GROUP, 1))
