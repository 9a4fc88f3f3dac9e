"""The text tower's Linear, ``y = x @ W^T + bias`` (torch.nn.functional.linear), through sgemm
on bf16 weight panels: validation, dispatch, threads and progress around the task driver.

Accumulation.  The default, ``accumulate="f32"``, accumulates in f32, as
``torch.nn.functional.linear`` does on f32 inputs -- the oracle LTX-2's code names for this
step -- so results are comparable with upstream's to within f32 reduction-order noise.
``accumulate="f64"`` widens both operands to f64 and uses dgemm: about 1e-16 relative error
instead of about 1e-7, i.e. the exact sum correctly rounded to f32 in practice, at roughly
half the speed and twice the panel memory.  Either way the result is an f32 array, and it is
byte-identical for any thread count and from run to run: the library, not the BLAS, fixes how
the in-dimension is split.
"""
import functools
import math

import numpy as np

from . import _gemm, _linear
from ._validate import (BLAS_INT_MAX, bf16_or_f32, bf16_to_f32, choice, contiguous, integer,
                        ndarray, output, progress_arg)
from ._threads import blas_single_threaded, resolve_threads, scipy_blas, waves
from .errors import ArgumentError, ArgumentTypeError, DTypeError, ShapeError

__all__ = ["linear", "plan", "segments", "task_count", "error_bound", "gamma", "buffer_bytes"]

#: Up to this many rows of x (with a bf16 weight and f32 accumulation) the product streams the
#: bf16 weight rows through the seam's own kernel: with so few rows per weight element, a BLAS
#: spends more time packing each weight panel than multiplying it.
STREAM_ROWS = 64

#: (rows of x per task, output features per task, in-features per chunk) for each route.  The
#: results depend on these -- they fix the order of the additions -- never on the thread count.
#: sgemm: a widened weight panel of 256 x 512 f32 (512 KiB) is packed by the BLAS once per call
#: and multiplied by up to 512 rows; wider panels are a little faster on two cores but give
#: half the tasks, and machines with many cores need the tasks.  stream: a segment of the
#: weight rows in one chunk; its sums do not depend on the blocks at all, which only set how
#: many weight rows share each block of x held in cache (64 output features for up to 16 rows,
#: 128 above; 8 up to STREAM_FEW_ROWS, below).  f64: panels half the
#: sgemm route's in features, as f64 is twice as wide.  (Tuning runs:
#: bench/results/amd-epyc-zen4-avx512bf16/tuning.md.)
BLOCKS = {"sgemm": (512, 256, 512), "stream": (16, 64, 1 << 18), "f64": (256, 128, 512)}
STREAM_WIDE_BLOCKS = (STREAM_ROWS, 128, 1 << 18)

#: From the kernel table's ``panel_min_rows`` (on the AVX2 table 48) up to STREAM_ROWS rows,
#: the "panel" route: the same tasks and segments as the streaming route, multiplied by the
#: fuse's register blocks (``_gemm.PANEL_CHUNK`` in-features a chunk, each chunk's sums in
#: order from +0.0), where the streaming kernel's widening would share the FMA pipes.
BLOCKS["panel"] = STREAM_WIDE_BLOCKS

#: The routes whose kernels read the bf16 weight rows themselves: they share the streaming
#: route's blocks and segments; the streaming and panel kernels (F32_X_ROUTES) take x in f32
#: (a bf16 x is widened once, shared), the dot-product kernels (DOT_ROUTES) a bf16 x as it is.
F32_X_ROUTES = ("stream", "panel")
DOT_ROUTES = ("dot", "dot_panel")
KERNEL_ROUTES = F32_X_ROUTES + DOT_ROUTES

#: The dot-product routes: bf16 x and a bf16 weight with f32 accumulation, at every row count,
#: on kernel tables with VDPBF16PS (two bf16 products a lane per instruction, added in f32):
#: the products are exact, only the additions round, as on the other routes, and no operand
#: is widened. They treat subnormal inputs, products and sums as zero, which error_bound
#: counts. "dot" streams both operands' rows (lane sums, as the streaming kernel); from
#: DOT_PANEL_ROWS rows "dot_panel" packs x into pairs and broadcasts the weight, as the
#: fuse does, where a vector of each operand a product would outrun L2. "dot" takes a whole
#: segment a call, as the streaming route, for long runs of each weight row; "dot_panel"
#: takes 2048 in-features, so that text_features, which holds a call's features of each
#: segment for every token, holds about as much as on the sgemm route (64 KiB a token). Up to
#: STREAM_FEW_ROWS rows, the streaming route's blocks.
DOT_PANEL_ROWS = 32
BLOCKS["dot"] = STREAM_WIDE_BLOCKS
BLOCKS["dot_panel"] = (STREAM_ROWS, 128, 2048)

#: Above STREAM_ROWS rows the dot-product panel route takes 128 rows a task: every task reads
#: its weight rows from memory once, so taller tasks read the weight fewer times (at 1024 rows,
#: tasks of 64 rows read it 16 times), and at LTX-2's widths there are still 256 tasks or more.
#: The bytes are the same: each output's chunks are added in the same order whatever the
#: blocks.
DOT_PANEL_WIDE_BLOCKS = (128, 128, 2048)


def _panel_min_rows():
    """The fewest rows the table in use takes the panel route for (0: never)."""
    return _gemm.panel_min_rows()


#: OpenBLAS's kernel cores whose sgemm runs 512-bit vectors. threadpoolctl names the core
#: OpenBLAS chose at load time; a CPU it does not know gets an older core (OpenBLAS 0.3.30
#: runs its 256-bit Haswell kernels on AMD Zen 5).
WIDE_BLAS_CORES = frozenset({"skylakex", "cooperlake", "sapphirerapids"})


@functools.lru_cache(maxsize=None)
def _blas_core():
    """The kernel core the BLAS chose when it loaded (fixed for the process), or None."""
    return (scipy_blas() or {}).get("architecture")


def panel_above_stream_rows():
    """Whether a bf16 weight takes the panel route above STREAM_ROWS rows instead of sgemm: where
    the kernel table's vectors (AVX-512) are wider than those of the sgemm kernel the BLAS runs
    on this CPU, the fuse's register blocks outrun it at every row count (1.3-1.5x at 256 rows
    on a Zen 5: bench/results/amd-epyc-zen5-avx512bf16). A BLAS of unknown core keeps sgemm."""
    core = _blas_core()
    return (_gemm.kernel_name().startswith("avx512") and core is not None
            and core.lower() not in WIDE_BLAS_CORES)


def _panel_route(rows):
    """Whether rows of f32 x by a bf16 weight take the panel kernel: from the table's
    panel_min_rows up to STREAM_ROWS, and above them where panel_above_stream_rows()."""
    if rows > STREAM_ROWS:
        return panel_above_stream_rows()
    return 0 < _panel_min_rows() <= rows


#: Up to this many rows of x the streaming product is bound by memory: it reads whole weight
#: rows (one segment; shorter runs read measurably slower) and takes its tasks from the output
#: features alone, 8 a task, 256 or more at the real widths -- x, at most 3 MiB, is then read
#: again by every task, from cache.
STREAM_FEW_ROWS = 4
STREAM_FEW_BLOCKS = (STREAM_FEW_ROWS, 8, 1 << 18)

#: The fewest independent tasks a Linear is cut into where its in-dimension allows: a machine
#: with tens of cores shares a few dozen tasks unevenly (32 tasks on 20 cores leave most of them
#: idle for the second half), and the output alone gives only 8 to 64 at the real shapes.
MIN_TASKS = 256

#: At most this many segments are asked for (rounding can give up to twice as many): each
#: segment's sums and, in the feature extractor, a chunk of its features per token are held
#: at once, and a narrow output would otherwise ask for hundreds.
MAX_SEGMENTS = 32

#: Above STREAM_FEW_ROWS rows the streaming route cuts the in-dimension into segments of this
#: many in-features, whole 4096-element blocks (the kernel's lane blocks), whatever the rows,
#: features or task blocks, so that its bytes stay independent of them: 16 segments at the real
#: width, 256 tasks or more at every real shape.
STREAM_SEGMENT = 3 * _gemm.STREAM_BLOCK


def plan(rows, weight_dtype, accumulate="f32", blocks=None, x_dtype=np.float32):
    """The route ("sgemm", "stream", "panel", "dot", "dot_panel" or "f64") and (rows, features,
    chunk) blocks a call with ``rows`` rows of x of ``x_dtype`` and this weight dtype takes."""
    bf16_weight = np.dtype(weight_dtype).itemsize == 2
    if accumulate == "f64":
        route = "f64"
    elif bf16_weight and np.dtype(x_dtype).itemsize == 2 and _gemm.has_dot_linear():
        route = "dot_panel" if rows >= DOT_PANEL_ROWS else "dot"
    elif bf16_weight and _panel_route(rows):
        route = "panel"
    elif bf16_weight and rows <= STREAM_ROWS:
        route = "stream"
    else:
        route = "sgemm"
    if blocks is not None:
        return route, tuple(blocks)
    if route == "dot_panel" and rows > STREAM_ROWS:
        return route, DOT_PANEL_WIDE_BLOCKS
    if route in DOT_ROUTES:
        return route, STREAM_FEW_BLOCKS if rows <= STREAM_FEW_ROWS else BLOCKS[route]
    if route in KERNEL_ROUTES and rows > BLOCKS["stream"][0]:
        return route, STREAM_WIDE_BLOCKS
    if route == "stream" and rows <= STREAM_FEW_ROWS:
        return route, STREAM_FEW_BLOCKS
    return route, BLOCKS[route]


def segments(rows, feats, cols, route, blocks):
    """(count, length): the in-dimension cut into ``count`` segments of ``length`` in-features
    (the last may be shorter).  Each segment's sum is taken on its own, by tasks of their own,
    and y is the segments' sums added in segment order (the first starting from the bias).

    The cut depends on the shape and the blocks only, never on the thread count.  Segments are
    whole chunks (whole 4096-element blocks on the streaming and panel routes); the sgemm and
    f64 routes take enough to bring the tasks to :data:`MIN_TASKS` (asking for at most
    :data:`MAX_SEGMENTS`); the streaming and panel routes cut :data:`STREAM_SEGMENT`
    in-features a segment, or with at most :data:`STREAM_FEW_ROWS` rows none."""
    task_rows, task_feats, chunk = blocks
    if route in KERNEL_ROUTES:
        length = STREAM_SEGMENT if rows > STREAM_FEW_ROWS else max(1, cols)
    else:
        blocks_out = _linear.block_count(rows, feats, task_rows, task_feats)
        wanted = min(MAX_SEGMENTS, -(-MIN_TASKS // max(1, blocks_out)))
        units = max(1, -(-cols // chunk))
        length = max(1, units // wanted) * chunk  # rounded down: at least `wanted` segments
    return max(1, -(-cols // length)), length


#: A call runs its segments in passes, in order, each pass's tasks sharing the pass's x packed
#: and its segments' sums (linear() allocates them for one pass, not the call: at 2048 rows of
#: the caption projection, every segment at once is 1 GiB, whose first touch cost a quarter of
#: the call). A pass takes enough segments for MIN_TASKS tasks and this many a thread, so that
#: the threads' wait at a pass's end, about one task each, stays near 1 % of the pass on many
#: cores.
PASS_TASKS_PER_THREAD = 64


def segments_per_pass(count, blocks_out, route, threads):
    """How many of a call's ``count`` segments each pass takes, with ``blocks_out`` tasks a
    segment on ``threads`` threads: every one with the f64 accumulation (the segments' sums are
    added in f64 before y is rounded once).  The passes never change the bytes of y: the
    segments' sums are added in segment order either way."""
    if route == "f64":
        return count
    wanted = max(MIN_TASKS, PASS_TASKS_PER_THREAD * threads)
    return max(1, min(count, -(-wanted // max(1, blocks_out))))


def segment_passes(rows, feats, cols, route, blocks, threads):
    """(count, length, per pass): the call's segments (:func:`segments`) and how many of them
    each pass takes (:func:`segments_per_pass`)."""
    count, length = segments(rows, feats, cols, route, blocks)
    per_segment = _linear.block_count(rows, feats, blocks[0], blocks[1])
    return count, length, segments_per_pass(count, per_segment, route, threads)


def task_count(rows, feats, cols, weight_dtype, accumulate="f32", blocks=None,
               x_dtype=np.float32):
    """How many independent tasks a call is cut into: output blocks times segments."""
    route, blocks = plan(rows, weight_dtype, accumulate, blocks, x_dtype)
    count, _ = segments(rows, feats, cols, route, blocks)
    return _linear.block_count(rows, feats, blocks[0], blocks[1]) * count


def buffer_bytes(rows, cols, weight_dtype, x_dtype=np.float32, accumulate="f32", threads=1,
                 blocks=None, *, feats):
    """Bytes of buffers a linear() call allocates besides its output, never a full-size copy of
    the weight.  Per thread: the widened weight panel [features x chunk] (sgemm route with a
    bf16 weight, or f64), the widened x panel [rows x chunk] (bf16 x on the sgemm route, or
    f64) and the accumulator [features x rows]; on the streaming and dot-product routes,
    instead of the weight panel, lane sums [features x rows x 16], on the panel route x's
    strips and one block of widened weight rows for a chunk, on the dot-product panel route
    one block of sums [8 x rows]; on the streaming and panel routes a bf16 x is widened once,
    shared, and on the dot-product panel route it is packed once, shared (as many bytes as x,
    its rows rounded up to 32) -- a pass's in-features of it at a time.  With more than one
    segment a pass (:func:`segments_per_pass`), each of the pass's segments' sums
    [rows x feats] (f32, f64 on the f64 route) until they are added up."""
    route, blocks = plan(rows, weight_dtype, accumulate, blocks, x_dtype)
    mb, ob, kb = blocks
    bf16_w = np.dtype(weight_dtype).itemsize == 2
    bf16_x = np.dtype(x_dtype).itemsize == 2
    # On the streaming and panel routes a bf16 x is widened once, whole, and shared: the
    # kernels then take it as f32; the dot-product kernels read it as it is, or packed.
    _, length, per_pass = segment_passes(rows, feats, cols, route, blocks, threads)
    packed = _packs_x_once(route, blocks, length)
    per_thread = _linear.thread_buffer_bytes(mb, ob, kb, route == "f64", _gemm.PRODUCTS[route],
                                             bf16_w, bf16_x, packed)
    shared = 4 * rows * cols if (route in F32_X_ROUTES and bf16_x) else 0
    if packed:
        shared += _linear.packed_x_bytes(rows, min(cols, per_pass * length))
    if per_pass > 1:
        shared += per_pass * rows * feats * (8 if route == "f64" else 4)
    return threads * per_thread + shared


def gamma(rows, cols, weight_dtype, accumulate="f32", blocks=None, feats=None,
          x_dtype=np.float32):
    """gamma_d of :func:`error_bound` for a call with this many rows, in-features and (if
    given) out features; without ``feats``, the larger gamma that holds for every cut into
    segments."""
    route, blocks = plan(rows, weight_dtype, accumulate, blocks, x_dtype)
    kb = blocks[2]
    if feats is None:  # one segment: the longest chain of additions any cut can give
        count, length = 1, cols
    else:
        count, length = segments(rows, feats, cols, route, blocks)
    length = min(length, cols)
    kt = min(kb, length)
    chunks = max(1, math.ceil(length / kb))
    if route == "stream":
        block = _gemm.STREAM_BLOCK
        d = 1 + block // 4 + math.ceil(kt / block) + 4 + 15 + chunks
    elif route == "dot":
        lanes, units = _gemm.dot_rule()
        block = _gemm.DOT_BLOCK
        d = (1 + block // (2 * lanes) * units + math.ceil(kt / block)
             + (lanes.bit_length() - 1) + (2 * lanes - 1) + chunks)
    elif route == "dot_panel":
        _, units = _gemm.dot_rule()
        block = _gemm.DOT_PANEL_CHUNK
        run = min(kt, block)
        d = (1 + units * (run // 2) - units // 2 + run % 2 + math.ceil(kt / block)
             + chunks)
    elif route == "panel":
        block = _gemm.PANEL_CHUNK
        d = 1 + (min(kt, block) - 1) + math.ceil(kt / block) + chunks
    else:
        d = 1 + (kt - 1) + chunks
    d += (count - 1) + 1
    u = 2.0**-53 if route == "f64" else 2.0**-24
    return d * u / (1 - d * u)


def error_bound(x, weight, bias=None, accumulate="f32", blocks=None):
    """Elementwise bound on |y - exact| before y's final rounding to f32, derived, not fitted.

    Parameters
    ----------
    x, weight, bias, accumulate, blocks
        As for :func:`linear`.

    Returns
    -------
    float64 array [..., out]
        The bound for each element of ``linear(x, weight, bias, ...)``.

    Notes
    -----
    Every product x*w and every addition rounds once, with relative error at most u (2^-24 in
    f32, 2^-53 in f64).  If a term of y passes through at most d roundings, then
    |y - exact| <= gamma_d * (sum_i |x_i w_i| + |bias|), gamma_d = d u / (1 - d u) (Higham,
    Accuracy and Stability of Numerical Algorithms, 2nd ed., §3.1, for any summation order).
    Counting d along a segment (:func:`segments`: S segments of L in-features; kb the chunk,
    n = ceil(L / kb) chunks in a segment):
      sgemm/f64 route: 1 product + kb - 1 additions inside a chunk's sum (any order the BLAS
        takes) + n additions of chunks into the segment's running sum;
      streaming route: 1 product + 1024 additions in a lane's block (4096 elements, 4 lanes at
        the narrowest) + ceil(kb / 4096) block sums + 4 tree levels + 15 tail additions + n;
      panel route: 1 product + 511 additions in a chunk's sum (512 elements, in order) +
        ceil(kb / 512) chunk sums + n;
      dot-product route: 1 product + U per pair in a lane's block (2048 elements, L lanes
        of pairs) + ceil(kb / 2048) block sums + log2(L) tree levels + 2L - 1 tail additions
        + n;
      dot-product panel route: 1 product + U per pair in a chunk's sum (512 elements, in
        order, U / 2 fewer for the first pair, added to +0.0) + 1 for an odd last element +
        ceil(kb / 512) chunk sums + n;
      then S - 1 additions of the segments' sums, and 1 for the bias.
    On the dot-product routes, L and U are the kernel table's (``_gemm.dot_rule()``): with
    VDPBF16PS (x86) 16 lanes, and U = 2, a pair's two products each added with one rounding to
    nearest; with BFDOT (Arm) 4 lanes, and U = 4, the pair's exact sum rounded to odd and added
    rounded to odd, each error below one unit in the last place, 2u, which (1 + 2u) <= (1 + u)^2
    lets gamma_d count as two roundings.  The dot-product instructions also treat subnormal
    inputs as zero, and flush a subnormal product or partial sum to zero, losing less than
    2^-126 each (at most two a term: its product, and the sum it joins or its pair's sum and
    the accumulation): on those routes the bound adds
    (1 + gamma_d) * (sum of |x_i w_i| over the terms with a subnormal factor + 2 * in * 2^-126).
    The final rounding to f32 adds half an ulp of y on top."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    k = weight.shape[1]
    route, _ = plan(rows, weight.dtype, accumulate, blocks, x.dtype)
    g = gamma(rows, k, weight.dtype, accumulate, blocks, feats=weight.shape[0], x_dtype=x.dtype)
    x64, w64 = np.abs(_as_f64(x).reshape(-1, k)), np.abs(_as_f64(weight))
    with blas_single_threaded():
        magnitude = _gemm.dgemm_xwt(x64, w64)
    if bias is not None:
        magnitude = magnitude + np.abs(_as_f64(bias))
    bound = g * magnitude
    if route in DOT_ROUTES:
        flushed = np.full(magnitude.shape, 2.0 * k * 2.0**-126)
        x_sub, w_sub = _subnormal(x64), _subnormal(w64)
        with blas_single_threaded():
            if x_sub.any():
                flushed += _gemm.dgemm_xwt(np.where(x_sub, x64, 0.0), w64)
            if w_sub.any():
                flushed += _gemm.dgemm_xwt(x64, np.where(w_sub, w64, 0.0))
        bound = bound + (1 + g) * flushed
    return bound.reshape(x.shape[:-1] + (weight.shape[0],))


def _packs_x_once(route, blocks, seg_len):
    """Whether the call packs its x whole, once, for its kernel (_linear.takes_packed_x)."""
    return _linear.takes_packed_x(_gemm.PRODUCTS[route], blocks[0], blocks[2], seg_len)


def _subnormal(magnitudes):
    return (magnitudes > 0) & (magnitudes < 2.0**-126)


def _as_f64(array):
    if array.dtype.itemsize == 2:
        return bf16_to_f32(array).astype(np.float64)
    return array.astype(np.float64)


def linear(x, weight, bias=None, *, accumulate="f32", threads=None, out=None, progress=None,
           blocks=None):
    """``torch.nn.functional.linear``: ``y = x @ weight^T + bias``, as f32.

    Parameters
    ----------
    x : float32 or bf16 array [..., in]
        bf16 as ``ml_dtypes.bfloat16`` or uint16 bit patterns. Leading dimensions are flattened.
        C-contiguous.
    weight : float32 or bf16 array [out, in]
        Read a panel at a time; a bf16 weight is widened a block at a time, never whole.
    bias : float32 or bf16 array [out], optional
    accumulate : "f32" (default) or "f64"
        See the module docstring: f32 mirrors F.linear on f32; f64 is the exact sum rounded
        to f32, at about half the speed.
    threads : int or None
        None uses every CPU the process may use; the result does not depend on it.
    out : float32 array [..., out], optional
    progress : callable, optional
        Called from the calling thread with the fraction done (0 < f <= 1, increasing, the last
        call 1.0). An exception it raises stops the call.
    blocks : (rows, features, chunk), optional
        Task and chunk sizes, three ints in [1, 2^20] (default: ``BLOCKS`` of the route
        :func:`plan` picks). Changing them changes the order of the additions, and so the last
        bits of an f32 result.

    Every argument is checked before anything is computed or written: a bad one raises an
    :class:`~ltx2blas.Ltx2BlasError` and leaves ``out`` as it was.

    Returns
    -------
    float32 array [..., out]
    """
    x_kind, x_bits = bf16_or_f32(x, "x")
    _, w_bits = bf16_or_f32(weight, "weight")
    choice(accumulate, ("f32", "f64"), "accumulate")
    blocks = _blocks_arg(blocks)
    threads = resolve_threads(threads)
    progress_arg(progress)
    rows, feats, cols = _shapes(x, weight)
    bias32 = _bias_f32(bias, feats)
    y = _output(out, x.shape[:-1] + (feats,), x, weight, bias)
    route, blocks = plan(rows, weight.dtype, accumulate, blocks, x.dtype)

    if rows == 0 or feats == 0 or cols == 0:  # nothing to multiply
        if rows and feats:
            y.reshape(rows, feats)[...] = 0.0 if bias32 is None else bias32
        if progress is not None:
            progress(1.0)
        return y
    x2 = x_bits.reshape(rows, cols)
    if route in F32_X_ROUTES and x_kind == "bf16":
        # Few rows: widen them once here rather than per thread and chunk.
        x2 = bf16_to_f32(x2)
    bias64 = bias32.astype(np.float64) if (bias32 is not None and route == "f64") else None
    _, length, per_pass = segment_passes(rows, feats, cols, route, blocks, threads)
    partial = packed = None
    if per_pass > 1:  # the pass's segments' sums, until they are added up in order
        partial = np.empty((per_pass, rows, feats), np.float64 if route == "f64" else np.float32)
    if _packs_x_once(route, blocks, length):
        packed = np.empty(_linear.packed_x_bytes(rows, min(cols, per_pass * length)) // 4,
                          np.uint32)
    tasks = _linear.LinearPlan(x2, w_bits, bias32, bias64, y.reshape(rows, feats), *blocks,
                               threads, route == "f64", _gemm.PRODUCTS[route], length, per_pass,
                               partial, packed)
    _run_in_waves(tasks, threads, progress)
    return y


def _shapes(x, weight):
    """(rows of x, out features, in features), the arrays' shapes and layouts checked."""
    if x.ndim < 1:
        raise ShapeError("x must have at least one dimension [..., in], got a 0-d array")
    if weight.ndim != 2:
        raise ShapeError(f"weight must be 2-D [out, in], got shape {weight.shape}")
    feats, cols = weight.shape
    if x.shape[-1] != cols:
        raise ShapeError(f"x has {x.shape[-1]} features, weight expects {cols} (x {x.shape}, "
                         f"weight {weight.shape})")
    contiguous(x, "x")
    contiguous(weight, "weight")
    # The BLAS takes 32-bit sizes: rows and chunks are cut to fit, and the leading dimensions
    # (the row lengths of x, weight and y) must fit too.
    if cols > BLAS_INT_MAX or feats > BLAS_INT_MAX:
        raise ShapeError(f"in ({cols}) and out ({feats}) features must be below 2^31 for a "
                         "32-bit-integer BLAS")
    return int(np.prod(x.shape[:-1], dtype=np.int64)), feats, cols


def _bias_f32(bias, feats):
    if bias is None:
        return None
    kind, bits = bf16_or_f32(bias, "bias")
    if bias.shape != (feats,):
        raise ShapeError(f"bias must have shape ({feats},), got {bias.shape}")
    return bf16_to_f32(bits) if kind == "bf16" else np.ascontiguousarray(bias)


def _output(out, shape, x, weight, bias):
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if ndarray(out, "out").dtype != np.dtype(np.float32):
        raise DTypeError(f"out must be a float32 numpy array, got {out.dtype}")
    return output(out, shape, {"x": x, "weight": weight, "bias": bias})


def _blocks_arg(blocks):
    """None, or ``blocks`` as three ints in [1, 2^20]; a float or a bool is refused rather than
    truncated, as the blocks fix the order of the additions."""
    if blocks is None:
        return None
    values = None
    if not isinstance(blocks, (str, bytes)):
        try:
            values = tuple(blocks)
        except TypeError:  # not iterable: an int, a 0-d array
            pass
    if values is None:
        raise ArgumentTypeError(f"blocks must be three ints (rows, features, chunk), got "
                                f"{blocks!r}")
    if len(values) != 3:
        raise ArgumentError(f"blocks must be three ints (rows, features, chunk), got {blocks!r}")
    return tuple(integer(v, f"blocks[{i}]", 1, 1 << 20) for i, v in enumerate(values))


def _run_in_waves(tasks, threads, progress):
    """Run the plan's tasks a wave at a time, reporting progress between waves (an exception
    from ``progress`` stops the call there)."""
    with blas_single_threaded():
        for first, stop in waves(tasks.tasks, threads):
            tasks.run(first, stop)
            if progress is not None:
                progress(stop / tasks.tasks)
