"""The ltx2blas command: fuse adapter files into a checkpoint, verify a fused one, extract a
LoRA from a fine-tuned checkpoint, resize or merge LoRAs, quantise a checkpoint, show what this
machine runs, and time a demonstration.

Exit codes: 0 success; 1 a check failed (demo, verify); 2 bad arguments or inputs that do not
fit (shapes, dtypes, keys, an already fused checkpoint); 3 a malformed file; 4 an I/O failure
or memory exhausted; 5 non-finite values; 6 nothing to verify by (verify); 130 interrupted
(Ctrl-C), 143 and 129 terminated by SIGTERM and SIGHUP: stopped within a second, before the
output was renamed into place, which is left as it was.  A signal after that rename finds the
output complete: the command says so and exits 0.  A reader that stops reading (| head) ends
the output quietly, with the command's own exit code.
"""
import argparse
import json
import os
import signal
import sys
import threading

# Idle OpenMP threads sleep instead of spinning: a command's reader, writer and hashing threads
# share the cores with the kernels' team, and spinning between its parallel passes takes the
# time they need.  Read by the OpenMP runtime when ltx2blas's kernels first load, so set before
# any of them is imported; one set by the user is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

from . import _stop  # noqa: E402

#: The library's keyword spellings in its messages, as this command spells them.
_FLAGS = (("force=True", "--force"), ("allow_unmatched=True", "--allow-unmatched"),
          ("allow_repeated=True", "--allow-repeated"),
          ("check_finite=True", "--check-finite"), ("alpha='ignore'", "--alpha ignore"),
          ("alpha='scale'", "--alpha scale"), ("fp8_rounding='stochastic'",
                                                "--fp8-rounding stochastic"),
          ("fp8_overflow='saturate'", "--fp8-overflow saturate"),
          ("fp8_overflow='nan'", "--fp8-overflow nan"),
          ("allow_overflow=True", "--allow-overflow"))


def _cmd_info(args):
    from .info import collect, format_info

    info = collect()
    _print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_demo(args):
    from .demo import run_demo

    return run_demo(threads=args.threads, rank=args.rank, shape=(args.rows, args.cols),
                    checkpoint=not args.no_files)


def _lora_arg(text, default=1.0):
    """PATH or PATH:STRENGTH: the strength after the colon that ends an existing file's name
    (or after the last colon, when no prefix names a file), ``default`` without one.  Raises
    ArgumentError for a strength that is not a finite number, and for PATH=STRENGTH."""
    if os.path.isfile(text):
        return text, default
    colon = text.find(":")
    while colon >= 0:
        head, tail = text[:colon], text[colon + 1:]
        if head and os.path.isfile(head):
            return head, _strength(tail, text)
        colon = text.find(":", colon + 1)
    head, sep, tail = text.rpartition("=")
    if sep and head and os.path.isfile(head):
        raise _argument_error(f"--lora {text}: no such file; a strength follows a colon "
                              f"(--lora {head}:{tail})")
    head, sep, tail = text.rpartition(":")
    if sep and head:
        try:
            float(tail)
        except ValueError:
            return text, default  # a missing file whose name has a colon: reported as missing
        return head, _strength(tail, text)
    return text, default


def _argument_error(message):
    from .errors import ArgumentError

    return ArgumentError(message)


def _strength(tail, text):
    """The strength after PATH: as a float, or ArgumentError (exit 2) for anything that is not
    a number finite as f32, however it is spelled (inf, nan, 1e40)."""
    from .errors import NonFiniteInputError
    from ._validate import strength_f32

    try:
        value = float(tail)
    except ValueError:
        raise _argument_error(f"--lora {text}: the strength {tail!r} is not a number (PATH or "
                              "PATH:STRENGTH)") from None
    try:
        strength_f32(value, "strength")
    except NonFiniteInputError:
        raise _argument_error(f"--lora {text}: the strength {tail!r} is not finite as f32 (its "
                              "magnitude must be below 3.4e38)") from None
    return value


class _ProgressPrinter:
    """A progress bar on a terminal (tensors, GFLOP, rate, ETA); a log line every 10 % or
    30 s otherwise.  The share done and the ETA are of the work (Progress.fraction: bytes read
    and written, and arithmetic); the rate is in GB/s where copying dominates, in GFLOP/s
    where arithmetic does."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.last_fraction = -1.0
        self.last_time = 0.0

    def __call__(self, p):
        if self.stream is None:
            return
        try:
            self._show(p)
        except BrokenPipeError:  # its reader went away: the job goes on without progress
            _silence(self.stream)
            self.stream = None

    def _show(self, p):
        from .files.checkpoint import format_gflop

        copy_bound = getattr(p, "copy_bound", False)  # a Progress of an older caller
        fraction = p.fraction
        eta = (p.elapsed / fraction - p.elapsed) if fraction > 0 else float("nan")
        text = f"{p.tensors_done}/{p.tensors_total} tensors  "
        if p.gflop_total > 0:  # a step without arithmetic (verify's hashing) counts no GFLOP
            text += f"{format_gflop(p.gflop_done)}/{format_gflop(p.gflop_total)} GFLOP  "
        if copy_bound:
            rate = p.bytes_done / 1e9 / p.elapsed if p.elapsed > 0 else 0.0
            text += f"{rate:,.2f} GB/s  "
        elif p.gflop_total > 0:
            rate = p.gflop_done / p.elapsed if p.elapsed > 0 else 0.0
            text += f"{rate:,.1f} GFLOP/s  "
        text += f"ETA {_duration(eta)}"
        if self.tty:
            width = 28
            done = int(width * fraction)
            print(f"\r[{'#' * done}{'.' * (width - done)}] {_percent(fraction, 1):>5}% {text}",
                  end="", file=self.stream, flush=True)
            if p.tensors_done == p.tensors_total:
                print(file=self.stream)
            return
        if fraction < self.last_fraction:  # a new step began (verify: rebuild, then hash)
            self.last_fraction = -1.0
        if (fraction - self.last_fraction >= 0.1 or p.elapsed - self.last_time >= 30
              or p.tensors_done == p.tensors_total):
            print(f"ltx2blas: {_percent(fraction, 0)}% {text}", file=self.stream, flush=True)
            self.last_fraction, self.last_time = fraction, p.elapsed


def _percent(fraction, digits):
    """A share as a percentage rounded down: 100 only when all is done, not when the tensors
    left are a few small ones."""
    scale = 10 ** digits
    value = int(fraction * 100 * scale + 1e-6) / scale  # 0.29 * 100 is 28.999...
    return f"{value:.{digits}f}"


def _duration(seconds):
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _check_output(args):
    """-o/--output of a command that writes one file: required unless --dry-run, never empty,
    never the file standard output goes to (where the summary is printed)."""
    if args.output is None and not args.dry_run:
        raise _argument_error("-o/--output is required (unless --dry-run)")
    if args.output is not None and not args.output:
        raise _argument_error("-o/--output is empty; name the file to write")
    if args.output is not None and _is_stdout(args.output):
        raise _argument_error(f"-o {args.output} is this command's standard output, where its "
                              "summary goes; name a file")


def _cmd_fuse(args):
    from .errors import printable
    from .files.checkpoint import fuse_checkpoint

    _check_output(args)
    if args.seed is not None and args.fp8_rounding != "stochastic":
        raise _argument_error("--seed seeds --fp8-rounding stochastic; without it nothing is "
                              "random")
    loras = [_lora_arg(item) for item in args.lora]
    report = fuse_checkpoint(
        args.model, loras, args.output, rule=args.rule, alpha=args.alpha,
        allow_unmatched=args.allow_unmatched, threads=args.threads,
        progress=None if (args.dry_run or args.quiet or args.json) else _ProgressPrinter(),
        check_finite=args.check_finite, force=args.force, fp8_rounding=args.fp8_rounding,
        seed=args.seed or 0, dry_run=args.dry_run, fp8_overflow=args.fp8_overflow,
        digests=not args.no_digests, allow_repeated=args.allow_repeated,
        allow_overflow=args.allow_overflow, to=args.to)
    # The output is in place (or this was a dry run): a signal from here on does not
    # interrupt (the handler sees the commit, _stop.commit_rename) and is reported by main().
    if args.json:
        _print(_json(report.as_dict()))
        return 0
    lines = [_cli_words(report.summary())]
    if args.verbose:
        lines += [f"  {printable(name)}  <- adapters {adapters} "
                  f"({', '.join(report.fused_kinds.get(name, []))})"
                  for name, adapters in report.fused]
    _print("\n".join(lines))
    return 0


def _cmd_verify(args):
    from .files.verify import verify_checkpoint

    loras = [_lora_arg(item, default=None) for item in args.lora or ()]
    report = verify_checkpoint(
        args.fused, args.model, loras, rule=args.rule, alpha=args.alpha, threads=args.threads,
        progress=None if (args.quiet or args.json) else _ProgressPrinter())
    _stop.check()  # a signal whose exception Python swallowed (in a __del__) still stops it
    _print(_json(report.as_dict()) if args.json else _cli_words(report.summary()))
    return report.exit_code


def _cmd_extract(args):
    from .errors import printable
    from .files.extract import extract_lora

    if args.rank is not None and args.energy is not None:
        raise _argument_error("give --rank or --energy, not both")
    _check_output(args)
    rank = 64 if args.rank is None and args.energy is None else args.rank
    report = extract_lora(
        args.tuned, args.base, args.output, rank=rank, energy=args.energy,
        max_rank=args.max_rank, keys=args.keys, dtype=args.dtype, full_diff=args.full_diff,
        seed=args.seed, power_iterations=args.power_iterations, threads=args.threads,
        progress=None if (args.quiet or args.json or args.dry_run) else _ProgressPrinter(),
        dry_run=args.dry_run, weights_at_once=args.weights_at_once)
    if args.json:
        _print(_json(report.as_dict()))
        return 0
    lines = [report.summary()]
    if args.verbose and args.dry_run:
        lines += [f"  {printable(name)}  {list(shape)}  rank {'<= ' if rank is None else ''}{r}"
                  for name, (shape, r) in report.planned.items()]
    elif args.verbose:
        lines += [f"  {printable(name)}  rank {r}, kept {kept:.4f}"
                  for name, (r, kept) in report.ranks.items()]
    _print("\n".join(lines))
    return 0


def _cmd_quantize(args):
    from .errors import printable
    from .files.quantize import quantize_checkpoint

    _check_output(args)
    report = quantize_checkpoint(
        args.model, args.output, args.format, include=args.include, exclude=args.exclude,
        fp8_format="F8_E5M2" if args.e5m2 else "F8_E4M3", per_row=args.per_row,
        threads=args.threads,
        progress=None if (args.dry_run or args.quiet or args.json) else _ProgressPrinter(),
        dry_run=args.dry_run, digests=not args.no_digests)
    if args.json:
        _print(_json(report.as_dict()))
        return 0
    lines = [report.summary()]
    if args.verbose:
        lines += [f"  {printable(name)}" for name in report.quantized]
        lines += [f"  kept: {printable(name)} ({why})" for name, why in report.kept.items()]
    _print("\n".join(lines))
    return 0


def _rank_rule(args):
    """{rule: value} of the one rank rule a resize or merge command was given."""
    rules = {"rank": args.rank, "energy": args.energy, "sv_ratio": args.sv_ratio,
             "sv_fro": args.sv_fro, "sv_cumulative": args.sv_cumulative}
    given = [k for k, v in rules.items() if v is not None]
    if len(given) != 1:
        named = ", ".join("--" + g.replace("_", "-") for g in given)
        raise _argument_error("give one of --rank, --energy, --sv-ratio, --sv-fro, "
                              "--sv-cumulative" + (f" (got {named})" if given else ""))
    return {given[0]: rules[given[0]]}


def _cmd_resize(args):
    from .files.resize import resize_lora

    _check_output(args)
    report = resize_lora(
        args.lora, args.output, max_rank=args.max_rank, alpha=args.alpha, dtype=args.dtype,
        threads=args.threads, progress=None if (args.quiet or args.json) else _ProgressPrinter(),
        **_rank_rule(args))
    return _print_ranks(args, report, "rank")


def _cmd_merge(args):
    from .files.resize import merge_loras

    _check_output(args)
    report = merge_loras(
        [_lora_arg(item) for item in args.loras], args.output, max_rank=args.max_rank,
        keys=args.keys, alpha=args.alpha, dtype=args.dtype, threads=args.threads,
        progress=None if (args.quiet or args.json) else _ProgressPrinter(), **_rank_rule(args))
    return _print_ranks(args, report, "ranks")


def _print_ranks(args, report, word):
    """A resize's or merge's report: JSON, or its summary (-v: each module's ranks)."""
    from .errors import printable

    if args.json:
        _print(_json(report.as_dict()))
        return 0
    lines = [report.summary()]
    if args.verbose:
        lines += [f"  {printable(module)}  {word} {a} -> {b}, kept {kept:.4f}"
                  for module, (a, b, kept) in report.ranks.items()]
    _print("\n".join(lines))
    return 0


def _json(data):
    """A report as JSON on stdout, alone there: names from files as they are (JSON escapes
    what a terminal must not see), a non-finite number as null."""
    return json.dumps(_finite(data), indent=2)


def _finite(value):
    """``value`` with every float that is not finite made None: JSON has no inf or NaN."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _fraction(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text}")
    return value


def _is_stdout(path):
    """Whether ``path`` is the regular file standard output writes to (a pipe or terminal is
    refused as the output by the writer)."""
    import stat

    try:
        st = os.stat(path)
        return stat.S_ISREG(st.st_mode) and os.path.samestat(st, os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # no such file, or no real stdout
        return False


def _cli_words(text):
    """A library message with its keyword arguments spelled as this command's options."""
    for keyword, flag in _FLAGS:
        text = text.replace(keyword, flag)
    return text


def _print(text, stream=None):
    """Print what any terminal takes: the output is already written, so a name the stream's
    encoding lacks must not turn success into an error."""
    stream = stream or sys.stdout
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream,
              flush=True)
    except BrokenPipeError:
        # the reader stopped reading (| head): the rest goes nowhere, quietly, as with any
        # Unix tool; the command's exit code is its own
        _silence(stream)


def _silence(stream):
    """Point a stream whose pipe is closed at /dev/null, so that nothing more written to it
    (Python's own flush at exit included) fails."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _thread_count(text):
    from ._threads import MAX_THREADS

    value = _positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {text}")
    return value


def _power_iterations(text):
    from .extract import MAX_POWER_ITERATIONS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 0 <= value <= MAX_POWER_ITERATIONS:
        raise argparse.ArgumentTypeError(f"expected 0 to {MAX_POWER_ITERATIONS}, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake told in one line (and where to read more) instead of the
    whole usage, by the command it belongs to."""

    commands = None  # the top-level parser's: command name -> its parser

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        if self.commands is not None:
            # an option before any command: argparse would say the command is missing
            for token in args:
                if not token.startswith("-"):
                    break
                if token.split("=")[0] not in self._option_string_actions:
                    self.error(f"unrecognized option {token}")
        known, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.commands.get(getattr(known, "command", None), self) \
                if self.commands else self
            owner.error(f"unrecognized arguments: {' '.join(extras)}")
        return known


#: ``ltx2blas quantize --format``'s choices (ltx2blas.quantized.QUANTIZE_FORMATS, spelled out
#: here so that the parser loads no compiled module).
FORMATS_TEXT = ("comfy_fp8", "comfy_nvfp4", "comfy_mxfp8", "comfy_int8", "fp8_scaled", "nvfp4",
                "fp8_block")


def _rank_rule_arguments(p, what, delta):
    """The rank rules of resize and merge: --rank, --energy, kohya's three, --max-rank."""
    p.add_argument("--rank", type=_positive_int, default=None, help=f"every {what} at this rank")
    p.add_argument("--energy", type=_fraction, default=None,
                   help=f"each module at the least rank keeping this fraction of its {delta}'s "
                        "Frobenius norm")
    p.add_argument("--sv-ratio", type=float, default=None, metavar="X",
                   help="kohya's rule: the singular values above the largest / X, plus one")
    p.add_argument("--sv-fro", type=_fraction, default=None, metavar="F",
                   help="kohya's rule: the least rank keeping fraction F of the Frobenius norm, "
                        "plus one")
    p.add_argument("--sv-cumulative", type=_fraction, default=None, metavar="F",
                   help="kohya's rule: the least rank whose singular values sum to fraction F "
                        "of their total, plus one")
    p.add_argument("--max-rank", type=_positive_int, default=None,
                   help="the largest rank --energy and the kohya rules may choose")


def _factor_command_arguments(p, listed):
    """--alpha, --threads, --json, -q and -v of resize and merge."""
    p.add_argument("--alpha", choices=("scale", "ignore"), default="scale",
                   help="scale (default): a file's alpha is part of its delta, as ComfyUI, "
                        "diffusers and kohya read it; ignore: as upstream LTX-2 reads it")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use; the same bytes for "
                        "any count)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (and no progress)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true", help=f"list {listed}")


def build_parser():
    from . import __version__

    parser = _Parser(prog="ltx2blas", description=__doc__.split("\n\n")[0].replace("\n", " "),
                     epilog="Exit codes: " + __doc__.split("Exit codes: ")[1].replace("\n", " "))
    parser.add_argument("--version", action="version", version=f"ltx2blas {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    parser.commands = sub.choices

    p = sub.add_parser("info", help="versions, BLAS, threads, CPU features, sgemm exact depth")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("fuse", help="fuse adapter files into a safetensors checkpoint",
                       description="Fuse LoRA adapters into a checkpoint, tensor by tensor, "
                                   "writing a new checkpoint.")
    p.add_argument("model", help="model .safetensors file, sharded .safetensors.index.json, or "
                                 "diffusers model folder")
    p.add_argument("--lora", action="append", required=True, metavar="PATH[:STRENGTH]",
                   help="adapter file and strength (default 1.0); repeat for several")
    p.add_argument("-o", "--output", help="output .safetensors file (not needed with --dry-run)")
    p.add_argument("--rule", choices=("addmm", "sum"), default="addmm",
                   help="how several adapters on one weight combine: addmm (upstream LTX-2 "
                        "today, the default) or sum (its first release)")
    p.add_argument("--alpha", choices=("scale", "ignore"), default="scale",
                   help="scale a pair by its file's alpha / rank (ComfyUI, PEFT; the default) "
                        "or ignore alpha (upstream LTX-2)")
    p.add_argument("--allow-unmatched", action="store_true",
                   help="fuse what matches when some adapter modules match no weight, and list "
                        "them (by default that is an error and nothing is written)")
    p.add_argument("--allow-repeated", action="store_true",
                   help="fuse an adapter given twice (the same file, or a copy of it) twice; "
                        "by default that is an error and nothing is written")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and match, report what would be fused, write nothing")
    p.add_argument("--check-finite", action="store_true",
                   help="refuse inf/NaN in adapters or weights, and results that overflow")
    p.add_argument("--allow-overflow", action="store_true",
                   help="store a bf16 value that the fuse takes past bf16's largest to +-inf "
                        "(upstream's behaviour), counted in the summary; by default that is an "
                        "error (exit 5) naming the tensor and position, and nothing is written")
    p.add_argument("--force", action="store_true",
                   help="fuse even into a checkpoint whose metadata says it already holds a fused adapter")
    p.add_argument("--fp8-rounding", choices=("nearest", "stochastic"), default="nearest",
                   help="rounding into fp8 weights (default nearest-even, upstream's CPU rule)")
    p.add_argument("--fp8-overflow", choices=("saturate", "nan"), default="saturate",
                   help="what a plain F8_E4M3 value rounded past 448 becomes: saturate, +-448, "
                        "as torch casts from 2.13 (the default), or nan, as torch cast up to "
                        "2.12")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of --fp8-rounding stochastic (default 0; bits differ per tensor "
                        "name)")
    p.add_argument("--no-digests", action="store_true",
                   help="record no digests of the adapters and the output in the metadata "
                        "(faster on few cores; ltx2blas verify then needs the inputs)")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (and no progress)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every weight fused (or, with --dry-run, to be fused) and its "
                        "adapters")
    p.add_argument("--to", choices=FORMATS_TEXT, default=None, metavar="FORMAT",
                   help="quantise the output's weights into FORMAT as they are written (the "
                        "format owner's choice of layers, as `ltx2blas quantize --format` "
                        "makes of the bf16 fuse): " + ", ".join(FORMATS_TEXT))
    p.set_defaults(func=_cmd_fuse)

    p = sub.add_parser("verify", help="check a fused checkpoint against its record and inputs",
                       description="Check a fused checkpoint: every tensor against the SHA-256 "
                                   "its fuse recorded; with --model and --lora, the inputs "
                                   "against the record and every fused tensor rebuilt from them "
                                   "and compared byte for byte. Exit 0 when everything matches, "
                                   "1 when something differs, 6 when the file holds no record "
                                   "this ltx2blas can check (another tool's file, an older "
                                   "contract) and no inputs settle it.")
    p.add_argument("fused", help="the fused .safetensors file")
    p.add_argument("--model", help="the base checkpoint it was fused from")
    p.add_argument("--lora", action="append", metavar="PATH[:STRENGTH]",
                   help="an adapter, in the order fused; without a strength, the recorded one")
    p.add_argument("--rule", choices=("addmm", "sum"), default=None,
                   help="the rule it is claimed to be fused by (default: the recorded one)")
    p.add_argument("--alpha", choices=("scale", "ignore"), default=None,
                   help="the alpha mode it is claimed to be fused with (default: the recorded "
                        "one)")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("extract", help="extract a LoRA from a fine-tuned checkpoint and its base",
                       description="Extract a LoRA whose pairs approximate the differences "
                                   "between a fine-tuned checkpoint and its base, weight by "
                                   "weight (a randomized SVD, the same bytes for any thread "
                                   "count), at a fixed rank or keeping a fraction of each "
                                   "difference's Frobenius norm.")
    p.add_argument("tuned", help="the fine-tuned checkpoint (.safetensors file, sharded index or "
                                 "diffusers model folder)")
    p.add_argument("--base", required=True, help="the checkpoint it was tuned from")
    p.add_argument("-o", "--output",
                   help="the LoRA .safetensors file to write (not needed with --dry-run)")
    p.add_argument("--rank", type=_positive_int, default=None,
                   help="every weight at this rank (the default, 64, without --energy)")
    p.add_argument("--energy", type=_fraction, default=None,
                   help="each weight at the least rank keeping this fraction of its "
                        "difference's Frobenius norm, up to --max-rank")
    p.add_argument("--max-rank", type=_positive_int, default=256,
                   help="the largest rank --energy may choose (default 256)")
    p.add_argument("--keys", choices=("ltx", "diffusers", "comfy"), default="ltx",
                   help="key spelling: ltx, upstream LTX-2's trainer's (the default); "
                        "diffusers; or comfy, ComfyUI's and kohya's (lora_down / lora_up)")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="the factors' storage (default bf16)")
    p.add_argument("--full-diff", action="store_true",
                   help="write the 1-D weights and biases that differ (norms, biases) as "
                        "full differences (.diff, .diff_b), which the fuse adds back; every "
                        "tensor that differs and is no Linear weight is listed either way")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random test matrix (default 0)")
    p.add_argument("--power-iterations", type=_power_iterations, default=2,
                   help="power iterations of the range finder, 0 to 16 (default 2): each "
                        "costs two more passes over every weight, and two already keep the "
                        "error within 2%% of the optimum")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--weights-at-once", type=_positive_int, default=None,
                   help="weights extracted side by side, the threads shared among them "
                        "(default: one per 4 threads); the same file either way, memory for "
                        "that many weights")
    p.add_argument("--dry-run", action="store_true",
                   help="plan from the headers, reading no weight: the weights, their ranks "
                        "(with --energy the largest each may get) and the output's size at "
                        "most; write nothing")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (and no progress)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every weight extracted and its rank and fraction kept (with "
                        "--dry-run, every weight planned and its rank)")
    p.set_defaults(func=_cmd_extract)

    p = sub.add_parser("quantize", help="quantise a bf16 checkpoint's Linear weights into "
                                        "ComfyUI's or upstream's fp8, NVFP4, MXFP8 or int8",
                       description="Quantise a bf16 checkpoint's Linear weights into a layout of "
                                   "their owners, byte for byte as the owner's quantiser writes "
                                   "it, streaming, and write a new checkpoint; the layers are "
                                   "the format owner's choice unless --include / --exclude "
                                   "change it.")
    p.add_argument("model", help="the bf16 checkpoint (.safetensors file, sharded index or "
                                 "diffusers model folder)")
    p.add_argument("-o", "--output",
                   help="the .safetensors file to write (not needed with --dry-run)")
    p.add_argument("--format", required=True, choices=FORMATS_TEXT,
                   help="comfy_fp8, comfy_nvfp4, comfy_mxfp8, comfy_int8 (ComfyUI's, with its "
                        "comfy_quant markers); fp8_scaled, nvfp4, fp8_block (upstream "
                        "LTX-2's)")
    p.add_argument("--include", action="append", metavar="GLOB",
                   help="also quantise the Linears whose module names match (repeat for "
                        "several)")
    p.add_argument("--exclude", action="append", metavar="GLOB",
                   help="keep bf16 the Linears whose module names match (repeat for several)")
    p.add_argument("--e5m2", action="store_true", help="comfy_fp8 with e5m2 codes (default "
                                                       "e4m3)")
    p.add_argument("--per-row", action="store_true",
                   help="comfy_int8 with one scale a row (default one a tensor)")
    p.add_argument("--no-digests", action="store_true",
                   help="record no digests (ltx2blas verify then checks the file only by a "
                        "rebuild from the base)")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--dry-run", action="store_true",
                   help="plan from the header: the weights, those kept and why, the output's "
                        "size; write nothing")
    p.add_argument("--json", action="store_true",
                   help="print the report as JSON (and no progress)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="list every weight quantised and every one kept")
    p.set_defaults(func=_cmd_quantize)

    p = sub.add_parser("resize", help="re-factor a LoRA at a smaller rank, at the optimum",
                       description="Re-factor every LoRA pair of a file at a smaller rank: the "
                                   "best approximation of each pair's delta at that rank "
                                   "(from a QR of each factor and a small SVD, no full delta), "
                                   "its scale folded in and .alpha set to the new rank, keys in "
                                   "the input's spelling.")
    p.add_argument("lora", help="the LoRA .safetensors file")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    _rank_rule_arguments(p, "module", "delta")
    p.add_argument("--dtype", choices=("bf16", "f32"), default=None,
                   help="the new factors' storage (default: bf16 unless every factor is f32)")
    _factor_command_arguments(p, "every module with its old and new rank and fraction kept")
    p.set_defaults(func=_cmd_resize, dry_run=False)

    p = sub.add_parser("merge", help="merge LoRAs into one, at the optimum for its rank",
                       description="Merge LoRA files into one LoRA whose every module is the "
                                   "best approximation, at its rank, of the sum of the inputs' "
                                   "deltas at their strengths (the factors stacked, exact, then "
                                   "re-factored as resize does).")
    p.add_argument("loras", nargs="+", metavar="LORA[:STRENGTH]",
                   help="the LoRA files, each with its strength (1.0 by default)")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    _rank_rule_arguments(p, "module at most (the inputs' ranks added keep the sum whole)",
                         "summed delta")
    p.add_argument("--keys", choices=("ltx", "diffusers", "comfy"), default=None,
                   help="the output's key spelling (default: the first input's)")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="the factors' storage (default bf16)")
    _factor_command_arguments(p, "every module with its ranks and fraction kept")
    p.set_defaults(func=_cmd_merge, dry_run=False)

    p = sub.add_parser("demo", help="fuse an LTX-2-shaped adapter in memory, check it, time it",
                       description="Fuse an LTX-2-shaped adapter into a weight in memory, check "
                                   "the result against the reference loop, and time it against "
                                   "the same run's sgemm; then write a small checkpoint and "
                                   "adapter to a temporary folder and fuse them as ltx2blas "
                                   "fuse does.")
    p.add_argument("--threads", type=_thread_count, default=None,
                   help="threads (default: every CPU this process may use)")
    p.add_argument("--rank", type=_positive_int, default=384, help="adapter rank (default 384)")
    p.add_argument("--rows", type=_positive_int, default=4096, help="weight rows (default 4096)")
    p.add_argument("--cols", type=_positive_int, default=4096,
                   help="weight columns (default 4096)")
    p.add_argument("--no-files", action="store_true",
                   help="skip the part that writes and fuses a small checkpoint in a temp folder")
    p.set_defaults(func=_cmd_demo)
    return parser


def exit_code(exc):
    """The exit code for an error (see the module docstring)."""
    from .errors import FormatError, NumericsError

    if isinstance(exc, NumericsError):
        return 5
    if isinstance(exc, FormatError):
        return 3
    if isinstance(exc, (OSError, MemoryError)):
        return 4
    return 2


def _message(exc):
    """One line for an error: its own message, without the [Errno N] an OSError prefixes."""
    if isinstance(exc, MemoryError):
        return "out of memory" + (f" ({exc})" if str(exc) else "")
    from .errors import printable

    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    # names from files may hold newlines and escape sequences: one printable line
    return _cli_words(printable(text.strip()) or type(exc).__name__)


_Terminated = _stop.Terminated


def _handle_signals():
    """Handlers for Ctrl-C, SIGTERM and SIGHUP (timeout, systemd, docker stop, a closed
    terminal), and the watchdog that ends the process should a stop's clean-up hang; returns
    (the previous handlers, the previous wakeup fd).  Only the main thread may set them."""
    if threading.current_thread() is not threading.main_thread():
        return {}, None
    previous = {sig: signal.signal(sig, _stop.on_signal) for sig in _stop.STOP_SIGNALS}
    return previous, _stop.arm()


def _quiet_stop(unraisable):
    """A stop raised where Python cannot raise (a __del__, a callback) is not a traceback: the
    signal stays recorded and stops the command at its next check."""
    if isinstance(unraisable.exc_value, (KeyboardInterrupt, _stop.Terminated)):
        return
    if isinstance(unraisable.exc_value, OSError) and "ignored due to race condition" in str(
            unraisable.exc_value):
        return  # a signal that came as main() set it ignored on its way out
    sys.__unraisablehook__(unraisable)


def _stopped(signum):
    """The exit of a command a stop signal reached: 128 + n and one line, unless its output
    was already complete (renamed into place), which it then says (exit 0)."""
    if _stop.state.complete is not None:
        return _stop.report(0, _stop.complete_line(signum, _stop.state.complete), sys.stderr)
    return _stop.report(128 + signum, _stop.stop_line(signum), sys.stderr)


def _interrupt_handled():
    """CPython ends the process by SIGINT at exit where it believes a KeyboardInterrupt went
    unhandled, and a nested evaluation that the interrupt passed on its way here can leave it
    believing so (seen under ``python -m``): the exit must be the code main() returns."""
    try:
        import ctypes

        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ImportError, AttributeError, ValueError, OSError):
        pass


def main(argv=None):
    """Runs the command line; returns the exit code.

    A stop signal (SIGINT, SIGTERM, SIGHUP) ends a command with 128 + n before its output is
    renamed into place, nothing changed; after the rename it is reported as coming after the
    complete output, exit 0.  Later signals are ignored, and so are signals after the return
    where a signal came or where this is the command line itself (``argv`` None): the process
    is on its way out, and a signal then must neither kill it nor print a traceback.  Called
    with ``argv`` (from Python), the previous handlers are restored after a command that no
    signal reached."""
    _stop.reset()
    previous, wakeup = _handle_signals()
    hook, sys.unraisablehook = sys.unraisablehook, _quiet_stop
    keep = argv is None
    code = None
    try:
        args = build_parser().parse_args(argv)
        # the commit of the output of fuse, extract and quantize is the command's result
        _stop.state.final = args.func in (_cmd_fuse, _cmd_extract, _cmd_quantize, _cmd_resize,
                                        _cmd_merge)
        code = args.func(args)
        if _stop.state.signum is not None:
            # deferred: it came after the output was complete (exit 0, said so), or Python
            # swallowed its exception where it could not raise (128 + n)
            return _stopped(_stop.state.signum)
        return _stop.report(code, None, sys.stderr)
    except KeyboardInterrupt:
        return _stopped(signal.SIGINT)
    except _stop.Terminated as exc:
        return _stopped(exc.signum)
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        raise
    except BrokenPipeError:
        # a reader of stdout or stderr went away in the middle (demo's lines): quietly, with
        # the exit status of a tool SIGPIPE ends
        _silence(sys.stdout)
        _silence(sys.stderr)
        return _stop.report(128 + signal.SIGPIPE, None, sys.stderr)
    except (Exception, MemoryError) as exc:
        from .errors import Ltx2BlasError

        known = (Ltx2BlasError, OSError, ValueError, TypeError, MemoryError)
        if not isinstance(exc, known) or (
                not isinstance(exc, (Ltx2BlasError, OSError, MemoryError))
                and os.environ.get("LTX2BLAS_DEBUG")):
            raise
        _print(f"ltx2blas: error: {_message(exc)}", sys.stderr)
        return _stop.report(exit_code(exc), None, sys.stderr)
    finally:
        if _stop.state.exit_code is None:  # an exception on its way out (or SystemExit)
            _stop.state.exit_code = 2 if code is None else code
        stopped = _stop.state.signum is not None
        if stopped:
            _interrupt_handled()
        if keep:
            # Python's finalization puts back the default action of a signal with a Python
            # handler (a signal then would kill the process), but leaves SIG_IGN alone
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
        elif not stopped:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            sys.unraisablehook = hook
        if not keep and wakeup is not None:
            _stop.disarm(wakeup)


if __name__ == "__main__":
    sys.exit(main())
