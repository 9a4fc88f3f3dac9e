"""The text feature extractor's forward (docs/arithmetic.md §4): normalise Gemma's hidden states, flatten them
to D * L features per token and project them -- without ever materialising the features.

Only valid (unmasked) tokens are computed.  A padded row's features are zero, so its output is
what upstream's Linear gives on zero features: the projection's bias (V2), zeros (V1).  The
projections are computed one after another, and each one's features a step at a time straight
into its GEMM input panels, its in-dimension's segments a pass at a time as the Linear takes
them, so a call reads the hidden states once for the statistics and once per projection for
the features, and holds one step's features: about 4096 f32 features per valid token, or one
512-feature chunk of each segment of the pass, and with 64 tokens or fewer (the streaming
route) all of them; on CPUs with AVX512_BF16 (the dot-product routes) the features of the
pass's segments, at most four segments' worth (96 KiB a token), and with 31 tokens or fewer
all of them, as bf16 -- where the flattened f32 features of 1024 tokens would take 770 MB --
besides one pass's segment sums (segments a pass x tokens x out f32, as the Linear holds
them).  The arithmetic is :mod:`ltx2blas.reference`'s ``text_features``; each projection's
result is byte-identical to :func:`ltx2blas.linear` on the materialised features (same
blocks, same order of additions).
"""
import math

import numpy as np

from . import _features, _gemm, _linear
from ._validate import (bf16_or_f32, choice, contiguous, f32_values, flag, integer, ndarray,
                        progress_arg)
from ._threads import blas_single_threaded, resolve_threads, waves
from .errors import ArgumentError, ArgumentTypeError, DTypeError, ShapeError
from .linear_layer import plan, segment_passes

__all__ = ["text_features", "normalized_features"]

_VERSIONS = ("v1", "v2")


def _validate(hidden_states, attention_mask, version):
    choice(version, _VERSIONS, "version")
    hidden = bf16_or_f32(hidden_states, "hidden_states")[1]
    if hidden.ndim != 4:
        raise ShapeError(f"hidden_states must be [B, T, D, L], got shape {hidden.shape}")
    contiguous(hidden, "hidden_states")
    if ndarray(attention_mask, "attention_mask").dtype.kind not in "biu":
        raise DTypeError(f"attention_mask must be bool or integer, got {attention_mask.dtype}")
    if attention_mask.shape != hidden.shape[:2]:
        raise ShapeError(f"attention_mask has shape {attention_mask.shape}, hidden_states "
                         f"{hidden.shape}: expected [B, T] = {hidden.shape[:2]}")
    return hidden, attention_mask.astype(bool)


def _statistics(flat, rows, sample, batch, layers, depth, version, threads):
    """(mean32, range32, None) for V1, each [B, L]; (None, None, inv32 [n, L]) for V2 -- the
    reference's arithmetic."""
    n = rows.shape[0]
    sums = np.empty((n, layers), np.float64)
    squares = np.empty((n, layers), np.float64)
    lows = np.empty((n, layers), np.float32)
    highs = np.empty((n, layers), np.float32)
    _features.row_stats(flat, rows, layers, sums, squares, lows, highs, threads)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if version == "v2":
            return None, None, (1.0 / np.sqrt(squares / depth + 1e-6)).astype(np.float32)
        mean = np.zeros((batch, layers), np.float32)
        rng = np.ones((batch, layers), np.float32)
        for b in range(batch):
            mine = sample == b
            count = int(mine.sum())
            if count == 0:
                continue
            total = np.cumsum(sums[mine], axis=0)[-1]     # over tokens in order, from the first
            mean[b] = (total / (count * depth + 1e-6)).astype(np.float32)
            rng[b] = (highs[mine].max(axis=0) - lows[mine].min(axis=0)) + np.float32(1e-6)
            nan = np.isnan(lows[mine]).any(axis=0)
            mean[b][nan] = np.nan
        return mean, rng, None


def text_features(hidden_states, attention_mask, projections, *, version="v1", threads=None,
                  progress=None, audio_video=False):
    """The text feature extractor's forward: normalise, flatten, project.

    Parameters
    ----------
    hidden_states : bf16 or float32 array [B, T, D, L]
        Gemma's stacked hidden states (LTX-2: D = 3840, L = 49), C-contiguous.
    attention_mask : bool or integer array [B, T]
        Nonzero for valid tokens; padded tokens are skipped, their features are zero and their
        output rows the projection's bias (zeros without one), as upstream's Linear gives.
    projections : list of (weight, bias)
        weight bf16 or f32 [out, D * L]; bias None, bf16 or f32 [out].  V1: one Linear (LTX-2,
        3840 out, no bias); V2: the video and audio Linears (LTX-2.3, 4096 and 2048, with bias).
    version : "v1" or "v2"
        V1: per-sample, per-layer mean/range normalisation times 8; V2: per-token RMS
        normalisation, rescaled by sqrt(out / D) for each projection (docs/arithmetic.md §4).
    threads, progress : as for :func:`ltx2blas.linear`.
    audio_video : bool
        V1 only: the model is an audio-video one, whose V1 extractor hands the same features to
        both streams (upstream returns them twice); the result is then ``[y, y]``, one array.

    Returns
    -------
    list of float32 arrays [B, T, out], one per projection (V1 audio-video: the one array twice).

    Every argument is checked before anything is computed: a bad one raises an
    :class:`~ltx2blas.Ltx2BlasError`.
    """
    hidden, mask = _validate(hidden_states, attention_mask, version)
    batch, tokens, depth, layers = hidden.shape
    if flag(audio_video, "audio_video") and version != "v1":
        raise ArgumentError("audio_video applies to version 'v1'; V2's audio stream is its second "
                            "projection")
    weights, biases = _projections(projections, version, depth, layers)
    threads = resolve_threads(threads)
    progress_arg(progress)

    flat = hidden.reshape(batch * tokens, depth * layers)
    rows = np.flatnonzero(mask.reshape(-1)).astype(np.int64)
    # Every row starts as the bias (or zeros): what the Linear gives on zero features, which a
    # padded row has; the valid rows are then written over.
    outputs = [np.zeros((batch * tokens, w.shape[0]), np.float32) if b is None else
               np.repeat(b[None, :], batch * tokens, axis=0) for w, b in zip(weights, biases)]
    if rows.size and flat.shape[1]:
        _project(flat, rows, tokens, batch, layers, version, weights, biases, outputs, threads,
                 progress)
    elif progress is not None:  # nothing to add to the bias
        progress(1.0)
    ys = [y.reshape(batch, tokens, -1) for y in outputs]
    return ys * 2 if audio_video else ys


def _projections(projections, version, depth, layers):
    """(weights, f32 biases or None) of the projections, each checked against D * L."""
    width = depth * layers
    if isinstance(projections, (str, bytes, np.ndarray)) or not hasattr(projections, "__iter__"):
        raise ArgumentTypeError(f"projections must be a list of (weight, bias), got "
                                f"{type(projections).__name__}")
    projections = list(projections)
    if not projections:
        raise ArgumentError("projections must hold at least one (weight, bias)")
    if version == "v1" and len(projections) != 1:
        raise ArgumentError(f"version 'v1' has one projection, got {len(projections)}")
    weights, biases = [], []
    for i, item in enumerate(projections):
        try:
            weight, bias = item
        except (TypeError, ValueError):
            raise ArgumentTypeError(f"projections[{i}] must be (weight, bias)") from None
        w = bf16_or_f32(weight, f"projections[{i}] weight")[1]
        if w.ndim != 2 or w.shape[1] != width:
            raise ShapeError(f"projections[{i}] weight has shape {w.shape}, expected "
                             f"[out, {width}] (D * L = {depth} * {layers})")
        contiguous(w, f"projections[{i}] weight")
        if bias is not None:
            bias = np.ascontiguousarray(f32_values(bias, f"projections[{i}] bias"))
            if bias.shape != (w.shape[0],):
                raise ShapeError(f"projections[{i}] bias has shape {bias.shape}, expected "
                                 f"({w.shape[0]},)")
        weights.append(w)
        biases.append(bias)
    if len({w.dtype for w in weights}) != 1:
        raise DTypeError("the projections' weights must share one dtype (all bf16 or all f32)")
    return weights, biases


def _project(flat, rows, tokens, batch, layers, version, weights, biases, outputs, threads,
             progress):
    """Statistics, then the features a step at a time into every projection's panels, and the
    segments' sums added up into ``outputs``' valid rows."""
    n, width = rows.shape[0], flat.shape[1]
    depth = width // layers
    sample = (rows // tokens).astype(np.int64)
    # The features are bf16: the route linear() takes for bf16 x, so that the bytes agree.
    route, blocks = plan(n, weights[0].dtype, "f32", x_dtype=np.uint16)
    task_rows, task_feats, chunk = blocks
    product = _gemm.PRODUCTS[route]
    cuts = [_cut(n, w.shape[0], width, route, blocks, threads) for w in weights]
    total = sum(cut[-1] for cut in cuts)
    done = 0
    with blas_single_threaded():
        mean, rng, inv = _statistics(flat, rows, sample, batch, layers, depth, version, threads)
        for w, b, y, (count, length, per_pass, chunks, _) in zip(weights, biases, outputs,
                                                                 cuts):
            panels = np.empty(_features.panel_elements(product, task_rows, n, per_pass, chunks,
                                                       chunk, length), np.float32)
            acc = np.empty(per_pass * n * w.shape[0], np.float32)
            scale = float(np.float32(math.sqrt(w.shape[0] / depth)))
            job = _features.FeaturePlan(flat, rows, sample, version == "v2", mean, rng, inv, w,
                                        b, acc, panels, scale, (count, length, per_pass, chunks),
                                        task_rows, task_feats, chunk, product, threads, layers)
            for step in range(job.steps):
                job.normalize(step)
                tasks = job.tasks(step)
                for first, stop in waves(tasks, threads):
                    job.run(step, first, stop)
                    if progress is not None and (stop < tasks or job.ends_pass(step) < 0):
                        progress((done + stop / tasks) / total)
                if job.ends_pass(step) >= 0:
                    job.end_pass(job.ends_pass(step), y)
                    if progress is not None:
                        progress((done + 1) / total)
                done += 1
            job = panels = acc = None  # one projection's panels and sums at a time


#: Features a token a step holds, about: this many features (a whole number of chunks of every
#: segment of its pass, at least one chunk each) on the routes that widen or stream x, and this
#: many segments' worth on the dot-product panel route, where linear() packs its x a pass at a
#: time -- so that at LTX-2's widths each task runs its whole segment in one step, as linear()'s
#: do (steps of one 2048-feature chunk restart every task six times a segment), while a narrow
#: projection, whose pass takes every segment, still never holds its features whole.
STEP_FEATURES = 4096
STEP_SEGMENTS = 4


def _cut(n, out, width, route, blocks, threads):
    """(segments, segment length, segments a pass, chunks a step, steps) of a projection with
    ``out`` features, cut as linear() cuts it."""
    task_rows, _, chunk = blocks
    count, length, per_pass = segment_passes(n, out, width, route, blocks, threads)
    per_segment = -(-min(length, width) // chunk)  # chunks in a segment
    budget = (STEP_SEGMENTS * length
              if _linear.takes_packed_x(_gemm.PRODUCTS[route], task_rows, chunk, length)
              else STEP_FEATURES)
    step = max(1, min(per_segment, budget // chunk // per_pass))
    return count, length, per_pass, step, -(-count // per_pass) * -(-per_segment // step)


def normalized_features(hidden_states, attention_mask, *, version="v1", out_features=None,
                        threads=None):
    """The bf16 features a projection multiplies, materialised: for checking and inspection
    (:func:`text_features` never builds them).

    Parameters
    ----------
    hidden_states, attention_mask, version, threads
        As for :func:`text_features`.
    out_features : int
        V2 only: the projection's out features (its rescaling depends on them); a positive int.

    Returns
    -------
    uint16 array [B, T, D * L]
        bf16 bits; padded rows +0.0.
    """
    hidden, mask = _validate(hidden_states, attention_mask, version)
    batch, tokens, depth, layers = hidden.shape
    if out_features is not None:
        out_features = integer(out_features, "out_features", 1, np.iinfo(np.int64).max)
    elif version == "v2":
        raise ArgumentError("version 'v2' rescales by sqrt(out_features / D): pass out_features")
    threads = resolve_threads(threads)
    width = depth * layers
    identity = np.zeros((1, width), np.uint16)  # a weight only to drive the normaliser
    flat = hidden.reshape(batch * tokens, width)
    rows = np.flatnonzero(mask.reshape(-1)).astype(np.int64)
    sample = (rows // tokens).astype(np.int64)
    n = rows.shape[0]
    feats = np.zeros((batch * tokens, width), np.uint16)
    if n == 0 or width == 0:
        return feats.reshape(batch, tokens, width)
    mean, rng, inv = _statistics(flat, rows, sample, batch, layers, depth, version, threads)
    x = np.empty(n * width, np.float32)
    scale = float(np.float32(math.sqrt(out_features / depth))) if version == "v2" else 1.0
    # one 1 x 1 task per row: its accumulator is a single float each
    job = _features.FeaturePlan(flat, rows, sample, version == "v2", mean, rng, inv,
                                identity, None, np.empty(n, np.float32), x, scale,
                                (1, width, 1, 1), 1, 1, width, _gemm.PRODUCTS["stream"],
                                threads, layers)
    job.normalize(0)
    feats[rows] = (x.reshape(n, width).view(np.uint32) >> 16).astype(np.uint16)
    return feats.reshape(batch, tokens, width)
