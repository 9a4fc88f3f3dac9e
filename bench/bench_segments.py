"""The Linear's and the feature extractor's in-dimension cut into segments (256 tasks or more at
every real shape, for many cores) against the one-segment cut, in the same run.

For each thread count and row count at the caption projection's width (188,160 in, or
--width): the Linear with its default tasks and with tasks from the output blocks alone (one
segment; on the streaming route 16 x 64 blocks down to one row), interleaved
(harness.interleaved); then text_features (V1, 3840 out) likewise. The two cuts add in
different orders, so their bytes differ by design: each Linear result is checked against the
derived bound on sampled outputs instead, and repeated calls against their first bytes.
Reported: the task counts and the speed ratio (one segment's time / the default's; above 1
the segments are faster), by fastest and by median sample, beside a control: the default cut
timed a second time in the same rounds, divided by the first.

    python bench/bench_segments.py [--threads 1,2] [--rows 1,8,64,256] [--tokens 32,100]
                                   [--width 188160] [--out FILE.json]
"""
import argparse
import contextlib
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WIDTH = 49 * 3840
ROWS = [1, 8, 64, 256]
FEATURE_TOKENS = [32, 100]      # the streaming route and the sgemm route


@contextlib.contextmanager
def one_segment():
    """linear() and text_features() with tasks from the output blocks alone: one segment, and
    the streaming route's 16 x 64 blocks down to one row."""
    from ltx2blas import linear_layer

    names = ("MIN_TASKS", "STREAM_SEGMENT", "STREAM_FEW_ROWS")
    saved = [getattr(linear_layer, n) for n in names]
    for name, value in zip(names, (1, 1 << 40, 0)):
        setattr(linear_layer, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(linear_layer, name, value)


def within_bound(x, w, y, samples=4):
    """Sampled outputs of y against the exact sum (math.fsum of the exact f64 products), held to
    gamma of the cut that computed y times sum |x w|, plus half an ulp."""
    from ltx2blas.linear_layer import gamma

    rows = x.shape[0]
    x64 = x.astype(np.float64) if x.dtype == np.float32 else harness.widen(x).astype(np.float64)
    g = gamma(rows, x.shape[1], w.dtype, feats=w.shape[0])
    ok = True
    rng = np.random.default_rng(1)
    for m, o in zip(rng.integers(0, rows, samples), rng.integers(0, w.shape[0], samples)):
        terms = x64[m] * harness.widen(w[o]).astype(np.float64)
        exact = math.fsum(terms)
        ok &= abs(float(y[m, o]) - exact) <= g * np.abs(terms).sum() + np.spacing(abs(y[m, o])) / 2
    return bool(ok)


def timed_pair(make, repeats):
    """Interleaved timings of ``make()`` under both cuts, and of the default cut a second time
    as a control (its ratio to the first shows the run's noise); (times, default result,
    one-segment result, repeatable)."""
    results = {"default": [], "one": [], "control": []}

    def default():
        results["default"].append(make())

    def one():
        with one_segment():
            results["one"].append(make())

    def control():
        results["control"].append(make())

    times = harness.interleaved({"default": default, "one": one, "control": control},
                                repeats=repeats)
    results["default"] += results.pop("control")
    repeatable = all(r.tobytes() == rs[0].tobytes() for rs in results.values() for r in rs)
    return times, results["default"][0], results["one"][0], repeatable


def compared(times):
    """The speed ratios of a timed pair: the output-only cut's time / the default's, and the
    control's, by fastest and by median sample."""
    return {"ratio_best": times["one"]["min"] / times["default"]["min"],
            "ratio_median": times["one"]["median"] / times["default"]["median"],
            "control_best": times["control"]["min"] / times["default"]["min"],
            "control_median": times["control"]["median"] / times["default"]["median"],
            "default_s": times["default"], "one_segment_s": times["one"]}


def described(row):
    return (f"{row['tasks']} tasks vs {row['tasks_one_segment']}: speed x{row['ratio_best']:.3f}"
            f" best, x{row['ratio_median']:.3f} median (control x{row['control_best']:.3f}, "
            f"x{row['control_median']:.3f}); repeatable: {row['same_bytes']}")


def run(threads_list, rows_list, tokens_list, feats=2048, feature_out=3840, width=WIDTH,
        repeats=3, log=print):
    import ltx2blas
    from ltx2blas.linear_layer import task_count

    rng = np.random.default_rng(0)
    w = harness.random_bf16(rng, (feats, width), 0.02)
    out = []
    for rows in rows_list:
        x = rng.standard_normal((rows, width), dtype=np.float32)
        tasks = task_count(rows, feats, width, w.dtype)
        with one_segment():
            tasks_one = task_count(rows, feats, width, w.dtype)
        for threads in threads_list:
            times, y, y_one, repeatable = timed_pair(
                lambda x=x, threads=threads: ltx2blas.linear(x, w, threads=threads), repeats)
            with one_segment():
                one_ok = within_bound(x, w, y_one)
            row = {"workload": "linear", "rows": rows, "out": feats, "threads": threads,
                   "tasks": tasks, "tasks_one_segment": tasks_one, **compared(times),
                   "within_bound": within_bound(x, w, y) and one_ok, "same_bytes": repeatable}
            out.append(row)
            log(f"linear M {rows:4d} out {feats} threads {threads}: {described(row)}; "
                f"within bound: {row['within_bound']}")
    w_v1 = harness.random_bf16(rng, (feature_out, width), 0.02)
    for tokens in tokens_list:
        hidden = harness.random_bf16(rng, (1, tokens, width // 49, 49), 1.0)
        mask = np.ones((1, tokens), bool)
        tasks = task_count(tokens, feature_out, width, w_v1.dtype)
        with one_segment():
            tasks_one = task_count(tokens, feature_out, width, w_v1.dtype)
        for threads in threads_list:
            times, _, _, repeatable = timed_pair(
                lambda h=hidden, m=mask, t=threads: ltx2blas.text_features(
                    h, m, [(w_v1, None)], threads=t)[0], repeats)
            row = {"workload": "text_features v1", "rows": tokens, "out": feature_out,
                   "threads": threads, "tasks": tasks, "tasks_one_segment": tasks_one,
                   **compared(times), "same_bytes": repeatable}
            out.append(row)
            log(f"text_features v1 tokens {tokens:4d} threads {threads}: {described(row)}")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="Linear row counts")
    parser.add_argument("--tokens", default=",".join(map(str, FEATURE_TOKENS)),
                        help="text_features token counts")
    parser.add_argument("--width", type=int, default=WIDTH, help="in features, a multiple of 49")
    parser.add_argument("--out-features", type=int, default=2048, help="the Linear's")
    parser.add_argument("--feature-out", type=int, default=3840, help="text_features' V1 Linear's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    rows = run(harness.thread_counts(args.threads), [int(r) for r in args.rows.split(",")],
               [int(t) for t in args.tokens.split(",") if t], feats=args.out_features,
               feature_out=args.feature_out, width=args.width, repeats=args.repeats)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r["same_bytes"] and r.get("within_bound", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
