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
import concurrent.futures
import inspect
import os
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .._threads import resolve_threads
from .._validate import progress_arg, strength_f32
from ..errors import ArgumentTypeError, printable
from ..fuse import fuse_bias
from . import adapters as plans
from . import provenance
from .adapters import Source
from .checkpoint import (Checkpoint, Progress, _count, _delta_buffer, _delta_view, _fuse_one,
                         _fused_history, _Options, _path_arg, _prepare, _read_tensor,
                         fuse_checkpoint)

#: verify's exit codes beside the command's own (2 arguments, 3 a malformed file, 4 I/O)
EXIT = {"verified": 0, "differs": 1, "unverifiable": 6}
#: how many tensors that differ a summary names
NAMED = 10
#: the defaults a fuse takes, for a file without a record
DEFAULT_OPTIONS = {k: inspect.signature(fuse_checkpoint).parameters[k].default
                   for k in provenance.OPTIONS}


@dataclass
class Finding:
    """One thing that is not as the record or the rebuild says.  ``what``: "digest" (the
    file's bytes against its record), "base" or "adapter N" (an input against the record),
    "strength", "option", "order", "rebuilt" (a tensor fused again differs), "missing",
    "extra" (tensors the record or the base has and the file has not, or the reverse);
    for a file without a record "equals the base" (no adapter in it), "unlike both" (neither
    the base nor ltx2blas's result) and "copied" (a tensor no adapter touches, not the
    base's)."""
    what: str
    tensor: str = ""
    detail: str = ""
    count: int = 0      # elements that differ
    first: int = -1     # the first that differs, as a flat index
    steps: int = 0      # the largest difference, in steps of the tensor's format


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` found: ``status`` "verified", "differs" or "unverifiable"
    (the file holds no record that can be checked, and no inputs settle it), ``origin`` (who
    made the file, as its metadata says), ``findings``; for a file without a record, how many
    fused tensors equal the base, ltx2blas's result, or neither."""
    path: str
    status: str = "verified"
    origin: str = ""
    reasons: list = field(default_factory=list)
    findings: list = field(default_factory=list)
    tensors_hashed: int = 0
    inputs_hashed: int = 0
    tensors_rebuilt: int = 0
    equal_base: int = 0
    equal_ltx2blas: int = 0
    unlike_both: int = 0
    fits: list = field(default_factory=list)   # what explains another tool's file better
    seconds: float = 0.0

    @property
    def exit_code(self):
        return EXIT[self.status]

    def as_dict(self):
        return asdict(self)

    def summary(self):
        head = {"verified": "verified", "differs": "DIFFERS", "unverifiable": "cannot verify"}
        lines = [f"{head[self.status]}: {printable(self.path)} ({self.origin})"]
        lines += [f"  {printable(r)}" for r in self.reasons]
        done = []
        if self.tensors_hashed:
            done.append(f"{_count(self.tensors_hashed, 'tensor')} against the record")
        if self.inputs_hashed:
            done.append(f"{_count(self.inputs_hashed, 'input tensor')} against the record")
        if self.tensors_rebuilt:
            done.append(f"{_count(self.tensors_rebuilt, 'tensor')} rebuilt from the inputs")
        lines.append("  checked " + (", ".join(done) or "nothing"))
        if self.equal_base or self.equal_ltx2blas or self.unlike_both:
            lines.append(f"  of the fused tensors: {self.equal_ltx2blas} equal ltx2blas's result, "
                         f"{self.equal_base} equal the base (no adapter in them), "
                         f"{self.unlike_both} differ from both")
        for f in self.findings[:NAMED]:
            lines.append("  " + _finding_text(f))
        if len(self.findings) > NAMED:
            lines.append(f"  ... and {len(self.findings) - NAMED} more")
        lines += [f"  {printable(fit)}" for fit in self.fits]
        lines.append(f"  {self.seconds:.1f} s")
        return "\n".join(lines)


def _finding_text(f):
    where = f"{printable(f.tensor)}: " if f.tensor else ""
    text = f"{f.what}: {where}{printable(f.detail)}"
    if f.count:
        text += f" ({f.count} elements differ, the first at {f.first}"
        text += f", at most {f.steps} steps)" if f.steps else ")"
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
        history = _fused_history(ckpt.metadata)
        report.origin = _origin(ckpt.metadata, record, history)
        usable = record is not None and record["format"] <= provenance.RECORD_FORMAT
        current = usable and record["contract"] == provenance.CONTRACT
        if record is not None and not usable:
            report.reasons.append(f"its record has format {record['format']}, newer than this "
                                  "ltx2blas reads; verify it with a newer ltx2blas")
        elif record is None and why == "unreadable":
            report.reasons.append(f"its {provenance.RECORD_KEY} entry is not a record this "
                                  "ltx2blas reads")
        # The rebuild first: each tensor it compares byte for byte needs no digest of its own,
        # and the base's tensors it reads are hashed from the page cache as it goes.
        rebuilt = {}
        if model is not None and given and (record is None or current):
            options = _options(record, given, rule, alpha)
            rebuilt = _rebuild(ckpt, model, options, record, report, threads, workers,
                               progress, t0)
        if usable:
            # progress from the step's own start: its ETA is the step's
            _check_own_digests(ckpt, record, report, workers, progress, time.perf_counter(),
                               skip=rebuilt)
            if not current:
                report.reasons.append(
                    f"fused under arithmetic contract {record['contract']} (this ltx2blas "
                    f"follows {provenance.CONTRACT}): its bytes match its record as above, but "
                    f"only ltx2blas {record.get('ltx2blas', '?')} rebuilds them")
        if current and (model is not None or given):
            _check_inputs(ckpt, record, model, given, rule, alpha, report, workers,
                          {n: d for n, d in rebuilt.items() if d is not None})
        if record is None and not report.reasons and not rebuilt:
            report.reasons.append(
                "no provenance record to check it by" + (
                    "; give --model and --lora to compare it with a rebuild"
                    if not (model is not None and given) else ""))
    report.seconds = time.perf_counter() - t0
    report.status = _status(report, record, current, history, bool(rebuilt))
    return report


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
    if any(f.what in ("digest", "missing", "extra") for f in report.findings) or (
            current and report.findings):
        return "differs"
    return "verified" if current else "unverifiable"


def _origin(metadata, record, history):
    if record is not None:
        return (f"fused by ltx2blas {record.get('ltx2blas', '?')}, contract "
                f"{record['contract']}, {_count(len(record['adapters']), 'adapter')}")
    if history:
        return f"fused by ltx2blas {metadata.get('ltx2blas.version', '?')}, without a record"
    return "no ltx2blas record"


def _digest_all(f_entries, workers, on_done=None):
    """{name: SHA-256} of tensors ``f_entries`` ({name: (SafetensorsFile, TensorInfo)}), on
    ``workers`` threads, each reading through one buffer of its own (hashlib runs without the
    GIL)."""
    local = threading.local()

    def one(name):
        if not hasattr(local, "buffer"):
            local.buffer = np.empty(1 << 20, np.uint8)
        return name, provenance.tensor_digest(*f_entries[name], local.buffer)

    out = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for name, digest in pool.map(one, list(f_entries)):
            out[name] = digest
            if on_done is not None:
                on_done(name)
    return out


def _check_own_digests(ckpt, record, report, workers, progress, t0, skip=()):
    """The file's tensors against the record's output digests, but those in ``skip`` (compared
    with a rebuild instead)."""
    recorded = record["output"]
    total = len(ckpt.entries) - len(skip)

    def tick(name):
        report.tensors_hashed += 1
        if progress is not None:
            progress(Progress(report.tensors_hashed, total, 0.0, 0.0,
                              time.perf_counter() - t0, name))

    got = _digest_all({n: e for n, e in ckpt.entries.items() if n in recorded and n not in skip},
                      workers, tick)
    for name in ckpt.entries:
        if name in skip and name in recorded:
            continue
        if name not in recorded:
            report.findings.append(Finding("extra", name, "in the file but not in its record"))
        elif got[name] != recorded[name]:
            report.findings.append(Finding("digest", name, "its bytes are not those the fuse "
                                                           "wrote (SHA-256 differs)"))
    for name in recorded:
        if name not in ckpt.entries:
            report.findings.append(Finding("missing", name, "recorded but not in the file"))


def _check_inputs(ckpt, record, model, given, rule, alpha, report, workers, read=None):
    """The inputs against the record: adapters (order, bytes, strengths), options, the base
    (``read``: the digests of base tensors a rebuild has hashed already)."""
    read = read or {}
    for key, value in (("rule", rule), ("alpha", alpha)):
        if value is not None and value != record["options"].get(key):
            report.findings.append(Finding("option", "", f"{key} {value!r} given, the file was "
                                                        f"fused with {record['options'].get(key)!r}"))
    recorded = record["adapters"]
    if given:
        if len(given) != len(recorded):
            report.findings.append(Finding("adapter", "", f"{len(given)} adapters given, the file "
                                                         f"records {len(recorded)}"))
        digests = []
        for path, _ in given:
            source = Source(path)
            try:
                digests.append(provenance.file_digests(source.file))
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
                    report.findings.append(Finding(
                        "order", "", f"adapter {i} ({os.path.basename(path)}) was fused as "
                                     f"adapter {elsewhere[0]}: the adapters are given in another "
                                     "order"))
                    continue
                _compare_digests(tensors, want["tensors"], f"adapter {i}", report,
                                 f"{os.path.basename(path)} against the record's "
                                 f"{want.get('file', '?')}")
            if strength is not None and np.float32(strength) != np.float32(want["strength"]):
                report.findings.append(Finding("strength", "", f"adapter {i}: strength {strength:g} "
                                                               f"given, fused at {want['strength']:g}"))
    if model is not None:
        with Checkpoint(model) as base:
            # a copied tensor's base digest is its output digest
            want = {n: record["base"]["read"].get(n, d) for n, d in record["output"].items()}
            got = _digest_all({n: e for n, e in base.entries.items()
                               if n in want and n not in read}, workers)
            report.inputs_hashed += len(got)
            got.update(read)
            # a base tensor the record lacks needs no digest to be named
            got.update((n, None) for n in base.entries if n not in want)
            _compare_digests(got, want, "base", report, os.path.basename(model))


def _compare_digests(got, want, what, report, where):
    for name, digest in want.items():
        if name not in got:
            report.findings.append(Finding(what, name, f"recorded, but not in {where}"))
        elif got[name] != digest:
            report.findings.append(Finding(what, name, f"{where}: its bytes differ from those "
                                                       "fused (SHA-256)"))
    for name in got:
        if name not in want:
            report.findings.append(Finding(what, name, f"in {where}, but not in the record"))


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
    every other tensor must be the base's.  Returns {tensor compared: its base digest}, the
    base's tensors hashed (with a record) by background threads from the page cache."""
    has_record = record is not None
    loras = list(zip(options["paths"], options["strengths"]))
    hasher = provenance.Hasher(workers) if has_record else None
    read = []
    ahead = concurrent.futures.ThreadPoolExecutor(2)
    with Checkpoint(model) as base, ahead:
        sources = []
        try:
            for path, _ in loras:
                sources.append(Source(path))
            entries = {n: (info.dtype, info.shape) for n, (_, info) in base.entries.items()}
            plan, layouts = _prepare(entries, base.metadata, lambda n: _read_tensor(base, n),
                                     sources, loras, options)
            run = _Options(options["rule"], threads, False, options["fp8_rounding"],
                           options["seed"], options["fp8_overflow"], options["alpha"],
                           options["allow_unmatched"], False,
                           allow_overflow=True)  # rebuilds what the file holds, inf included
            delta = _delta_buffer(layouts)

            def read_base(name):
                read.append(name)
                if hasher is not None:
                    hasher.add_file(name, *base.entries[name])
                return _read_tensor(base, name)

            names = [n for n in base.entries if n in plan.weights or n in plan.biases]
            weights = [n for n in names if n in plan.weights]
            following = dict(zip(weights, weights[1:]))
            total_gflop = sum(plans.gflop(layouts[n].shape, plan.weights[n], sources)
                              for n in plan.weights)
            done_gflop = 0.0
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
                    _compare(ckpt, name, weight, original, report, layout.fmt, loaded,
                             stored.result())
                    for c, s in zip(layout.rewritten, scales):
                        _compare(ckpt, c, s, None, report, None, None)
                    done_gflop += plans.gflop(layout.shape, plan.weights[name], sources)
                else:
                    bias = read_base(name)
                    _compare(ckpt, name, fuse_bias(bias, plans.bias_terms(plan.biases[name],
                                                                          sources)),
                             None if has_record else bias, report, None, None)
                if progress is not None:
                    progress(Progress(count, len(names), done_gflop, total_gflop,
                                      time.perf_counter() - t0, name))
            if not has_record:
                _compare_copied(ckpt, base, set(read), report, workers)
            digests = hasher.wait() if hasher is not None else {}
        finally:
            if hasher is not None:
                hasher.close()
            for s in sources:
                s.close()
    return {name: digests.get(name) for name in read}


def _stored(ckpt, name):
    """The file's tensor ``name`` as raw bytes (None where the file has no such tensor)."""
    if name not in ckpt.entries:
        return None
    f, info = ckpt.entries[name]
    return f.read(name, np.empty(info.nbytes, np.uint8))


def _compare(ckpt, name, rebuilt, original, report, fmt, loaded, stored=None):
    """The file's tensor ``name`` (``stored``, its bytes, when read already) against the
    ``rebuilt`` one; without a record (``original``, the base's tensor, given) also against
    the base."""
    report.tensors_rebuilt += 1
    if name not in ckpt.entries:
        report.findings.append(Finding("missing", name, "fused from the inputs but not in the "
                                                        "file"))
        return
    f, info = ckpt.entries[name]
    rebuilt = np.ascontiguousarray(rebuilt)
    if info.nbytes != rebuilt.nbytes or list(info.shape) != list(rebuilt.shape):
        report.findings.append(Finding("rebuilt", name, f"the file's {info.dtype} "
                                                        f"{list(info.shape)} is not the rebuilt "
                                                        f"{list(rebuilt.shape)}"))
        return
    stored = (_stored(ckpt, name) if stored is None else stored).view(rebuilt.dtype).reshape(
        rebuilt.shape)
    if _same_bytes(stored, rebuilt):
        if original is not None:
            report.equal_ltx2blas += 1
        return
    if original is not None and _same_bytes(stored, original):
        report.equal_base += 1
        report.findings.append(Finding("equals the base", name,
                                       "no adapter in it: the file holds the base's bytes"))
        return
    differ = _elements_differing(stored, rebuilt)
    steps = _steps(stored, rebuilt, fmt) if fmt in ("bf16", "F8_E4M3", "F8_E5M2") else 0
    finding = Finding("rebuilt" if original is None else "unlike both", name,
                      "differs from the rebuild" if original is None else
                      "neither the base nor ltx2blas's result", int(differ.size),
                      int(differ[0]), steps)
    report.findings.append(finding)
    if original is not None:
        report.unlike_both += 1
        if fmt == "bf16" and loaded and len(report.fits) < 3:
            fit = _fitted_strength(stored, original, loaded)
            if fit:
                report.fits.append(f"{name}: {fit}")


def _same_bytes(a, b):
    """Whether two C-contiguous arrays hold the same bytes: compared as 8-byte words where the
    length allows (a tenth of the time of a byte-wise comparison)."""
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    if a.size != b.size:
        return False
    if a.size % 8 == 0:
        a, b = a.view(np.uint64), b.view(np.uint64)
    return bool(np.array_equal(a, b))


def _elements_differing(a, b):
    a, b = a.reshape(-1), b.reshape(-1)
    width = a.dtype.itemsize
    return np.flatnonzero(np.any(a.view(np.uint8).reshape(-1, width)
                                 != b.view(np.uint8).reshape(-1, width), axis=1))


def _steps(a, b, fmt):
    """The largest distance between the two tensors' values in steps of the format (adjacent
    values are one step apart; +0 and -0 none), NaN and inf included as their codes."""
    bits, sign = (16, 0x8000) if fmt == "bf16" else (8, 0x80)

    def ordered(x):
        x = x.reshape(-1).view(np.uint16 if bits == 16 else np.uint8).astype(np.int64)
        return np.where(x & sign, -(x & (sign - 1)), x)

    return int(np.max(np.abs(ordered(a) - ordered(b)))) if a.size else 0


def _fitted_strength(stored, original, loaded):
    """For another tool's bf16 weight: the multiple ``c`` of ltx2blas's delta that fits the
    file's change best (least squares, in f64); named where it is not 1, with alpha / rank
    where that explains it."""
    if any(ld.item.kind != "lora" for ld in loaded):
        return ""
    def f64(bits):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    delta = np.zeros(stored.shape)
    for ld in loaded:
        a, b = ld.arrays
        delta += (f64(b) @ f64(a)) * ld.item.scale
    change = f64(stored) - f64(original)
    norm = float(np.sum(delta * delta))
    if not norm or not np.isfinite(norm):
        return ""
    c = float(np.sum(change * delta)) / norm
    if abs(c - 1.0) < 0.01:
        return ""
    text = f"the file's change fits {c:.3g} x ltx2blas's delta (the strengths x {c:.3g})"
    factors = {ld.item.scale / ld.item.strength for ld in loaded if ld.item.strength}
    for k in factors:
        if k != 1 and abs(c * k - 1) < 0.01:
            text += f"; so would the alpha / rank factor {k:g} left out (--alpha ignore)"
        elif k != 1 and abs(c - k) < 0.01 * k:
            text += f"; so would alpha / rank ({k:g}) applied twice"
    return text


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
            report.findings.append(Finding("missing", name, "in the base but not in the file"))
        elif name not in mine or mine[name] != theirs[name]:
            report.findings.append(Finding("copied", name, "differs from the base's, which a "
                                                           "fuse copies unchanged"))
    for name in ckpt.entries:
        if name not in base.entries:
            report.findings.append(Finding("extra", name, "in the file but not in the base"))
