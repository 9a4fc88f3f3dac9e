"""Shared measuring tools for the benchmarks: interleaved repetitions, ceilings.

Machines here are shared and noisy, so every figure is a ratio of timings taken in the same
run, with the competing candidates' repetitions interleaved (A B C A B C ...), after a warm-up,
and every candidate judged by the same statistic, STAT.
"""
import json
import os
import platform
import statistics
import sys
import time

import numpy as np


#: The sample of each candidate's interleaved timings that the figures use: the fastest. On a
#: shared host noise only ever slows a call down (another tenant's burst, a worker thread woken
#: late), so the fastest sample is the nearest to what the code costs -- timeit's rule -- and
#: taking it for every candidate alike (ours, the peers, the sgemm and bandwidth ceilings) keeps
#: each ratio like with like. Medians are recorded beside it.
STAT = "min"


def thread_counts(text):
    """A comma list of thread counts ("1,2,4"), or every count from 1 to every CPU for None."""
    if text:
        return [int(t) for t in text.split(",")]
    from ltx2blas._threads import available_cpus

    return list(range(1, available_cpus() + 1))


def best_time(fn, repeats=3, clock=time.perf_counter):
    """The shortest of ``repeats`` timed calls, after one untimed call. ``clock`` returns
    seconds (a test passes one that advances by fixed amounts, so that its result does not
    depend on the machine's load)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


#: A candidate whose warm-up call takes this many times the first candidate's is timed by that
#: call alone: a peer a hundred times slower (torch's bf16 matmul on a CPU without bf16
#: instructions) would otherwise take most of a run, and its figure needs no precision.
SLOW_PEER = 20.0


def interleaved(candidates, repeats=5, warmup=1, min_seconds=0.0, settle=0.25, min_sample=0.05,
                clock=time.perf_counter):
    """Time every callable in ``candidates`` (name -> fn) ``repeats`` times, round-robin.

    ``settle`` seconds pass, untimed, before each timing: BLAS and OpenMP worker threads keep
    spinning for a while after a parallel call (OpenBLAS ~0.1 s; torch carries an OpenMP runtime
    of its own), and would otherwise steal cores from whichever candidate runs next.

    A candidate whose warm-up call took less than ``min_sample`` seconds is called that many
    more times back to back within each timing, and the time per call recorded: after the settle
    pause a parallel call first wakes its idle worker threads, which on a virtual machine costs
    milliseconds and would swamp a call of a few milliseconds.

    A candidate whose warm-up call took more than SLOW_PEER times the first candidate's is not
    called again: that call is its one sample.

    ``clock`` returns seconds and times every call and ``min_seconds``: a test passes one that
    advances by fixed amounts, so that which candidate counts as slow does not depend on the
    machine's load.

    Returns name -> {"median": s, "min": s, "max": s, "spread": (max - min) / median, "n",
    "samples": every timing in round order}, times per call.  Candidates timed every round
    have samples that pair by round (round_ratios)."""
    inner = dict.fromkeys(candidates, 1)
    warm = {}
    for _ in range(warmup):
        for name, fn in candidates.items():
            time.sleep(settle)
            t0 = clock()
            fn()
            warm[name] = once = clock() - t0
            inner[name] = max(1, min(1000, int(min_sample / max(once, 1e-6)) + 1))
    first = next(iter(candidates))
    slow = {name for name in warm if name != first and warm[name] > SLOW_PEER * warm[first]}
    times = {name: [warm[name]] if name in slow else [] for name in candidates}
    t_end = clock() + min_seconds
    rounds = 0
    while rounds < repeats or clock() < t_end:
        for name, fn in candidates.items():
            if name in slow:
                continue
            time.sleep(settle)
            t0 = clock()
            for _ in range(inner[name]):
                fn()
            times[name].append((clock() - t0) / inner[name])
        rounds += 1
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"median": med, "min": min(ts), "max": max(ts),
                     "spread": (max(ts) - min(ts)) / med if med else 0.0, "n": len(ts),
                     "samples": ts}
    return out


def round_ratios(times, numerator, denominator):
    """numerator's time / denominator's, round by round, from interleaved()'s samples: each
    pair taken within one round, under the same load."""
    return [a / b for a, b in zip(times[numerator]["samples"], times[denominator]["samples"])]


def reset_peak_rss():
    """Start a new peak-memory window (Linux: clear_refs 5 resets VmHWM to the current RSS)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_mib():
    """Peak resident memory of this process since the last reset_peak_rss() (VmHWM), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reader(array, threads):
    """A callable that reads every byte of ``array`` (bf16 bits) once, one stripe per thread,
    through ltx2blas's scan kernel: the memory read rate a bandwidth-bound kernel can reach."""
    import threading

    from ltx2blas import _gemm

    stripes = np.array_split(array.reshape(-1).view(np.uint16), threads)

    def read():
        workers = [threading.Thread(target=_gemm.scan_bf16, args=(s,)) for s in stripes]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return read


def without_dot_product(call):
    """``call`` run as on a CPU without the fuse's dot-product kernel: its guard refuses every
    adapter, so the f32 kernels and sgemm take the products (the comparison in one run)."""
    def run():
        from ltx2blas import fuse

        own = fuse._pairs_exact
        fuse._pairs_exact = lambda *args: False
        try:
            return call()
        finally:
            fuse._pairs_exact = own
    return run


def square_sgemm(threads, n=2048):
    """(callable, flops): one n^3 sgemm through the BLAS ltx2blas calls, at ``threads`` threads --
    the sgemm rate as a candidate to interleave with a workload's calls, so that the rate a
    workload is divided by is measured over the same minutes as the workload itself, not only
    in a few calls at the start of the run."""
    import _ltx2blas_hooks as hooks
    from threadpoolctl import threadpool_limits

    x = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    product = np.empty((n, n), np.float32)

    def call():
        with threadpool_limits(threads, user_api="blas"):
            hooks.sgemm(x, x, out=product)
    return call, 2.0 * n**3


def ceilings(threads, n=2048, bandwidth_mib=1024, repeats=5):
    """The machine at ``threads`` threads, measured now: square sgemm and dgemm rates (GFLOP/s,
    through the BLAS ltx2blas calls), memory read bandwidth (GB/s, one stripe per thread read
    by ltx2blas's scan kernel) and the register-only peaks of the instructions the kernels run
    on (instruction_peaks).  Best of ``repeats``, each after the previous parallel call's
    worker threads have gone quiet."""

    import _ltx2blas_hooks as hooks
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(2)
    x32 = rng.standard_normal((n, n), dtype=np.float32)
    x64 = x32.astype(np.float64)
    dgemm = __import__("scipy.linalg.blas", fromlist=["dgemm"]).dgemm
    best = {"sgemm": float("inf"), "dgemm": float("inf"), "read": float("inf")}
    buffer = np.ones(bandwidth_mib << 19, np.uint16)
    product = np.empty((n, n), np.float32)
    with threadpool_limits(threads, user_api="blas"):
        hooks.sgemm(x32, x32, out=product)
        for _ in range(repeats):
            time.sleep(0.2)
            t0 = time.perf_counter()
            hooks.sgemm(x32, x32, out=product)
            best["sgemm"] = min(best["sgemm"], time.perf_counter() - t0)
            time.sleep(0.2)
            t0 = time.perf_counter()
            dgemm(1.0, x64, x64)
            best["dgemm"] = min(best["dgemm"], time.perf_counter() - t0)
    read = reader(buffer, threads)
    for _ in range(repeats):
        time.sleep(0.2)
        t0 = time.perf_counter()
        read()
        best["read"] = min(best["read"], time.perf_counter() - t0)
    time.sleep(0.2)
    return {"threads": threads, "sgemm_gflops": 2.0 * n**3 / best["sgemm"] / 1e9,
            "dgemm_gflops": 2.0 * n**3 / best["dgemm"] / 1e9,
            "read_gbs": buffer.nbytes / best["read"] / 1e9,
            "peaks_gflops": instruction_peaks(threads)}


#: bench/peaks.c's register-only loops: name -> (flops a loop iteration, the CPU features it
#: needs, as ltx2blas info names them). 24 accumulators an iteration.
PEAK_LOOPS = {
    "fma_avx2": (24 * 8 * 2, {"avx2", "fma"}),
    "fma_avx512": (24 * 16 * 2, {"avx512f"}),
    "dot_avx512bf16": (24 * 16 * 4, {"avx512f", "avx512_bf16"}),
    "fma_neon": (24 * 4 * 2, set()),
    "bfmlal_neon_bf16": (24 * 4 * 2, {"bf16"}),
    "dot_neon_bf16": (24 * 4 * 4, {"bf16"}),
    "mmla_neon_bf16": (24 * 4 * 4 * 2, {"bf16"}),
}
_C_LIBRARIES = {}


def c_library(source):
    """bench/<source> (C) compiled with the system compiler at -O2 to a shared library and
    loaded (once a process), or None without a compiler or where it fails to build."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    if source in _C_LIBRARIES:
        return _C_LIBRARIES[source]
    lib = None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is not None:
        folder = tempfile.mkdtemp(prefix="ltx2blas-bench-")
        out = os.path.join(folder, source + ".so")
        try:
            subprocess.run([cc, "-O2", "-shared", "-fPIC", os.path.join(
                os.path.dirname(os.path.abspath(__file__)), source), "-o", out], check=True)
            lib = ctypes.CDLL(out)
        except (OSError, subprocess.CalledProcessError):
            lib = None
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # loaded: the file is no longer needed
    _C_LIBRARIES[source] = lib
    return lib


def instruction_peaks(threads, seconds=0.05, repeats=5):
    """GFLOP/s of each register-only loop of bench/peaks.c this CPU runs (PEAK_LOOPS), on
    ``threads`` threads at once (each its own loop; ctypes lets go of the GIL): the FMA peak
    and, where the CPU has one, the bf16 dot-product peak -- what the fuse's and the Linear's
    kernels run on. Best of ``repeats``. Empty without a C compiler."""
    import ctypes
    import threading

    from ltx2blas.info import cpu_and_features

    lib = c_library("peaks.c")
    if lib is None:
        return {}
    have = set(cpu_and_features()[1])
    arch = platform.machine().lower()
    rates = {}
    for name, (flops, needs) in PEAK_LOOPS.items():
        if ("neon" in name) != (arch in ("aarch64", "arm64")) or not needs <= have:
            continue
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_long, ctypes.c_float, ctypes.c_float], ctypes.c_float
        iters = 1000
        while True:  # enough iterations for about `seconds` on one thread
            t0 = time.perf_counter()
            fn(iters, 1.0, 1e-3)
            if time.perf_counter() - t0 >= seconds / 4:
                break
            iters *= 4
        best = float("inf")
        for _ in range(repeats):
            workers = [threading.Thread(target=fn, args=(iters, 1.0, 1e-3))
                       for _ in range(threads)]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - t0)
        rates[name] = flops * iters * threads / best / 1e9
    return rates


def of_instruction_peak(rate, route, ceilings):
    """A fuse row's rate against the register-only peak of the instruction its route runs on
    (ceilings' peaks_gflops): the dot-product peak on the dot-product route, else the widest
    FMA peak. {} where no peak was measured."""
    peaks = ceilings.get("peaks_gflops") or {}
    dot = [k for k in peaks if k.startswith("dot_")]
    fma = [k for k in ("fma_avx512", "fma_avx2", "fma_neon") if k in peaks]
    name = dot[0] if route == "dot-product" and dot else fma[0] if fma else None
    if name is None:
        return {}
    return {"instruction_peak": name, "peak_gflops": peaks[name],
            "of_instruction_peak": rate / peaks[name]}


def random_bf16(rng, shape, scale, chunk=1 << 24):
    """Gaussian bf16 bits (scale = standard deviation), rounded by the reference rule a chunk at
    a time (its temporaries are 8 bytes an element: a whole 770M-element weight would need 6 GB)."""
    from ltx2blas.reference import bf16_round

    out = np.empty(shape, dtype=np.uint16)
    flat = out.reshape(-1)
    for start in range(0, flat.size, chunk):
        n = min(chunk, flat.size - start)
        flat[start:start + n] = bf16_round(rng.standard_normal(n, dtype=np.float32) * np.float32(scale))
    return out


def widen(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def machine():
    import scipy
    import threadpoolctl

    import ltx2blas
    from ltx2blas import info

    data = info.collect(probe_depths=())
    data.pop("sgemm_exact_depth", None)
    data.update({
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "platform": platform.platform(),
        "cores": os.cpu_count(),
        "ltx2blas": ltx2blas.__version__,
        "scipy": scipy.__version__,
        "threadpoolctl": threadpoolctl.__version__,
        "blas_libraries": threadpoolctl.threadpool_info(),
    })
    try:
        import torch

        data["torch"] = torch.__version__
    except ImportError:
        data["torch"] = None
    return data


def check_installed_not_checkout():
    """The benchmarks measure the installed package. A checkout's ltx2blas/ folder that got on
    sys.path first would shadow it, and has no compiled modules: say so instead of a traceback."""
    try:
        import ltx2blas._gemm  # noqa: F401
    except ImportError as exc:
        sys.exit(f"bench: cannot import the compiled ltx2blas ({exc}); install the project "
                 "(see README) and run the benchmarks from outside the checkout's root")


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def shapes_and_ranks_main(doc, run, shapes, ranks, argv=None):
    """The command line of a benchmark over fuse shapes, ranks and thread counts whose rows each
    say whether the results compared were the same bytes: --threads, --ranks, --shapes, --out
    (JSON with the machine). Exit status 1 if any row's bytes differed."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--ranks", default=None,
                        help=f"comma list, default {','.join(map(str, ranks))}")
    parser.add_argument("--shapes", default=None, help="comma list of RxC, default "
                        + ",".join(f"{r}x{c}" for r, c in shapes))
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    check_installed_not_checkout()
    threads = thread_counts(args.threads)
    if args.ranks:
        ranks = [int(r) for r in args.ranks.split(",")]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = run(threads, shapes, ranks)
    if args.out:
        write_json(args.out, {"machine": machine(), "rows": rows})
    return 0 if all(r["same_bytes"] for r in rows) else 1
