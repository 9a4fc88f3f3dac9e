"""The text-tower Linear against its roofline and against torch, in the same run.

For each thread count, out_features and row count M (in_features = 188,160, bf16 weight):
  * ``ltx2blas``: ltx2blas.linear (f32 accumulation, the default);
  * peers, when torch is installed: ``torch.nn.functional.linear`` on f32 with the weight held in
    f32 (what a torch user holds), and in bf16 (x rounded to bf16);
  * the reports' scalar f64 loop, timed on a few output features (the "before" figure);
and the ceilings at the same thread count, both interleaved with the calls: the sgemm rate (a
square 2048^3 sgemm, harness.square_sgemm) and the memory read bandwidth (the weight itself read
by ltx2blas's scan kernel). Every candidate is judged by its fastest sample (harness.STAT),
medians recorded beside; the roofline from the ceilings measured at the start of the run
(harness.ceilings, best of five) is recorded too (``of_roofline_at_start``).
roofline = max(2 M out in / sgemm rate, weight bytes / read bandwidth).  With ``--x bf16`` x is
bf16 (what text_features feeds the Linear), torch's bf16 peer takes the same x, and where the
Linear takes the dot-product route (VDPBF16PS, two products per instruction) the compute
ceiling is twice the sgemm rate.
Every row is checked: sampled outputs against the exact sum (math.fsum), within the derived
bound of ltx2blas.linear_layer.

    python bench/run.py --only linear            (the suite)
    python bench/bench_linear.py [--quick] [--x bf16] [--outs 2048] [--rows 1,64]
                                                  (this workload alone)
    python bench/bench_linear.py --accuracy      (the accumulation table of docs/exactness.md)
"""
import argparse
import contextlib
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers  # noqa: E402

IN_FEATURES = 49 * 3840
OUTS = [2048, 4096]
ROWS = [1, 8, 64, 256, 1024]


def exact_sample(x, w, m_idx, o_idx):
    w64 = (w[o_idx].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.array([math.fsum(x[m].astype(np.float64) * w64[i]) for i, m in enumerate(m_idx)])


@contextlib.contextmanager
def taking(route):
    """The Linear's plan (and text_features') sent to the panel route, or away from it (to the
    streaming kernel up to STREAM_ROWS rows, to sgemm above), whatever the kernel table's own
    panel_min_rows and the BLAS beside it."""
    from ltx2blas import linear_layer

    own = linear_layer._panel_min_rows, linear_layer.panel_above_stream_rows
    linear_layer._panel_min_rows = (lambda: 1) if route == "panel" else (lambda: 0)
    linear_layer.panel_above_stream_rows = lambda: route == "panel"
    try:
        yield
    finally:
        linear_layer._panel_min_rows, linear_layer.panel_above_stream_rows = own


def check_rows(x, w, y, rng, samples=8):
    """Sampled outputs against the exact sum, within the derived bound of the route taken (x
    f32, or bf16 bits: random normal data has no subnormal terms, so the dot-product route's
    flushing adds at most 2 in 2^-126, which the bound carries)."""
    from ltx2blas.linear_layer import gamma

    xd = x.dtype
    if xd.itemsize == 2:
        x = harness.widen(x)
    m_idx = rng.integers(0, x.shape[0], samples)
    o_idx = rng.integers(0, w.shape[0], samples)
    ref = exact_sample(x, w, m_idx, o_idx)
    w64 = harness.widen(w[o_idx]).astype(np.float64)
    mag = np.array([np.sum(np.abs(x[m].astype(np.float64) * w64[i])) for i, m in enumerate(m_idx)])
    g = gamma(x.shape[0], x.shape[1], w.dtype, x_dtype=xd)
    bound = g * mag + (1 + g) * 2 * x.shape[1] * 2.0**-126
    got = y[m_idx, o_idx].astype(np.float64)
    ulp = np.spacing(np.abs(got).astype(np.float32)).astype(np.float64)
    return bool(np.all(np.abs(got - ref) <= bound + ulp / 2))


def run(threads_list, outs, rows_list, ceilings, repeats=3, short_repeats=7,
        in_features=IN_FEATURES, log=print, x_kind="f32"):
    """At 8 rows or fewer, ``short_repeats`` samples of each candidate (``repeats`` above), each
    sample at least 0.2 s of calls back to back (0.05 s above). Those calls take tens of
    milliseconds, where one busy moment of a shared host moves a sample by a large fraction
    (8 rows on 2 threads: 0.82 of the roofline in one run, its samples 0.6 apart; 0.93 alone),
    and where the first call after the pause between samples is slow: 8 x 2048 on 2 threads,
    median 33.0 ms back to back, 36-37 ms after 0.25 s idle (worker threads and cores waking).
    The ceilings they are divided by are sampled the same way."""
    import ltx2blas
    from ltx2blas import linear_layer, reference

    torch = peers.torch_module()
    rng = np.random.default_rng(0)
    results = []
    for out in outs:
        weight = harness.random_bf16(rng, (out, in_features), 0.02)
        w32_np = harness.widen(weight)
        w32 = torch.from_numpy(w32_np) if torch is not None else None
        w16 = w32.bfloat16() if torch is not None else None
        x_all = rng.standard_normal((max(rows_list), in_features), dtype=np.float32)
        scalar = peers.scalar_linear_rate(x_all, w32_np, min(out, 4), harness.best_time)
        if x_kind == "bf16":
            x_all = reference.bf16_round(x_all)  # bf16 bits
        for threads in threads_list:
            at_start = ceilings[threads]["sgemm_gflops"]
            square, square_flops = harness.square_sgemm(threads)
            for rows in rows_list:
                x = x_all[:rows]
                y = np.empty((rows, out), np.float32)
                # The weight read once, interleaved with the calls: how fast memory is now. On a
                # shared host the rate moves between runs (this one has measured both 35 and
                # 65 GB/s on two threads); a ceiling from the start of the run would not do.
                cands = {"ltx2blas": lambda: ltx2blas.linear(x, weight, threads=threads, out=y),
                         "read_weight": harness.reader(weight, threads), "sgemm_square": square}
                route = linear_layer.plan(rows, weight.dtype, x_dtype=x.dtype)[0]
                # VDPBF16PS does two products per instruction where an FMA does one
                compute_factor = 2.0 if route in linear_layer.DOT_ROUTES else 1.0
                if torch is not None:
                    tx = torch.from_numpy(harness.widen(x) if x_kind == "bf16" else x)
                    tx16 = tx.bfloat16()  # exact for a bf16 x

                    def torch_f32():
                        torch.set_num_threads(threads)
                        torch.nn.functional.linear(tx, w32)

                    def torch_bf16():
                        torch.set_num_threads(threads)
                        torch.nn.functional.linear(tx16, w16)

                    cands["torch_f32"] = torch_f32
                    cands["torch_bf16"] = torch_bf16
                harness.reset_peak_rss()
                short = rows <= 8
                samples = short_repeats if short else repeats
                t = harness.interleaved(cands, repeats=samples, warmup=1,
                                        min_sample=0.2 if short else 0.05)
                flops = 2.0 * rows * out * in_features
                probe = t.pop("read_weight")
                square_t = t.pop("sgemm_square")

                def roofline(stat, compute_factor=compute_factor):
                    """(compute, memory) seconds by the ceilings' samples of statistic stat."""
                    return (flops * square_t[stat] / square_flops / compute_factor,
                            probe[stat])

                compute_s, memory_s = roofline(harness.STAT)  # the same statistic as ours
                roofline_s = max(compute_s, memory_s)
                peak, bw = flops / compute_s / 1e9, weight.nbytes / memory_s / 1e9
                ours = t["ltx2blas"][harness.STAT]
                row = {
                    "workload": "linear", "rows": rows, "out": out, "in": in_features,
                    "x": x_kind, "route": route, "compute_ceiling_of_sgemm": compute_factor,
                    "threads": threads, "ms": ours * 1e3, "gflops": flops / ours / 1e9,
                    "sgemm_gflops": peak, "sgemm_gflops_at_start": at_start, "read_gbs": bw,
                    "read_gbs_median": weight.nbytes / probe["median"] / 1e9,
                    "ms_median": t["ltx2blas"]["median"] * 1e3,
                    "of_roofline_median": max(roofline("median")) / t["ltx2blas"]["median"],
                    "read_gbs_at_start": ceilings[threads]["read_gbs"],
                    "roofline_ms": roofline_s * 1e3,
                    "of_roofline": roofline_s / ours, "of_sgemm": flops / ours / 1e9 / peak,
                    "of_roofline_at_start": max(
                        flops / (at_start * compute_factor * 1e9),
                        weight.nbytes / (ceilings[threads]["read_gbs"] * 1e9)) / ours,
                    "bound": "compute" if compute_s > memory_s else "memory",
                    "spread": t["ltx2blas"]["spread"], "peak_rss_mib": harness.peak_rss_mib(),
                    "checked": check_rows(x, weight, y, rng), "samples": samples, "peers": {},
                }
                for name in ("torch_f32", "torch_bf16"):
                    if name in t:
                        row["peers"][name] = {"ms": t[name][harness.STAT] * 1e3,
                                              "gflops": flops / t[name][harness.STAT] / 1e9,
                                              "speedup": t[name][harness.STAT] / ours}
                if scalar:
                    row["peers"]["reports_scalar_loop"] = {
                        "gflops": scalar, "speedup": row["gflops"] / scalar,
                        "note": f"1 thread, f64, timed on {min(out, 4)} output features"}
                results.append(row)
                peer_text = "  ".join(f"{k} x{v['speedup']:.2f}" for k, v in row["peers"].items())
                log(f"linear x {x_kind} threads={threads} out={out} M={rows:>4} ({route}): "
                    f"{row['ms']:8.1f} ms "
                    f"{row['gflops']:6.1f} GFLOP/s  {row['of_roofline']:.2f} of roofline "
                    f"({row['bound']})  checked={row['checked']}  vs: {peer_text}")
        weight = w32 = w16 = w32_np = x_all = None  # freed before the next (larger) weight
    return results


def accuracy(rows=4, out=2048, samples=48):
    """Max error of each way of computing the caption projection, on the real width, against
    the exact sum: in f32 ulps of the exact value, and relative to sum |x w|."""
    import ltx2blas

    def panel_route(xs):
        with taking("panel"):  # on every kernel table
            return ltx2blas.linear(xs, weight)

    rng = np.random.default_rng(1)
    weight = harness.random_bf16(rng, (out, IN_FEATURES), 0.02)
    x = rng.standard_normal((rows, IN_FEATURES), dtype=np.float32)
    m_idx = rng.integers(0, rows, samples)
    o_idx = rng.integers(0, out, samples)
    ref = exact_sample(x, weight, m_idx, o_idx)
    w64 = harness.widen(weight[o_idx]).astype(np.float64)
    mag = np.array([np.sum(np.abs(x[m].astype(np.float64) * w64[i])) for i, m in enumerate(m_idx)])
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    ways = {
        "ltx2blas f32 (default)": lambda: ltx2blas.linear(x, weight),
        "ltx2blas f32, streaming in segments": lambda: ltx2blas.linear(
            np.ascontiguousarray(np.resize(x, (8, IN_FEATURES))), weight)[:rows],
        "ltx2blas f32, panel route": lambda: panel_route(
            np.ascontiguousarray(np.resize(x, (64, IN_FEATURES))))[:rows],
        "ltx2blas f32, sgemm route": lambda: ltx2blas.linear(
            np.ascontiguousarray(np.resize(x, (80, IN_FEATURES))), weight)[:rows],
        "ltx2blas f64": lambda: ltx2blas.linear(x, weight, accumulate="f64"),
        "numpy f64 (x @ W.T, dgemm)": lambda: (x.astype(np.float64) @ harness.widen(weight).astype(np.float64).T).astype(np.float32),
    }
    try:
        import torch

        tw = torch.from_numpy(harness.widen(weight))
        ways["torch F.linear f32"] = lambda: torch.nn.functional.linear(torch.from_numpy(x), tw).numpy()
        ways["torch F.linear bf16 (x rounded)"] = lambda: torch.nn.functional.linear(
            torch.from_numpy(x).bfloat16(), tw.bfloat16()).float().numpy()
    except ImportError:
        pass
    table = []
    for name, fn in ways.items():
        y = fn()[m_idx, o_idx].astype(np.float64)
        err = np.abs(y - ref)
        table.append({"way": name, "max_ulps": float(np.max(err / ulp)),
                      "max_rel_to_sum_abs": float(np.max(err / mag))})
        print(f"{name:34s} max error {table[-1]['max_ulps']:10.1f} f32 ulps   "
              f"{table[-1]['max_rel_to_sum_abs']:.2e} of sum|x w|", flush=True)
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="out = 256, M up to 64, 2 repeats")
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--accuracy", action="store_true", help="print the accuracy table only")
    parser.add_argument("--out", default=None, help="with --accuracy: write the table as JSON here")
    parser.add_argument("--x", default="f32", choices=("f32", "bf16"),
                        help="the dtype of x (bf16: what text_features feeds the Linear)")
    parser.add_argument("--outs", default=None, help="comma list of out features")
    parser.add_argument("--rows", default=None, help="comma list of row counts M")
    parser.add_argument("--save", default=None, help="write the rows and the machine as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    if args.accuracy:
        table = accuracy()
        if args.out:
            harness.write_json(args.out, {"machine": harness.machine(), "accuracy": table})
        return 0
    threads = harness.thread_counts(args.threads)
    ceilings = {t: harness.ceilings(t) for t in threads}
    if args.quick:
        rows = run(threads, [256], [1, 8, 64], ceilings, repeats=2, short_repeats=2,
                   x_kind=args.x)
    else:
        outs = [int(v) for v in args.outs.split(",")] if args.outs else OUTS
        rows_list = [int(v) for v in args.rows.split(",")] if args.rows else ROWS
        rows = run(threads, outs, rows_list, ceilings, x_kind=args.x)
    if args.save:
        harness.write_json(args.save, {"machine": harness.machine(), "linear": rows})
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
