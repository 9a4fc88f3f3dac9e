"""Where one fuse call spends its time, step by step, and what that makes of many threads.

A fuse call (``ltx2blas.fuse_lora`` into a given ``out``) runs, in order:

  * ``validate``  the weight, the adapter, ``out``, the thread count and the tile checked
                  (Python, one thread);
  * ``route``     the adapter's magnitudes scanned and the route chosen (one thread);
  * ``pin``       the BLAS held to one thread for the call (threadpoolctl, one thread), only
                  where a tile calls sgemm (timed everywhere, counted only there);
  * ``plan``      the sgemm depths looked up and the tile driver's buffers allocated (one
                  thread);
  * ``run``       the tiles, in parallel (with the dot-product route, A packed into pairs
                  first, in parallel too), and the per-tile results gathered.

Each step before the run is timed on its own, interleaved with the others and with the whole
call, at every thread count asked; the run is the call less those steps. The run at two
thread counts or more gives its serial and parallel parts by a straight-line fit of time
against 1 / threads (the run's own fork, join and gathering, and whatever does not scale with
the cores -- memory bandwidth among it -- are in the serial part). Amdahl's model then gives the time at 16 and 20 threads:
``T(n) = S + P / n``, S the serial steps plus the run's serial part, P the run's parallel
part, and the efficiency ``T(1) / (n T(n))``. Memory bandwidth is not in the model: where the
weight's reading and writing outgrow the cores' share of it the real time is longer.

So that the fit's serial part can be told apart from memory, the weight is also read alone
(harness.reader: every byte once, a stripe a thread) at each thread count, interleaved with the
calls: where the read's speed-up from 1 to 2 threads falls short of 2 as the run's does, the
fit's serial part is the memory's, not the code's. Beside the fit, the steps' model takes the
serial steps alone, ``T(n) = S_steps + R(1) / n`` with R(1) the run on one thread, and names
the memory rate its time at n threads needs: the weight read and written, (bytes in + bytes
out) / (R(1) / n).

    python bench/bench_steps.py [--threads 1,2] [--cases 4096x4096:32,...] [--out FILE.json]

A case is RxC:rank, or RxC:rank:fp8 for an F8_E4M3 weight.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

CASES = ["4096x4096:32", "4096x4096:384", "2048x2048:32", "2048x2048:384", "4096x4096:32:fp8"]
STEPS = ("validate", "route", "pin", "plan", "run")
#: The thread counts the model is evaluated at: a 16-core Xeon, a 20-core GB10.
MODEL_THREADS = (16, 20)


def parse_case(text):
    shape, rank, *fmt = text.split(":")
    rows, cols = (int(v) for v in shape.split("x"))
    return rows, cols, int(rank), (fmt[0] if fmt else "bf16")


def step_calls(weight, lora_a, lora_b, fmt, threads):
    """The call's steps as separate callables, each doing what fuse._fuse_into does for it
    (the later ones on what the earlier ones made, made once here), and the whole call."""
    import ltx2blas
    from ltx2blas import _validate, fuse
    from ltx2blas._threads import blas_single_threaded, resolve_threads

    weight_format = "F8_E4M3" if fmt == "fp8" else None
    adapters = [(lora_a, lora_b, 0.8)]
    # Into a buffer of its own, not in place: repeated in-place fuses would walk an fp8
    # weight into saturation, whose overflow counting costs more than a plain store.
    result = np.empty_like(weight)

    def validate():
        f, w = _validate.fuse_weight(weight, weight_format, "nearest", "saturate")
        prepared = _validate.adapters_for(adapters, *w.shape)
        resolve_threads(threads)
        fuse.default_tile(*w.shape)
        _validate.fuse_output(result, w, f, prepared)
        return f, w, prepared

    f, w, prepared = validate()
    tile = fuse.default_tile(*w.shape)

    def route():
        return fuse._choose_route(prepared, f, "one", False)

    chosen = route()

    def pin():
        with blas_single_threaded():
            pass

    def plan():
        with blas_single_threaded():
            return fuse._plan(w, result.view(w.dtype), f, prepared, chosen, tile, threads)

    def whole():
        ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads, out=result,
                           weight_format=weight_format)

    made = plan()
    # the call pins the BLAS only where a tile calls sgemm (fuse._fuse_into)
    return ({"validate": validate, "route": route, "pin": pin, "plan": plan, "call": whole},
            made.routes()[0], bool(made.depths.any()))


def run_bench(threads_list, cases, repeats=15, log=print):
    rng = np.random.default_rng(0)
    rows_out = []
    for text in cases:
        rows, cols, rank, fmt = parse_case(text)
        if fmt == "fp8":
            weight = rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8)
        else:
            weight = harness.random_bf16(rng, (rows, cols), 0.02)
        lora_a = harness.random_bf16(rng, (rank, cols), 0.05)
        lora_b = harness.random_bf16(rng, (rows, rank), 0.05)
        per_threads, wholes, reads = {}, {}, {}
        for threads in threads_list:
            calls, route, pins = step_calls(weight, lora_a, lora_b, fmt, threads)
            wholes[threads] = calls.pop("call")
            reads[f"read{threads}"] = harness.reader(weight.view(np.uint16), threads)
            t = harness.interleaved(calls, repeats=repeats, settle=0.0)
            per_threads[threads] = {name: t[name][harness.STAT] for name in calls}
        # The whole calls at each thread count, interleaved with each other alone (the steps'
        # thousands of small allocations beside them would slow them down), back to back: a
        # fuse of many weights calls one after another, its OpenMP workers awake, where after
        # a pause waking them costs a virtual machine milliseconds.
        t = harness.interleaved({**{n: wholes[n] for n in threads_list}, **reads},
                                repeats=repeats, settle=0.0)
        for threads in threads_list:
            got = per_threads[threads]
            got["call"] = t[threads][harness.STAT]
            # the run: the call less the steps before it, each timed on its own
            got["run"] = max(0.0, got["call"] - sum(got[s] for s in in_call(pins)))
            got["read_weight"] = t[f"read{threads}"][harness.STAT]
            log(f"{text} {threads} thread(s) [{route}]: call {got['call'] * 1e3:.3f} ms; "
                + ", ".join(f"{s} {got[s] * 1e6:.0f} us" for s in STEPS))
        row = {"case": text, "rows": rows, "cols": cols, "rank": rank, "format": fmt,
               "route": route, "pins_blas": pins, "seconds": per_threads,
               "checked": checked(weight, lora_a, lora_b, fmt, max(threads_list))}
        row.update(model(per_threads, pins, 2 * weight.nbytes))
        rows_out.append(row)
        if "model" in row:
            m = row["model"]
            log(f"  serial {m['serial_s'] * 1e6:.0f} us (steps {m['serial_steps_s'] * 1e6:.0f}, "
                f"run {m['run_serial_s'] * 1e6:.0f}), parallel {m['parallel_s'] * 1e3:.2f} ms; "
                + ", ".join(f"{n} threads: {m[str(n)]['ms']:.3f} ms, efficiency "
                            f"{m[str(n)]['efficiency']:.2f}" for n in MODEL_THREADS))
            steps_model = row["steps_model"]
            log(f"  speed-up from 1 to 2 threads: the run {row['speedup']['run']:.2f}, reading "
                f"the weight alone {row['speedup']['read_weight']:.2f}; the serial steps alone: "
                + ", ".join(f"{n} threads: efficiency {steps_model[str(n)]['efficiency']:.2f}"
                            + needs_text(steps_model[str(n)]['needs_gbs']) for n in MODEL_THREADS))
    return rows_out


def checked(weight, lora_a, lora_b, fmt, threads, sample_rows=16):
    """Whether the call's result on a fresh copy equals the reference on its first rows."""
    import ltx2blas
    from ltx2blas import reference

    part = slice(0, min(sample_rows, weight.shape[0]))
    if fmt == "fp8":
        got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads,
                                 weight_format="F8_E4M3")
        want = reference.fuse_loras_fp8(weight[part], [(lora_a, lora_b[part], 0.8)], "F8_E4M3")
    else:
        got = ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads)
        want = reference.fuse_lora(weight[part], lora_a, lora_b[part], 0.8)
    return bool(np.array_equal(np.asarray(got)[part].view(np.uint8),
                               np.asarray(want).view(np.uint8)))


def needs_text(gbs):
    """The memory rate the steps' model needs, or why none: a loaded machine can time the run
    (the call less its steps) as nothing."""
    return f" if memory moves {gbs:.0f} GB/s" if gbs is not None else " (the run timed as nothing)"


def in_call(pins):
    """The steps before the run that the call takes: the pin only where it calls sgemm."""
    return [s for s in STEPS if s != "run" and (s != "pin" or pins)]


def model(per_threads, pins, moved_bytes):
    """Amdahl's model from the step timings: the serial steps at one thread, the run's serial
    and parallel parts from the fit over the thread counts measured (at least two); the steps'
    model (the serial steps alone, the one-thread run parallel) with the memory rate it needs
    to move ``moved_bytes`` in its time; the speed-ups of the run and of reading the weight
    from the fewest to the most threads measured."""
    counts = sorted(per_threads)
    if len(counts) < 2:
        return {}
    steps = sum(per_threads[counts[0]][s] for s in in_call(pins))
    lo, hi = per_threads[counts[0]], per_threads[counts[-1]]
    run_one = lo["run"] * counts[0]
    steps_model = {}
    for n in MODEL_THREADS:
        t = steps + run_one / n
        steps_model[str(n)] = {"ms": t * 1e3, "efficiency": (steps + run_one) / (n * t),
                               "needs_gbs": moved_bytes / (run_one / n) / 1e9 if run_one else None}
    speedup = {"threads": [counts[0], counts[-1]],
               "run": lo["run"] / hi["run"] if hi["run"] else 0.0,
               "read_weight": lo["read_weight"] / hi["read_weight"] if hi["read_weight"] else 0.0}
    inv = np.array([1.0 / n for n in counts])
    run = np.array([per_threads[n]["run"] for n in counts])
    parallel, serial = np.polyfit(inv, run, 1)
    serial, parallel = max(0.0, float(serial)), max(0.0, float(parallel))
    out = {"serial_steps_s": steps, "run_serial_s": serial, "parallel_s": parallel,
           "serial_s": steps + serial}
    one = steps + serial + parallel
    for n in MODEL_THREADS:
        t = steps + serial + parallel / n
        out[str(n)] = {"ms": t * 1e3, "efficiency": one / (n * t)}
    return {"model": out, "steps_model": steps_model, "speedup": speedup}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="comma list of RxC:rank[:fp8], default %(default)s")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    threads = harness.thread_counts(args.threads)
    rows = run_bench(threads, args.cases.split(","), repeats=args.repeats)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(row["checked"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
