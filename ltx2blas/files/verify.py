"""Checking a fused checkpoint: against the provenance record it carries, and against the base
and adapter files it names, by rebuilding every fused tensor (docs/verify.md).

Three checks, each as far as what is given allows:

* the file alone: every tensor's bytes against the SHA-256 the fuse recorded as it wrote them
  (a corrupt download, a tensor edited after the fuse);
* the inputs: every base and adapter tensor against the digests recorded when they were read,
  the adapters in the recorded order, the strengths and options against the recorded ones;
* the rebuild: every fused weight, rewritten scale and bias fused again from the inputs, by the
  same code and options, and compared byte for byte with the file.

A file without a record (another tool's, or an older ltx2blas's) is compared tensor by tensor
with the base and with what ltx2blas makes of the inputs.
"""
import inspect
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .. import _stop
from .. import quantized as qz
from .._threads import resolve_threads
from .._validate import bf16_to_f32, progress_arg, strength_f32, where
from ..errors import ArgumentTypeError, printable
from ..fuse import fuse_bias
from . import adapters as plans
from . import provenance
from .adapters import Source
from .checkpoint import (FUSED_KEY, Checkpoint, Progress, _count, _delta_buffer, _delta_view,
                         _fuse_one, _Options, _path_arg, _prepare, _read_tensor, fuse_checkpoint,
                         read_history)
from .keys import LOKR_ROLES

#: verify's exit codes beside the command's own (2 arguments, 3 a malformed file, 4 I/O)
EXIT = {"verified": 0, "differs": 1, "unverifiable": 6}
#: how many findings of each kind a report keeps (and names); it counts them all
NAMED = 10
#: how many characters of a version the file's metadata names the origin shows
VERSION_SHOWN = 80
#: the defaults a fuse takes, for a file without a record
DEFAULT_OPTIONS = {k: inspect.signature(fuse_checkpoint).parameters[k].default
                   for k in provenance.OPTIONS}


@dataclass
class Finding:
    """One thing that is not as the record or the rebuild says.  ``what``: "digest" (the
    file's bytes against its record), "base" or "adapter N" (an input against the record),
    "strength", "option", "order", "rebuilt" (a tensor fused again differs), "missing",
    "extra" (tensors the record or the base has and the file has not, or the reverse),
    "copied" (a tensor no adapter touches, not the base's: with a record, where the file's
    agrees with the record and the base's does not); for a file without a record "equals the
    base" (no adapter in it) and "unlike both" (neither the base nor ltx2blas's result)."""
    what: str
    tensor: str = ""
    detail: str = ""
    count: int = 0      # elements that differ
    first: int = -1     # the first that differs, as a flat index
    at: tuple = ()      # the same as (row, column) (a vector's: its index alone)
    steps: int = 0      # the largest difference, in steps of the tensor's format (codes apart)
    # a bf16 weight that differs from its rebuild: the largest difference in bf16 steps of
    # |W| + |delta| (None: not measured, or a non-finite value on one side), the class
    # ("rounding": the same inputs under another rounding; "different inputs"; "changed after
    # the fuse": with a record, bytes that are not those the fuse wrote), the rule that
    # reproduces the file's sampled rows, and the multiple of the delta that fits its change
    scaled_steps: float = None
    steps_over: str = ""  # what scaled_steps is the largest of: "every element", "sampled rows"
    cls: str = ""
    rule: str = ""
    multiple: float = None


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` found: ``status`` "verified", "differs" or "unverifiable"
    (the file holds no record that can be checked, and no inputs settle it), ``origin`` (who
    made the file, as its metadata says), ``findings`` (the first NAMED of each kind) and
    ``counts`` (how many of each kind, {what: count}); for a file without a record, how many
    fused tensors equal the base, ltx2blas's result, or neither."""
    path: str
    status: str = "verified"
    origin: str = ""
    reasons: list = field(default_factory=list)
    findings: list = field(default_factory=list)
    counts: dict = field(default_factory=dict)
    tensors_hashed: int = 0
    inputs_hashed: int = 0
    tensors_rebuilt: int = 0
    equal_base: int = 0
    equal_ltx2blas: int = 0
    unlike_both: int = 0
    cause: str = ""        # what is wrong, in one line (the summary's first line ends with it)
    cause_class: str = ""  # its class: a kind of input finding ("order", "adapter", ...),
    #                        "file" (not as its record says), or a tensor class (CLASSES)
    classes: dict = field(default_factory=dict)  # {tensor class: how many tensors}
    fits: list = field(default_factory=list)  # every differing bf16 weight fitted (FIT_ROWS)
    seconds: float = 0.0

    @property
    def exit_code(self):
        return EXIT[self.status]

    def add(self, what, tensor="", detail="", count=0, first=-1, steps=0, at=(), **more):
        """Count a finding, and keep it if fewer than NAMED of its kind are kept: a record can
        name a million tensors the file lacks, and the report stays small."""
        n = self.counts.get(what, 0)
        self.counts[what] = n + 1
        if n < NAMED:
            self.findings.append(Finding(what, tensor, detail, count, first, at=tuple(at),
                                         steps=steps, **more))

    def as_dict(self):
        out = asdict(self)
        for f in out["findings"]:
            f["class"] = f.pop("cls")
        return out

    def summary(self):
        head = {"verified": "verified", "differs": "DIFFERS", "unverifiable": "cannot verify"}
        first = f"{head[self.status]}: {printable(self.path)} ({printable(self.origin)})"
        if self.cause:
            first += f": {printable(self.cause)}"
        lines = [first]
        lines += [f"  {printable(r)}" for r in self.reasons]
        # what is wrong first: the inputs, then the file against its record, then each
        # class's count of tensors, then a few of those tensors (EXAMPLES of each kind and
        # class; the JSON keeps NAMED)
        for group in range(3):
            for f in self.findings:
                if _group(f.what) == group and (group < 2 or _shown(self.findings, f)):
                    lines.append("  " + _finding_text(f))
            if group == 1:
                lines += self._class_lines()
            for what in [w for w in self.counts if _group(w) == group]:
                shown = sum(f.what == what and (group < 2 or _shown(self.findings, f))
                            for f in self.findings)
                if self.counts[what] > shown:
                    lines.append(f"  ... {what}: {self.counts[what] - shown} more, "
                                 f"{self.counts[what]} in all")
        lines += self._fit_lines()
        done = []
        if self.tensors_hashed:
            done.append(f"{_count(self.tensors_hashed, 'tensor')} against the record")
        if self.inputs_hashed:
            done.append(f"{_count(self.inputs_hashed, 'input tensor')} against the record")
        if self.tensors_rebuilt:
            done.append(f"{_count(self.tensors_rebuilt, 'tensor')} rebuilt from the inputs")
        lines.append("  checked " + (", ".join(done) or "nothing"))
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)

    def _class_lines(self):
        lines = []
        if self.equal_base or self.equal_ltx2blas or self.unlike_both:
            lines.append(f"  of the fused tensors: {self.equal_ltx2blas} equal ltx2blas's result, "
                         f"{self.equal_base} equal the base (no adapter in them), "
                         f"{self.unlike_both} differ from both")
        if self.classes:
            lines.append("  of the tensors that differ: " + ", ".join(
                f"{n} {CLASSES.get(c, c)}" for c, n in self.classes.items()))
        return lines

    def _fit_lines(self):
        """The fits in a few lines: how the multiples spread, and what the alpha / rank factor
        explains where it does."""
        fitted = [f for f in self.fits if f["multiple"] is not None]
        if not fitted:
            return []
        cs = sorted(f["multiple"] for f in fitted)
        spread = (f"{cs[0]:.4g}" if cs[-1] - cs[0] <= 0.0005 * max(abs(cs[-1]), 1e-30)
                  else f"{cs[0]:.4g} to {cs[-1]:.4g}, median {cs[len(cs) // 2]:.4g}")
        lines = [f"  fit: the change of {_count(len(fitted), 'differing weight')} is {spread} x "
                 f"ltx2blas's delta (least squares on up to {FIT_ROWS} sampled rows of each)"]
        notes = {}
        for f in fitted:
            if f["explains"]:
                notes[f["explains"]] = notes.get(f["explains"], 0) + 1
        return lines + [f"  fit: {_count(n, 'weight')} at {printable(text)}"
                        for text, n in sorted(notes.items(), key=lambda t: -t[1])[:3]]


#: the classes of a fused tensor that differs, as the summary words them
CLASSES = {"rounding": "the same inputs under another rounding",
           "different inputs": "different inputs (or options)",
           "changed after the fuse": "changed after the fuse (not the bytes it wrote)",
           "not classed": "not classed (not a bf16 weight, or a DoRA one)",
           "no adapter": "the base's bytes (no adapter in them)"}
#: the finding kinds about the inputs, and about the file against its record
#: The hashes of tensor digests, as findings name them.
HASH_TEXT = {"sha256": "SHA-256", "blake3": "BLAKE3"}
_INPUTS = ("order", "adapter", "strength", "option", "base")
_FILE = ("digest", "missing", "extra", "copied")
#: tensor findings the text names of each kind and class (the JSON keeps NAMED)
EXAMPLES = 3


def _group(what):
    """0: a finding about the inputs; 1: about the file against its record; 2: a tensor
    rebuilt."""
    if what in _INPUTS or what.startswith("adapter "):
        return 0
    return 1 if what in _FILE else 2


def _shown(findings, f):
    """Whether the text names tensor finding ``f``: the first EXAMPLES of its kind and
    class."""
    same = [g for g in findings if g.what == f.what and g.cls == f.cls]
    return next(i for i, g in enumerate(same) if g is f) < EXAMPLES


def _finding_text(f):
    where = f"{printable(f.tensor)}: " if f.tensor else ""
    text = f"{f.what}: {where}{printable(f.detail)}"
    if f.count:
        at = f"({', '.join(map(str, f.at))})" if len(f.at) > 1 else (f.at or (f.first,))[0]
        text += (f" ({_count(f.count, 'element')} {'differs' if f.count == 1 else 'differ'}, "
                 f"the first at {at}")
        if f.scaled_steps is not None:
            text += (f", at most {f.scaled_steps:.3g} bf16 "
                     f"{'step' if f.scaled_steps == 1 else 'steps'} of |W| + |delta|") + (
                " on the sampled rows" if f.steps_over == "sampled rows" else "")
        elif f.steps:
            text += f", at most {f.steps} steps"
        if f.multiple is not None:
            text += f"; the change fits {f.multiple:.4g} x the delta"
        text += ")"
    if f.cls:
        text += f": {CLASSES.get(f.cls, f.cls)}"
        if f.rule:
            text += f", as {f.rule} makes it"
    return text


def _parse_inputs(loras):
    """[(path, strength or None)]: a path alone leaves the strength to the record."""
    if loras is None:
        return []
    if isinstance(loras, (str, bytes, os.PathLike)) or not hasattr(loras, "__iter__"):
        raise ArgumentTypeError(f"loras must be a list of paths or (path, strength) pairs, got "
                                f"{type(loras).__name__}")
    out = []
    for i, item in enumerate(loras):
        if isinstance(item, (str, bytes, os.PathLike)):
            path, strength = item, None
        else:
            try:
                path, strength = item
            except (TypeError, ValueError):
                raise ArgumentTypeError("loras must be a list of paths or (path, strength) "
                                        "pairs") from None
        if strength is not None:
            strength_f32(strength, f"loras[{i}]: strength")
            strength = float(strength)
        out.append((_path_arg(path, f"loras[{i}]: the adapter"), strength))
    return out


def verify_checkpoint(fused, model=None, loras=None, *, rule=None, alpha=None, threads=None,
                      progress=None):
    """Check a fused checkpoint: its bytes against its record, and, given the inputs, the
    inputs against the record and every fused tensor rebuilt from them.

    Parameters
    ----------
    fused : path
        A safetensors file written by :func:`ltx2blas.fuse_checkpoint` (or by another tool).
    model : path, optional
        The base checkpoint (file, sharded index or diffusers folder).
    loras : list of path or (path, strength), optional
        The adapters, in the order they were fused; a strength left out (or None) is taken from
        the record (1.0 for a file without one).
    rule, alpha : optional
        The options the file is claimed to be fused with; left out, the record's.
    threads, progress : as for :func:`ltx2blas.fuse_checkpoint`

    Returns
    -------
    VerifyReport
        ``status`` "verified" only when every check that ran found the bytes as recorded (and
        rebuilt); a malformed file raises FormatError instead.
    """
    fused = _path_arg(fused, "fused")
    model = None if model is None else _path_arg(model, "model")
    given = _parse_inputs(loras)
    workers = resolve_threads(threads)
    progress_arg(progress)
    t0 = time.perf_counter()
    report = VerifyReport(fused)
    with Checkpoint(fused) as ckpt:
        record, why = provenance.read_record(ckpt.metadata)
        history, history_why = read_history(ckpt.metadata)
        report.origin = _origin(ckpt.metadata, record, history)
        usable = record is not None and record["format"] <= provenance.RECORD_FORMAT
        current = usable and record["contract"] == provenance.CONTRACT
        names_differ = False
        if usable:
            # format 2 lists digests in the order of the file's names: unpacked here, as
            # format 1 holds them ({tensor: hex digest})
            output, read = provenance.expand_output(record, list(ckpt.entries))
            names_differ = output is None
            if names_differ:
                count = record["output"]["count"]
                report.add("missing", "", f"the file's tensor names are not those its record "
                                          f"lists ({count} recorded, {len(ckpt.entries)} in the "
                                          "file): a tensor was added, removed or renamed after "
                                          "the fuse")
            record = dict(record, hash=provenance.tensor_hash_of(record), output=output or {},
                          base=dict(record["base"], read=read or {}))
        if record is not None and not usable:
            report.reasons.append(f"its record has format {record['format']}, newer than this "
                                  "ltx2blas reads; verify it with a newer ltx2blas")
        elif record is None and why == "unreadable":
            report.reasons.append(f"its {provenance.RECORD_KEY} entry is not a record this "
                                  "ltx2blas reads")
        if history is None and history_why != "missing":
            report.reasons.append(f"its {FUSED_KEY} entry is not a history of fuses this "
                                  f"ltx2blas reads ({history_why})")
        # The rebuild first: each tensor it compares byte for byte needs no digest of its own,
        # and the base's tensors it reads are hashed from the page cache as it goes.
        rebuilt, differing = {}, []
        quantized = record is not None and record.get("quantize") is not None
        if model is not None and (given or quantized and not record["adapters"]) and (
                record is None or current):
            options = _options(record, given, rule, alpha)
            rebuilt, differing = _rebuild(ckpt, model, options, record, report, threads,
                                          workers, progress, t0)
        own = None
        if usable and not names_differ:
            # progress from the step's own start: its ETA is the step's
            own = _check_own_digests(ckpt, record, report, workers, progress,
                                     time.perf_counter(), skip=rebuilt)
            if not current:
                report.reasons.append(
                    f"fused under arithmetic contract {record['contract']} (this ltx2blas "
                    f"follows {provenance.CONTRACT}): its bytes match its record as above, but "
                    f"only ltx2blas {_version_text(record.get('ltx2blas', '?'))} rebuilds them")
        if current and (model is not None or given):
            _check_inputs(ckpt, record, None if names_differ else model, given, rule, alpha,
                          report, workers, {n: d for n, d in rebuilt.items() if d is not None},
                          own)
            _blame_base(record, model, given, differing, report)
        if record is None and not report.reasons and not rebuilt:
            report.reasons.append(
                "no provenance record to check it by" + (
                    "; give --model and --lora to compare it with a rebuild"
                    if not (model is not None and given) else ""))
    report.seconds = time.perf_counter() - t0
    report.status = _status(report, record, current, bool(history), bool(rebuilt))
    _name_cause(report)
    return report


def _name_cause(report):
    """Findings in the order that tells the cause: about the inputs first (the adapters' order,
    files, strengths, options, the base), then the file against its record, then the tensors;
    and ``cause``, the first line's words for what is wrong."""
    report.findings.sort(key=lambda f: _group(f.what))
    if report.status == "verified" or not report.findings:
        return
    first = report.findings[0]
    group = _group(first.what)
    if group == 0:
        report.cause_class = "adapter" if first.what.startswith("adapter") else first.what
        report.cause = first.detail if not first.tensor else _finding_text(first)
    elif group == 1:
        report.cause_class = "file"
        report.cause = "the file is not as its record says: " + _finding_text(first)
    elif report.classes:
        # the worst class present names the cause
        for cls in ("changed after the fuse", "no adapter", "different inputs", "not classed",
                    "rounding"):
            if cls in report.classes:
                break
        report.cause_class = cls
        n, total = report.classes[cls], sum(report.classes.values())
        report.cause = (f"{CLASSES[cls]} in {n} of the {_count(total, 'tensor')} that "
                        f"{'differs' if total == 1 else 'differ'}")
        rules = {f.rule for f in report.findings if f.cls == cls}
        if cls == "rounding" and len(rules) == 1 and "" not in rules:
            report.cause += f" ({rules.pop()} makes them)"
        # the multiples that fit them well, the commonest first
        multiples = {}
        for fit in report.fits:
            if fit["class"] == cls and fit["residual"] is not None and fit["residual"] < 0.1:
                key = f"{fit['multiple']:.2g}"
                multiples[key] = multiples.get(key, 0) + 1
        if cls == "different inputs" and multiples:
            ranked = sorted(multiples.items(), key=lambda t: -t[1])[:2]
            report.cause += "; the change fits " + ", ".join(
                f"{c} x ltx2blas's delta in {k}" if i == 0 else f"{c} x in {k}"
                for i, (c, k) in enumerate(ranked))
    else:
        report.cause_class = "no adapter" if first.what == "equals the base" else first.what
        report.cause = _finding_text(first)
    more = len([f for f in report.findings if _group(f.what) == group]) - 1
    if group < 2 and more > 0:
        report.cause += f"; {more} more below"


def _status(report, record, current, history, rebuilt):
    if record is None:
        if not rebuilt:
            return "unverifiable"
        if report.findings and history:
            # an older ltx2blas's file whose rebuild differs: its contract is not known
            report.reasons.append("fused by an ltx2blas without records, whose arithmetic may "
                                  "differ from this one's: the differences below are not "
                                  "proof of a fault")
            return "unverifiable"
        return "differs" if report.findings else "verified"
    if any(report.counts.get(what) for what in ("digest", "missing", "extra")) or (
            current and report.findings):
        return "differs"
    return "verified" if current else "unverifiable"


def _origin(metadata, record, history):
    if record is not None:
        quant = record.get("quantize")
        made = "fused" if not quant else f"quantized to {quant['format']}" if not \
            record["adapters"] else f"fused and quantized to {quant['format']}"
        return (f"{made} by ltx2blas {_version_text(record.get('ltx2blas', '?'))}, contract "
                f"{record['contract']}, {_count(len(record['adapters']), 'adapter')}")
    if history:
        return (f"fused by ltx2blas {_version_text(metadata.get('ltx2blas.version', '?'))}, "
                "without a record")
    return "no ltx2blas record"


def _version_text(version):
    """A version as the file's metadata gives it, cut short: the text is the file's to choose
    (the summary also writes it printable)."""
    version = str(version)
    return version if len(version) <= VERSION_SHOWN else version[:VERSION_SHOWN] + "..."


def _digest_all(f_entries, workers, on_done=None, hash_name=provenance.TENSOR_HASH):
    """{name: digest by ``hash_name``} of tensors ``f_entries`` ({name: (SafetensorsFile,
    TensorInfo)}), on ``workers`` threads, each reading through one buffer of its own (hashlib
    and blake3 run without the GIL)."""
    local = threading.local()

    def one(name):
        if not hasattr(local, "buffer"):
            local.buffer = np.empty(1 << 20, np.uint8)
        return name, provenance.tensor_digest(*f_entries[name], local.buffer, hash_name)

    out = {}
    # daemon workers, left to themselves on the way out of an error or a stop: a
    # ThreadPoolExecutor's exit joins every worker, and after a signal one may never end
    with _stop.Workers(workers, "ltx2blas-digests") as pool:
        for name, digest in pool.map(one, list(f_entries)):
            out[name] = digest
            if on_done is not None:
                on_done(name)
    return out


def _check_own_digests(ckpt, record, report, workers, progress, t0, skip=()):
    """The file's tensors against the record's output digests, but those in ``skip`` (compared
    with a rebuild instead); returns {tensor: its digest in the file} of those hashed."""
    recorded = record["output"]
    total = len(ckpt.entries) - len(skip)
    hashed = {n: e for n, e in ckpt.entries.items() if n in recorded and n not in skip}
    # the work is the bytes hashed
    bytes_total = sum(info.nbytes for _, info in hashed.values())
    bytes_done = 0

    def tick(name):
        nonlocal bytes_done
        report.tensors_hashed += 1
        bytes_done += hashed[name][1].nbytes
        if progress is not None:
            progress(Progress(report.tensors_hashed, total, 0.0, 0.0,
                              time.perf_counter() - t0, name, bytes_done, bytes_total))

    got = _digest_all(hashed, workers, tick, record["hash"])
    for name in ckpt.entries:
        if name in skip and name in recorded:
            continue
        if name not in recorded:
            report.add("extra", name, "in the file but not in its record")
        elif got[name] != recorded[name]:
            report.add("digest", name, "its bytes are not those the fuse wrote "
                                       f"({HASH_TEXT[record['hash']]} differs)")
    for name in recorded:
        if name not in ckpt.entries:
            report.add("missing", name, "recorded but not in the file")
    return got


def _check_inputs(ckpt, record, model, given, rule, alpha, report, workers, read=None, own=None):
    """The inputs against the record: adapters (order, bytes, strengths), options, the base
    (``read``: the digests of base tensors a rebuild has hashed already; ``own``: those of the
    file's tensors, as hashed against the record)."""
    read, own = read or {}, own or {}
    for key, value in (("rule", rule), ("alpha", alpha)):
        if value is not None and value != record["options"].get(key):
            report.add("option", "", f"{key} {value!r} given, the file was fused with "
                                     f"{record['options'].get(key)!r}")
    recorded = record["adapters"]
    if given:
        if len(given) != len(recorded):
            report.add("adapter", "", f"{len(given)} adapters given, the file records "
                                      f"{len(recorded)}")
        digests = []
        for path, _ in given:
            source = Source(path)
            try:
                digests.append(provenance.file_digests(source.file,
                                                       hash_name=record["hash"]))
            finally:
                source.close()
            report.inputs_hashed += len(digests[-1][1])
        for i, ((path, strength), (whole, tensors)) in enumerate(zip(given, digests)):
            if i >= len(recorded):
                break
            want = recorded[i]
            if whole != want["sha256"]:
                elsewhere = [j for j, r in enumerate(recorded) if r["sha256"] == whole]
                if elsewhere:
                    report.add("order", "", f"adapter {i} ({os.path.basename(path)}) was fused "
                                            f"as adapter {elsewhere[0]}: the adapters are given "
                                            "in another order")
                    continue
                # one line for the file, then its tensors: a wrong file names every one
                theirs = provenance.adapter_tensors(want, tensors)
                if theirs is None:  # format 2 names no tensor: only the same names compare
                    report.add("adapter", "", f"adapter {i} ({os.path.basename(path)}) is not "
                                              f"the file fused (the record's "
                                              f"{want.get('file', '?')}): its tensor names are "
                                              f"not those fused ({len(tensors)} tensors, "
                                              f"{want['tensors']['count']} recorded)")
                    continue
                differ = sum(tensors.get(n) != d for n, d in theirs.items())
                extra = sum(n not in theirs for n in tensors)
                report.add("adapter", "", f"adapter {i} ({os.path.basename(path)}) is not the "
                                          f"file fused (the record's {want.get('file', '?')}): "
                                          f"{differ} of its {len(theirs)} tensors differ" + (
                                              f", {extra} not in the record" if extra else ""))
                _compare_digests(tensors, theirs, f"adapter {i}", report,
                                 f"{os.path.basename(path)} against the record's "
                                 f"{want.get('file', '?')}", record["hash"])
            if strength is not None and np.float32(strength) != np.float32(want["strength"]):
                report.add("strength", "", f"adapter {i}: strength {strength:g} given, fused at "
                                           f"{want['strength']:g}")
    if model is not None:
        with Checkpoint(model) as base:
            # a copied tensor's base digest is its output digest; a computed one's is kept in
            # format 1 only (format 2's rebuild checks it)
            computed = record["base"]["read"]
            want = {n: computed.get(n, d) for n, d in record["output"].items()
                    if n not in computed or computed[n] is not None}
            unchecked = [n for n in computed if computed[n] is None]
            quant = _quantizing(record, base)
            if unchecked and not given and quant is None:
                report.reasons.append(
                    f"the {_count(len(unchecked), 'tensor')} the fuse computed from the base "
                    "(fused weights, their scales, biases) are checked by a rebuild: give the "
                    "adapters (--lora) too")
            got = _digest_all({n: e for n, e in base.entries.items()
                               if n in want and n not in read}, workers,
                              hash_name=record["hash"])
            report.inputs_hashed += len(got)
            got.update(read)
            # a base tensor the record lacks needs no digest to be named; the old scales and
            # markers of weights quantised anew are not in the output, and their new ones
            # not in the base
            dropped, made = set(), set()
            if quant is not None:
                dropped = quant.dropped
                made = {p for n in quant.planned for p in quant.parts(n)} - set(base.entries)
            got.update((n, None) for n in base.entries if n not in want and n not in computed
                       and n not in dropped)
            name = os.path.basename(model)
            for n in unchecked:
                if n not in base.entries and n not in made:
                    report.add("base", n, f"recorded, but not in {name}")
            for n in [n for n in want if n not in computed and n in got and got[n] != want[n]
                      and own.get(n) == want[n]]:
                # A copied tensor the file holds as its record says, unlike the base's: the
                # file is not this base's fuse.  The digests cannot tell whether the base
                # changed or the file was edited with its record, so the file's tensor is
                # named (the file is what is verified), and both causes are.
                report.add("copied", n, f"the file's tensor is not {name}'s, which a fuse "
                                        "copies unchanged; the file's record agrees with the "
                                        "file: either both were changed after the fuse, or "
                                        f"{name} is not the base fused")
                del want[n], got[n]
            _compare_digests(got, want, "base", report, name, record["hash"])


def _blame_base(record, model, given, differing, report):
    """A tensor the fuse computed that differs from its rebuild while the file holds the bytes
    the fuse wrote, the adapters are the files fused, at their strengths and in their order,
    and the options are the recorded ones: the one input left is the base.  Named as such
    where the record keeps no digest of the base's bytes to say so (format 2)."""
    if not differing or any(_group(f.what) == 0 for f in report.findings) or \
            len(given) != len(record["adapters"]):
        return
    name = os.path.basename(model)
    for tensor in differing:
        if record["base"]["read"].get(tensor) is None:
            report.add("base", tensor, f"{name}: not the tensor fused: its rebuild differs "
                                       "from the file, which holds what the fuse wrote, while "
                                       "the adapters and options are those recorded")


def _compare_digests(got, want, what, report, where, hash_name):
    for name, digest in want.items():
        if name not in got:
            report.add(what, name, f"recorded, but not in {where}")
        elif got[name] != digest:
            report.add(what, name, f"{where}: its bytes differ from those fused "
                                   f"({HASH_TEXT[hash_name]})")
    for name in got:
        if name not in want:
            report.add(what, name, f"in {where}, but not in the record")


def _options(record, given, rule, alpha):
    options = dict(record["options"] if record is not None else DEFAULT_OPTIONS)
    if rule is not None:
        options["rule"] = rule
    if alpha is not None:
        options["alpha"] = alpha
    strengths = []
    for i, (_, strength) in enumerate(given):
        if strength is None:
            recorded = record["adapters"] if record is not None else []
            strength = recorded[i]["strength"] if i < len(recorded) else 1.0
        strengths.append(strength)
    options["strengths"] = strengths
    options["paths"] = [path for path, _ in given]
    return options


def _rebuild(ckpt, model, options, record, report, threads, workers, progress, t0):
    """Every fused tensor fused again from the base and adapters by ``options``, one weight at a
    time, compared with the file.  Without a record, each is also compared with the base, and
    every other tensor must be the base's.  Returns ({tensor compared: its base digest, or
    None}, [tensors that differ from their rebuild while the file holds what the fuse wrote]):
    the base's tensors are hashed (for a format 1 record, which holds their digests) by
    background threads from the page cache."""
    has_record = record is not None
    loras = list(zip(options["paths"], options["strengths"]))
    # only a format 1 record holds the digests of the base tensors a fuse computed from
    hashed = has_record and any(d is not None for d in record["base"]["read"].values())
    hasher = provenance.Hasher(workers, hash_name=record["hash"]) if hashed else None
    read = []
    differing = []  # compared tensors that differ while the file's bytes are as recorded
    ahead = _stop.Workers(2, "ltx2blas-ahead")  # not joined after an error or a stop
    digests = None
    with Checkpoint(model) as base, ahead:
        sources = []
        try:
            for path, _ in loras:
                sources.append(Source(path))
            entries = {n: (info.dtype, info.shape) for n, (_, info) in base.entries.items()}
            plan, layouts = _prepare(entries, base.metadata, lambda n: _read_tensor(base, n),
                                     sources, loras, options)
            # a quantised output: its weights quantised again after the fuse (or from the
            # base), by the record's format and choice of layers
            quant = _quantizing(record, base) if has_record else None
            run = _Options(options["rule"], threads, False, options["fp8_rounding"],
                           options["seed"], options["fp8_overflow"], options["alpha"],
                           options["allow_unmatched"], False,
                           allow_overflow=True)  # rebuilds what the file holds, inf included
            delta = _delta_buffer(layouts)

            def recorded(name):  # what _compare needs to tell a file changed after the fuse
                return dict(recorded=record["output"].get(name), hash_name=record["hash"],
                            differing=differing) if has_record else {}

            def read_base(name):
                read.append(name)
                if hasher is not None:
                    hasher.add_file(name, *base.entries[name])
                return _read_tensor(base, name)

            names = [n for n in base.entries if n in plan.weights or n in plan.biases or
                     quant is not None and n in quant.planned]
            weights = [n for n in names if n in plan.weights]
            following = dict(zip(weights, weights[1:]))
            total_gflop = sum(plans.gflop(layouts[n].shape, plan.weights[n], sources)
                              for n in plan.weights)
            done_gflop = 0.0
            # the work: each tensor read from the base and from the file, and the fuse's
            # arithmetic
            sizes = {n: 2 * base.entries[n][1].nbytes for n in names}
            bytes_total, bytes_done = sum(sizes.values()), 0
            base_ahead = {}
            for count, name in enumerate(names, 1):
                if name in plan.weights:
                    # while this weight is fused: the file's tensor read (from disk, most
                    # often), and the next weight's base
                    stored = ahead.submit(_stored, ckpt, name)
                    layout = layouts[name]
                    weight = (base_ahead.pop(name).result() if name in base_ahead
                              else read_base(name))
                    if name in following:
                        base_ahead[following[name]] = ahead.submit(read_base, following[name])
                    original = None if has_record else weight.copy()
                    scales = [read_base(c) for c in layout.rewritten]
                    loaded = plans.factors(plan.weights[name], sources, plan.reports)
                    _fuse_one(weight, loaded, layout, name, run, scales,
                              _delta_view(delta, layout), base.path, sources)
                    if quant is not None and name in quant.planned:
                        _compare_quantized(ckpt, quant, name, weight, report, threads, recorded)
                    else:
                        _compare(ckpt, name, weight, original, report, layout.fmt, loaded,
                                 stored.result(), differing=differing if has_record else None,
                                 base=(lambda n=name: _read_tensor(base, n)) if has_record
                                 else None,
                                 recorded=record["output"].get(name) if has_record else None,
                                 hash_name=record["hash"] if has_record else None)
                    for c, s in zip(layout.rewritten, scales):
                        _compare(ckpt, c, s, None, report, None, None, **recorded(c))
                    done_gflop += plans.gflop(layout.shape, plan.weights[name], sources)
                elif name not in plan.biases:  # quantised only, not fused
                    read.append(name)
                    weight = (quant.dequantize(base, name, threads) if name in quant.sources
                              else _read_tensor(base, name))
                    _compare_quantized(ckpt, quant, name, weight, report, threads, recorded)
                else:
                    bias = read_base(name)
                    _compare(ckpt, name, fuse_bias(bias, plans.bias_terms(plan.biases[name],
                                                                          sources)),
                             None if has_record else bias, report, None, None, **recorded(name))
                bytes_done += sizes[name]
                if progress is not None:
                    progress(Progress(count, len(names), done_gflop, total_gflop,
                                      time.perf_counter() - t0, name, bytes_done,
                                      bytes_total))
            if not has_record:
                _compare_copied(ckpt, base, set(read), report, workers)
            digests = hasher.wait() if hasher is not None else {}
        finally:
            if hasher is not None:
                hasher.close(cancel=digests is None)  # an error or a stop: waits for no thread
            for s in sources:
                s.close()
    return {name: digests.get(name) for name in read}, differing


def _quantizing(record, base):
    """The quantize.Quantizing a record's ``quantize`` entry made of checkpoint ``base``
    (None for a record without one)."""
    q = record.get("quantize")
    if q is None:
        return None
    from .quantize import Quantizing, source_layouts

    entries = {n: (info.dtype, tuple(info.shape)) for n, (_, info) in base.entries.items()}
    return Quantizing(entries, q["format"], q["include"], q["exclude"],
                      q["fp8_format"] or "F8_E4M3", q["per_row"], source_layouts(base, entries))


def _compare_quantized(ckpt, quant, name, weight, report, threads, recorded):
    """A bf16 weight (fused again, or the base's) quantised again by the record's format and
    each of its tensors compared with the file's."""
    q = qz.quantize_weight(quant.fmt, weight, threads=threads, fp8_format=quant.fp8_format,
                           per_row=quant.per_row)
    arrays = [q.weight, q.scale] + ([q.scale_2] if q.scale_2 is not None else []) + (
        [quant.marker] if quant.marker is not None else [])
    for key, array in zip(quant.parts(name), arrays):
        _compare(ckpt, key, array, None, report, None, None, **recorded(key))


def _stored(ckpt, name):
    """The file's tensor ``name`` as raw bytes (None where the file has no such tensor)."""
    if name not in ckpt.entries:
        return None
    f, info = ckpt.entries[name]
    return f.read(name, np.empty(info.nbytes, np.uint8))


def _compare(ckpt, name, rebuilt, original, report, fmt, loaded, stored=None, base=None,
             recorded=None, hash_name=None, differing=None):
    """The file's tensor ``name`` (``stored``, its bytes, when read already) against the
    ``rebuilt`` one; without a record (``original``, the base's tensor, given) also against
    the base.  A bf16 weight that differs is measured against the base's (``base()`` reads it
    again, with a record), fitted (_fit) and classed (CLASSES); with a record, ``recorded`` is
    the digest the fuse wrote for it, by ``hash_name``."""
    report.tensors_rebuilt += 1
    if name not in ckpt.entries:
        report.add("missing", name, "fused from the inputs but not in the file")
        return
    f, info = ckpt.entries[name]
    # (ascontiguousarray would make a 0-d scale 1-d)
    rebuilt = np.ascontiguousarray(rebuilt).reshape(np.shape(rebuilt))
    if info.nbytes != rebuilt.nbytes or list(info.shape) != list(rebuilt.shape):
        report.add("rebuilt", name, f"the file's {info.dtype} {list(info.shape)} is not the "
                                    f"rebuilt {list(rebuilt.shape)}")
        return
    stored = (_stored(ckpt, name) if stored is None else stored).view(rebuilt.dtype).reshape(
        rebuilt.shape)
    if _same_bytes(stored, rebuilt):
        if original is not None:
            report.equal_ltx2blas += 1
        return
    if original is not None and _same_bytes(stored, original):
        report.equal_base += 1
        report.classes["no adapter"] = report.classes.get("no adapter", 0) + 1
        report.add("equals the base", name, "no adapter in it: the file holds the base's bytes")
        return
    other_tool = original is not None  # a file without a record: compared with the base too
    weight = fmt == "bf16" and rebuilt.ndim == 2 and bool(loaded)
    if weight and original is None and base is not None:
        original = base()  # only for a weight that differs: the rebuild fused the base in place
    count, first, steps, rows = _measure(stored, rebuilt, fmt)
    fit = _fit(name, stored, rebuilt, original, loaded, rows) if weight and \
        original is not None else None
    scaled = fit["steps"] if fit else None
    if scaled is not None and scaled <= ROUNDING_STEPS and (
            fit["multiple"] is None or abs(fit["multiple"] - 1) < 0.01):
        # another rounding on the sampled rows: every element is measured to say so
        scaled = fit["steps"] = _steps_everywhere(stored, rebuilt, original,
                                                  _magnitude(loaded, rebuilt.shape))
        fit["steps_over"] = "every element"
    if recorded is not None and provenance.digest_of(
            stored.reshape(-1).view(np.uint8), hash_name) != recorded:
        cls = "changed after the fuse"
    elif fit is None or scaled is None and fit["multiple"] is None:
        cls = "not classed"
    elif scaled is not None and scaled <= ROUNDING_STEPS and (
            fit["multiple"] is None or abs(fit["multiple"] - 1) < 0.01):
        cls = "rounding"
    else:
        cls = "different inputs"
    report.classes[cls] = report.classes.get(cls, 0) + 1
    if differing is not None and cls != "changed after the fuse":
        differing.append(name)
    report.add("unlike both" if other_tool else "rebuilt", name,
               "neither the base nor ltx2blas's result" if other_tool else
               "differs from the rebuild", count, first, steps,
               where(first, rebuilt.shape), scaled_steps=scaled,
               steps_over=fit["steps_over"] if scaled is not None else "", cls=cls,
               rule=fit["rule"] if fit and cls == "rounding" else "",
               multiple=fit["multiple"] if fit else None)
    if fit is not None:
        fit["class"] = cls
        report.fits.append(fit)
    if other_tool:
        report.unlike_both += 1


def _same_bytes(a, b):
    """Whether two C-contiguous arrays hold the same bytes: compared as 8-byte words where the
    length allows (a tenth of the time of a byte-wise comparison)."""
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False
    if a.size % 8 == 0:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return bool(np.array_equal(a, b))


#: elements a pass of _measure takes at a time (its f64 copies stay a few MB)
CHUNK = 1 << 18
#: rows of a weight _fit samples: evenly spaced, and a quarter of them among rows that differ
FIT_ROWS = 64
#: the largest difference, in bf16 steps of |W| + |delta|, of "another rounding"
ROUNDING_STEPS = 2.0


def _measure(stored, rebuilt, fmt):
    """(count, first, steps, rows) of two tensors that differ: the elements that differ, the
    first as a flat index, the largest difference in codes of the format (_steps), and for a
    2-D tensor which rows differ.  Taken about CHUNK elements at a time: no copy of the
    tensor."""
    a, b = stored.reshape(-1), rebuilt.reshape(-1)
    cols = rebuilt.shape[-1] if rebuilt.ndim == 2 and rebuilt.shape[-1] else 1
    rows = np.zeros(a.size // cols, bool)
    width = a.dtype.itemsize
    step = max(1, CHUNK // cols) * cols
    count, first, steps = 0, -1, 0
    for lo in range(0, a.size, step):
        x, y = a[lo:lo + step], b[lo:lo + step]
        d = np.any(x.view(np.uint8).reshape(-1, width) != y.view(np.uint8).reshape(-1, width),
                   axis=1)
        n = int(np.count_nonzero(d))
        if not n:
            continue
        if first < 0:
            first = lo + int(np.argmax(d))
        count += n
        rows[lo // cols:(lo + x.size) // cols] |= d.reshape(-1, cols).any(axis=1)
        if fmt in ("bf16", "F8_E4M3", "F8_E5M2"):
            steps = max(steps, _steps(x[d], y[d], fmt))
    return count, first, steps, rows


def _ordered(bits):
    """bf16 codes as integers in the order of their values (adjacent values 1 apart)."""
    x = bits.astype(np.int64)
    return np.where(x & 0x8000, -(x & 0x7FFF), x)


def _scaled_steps(stored, rebuilt, original, at, magnitude):
    """The largest of |stored - rebuilt| / (bf16's step at |W| + sum |scale| |factors|) over
    the elements ``at`` (flat indices); None where a value is not finite."""
    if not at.size:
        return 0.0
    i, j = np.divmod(at, rebuilt.shape[1])
    x, y, w = (_f64(t.reshape(-1)[at]) for t in (stored, rebuilt, original))
    with np.errstate(all="ignore"):
        size = np.abs(w) + magnitude(i, j)
        # bf16's step at a magnitude in [2^(e-1), 2^e): 2^(e - 8); the subnormals' 2^-133
        ulp = np.maximum(np.ldexp(1.0, np.frexp(size)[1] - 8), 2.0**-133)
        ratio = np.abs(x - y) / ulp
    return float(ratio.max()) if np.all(np.isfinite(ratio)) else None


def _steps_everywhere(stored, rebuilt, original, magnitude):
    """_scaled_steps over every element of a bf16 weight that differs: those one code apart
    count as one step (they are within a step of the magnitude by construction), those
    further apart are measured, CHUNK elements at a time."""
    a, b = stored.reshape(-1), rebuilt.reshape(-1)
    largest = 0.0
    for lo in range(0, a.size, CHUNK):
        apart = np.abs(_ordered(a[lo:lo + CHUNK]) - _ordered(b[lo:lo + CHUNK]))
        if np.any(apart == 1):
            largest = max(largest, 1.0)
        far = _scaled_steps(stored, rebuilt, original, lo + np.flatnonzero(apart > 1),
                            magnitude)
        if far is None:
            return None
        largest = max(largest, far)
    return largest


def _f64(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _steps(a, b, fmt):
    """The largest distance between the two tensors' values in steps of the format (adjacent
    values are one step apart; +0 and -0 none), NaN and inf included as their codes."""
    bits, sign = (16, 0x8000) if fmt == "bf16" else (8, 0x80)

    def ordered(x):
        x = x.reshape(-1).view(np.uint16 if bits == 16 else np.uint8).astype(np.int64)
        return np.where(x & sign, -(x & (sign - 1)), x)

    return int(np.max(np.abs(ordered(a) - ordered(b)))) if a.size else 0


def _delta_rows(ld, rows, shape):
    """One adapter's unscaled delta on ``rows`` of a weight of ``shape``, in f64 from its bf16
    factors: a LoRA's B @ A, a difference, a LoHa's (w1_a @ w1_b) * (w2_a @ w2_b), a LoKr's
    Kronecker product; None for DoRA (its weight is normalised: no multiple of a delta)."""
    kind, arrays = ld.item.kind, ld.arrays
    wide = _f64
    if kind == "lora":
        d = wide(arrays[1][rows]) @ wide(arrays[0])
    elif kind == "diff":
        d = wide(arrays[0].reshape(shape)[rows])
    elif kind == "loha":
        d = (wide(arrays[0][rows]) @ wide(arrays[1])) * (wide(arrays[2][rows]) @ wide(arrays[3]))
    elif kind == "lokr":
        # the rows of each factor that the sampled rows take, each made from its pair alone
        # (a factor as large as the weight is never made whole)
        by = _lokr_roles(ld)

        def factor(n, at):
            return wide(by[n][at]) if n in by else wide(by[n + "_a"][at]) @ wide(by[n + "_b"])
        m2 = (by["lokr_w2"] if "lokr_w2" in by else by["lokr_w2_a"]).shape[0]
        rows = np.arange(shape[0])[rows]
        w1, w2 = factor("lokr_w1", rows // m2), factor("lokr_w2", rows % m2)
        d = (w1[:, :, None] * w2[:, None, :]).reshape(len(rows), -1)
    else:
        return None
    return d if d.shape == (len(d), shape[1]) else None


def _magnitude(loaded, shape):
    """(i, j) -> sum over the adapters of |scale| x the delta of the factors' magnitudes at
    elements (i, j): |B| @ |A|, |diff|, (|w1_a| @ |w1_b|) (|w2_a| @ |w2_b|), a LoKr's |w1|
    (x) |w2|; with |W|, the size of what a fuse adds, against which any order of the sums
    rounds.  None for DoRA."""
    if any(ld.item.kind not in ("lora", "diff", "loha", "lokr") for ld in loaded):
        return None

    absolute = {}  # the factors' magnitudes in f32, the right ones transposed: made once

    def factor(key, bits, transpose=False):
        if key not in absolute:
            v = np.abs(bf16_to_f32(bits))
            absolute[key] = np.ascontiguousarray(v.T) if transpose else v
        return absolute[key]

    def dots(k, left, right, i, j):
        """sum_r |left[i, r]| |right[r, j]| for each pair (i, j)."""
        return np.einsum("nr,nr->n", factor((k, 0), left)[i],
                         factor((k, 1), right, True)[j]).astype(np.float64)

    def lokr(k, ld, i, j):
        by = _lokr_roles(ld)
        w2 = by["lokr_w2"] if "lokr_w2" in by else None
        m2 = (w2 if w2 is not None else by["lokr_w2_a"]).shape[0]
        n2 = shape[1] // (by["lokr_w1"].shape[1] if "lokr_w1" in by else by["lokr_w1_b"].shape[1])
        out = 1.0
        for n, p, q in (("lokr_w1", i // m2, j // n2), ("lokr_w2", i % m2, j % n2)):
            out = out * (np.abs(_f64(by[n][p, q])) if n in by else
                         dots((k, n), by[n + "_a"], by[n + "_b"], p, q))
        return out

    def of(i, j):
        total = np.zeros(i.size)
        for k, ld in enumerate(loaded):
            kind, arrays = ld.item.kind, ld.arrays
            for lo in range(0, i.size, 4096):
                n, m = i[lo:lo + 4096], j[lo:lo + 4096]
                if kind == "lora":
                    d = dots(k, arrays[1], arrays[0], n, m)
                elif kind == "diff":
                    d = np.abs(_f64(arrays[0].reshape(shape)[n, m]))
                elif kind == "loha":
                    d = dots(k, arrays[0], arrays[1], n, m) * dots(k + 0.5, arrays[2],
                                                                   arrays[3], n, m)
                else:
                    d = lokr(k, ld, n, m)
                total[lo:lo + 4096] += abs(float(np.float32(ld.item.scale))) * d
        return total
    return of


def _lokr_roles(ld):
    """A LoKr's factors by role (lokr_w1 or lokr_w1_a and _b, the same of w2)."""
    return dict(zip([r for r in LOKR_ROLES if r in ld.item.pair.keys], ld.arrays))


def _rules(loaded):
    """{name: rule(W rows, unscaled deltas) -> bf16 bits}: other tools' arithmetic that the
    same inputs may have been fused by, each a plain restatement on sampled rows."""
    scales = [np.float32(ld.item.scale) for ld in loaded]

    def comfyui(w, deltas):
        # the weight in f32, each adapter's product f32(strength x alpha / rank) x its f32
        # product added in f32, rounded to bf16 once at the end
        acc = bf16_to_f32(w)
        for d, s in zip(deltas, scales):
            acc = acc + s * d.astype(np.float32)
        return qz.round_bf16_bits(acc)

    def peft(w, deltas):
        # PEFT's merge on a CPU: the f32 product times its scaling, rounded to bf16, added to
        # the bf16 weight
        for d, s in zip(deltas, scales):
            w = qz.round_bf16_bits(bf16_to_f32(w) + bf16_to_f32(
                qz.round_bf16_bits(d.astype(np.float32) * s)))
        return w

    rules = {"ComfyUI's f32 add": comfyui}
    if all(ld.item.kind == "lora" for ld in loaded):
        rules["PEFT's scaled product"] = peft
    return rules


def _fit(name, stored, rebuilt, original, loaded, differing):
    """How one bf16 weight's change (the file's less the base's) relates to ltx2blas's delta,
    on up to FIT_ROWS rows (evenly spaced, and among those that differ): the multiple of the
    delta that fits it best (least squares, in f64; each adapter's own where there are
    several), how much of the change it leaves, and the other tool's rule (_rules) that makes
    the sampled rows where one does.  A dict of numbers, for the report's ``fits``."""
    n_rows, shape = stored.shape[0], stored.shape
    even = np.linspace(0, n_rows - 1, min(n_rows, FIT_ROWS - FIT_ROWS // 4)).astype(np.int64)
    where_differ = np.flatnonzero(differing)
    some = where_differ[np.linspace(0, where_differ.size - 1,
                                    min(where_differ.size, FIT_ROWS // 4)).astype(np.int64)]
    rows = np.union1d(even, some)
    out = {"tensor": name, "rows": int(rows.size), "multiple": None, "multiples": None,
           "residual": None, "rule": "", "explains": "", "steps": None,
           "steps_over": "sampled rows"}
    magnitude = _magnitude(loaded, shape)
    if magnitude is not None:
        at = (rows[:, None] * shape[1] + np.arange(shape[1])).reshape(-1)
        at = at[stored.reshape(-1)[at] != rebuilt.reshape(-1)[at]]
        out["steps"] = _scaled_steps(stored, rebuilt, original, at, magnitude)
    deltas = [_delta_rows(ld, rows, shape) for ld in loaded]
    if any(d is None for d in deltas):
        return out
    w, s, r = original[rows], stored[rows], rebuilt[rows]
    change = _f64(s) - _f64(w)
    terms = [d * ld.item.scale for d, ld in zip(deltas, loaded)]
    total = sum(terms)
    with np.errstate(all="ignore"):
        norm = float(np.sum(total * total))
        if not norm or not np.isfinite(norm) or not np.all(np.isfinite(change)):
            return out
        c = float(np.sum(change * total)) / norm
        rest = float(np.linalg.norm(change - c * total))
        size = float(np.linalg.norm(change))
    out["multiple"] = c
    out["residual"] = rest / size if size else 0.0
    if len(terms) > 1:
        columns = np.stack([t.reshape(-1) for t in terms], axis=1)
        out["multiples"] = [float(v) for v in np.linalg.lstsq(columns, change.reshape(-1),
                                                              rcond=None)[0]]
    theirs = int(np.count_nonzero(s != r))
    for rule, make in _rules(loaded).items():
        if theirs and np.count_nonzero(make(w, deltas) != s) * 10 <= theirs:
            out["rule"] = rule
            break
    if abs(c - 1) >= 0.01 and out["residual"] < 0.1:
        text = f"{c:.2g} x the delta: the strengths x {c:.2g}"
        for k in sorted({ld.item.scale / ld.item.strength for ld in loaded if ld.item.strength}):
            if k != 1 and abs(c * k - 1) < 0.01:
                text += f"; or the alpha / rank factor {k:.4g} left out (--alpha ignore)"
            elif k != 1 and abs(c - k) < 0.01 * abs(k):
                text += (f"; or alpha / rank ({k:.4g}) applied twice, as LyCORIS' merge_to "
                         "applies it")
        out["explains"] = text
    return out


def _compare_copied(ckpt, base, changed, report, workers):
    """Without a record: every tensor the fuse copies must be the base's, byte for byte (both
    sides hashed on ``workers`` threads)."""
    copied = [n for n in base.entries if n not in changed and n in ckpt.entries]
    same_size = [n for n in copied if base.entries[n][1].nbytes == ckpt.entries[n][1].nbytes]
    mine = _digest_all({n: base.entries[n] for n in same_size}, workers)
    theirs = _digest_all({n: ckpt.entries[n] for n in same_size}, workers)
    for name in base.entries:
        if name in changed:
            continue
        if name not in ckpt.entries:
            report.add("missing", name, "in the base but not in the file")
        elif name not in mine or mine[name] != theirs[name]:
            report.add("copied", name, "differs from the base's, which a fuse copies unchanged")
    for name in ckpt.entries:
        if name not in base.entries:
            report.add("extra", name, "in the file but not in the base")
