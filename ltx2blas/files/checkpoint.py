"""Fusing adapter files into checkpoints, tensor by tensor.

A checkpoint is never loaded whole: each weight an adapter touches is read into a buffer,
fused in place by :func:`ltx2blas.fuse_loras`, written, and the buffer reused; every other
tensor is copied byte for byte, file to file.  Peak memory is about twice the largest fused
tensor with its adapter factors (the reader's two buffers), whatever the checkpoint's size.
"""
import collections.abc
import contextlib
import dataclasses
import functools
import json
import os
import resource
import threading
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from ..errors import (
    AlreadyFusedError,
    ArgumentError,
    ArgumentTypeError,
    DTypeError,
    FormatError,
    LayoutError,
    Ltx2IOError,
    NumericsError,
    counted,
    listed,
    printable,
)
from .._threads import resolve_threads
from .._validate import (FP8, FP8_OVERFLOWS, RULES, choice, fp8_rounding_rule, progress_arg,
                         round_up, strength_f32)
from ..fuse import fuse_bias, fuse_dora, fuse_loras, raise_overflows
from ..quantized import check_weight, fuse_quantized
from . import adapters as plans
from . import layouts as layoutmod
from . import provenance
from . import safetensors as _st
from .adapters import FP8View, Source, as_numpy, dtype_name
from .safetensors import (SafetensorsFile, SafetensorsWriter, open_regular, page_aligned,
                          parse_json, pread_exact)

_package = "ltx2blas"
FUSED_KEY = "ltx2blas.fused"
IN_PLACE = "<in place>"  # a state dict's fuse: the report's output
RULE_TEXT = {
    "addmm": "W' = layout(W + agg); agg = delta_1, then agg = bf16(agg + f32(s_i * (B_i @ A_i))) "
             "for each later adapter; delta = bf16(bf16(B*s) @ A), f32 textbook order",
    "sum": "W' = layout(W + bf16(delta_1 + ... + delta_n)); delta = bf16(bf16(B*s) @ A), f32 "
           "textbook order",
}


@dataclass
class FuseReport:
    """What a checkpoint or state-dict fuse did: modules fused (``fused``: model key and the
    adapters on it, in file order), tensors copied, the adapters' reports (keys used, alpha,
    what did not match), GFLOP, seconds, peak memory and the metadata written;
    :meth:`summary` as the command prints it."""
    output: str
    dry_run: bool
    modules_fused: int = 0
    tensors_copied: int = 0
    tensors_total: int = 0
    gflop: float = 0.0
    seconds: float = 0.0
    peak_rss_mib: float = 0.0
    adapters: list = field(default_factory=list)
    fused: list = field(default_factory=list)  # (model key, [adapter indices]) in file order
    fused_kinds: dict = field(default_factory=dict)  # model key -> [each adapter's kind there]
    metadata: dict = field(default_factory=dict)
    rule: str = "addmm"
    layouts: dict = field(default_factory=dict)  # layout kind -> modules fused in it
    biases_fused: int = 0
    fp8_overflow: str = "saturate"
    # plain fp8 weights with values rounded past the format's largest finite value: name ->
    # how many, in output order
    fp8_overflows: dict = field(default_factory=dict)
    # bytes of the base's tensors read and of the output's written (in place: the tensors
    # rewritten in memory, each read and written)
    bytes_read: int = 0
    bytes_written: int = 0
    # with allow_overflow, bf16 weights with results that overflowed to +-inf from finite
    # elements: name -> (how many, the first's (row, column)), in output order
    bf16_overflows: dict = field(default_factory=dict)
    # where the provenance record would have taken the output's header past the limit
    # readers enforce: the header's size with it (the output is written without a record)
    record_left_out: int = 0
    # fuse(to=...): the format the output's weights were quantised into, those quantised, and
    # those chosen but kept (name -> why)
    quantized_to: str = ""
    quantized: list = field(default_factory=list)
    quantized_kept: dict = field(default_factory=dict)

    @property
    def gflops(self):
        return self.gflop / self.seconds if self.seconds > 0 else 0.0

    @property
    def gbs(self):
        """GB read and written per second."""
        moved = self.bytes_read + self.bytes_written
        return moved / 1e9 / self.seconds if self.seconds > 0 else 0.0

    @property
    def copy_bound(self):
        """Whether moving bytes was most of the work, by the work model of
        :attr:`Progress.fraction` (the summary then gives GB/s, not GFLOP/s)."""
        return Progress(0, 0, 0.0, self.gflop, 0.0, "", 0,
                        self.bytes_read + self.bytes_written).copy_bound

    def as_dict(self):
        """The report as plain data (``ltx2blas fuse --json``): every field but the output's
        metadata (the record of digests, which the output holds), each fused weight as
        {name, adapters, kinds}, and the rate by the work that dominated."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "metadata"}
        out["adapters"] = [asdict(a) for a in self.adapters]
        out["fused"] = [{"name": name, "adapters": list(adapters),
                         "kinds": list(self.fused_kinds.get(name, []))}
                        for name, adapters in self.fused]
        del out["fused_kinds"]
        out["gflop_per_s"] = self.gflops
        out["gb_per_s"] = self.gbs
        out["copy_bound"] = self.copy_bound
        return out

    def summary(self):
        """What the command prints: every name read from a file escaped (printable)."""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.layouts.items()))
        biases = f" and {_count(self.biases_fused, 'bias', 'biases')}" if self.biases_fused else ""
        several = sum(len(adapters) > 1 for _, adapters in self.fused)
        rule = (f"; {several} with several adapters, combined by the {self.rule} rule"
                if several else "")
        lines = [("would fuse" if self.dry_run else "fused") +
                 f" {_count(self.modules_fused, 'module')}{biases} ({kinds or 'none'}{rule}), " +
                 ("would copy" if self.dry_run else "copied") +
                 f" {_count(self.tensors_copied, 'other tensor')} ({self.tensors_total} in "
                 f"all); {format_gflop(self.gflop)} GFLOP"]
        if not self.dry_run:
            # a rate of the work that dominated: GB/s where copying did
            rate = (f"{self.gbs:,.2f} GB/s read and written" if self.copy_bound else
                    f"{self.gflops:.1f} GFLOP/s")
            lines.append(f"{self.seconds:.1f} s, {rate}, peak memory "
                         f"{self.peak_rss_mib:.0f} MiB -> {printable(self.output)}")
        if self.fp8_overflows:
            first, count = next(iter(self.fp8_overflows.items()))
            made = FP8_OVERFLOWS[self.fp8_overflow]
            lines.append(f"{sum(self.fp8_overflows.values())} fp8 values in "
                         f"{_count(len(self.fp8_overflows), 'weight')} rounded past their "
                         f"format's largest finite value (e.g. {count} in {printable(first)}): "
                         f"F8_E4M3 stores them as {made} (fp8_overflow={self.fp8_overflow!r}), "
                         "F8_E5M2 as +-inf")
        if self.bf16_overflows:
            first, (count, at) = next(iter(self.bf16_overflows.items()))
            total = sum(n for n, _ in self.bf16_overflows.values())
            lines.append(f"{total} bf16 values in {_count(len(self.bf16_overflows), 'weight')} "
                         f"overflowed to +-inf from finite weight elements (e.g. {count} in "
                         f"{printable(first)}, first at {at}), stored as +-inf "
                         "(allow_overflow=True)")
        if self.quantized_to:
            lines.append(f"{'would quantize' if self.dry_run else 'quantized'} "
                         f"{_count(len(self.quantized), 'weight')} into {self.quantized_to}"
                         + (f"; {_count(len(self.quantized_kept), 'chosen weight')} kept bf16 "
                            f"(first: {printable(next(iter(self.quantized_kept)))}: "
                            f"{next(iter(self.quantized_kept.values()))})"
                            if self.quantized_kept else ""))
            from .quantize import INPUT_SCALE_NOTE

            if self.quantized_to in INPUT_SCALE_NOTE:
                lines.append(INPUT_SCALE_NOTE[self.quantized_to])
        if self.record_left_out:
            lines.append(f"no provenance record written: with it the output's header would be "
                         f"{self.record_left_out:,} bytes, past the {_st.MAX_HEADER:,}-byte limit "
                         "readers enforce; the file is as --no-digests writes it (verify "
                         "rebuilds it from its inputs)")
        in_file = self.output != IN_PLACE
        for i, a in enumerate(self.adapters):
            lines.append(_adapter_line(i, a, in_file))
        return "\n".join(lines)


#: The adapter kinds as the summary names them (LyCORIS' spelling of its own).
KIND_NAMES = {"lora": "LoRA", "dora": "DoRA", "diff": "diff", "loha": "LoHa", "lokr": "LoKr"}


def _adapter_line(i, a, in_file=True):
    kinds = ", ".join(f"{n} {KIND_NAMES.get(k, k)}" for k, n in sorted(a.kinds.items()))
    text = (f"adapter {i}: {printable(a.path)} x {a.strength:g}: "
            f"{_count(a.pairs_used, 'module')} ({kinds or 'none'}; "
            f"{_count(a.keys_used, 'key')}) used")
    if a.repeat_of is not None:
        text += (f"; {a.repeat_how} as adapter {a.repeat_of}, so its change is added again "
                 "(given twice)")
    if a.alpha_scaled:
        if a.alpha_rslora == a.alpha_scaled:
            how = "alpha / sqrt(rank) (rsLoRA)"
        elif a.alpha_rslora:
            how = f"alpha / rank ({a.alpha_rslora} of them by alpha / sqrt(rank), rsLoRA)"
        else:
            how = "alpha / rank"
        text += f"; {a.alpha_scaled} scaled by {how} from {a.alpha_source or 'the file'}"
    if a.alpha_ignored:
        text += "; " + _alpha_ignored_text(a)
    if a.metadata_ignored:
        text += (f"; its lora_adapter_metadata's {', '.join(map(printable, a.metadata_ignored))} "
                 "fields not read (diffusers reads them for that component alone)")
    if a.unmatched_modules:
        first = a.unmatched_modules[0]
        where = a.unmatched_components.get(first)
        n = len(a.unmatched_modules)
        text += (f"; {n} {'module matches' if n == 1 else 'modules match'} no weight and "
                 f"{'was' if n == 1 else 'were'} not fused (e.g. {printable(first)}"
                 f"{f' ({where})' if where else ''})")
    if a.extra_tensors:
        text += (f"; {_count(len(a.extra_tensors), 'tensor')} of modules the model does not "
                 f"have were not fused ({_modules_text(a.extra_tensors)})")
    if a.unused_keys:
        text += (f"; {_count(len(a.unused_keys), 'key')} of no known role (e.g. "
                 f"{printable(a.unused_keys[0])})")
    if a.rounded_to_bf16:
        text += f"; {_count(len(a.rounded_to_bf16), 'tensor')} rounded from F32/F16 to bf16"
    if a.settings:
        settings = ", ".join(f"{printable(k)}={printable(v)}" for k, v in a.settings.items())
        text += f"; its run-time settings ({settings}) are not in the weights: " + (
            "the output's metadata keeps them under this adapter in ltx2blas.fused, for the "
            "loader to read there" if in_file else
            f"the loader must apply them itself (report.adapters[{i}].settings)")
    return text


_count = counted   # the short name the summaries here and verify's use
_listed = listed


def _alpha_ignored_text(a):
    """How many of an adapter's modules keep their alpha unapplied, why, and the alphas the
    file gives them: "alpha not applied to 8 modules (alpha='ignore'; the file's alpha is 16)"."""
    whys = a.alpha_ignored_why or {"alpha='ignore'" if a.alpha_mode == "ignore" else "": 0}
    why = "; ".join(w if len(whys) == 1 else f"{n}: {w}" for w, n in whys.items() if w)
    values = sorted(a.alpha_ignored_values)
    if values:
        why += ("; " if why else "") + (
            f"the file's alpha is {values[0]:g}" if len(values) == 1 else
            f"the file's alphas are {_listed(f'{v:g}' for v in values)}")
    return f"alpha not applied to {_count(a.alpha_ignored, 'module')}" + (
        f" ({why})" if why else "")


def format_gflop(value):
    """GFLOP as a reader wants them: a small fuse's keep their first digits instead of 0.0."""
    return f"{value:,.1f}" if value >= 1 or value == 0 else f"{value:.2g}"


def _modules_text(keys, shown=3):
    """The modules that ``keys`` belong to, each named once: a module inside one already named
    is left out (reference_slot_embedding.net.0 under reference_slot_embedding).  Linear in
    the keys: each module's enclosing modules are looked up, not compared with every other."""
    named, kept = set(), []
    for module in sorted({plans.module_of_tensor(k) for k in keys}, key=lambda m: (len(m), m)):
        parts = module.split(".")
        if not any(".".join(parts[:i]) in named for i in range(1, len(parts))):
            named.add(module)
            kept.append(module)
            if len(kept) > shown:
                break
    return ", ".join(map(printable, kept[:shown])) + (", ..." if len(kept) > shown else "")


#: The work model of :attr:`Progress.fraction`: bytes moved and arithmetic, each converted to
#: seconds at a fixed nominal rate.  A fuse or an extract moves bytes at a few GB/s and computes
#: at a hundred GFLOP/s or more, so that a copied tensor counts by its size and a fused one by
#: its size and its arithmetic, whichever dominates.
NOMINAL_BYTES_PER_S = 1e9
NOMINAL_GFLOP_PER_S = 100.0


@dataclass
class Progress:
    """What a progress callback is told after each tensor: tensors, GFLOP and bytes (read and
    written) done of the step's total, the seconds since it began and the tensor's name."""
    tensors_done: int
    tensors_total: int
    gflop_done: float
    gflop_total: float
    elapsed: float
    name: str
    bytes_done: int = 0
    bytes_total: int = 0

    @staticmethod
    def work(nbytes, gflop):
        """Nominal seconds of ``nbytes`` moved and ``gflop`` computed (the work model)."""
        return nbytes / NOMINAL_BYTES_PER_S + gflop / NOMINAL_GFLOP_PER_S

    @property
    def fraction(self):
        """The share of the step's work done, in [0, 1], 1.0 exactly at its last tensor: bytes
        read and written plus arithmetic, each at its nominal rate (:meth:`work`), so that a
        fuse copying most of a checkpoint's bytes is not done when its last weight is fused;
        of the tensors where neither is counted."""
        if self.tensors_total > 0 and self.tensors_done >= self.tensors_total:
            return 1.0
        total = self.work(self.bytes_total, self.gflop_total)
        if total > 0:
            return min(1.0, self.work(self.bytes_done, self.gflop_done) / total)
        return self.tensors_done / max(1, self.tensors_total)

    @property
    def copy_bound(self):
        """Whether moving bytes is most of the step's work (its rate is then told in GB/s, in
        GFLOP/s otherwise)."""
        return self.bytes_total > 0 and (self.bytes_total / NOMINAL_BYTES_PER_S
                                         >= self.gflop_total / NOMINAL_GFLOP_PER_S)


class Checkpoint:
    """One safetensors file, or the shards of a ``*.safetensors.index.json``, as a single map
    of tensor name -> (file, TensorInfo), in file order."""

    #: a diffusers model folder's weights: sharded (the index) or one file
    DIFFUSERS_FILES = ("diffusion_pytorch_model.safetensors.index.json",
                       "diffusion_pytorch_model.safetensors")

    def __init__(self, path):
        self.path = os.fspath(path)
        self.files = []
        self.entries = {}
        if os.path.isdir(self.path):
            found = [os.path.join(self.path, n) for n in self.DIFFUSERS_FILES
                     if os.path.isfile(os.path.join(self.path, n))]
            if not found:
                raise ArgumentError(f"model {self.path} is a folder without "
                                    f"{' or '.join(self.DIFFUSERS_FILES)}")
            self.path = found[0]
        try:
            if self.path.endswith(".json"):
                self._open_index()
            else:
                f = SafetensorsFile(self.path)
                self.files.append(f)
                self.metadata = dict(f.metadata)
                for name, info in f.tensors.items():
                    self.entries[name] = (f, info)
        except BaseException:
            self.close()
            raise

    def _open_index(self):
        fd = open_regular(self.path, "checkpoint index")
        try:
            size = os.fstat(fd).st_size
            if size > 100_000_000:
                raise FormatError(f"{self.path}: index of {size} bytes is implausibly large")
            raw = pread_exact(fd, size, 0, self.path)
        finally:
            os.close(fd)
        def fail(message):
            raise FormatError(f"{self.path}: {message}")

        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FormatError(f"{self.path}: the index is not UTF-8 ({exc.reason})") from None
        index = parse_json(text, fail, "the index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise FormatError(f"{self.path}: 'weight_map' must map tensor names to shard files")
        meta = index.get("metadata", {})
        self.metadata = {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}
        folder = os.path.dirname(os.path.abspath(self.path))
        shards = {}
        for shard in dict.fromkeys(weight_map.values()):
            if os.path.basename(shard) != shard:
                raise FormatError(f"{self.path}: shard name {shard!r} is not a plain file name")
            shard_path = os.path.join(folder, shard)
            if not os.path.exists(shard_path):
                raise Ltx2IOError(2, f"{self.path}: shard {shard} is missing ({shard_path})")
            shards[shard] = SafetensorsFile(shard_path)
            self.files.append(shards[shard])
        for shard, f in shards.items():
            for name, info in f.tensors.items():
                if name in self.entries:
                    raise FormatError(f"{self.path}: tensor {name!r} is in two shards "
                                      f"({os.path.basename(self.entries[name][0].path)} and {shard})")
                if weight_map.get(name) != shard:
                    raise FormatError(f"{self.path}: tensor {name!r} is in shard {shard} but the "
                                      f"index puts it in {weight_map.get(name)!r}")
                self.entries[name] = (f, info)
        missing = [n for n in weight_map if n not in self.entries]
        if missing:
            raise FormatError(f"{self.path}: {len(missing)} tensors in the index are in no shard "
                              f"(e.g. {missing[0]!r})")

    def paths(self):
        return [self.path] + [f.path for f in self.files]

    def close(self):
        for f in self.files:
            f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _hash_all(sources, out, tensors=True):
    """Each adapter file's (SHA-256, {tensor: BLAKE3}; with ``tensors`` False, {}), or the
    exception that stopped it."""
    for i, source in enumerate(sources):
        try:
            out[i] = provenance.file_digests(source.file, tensors=tensors)
        except BaseException as exc:  # reported by the caller
            out[i] = exc


def read_history(metadata):
    """(the fuses a file's metadata records, a list of objects, or None; why there is none:
    "" for a list, "missing" or why the entry is not read), parsed within the bounds of
    provenance.load_json: the metadata is the file's to choose."""
    text = metadata.get(FUSED_KEY)
    if text is None:
        return None, "missing"
    try:
        history = provenance.load_json(text, "the entry")
    except provenance.MetadataJSONError as exc:
        return None, str(exc)
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        return None, "the entry is not a list of objects"
    return history, ""


#: How many earlier fuses' adapters a refusal names.
FUSES_NAMED = 4


def _already_fused_text(metadata):
    """What a checkpoint's history of fuses says, as a sentence: the adapters each fuse
    fused, by file and strength, or why the history cannot be read (never its raw text)."""
    history, why = read_history(metadata)
    if history is None:
        return (f"its metadata says adapters are already fused into it (its {FUSED_KEY} entry "
                f"cannot be read: {why})")
    if not history:
        return f"its metadata marks it as already fused (an empty {FUSED_KEY} history)"
    named = []
    for entry in history[:FUSES_NAMED]:
        name, strength = entry.get("file"), entry.get("strength")
        text = (printable(name if len(name) <= 100 else name[:100] + "...")
                if isinstance(name, str) else "an adapter of no recorded name")
        if isinstance(strength, (int, float)) and not isinstance(strength, bool):
            text += f" at strength {strength:g}"
        named.append(text)
    if len(history) > FUSES_NAMED:
        named.append(f"{len(history) - FUSES_NAMED} more")
    return (f"its metadata says ltx2blas already fused {_count(len(history), 'adapter')} into "
            f"it ({_listed(named)})")


def _fused_history(base, path):
    """The fuses an input's metadata records (a list, [] for none); FormatError naming ``path``
    for an entry that is not such a list: appending to it would write a history that is
    not the file's."""
    history, why = read_history(base)
    if history is None and why != "missing":
        raise FormatError(f"{path}: its {FUSED_KEY} entry is not a history of fuses this "
                          f"ltx2blas reads ({why})")
    return history or []


#: How many of an adapter's tensors left out of the fuse its record names (it counts them all).
NOT_FUSED_NAMED = 20
#: What the metadata says of each fp8 overflow rule.
FP8_OVERFLOW_TEXT = {
    "saturate": "an F8_E4M3 value rounded past 448 is stored as +-448, as torch casts from 2.13",
    "nan": "an F8_E4M3 value rounded past 448 is stored as NaN, as torch casts up to 2.12",
}


def _fused_metadata(base, reports, dtypes, plan, options, layout_counts, path):
    """The input's metadata, with this fuse appended to the history of fuses it records, and
    without its provenance record: that names another file's tensors, and this fuse writes
    its own or none (digests=False)."""
    metadata = {k: v for k, v in base.items() if k != provenance.RECORD_KEY}
    metadata[FUSED_KEY] = json.dumps(_fused_history(base, path) + [
        {"file": os.path.basename(r.path), "sha256": r.sha256, "strength": r.strength,
         "pairs": r.pairs_used, "alpha": r.alpha_mode, "alpha_scaled": r.alpha_scaled,
         **({"alpha_source": r.alpha_source} if r.alpha_source else {}),
         **({"not_fused": r.extra_tensors[:NOT_FUSED_NAMED],
             "not_fused_count": len(r.extra_tensors)} if r.extra_tensors else {}),
         **({"settings": r.settings} if r.settings else {}),
         "rule": options.rule} for r in reports])
    metadata["ltx2blas.version"] = _version()
    metadata["ltx2blas.rule"] = f"{options.rule}: {RULE_TEXT[options.rule]}"
    metadata["ltx2blas.layouts"] = json.dumps(dict(sorted(layout_counts.items())))
    if any(dtypes[n] in ("F8_E4M3", "F8_E5M2") for n in plan):
        metadata["ltx2blas.fp8_rounding"] = options.fp8_rounding + (
            f" (seed {options.seed})" if options.fp8_rounding == "stochastic" else "")
        metadata["ltx2blas.fp8_overflow"] = (
            f"{options.fp8_overflow}: {FP8_OVERFLOW_TEXT[options.fp8_overflow]}")
    return metadata


class _Prefetcher:
    """Reads the fused weights in order, ahead of the caller, each with its adapter factors, so
    that reading overlaps the fuse of the weight before and the write of the one before that.

    A weight and its factors go into one of two reused bins, each the size of the largest such
    set (``load(name, space)`` reads the factors into the ``space`` after the weight, of
    ``factor_bytes(name)`` bytes, and returns them).  A bin takes weights one after another
    while they fit and is reused once every weight in it is written: small weights are so read
    ahead while a large one is still being written (one weight per buffer leaves the fuse
    waiting for a read after each large write), and nothing is read into fresh memory (whose
    page faults cost more than the reading).
    Each weight is placed ``shift(name)`` bytes past a page boundary (its offset within a page
    of the output file), so that the writer can write it to the output without copying it."""

    def __init__(self, ckpt, names, load, factor_bytes, shift=lambda name: 0, page=4096):
        self.ckpt, self.names, self.load = ckpt, names, load
        self.layouts = [self._layout(n, factor_bytes, shift, page) for n in names]
        self.size = max((span for _, _, _, span in self.layouts), default=0)
        self.bins = [page_aligned(self.size, page), page_aligned(self.size, page)]
        self.fill, self.live, self.open = [0, 0], [0, 0], 0
        self.ready = {}
        self.error = None
        self.cv = threading.Condition()
        self.stop = False
        self.thread = threading.Thread(target=self._run, name="ltx2blas-reader", daemon=True)
        self.thread.start()

    def _layout(self, name, factor_bytes, shift, page):
        """(the weight's shift; its bytes in a bin: the shift, its data, up to the next page;
        factor bytes; the whole span, up to the next page: where the next weight may start)."""
        start = shift(name)
        weight = round_up(start + self.ckpt.entries[name][1].nbytes, page)
        factors = factor_bytes(name)
        return start, weight, factors, round_up(weight + factors, page)

    def _place(self, span):
        """(bin, offset) for ``span`` bytes: after the weights in the open bin if they fit,
        else at the start of the other bin once it is empty; None while there is no room."""
        b = self.open
        if self.live[b] and self.fill[b] + span > self.size:
            b = 1 - b
            if self.live[b]:
                return None
        if not self.live[b]:
            self.fill[b] = 0
        self.open, at = b, self.fill[b]
        self.fill[b] += span
        self.live[b] += 1
        return b, at

    def _run(self):
        for name, (shift, weight_bytes, factor_bytes, span) in zip(self.names, self.layouts):
            with self.cv:
                while not self.stop and (place := self._place(span)) is None:
                    self.cv.wait()
                if self.stop:
                    return
            f, info = self.ckpt.entries[name]
            b, at = place
            start = at + shift
            array = self.bins[b][start:start + info.nbytes].view(
                {"BF16": np.uint16, "I8": np.int8}.get(info.dtype, np.uint8)).reshape(info.shape)
            try:
                f.read(name, array)
                space = at + weight_bytes
                factors = self.load(name, self.bins[b][space:space + factor_bytes])
            except BaseException as exc:
                with self.cv:
                    self.error = exc
                    self.cv.notify_all()
                return
            with self.cv:
                self.ready[name] = (array, factors)
                self.cv.notify_all()

    def take(self, name):
        """(weight, factors) of ``name``, the next in order, once read."""
        with self.cv:
            while name not in self.ready and self.error is None:
                self.cv.wait()
            if name not in self.ready:
                raise self.error
            return self.ready.pop(name)

    def release(self, array):
        """The weight ``array`` is written: its place may be reused."""
        with self.cv:
            for b, buf in enumerate(self.bins):
                if np.shares_memory(buf, array):
                    self.live[b] -= 1
            self.cv.notify_all()

    def close(self, wait=True):
        """Stop reading ahead.  ``wait`` False (on the way out of an error or a stop) waits
        only briefly: the thread may wait for ever on a lock an interrupted main thread left
        held, and it is a daemon that touches nothing the caller keeps."""
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join(None if wait else 0.25)


def _path_arg(value, what):
    """A path argument as a str: str, bytes and os.PathLike taken, anything else refused."""
    if isinstance(value, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(value))
        if not path:
            raise ArgumentError(f"{what} is an empty path")
        return path
    raise ArgumentTypeError(f"{what} must be a path (str, bytes or os.PathLike), got "
                            f"{type(value).__name__}")


def _parse_loras(loras, mappings=False):
    """[(path or mapping, strength)], each checked: a path (or, with ``mappings``, a mapping
    of adapter tensors) and a strength finite as f32, so that no bad entry is found after
    something is written."""
    if isinstance(loras, (str, bytes, os.PathLike)) or not hasattr(loras, "__iter__"):
        raise ArgumentTypeError(f"loras must be a list of (path, strength) pairs, got "
                                f"{type(loras).__name__}")
    out = []
    for i, item in enumerate(loras):
        try:
            source, strength = item
        except (TypeError, ValueError):
            raise ArgumentTypeError("loras must be a list of (path, strength) pairs") from None
        strength_f32(strength, f"loras[{i}]: strength")
        if not (mappings and isinstance(source, collections.abc.Mapping)):
            source = _path_arg(source, f"loras[{i}]: the adapter")
        out.append((source, float(strength)))
    return out


def _fuse_one(weight, loaded, layout, name, options, scales, delta, model, sources):
    """Fuse one weight's ``loaded`` adapter tensors into ``weight`` (bits, in place); for a
    quantised layout also into its ``scales`` arrays (in place), the delta held in ``delta``
    memory; a DoRA adapter by fuse_dora.  A NumericsError says the ``model`` file (or
    "<state dict>") and the weight's key, and the adapter file and key when one is at fault.
    Returns the :class:`~ltx2blas.fuse.Overflows` of a plain bf16 or fp8 weight (0 for the
    rest): a bf16 weight's refused here unless ``options.allow_overflow``."""
    try:
        return _fuse_arrays(weight, loaded, layout, name, options, scales, delta)
    except NumericsError as exc:
        raise _located(exc, model, name, loaded, sources) from None


def _located(exc, model, name, loaded=(), sources=()):
    """``exc`` again, its message led by the model file and the weight's key, and by the adapter
    file and key where the error names one of ``loaded``'s adapters."""
    place = f"{model}: {name}"
    if exc.adapter is not None and exc.adapter < len(loaded):
        item = loaded[exc.adapter].item
        place += f", adapter {sources[item.source].name}: {loaded[exc.adapter].key_of(exc.tensor)}"
    return type(exc)(f"{place}: {exc}", adapter=exc.adapter, tensor=exc.tensor)


def _dry_run_checks(read, plan, layouts, sources, check_finite, model):
    """What a dry run reads: every adapter tensor, checked as the fuse checks it as it reads
    it, and with ``check_finite`` every weight to be fused and its scales, checked as the fuse
    checks them (``read(name)`` gives a tensor).  What only the arithmetic can show -- a sum
    that overflows -- is left to the fuse, which then writes nothing."""
    for name, items in plan.weights.items():
        plans.factors(items, sources, plan.reports)
        if not check_finite:
            continue
        layout = layouts[name]
        weight, scales = read(name), [read(c) for c in layout.rewritten]
        try:
            if layout.quantized:
                check_weight(layout.kind, weight, scale=scales[0],
                             scale_2=scales[1] if len(scales) > 1 else None,
                             fmt=layout.fmt if layout.fmt in FP8 else None)
            else:  # no adapters, in place: the fuse's weight check alone, nothing written
                fuse_loras(weight, [], out=weight, check_finite=True, weight_format=layout.fmt)
        except NumericsError as exc:
            raise _located(exc, model, name) from None
    for items in plan.biases.values():
        plans.bias_terms(items, sources)


def _fuse_arrays(weight, loaded, layout, name, options, scales, delta):
    if loaded and loaded[0].item.kind == "dora":
        item, (a, b) = loaded[0].item, loaded[0].arrays
        style = "peft" if "magnitude" in item.pair.keys else "comfy"
        fuse_dora(weight, a, b, loaded[0].magnitude, scale=item.scale, strength=item.strength,
                  style=style, threads=options.threads, out=weight)
        return 0
    adapters = [ld.adapter() for ld in loaded]
    if layout.quantized:
        fuse_quantized(layout.kind, weight, adapters, scale=scales[0],
                       scale_2=scales[1] if len(scales) > 1 else None,
                       fmt=layout.fmt if layout.fmt in FP8 else None, rule=options.rule,
                       threads=options.threads, in_place=True, delta_buffer=delta)
        return 0
    plain_fp8 = layout.kind == "fp8"
    # A bf16 result that overflowed is refused unless allowed: a checkpoint's weight is the
    # fuse's own buffer, checked after the fuse by the store's count (free), whereas a state
    # dict's is the caller's, which fuse_loras leaves untouched (a dry run where it cannot
    # rule overflow out).
    refuse_after = not options.allow_overflow and options.private_weights
    _, overflows = fuse_loras(
        weight, adapters, rule=options.rule, threads=options.threads, out=weight,
        check_finite=options.check_finite, weight_format=layout.fmt,
        fp8_rounding=options.fp8_rounding if plain_fp8 else "nearest", seed=options.seed,
        name=name, fp8_overflow=options.fp8_overflow if plain_fp8 else "saturate",
        return_overflows=True, allow_overflow=options.allow_overflow or refuse_after)
    if refuse_after and not plain_fp8:
        raise_overflows(overflows, layout.fmt)
    return overflows


def _note_overflows(report, name, layout, overflows):
    """A fused weight's overflows in the report: a plain fp8 weight's count, or an allowed bf16
    one's count and first position."""
    if not overflows:
        return
    if layout.kind == "fp8":
        report.fp8_overflows[name] = int(overflows)
    else:
        report.bf16_overflows[name] = (int(overflows), overflows.first)


@dataclass(frozen=True)
class _Options:
    """What every fused weight of one call is fused with."""
    rule: str
    threads: object
    check_finite: bool
    fp8_rounding: str
    seed: int
    fp8_overflow: str
    alpha: str = "scale"
    allow_unmatched: bool = False
    digests: bool = True
    allow_overflow: bool = False
    private_weights: bool = True  # the weights fused are the writer's buffers, not the caller's


def _check_fp8_rounding(fp8_rounding, layouts):
    """Stochastic rounding is for plain fp8 weights: the layouts round by their own rules."""
    if fp8_rounding == "stochastic":
        scaled = [n for n, lay in layouts.items() if lay.quantized]
        if scaled:
            raise ArgumentError(f"stochastic rounding applies to plain fp8 weights; {scaled[0]} is "
                             f"{layouts[scaled[0]].kind}, fused by its layout's own rounding")


def _layout_counts(layouts):
    counts = {}
    for lay in layouts.values():
        name = lay.kind if lay.kind != "fp8" else f"fp8 ({lay.fmt})"
        counts[name] = counts.get(name, 0) + 1
    return counts


def _delta_buffer(layouts):
    """One reused bf16 buffer for the largest quantised weight's delta (None if there is none)."""
    sizes = [lay.shape[0] * lay.shape[1] for lay in layouts.values() if lay.quantized]
    return np.empty(max(sizes), np.uint16) if sizes else None


def _delta_view(buffer, layout):
    if buffer is None or not layout.quantized:
        return None
    return buffer[: layout.shape[0] * layout.shape[1]].reshape(layout.shape)


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def check_output_is_not_an_input(output, inputs):
    out_real = os.path.realpath(output)
    for path in inputs:
        if os.path.realpath(path) == out_real or (
                os.path.exists(output) and os.path.exists(path) and os.path.samefile(output, path)):
            raise ArgumentError(f"output {output} is an input file ({path}); write elsewhere")


def _prepare(entries, metadata, read_bytes, sources, loras, options, retry_dtype=None):
    """(Plan, {fused weight: Layout}) for a model of ``entries`` (name -> (dtype, shape));
    every weight's layout and every adapter tensor's place are settled here, before anything
    is written.  ``retry_dtype``: the fp8 format that U8 weights hold when no quantised layout
    claims them (fuse_state_dict's ``weight_format``)."""
    choice(options["rule"], RULES, "rule")
    fp8_rounding_rule(options["fp8_rounding"], options["fp8_overflow"])
    configs, marker = layoutmod.comfy_configs(metadata, entries, read_bytes)
    cache = {}

    def layout_of(key):
        if key not in cache:
            try:
                cache[key] = layoutmod.detect(key, entries, configs, marker)
            except (DTypeError, FormatError):
                if not (retry_dtype and entries[key][0] == "U8"):
                    raise
                cache[key] = layoutmod.detect(key, {**entries, key: (retry_dtype, entries[key][1])},
                                              configs, marker)
        return cache[key]

    plan = plans.make_plan(entries, layout_of, sources, [s for _, s in loras],
                           alpha=options["alpha"], allow_unmatched=options["allow_unmatched"],
                           allow_repeated=options.get("allow_repeated", True))
    layouts = {n: layout_of(n) for n in plan.weights}
    _check_fp8_rounding(options["fp8_rounding"], layouts)
    return plan, layouts


def _report(output, dry_run, plan, layouts, total, options, order, sources):
    report = FuseReport(output=output or "", dry_run=dry_run, adapters=plan.reports,
                        tensors_total=total, rule=options["rule"],
                        layouts=_layout_counts(layouts), fp8_overflow=options["fp8_overflow"])
    report.fused = [(n, [it.source for it in plan.weights[n]]) for n in order if n in plan.weights]
    report.fused_kinds = {n: [KIND_NAMES.get(it.kind, it.kind) for it in items]
                          for n, items in plan.weights.items()}
    report.modules_fused = len(report.fused)
    report.biases_fused = len(plan.biases)
    report.gflop = sum(plans.gflop(layouts[n].shape, plan.weights[n], sources)
                       for n in plan.weights)
    return report


def fuse_checkpoint(model, loras, output, *, rule="addmm", threads=None, progress=None,
                    check_finite=False, force=False, fp8_rounding="nearest", seed=0,
                    dry_run=False, alpha="scale", allow_unmatched=False,
                    fp8_overflow="saturate", digests=True, allow_repeated=True,
                    allow_overflow=False, to=None):
    """Fuse adapter files into a safetensors checkpoint, writing a new one.

    Parameters
    ----------
    model : path
        A ``.safetensors`` file, a sharded ``*.safetensors.index.json``, or a diffusers model
        folder (``diffusion_pytorch_model.safetensors`` or its sharded index); the output is one
        file either way.
    loras : list of (path, strength)
    output : path
        Written through a temporary file in its folder, fsynced and renamed into place; never an
        input path.  On any error nothing is left behind and an existing output is untouched.
        May be None with ``dry_run``.
    rule : "addmm" (default) or "sum"
        How several adapters on one weight combine (see :func:`ltx2blas.fuse_loras`).
    threads, check_finite : as for :func:`ltx2blas.fuse_lora`
    progress : callable, optional
        Called with a :class:`Progress` after each tensor.
    force : bool
        Fuse even if the checkpoint's metadata says an adapter is already fused into it.
    fp8_rounding, seed : "nearest" (default) or "stochastic" rounding into plain fp8 weights,
        the stochastic bits seeded per tensor name.
    fp8_overflow : "saturate" (default) or "nan"
        What a plain F8_E4M3 value rounded past 448 becomes: +-448, as torch casts from 2.13
        on, or NaN, as torch cast up to 2.12 (see :func:`ltx2blas.fuse_lora`); recorded in
        the output's metadata. The report counts the values that overflowed either way.
    allow_overflow : bool
        A bf16 weight whose fused value overflows to +-inf from a finite element (a finite
        weight plus a finite delta past bf16's largest value, or a product that reached inf)
        is refused by default: :class:`~ltx2blas.errors.NonFiniteResultError` naming the
        tensor, the first (row, column) and the count, and nothing is written. True stores
        them as +-inf, as upstream does, and the report counts and names them.
    dry_run : bool
        Validate and match everything, write nothing.
    alpha : "scale" (default) or "ignore"
        Scale a pair's strength by its file's alpha / rank (ComfyUI, PEFT), or not (upstream
        LTX-2, which never reads alpha).
    allow_unmatched : bool
        Fuse what matches when some adapter modules match no weight (or some keys have no known
        role), and list them in the report; by default that is an error and nothing is written.
    digests : bool
        Record in the output's metadata, beside the options, the SHA-256 of each adapter file
        and the BLAKE3 of every adapter tensor and of every tensor written
        (``ltx2blas.provenance``), so that :func:`ltx2blas.verify_checkpoint` can check the
        file and rebuild it (default True).  Where that record would take the output's header
        past the 100,000,000-byte limit readers enforce, the file is written without it and
        the report's ``record_left_out`` gives the header's size with it.
    allow_repeated : bool
        An adapter given twice (the same file, or a copy of its bytes) is fused twice, and the
        report says so (the default); False refuses it with an ArgumentError before anything
        is written, as the command does without ``--allow-repeated``.

    to : str, optional
        A format of :data:`ltx2blas.quantized.QUANTIZE_FORMATS`: the output's bf16 weights of
        that format owner's choice (docs/quantize.md) quantised as they are written, fused or
        not, in the same pass: the file ``quantize_checkpoint`` would make of the bf16 fuse,
        with no bf16 output in between.

    Weights stored in a scaled or quantised layout (:mod:`ltx2blas.files.layouts`) are fused
    by their layout's rule, their rewritten scales written right after them; bias terms of an
    adapter are added to the module's bias.

    Returns
    -------
    FuseReport
    """
    model = _path_arg(model, "model")
    output = None if dry_run and output is None else _path_arg(output, "output")
    loras = _parse_loras(loras)
    if not loras:
        raise ArgumentError("no adapters given")
    resolve_threads(threads)  # a bad count is refused before any file is opened
    progress_arg(progress)
    t0 = time.perf_counter()
    ckpt = Checkpoint(model)
    sources = []
    try:
        for path, _ in loras:
            sources.append(Source(path))
        if FUSED_KEY in ckpt.metadata and not force:
            raise AlreadyFusedError(f"{model}: {_already_fused_text(ckpt.metadata)}; pass "
                                    "force=True to fuse again")
        _fused_history(ckpt.metadata, model)  # a history that cannot be appended to: refused now
        entries_of = {n: (info.dtype, info.shape) for n, (_, info) in ckpt.entries.items()}
        opts = dict(rule=rule, alpha=alpha, allow_unmatched=allow_unmatched,
                    fp8_rounding=fp8_rounding, fp8_overflow=fp8_overflow,
                    allow_repeated=allow_repeated)
        plan, layouts = _prepare(entries_of, ckpt.metadata, lambda n: _read_tensor(ckpt, n),
                                 sources, loras, opts)
        order = layoutmod.output_order(list(ckpt.entries), layouts)
        report = _report(output, dry_run, plan, layouts, len(ckpt.entries), opts, order, sources)
        quant = None
        if to is not None:
            from .quantize import Quantizing  # the quantising layer sits on this one

            quant = Quantizing(entries_of, to)
            report.quantized_to, report.quantized = to, list(quant.planned)
            report.quantized_kept = quant.kept
        report.tensors_copied = report.tensors_total - report.modules_fused - len(plan.biases) - sum(
            len(lay.rewritten) for lay in layouts.values())
        if output is not None:
            check_output_is_not_an_input(output, ckpt.paths() + [s.name for s in sources])
        if dry_run:
            _dry_run_checks(lambda n: _read_tensor(ckpt, n), plan, layouts, sources,
                            check_finite, ckpt.path)
        else:
            options = _Options(rule, threads, check_finite, fp8_rounding, seed, fp8_overflow,
                               alpha, allow_unmatched, bool(digests),
                               allow_overflow=bool(allow_overflow))
            report.metadata = _FusedWriter(ckpt, sources, plan, layouts, options, quant).write(
                output, order, report, progress, t0)
            report.peak_rss_mib = _peak_rss_mib()
        report.seconds = time.perf_counter() - t0
        return report
    finally:
        for s in sources:
            s.close()
        ckpt.close()


class _FusedWriter:
    """The output of one checkpoint fuse, tensor by tensor in output order: fused weights (read
    ahead by a _Prefetcher), their rewritten scales right after them, fused biases, and every
    other tensor copied byte for byte."""

    def __init__(self, ckpt, sources, plan, layouts, options, quant=None):
        self.ckpt, self.sources, self.plan, self.layouts = ckpt, sources, plan, layouts
        self.options = options
        self.quant = quant  # a quantize.Quantizing (fuse_checkpoint's ``to``), or None
        self.output_names = list(ckpt.entries)
        self.delta = _delta_buffer(layouts)
        self.pending = {}  # rewritten scales, written right after their weight
        self.dtypes = {n: info.dtype for n, (_, info) in ckpt.entries.items()}

    def metadata(self, hashes, output_digests):
        """The output's metadata: ``hashes`` holds each adapter's (file digest, {tensor:
        digest}) once known (None before), ``output_digests`` each written tensor's."""
        for r, h in zip(self.plan.reports, hashes):
            r.sha256 = h[0] if h else provenance.PLACEHOLDER
        metadata = _fused_metadata(self.ckpt.metadata, self.plan.reports, self.dtypes,
                                   self.plan.weights, self.options, _layout_counts(self.layouts),
                                   self.ckpt.path)
        if self.quant is not None:
            from .quantize import METADATA_KEY

            metadata[METADATA_KEY] = self.quant.metadata_value()
        if self.options.digests:
            metadata[provenance.RECORD_KEY] = json.dumps(self._record(hashes, output_digests),
                                                         separators=(",", ":"))
        return metadata

    def _record(self, hashes, output_digests):
        options = self.options
        blank = provenance.PLACEHOLDER
        adapters = []
        for source, r, h in zip(self.sources, self.plan.reports, hashes):
            tensors = h[1] if h else dict.fromkeys(source.keys, blank)
            adapters.append((os.path.basename(r.path), r.sha256, r.strength, tensors))
        changed = [n for name in self.plan.weights for n in [name, *self.layouts[name].rewritten]]
        changed += list(self.plan.biases)
        if self.quant is not None:
            changed += [p for name in self.quant.planned for p in self.quant.parts(name)]
        if output_digests:  # the final record: every digest known, or the fuse fails
            missing = [n for n in self.output_names if n not in output_digests]
            if missing:
                raise RuntimeError(f"no digest for tensor {missing[0]!r}: the record would "
                                   "be wrong, so nothing is written")
        return provenance.make_record(
            _version(), {k: getattr(options, k) for k in provenance.OPTIONS},
            os.path.basename(self.ckpt.path), set(changed), adapters,
            {n: output_digests.get(n, blank) for n in self.output_names},
            quantize=self.quant.record() if self.quant is not None else None)

    def write(self, output, order, report, progress, t0):
        """Write and commit the output; returns its metadata."""
        ckpt, plan, sources = self.ckpt, self.plan, self.sources
        # The adapters' digests and the output's go into the header, which is written first:
        # hash in the background, write same-length placeholders, patch them in before commit.
        hashes = [None] * len(sources)
        adapter_hashing = threading.Thread(target=_hash_all, daemon=True,
                                           args=(sources, hashes, self.options.digests))
        adapter_hashing.start()
        def entry(n):
            return (n, ckpt.entries[n][1].dtype, ckpt.entries[n][1].shape,
                    ckpt.entries[n][1].nbytes)

        entries = (self.quant.entries(order, entry) if self.quant is not None else
                   [entry(n) for n in order])
        self.output_names = [e[0] for e in entries]
        done_gflop = 0.0
        # every output tensor is a base tensor of the same size, read and written once
        sizes = {n: ckpt.entries[n][1].nbytes for n in order}
        bytes_total = 2 * sum(sizes.values())
        first = self._first_metadata(entries, report)
        # hashing threads as many as the fuse's: on many cores the digests keep up
        with (provenance.Hasher(resolve_threads(self.options.threads)) if self.options.digests
              else contextlib.nullcontext()) as digests, \
                SafetensorsWriter(output, entries, first, hasher=digests) as writer:
            reader = _Prefetcher(
                ckpt, [n for n in order if n in plan.weights],
                lambda name, space: plans.factors(plan.weights[name], sources, plan.reports, space),
                lambda name: plans.factor_space(plan.weights[name], sources),
                lambda name: writer.file_offset(name) % writer.ALIGN, writer.ALIGN)
            try:
                for count, name in enumerate(order, 1):
                    done_gflop += self._write_one(name, writer, reader, report)
                    report.bytes_read += sizes[name]
                    report.bytes_written += sizes[name]
                    if progress is not None:
                        progress(Progress(count, len(order), done_gflop, report.gflop,
                                          time.perf_counter() - t0, name,
                                          report.bytes_read + report.bytes_written,
                                          bytes_total))
                adapter_hashing.join()
                for r, h in zip(plan.reports, hashes):
                    if isinstance(h, BaseException):
                        raise Ltx2IOError(5, f"hashing {r.path} failed: {h}") from h
                metadata = self.metadata(hashes, writer.digests() if digests is not None
                                         else {})
                writer.set_metadata(metadata)
                writer.commit()  # the commit point: the output is complete once this returns
            except BaseException:
                reader.close(wait=False)
                raise
            reader.close()
        return metadata

    def _first_metadata(self, entries, report):
        """The metadata written first (digests as placeholders).  Where the record would take
        the header past the limit readers enforce and the header fits without it, the fuse
        goes on without a record (as digests=False) and ``report`` says so: a record never
        stops a fuse that fits without one."""
        metadata = self.metadata([None] * len(self.sources), {})
        if not self.options.digests:
            return metadata
        size = len(_st.header_bytes(entries, metadata)[0]) - 8
        if size <= _st.MAX_HEADER:
            return metadata
        without = {k: v for k, v in metadata.items() if k != provenance.RECORD_KEY}
        if len(_st.header_bytes(entries, without)[0]) - 8 > _st.MAX_HEADER:
            return metadata  # too large either way: the writer says so
        self.options = dataclasses.replace(self.options, digests=False)
        report.record_left_out = size
        return without

    def _write_one(self, name, writer, reader, report):
        """Write tensor ``name``; returns the GFLOP its fuse took (0 for the rest)."""
        ckpt, plan = self.ckpt, self.plan
        if name in plan.weights:
            layout = self.layouts[name]
            weight, loaded = reader.take(name)
            scales = [_read_tensor(ckpt, c) for c in layout.rewritten]
            overflows = _fuse_one(weight, loaded, layout, name, self.options, scales,
                                  _delta_view(self.delta, layout), ckpt.path, self.sources)
            _note_overflows(report, name, layout, overflows)
            self.pending.update(zip(layout.rewritten, scales))
            if self.quant is not None and name in self.quant.planned:
                # the codes go over the fused weight, placed as the writer takes them
                self.quant.write(writer, name, weight, self.options.threads,
                                 release=functools.partial(reader.release, weight))
            else:  # written from the read buffer, which is reused once the write is done
                writer.write(name, weight, release=functools.partial(reader.release, weight))
            return plans.gflop(layout.shape, plan.weights[name], self.sources)
        if name in self.pending:
            writer.write(name, self.pending.pop(name))
        elif name in plan.biases:
            writer.write(name, fuse_bias(_read_tensor(ckpt, name),
                                         plans.bias_terms(plan.biases[name], self.sources)))
        elif self.quant is not None and name in self.quant.planned:
            self.quant.write(writer, name, _read_tensor(ckpt, name), self.options.threads)
        else:
            f, info = ckpt.entries[name]
            writer.copy(name, f.fileno(), info.begin, info.nbytes, f.path)
        return 0.0


def _read_tensor(ckpt, name):
    f, _ = ckpt.entries[name]
    return f.read(name)


def fuse_state_dict(state_dict, loras, *, rule="addmm", threads=None, progress=None,
                    check_finite=False, fp8_rounding="nearest", seed=0, weight_format=None,
                    alpha="scale", allow_unmatched=False, fp8_overflow="saturate",
                    allow_overflow=False):
    """Fuse adapters into tensors a loader already holds, in place.

    Parameters
    ----------
    state_dict : mapping of name -> array
        numpy arrays (bf16 as uint16 or ml_dtypes.bfloat16; fp8 as ml_dtypes float8 arrays, or
        uint8 codes with ``weight_format``) or CPU torch tensors (bfloat16, float8_e4m3fn,
        float8_e5m2, uint8), viewed without a copy; torch is not needed for the rest of
        ltx2blas.  Scaled and quantised layouts are recognised from the tensors beside each
        weight, as in a checkpoint, and their scales rewritten in place; bias terms are added
        to the biases in place.
    loras : list of (path or mapping of adapter tensors, strength)
    weight_format : "F8_E4M3" or "F8_E5M2", optional
        The fp8 format of uint8 weights that no quantised layout claims.
    rule, threads, progress, check_finite, fp8_rounding, seed, alpha, allow_unmatched,
    fp8_overflow, allow_overflow
        As for :func:`fuse_checkpoint`; a weight refused for overflow is left as it was (the
        weights before it in the report's order are fused).

    Returns
    -------
    FuseReport
    """
    if not isinstance(state_dict, collections.abc.Mapping):
        raise ArgumentTypeError(f"state_dict must map names to tensors, got "
                                f"{type(state_dict).__name__}")
    loras = _parse_loras(loras, mappings=True)
    resolve_threads(threads)
    progress_arg(progress)
    t0 = time.perf_counter()
    views = {}
    for name, tensor in state_dict.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"state_dict keys must be tensor names (str), got {name!r}")
        views[name] = as_numpy(tensor)
    sources = [Source(src) for src, _ in loras]
    try:
        entries_of = {n: (dtype_name(v), tuple(v.shape)) for n, v in views.items()}
        opts = dict(rule=rule, alpha=alpha, allow_unmatched=allow_unmatched,
                    fp8_rounding=fp8_rounding, fp8_overflow=fp8_overflow)
        plan, layouts = _prepare(entries_of, {}, lambda n: views[n].tobytes(), sources, loras,
                                 opts, retry_dtype=weight_format)
        report = _report(IN_PLACE, False, plan, layouts, len(views), opts, list(views),
                         sources)
        report.tensors_copied = 0
        written = [what for name in list(plan.weights) + list(plan.biases)
                   for what in [name, *(layouts[name].rewritten if name in layouts else ())]]
        for what in written:
            arr = _plain(views[what])
            if not arr.flags.c_contiguous or not arr.flags.writeable:
                raise DTypeError(f"tensor {what} must be contiguous and writeable to fuse in "
                                 "place")
        _refuse_shared_memory(views, written, plan, sources)
        options = _Options(rule, threads, check_finite, fp8_rounding, seed, fp8_overflow,
                           allow_overflow=bool(allow_overflow), private_weights=False)
        delta = _delta_buffer(layouts)
        done_gflop = 0.0
        # in place: each weight read and written in memory
        bytes_total = 2 * sum(views[name].nbytes for name, _ in report.fused)
        for count, (name, _) in enumerate(report.fused, 1):
            layout = layouts[name]
            weight = _plain(views[name])
            scales = [_plain(views[c]) for c in layout.rewritten]
            loaded = plans.factors(plan.weights[name], sources, plan.reports)
            overflows = _fuse_one(weight, loaded, layout, name, options, scales,
                                  _delta_view(delta, layout), "<state dict>", sources)
            _note_overflows(report, name, layout, overflows)
            done_gflop += plans.gflop(layout.shape, plan.weights[name], sources)
            report.bytes_read += views[name].nbytes
            report.bytes_written += views[name].nbytes
            if progress is not None:
                progress(Progress(count, report.modules_fused, done_gflop, report.gflop,
                                  time.perf_counter() - t0, name,
                                  report.bytes_read + report.bytes_written, bytes_total))
        for name, items in plan.biases.items():
            bias = _plain(views[name])
            fuse_bias(bias, plans.bias_terms(items, sources), out=bias)
        report.seconds = time.perf_counter() - t0
        report.peak_rss_mib = _peak_rss_mib()
        return report
    finally:
        for s in sources:
            s.close()


def _byte_span(array):
    """[first, last + 1) bytes an array's elements occupy."""
    bounds = getattr(np.lib, "array_utils", np).byte_bounds(array)
    return bounds[0], bounds[1]


def _refuse_shared_memory(views, written, plan, sources):
    """LayoutError where a tensor fused in place shares memory with another one written (tied
    weights, overlapping views: each would take the delta, W + 2 * delta) or with an adapter
    tensor it is computed from, naming both keys.  Sorted by where they start, an overlap is
    found in one pass."""
    spans = [(*_byte_span(views[name]), name, "tensor") for name in written
             if views[name].nbytes]
    for item in (it for items in plan.weights.values() for it in items):
        source = sources[item.source]
        if source.file is None:
            for key in item.pair.keys.values():
                array = as_numpy(source.mapping[key])
                if array.nbytes:
                    spans.append((*_byte_span(array), key, f"adapter {item.source}'s tensor"))
    spans.sort(key=lambda span: span[0])
    reach, holder = None, None  # the furthest end so far, and its span
    for span in spans:
        start, end, name, what = span
        # Any overlap with a written tensor shows here: the span that reaches furthest
        # overlaps every later one that starts before its end.
        if reach is not None and start < reach and "tensor" in (what, holder[3]):
            first, second = holder, span
            raise LayoutError(f"{first[3]} {first[2]!r} and {second[3]} {second[2]!r} share "
                              "memory (tied weights or overlapping views); fusing in place "
                              "would add to it twice or read what was written: pass separate "
                              "arrays, or only one key of tied weights")
        if reach is None or end > reach:
            reach, holder = end, span


def _plain(array):
    return array.view(np.ndarray) if isinstance(array, FP8View) else array


def _version():
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(_package)
    except PackageNotFoundError:
        return "unknown"
