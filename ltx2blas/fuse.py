"""LoRA fusion into bf16 weights: validation, dispatch and threads around the tile driver.

The arithmetic is spec §1 (see :mod:`ltx2blas.reference`), and the result is byte-identical to
that loop for every shape, rank, strength and thread count.  How: :mod:`ltx2blas._gemm`.
"""
import numbers

import numpy as np

from . import _fuse, _gemm
from ._dtypes import bf16_bits, like
from ._threads import blas_single_threaded, resolve_threads
from .errors import (
    LayoutError,
    NonFiniteInputError,
    NonFiniteResultError,
    NonFiniteWeightError,
    ShapeError,
)

__all__ = ["fuse_lora", "fuse_loras", "buffer_bytes", "DEFAULT_TILE"]

#: Output tile (rows, cols) each thread computes at a time. The f32 accumulator tile
#: (512 x 256 x 4 B = 512 KiB) stays in L2 between the product and the rounding store.
DEFAULT_TILE = (512, 256)

_INT_MAX = 2**31 - 1
_BF16_FINITE_LIMIT = 3.0e38  # below bf16's largest finite value (3.39e38), with margin


def fuse_lora(weight, lora_a, lora_b, strength=1.0, *, threads=None, out=None,
              check_finite=False, tile=None):
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
        None uses every CPU the process may use (see the README); an int is used as given.
    out : bf16 array [out, in], optional
        Where to write. ``out=weight`` fuses in place with no full-size temporary.
    check_finite : bool
        Raise :class:`~ltx2blas.errors.NumericsError` subclasses for inf/NaN in the adapter,
        in the weight, or produced by overflow -- before anything is written to ``out``.
    tile : (int, int), optional
        Output tile size; the result does not depend on it.

    Returns
    -------
    The fused weight, the same bf16 kind as ``weight`` (or ``out`` when given).
    Byte-identical to :func:`ltx2blas.reference.fuse_lora` on the same inputs.
    """
    return _fuse_into(weight, [(lora_a, lora_b, strength)], threads, out, check_finite, tile,
                      sum_rule=False)


def fuse_loras(weight, adapters, *, threads=None, out=None, check_finite=False, tile=None):
    """Fold several adapters into one weight by the spec's rule:
    ``total = bf16(0.0 + delta_1 + delta_2 + ...)`` (f32, in the order given), then
    ``W' = bf16(W + total)``.

    ``adapters`` is a sequence of ``(lora_a, lora_b, strength)``. Other arguments as
    :func:`fuse_lora`.  With a single adapter the result equals :func:`fuse_lora`'s except where
    a delta is -0.0 (possible only when products underflow), which the sum turns into +0.0.
    """
    try:
        adapters = [tuple(item) for item in adapters]
    except TypeError:
        raise TypeError("adapters must be a sequence of (lora_a, lora_b, strength)") from None
    for i, item in enumerate(adapters):
        if len(item) != 3:
            raise TypeError(f"adapters[{i}] must be (lora_a, lora_b, strength), got {len(item)} items")
    return _fuse_into(weight, adapters, threads, out, check_finite, tile, sum_rule=True)


def buffer_bytes(ranks, threads=1, tile=None, several=None):
    """Bytes of panel buffers a fuse allocates (its extra memory, beyond the output when not
    in place).  Per thread: f32 bf16(B*s) rows [tile_rows x sum(ranks)], A panels
    [sum(ranks) x tile_cols] and the product tile [tile_rows x tile_cols] (twice for several
    adapters), each rounded up to 64 bytes."""
    mb, nb = DEFAULT_TILE if tile is None else tile
    total_rank = sum(ranks)
    several = len(ranks) > 1 if several is None else several

    def up(n):
        return (n + 63) // 64 * 64

    slot = up(4 * mb * total_rank) + up(4 * total_rank * nb) + up(4 * mb * nb) * (1 + several)
    return slot * threads


class _Magnitudes:
    """Largest finite and smallest non-zero magnitude of a bf16 array, and where its first
    inf/NaN is (flat index, or -1)."""

    def __init__(self, bits):
        hi, lo, self.first_nonfinite = _gemm.scan_bf16(bits.reshape(-1))
        self.max = _bf16_value(hi)
        self.min = _bf16_value(lo)


def _bf16_value(bits):
    return float((np.uint32(bits) << np.uint32(16)).view(np.float32))


def _strength_f32(strength, index):
    if isinstance(strength, (bool, np.bool_)) or not isinstance(strength, numbers.Real):
        raise TypeError(f"adapter {index}: strength must be a real number, got {strength!r}")
    with np.errstate(over="ignore"):
        s = np.float32(strength)
    if not np.isfinite(s):
        raise NonFiniteInputError(
            f"adapter {index}: strength {strength!r} is not finite as f32")
    return s


def _check_layout(bits, name):
    if not bits.flags.c_contiguous:
        raise LayoutError(
            f"{name} must be C-contiguous (row-major, unit stride); pass "
            f"np.ascontiguousarray({name}) to copy it")


def _where(index, shape):
    return tuple(int(v) for v in np.unravel_index(index, shape))


def _fuse_into(weight, adapters, threads, out, check_finite, tile, *, sum_rule):
    w = bf16_bits(weight, "weight")
    if w.ndim != 2:
        raise ShapeError(f"weight must be 2-D [out, in], got shape {w.shape}")
    _check_layout(w, "weight")
    rows, cols = w.shape

    prepared = []  # (A bits, B bits, f32 strength)
    for i, (lora_a, lora_b, strength) in enumerate(adapters):
        a = bf16_bits(lora_a, f"adapter {i} lora_a")
        b = bf16_bits(lora_b, f"adapter {i} lora_b")
        if a.ndim != 2 or b.ndim != 2:
            raise ShapeError(
                f"adapter {i}: lora_a and lora_b must be 2-D, got {a.shape} and {b.shape}")
        if a.shape[1] != cols:
            raise ShapeError(
                f"adapter {i}: lora_a {a.shape} does not fit weight {w.shape}: expected [rank, {cols}]")
        if b.shape[0] != rows:
            raise ShapeError(
                f"adapter {i}: lora_b {b.shape} does not fit weight {w.shape}: expected [{rows}, rank]")
        if a.shape[0] != b.shape[1]:
            raise ShapeError(
                f"adapter {i}: ranks disagree: lora_a has {a.shape[0]} rows, lora_b {b.shape[1]} columns")
        if a.shape[0] > _INT_MAX:
            raise ShapeError(f"adapter {i}: rank {a.shape[0]} exceeds the BLAS integer range")
        _check_layout(a, f"adapter {i} lora_a")
        _check_layout(b, f"adapter {i} lora_b")
        s = _strength_f32(strength, i)
        if a.shape[0] > 0:
            prepared.append((a, b, s))

    threads = resolve_threads(threads)
    if tile is None:
        tile = DEFAULT_TILE
    mb, nb = (int(v) for v in tile)
    if not (1 <= mb <= 65536 and 1 <= nb <= 65536):
        raise ValueError(f"tile must be two ints in [1, 65536], got {tile!r}")

    if out is None:
        result = np.empty_like(w)
        given_out = False
    else:
        result = bf16_bits(out, "out")
        given_out = True
        if result.shape != w.shape:
            raise ShapeError(f"out has shape {result.shape}, expected {w.shape}")
        _check_layout(result, "out")
        if not result.flags.writeable:
            raise LayoutError("out is read-only")
        in_place = result.__array_interface__["data"][0] == w.__array_interface__["data"][0]
        if not in_place and np.shares_memory(result, w):
            raise LayoutError("out partially overlaps weight; pass out=weight or a separate array")
        for i, (a, b, _) in enumerate(prepared):
            if np.shares_memory(result, a) or np.shares_memory(result, b):
                raise LayoutError(f"out overlaps adapter {i}")

    if check_finite:
        wmag = _Magnitudes(w)
        if wmag.first_nonfinite >= 0:
            at = _where(wmag.first_nonfinite, w.shape)
            raise NonFiniteWeightError(
                f"weight is already non-finite at {at} (value {_bf16_value(w[at])!r}) "
                "before fusing")

    allow_fma = True
    use_blas = True
    overflow_bound = 0.0
    for i, (a, b, s) in enumerate(prepared):
        amag, bmag = _Magnitudes(a), _Magnitudes(b)
        if check_finite:
            for name, arr, mag in (("lora_a", a, amag), ("lora_b", b, bmag)):
                if mag.first_nonfinite >= 0:
                    at = _where(mag.first_nonfinite, arr.shape)
                    raise NonFiniteInputError(
                        f"adapter {i} {name} is non-finite at {at} (value {_bf16_value(arr[at])!r})")
        # bs = bf16(B*s): bounds on its magnitudes, one bf16 rounding step of slack each way.
        bs_max = bmag.max * abs(float(s)) * (1 + 2.0**-7)
        bs_min = bmag.min * abs(float(s)) * (1 - 2.0**-7)
        if check_finite and bs_max >= _BF16_FINITE_LIMIT:
            with np.errstate(over="ignore", invalid="ignore"):
                scaled = (b.astype(np.uint32) << 16).view(np.float32) * s
            from .reference import bf16_round

            bad = np.flatnonzero((bf16_round(scaled) & 0x7F80) == 0x7F80)
            if bad.size:
                at = _where(bad[0], b.shape)
                raise NonFiniteResultError(
                    f"adapter {i}: lora_b{at} x strength {float(s)!r} overflows bf16")
        # Products bs*A are exact in f32 (so FMA and BLAS are exact too) unless they could
        # leave the normal range.
        if bs_max * amag.max >= 2.0**127 or (
                bs_min * amag.min != 0 and bs_min * amag.min < 2.0**-126):
            allow_fma = False
        if amag.first_nonfinite >= 0 or bmag.first_nonfinite >= 0 or bs_max >= _BF16_FINITE_LIMIT:
            use_blas = False
        overflow_bound += a.shape[0] * bs_max * amag.max * 1.01

    if not prepared:
        if result is not w:
            np.copyto(result, w)
        return result if given_out else like(result, weight)

    depths = np.zeros((len(prepared), 4), dtype=np.intc)
    edge_m, edge_n = rows - (rows - 1) // mb * mb, cols - (cols - 1) // nb * nb
    dry_run = False
    if check_finite and given_out:
        dry_run = not (overflow_bound + wmag.max < _BF16_FINITE_LIMIT)

    with blas_single_threaded():
        if use_blas and allow_fma:
            for i, (a, _, _) in enumerate(prepared):
                rank = a.shape[0]
                for em, m in ((0, mb), (1, edge_m)):
                    for en, n in ((0, nb), (1, edge_n)):
                        if (em == 0 and rows < mb) or (en == 0 and cols < nb):
                            continue  # no tile of this shape
                        depths[i, 2 * em + en] = _gemm.verified_depth(m, n, rank, rank)
        tiles = -(-rows // mb) * -(-cols // nb)
        run_threads = max(1, min(threads, tiles))
        lora_a = [a for a, _, _ in prepared]
        lora_b = [b for _, b, _ in prepared]
        scales = np.array([s for _, _, s in prepared], dtype=np.float32)
        if dry_run:
            bad = _fuse.fuse_tiles(w, result, lora_a, lora_b, scales, depths, mb, nb,
                                   run_threads, allow_fma, sum_rule, True, True)
            _raise_nonfinite_result(bad, w.shape)
        bad = _fuse.fuse_tiles(w, result, lora_a, lora_b, scales, depths, mb, nb, run_threads,
                               allow_fma, sum_rule, check_finite, False)
    if check_finite:
        _raise_nonfinite_result(bad, w.shape)
    return result if given_out else like(result, weight)


def _raise_nonfinite_result(bad, shape):
    if bad >= 0:
        raise NonFiniteResultError(
            f"the fused weight overflows bf16 at {_where(bad, shape)}")
