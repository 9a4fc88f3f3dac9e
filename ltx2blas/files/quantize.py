"""A bf16 checkpoint's Linear weights quantised into a layout of their owners (``ltx2blas
quantize``): which weights (the format's owner's choice, and the user's globs), the tensors and
markers each format's loader needs, and a streaming write.  The arithmetic is
:func:`ltx2blas.quantized.quantize_weight`'s; docs/quantize.md says what each format is.
"""
import fnmatch
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .. import quantized as qz
from .._threads import resolve_threads
from .._validate import choice, progress_arg
from ..errors import ArgumentError, printable
from . import keys as keymatch
from . import provenance
from .checkpoint import (Checkpoint, Progress, _path_arg, _peak_rss_mib, _version,
                         check_output_is_not_an_input)
from .safetensors import SafetensorsWriter, header_bytes

FORMATS = qz.QUANTIZE_FORMATS
#: The metadata entry naming what was quantised, and how.
METADATA_KEY = "ltx2blas.quantized"
#: ComfyUI's name of each of its formats, as its per-layer ``comfy_quant`` marker holds it.
COMFY_NAMES = {("comfy_fp8", "F8_E4M3"): "float8_e4m3fn", ("comfy_fp8", "F8_E5M2"): "float8_e5m2",
               ("comfy_nvfp4", None): "nvfp4", ("comfy_mxfp8", None): "mxfp8",
               ("comfy_int8", None): "int8_tensorwise"}

# The owners' choices of Linears, on module names without the model's prefix.
#: Upstream LTX-2's NVFP4 allowlist (ltx_core.quantization.nvfp4.convert): twelve Linears of a
#: transformer block; not to_gate_logits (too narrow for an FP4 GEMM), the audio branch, the
#: text-side keys and values, or adaln_single.
NVFP4_SUFFIXES = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q",
                  "attn2.to_out.0", "audio_to_video_attn.to_q", "audio_to_video_attn.to_out.0",
                  "video_to_audio_attn.to_k", "video_to_audio_attn.to_v", "ff.net.0.proj",
                  "ff.net.2")
_NVFP4 = re.compile(r"^transformer_blocks\.\d+(?:\._orig_mod)?\.(?:" +
                    "|".join(map(re.escape, NVFP4_SUFFIXES)) + r")$")
#: Upstream's fp8 cast set (ltx_core.quantization.fp8_cast): inside a transformer block, the
#: attention projections and the feed-forwards (the audio ones too: the suffixes are matched
#: as written, "ff.net.2" within "audio_ff.net.2").
FP8_CAST_SUFFIXES = (".to_q", ".to_k", ".to_v", ".to_out.0", "ff.net.0.proj", "ff.net.2")
#: Upstream's blockwise set (ltx_core.quantization.blockwise): every Linear of the transformer
#: blocks but these.
BLOCKWISE_EXCLUDED = ("patchify_proj", "adaln_single", "caption_projection", "proj_out",
                      "to_gate_logits", "scale_shift_table")


#: Tensors beside a weight that say it is stored scaled or quantised already.
COMPANIONS = ("weight_scale", "weight_scale_2", "comfy_quant", "scale_weight", "input_scale")


def _in_blocks(module):
    return "transformer_blocks." in module


CHOICES = {
    "nvfp4": ("upstream LTX-2's NVFP4 allowlist (12 Linears a transformer block; not "
              "to_gate_logits, the audio branch or adaln_single)",
              lambda m: bool(_NVFP4.match(m))),
    "fp8_scaled": ("upstream LTX-2's fp8 cast set (the attention projections and feed-forwards "
                   "of every transformer block)",
                   lambda m: _in_blocks(m) and m.endswith(FP8_CAST_SUFFIXES)),
    "fp8_block": ("upstream LTX-2's blockwise set (every Linear of the transformer blocks but "
                  "to_gate_logits and the adaln tables)",
                  lambda m: _in_blocks(m) and not any(x in m for x in BLOCKWISE_EXCLUDED)),
}
#: ComfyUI documents no choice of its own for LTX-2: its formats take upstream's blockwise set.
for _fmt in ("comfy_fp8", "comfy_nvfp4", "comfy_mxfp8", "comfy_int8"):
    CHOICES[_fmt] = ("every Linear of the transformer blocks but to_gate_logits and the adaln "
                     "tables (ComfyUI states no choice for LTX-2; upstream's blockwise set)",
                     CHOICES["fp8_block"][1])


@dataclass
class QuantizeReport:
    """What ``quantize_checkpoint`` did (or, with ``dry_run``, would do)."""
    output: str
    format: str
    choice: str
    dry_run: bool = False
    tensors_total: int = 0
    quantized: list = field(default_factory=list)   # names of the weights quantised
    kept: dict = field(default_factory=dict)        # weight chosen but kept bf16 -> why
    tensors_copied: int = 0
    bytes_in: int = 0     # the input's tensor bytes
    bytes_out: int = 0    # the output file's size
    largest_error: float = 0.0   # max |w - dequantised| / max |w| over sampled rows
    largest_error_at: str = ""
    seconds: float = 0.0
    peak_rss_mib: float = 0.0

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def summary(self):
        verb = "would quantize" if self.dry_run else "quantized"
        lines = [f"{verb} {len(self.quantized)} of {self.tensors_total} tensors into "
                 f"{self.format}; {self.tensors_copied} copied"]
        lines.append(f"  layers: {self.choice}")
        saved = self.bytes_in - self.bytes_out
        size = "at most " if self.dry_run else ""
        lines.append(f"  size: {self.bytes_in / 1e9:.3f} GB in, {size}{self.bytes_out / 1e9:.3f} "
                     f"GB out ({saved / 1e9:.3f} GB saved)")
        if self.kept:
            shown = list(self.kept.items())[:5]
            lines.append(f"  kept bf16: {len(self.kept)} chosen weights the format cannot hold: "
                         + "; ".join(f"{printable(n)} ({why})" for n, why in shown)
                         + ("; ..." if len(self.kept) > 5 else ""))
        if self.quantized and not self.dry_run:
            lines.append(f"  largest error: {self.largest_error:.3g} of the weight's largest "
                         f"magnitude ({printable(self.largest_error_at)}, sampled rows)")
        if not self.dry_run:
            rate = self.bytes_in / self.seconds / 1e9 if self.seconds else 0.0
            lines.append(f"  {self.seconds:.2f} s, {rate:.2f} GB/s read; written "
                         f"{printable(self.output)}")
        return "\n".join(lines)


def _globs(values, name):
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    values = list(values)
    for v in values:
        if not isinstance(v, str) or not v:
            raise ArgumentError(f"{name} takes glob patterns of module names, got {v!r}")
    return tuple(values)


def _plan(ckpt, fmt, include, exclude, fp8_format, per_row):
    """({weight name: its quantised tensors' shapes}, {kept weight: why}) in the base's order."""
    chosen_by = CHOICES[fmt][1]
    planned, kept = {}, {}
    for name, (_, info) in ckpt.entries.items():
        module = keymatch.model_module(name)
        if module is None:
            continue
        full = name[: -len(".weight")]
        wanted = chosen_by(module) or any(fnmatch.fnmatchcase(m, g) for g in include
                                           for m in (module, full))
        if not wanted or any(fnmatch.fnmatchcase(m, g) for g in exclude for m in (module, full)):
            continue
        if len(info.shape) != 2:
            if include and any(fnmatch.fnmatchcase(m, g) for g in include for m in (module, full)):
                kept[name] = f"not 2-D ({list(info.shape)})"
            continue
        if info.dtype != "BF16":
            kept[name] = f"{info.dtype}, not bf16"
            continue
        if any(f"{full}.{s}" in ckpt.entries for s in COMPANIONS):
            kept[name] = "it has scales or a marker already"
            continue
        try:
            planned[name] = qz.quantized_shapes(fmt, *info.shape, per_row=per_row)
        except Exception as exc:  # noqa: BLE001  a ShapeError: the format cannot hold it
            kept[name] = str(exc)
            continue
        if fmt == "comfy_fp8" and fp8_format == "F8_E5M2":
            planned[name]["weight"] = ("F8_E5M2", planned[name]["weight"][1])
    return planned, kept


def _marker(fmt, fp8_format):
    """The bytes of ComfyUI's per-layer ``comfy_quant`` marker, as its own writer makes them
    (json.dumps with its default separators), or None for upstream's formats (which carry none:
    their loaders go by the tensors' dtypes and names)."""
    name = COMFY_NAMES.get((fmt, fp8_format if fmt == "comfy_fp8" else None))
    return None if name is None else np.frombuffer(json.dumps({"format": name}).encode(),
                                                   np.uint8).copy()


def _entries(ckpt, planned, marker):
    """The output's entries in order: each base tensor as it is, a quantised weight followed by
    its scales and marker."""
    out = []
    for name, (_, info) in ckpt.entries.items():
        if name not in planned:
            out.append((name, info.dtype, tuple(info.shape), info.nbytes))
            continue
        full = name[: -len(".weight")]
        for part, (dtype, shape) in planned[name].items():
            key = name if part == "weight" else f"{full}.weight_{part}"
            out.append((key, dtype, tuple(shape), _nbytes(dtype, shape)))
        if marker is not None:
            out.append((full + ".comfy_quant", "U8", (marker.size,), marker.size))
    return out


def _nbytes(dtype, shape):
    return int(np.prod(shape, dtype=np.int64)) * (4 if dtype == "F32" else 1)


def quantize_checkpoint(model, output, format, *, include=None, exclude=None,  # noqa: A002
                        fp8_format="F8_E4M3", per_row=False, threads=None, progress=None,
                        dry_run=False):
    """Quantise a bf16 checkpoint's Linear weights into ``format``, writing a new checkpoint.

    Parameters
    ----------
    model : path
        A ``.safetensors`` file, a sharded index or a diffusers model folder.
    output : path
        Written through a temporary file renamed into place; never an input.  Nothing is left
        on any error.  May be None with ``dry_run``.
    format : str
        One of ``FORMATS`` (:data:`ltx2blas.quantized.QUANTIZE_FORMATS`).
    include, exclude : glob or list of globs, optional
        Module names (with or without the model's prefix, ``.weight`` left off) added to, or
        taken from, the format owner's choice (``CHOICES``).
    fp8_format : "F8_E4M3" (default) or "F8_E5M2"
        comfy_fp8's codes.
    per_row : bool
        comfy_int8 with one scale a row.
    threads, progress, dry_run : as for :func:`ltx2blas.fuse_checkpoint`.

    Returns
    -------
    QuantizeReport
    """
    model = _path_arg(model, "model")
    output = None if dry_run and output is None else _path_arg(output, "output")
    choice(format, FORMATS, "format")
    include, exclude = _globs(include, "include"), _globs(exclude, "exclude")
    if fp8_format not in ("F8_E4M3", "F8_E5M2") or fp8_format != "F8_E4M3" and \
            format != "comfy_fp8":
        raise ArgumentError(f"fp8_format F8_E5M2 is comfy_fp8's only; got {fp8_format!r} for "
                            f"{format}")
    if per_row and format != "comfy_int8":
        raise ArgumentError(f"per_row is comfy_int8's, not {format}'s")
    threads = resolve_threads(threads)
    progress_arg(progress)
    t0 = time.perf_counter()
    with Checkpoint(model) as ckpt:
        planned, kept = _plan(ckpt, format, include, exclude, fp8_format, per_row)
        report = QuantizeReport(output=os.fspath(output) if output is not None else "",
                                format=format, choice=CHOICES[format][0] + (
                                    f"; include {', '.join(include)}" if include else "") + (
                                    f"; exclude {', '.join(exclude)}" if exclude else ""),
                                dry_run=bool(dry_run), tensors_total=len(ckpt.entries))
        report.quantized = list(planned)
        report.kept = kept
        report.tensors_copied = len(ckpt.entries) - len(planned)
        report.bytes_in = sum(info.nbytes for _, info in ckpt.entries.values())
        if not planned:
            raise ArgumentError(f"no weight of {printable(model)} is chosen for {format}"
                                + (f" ({len(kept)} chosen but kept: "
                                   f"{printable(next(iter(kept)))}: {next(iter(kept.values()))})"
                                   if kept else "") + ": nothing to quantize, nothing written")
        marker = _marker(format, fp8_format)
        entries = _entries(ckpt, planned, marker)
        # a fused base's record names the bytes of its tensors, which these are not
        metadata = {k: v for k, v in ckpt.metadata.items() if k != provenance.RECORD_KEY}
        metadata[METADATA_KEY] = json.dumps(
            {"format": format, "fp8_format": fp8_format if format == "comfy_fp8" else None,
             "per_row": bool(per_row), "layers": CHOICES[format][0], "include": list(include),
             "exclude": list(exclude), "weights": len(planned), "ltx2blas": _version()},
            separators=(",", ":"))
        header, _, data_len = header_bytes(entries, metadata)
        report.bytes_out = len(header) + data_len
        if output is not None:
            check_output_is_not_an_input(output, ckpt.paths())
        if dry_run:
            report.seconds = time.perf_counter() - t0
            return report
        _write(ckpt, output, entries, metadata, planned, marker, format, fp8_format, per_row,
               threads, progress, report, t0)
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mib = _peak_rss_mib()
    return report


#: Rows of each weight the summary's error is measured on (evenly spaced).
ERROR_ROWS = 16


def _write(ckpt, output, entries, metadata, planned, marker, fmt, fp8_format, per_row, threads,
           progress, report, t0):
    weights = list(planned)
    following = dict(zip(weights, weights[1:]))
    ahead = {}
    total_bytes = report.bytes_in
    done_bytes = 0

    # two buffers of the largest weight, taken in turns: weight k is read into one while k - 1
    # is quantised from the other (fresh memory for every weight costs its page faults, more
    # than the reading)
    largest = max(ckpt.entries[n][1].nbytes for n in weights) // 2
    buffers = [np.empty(largest, np.uint16), np.empty(largest, np.uint16)]
    slot = {name: i % 2 for i, name in enumerate(weights)}

    def read(name):
        f, info = ckpt.entries[name]
        size = info.nbytes // 2
        return f.read(name, buffers[slot[name]][:size].reshape(info.shape))

    with SafetensorsWriter(output, entries, metadata) as writer:
        for count, name in enumerate(ckpt.entries, 1):
            f, info = ckpt.entries[name]
            if name in planned:
                weight = ahead.pop(name).result() if name in ahead else read(name)
                if name in following:
                    ahead[following[name]] = _Pending(read, following[name])
                q = qz.quantize_weight(fmt, weight, threads=threads, fp8_format=fp8_format,
                                       per_row=per_row)
                error = qz.quantization_error(fmt, weight, q, ERROR_ROWS, fp8_format)
                if error > report.largest_error or not report.largest_error_at:
                    report.largest_error, report.largest_error_at = error, name
                writer.write(name, q.weight)
                writer.write(name[: -len(".weight")] + ".weight_scale", q.scale)
                if q.scale_2 is not None:
                    writer.write(name[: -len(".weight")] + ".weight_scale_2", q.scale_2)
                if marker is not None:
                    writer.write(name[: -len(".weight")] + ".comfy_quant", marker)
            else:
                writer.copy(name, f.fileno(), info.begin, info.nbytes, f.path)
            done_bytes += info.nbytes
            if progress is not None:
                progress(Progress(count, len(ckpt.entries), 0.0, 0.0,
                                  time.perf_counter() - t0, name, done_bytes, total_bytes))
        writer.commit()


class _Pending:
    """A weight read on a background thread while the one before it is quantised and
    written (a daemon: nothing waits for it after an error or a stop)."""

    def __init__(self, read, name):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(read, name), daemon=True,
                                        name="ltx2blas-reader")
        self._thread.start()

    def _run(self, read, name):
        try:
            self._value = read(name)
        except BaseException as exc:  # noqa: BLE001  raised where the caller waits
            self._error = exc

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
