"""A LoRA extracted from a fine-tuned checkpoint and its base (``ltx2blas extract``).

Every tensor of the two checkpoints is paired by name.  Weights of Linear layers (2-D
``.weight`` tensors, dequantised first where a layout stores them scaled) that differ become a
LoRA pair by :func:`ltx2blas.extract.extract_lora_weight`, one weight at a time; equal ones are
skipped and counted.  Other tensors that differ (norms, biases, tables) are listed, and with
``full_diff`` written as full differences (``.diff``, ``.diff_b``).  The factors are spilled to
a temporary file as they are made and the output is written from it at the end, so memory holds
a few weights whatever the model's size; nothing is written unless every tensor was read and
extracted.
"""
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .._threads import resolve_threads
from .._validate import FP8, bf16_bits, bf16_to_f32, choice
from ..errors import (ArgumentError, DTypeError, KeyMatchError, Ltx2IOError, NumericsError,
                      ShapeError, counted, printable)
from ..extract import (DTYPES, OVERSAMPLE, POWER_ITERATIONS, check_counts, extract_lora_weight,
                       range_width)
from ..quantized import DEQUANTIZED_TO_BF16, dequantized
from . import keys as keymatch
from . import layouts as layoutmod
from .checkpoint import Checkpoint, Progress, check_output_is_not_an_input, format_gflop
from .safetensors import SafetensorsWriter, output_path

#: The output's key spellings: upstream LTX-2's trainer (``diffusion_model.<m>.lora_A.weight``),
#: diffusers' (``transformer.<diffusers name>.lora_A.weight``), ComfyUI's and kohya's
#: (``diffusion_model.<m>.lora_down.weight``).  Each pair has an ``.alpha`` equal to its rank,
#: so that a tool that reads alpha scales the pair by 1, as one that does not.
KEYS = ("ltx", "diffusers", "comfy")
#: Layouts whose weights extract dequantises (f32 value of each code, times the one scale).
READABLE = ("bf16", "float", "fp8", "fp8_scaled", "comfy_fp8", "fp8_block", "fp6_block", "nvfp4")
METADATA_KEY = "ltx2blas.extracted"


@dataclass
class ExtractReport:
    output: str
    rank: object                 # the fixed rank, or None (energy mode)
    energy: object               # the energy fraction, or None
    max_rank: object = None      # energy mode: the largest rank a weight is given
    weights_extracted: int = 0
    weights_equal: int = 0
    other_differing: list = field(default_factory=list)   # names of other tensors that differ
    full_diffs: int = 0           # of those, written as .diff / .diff_b
    full_diff: bool = False       # whether they were asked for
    ranks: dict = field(default_factory=dict)   # weight -> (rank, fraction of ||D||_F kept)
    gflop: float = 0.0
    seconds: float = 0.0
    bytes_written: int = 0
    bytes_read: int = 0           # of both checkpoints' tensors
    dry_run: bool = False
    # a dry run's plan: each Linear weight -> its shape and the rank it would be given (in
    # energy mode the largest, max_rank or its smaller side: the rank itself needs the SVD)
    planned: dict = field(default_factory=dict)
    too_small: list = field(default_factory=list)   # weights smaller than the fixed rank
    other_tensors: int = 0        # tensors that are no Linear weight, compared when run
    bytes_planned: int = 0        # a dry run: the factors' bytes at most (all weights differ)

    def as_dict(self):
        """The report as plain data (``ltx2blas extract --json``): each weight's rank and
        fraction kept as {"rank", "kept"}; a dry run's plan as {"shape", "rank"}."""
        out = asdict(self)
        out["ranks"] = {n: {"rank": r, "kept": k} for n, (r, k) in self.ranks.items()}
        out["planned"] = {n: {"shape": list(shape), "rank": r}
                          for n, (shape, r) in self.planned.items()}
        out["short_of_energy"] = [n for n, _ in self.short_of_energy()]
        return out

    def short_of_energy(self):
        """Energy mode: the weights (name, fraction kept) that max_rank held short of the
        energy asked for, in file order.  The fraction is taken to the six digits the
        metadata records, so that the metadata counts the same weights."""
        if self.energy is None:
            return []
        return [(n, k) for n, (_, k) in self.ranks.items() if round(k, 6) < self.energy]

    def summary(self):
        if self.dry_run:
            return self._plan_summary()
        kept = [k for _, k in self.ranks.values()]
        ranks = [r for r, _ in self.ranks.values()]
        mode = f"rank {self.rank}" if self.rank is not None else \
            f"energy {self.energy:g} (ranks {min(ranks, default=0)}-{max(ranks, default=0)})"
        lines = [f"extracted {counted(self.weights_extracted, 'weight')} at {mode} into "
                 f"{printable(self.output)} ({self.bytes_written / 2**20:.1f} MiB); "
                 f"{counted(self.weights_equal, 'equal weight')} skipped"]
        if kept:
            lines.append(f"fraction of each difference's Frobenius norm kept: least "
                         f"{min(kept):.4f}, median {float(np.median(kept)):.4f}")
        short = self.short_of_energy()
        if short:
            name, least = min(short, key=lambda item: item[1])
            lines.append(f"{len(short)} of {counted(len(kept), 'weight')} missed the energy "
                         f"target {self.energy:g} at max rank {self.max_rank} (least fraction "
                         f"kept {least:.4f}, by {printable(name)}); a larger max rank keeps more")
        elif kept and self.energy is not None:
            lines.append(f"every weight reached the energy target {self.energy:g}")
        if self.other_differing:
            shown = ", ".join(map(printable, self.other_differing[:3]))
            more = ", ..." if len(self.other_differing) > 3 else ""
            listed = len(self.other_differing) - self.full_diffs
            if not self.full_diff:
                what = ("not in a LoRA (--full-diff writes those of 1-D weights and biases as "
                        "full differences)")
            else:
                what = f"{self.full_diffs} written as full differences" + (
                    f", {listed} listed only (the fuse adds differences to 1-D weights and "
                    "biases only)" if listed else "")
            n = len(self.other_differing)
            lines.append(f"{counted(n, 'other tensor')} {'differs' if n == 1 else 'differ'} "
                         f"({shown}{more}): " + what)
        # the rate of the work that dominated (Progress.fraction's model): GB/s where reading
        # the two checkpoints did
        if Progress(0, 0, 0.0, self.gflop, 0.0, "", 0, self.bytes_read).copy_bound:
            rate = self.bytes_read / 1e9 / self.seconds if self.seconds > 0 else 0.0
            rate = f", {rate:,.2f} GB/s read"
        else:
            rate = self.gflop / self.seconds if self.seconds > 0 else 0.0
            rate = f", {rate:,.1f} GFLOP/s"
        lines.append(f"{self.seconds:.1f} s, {format_gflop(self.gflop)} GFLOP{rate}")
        return "\n".join(lines)

    def _plan_summary(self):
        """A dry run's plan: what would be extracted, at which ranks, into how many bytes."""
        n = len(self.planned)
        ranks = [r for _, r in self.planned.values()]
        where = f" into {printable(self.output)}" if self.output else ""
        if self.rank is not None:
            mode = f"at rank {self.rank}"
        else:
            mode = (f"at energy {self.energy:g}, each at the least rank that keeps it, up to "
                    f"{max(ranks, default=self.max_rank)} (max rank {self.max_rank}; the ranks "
                    "are known only once the SVD has run)")
        lines = [f"would extract up to {counted(n, 'Linear weight')} {mode}{where}; a weight "
                 "found equal to its base is skipped"]
        size = (f"{self.bytes_planned / 2**20:.1f} MiB" if self.bytes_planned >= 2**20 else
                f"{self.bytes_planned / 2**10:.1f} KiB")
        lines.append(f"output at most {size} of factors (every weight differing"
                     + (", each at its largest rank" if self.rank is None else "")
                     + f"), plus its header; at most {format_gflop(self.gflop)} GFLOP")
        if self.too_small:
            name, shape = self.too_small[0], self.planned[self.too_small[0]][0]
            lines.append(f"{counted(len(self.too_small), 'weight')} smaller than rank "
                         f"{self.rank} (e.g. {printable(name)} {list(shape)}): the extract "
                         "stops there unless it is equal to its base")
        if self.other_tensors:
            lines.append(f"{counted(self.other_tensors, 'other tensor')} compared when run, "
                         + ("those of 1-D weights and biases that differ written as full "
                            "differences (counted in the size above)" if self.full_diff else
                            "listed where they differ"))
        lines.append("no weight read, nothing written")
        return "\n".join(lines)


def _stem(module, spelling):
    """A model module's name as an adapter key of the spelling begins."""
    if spelling == "diffusers":
        return "transformer." + keymatch.to_diffusers(module)
    return "diffusion_model." + module


def _names(module, spelling):
    """(A key, B key, alpha key) of a Linear module in a spelling."""
    base = _stem(module, spelling)
    if spelling == "comfy":
        return base + ".lora_down.weight", base + ".lora_up.weight", base + ".alpha"
    return base + ".lora_A.weight", base + ".lora_B.weight", base + ".alpha"


class _Side:
    """One checkpoint, its entries and each weight's layout."""

    def __init__(self, path, what):
        self.what = what
        self.ckpt = Checkpoint(path)
        self.entries = {n: (info.dtype, tuple(info.shape)) for n, (_, info) in
                        self.ckpt.entries.items()}
        self.configs, self.marker = layoutmod.comfy_configs(
            self.ckpt.metadata, self.entries, lambda n: self.ckpt.entries[n][0].read(n))

    def layout(self, name):
        dtype, shape = self.entries[name]
        if dtype in ("F16", "F32"):  # no adapter fuses into these, so detect() refuses them
            return layoutmod.Layout("float", dtype, shape)
        return layoutmod.detect(name, self.entries, self.configs, self.marker)

    def read(self, name):
        return self.ckpt.entries[name][0].read(name)

    def check_readable(self, name, layout):
        """DTypeError for a weight stored in a layout extract does not read."""
        if layout.kind not in READABLE:
            raise DTypeError(f"{self.what} {printable(self.ckpt.path)}: weight {printable(name)} "
                             f"is stored as {layout.kind}; extract reads BF16, F16, F32, fp8, "
                             "scaled fp8 and upstream's blockwise fp8/fp6 and NVFP4 weights")

    def nbytes(self, name):
        """The bytes of tensor ``name`` in the file."""
        return self.ckpt.entries[name][1].nbytes

    def values(self, name, layout):
        """The weight as extract reads it: bf16 bits, or f32 values (fp8 codes widened, times
        the layout's one scale where it has one)."""
        self.check_readable(name, layout)
        array = self.read(name)
        if layout.kind in DEQUANTIZED_TO_BF16:
            scale_2 = self.read(layout.scale_2) if layout.scale_2 else None
            return dequantized(layout.kind, array, scale=self.read(layout.scale),
                               scale_2=scale_2)
        if layout.kind == "bf16":
            return bf16_bits(array, name)
        if layout.kind == "float":
            return np.ascontiguousarray(array, np.float32)
        from .. import _quant

        codes = np.asarray(array).view(np.uint8)
        values = _quant.fp8_values(FP8[layout.fmt].e5m2)[codes]
        if layout.scale is not None:
            scale = np.float32(np.asarray(self.read(layout.scale), np.float32).reshape(-1)[0])
            values = values * scale
        return np.ascontiguousarray(values, np.float32)

    def close(self):
        self.ckpt.close()


def _float_values(array, dtype):
    """A tensor that is no Linear weight as f32 values (for its difference)."""
    return bf16_to_f32(array) if dtype == "BF16" else np.asarray(array, np.float32)


def extract_lora(tuned, base, output, *, rank=None, energy=None, max_rank=256, keys="ltx",
                 dtype="bf16", full_diff=False, seed=0, oversample=OVERSAMPLE,
                 power_iterations=POWER_ITERATIONS, threads=None, progress=None,
                 dry_run=False, weights_at_once=None):
    """Extract a LoRA of ``tuned - base`` into a safetensors file (see the module docstring).

    Parameters
    ----------
    tuned, base : path
        The fine-tuned checkpoint and its base (file, sharded index or diffusers folder).
    output : path
        The LoRA file; written only when every tensor was read and extracted.
    rank : int, optional
        Every weight at this rank; or
    energy : float in (0, 1], optional
        each weight at the least rank that keeps this fraction of its difference's Frobenius
        norm, up to ``max_rank``.
    keys : "ltx" (default), "diffusers" or "comfy"
    dtype : "bf16" (default) or "f32"
    full_diff : bool
        Write other tensors that differ as full differences (``.diff`` beside a weight,
        ``.diff_b`` beside a bias); they are listed either way.
    seed, oversample, power_iterations, threads
        As for :func:`ltx2blas.extract.extract_lora_weight`.
    weights_at_once : int, optional
        Weights extracted side by side, the threads shared among them (weight_lanes; by
        default one per THREADS_PER_WEIGHT threads).  The same file either way; memory holds
        that many weights' pairs and differences.
    progress : callable, optional
        Called with a :class:`~ltx2blas.files.checkpoint.Progress` after each tensor; its
        work is the bytes read from both checkpoints and the range finder's arithmetic (the
        total at first as if every weight differed, less each weight found equal).
    dry_run : bool
        Read the two checkpoints' headers and plan: the Linear weights paired, the rank
        each would get (in energy mode the largest it may get), the factors' bytes at most;
        no weight is read and nothing is written (``output`` may be None).

    Returns
    -------
    ExtractReport
    """
    choice(keys, KEYS, "keys")
    choice(dtype, DTYPES, "dtype")
    if (rank is None) == (energy is None):
        raise ArgumentError("give rank or energy, one of them")
    check_counts(oversample, power_iterations)
    weight_lanes(threads, weights_at_once)
    if output is not None or not dry_run:
        output_path(output)  # a missing folder, a folder or a device: refused by name, first
    t0 = time.perf_counter()
    sides = []
    try:
        sides.append(_Side(tuned, "tuned"))
        sides.append(_Side(base, "base"))
        if output is not None:
            check_output_is_not_an_input(os.fspath(output), [p for side in sides
                                                              for p in side.ckpt.paths()])
        if dry_run:
            return _plan_only(*sides, output, rank, energy, max_rank, dtype, full_diff,
                              oversample, power_iterations, t0)
        return _extract(*sides, output, rank, energy, max_rank, keys, dtype, full_diff, seed,
                        oversample, power_iterations, threads, progress, t0, weights_at_once)
    finally:
        for side in sides:
            side.close()


def _companions(side):
    """The tensors that belong to one side's stored layouts rather than to the model: each
    quantised weight's scales, input scale and ComfyUI marker, and the scaled_fp8 marker."""
    names = {n for n in side.entries if n == "scaled_fp8" or n.endswith(".scaled_fp8")}
    for name, (_, shape) in side.entries.items():
        if name.endswith(".weight") and len(shape) == 2:
            layout = side.layout(name)
            module = name[: -len(".weight")]
            if layout.kind not in ("bf16", "float"):
                names.update(n for n in (layout.scale, layout.scale_2, module + ".input_scale",
                                         module + ".comfy_quant") if n in side.entries)
    return names


def _plan(tuned, base):
    """(Linear weights, other tensors) in the tuned file's order, every name and shape checked
    against the base; the tensors of either side's stored layouts (scales, markers) need no
    partner and are left out of both."""
    companions = _companions(tuned) | _companions(base)
    t_names = [n for n in tuned.entries if n not in companions]
    b_names = {n for n in base.entries if n not in companions}
    only = [n for n in t_names if n not in b_names]
    missing = [n for n in base.entries if n in b_names and n not in set(t_names)]
    if only or missing:
        name, where = (only[0], "tuned but not the base") if only else (missing[0],
                                                                           "base but not tuned")
        raise KeyMatchError(f"tensor {printable(name)} is in the {where} checkpoint "
                            f"({len(only) + len(missing)} such): extract pairs every tensor")
    linear, other = [], []
    for name in t_names:
        t_shape, b_shape = tuned.entries[name][1], base.entries[name][1]
        if name.endswith(".weight") and len(t_shape) == 2:
            layouts = [tuned.layout(name), base.layout(name)]
            if layouts[0].shape != layouts[1].shape:
                raise ShapeError(f"weight {printable(name)} is {list(layouts[0].shape)} in the "
                                 f"tuned checkpoint and {list(layouts[1].shape)} in the base")
            linear.append((name, layouts))
        elif t_shape != b_shape:
            raise ShapeError(f"tensor {printable(name)} is {list(t_shape)} in the tuned "
                             f"checkpoint and {list(b_shape)} in the base")
        else:
            other.append(name)
    return linear, other


def _gflop(shape, rank, max_rank, oversample, power_iterations):
    """The range finder's GFLOP on a weight of ``shape`` (the same whatever rank energy mode
    then keeps): 2 rows cols width per product, 2 power_iterations + 2 products."""
    rows, cols = shape
    width = range_width(rank or max_rank, oversample, min(rows, cols))
    return 2.0 * rows * cols * width * (2 * power_iterations + 2) / 1e9


def _diff_written(name, tuned, base):
    """Whether full_diff writes this tensor's difference when it differs: a 1-D float .weight
    (added back as a bias term) or .bias; a scalar's is listed only."""
    t_dtype, b_dtype = tuned.entries[name][0], base.entries[name][0]
    return t_dtype in ("BF16", "F16", "F32") and b_dtype in ("BF16", "F16", "F32") and \
        name.endswith((".weight", ".bias")) and len(tuned.entries[name][1]) == 1


def _plan_only(tuned, base, output, rank, energy, max_rank, dtype, full_diff, oversample,
               power_iterations, t0):
    """A dry run: the plan from the headers alone, every Linear weight taken to differ."""
    linear, other = _plan(tuned, base)
    report = ExtractReport(output="" if output is None else os.fspath(output), rank=rank,
                           energy=energy, max_rank=max_rank if energy is not None else None,
                           full_diff=bool(full_diff), dry_run=True, other_tensors=len(other))
    size = 2 if dtype == "bf16" else 4
    for name, (t_layout, b_layout) in linear:
        tuned.check_readable(name, t_layout)
        base.check_readable(name, b_layout)
        rows, cols = t_layout.shape
        largest = min(rows, cols)
        if rank is not None and rank > largest:
            report.too_small.append(name)
        wanted = min(rank if rank is not None else max_rank, largest)
        report.planned[name] = ((rows, cols), wanted)
        report.bytes_planned += wanted * (rows + cols) * size + 4   # A, B and the F32 alpha
        report.gflop += _gflop((rows, cols), rank, max_rank, oversample, power_iterations)
    if full_diff:
        report.bytes_planned += sum(4 * tuned.entries[n][1][0] for n in other
                                    if _diff_written(n, tuned, base))
    report.seconds = time.perf_counter() - t0
    return report


#: Threads one weight's extraction keeps busy: its transposed products run in blocks of 1024
#: columns, four on a 4096-column weight (ltx2blas._lowrank.COLUMN_BLOCK).  Where more threads
#: are given, weights run side by side, each on its share.
THREADS_PER_WEIGHT = 4


def weight_lanes(threads=None, weights_at_once=None):
    """(weights extracted at once, threads each): by default one weight for every
    THREADS_PER_WEIGHT threads, at least one; ``weights_at_once`` (a positive integer, held to
    the thread count) sets it.  Each weight in flight holds its two weights read and their f32
    difference, and the calling thread reads the next pair meanwhile."""
    threads = resolve_threads(threads)
    if weights_at_once is None:
        lanes = max(1, threads // THREADS_PER_WEIGHT)
    else:
        try:
            whole = not isinstance(weights_at_once, bool) and \
                int(weights_at_once) == weights_at_once >= 1
        except (TypeError, ValueError, OverflowError):
            whole = False
        if not whole:
            raise ArgumentError(f"weights_at_once must be a positive integer, got "
                                f"{weights_at_once!r}")
        lanes = min(int(weights_at_once), threads)
    return lanes, threads // lanes


def _extract(tuned, base, output, rank, energy, max_rank, keys, dtype, full_diff, seed,
             oversample, power_iterations, threads, progress, t0, weights_at_once=None):
    linear, other = _plan(tuned, base)
    report = ExtractReport(output=os.fspath(output), rank=rank, energy=energy,
                           max_rank=max_rank if energy is not None else None,
                           full_diff=bool(full_diff))
    total = len(linear) + len(other)
    # the work: both sides' bytes read, and the arithmetic of every weight but those found
    # equal (taken off the total as they are found, so that the share done only grows)
    sizes = {n: tuned.nbytes(n) + base.nbytes(n) for n in [n for n, _ in linear] + other}
    bytes_total = sum(sizes.values())
    planned = {n: _gflop(layouts[0].shape, rank, max_rank, oversample, power_iterations)
               for n, layouts in linear}
    gflop_total = sum(planned.values())
    entries, places, per_weight = [], [], {}
    shown = printable(os.fspath(output))
    folder = os.path.dirname(output_path(output))   # beside the file the output names
    store = "BF16" if dtype == "bf16" else "F32"
    try:
        spill = tempfile.TemporaryFile(dir=folder)
    except OSError as exc:  # a read-only or special folder (/proc, /sys): name it, as the
        raise Ltx2IOError(  # writer does
            exc.errno, f"output {shown}: cannot create a file in {printable(folder)}: "
                       f"{exc.strerror}") from exc
    with spill:
        def put(name, array, dtype_name):
            data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            offset = spill.seek(0, os.SEEK_END)
            try:
                spill.write(data)
            except OSError as exc:  # a full disk, the file size limit
                raise Ltx2IOError(exc.errno, f"output {shown}: writing the spilled factors in "
                                             f"{printable(folder)}: {exc.strerror}") from exc
            entries.append((name, dtype_name, tuple(array.shape), data.nbytes))
            places.append((offset, data.nbytes))

        def extract_one(name, t_values, b_values, weight_threads):
            if t_values.dtype == b_values.dtype and np.array_equal(t_values, b_values):
                return None
            try:
                return extract_lora_weight(
                    t_values, b_values, rank=rank, energy=energy, max_rank=max_rank,
                    oversample=oversample, power_iterations=power_iterations, seed=seed,
                    name=name, dtype=dtype, threads=weight_threads)
            except (NumericsError, ShapeError) as exc:
                # the weight's own messages begin with its name (raw): named once, escaped
                text = str(exc)
                text = text[len(name) + 2:] if text.startswith(name + ": ") else text
                raise type(exc)(f"{printable(name)}: {text}") from None

        def record(name, low):
            nonlocal done, gflop_total
            done += 1
            report.bytes_read += sizes[name]
            if low is None or low.rank == 0:   # equal values (stored alike or not)
                report.weights_equal += 1
                gflop_total -= planned[name]
            else:
                report.gflop += planned[name]
                a_key, b_key, alpha_key = _names(keymatch.model_module(name), keys)
                put(a_key, low.lora_a, store)
                put(b_key, low.lora_b, store)
                put(alpha_key, np.array(low.rank, np.float32), "F32")
                report.weights_extracted += 1
                report.ranks[name] = (low.rank, low.kept)
                per_weight[name] = {"rank": low.rank, "kept": round(low.kept, 6)}
            if progress is not None:
                progress(Progress(done, total, report.gflop, gflop_total,
                                  time.perf_counter() - t0, name, report.bytes_read,
                                  bytes_total))

        done = 0
        lanes, weight_threads = weight_lanes(threads, weights_at_once)

        def read(name, layouts):   # in the calling thread, in order
            return name, tuned.values(name, layouts[0]), base.values(name, layouts[1])

        def extracted(weight):
            name, t_values, b_values = weight
            return name, extract_one(name, t_values, b_values, weight_threads)
        if lanes == 1:
            for name, layouts in linear:
                record(*extracted(read(name, layouts)))
        else:
            # weights side by side, each on its share of the threads, at most ``lanes`` in
            # flight, the results taken in order (each weight's bytes do not depend on its
            # thread count): the file is the one lanes == 1 writes.  A pool that joins its
            # threads, not _stop.Workers' daemons: a daemon still inside the BLAS or OpenMP as
            # the interpreter finalises can crash the process; on a stop the watchdog ends the
            # process within GRACE while the pool waits.
            from collections import deque
            from concurrent.futures import ThreadPoolExecutor

            pending = deque()
            with ThreadPoolExecutor(lanes) as pool:
                try:
                    for name, layouts in linear:
                        if len(pending) == lanes:
                            record(*pending.popleft().result())
                        pending.append(pool.submit(extracted, read(name, layouts)))
                    while pending:
                        record(*pending.popleft().result())
                except BaseException:
                    for future in pending:
                        future.cancel()
                    raise
        for name in other:
            t_dtype, b_dtype = tuned.entries[name][0], base.entries[name][0]
            t_raw, b_raw = tuned.read(name), base.read(name)
            done += 1
            report.bytes_read += sizes[name]
            # compared as bytes, flattened first: numpy views no 0-d array (a scalar such
            # as a logit scale) as bytes of another size
            if t_dtype == b_dtype and np.array_equal(
                    np.asarray(t_raw).reshape(-1).view(np.uint8),
                    np.asarray(b_raw).reshape(-1).view(np.uint8)):
                pass
            else:
                report.other_differing.append(name)
                # a difference is written where the fuse adds it back: to a 1-D .weight (as a
                # bias term) or .bias; a scalar's is listed only
                if full_diff and _diff_written(name, tuned, base):
                    diff = _float_values(t_raw, t_dtype) - _float_values(b_raw, b_dtype)
                    if not np.all(np.isfinite(diff)):
                        raise NumericsError(f"{printable(name)}: the difference is not finite")
                    weight = name if name.endswith(".weight") else \
                        name[: -len(".bias")] + ".weight"
                    stem = _stem(keymatch.model_module(weight), keys)  # the model's prefix off
                    put(stem + (".diff" if name.endswith(".weight") else ".diff_b"), diff, "F32")
                    report.full_diffs += 1
            if progress is not None:
                progress(Progress(done, total, report.gflop, gflop_total,
                                  time.perf_counter() - t0, name, report.bytes_read,
                                  bytes_total))
        if not entries and report.other_differing:
            names = ", ".join(map(printable, report.other_differing[:3]))
            raise ArgumentError(
                f"no Linear weight differs and no other tensor's difference is written "
                f"({len(report.other_differing)} differ: {names}"
                f"{', ...' if len(report.other_differing) > 3 else ''}"
                f"{'' if full_diff else '; --full-diff writes those of 1-D weights and biases'}"
                "): no LoRA to write, nothing written")
        if not entries:
            raise ArgumentError("the two checkpoints are equal in every tensor: no LoRA to "
                                "write, nothing written")
        metadata = {METADATA_KEY: json.dumps({
            "rank": rank, "energy": energy, "max_rank": max_rank if energy else None,
            "dtype": dtype, "keys": keys, "seed": seed, "oversample": oversample,
            "power_iterations": power_iterations, "weights": per_weight,
            **({"energy_missed": len(report.short_of_energy()),
                "least_kept": min((w["kept"] for w in per_weight.values()), default=None)}
               if energy is not None else {}),
            "other_differing": report.other_differing}, separators=(",", ":"))}
        spill.flush()
        with SafetensorsWriter(output, entries, metadata) as writer:
            for (name, *_), (offset, nbytes) in zip(entries, places):
                writer.copy(name, spill.fileno(), offset, nbytes, "the spilled factors")
            writer.commit()
            report.bytes_written = writer.size
    report.seconds = time.perf_counter() - t0
    return report
