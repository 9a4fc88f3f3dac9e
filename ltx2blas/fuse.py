"""LoRA fusion into bf16 weights: validation, dispatch and threads around the tile driver.

The arithmetic is docs/arithmetic.md §1 (see :mod:`ltx2blas.reference`), and the result is byte-identical to
that loop for every shape, rank, strength and thread count.  How: :mod:`ltx2blas._gemm`.
"""
import contextlib
import os
from typing import NamedTuple

import numpy as np

from . import _fuse, _gemm, _probe, _quant
from ._validate import (FP8, FP8_OVERFLOWS, RULES, WEIGHT_FORMATS, Adapter, LoHa, LoKr,
                        adapter_items, adapters_for, refuse_nonfinite_adapter, as_kind, bf16_bits, bf16_to_f32, bias_f32,
                        choice, contiguous,
                        finite_weight_largest, fuse_output, fuse_weight, is_bf16, ndarray, output,
                        strength_f32, tile_arg, where)
from ._threads import blas_single_threaded, resolve_threads
from .errors import (
    DTypeError,
    NonFiniteResultError,
    ShapeError,
)

__all__ = ["fuse_lora", "fuse_loras", "fuse_dora", "fuse_bias", "aggregate_delta", "LoKr", "LoHa",
           "Overflows",
           "buffer_bytes", "default_tile", "DEFAULT_TILE", "MIN_TILES", "SMALLEST_TILE"]

#: The largest output tile (rows, cols) a thread computes at a time: its f32 accumulator
#: (512 x 256 x 4 B = 512 KiB) stays in L2 between the product and the rounding store.
DEFAULT_TILE = (512, 256)
#: A weight is cut into at least this many tiles, down to SMALLEST_TILE: enough independent
#: tasks for machines with tens of cores to share out evenly as threads come free. Smaller
#: tiles cost a little more widening per element; the result never depends on the tiling.
MIN_TILES = 256
SMALLEST_TILE = (64, 64)

_BF16_FINITE_LIMIT = 3.0e38  # below bf16's largest finite value (3.39e38), with margin
# f32 magnitudes from this one up round to bf16 inf: halfway between bf16's largest finite
# value, 2^128 - 2^120, and 2^128 (a tie rounds up, to the even inf)
_BF16_ROUNDS_TO_INF = np.float32(2.0**128 - 2.0**119)
# A bound on |delta| below this rules a bf16 overflow out whatever the finite weight: bf16's
# largest, 2**128 - 2**120, plus a rounded delta below 2**118 stays short of 2**128 - 2**119
# (the f32 sum's rounding, at most 2**103 there, cannot close the gap).
_NO_BF16_OVERFLOW = 2.0**117


def fuse_lora(weight, lora_a, lora_b, strength=1.0, *, threads=None, out=None,
              check_finite=False, tile=None, weight_format=None, fp8_rounding="nearest",
              seed=0, name="", fp8_overflow="saturate", return_overflows=False,
              allow_overflow=True):
    """Fold one LoRA adapter into a bf16 weight: ``W' = bf16(W + bf16(bf16(B * s) @ A))``.

    Parameters
    ----------
    weight : bf16 array [out, in]
        ``uint16`` bit patterns or ``ml_dtypes.bfloat16``; C-contiguous.
    lora_a : bf16 array [rank, in]
        The adapter's ``lora_A`` / ``lora_down``.
    lora_b : bf16 array [out, rank]
        The adapter's ``lora_B`` / ``lora_up``.
    strength : float
        Scale ``s``, used as f32; ``B * s`` is rounded to bf16 before the product (upstream).
    threads : int or None
        None uses every CPU the process may use (docs/threads.md); an int is used as given.
    out : bf16 array [out, in], optional
        Where to write. ``out=weight`` fuses in place with no full-size temporary.
    check_finite : bool
        Raise :class:`~ltx2blas.errors.NumericsError` subclasses for inf/NaN in the adapter,
        in the weight, or produced by overflow -- before anything is written to ``out``.
    tile : (int, int), optional
        Output tile size (default: :func:`default_tile` of the weight's shape); the result does
        not depend on it.
    weight_format : "bf16", "F8_E4M3" or "F8_E5M2", optional
        Taken from the dtype when it says (uint16 and ml_dtypes.bfloat16 are bf16,
        ml_dtypes.float8_e4m3fn and float8_e5m2 the fp8 formats); required for uint8 fp8 codes.
        An fp8 weight is fused by docs/arithmetic.md §2: ``W' = fp8(bf16(delta + bf16(W)))``.
    fp8_rounding : "nearest" or "stochastic"
        Into fp8: nearest-even (upstream's CPU rule), or deterministic stochastic rounding with
        random bits from ``seed`` and ``name`` (the tensor's name), the same for any tiling and
        thread count (see :func:`ltx2blas.reference.fp8_round_stochastic`).
    fp8_overflow : "saturate" (default) or "nan"
        What a nearest rounding into F8_E4M3 makes of a value past 448: +-448, as torch casts
        from 2.13 on, or NaN, as torch cast up to 2.12 (docs/arithmetic.md §2). Other formats
        are unaffected (F8_E5M2 overflows to inf under both); the stochastic rounding takes
        "saturate" alone.
    return_overflows : bool
        Also return how many results overflowed: of a bf16 weight, the results that are +-inf
        where the weight's element was finite (the product, its rounding or the sum reached
        inf; an inf already in the weight, or a NaN, is not counted); of an fp8 weight, the
        finite sums that rounded past its largest finite value. Counted by the rounding store
        as it writes, at no measurable cost; the fuse is upstream's either way (check_finite
        refuses them).
    allow_overflow : bool
        True (default, upstream's behaviour): a bf16 result that overflows to +-inf is stored
        as +-inf. False: :class:`~ltx2blas.errors.NonFiniteResultError` naming the first
        overflow's (row, column) and the count, before anything is written to ``out`` (a dry
        run first where the adapters' magnitudes do not rule overflow out, a delta of 2**117
        or more); inf/NaN already in the inputs are left to ``check_finite``.

    Returns
    -------
    The fused weight, the same kind as ``weight`` (or ``out`` when given), and with
    ``return_overflows`` the count (an :class:`Overflows`, an int whose ``first`` names the
    first overflow's (row, column), None for none), as a tuple. Byte-identical to
    :func:`ltx2blas.reference.fuse_lora` (bf16) or :func:`ltx2blas.reference.fuse_loras_fp8`
    (fp8) on the same inputs.
    """
    result, overflows = _fuse_into(
        weight, [(lora_a, lora_b, strength)], threads, out, check_finite, tile, rule="one",
        weight_format=weight_format, fp8_rounding=fp8_rounding, seed=seed, name=name,
        fp8_overflow=fp8_overflow, allow_overflow=allow_overflow)
    return (result, overflows) if return_overflows else result


def fuse_loras(weight, adapters, *, rule="addmm", threads=None, out=None, check_finite=False,
               tile=None, weight_format=None, fp8_rounding="nearest", seed=0, name="",
               fp8_overflow="saturate", return_overflows=False, allow_overflow=True):
    """Fold several adapters into one weight: ``W' = bf16(W + agg)``, the adapters' bf16
    aggregate ``agg`` formed by a named rule, in the order given.

    Parameters
    ----------
    weight : bf16 or fp8 array [out, in]
        As for :func:`fuse_lora`.
    adapters : sequence
        ``(lora_a, lora_b, strength)``, a LoRA pair, ``(diff, strength)``, a full-weight
        difference [out, in] (bf16) whose delta is ``bf16(strength * diff)``, a
        :class:`LoKr` or a :class:`LoHa`, in any mix.
    rule : "addmm" (default) or "sum"
        ``"addmm"`` (upstream LTX-2 today): ``agg = delta_1``, then for each later adapter
        ``agg = bf16(agg + f32(s_i * (B_i @ A_i)))``, B_i not scaled and the product
        accumulated in f32 in order; with one adapter this is :func:`fuse_lora` exactly.
        ``"sum"`` (upstream's first release): ``agg = bf16(0.0 + delta_1 + delta_2 + ...)`` in
        f32; with one adapter the result is :func:`fuse_lora`'s except where the weight and the
        delta are both -0.0 (a delta is -0.0 only when its products underflow), which the sum
        makes +0.0.
    threads, out, check_finite, tile, weight_format, fp8_rounding, seed, name, fp8_overflow
        As for :func:`fuse_lora`.
    return_overflows, allow_overflow
        As for :func:`fuse_lora`.

    Returns
    -------
    The fused weight, the same kind as ``weight`` (or ``out`` when given), and with
    ``return_overflows`` the count of overflows; byte-identical to
    :func:`ltx2blas.reference.fuse_loras` (``reference.fuse_loras_fp8`` for fp8 weights).
    """
    choice(rule, RULES, "rule")
    adapters = adapter_items(adapters)
    result, overflows = _fuse_into(weight, adapters, threads, out, check_finite, tile, rule=rule,
                                   weight_format=weight_format, fp8_rounding=fp8_rounding,
                                   seed=seed, name=name, fp8_overflow=fp8_overflow,
                                   allow_overflow=allow_overflow)
    return (result, overflows) if return_overflows else result


class Overflows(int):
    """How many results of a fuse overflowed (``return_overflows``), an int, with ``first``:
    the (row, column) of the first in row-major order, or None when there are none."""

    def __new__(cls, count, first=None):
        self = super().__new__(cls, count)
        self.first = first
        return self

    def __repr__(self):
        return f"Overflows({int(self)}, first={self.first!r})"


def aggregate_delta(rows, cols, adapters, *, rule="addmm", threads=None, tile=None, out=None):
    """The adapters' bf16 aggregate delta: what a scaled or quantised layout's rule adds to its
    dequantised weight.

    Parameters
    ----------
    rows, cols : int
        The weight's shape.
    adapters, rule, threads, tile
        As for :func:`fuse_loras`.
    out : uint16 array [rows, cols], optional
        C-contiguous; filled when given.

    Returns
    -------
    uint16 array [rows, cols]
        ``bf16(bf16(B*s) @ A)`` for one adapter, the rule's aggregate for several;
        byte-identical to :func:`ltx2blas.reference.aggregate_delta`.
    """
    choice(rule, RULES, "rule")
    adapters = adapter_items(adapters)
    if out is None:
        out = np.empty((rows, cols), np.uint16)
    else:
        out = output(bf16_bits(out, "out"), (rows, cols), {})
    _fuse_into(out, adapters, threads, out, False, tile, rule=rule, weight_format="delta")
    return out


def fuse_bias(bias, items, *, out=None):
    """Fold adapters' bias terms into a module's bias.

    ``acc = f32(bias)``, then for each ``(b, s)`` in order ``acc = acc + f32(f32(s) * f32(b))``,
    rounded once into the bias's own dtype.

    Parameters
    ----------
    bias : bf16, float16 or float32 array [out]
    items : sequence of (b, s)
        ``b`` a LoRA's ``lora_B.bias`` (``s`` the LoRA's scale) or ComfyUI's ``diff_b``
        (``s`` the strength), bf16, float16 or float32 [out].
    out : array like ``bias``, optional
        May be ``bias`` itself.

    Returns
    -------
    The fused bias, the dtype of ``bias``; byte-identical to
    :func:`ltx2blas.reference.fuse_bias`.
    """
    acc, kind = bias_f32(bias, "bias")
    acc = acc.reshape(-1)
    for i, (b, s) in enumerate(items):
        term, _ = bias_f32(b, f"bias term {i}")
        if term.size != acc.size:
            raise ShapeError(f"bias term {i} has {term.size} values, the bias {acc.size}")
        with np.errstate(over="ignore", invalid="ignore"):
            acc = acc + np.float32(strength_f32(s, f"adapter {i}: strength")) * term.reshape(-1)
    if kind == "BF16":
        result = _quant.round_bf16(np.ascontiguousarray(acc, np.float32))
    else:
        result = acc.astype(np.float16 if kind == "F16" else np.float32)
    result = result.reshape(np.shape(bias))
    if out is None:
        return result.view(bias.dtype) if bias.dtype.itemsize == result.dtype.itemsize else result
    np.copyto(out.view(result.dtype) if out.dtype != result.dtype else out, result)
    return out


#: ComfyUI's DoRA eps: f32's machine epsilon (its compute dtype on the CPU)
DORA_EPS = np.float32(2.0 ** -23)


def fuse_dora(weight, lora_a, lora_b, magnitude, *, scale=1.0, strength=1.0, style="peft",
              threads=None, out=None):
    """Fold a DoRA adapter into a bf16 weight: the LoRA-fused weight rescaled to the adapter's
    magnitudes, as PEFT or ComfyUI define it.

    Parameters
    ----------
    weight, lora_a, lora_b : bf16 arrays
        As for :func:`fuse_lora`.
    magnitude : float32 or bf16 array
        PEFT's ``lora_magnitude_vector`` [out] (``style="peft"``), or ComfyUI's ``dora_scale``
        [out, 1] or [1, in] (``style="comfy"``).
    scale : float
        The LoRA's own scale (alpha / rank), applied inside the decomposition.
    strength : float
        Blends the result with the weight, ``W + strength * (W_dora - W)``, as ComfyUI does
        (PEFT merges at strength 1).
    style : "peft" (default) or "comfy"
    threads, out
        As for :func:`fuse_lora`.

    Returns
    -------
    The fused weight, the same kind as ``weight``; the arithmetic, norms and eps included, is
    :func:`ltx2blas.reference.fuse_dora`'s, byte for byte.

    Raises
    ------
    NonFiniteResultError
        Where a norm is zero (PEFT's rule then divides by zero).
    """
    w = bf16_bits(weight, "weight")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D [out, in], got shape {w.shape}")
    contiguous(w, "weight")
    rows, cols = w.shape
    choice(style, ("peft", "comfy"), "style")
    m = bf16_to_f32(magnitude) if is_bf16(ndarray(magnitude, "magnitude").dtype) else magnitude
    if m.dtype != np.float32:
        raise DTypeError(f"magnitude must be float32 or bf16, got {magnitude.dtype}")
    if style == "peft" and m.size == rows and m.ndim == 1:
        norm_of, per_row = 0, True
    elif style == "comfy" and m.shape == (rows, 1):
        norm_of, per_row = 1, True
    elif style == "comfy" and m.shape == (1, cols):
        norm_of, per_row = 2, False
    else:
        want = f"[{rows}]" if style == "peft" else f"[{rows}, 1] or [1, {cols}]"
        raise ShapeError(f"a {style} DoRA magnitude of a [{rows}, {cols}] weight is {want}, "
                         f"got {list(m.shape)}")
    strength = strength_f32(strength, "adapter 0: strength")
    threads = resolve_threads(threads)
    result, given_out = fuse_output(out, w, "bf16", [])
    v = aggregate_delta(rows, cols, [(lora_a, lora_b, scale)], threads=threads)
    squares = _quant.dora_merge(w, v, norm_of, threads)      # v now holds bf16(W + delta)
    with np.errstate(divide="ignore", invalid="ignore"):
        norms = np.sqrt(squares).astype(np.float32)
        if style == "comfy":
            norms = norms + DORA_EPS
        factor = np.ascontiguousarray(m.reshape(-1) / norms, np.float32)
    if not np.all(np.isfinite(factor)):
        bad = int(np.flatnonzero(~np.isfinite(factor))[0])
        raise NonFiniteResultError(f"DoRA {'row' if per_row else 'column'} {bad}: magnitude "
                                   f"{float(m.reshape(-1)[bad])!r} over a norm of "
                                   f"{float(norms[bad])!r} is not finite")
    _quant.dora_store(v, factor, per_row, w, result, strength, strength != 1, threads)
    return result if given_out else as_kind(result, weight)


def buffer_bytes(ranks, threads=1, tile=None, several=None, cols=None):
    """Bytes of panel buffers a fuse allocates at most (its extra memory, beyond the output
    when not in place): per thread, the f32 bf16(B*s) rows [tile_rows x width], A panels
    [width x tile_cols] and the product tile (twice for several adapters), width the sum of
    min(rank, PASS_DEPTH) -- a larger rank runs in passes -- and for each adapter of rank up
    to PASS_DEPTH its rows in bf16 pairs, should the dot-product kernel take it; that kernel's
    adapters take no A panels but share one copy of A in pairs, ceil(rank / 2) x cols x 4
    bytes (about A's own size), counted when the weight's ``cols`` are given.  The driver's own
    count (_fuse.thread_buffer_bytes, _fuse.shared_buffer_bytes), the larger of the two ways.
    With no tile given, DEFAULT_TILE: the most that any default tile (:func:`default_tile`)
    takes."""
    tile = Tile(*tile_arg(DEFAULT_TILE if tile is None else tile))
    ranks = list(ranks)
    several = len(ranks) > 1 if several is None else several
    pairs = [True] * len(ranks)
    with_pairs = _fuse.thread_buffer_bytes(tile.rows, tile.cols, ranks, several, pairs) * threads
    if cols is not None:
        with_pairs += _fuse.shared_buffer_bytes(cols, ranks, pairs)
    without = _fuse.thread_buffer_bytes(tile.rows, tile.cols, ranks, several) * threads
    return max(with_pairs, without)


#: The fuse kernels a caller may force (LTX2BLAS_FUSE_KERNEL or use_fuse_kernel): "dot", the
#: dot-product kernel wherever it gives the textbook bytes, or "fma", never it.
FUSE_KERNELS = ("dot", "fma")
_forced_fuse_kernel = None


def use_fuse_kernel(name=None):
    """Force the fuse's kernel choice for every later call: "dot" (the dot-product kernel
    wherever the adapter's magnitudes let it give the textbook bytes) or "fma" (the f32
    kernels and sgemm only); None restores the choice by measured rate
    (:func:`dot_fuse_chosen`).  The bytes are the same either way.  The environment variable
    ``LTX2BLAS_FUSE_KERNEL`` does the same when the module loads."""
    global _forced_fuse_kernel
    _forced_fuse_kernel = None if name is None else choice(name, FUSE_KERNELS, "fuse kernel")


def forced_fuse_kernel():
    """The fuse kernel forced by :func:`use_fuse_kernel` ("dot" or "fma"), or None."""
    return _forced_fuse_kernel


def dot_fuse_chosen():
    """Whether the fuse takes the kernel table's dot-product kernel where it may: forced by
    :func:`use_fuse_kernel`, else where it ran faster than the same table's f32 FMA kernel on an
    in-cache tile (``_gemm.fuse_rates``, measured once per process)."""
    if not _gemm.has_pairs_kernel():
        return False
    if _forced_fuse_kernel is not None:
        return _forced_fuse_kernel == "dot"
    dot, fma = _gemm.fuse_rates()
    return dot > fma


if os.environ.get("LTX2BLAS_FUSE_KERNEL"):
    use_fuse_kernel(os.environ["LTX2BLAS_FUSE_KERNEL"])


def _pairs_exact(rank, bs_min, a_min, overflow_bound):
    """Whether the dot-product kernel (VDPBF16PS, two terms per instruction) gives the textbook
    bytes for this adapter.  It adds each product in order, rounded, as the textbook loop does,
    but flushes subnormal inputs, products and sums to zero, and it is used only where none can
    occur and no sum can reach inf -- conditions on magnitudes, not on the rank, so it serves
    every rank that one pass holds (PASS_DEPTH; a larger rank runs in passes):
      * no subnormal input: the smallest non-zero |bf16(B*s)| and |A| are at least 2**-126;
      * no subnormal partial sum: a bf16 value of exponent e is a multiple of 2**(e - 7), so
        every product, and every sum of products (rounding keeps multiples of the smallest
        quantum), is a multiple of 2**(ea + eb - 14), with ea, eb the exponents of the smallest
        magnitudes; a product of those magnitudes of at least 2**-110 makes that quantum at
        least 2**-126, the smallest normal;
      * no overflow: rank * max|bf16(B*s)| * max|A| (with slack) below 2**127.
    Zero magnitudes (all-zero operands) add only zeros, which no flushing changes."""
    if rank > _fuse.PASS_DEPTH or overflow_bound >= 2.0**127:
        return False
    if bs_min == 0 or a_min == 0:
        return True
    return bs_min >= 2.0**-126 and a_min >= 2.0**-126 and bs_min * a_min >= 2.0**-110


_FORMAT_CODES = dict(zip(WEIGHT_FORMATS + ("product",), range(5)))  # the tile driver's fmt
#: Largest finite value of each storage format: past it a result has overflowed.
_FORMAT_LIMIT = {"bf16": _BF16_FINITE_LIMIT, **{k: f.largest for k, f in FP8.items()}}


def _specs(prepared):
    """The tile driver's specs of the adapters, in order: (kind, a, b, scale, adapter), the
    kind a _fuse.KINDS name and adapter the adapter's place in the rule's order.  A LoHa is
    two specs, its pairs, the second carrying its scale; a LoKr carries its f32 factors, or,
    with a [1, 1] factor ("lokr_scaled"), its other factor as stored -- A and B of a pair,
    or the whole bits and None -- and, a sixth item, the value (_lokr_factors)."""
    specs = []
    for n, ad in enumerate(prepared):
        if ad.kind == "loha":
            (a1, b1), (a2, b2) = ad.pairs
            specs += [("loha_first", a1, b1, 1.0, n), ("loha", a2, b2, ad.s, n)]
        elif ad.kind == "lokr" and ad.value is not None:
            other = ad.other
            specs.append(("lokr_scaled", other[1], other[2] if other[0] == "pair" else None,
                          ad.s, n, float(ad.value)))
        elif ad.kind == "lokr":
            specs.append(("lokr", ad.f1, ad.f2, ad.s, n))
        else:
            specs.append((ad.kind, ad.a, ad.b, ad.s, n))
    return specs


def _is_pair(spec):
    """Whether a spec's product is a low-rank pair's, which the pair kernels take."""
    return spec[0] in ("lora", "loha_first", "loha") or (spec[0] == "lokr_scaled" and
                                                         spec[2] is not None)


class _Route:
    """How a fuse runs, decided from the adapters' magnitudes; none of it changes a byte.

    rule       "one" (a single adapter, W + delta), "sum" or "addmm"
    specs      the tile driver's specs (_specs)
    fma        every product is exact in f32, so the fast tables may contract c + x*y and a
               BLAS may be used
    blas       the adapters are finite (some BLAS builds skip zero terms, which changes how a
               NaN or inf propagates)
    pairs      per spec: the dot-product kernel gives its product's textbook bytes
               (_pairs_exact, and the kernel table has one); with one bf16 LoRA it also fuses
               in the same pass (fused_pairs)
    plus_zero  one bf16 adapter under the sum rule: the one-adapter result with -0.0 made +0.0
    bound      a bound on |delta|, for the overflow check"""

    def __init__(self, rule, fmt, prepared):
        # One adapter under the sum rule: bf16(0.0 + delta) is delta with -0.0 made +0.0, so
        # it takes the one-adapter routes (the one-pass and dot-product kernels among them) and
        # the kernels clear -0.0 from each stored tile, instead of a zeroed f32 total and one
        # more rounding pass per tile. Not for fp8, whose one-adapter rule is the delta's. One
        # adapter under addmm is the one-adapter rule exactly.
        self.plus_zero = rule == "sum" and fmt == "bf16" and len(prepared) == 1
        self.rule = "one" if len(prepared) == 1 else rule
        self.fmt = fmt
        self.fma, self.blas, self.bound = True, True, 0.0
        self.specs = _specs(prepared)
        self.pairs = [_is_pair(spec) for spec in self.specs]

    @property
    def fused_pairs(self):
        """One bf16 LoRA whose product the dot-product kernel takes: computed, rounded and
        added in one pass."""
        return (self.rule == "one" and self.fmt == "bf16" and self.specs[0][0] == "lora"
                and self.pairs[0])


def _pair_route(route, rank, amag, bmag, bs_max, bs_min):
    """A low-rank pair's part in the route -- its rank, the Magnitudes of A and B, and B's as
    multiplied (bs_max, bs_min: bf16(B*s) or B) -- and (a bound on its product, whether the
    dot-product kernel gives its textbook bytes)."""
    # Products bs*A are exact in f32 (so FMA and BLAS are exact too) unless they could leave
    # the normal range.
    if bs_max * amag.max >= 2.0**127 or (
            bs_min * amag.min != 0 and bs_min * amag.min < 2.0**-126):
        route.fma = False
    if amag.first_nonfinite >= 0 or bmag.first_nonfinite >= 0 or bs_max >= _BF16_FINITE_LIMIT:
        route.blas = False
    bound = rank * bs_max * amag.max * 1.01
    return bound, _pairs_exact(rank, bs_min, amag.min, bound)


def _choose_route(prepared, fmt, rule, check_finite):
    route = _Route(rule, fmt, prepared)
    spec = 0
    for i, ad in enumerate(prepared):
        refuse_nonfinite_adapter(ad, check_finite)
        if ad.kind == "diff":
            route.bound += abs(float(ad.s)) * ad.magnitudes(ad.a).max * 1.01
            spec += 1
            continue
        if ad.kind == "lokr" and ad.value is not None:
            # one factor a single value; the other's product taken unscaled, as a LoHa pair's
            other = ad.other
            value = abs(float(ad.value))
            if other[0] == "whole":
                bound = ad.magnitudes(other[1]).max * 1.01
            else:
                bmag = ad.magnitudes(other[2])
                bound, exact = _pair_route(route, other[1].shape[0], ad.magnitudes(other[1]),
                                           bmag, bmag.max, bmag.min)
                route.pairs[spec] = route.pairs[spec] and exact
            with np.errstate(invalid="ignore", over="ignore"):
                route.bound += abs(float(ad.s)) * float(np.float64(value) * bound) * 1.01
            spec += 1
            continue
        if ad.kind == "lokr":
            # the factors are f32 (_lokr_factors); their element products are one rounding each
            with np.errstate(invalid="ignore", over="ignore"):
                largest = _largest(ad.f1) * _largest(ad.f2)
            route.bound += abs(float(ad.s)) * largest * 1.01
            spec += 1
            continue
        if ad.kind == "loha":
            bound = abs(float(ad.s))
            for a, b in ad.pairs:
                bmag = ad.magnitudes(b)
                pair_bound, exact = _pair_route(route, a.shape[0], ad.magnitudes(a), bmag,
                                                bmag.max, bmag.min)
                bound *= pair_bound
                route.pairs[spec] = route.pairs[spec] and exact
                spec += 1
            route.bound += bound
            continue
        bmag = ad.magnitudes(ad.b)
        # bs = bf16(B*s): bounds on its magnitudes, one bf16 rounding step of slack each way;
        # addmm multiplies later adapters' B unscaled and scales their products.
        prescaled = route.rule != "addmm" or i == 0
        if prescaled:
            bs_max = bmag.max * abs(float(ad.s)) * (1 + 2.0**-7)
            bs_min = bmag.min * abs(float(ad.s)) * (1 - 2.0**-7)
        else:
            bs_max, bs_min = bmag.max, bmag.min
        if check_finite and prescaled and bs_max >= _BF16_FINITE_LIMIT:
            bad = _first_bf16_overflow(ad.b, ad.s)
            if bad >= 0:
                at = where(bad, ad.b.shape)
                raise NonFiniteResultError(
                    f"adapter {ad.index}: lora_b{at} x strength {float(ad.s)!r} overflows bf16",
                    adapter=ad.index, tensor="lora_b")
        product_bound, exact = _pair_route(route, ad.rank, ad.magnitudes(ad.a), bmag, bs_max,
                                           bs_min)
        route.bound += product_bound * (1.0 if prescaled else abs(float(ad.s)))
        route.pairs[spec] = route.pairs[spec] and exact
        spec += 1
    usable = route.blas and route.fma and dot_fuse_chosen()
    route.pairs = [p and usable for p in route.pairs]
    return route


def _largest(array):
    """max |x| of an f32 array (NaN where it holds one), without an array of |x| as large."""
    if array.size == 0:
        return 0.0
    return max(float(np.max(array)), -float(np.min(array)))


def _first_bf16_overflow(bits, s):
    """Index of the first element of bf16(B * s) that is inf or NaN, or -1."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = bf16_to_f32(bits) * s
    bad = np.flatnonzero(~np.isfinite(scaled) | (np.abs(scaled) >= _BF16_ROUNDS_TO_INF))
    return int(bad[0]) if bad.size else -1


def _probe_depths(route, shape, tile):
    """The verified sgemm depth of each spec's pair for each tile shape class -- (full, full),
    (full, edge), (edge, full), (edge, edge) in (rows, cols) -- zero where sgemm is not used."""
    depths = np.zeros((len(route.specs), 4), dtype=np.intc)
    if not (route.blas and route.fma):
        return depths
    rows, cols = shape
    last_rows = rows - (rows - 1) // tile.rows * tile.rows  # the edge tiles' sizes
    last_cols = cols - (cols - 1) // tile.cols * tile.cols
    for i, (kind, a, *_) in enumerate(route.specs):
        if not _is_pair(route.specs[i]) or route.pairs[i]:
            continue  # no pair, or the dot-product kernel, which calls no sgemm
        depth = min(a.shape[0], _fuse.PASS_DEPTH)  # the first pass's, as the tile runs it
        for row_edge, m in ((0, tile.rows), (1, last_rows)):
            for col_edge, n in ((0, tile.cols), (1, last_cols)):
                if (not row_edge and rows < tile.rows) or (not col_edge and cols < tile.cols):
                    continue  # no tile of this shape
                depths[i, 2 * row_edge + col_edge] = _probe.blas_depth(
                    m, n, depth, depth, pin=blas_single_threaded)
    return depths


def _fuse_into(weight, adapters, threads, out, check_finite, tile, *, rule,
               weight_format=None, fp8_rounding="nearest", seed=0, name="",
               fp8_overflow="saturate", allow_overflow=True):
    """The fuse: the operands checked, ``out`` checked, the route chosen, the plan made, run.
    Returns the result and its Overflows (the store's count of results that overflowed, and
    the first's position)."""
    fmt, w = fuse_weight(weight, weight_format, fp8_rounding, fp8_overflow)
    prepared = adapters_for(adapters, *w.shape)
    threads = resolve_threads(threads)
    tile = default_tile(*w.shape) if tile is None else Tile(*tile_arg(tile))
    result, given_out = fuse_output(out, w, fmt, prepared)
    w_largest = finite_weight_largest(w, fmt) if check_finite else 0.0
    refuse = not allow_overflow and fmt == "bf16"
    if not prepared or w.size == 0:  # nothing to add: no probe, no buffer
        if fmt == "delta":
            result.fill(0)
        elif result is not w:
            np.copyto(result, w)
        return (result if given_out else as_kind(result, weight)), Overflows(0)
    _lokr_factors(prepared, threads)
    route = _choose_route(prepared, fmt, rule, check_finite)
    # In place with the overflow check on and a bound that does not rule overflow out: a dry
    # run finds any overflow before a byte is written.
    # A bf16 overflow refused: nothing written to a given out either, so a dry run counts first
    # unless the delta's bound rules overflow out whatever the weight holds (no scan of it).
    dry_run = given_out and (
        (check_finite and not (route.bound + w_largest < _FORMAT_LIMIT[fmt]))
        or (refuse and not route.bound < _NO_BF16_OVERFLOW))
    stochastic_key = (_quant.stochastic_key(int(seed), str(name))
                      if fp8_rounding == "stochastic" else None)
    plan = _plan(w, result, fmt, prepared, route, tile, threads, stochastic_key, dry_run,
                 fp8_overflow)
    # The BLAS is held to one thread only where a tile calls sgemm (the probe pins its own
    # calls): threadpoolctl's limit and restore cost tens of microseconds a call, a serial
    # step that the dot-product and one-pass routes, which call no BLAS, need not take.
    with blas_single_threaded() if plan.depths.any() else contextlib.nullcontext():
        if dry_run:
            bad = plan.run(check=True, dry_run=True)
            if check_finite:
                _raise_nonfinite_result(bad, w.shape, fmt, fp8_overflow)
            if refuse:
                raise_overflows(_overflows(plan, w.shape), fmt)
        bad = plan.run(check=check_finite)
    if check_finite:
        _raise_nonfinite_result(bad, w.shape, fmt, fp8_overflow)
    overflows = _overflows(plan, w.shape)
    if refuse:
        raise_overflows(overflows, fmt)
    return (result if given_out else as_kind(result, weight)), overflows


def _overflows(plan, shape):
    """The Overflows of a plan's last run."""
    first = where(plan.first_overflow, shape) if plan.first_overflow >= 0 else None
    return Overflows(plan.overflows, first)


def raise_overflows(overflows, fmt="bf16", what="the fused weight"):
    """NonFiniteResultError naming the first of ``overflows`` (an :class:`Overflows`) and the
    count, if there are any: results of ``what`` that overflowed to +-inf from finite
    weight elements (the file layer's refusal, and ``allow_overflow=False``'s)."""
    if overflows:
        raise NonFiniteResultError(
            f"{what} overflows {fmt} at {overflows.first}: {int(overflows)} "
            f"{'value' if overflows == 1 else 'values'} became +-inf from finite weight "
            "elements; pass allow_overflow=True to store them as +-inf, as upstream does")


def _lokr_factors(prepared, threads):
    """Each LoKr's two factors in f32 (``f1``, ``f2``): a whole one widened, a low-rank one
    the f32 product of its pair in §1's order, once a call (each has the weight's elements
    over the other's).  Where one factor is [1, 1], the other has the weight's every element,
    and an f32 copy of it would take twice a bf16 weight's memory: ``value`` is then that
    factor's f32 value and ``other`` the other as stored, which the tiles widen or multiply
    as they need it (KIND_LOKR_SCALED), the same products in the same order -- w1 (x) w2
    with w1 = [[v]] is v * w2, and with w2 = [[v]] w1 * v, one f32 product an element either
    way.  Non-finite factors are refused, where asked, with the other adapters'
    (_choose_route), before anything is written."""
    for ad in prepared:
        if ad.kind != "lokr":
            continue
        shapes = [f[1].shape if f[0] == "whole" else (f[2].shape[0], f[1].shape[1])
                  for f in ad.factors]
        ad.value = ad.other = None
        for one, other in ((0, 1), (1, 0)):
            if tuple(shapes[one]) == (1, 1) and tuple(shapes[other]) != (1, 1):
                ad.value = _lokr_f32(ad.factors[one], threads).reshape(-1)[0]
                ad.other = ad.factors[other]
                break
        else:
            ad.f1, ad.f2 = (_lokr_f32(f, threads) for f in ad.factors)


def _lokr_f32(factor, threads):
    """A LoKr factor in f32: ("whole", bits) widened, ("pair", A, B) the product B @ A."""
    return bf16_to_f32(factor[1]) if factor[0] == "whole" else pair_product(factor[1], factor[2],
                                                                            threads)


def pair_product(a, b, threads=None):
    """The f32 product ``B @ A`` of a low-rank pair, A [r, n] and B [m, r] bf16 bits: each
    element summed from 0.0 in k order, one rounding per product and per add (§1's order), by
    the fuse's routes; byte-identical to :func:`ltx2blas.reference.lora_product`."""
    rows, cols = b.shape[0], a.shape[1]
    out = np.empty((rows, cols), np.float32)
    if out.size == 0:
        return out
    prepared = [Adapter("lora", a, b, np.float32(1.0), 0)]
    route = _choose_route(prepared, "product", "addmm", False)
    tile = default_tile(rows, cols)
    threads = resolve_threads(threads)
    plan = _plan(out, out, "product", prepared, route, tile, threads)
    with blas_single_threaded() if plan.depths.any() else contextlib.nullcontext():
        plan.run()
    return out


def _plan(w, result, fmt, prepared, route, tile, threads, stochastic_key=None, dry_run=False,
          fp8_overflow="saturate"):
    """The tile driver's plan of a fuse of ``prepared`` adapters by ``route``: each adapter's
    spec with its verified sgemm depths, and the buffers."""
    depths = _probe_depths(route, w.shape, tile)
    specs = [(_fuse.KINDS[kind], a, b, float(scale), list(depths[i]), route.pairs[i], adapter,
              *value) for i, (kind, a, b, scale, adapter, *value) in enumerate(route.specs)]
    return _fuse.FusePlan(
        w.view(np.uint8), result.view(np.uint8), _FORMAT_CODES[fmt], specs, tile.rows, tile.cols,
        max(1, min(threads, tile.count(*w.shape))), route.fma, _fuse.RULES[route.rule],
        fused_pairs=route.fused_pairs, plus_zero=route.plus_zero,
        stochastic=stochastic_key is not None, key=stochastic_key or 0, dry_run=dry_run,
        fp8_nan_overflow=fp8_overflow == "nan")


def route_of(rank, tile=None, pairs=True):
    """What takes the product of one bf16 adapter of ``rank`` and ordinary magnitudes (no
    subnormal input, no sum near overflow) on this machine, as its plan decides it
    (``_fuse.ROUTE_NAMES``): with ``pairs`` False, where its magnitudes would rule out the
    dot-product kernel.  ``tile`` (default DEFAULT_TILE) is the weight's shape."""
    rows, cols = tile or DEFAULT_TILE
    a, b = np.full((rank, cols), 0x3C00, np.uint16), np.full((rows, rank), 0x3C00, np.uint16)
    w = np.zeros((rows, cols), np.uint16)
    prepared = adapters_for([(a, b, 0.01)], rows, cols)
    route = _choose_route(prepared, "bf16", "addmm", False)
    if not pairs:
        route.pairs = [False]
    with blas_single_threaded():
        return _plan(w, w, "bf16", prepared, route, Tile(rows, cols), 1).routes()[0]


class Tile(NamedTuple):
    """The output tile each thread computes at a time."""
    rows: int
    cols: int

    def count(self, rows, cols):
        """How many tiles cut a [rows, cols] weight."""
        return -(-rows // self.rows) * -(-cols // self.cols)


def default_tile(rows, cols):
    """The tile a fuse into a [rows, cols] weight uses when none is given.

    DEFAULT_TILE, its longer side halved (rows on a tie) until the weight holds MIN_TILES
    tiles or the tile is SMALLEST_TILE.

    Returns
    -------
    Tile
    """
    tile = Tile(*DEFAULT_TILE)
    smallest = Tile(*SMALLEST_TILE)
    while tile.count(rows, cols) < MIN_TILES and tile != smallest:
        if tile.cols > smallest.cols and (tile.cols > tile.rows or tile.rows == smallest.rows):
            tile = tile._replace(cols=tile.cols // 2)
        else:
            tile = tile._replace(rows=tile.rows // 2)
    return tile


def _raise_nonfinite_result(bad, shape, fmt="bf16", fp8_overflow="saturate"):
    if bad < 0:
        return
    at = where(bad, shape)
    if fmt not in FP8:
        raise NonFiniteResultError(f"the fused weight overflows {fmt} at {at}")
    made = ("rounds to +-inf" if FP8[fmt].e5m2 else
            f"fp8_overflow={fp8_overflow!r} makes {FP8_OVERFLOWS[fp8_overflow]}")
    raise NonFiniteResultError(f"the fused weight overflows {fmt} at {at}: past "
                               f"{FP8[fmt].largest:g}, which {made}")
