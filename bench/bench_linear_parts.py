"""Where a bf16-x Linear with many rows spends its time, part by part.

A ``ltx2blas.linear`` call on the dot-product panel route (bf16 x, bf16 weight, 32 rows or
more) allocates its buffers (x packed into strips of pairs, and each segment's sums
[rows, out] f32), then runs its segments in passes (linear_layer.segments_per_pass): each
pass packs its in-features of x, in parallel, runs its tasks (a block of rows and output
features of one segment each), and adds its sums onto y.

Timed, interleaved (harness.interleaved), at each thread count:

  * ``call``       the call as it is;
  * ``reused``     the same plan on buffers allocated and touched once, before: the call less
                   the first touch of its buffers (the kernel zeroes fresh pages);
  * ``one_pass``   every segment in one pass, fresh buffers (x packed whole, every segment's
                   sums at once), and ``one_pass_reused`` the same on buffers touched before;
  * ``first_pass`` the first pass's tasks after its x is packed, against the compute ceiling
                   (twice the rate of a square sgemm in the same rounds, as bench_linear.py's
                   roofline, and the register-only VDPBF16PS peak of bench/peaks.c): what the
                   kernel itself loses.

Every way gives the call's bytes (checked). ``--blocks`` adds the same for other task blocks.

    python bench/bench_linear_parts.py [--threads 1,2] [--rows 256,2048] [--out-features 2048]
                                       [--blocks 128x128x2048,...] [--save FILE.json]
"""
import argparse
import time
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

IN_FEATURES = 49 * 3840
ROWS = [64, 256, 1024, 2048]


def cut(rows, feats, cols, blocks, threads, one_pass):
    """(segment length, segments a pass, tasks a pass) of a call, as linear() cuts it, or with
    every segment in one pass."""
    from ltx2blas import _linear, linear_layer

    count, length = linear_layer.segments(rows, feats, cols, "dot_panel", blocks)
    per_segment = _linear.block_count(rows, feats, blocks[0], blocks[1])
    per_pass = count if one_pass else linear_layer.segments_per_pass(count, per_segment,
                                                                     "dot_panel", threads)
    return length, per_pass, per_pass * per_segment


def buffers(rows, feats, cols, length, per_pass):
    """A call's partial sums (None for one segment a pass) and packed x."""
    from ltx2blas import _linear

    partial = np.empty((per_pass, rows, feats), np.float32) if per_pass > 1 else None
    packed = np.empty(_linear.packed_x_bytes(rows, min(cols, per_pass * length)) // 4,
                      np.uint32)
    return partial, packed


def plan_on(x, weight, y, threads, blocks, length, per_pass, partial, packed):
    """The LinearPlan linear() builds, on the given buffers."""
    from ltx2blas import _gemm, _linear

    return _linear.LinearPlan(x, weight, None, None, y, *blocks, threads, False,
                              _gemm.PRODUCTS["dot_panel"], length, per_pass, partial, packed)


def parts(x, weight, threads, blocks, repeats):
    """Seconds (fastest samples) of each way, and whether every way gave the call's bytes."""
    import ltx2blas
    from ltx2blas._threads import blas_single_threaded

    rows, cols = x.shape
    feats = weight.shape[0]
    y_call = np.empty((rows, feats), np.float32)
    ys = {}
    kept = {}

    def way(name, one_pass, reuse):
        length, per_pass, _ = cut(rows, feats, cols, blocks, threads, one_pass)
        ys[name] = np.empty_like(y_call)
        if reuse:  # allocated and touched once, here
            kept[name] = [np.ones_like(b) if b is not None else None
                          for b in buffers(rows, feats, cols, length, per_pass)]

        def run():
            partial, packed = kept[name] if reuse else buffers(rows, feats, cols, length,
                                                               per_pass)
            plan = plan_on(x, weight, ys[name], threads, blocks, length, per_pass, partial,
                           packed)
            with blas_single_threaded():
                plan.run(0, plan.tasks)
        return run

    first_pass = []

    def tasks_of_first_pass():
        length, per_pass, tasks = cut(rows, feats, cols, blocks, threads, False)
        partial, packed = kept["reused"]
        plan = plan_on(x, weight, ys["reused"], threads, blocks, length, per_pass, partial,
                       packed)
        with blas_single_threaded():
            plan.run(0, 1)  # packs the pass
            t0 = time.perf_counter()
            plan.run(1, tasks)
            first_pass.append((time.perf_counter() - t0) * tasks / max(1, tasks - 1))
            plan.run(tasks, plan.tasks)

    cands = {"call": lambda: ltx2blas.linear(x, weight, threads=threads, blocks=blocks,
                                             out=y_call),
             "reused": way("reused", False, True), "one_pass": way("one_pass", True, False),
             "one_pass_reused": way("one_pass_reused", True, True),
             "first_pass": tasks_of_first_pass}
    square, square_flops = harness.square_sgemm(threads)
    cands["sgemm_square"] = square
    t = harness.interleaved(cands, repeats=repeats, warmup=1)
    got = {name: t[name]["min"] for name in ("call", "reused", "one_pass", "one_pass_reused")}
    got["first_pass"] = min(first_pass)
    same = all(np.array_equal(y.view(np.uint32), y_call.view(np.uint32)) for y in ys.values())
    length, per_pass, tasks = cut(rows, feats, cols, blocks, threads, False)
    got["pass_fraction"] = min(cols, per_pass * length) / cols  # of the flops
    got["sgemm_gflops"] = square_flops / t["sgemm_square"]["min"] / 1e9
    return got, same


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--out-features", type=int, default=2048)
    parser.add_argument("--width", type=int, default=IN_FEATURES, help="in features")
    parser.add_argument("--blocks", default=None,
                        help="comma list of RxFxC task blocks (default: the plan's)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--save", default=None)
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    from ltx2blas import linear_layer, reference

    threads_list = harness.thread_counts(args.threads)
    rows_list = [int(v) for v in args.rows.split(",")]
    peaks = {t: harness.instruction_peaks(t) for t in threads_list}
    rng = np.random.default_rng(0)
    weight = harness.random_bf16(rng, (args.out_features, args.width), 0.02)
    x_all = reference.bf16_round(rng.standard_normal((max(rows_list), args.width),
                                                     dtype=np.float32))
    results = []
    for threads in threads_list:
        dot_peak = next((v for k, v in peaks[threads].items() if k.startswith("dot_")), None)
        for rows in rows_list:
            x = x_all[:rows]
            route, default = linear_layer.plan(rows, weight.dtype, x_dtype=x.dtype)
            if route != "dot_panel":
                print(f"{rows} rows take the {route} route here, not dot_panel: skipped")
                continue
            block_list = ([tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
                          if args.blocks else [default])
            flops = 2.0 * rows * weight.shape[0] * args.width
            for blocks in block_list:
                got, same = parts(x, weight, threads, blocks, args.repeats)
                ceiling = 2 * got["sgemm_gflops"]
                rate = {k: flops / got[k] / 1e9 for k in ("call", "reused", "one_pass",
                                                          "one_pass_reused")}
                rate["first_pass"] = flops * got["pass_fraction"] / got["first_pass"] / 1e9
                row = {"threads": threads, "rows": rows, "out": weight.shape[0],
                       "in": args.width, "blocks": list(blocks), "same_bytes": same,
                       "seconds": {k: got[k] for k in rate}, "gflops": rate,
                       "sgemm_gflops": got["sgemm_gflops"], "dot_peak_gflops": dot_peak,
                       "of_ceiling": {k: v / ceiling for k, v in rate.items()},
                       "of_dot_peak": ({k: v / dot_peak for k, v in rate.items()}
                                       if dot_peak else None)}
                results.append(row)
                text = ", ".join(f"{k} {got[k] * 1e3:.0f} ms ({row['of_ceiling'][k]:.3f})"
                                 for k in rate)
                print(f"threads={threads} rows={rows:>4} blocks={blocks}, of the ceiling "
                      f"({ceiling:.0f} GFLOP/s): {text}; the first pass's tasks "
                      f"{(row['of_dot_peak'] or {}).get('first_pass', 0):.3f} of the VDPBF16PS "
                      f"peak; same bytes: {same}", flush=True)
    if args.save:
        harness.write_json(args.save, {"machine": harness.machine(), "parts": results})
    return 0 if all(r["same_bytes"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
