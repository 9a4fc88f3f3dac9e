"""The Linear's panel route against the route the rows would take without it, and the sgemm
rate, in the same run.

  * ``panel``: the fuse's register blocks on weight rows widened 512 at a time (the route the
    kernel table takes from its ``panel_min_rows``, and above STREAM_ROWS rows where the
    table's vectors are wider than the BLAS's sgemm kernel);
  * ``stream``: the streaming kernel, as the tables without the panel route run up to
    STREAM_ROWS rows; ``sgemm``: the sgemm route on widened weight panels, above.

Both are interleaved with a square 2048^3 sgemm at the same thread count
(harness.square_sgemm); every result is checked on sampled outputs against the exact sum,
within the derived bound of the route that computed it. Reported per row: each route's rate as
a fraction of the sgemm rate (fastest samples) and the panel route's speed over the other's
(fastest and median samples).  With ``--tokens``, also ``text_features`` V2 (hidden states
[1, T, 3840, 49], every token valid, the 4096 and 2048 projections) by the panel and streaming
routes.

    python bench/bench_linear_routes.py [--threads 1,2] [--rows 48,64,256] [--outs 2048,4096]
                                        [--width 188160] [--tokens 64] [--out FILE.json]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from bench_linear import IN_FEATURES, check_rows, taking  # noqa: E402

ROWS = [48, 64]
OUTS = [2048, 4096]
ROUTES = ("panel", "stream")


def compared(times, checked, other="stream"):
    """A row's common part: the panel route's speed over the other's, the samples, the checks."""
    return {"against": other,
            "panel_speedup": times[other]["min"] / times["panel"]["min"],
            "panel_speedup_median": times[other]["median"] / times["panel"]["median"],
            "times": times, "checked": checked}


def said(row):
    return (f"panel faster than {row['against']} x{row['panel_speedup']:.3f} (medians "
            f"x{row['panel_speedup_median']:.3f}); checked: {row['checked']}")


def run(threads_list, rows_list, outs, width=IN_FEATURES, repeats=5, log=print):
    import ltx2blas
    from ltx2blas import linear_layer

    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((max(rows_list), width), dtype=np.float32)
    result = []
    for out in outs:
        weight = harness.random_bf16(rng, (out, width), 0.02)
        for rows in rows_list:
            x = x_all[:rows]
            routes = ("panel", "stream" if rows <= linear_layer.STREAM_ROWS else "sgemm")
            for threads in threads_list:
                ys = {name: np.empty((rows, out), np.float32) for name in routes}

                def linear(name):
                    def call():
                        with taking(name):
                            ltx2blas.linear(x, weight, threads=threads, out=ys[name])
                    return call

                sgemm, flops = harness.square_sgemm(threads)
                # the ceiling's own key: "sgemm" names a route here
                times = harness.interleaved({**{name: linear(name) for name in routes},
                                             "square_sgemm": sgemm}, repeats=repeats)
                checked = {}
                for name in routes:
                    with taking(name):
                        assert linear_layer.plan(rows, weight.dtype)[0] == name
                        checked[name] = check_rows(x, weight, ys[name], rng)
                work = 2.0 * rows * out * width
                rate = {name: (work / times[name]["min"]) / (flops / times["square_sgemm"]["min"])
                        for name in routes}
                row = {"rows": rows, "out": out, "in": width, "threads": threads,
                       **{f"{name}_of_sgemm": rate[name] for name in routes},
                       "sgemm_gflops": flops / times["square_sgemm"]["min"] / 1e9,
                       **compared(times, checked, routes[1])}
                result.append(row)
                log(f"out {out} M {rows} threads {threads}: panel x{rate['panel']:.2f} of sgemm, "
                    f"{routes[1]} x{rate[routes[1]]:.2f}; " + said(row))
    return result


def run_features(threads_list, tokens, depth=3840, layers=49, outs=(4096, 2048), repeats=5,
                 log=print):
    import math

    import ltx2blas
    from ltx2blas import linear_layer

    rng = np.random.default_rng(1)
    hidden = harness.random_bf16(rng, (1, tokens, depth, layers), 1.0)
    mask = np.ones((1, tokens), np.int64)
    projections = [(harness.random_bf16(rng, (o, depth * layers), 0.02),
                    rng.standard_normal(o, dtype=np.float32)) for o in outs]
    feats = harness.widen(ltx2blas.normalized_features(
        hidden, mask, version="v2", out_features=outs[0])[0])
    result = []
    for threads in threads_list:
        ys = {}

        def features(name):
            def call():
                with taking(name):
                    ys[name] = ltx2blas.text_features(hidden, mask, projections, version="v2",
                                                      threads=threads)
            return call

        times = harness.interleaved({name: features(name) for name in ROUTES}, repeats=repeats)
        # The first projection's outputs, sampled, against the exact sum of its features.
        checked = {}
        w, b = projections[0]
        for name in ROUTES:
            with taking(name):
                g = linear_layer.gamma(tokens, depth * layers, w.dtype)
            ok = True
            for t, o in zip(rng.integers(0, tokens, 6), rng.integers(0, outs[0], 6)):
                terms = feats[t].astype(np.float64) * harness.widen(w[o]).astype(np.float64)
                exact = math.fsum(list(terms) + [float(b[o])])
                got = float(np.asarray(ys[name][0]).reshape(tokens, -1)[t, o])
                ulp = float(np.spacing(np.float32(abs(got))))
                ok &= abs(got - exact) <= g * (np.sum(np.abs(terms)) + abs(b[o])) + ulp / 2
            checked[name] = bool(ok)
        row = {"workload": "text_features", "tokens": tokens, "threads": threads,
               **compared(times, checked)}
        result.append(row)
        log(f"text_features V2, {tokens} tokens, threads {threads}: " + said(row))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--outs", default=",".join(map(str, OUTS)))
    parser.add_argument("--width", type=int, default=IN_FEATURES, help="in-features")
    parser.add_argument("--tokens", type=int, default=None,
                        help="also text_features V2 with this many tokens")
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    threads = harness.thread_counts(args.threads)
    rows = run(threads, [int(r) for r in args.rows.split(",")],
               [int(o) for o in args.outs.split(",")], args.width)
    if args.tokens:
        rows += run_features(threads, args.tokens)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(all(r["checked"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
