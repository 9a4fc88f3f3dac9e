"""A bf16 checkpoint's Linear weights quantised into a layout of their owners (``ltx2blas
quantize``): which weights (the format's owner's choice, and the user's globs), the tensors and
markers each format's loader needs, and a streaming write.  The arithmetic is
:func:`ltx2blas.quantized.quantize_weight`'s; docs/quantize.md says what each format is.
"""
import contextlib
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
from .._validate import progress_arg
from ..errors import ArgumentError, Ltx2BlasError, ShapeError, printable
from . import keys as keymatch
from . import layouts as layoutmod
from . import provenance
from .checkpoint import (Checkpoint, Progress, _path_arg, _peak_rss_mib, _version,
                         check_output_is_not_an_input)
from .safetensors import (MAX_HEADER, SafetensorsWriter, header_bytes, page_aligned, read_into,
                          wait_in_steps)

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


#: What the output lacks for a loader of the format: an activation scale per layer
#: (``input_scale``), which calibration finds and the weights cannot give.
INPUT_SCALE_NOTE = {
    "fp8_scaled": "no input_scale written: upstream's fp8_scaled_mm loader needs one per layer "
                  "(an activation calibration); its fp8 cast loader and ltx2blas need none",
    "nvfp4": "no input_scale written: upstream's nvfp4-prequant with static activation scales "
             "needs one per layer; with dynamic ones it needs none",
}

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
    requantized: int = 0  # of the quantised, those stored quantised before (read back first)
    bytes_in: int = 0     # the input's tensor bytes
    bytes_out: int = 0    # the output file's size
    largest_error: float = 0.0   # max |w - dequantised| / max |w| over sampled rows
    largest_error_at: str = ""
    record_left_out: int = 0     # the header's size with the record, where it could not fit
    seconds: float = 0.0
    peak_rss_mib: float = 0.0

    def as_dict(self):
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def summary(self):
        verb = "would quantize" if self.dry_run else "quantized"
        lines = [f"{verb} {len(self.quantized)} of {self.tensors_total} tensors into "
                 f"{self.format}; {self.tensors_copied} copied" + (
                     f"; {self.requantized} of them stored quantised before, read back by "
                     "their owner's rule" if self.requantized else "")]
        lines.append(f"  layers: {self.choice}")
        saved = self.bytes_in - self.bytes_out
        lines.append(f"  size: {self.bytes_in / 1e9:.3f} GB in, {self.bytes_out / 1e9:.3f} GB "
                     f"out ({saved / 1e9:.3f} GB saved)")
        if self.kept:
            shown = list(self.kept.items())[:5]
            lines.append(f"  kept bf16: {len(self.kept)} chosen weights the format cannot hold: "
                         + "; ".join(f"{printable(n)} ({why})" for n, why in shown)
                         + ("; ..." if len(self.kept) > 5 else ""))
        if self.format in INPUT_SCALE_NOTE:
            lines.append(f"  {INPUT_SCALE_NOTE[self.format]}")
        if self.record_left_out:
            lines.append(f"  no provenance record written: with it the header would be "
                         f"{self.record_left_out:,} bytes, past the limit readers enforce")
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


def _matches(globs, module, full):
    return any(fnmatch.fnmatchcase(m, g) for g in globs for m in (module, full))


def _nothing():
    pass


class Quantizing:
    """One checkpoint's weights quantised into one format (``quantize_checkpoint`` and
    ``fuse_checkpoint(to=...)``): which weights (``planned``: name -> its tensors' dtypes and
    shapes; ``kept``: chosen but kept, name -> why), the output's entries, and each weight
    quantised and written.  ``entries_of``: {name: (dtype, shape)} of the input."""

    def __init__(self, entries_of, fmt, include=None, exclude=None, fp8_format="F8_E4M3",
                 per_row=False, sources=None):
        qz.check_quantize_options(fmt, fp8_format, per_row)
        self.fmt, self.fp8_format, self.per_row = fmt, fp8_format, bool(per_row)
        self.include, self.exclude = _globs(include, "include"), _globs(exclude, "exclude")
        self.marker = _marker(fmt, fp8_format)
        # weights stored quantised (source_layouts): name -> Layout, read back to bf16 by their
        # owner's rule and quantised anew; their old scales and markers are left out
        self.sources, self.dropped = {}, set()
        self.planned, self.kept = self._plan(entries_of, sources)
        self.largest_error, self.largest_error_at = 0.0, ""

    def _plan(self, entries_of, sources):
        chosen_by = CHOICES[self.fmt][1]
        planned, kept = {}, {}
        for name, (dtype, shape) in entries_of.items():
            module = keymatch.model_module(name)
            if module is None:
                continue
            full = name[: -len(".weight")]
            if not (chosen_by(module) or _matches(self.include, module, full)) or \
                    _matches(self.exclude, module, full):
                continue
            if len(shape) != 2:
                if _matches(self.include, module, full):
                    kept[name] = f"not 2-D ({list(shape)})"
                continue
            stored = dtype != "BF16" or any(f"{full}.{c}" in entries_of for c in COMPANIONS)
            if stored:
                source = (sources or {}).get(name)
                if source is None:
                    kept[name] = (f"{dtype}, not bf16" if dtype != "BF16" else
                                  "it has scales or a marker already")
                    continue
                if isinstance(source, Exception):
                    kept[name] = str(source)
                    continue
                if source.kind not in qz.DEQUANTIZED:
                    kept[name] = f"stored as {source.kind}, which is not read back"
                    continue
                shape = source.shape
            try:
                planned[name] = qz.quantized_shapes(self.fmt, *shape, per_row=self.per_row)
            except ShapeError as exc:  # the format cannot hold it
                kept[name] = str(exc)
                continue
            if self.fp8_format == "F8_E5M2":
                planned[name]["weight"] = ("F8_E5M2", planned[name]["weight"][1])
            if stored:
                self.sources[name] = source
                self.dropped.update(n for n in (*source.rewritten, full + ".comfy_quant")
                                    if n in entries_of)
        return planned, kept

    def dequantize(self, ckpt, name, threads):
        """The stored weight ``name`` of checkpoint ``ckpt`` read back into bf16 by its owner's
        rule (a weight of ``sources``)."""
        source = self.sources[name]
        read = lambda n: ckpt.entries[n][0].read(n)  # noqa: E731
        return qz.dequantize_bf16(
            source.kind, read(name), scale=read(source.scale) if source.scale else None,
            scale_2=read(source.scale_2) if source.scale_2 else None,
            fmt=source.fmt if source.fmt in ("F8_E4M3", "F8_E5M2") else None, threads=threads)

    def metadata(self, base):
        """The base's metadata for the output: ComfyUI's _quantization_metadata without the
        layers quantised anew (its reader would mark them with their old format)."""
        metadata = dict(base)
        raw = metadata.get("_quantization_metadata")
        if raw is None or not self.sources:
            return metadata
        try:
            data = json.loads(raw)
            layers = data["layers"]
        except (ValueError, TypeError, KeyError):
            return metadata  # not read by the plan either: left as it is
        modules = {n[: -len(".weight")] for n in self.sources}
        for layer in list(layers):
            if layer in modules or any(layer == m.split(".", 2)[-1] or
                                       m.endswith("." + layer) for m in modules):
                del layers[layer]
        metadata["_quantization_metadata"] = json.dumps(data)
        return metadata

    @property
    def choice_text(self):
        return CHOICES[self.fmt][0] + (f"; include {', '.join(self.include)}"
                                       if self.include else "") + (
            f"; exclude {', '.join(self.exclude)}" if self.exclude else "")

    def record(self):
        """What a provenance record keeps of it (provenance.QUANTIZE_KEYS)."""
        return {"format": self.fmt,
                "fp8_format": self.fp8_format if self.fmt == "comfy_fp8" else None,
                "per_row": self.per_row, "include": list(self.include),
                "exclude": list(self.exclude)}

    def metadata_value(self):
        return json.dumps({**self.record(), "layers": CHOICES[self.fmt][0],
                           "weights": len(self.planned), "ltx2blas": _version()},
                          separators=(",", ":"))

    def parts(self, name):
        """The output's names of weight ``name``: the codes, the scales, the marker."""
        full = name[: -len(".weight")]
        out = [name if part == "weight" else f"{full}.weight_{part}"
               for part in self.planned[name]]
        return out + ([full + ".comfy_quant"] if self.marker is not None else [])

    def entries(self, order, entry_of):
        """The output's (name, dtype, shape, nbytes) for the input's names in ``order``, each
        quantised weight followed by its scales and marker; ``entry_of(name)`` gives the
        others' entry."""
        out = []
        for name in order:
            if name in self.dropped:
                continue
            if name not in self.planned:
                out.append(entry_of(name))
                continue
            full = name[: -len(".weight")]
            for part, (dtype, shape) in self.planned[name].items():
                key = name if part == "weight" else f"{full}.weight_{part}"
                out.append((key, dtype, tuple(shape), _nbytes(dtype, shape)))
            if self.marker is not None:
                out.append((full + ".comfy_quant", "U8", (self.marker.size,), self.marker.size))
        return out

    def write(self, writer, name, weight, threads, maxima=None, out=None, release=_nothing):
        """Quantise bf16 ``weight`` (the tensor ``name``; ``maxima``: its weight_maxima, where
        the caller took them) and write its parts; returns their bytes.  The codes go over the
        weight's own memory, which is consumed: from ``out`` (quantize_weight's, starting at the
        weight's first byte or before it: as far into a page as the codes will be in the file,
        for the writer to take their whole pages from there), else from its first byte.
        ``release()`` is called once the writer is done with that memory."""
        keys = self.parts(name)
        if out is None:
            out = weight.reshape(-1).view(np.uint8)
        if out.size < _nbytes(*self.planned[name]["weight"]):
            out = None  # padded to more codes than the weight has bytes: memory of their own
        sampled = qz.error_rows(weight, ERROR_ROWS)
        try:
            q = qz.quantize_weight(self.fmt, weight, threads=threads, fp8_format=self.fp8_format,
                                   per_row=self.per_row, maxima=maxima, out=out)
        except BaseException:
            release()
            raise
        error = qz.quantization_error(self.fmt, weight, q, ERROR_ROWS, self.fp8_format, sampled)
        if error > self.largest_error or not self.largest_error_at:
            self.largest_error, self.largest_error_at = error, name
        arrays = [q.weight, q.scale] + ([q.scale_2] if q.scale_2 is not None else []) + (
            [self.marker] if self.marker is not None else [])
        writer.write(keys[0], q.weight, release=release)
        for key, array in zip(keys[1:], arrays[1:]):
            writer.write(key, array)
        return sum(a.nbytes for a in arrays)


def source_layouts(ckpt, entries_of):
    """{weight: its Layout, or the error that says why it is not read} of every 2-D weight of
    ``ckpt`` stored otherwise than plain bf16 (scaled, quantised, an fp8 cast)."""
    configs, marker = layoutmod.comfy_configs(ckpt.metadata, entries_of,
                                              lambda n: ckpt.entries[n][0].read(n))
    out = {}
    for name, (dtype, shape) in entries_of.items():
        if not name.endswith(".weight") or len(shape) != 2:
            continue
        module = name[: -len(".weight")]
        if dtype in ("BF16", "F16", "F32", "F64") and not any(
                module + c in entries_of for c in layoutmod.COMPANIONS):
            continue  # a plain float weight: bf16 is quantised, the others kept and named
        try:
            out[name] = layoutmod.detect(name, entries_of, configs, marker)
        except Ltx2BlasError as exc:
            out[name] = exc
    return out


def _marker(fmt, fp8_format):
    """The bytes of ComfyUI's per-layer ``comfy_quant`` marker, as its own writer makes them
    (json.dumps with its default separators), or None for upstream's formats (which carry none:
    their loaders go by the tensors' dtypes and names)."""
    name = COMFY_NAMES.get((fmt, fp8_format if fmt == "comfy_fp8" else None))
    return None if name is None else np.frombuffer(json.dumps({"format": name}).encode(),
                                                   np.uint8).copy()


def _nbytes(dtype, shape):
    return int(np.prod(shape, dtype=np.int64)) * (4 if dtype == "F32" else 1)


def quantize_checkpoint(model, output, format, *, include=None, exclude=None,  # noqa: A002
                        fp8_format="F8_E4M3", per_row=False, threads=None, progress=None,
                        dry_run=False, digests=True):
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
    digests : bool
        Record the BLAKE3 of every tensor written and how the file was made
        (``ltx2blas.provenance``, with its ``quantize`` entry), so that
        :func:`ltx2blas.verify_checkpoint` checks the file alone and rebuilds it from the base
        (default True).

    Returns
    -------
    QuantizeReport
    """
    model = _path_arg(model, "model")
    output = None if dry_run and output is None else _path_arg(output, "output")
    threads = resolve_threads(threads)
    progress_arg(progress)
    t0 = time.perf_counter()
    with Checkpoint(model) as ckpt:
        entries_of = {n: (info.dtype, tuple(info.shape)) for n, (_, info) in ckpt.entries.items()}
        quant = Quantizing(entries_of, format, include, exclude, fp8_format, per_row,
                           source_layouts(ckpt, entries_of))
        report = QuantizeReport(output=os.fspath(output) if output is not None else "",
                                format=format, choice=quant.choice_text, dry_run=bool(dry_run),
                                tensors_total=len(ckpt.entries))
        report.quantized, report.kept = list(quant.planned), quant.kept
        report.tensors_copied = len(ckpt.entries) - len(quant.planned) - len(quant.dropped)
        report.requantized = len(quant.sources)
        report.bytes_in = sum(info.nbytes for _, info in ckpt.entries.values())
        if not quant.planned:
            kept = quant.kept
            raise ArgumentError(f"no weight of {printable(model)} is chosen for {format}"
                                + (f" ({len(kept)} chosen but kept: "
                                   f"{printable(next(iter(kept)))}: {next(iter(kept.values()))})"
                                   if kept else "") + ": nothing to quantize, nothing written")
        entries = quant.entries(list(ckpt.entries), lambda n: (
            n, ckpt.entries[n][1].dtype, tuple(ckpt.entries[n][1].shape),
            ckpt.entries[n][1].nbytes))
        names = [e[0] for e in entries]
        computed = {p for name in quant.planned for p in quant.parts(name)}
        # a fused base's record names the bytes of its tensors, which these are not
        metadata = {k: v for k, v in quant.metadata(ckpt.metadata).items()
                    if k != provenance.RECORD_KEY}
        metadata[METADATA_KEY] = quant.metadata_value()

        def record(output_digests):
            return json.dumps(provenance.make_record(
                _version(), DEFAULT_OPTIONS, os.path.basename(ckpt.path), computed, [],
                {n: output_digests.get(n, provenance.PLACEHOLDER) for n in names},
                quantize=quant.record()), separators=(",", ":"))

        if digests:
            with_record = dict(metadata, **{provenance.RECORD_KEY: record({})})
            size = len(header_bytes(entries, with_record)[0]) - 8
            if size <= MAX_HEADER:
                metadata = with_record
            else:  # as a fuse does: the record never stops a file that fits without it
                report.record_left_out = size
                digests = False
        header, _, data_len = header_bytes(entries, metadata)
        report.bytes_out = len(header) + data_len
        if output is not None:
            check_output_is_not_an_input(output, ckpt.paths())
        if dry_run:
            report.seconds = time.perf_counter() - t0
            return report
        _write(ckpt, output, entries, metadata, quant, threads, progress, report, t0,
               record if digests else None)
        report.largest_error, report.largest_error_at = (quant.largest_error,
                                                         quant.largest_error_at)
    report.seconds = time.perf_counter() - t0
    report.peak_rss_mib = _peak_rss_mib()
    return report


#: The fuse options a quantising record names (it fuses nothing: the defaults).
DEFAULT_OPTIONS = {"rule": "addmm", "alpha": "scale", "allow_unmatched": False,
                   "fp8_rounding": "nearest", "seed": 0, "fp8_overflow": "saturate"}
#: Rows of each weight the summary's error is measured on (evenly spaced).
ERROR_ROWS = 16
#: Bytes of a weight read at a time: a piece stays in the cache for its maxima to be taken.
READ_PIECE = 1 << 20


def _write(ckpt, output, entries, metadata, quant, threads, progress, report, t0, record):
    # the bf16 weights are read ahead; a stored quantised one is read back when its turn comes
    weights = [n for n in quant.planned if n not in quant.sources]
    following = dict(zip(weights, weights[1:]))
    ahead = {}
    total_bytes = report.bytes_in
    done_bytes = 0

    # two buffers of the largest weight, taken in turns: weight k is read into one while k - 1
    # is quantised in the other, its codes over its own bf16 (fresh memory for every weight
    # costs its page faults, more than the reading); a buffer is read into again once the
    # writer is done with the codes it holds
    largest = max((ckpt.entries[n][1].nbytes for n in weights), default=0)
    buffers = [(page_aligned(largest + 2 * SafetensorsWriter.ALIGN), threading.Event())
               for _ in range(2)]
    for _, free in buffers:
        free.set()
    slot = {name: i % 2 for i, name in enumerate(weights)}

    def read(name):
        """The bf16 weight ``name``, its weight_maxima, and where its codes go: each piece's
        maxima taken as soon as it is read, while it is still in the cache, so that
        quantising needs no pass of its own to find them.  The codes start as far into a page
        as they will into the file (the writer takes their whole pages from there), the
        weight on the even byte at or after them."""
        f, info = ckpt.entries[name]
        rows, cols = info.shape
        memory, free = buffers[slot[name]]
        wait_in_steps(free)
        free.clear()
        at = writer.file_offset(quant.parts(name)[0]) % writer.ALIGN
        start = at + at % 2
        weight = memory[start:start + info.nbytes].view(np.uint16).reshape(rows, cols)
        row_tops = np.empty(rows, np.float32)
        step = max(1, READ_PIECE // max(1, 2 * cols))
        for r0 in range(0, rows, step):
            piece = weight[r0:r0 + step]
            read_into(f.fileno(), piece, info.begin + 2 * r0 * cols, f.path)
            row_tops[r0:r0 + step] = qz.weight_maxima(piece, 1)[1]
        maxima = (np.max(row_tops) if rows else np.float32(0)), row_tops
        return weight, maxima, memory[at:], free.set

    with (provenance.Hasher(threads) if record is not None else contextlib.nullcontext()) \
            as hasher, SafetensorsWriter(output, entries, metadata, hasher=hasher) as writer:
        for count, name in enumerate(ckpt.entries, 1):
            f, info = ckpt.entries[name]
            if name in quant.dropped:
                pass  # an old scale or marker of a weight quantised anew
            elif name in quant.sources:  # read back into fresh memory: the codes go over it
                weight = quant.dequantize(ckpt, name, threads)
                quant.write(writer, name, weight, threads)
            elif name in quant.planned:
                weight, maxima, out, release = (ahead.pop(name).result() if name in ahead
                                                else read(name))
                if name in following:
                    ahead[following[name]] = _Pending(read, following[name])
                quant.write(writer, name, weight, threads, maxima, out, release)
            else:
                writer.copy(name, f.fileno(), info.begin, info.nbytes, f.path)
            done_bytes += info.nbytes
            if progress is not None:
                progress(Progress(count, len(ckpt.entries), 0.0, 0.0,
                                  time.perf_counter() - t0, name, done_bytes, total_bytes))
        if record is not None:
            writer.set_metadata(dict(metadata, **{provenance.RECORD_KEY: record(
                writer.digests())}))
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
