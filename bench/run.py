"""The benchmark suite: ltx2blas against the machine's ceilings and against what a user would
use instead, at every thread count, in one run.

    python bench/run.py [--quick] [--threads 1,2,...] [--only fuse,linear,checkpoint,features]
                        [--out DIR]

Run it against the installed package (``pip install ".[bench]"``), from any directory.

It takes a while, and more with every thread count (the default is every count from 1 to every
CPU). At ``--threads 1,2`` on 2 cores the whole suite took 1180 s (an AMD EPYC Zen 5) and 1419
and 1469 s (an AMD EPYC Zen 4), both with AVX512_BF16 and torch 2.13 installed. Where the CPU
lacks AVX512_BF16, torch's bf16 matmul, a peer of the fuse and the Linear, is slow (100-300
times our fuse's time): with torch installed, the fuse part alone took 1545 s and the Linear
part 3321 s on an AMD EPYC Zen 4 with AVX-512 hidden, 2 cores. ``--only`` runs fewer parts;
``--quick`` runs every part on small shapes: 50 s at ``--threads 1``, 85 s at ``--threads
1,2`` on 2 cores of an AMD EPYC Zen 4. The run first says how long it expects to take here,
then each part and each row as it is measured, with the time elapsed.

As each part ends it writes DIR/results.json (every row so far, with the machine: CPU, cores,
BLAS and its kernels, versions, date; and each part's time), DIR/results.md (the tables) and PNG
plots, so that a run stopped by Ctrl-C, SIGTERM or SIGHUP keeps the parts it finished. DIR is
made when the first part's results are written: a run stopped before then leaves no folder.

No timing here is a pass/fail test: repeats are interleaved and warmed up, each candidate
judged by its fastest sample (harness.STAT), medians and spreads recorded; every row's result
is checked against the reference. The exit status is 1 if any check failed; 130, 143 or 129
when stopped by Ctrl-C, SIGTERM or SIGHUP.
"""
import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WORKLOADS = ("fuse", "linear", "checkpoint", "features")

#: Seconds each part took at one thread on 2 cores of an AMD EPYC Zen 4 with AVX512_BF16 and
#: torch installed, (full, --quick): the full suite's 1469 s there shared out by its rows'
#: timings; --quick measured.
SECONDS = {"fuse": (240, 13), "linear": (560, 20), "checkpoint": (25, 7), "features": (55, 4)}
#: Another thread count t takes about t ** -SCALING of a part's time at one thread, (full,
#: --quick): at two threads the full parts took 0.5-0.84 of it, the quick ones, mostly pauses
#: between samples, 0.44-0.85.
SCALING = (0.7, 0.2)
#: The ceilings and the machine's description, each thread count, (full, --quick).
CEILING_SECONDS = (10, 3)
#: Without AVX512_BF16 (no `avx512bf16` kernel table): torch's bf16 matmul makes the fuse and the
#: Linear about 4 times as long where torch is installed (1545 s and 3321 s for those parts on
#: the Zen 4 with AVX-512 hidden); the checkpoint and the feature extractor run on FMA kernels.
WITHOUT_BF16 = {"fuse": 4.0, "linear": 4.0, "checkpoint": 2.4, "features": 2.4}
MEASURED = ("at --threads 1,2 on 2 cores the whole suite took 20-25 min with AVX512_BF16 (AMD "
            "EPYC Zen 5, Zen 4), and the fuse and the Linear alone 81 min without it, torch "
            "installed")
QUICK_MEASURED = "at --threads 1,2 on 2 cores of an AMD EPYC Zen 4 it took 85 s"


def parts(quick):
    """name -> (rows a thread count, run(threads, ceilings, log) -> rows)."""
    import bench_checkpoint
    import bench_features
    import bench_fuse
    import bench_linear

    if quick:
        shapes, ranks, fuse_kw = [(2048, 2048)], [32, 450], {"repeats": 3}
        outs, rows, linear_kw = [256], [1, 8, 64], {"repeats": 2, "short_repeats": 2}
        blocks, rank, checkpoint_kw = 1, 64, {"repeats": 1}
        tokens, outs_f, features_kw = 48, (256, 128), {"repeats": 1}
    else:
        shapes, ranks, fuse_kw = bench_fuse.SHAPES, bench_fuse.RANKS, {}
        outs, rows, linear_kw = bench_linear.OUTS, bench_linear.ROWS, {}
        blocks, rank, checkpoint_kw = 2, 384, {"repeats": 3}
        tokens, outs_f, features_kw = 1024, (4096, 2048), {}
    return {
        "fuse": (len(shapes) * len(ranks), lambda threads, ceilings, log: bench_fuse.run(
            threads, shapes, ranks, ceilings, log=log, **fuse_kw)),
        "linear": (len(outs) * len(rows), lambda threads, ceilings, log: bench_linear.run(
            threads, outs, rows, ceilings, log=log, **linear_kw)),
        "checkpoint": (1, lambda threads, ceilings, log: bench_checkpoint.run(
            threads, blocks, rank, ceilings, log=log, **checkpoint_kw)),
        "features": (1, lambda threads, ceilings, log: bench_features.run(
            threads, tokens, 0.3, outs_f, ceilings, log=log, **features_kw)),
    }


def estimate(name, threads, quick):
    """Seconds a part (or "ceilings") should take here: SECONDS scaled to the thread counts, by
    WITHOUT_BF16 on a CPU without the bf16 dot-product kernels."""
    import peers
    from ltx2blas import _gemm

    if name == "ceilings":
        return CEILING_SECONDS[quick] * len(threads)
    factor = 1.0
    if "bf16" not in _gemm.kernel_name() and (
            name in ("checkpoint", "features") or peers.torch_module() is not None):
        factor = WITHOUT_BF16[name]
    return SECONDS[name][quick] * factor * sum(t ** -SCALING[quick] for t in threads)


def count(n, word):
    return f"{n} {word}" + ("" if n == 1 else "s")


def clock(seconds):
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Stopped(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that
    the run ends the same way: what it finished kept, one line said."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    for name in ("SIGTERM", "SIGHUP"):  # a second signal must not interrupt the ending
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    raise Stopped(signum)


class Output:
    """The output folder, made when the first results are written: a run stopped before then
    leaves no folder behind. results.json and results.md are replaced whole, never left half
    written."""

    def __init__(self, folder):
        self.folder = folder

    def check(self):
        """Fail now, not after the first part, if the folder cannot be made or written."""
        path = os.path.abspath(self.folder)
        if os.path.exists(path) and not os.path.isdir(path):
            sys.exit(f"bench: --out {self.folder} is a file, not a folder")
        while not os.path.exists(path):
            path = os.path.dirname(path)
        if not os.access(path, os.W_OK | os.X_OK):
            sys.exit(f"bench: cannot write the results under {path} (permission denied)")

    def _replace(self, name, text):
        path = os.path.join(self.folder, name)
        try:
            with open(path + ".partial", "w") as f:
                f.write(text)
            os.replace(path + ".partial", path)
        finally:
            if os.path.exists(path + ".partial"):
                os.unlink(path + ".partial")

    def write(self, results, text):
        """results.json and results.md."""
        import json

        made = not os.path.isdir(self.folder)
        os.makedirs(self.folder, exist_ok=True)
        try:
            self._replace("results.json", json.dumps(results, indent=1, default=str))
            self._replace("results.md", text)
        except BaseException:
            if made and not os.listdir(self.folder):
                os.rmdir(self.folder)
            raise

    def plots(self, results):
        """The PNG plots (none without matplotlib); returns their paths."""
        import report

        return report.plots(results, self.folder)


def markdown(results, pending):
    """results.md, saying which parts are not in it yet."""
    import report

    text = report.markdown(results)
    if not pending:
        return text
    title, rest = text.split("\n", 1)
    return (f"{title}\n\nNot run (the run stopped, or was still running, when this was written): "
            f"{', '.join(pending)}.\n{rest}")


def kept(state, output):
    done = state["done"]
    return f"kept {', '.join(done)} in {output.folder}" if done else "nothing written"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 2)[2].replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, few repeats: 50-85 s on 2 cores")
    parser.add_argument("--threads", default=None, help="comma list (default: 1 .. every CPU)")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma list of workloads (default: {','.join(WORKLOADS)})")
    parser.add_argument("--out", default=None,
                        help="output folder (default: bench/results-<date> beside this script)")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - set(WORKLOADS))
    if unknown or not only:
        parser.error(f"unknown workload(s) {unknown}; choose from {WORKLOADS}")
    only = [w for w in WORKLOADS if w in only]
    threads = harness.thread_counts(args.threads)
    output = Output(args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "results-" + time.strftime("%Y%m%d-%H%M%S")))
    output.check()
    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            previous[getattr(signal, name)] = signal.signal(getattr(signal, name), _stop)
    t0 = time.perf_counter()
    state = {"done": [], "now": "the ceilings"}
    try:
        failed = run(args, only, threads, output, t0, state)
        return 1 if failed else 0
    except (KeyboardInterrupt, Stopped) as exc:
        how = ("interrupted" if isinstance(exc, KeyboardInterrupt)
               else f"terminated by {signal.Signals(exc.signum).name}")
        print(f"bench: {how} after {clock(time.perf_counter() - t0)}, during {state['now']}; "
              f"{kept(state, output)}", file=sys.stderr, flush=True)
        return 130 if isinstance(exc, KeyboardInterrupt) else 128 + exc.signum
    except BaseException:
        print(f"bench: stopped by the error below, during {state['now']}; {kept(state, output)}",
              file=sys.stderr, flush=True)
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(args, only, threads, output, t0, state):
    """The ceilings, then each part, its results written as it ends (state: the parts done, the
    step running); returns the rows whose check failed."""
    import report

    def say(text):
        print(f"[{clock(time.perf_counter() - t0):>7}] {text}", flush=True)

    plan = parts(args.quick)
    guess = {name: estimate(name, threads, args.quick) for name in ["ceilings", *only]}
    print(f"bench: {', '.join(only)} at threads {','.join(map(str, threads))}"
          f"{' (quick)' if args.quick else ''}: about {clock(sum(guess.values()))} here, by an "
          f"estimate from other runs ({QUICK_MEASURED if args.quick else MEASURED}). Each "
          f"part's results are written to {output.folder} as it ends.", flush=True)
    ceilings = {}
    for t in threads:
        ceilings[t] = harness.ceilings(t, n=1024 if args.quick else 2048,
                                       bandwidth_mib=256 if args.quick else 1024,
                                       repeats=3 if args.quick else 5)
        c = ceilings[t]
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in c["peaks_gflops"].items())
        say(f"ceilings, {count(t, 'thread')}: sgemm {c['sgemm_gflops']:.0f} GFLOP/s, dgemm "
            f"{c['dgemm_gflops']:.0f} GFLOP/s, read {c['read_gbs']:.1f} GB/s; register-only "
            f"peaks (GFLOP/s): {peaks or 'none (no C compiler)'}")
    rows, timings, figures = [], [], []
    machine = harness.machine()
    for index, name in enumerate(only, 1):
        per_thread, measure = plan[name]
        total, seen = per_thread * len(threads), [0]
        step = f"part {index}/{len(only)} {name}"
        say(f"{step}: {count(total, 'row')}, about {clock(guess[name])} by estimate")
        state["now"] = step

        def log(text, step=step, name=name, total=total, seen=seen):
            if text.startswith(name):  # a row's line; the others say what is being built
                seen[0] += 1
                say(f"{step}, row {seen[0]}/{total}: {text}")
            else:
                say(f"{step}: {text}")

        started = time.perf_counter()
        rows += measure(threads, ceilings, log)
        timings.append({"workload": name, "seconds": time.perf_counter() - started,
                        "rows": sum(r["workload"] == name for r in rows)})
        report.annotate(rows)
        pending = only[index:]
        results = {"machine": machine, "quick": args.quick,
                   "ceilings": [ceilings[t] for t in threads], "rows": rows,
                   "parts": timings, "not_run": pending, "complete": not pending,
                   "seconds": time.perf_counter() - t0}
        state["now"] = f"the writing of {name}'s results"
        output.write(results, markdown(results, pending))
        state["done"].append(name)
        figures = output.plots(results)
        state["now"] = "the next part"
        plots = f", {count(len(figures), 'plot')}" if figures else ""
        say(f"{step} done in {clock(timings[-1]['seconds'])}: results.json, results.md{plots} "
            f"in {output.folder}")
    failed = [r for r in rows if not r["checked"]]
    print(f"bench: {len(rows)} rows in {clock(time.perf_counter() - t0)} -> {output.folder} "
          f"(results.json, results.md"
          f"{f', {len(figures)} plots' if figures else ', no plots: matplotlib not installed'})"
          + (f"; {len(failed)} rows FAILED their check" if failed else "; every row checked"),
          flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
