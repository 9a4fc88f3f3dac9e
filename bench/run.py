"""The benchmark suite: ltx2blas against the machine's ceilings and against what a user would
use instead, at every thread count, in one run.

    python bench/run.py [--quick] [--threads 1,2,...] [--only fuse,linear,checkpoint,features] [--out DIR]

Run it against the installed package (``pip install ".[bench]"``), from any directory.  Writes
DIR/results.json (every row, with the machine: CPU, cores, BLAS and its kernels, versions,
date), DIR/results.md (the tables) and PNG plots.  No timing here is a pass/fail test: repeats
are interleaved and warmed up, each candidate judged by its fastest sample (harness.STAT),
medians and spreads recorded; every row's result is checked
against the reference, and the exit status is non-zero if any check failed.
``--quick`` runs every part on small shapes in under two minutes on two cores.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

WORKLOADS = ("fuse", "linear", "checkpoint", "features")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, few repeats: every part in under two minutes")
    parser.add_argument("--threads", default=None, help="comma list (default: 1 .. every CPU)")
    parser.add_argument("--only", default=",".join(WORKLOADS),
                        help=f"comma list of workloads (default: {','.join(WORKLOADS)})")
    parser.add_argument("--out", default=None,
                        help="output folder (default: bench/results-<date> beside this script)")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    import bench_checkpoint
    import bench_features
    import bench_fuse
    import bench_linear
    import report

    only = [w.strip() for w in args.only.split(",") if w.strip()]
    unknown = sorted(set(only) - set(WORKLOADS))
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {WORKLOADS}")
    threads = harness.thread_counts(args.threads)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                   "results-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)

    t0 = time.perf_counter()
    print(f"bench: threads {threads}, workloads {only}{' (quick)' if args.quick else ''}", flush=True)
    ceilings = {}
    for t in threads:
        ceilings[t] = harness.ceilings(t, n=1024 if args.quick else 2048,
                                       bandwidth_mib=256 if args.quick else 1024,
                                       repeats=3 if args.quick else 5)
        c = ceilings[t]
        print(f"ceilings, {t} threads: sgemm {c['sgemm_gflops']:.0f} GFLOP/s, dgemm "
              f"{c['dgemm_gflops']:.0f} GFLOP/s, read {c['read_gbs']:.1f} GB/s", flush=True)
    rows = []
    if "fuse" in only:
        if args.quick:
            rows += bench_fuse.run(threads, [(2048, 2048)], [32, 450], ceilings, repeats=3)
        else:
            rows += bench_fuse.run(threads, bench_fuse.SHAPES, bench_fuse.RANKS, ceilings)
    if "linear" in only:
        if args.quick:
            rows += bench_linear.run(threads, [256], [1, 8, 64], ceilings, repeats=2,
                                         short_repeats=2)
        else:
            rows += bench_linear.run(threads, bench_linear.OUTS, bench_linear.ROWS, ceilings)
    if "checkpoint" in only:
        if args.quick:
            rows += bench_checkpoint.run(threads, 1, 64, ceilings, repeats=1)
        else:
            rows += bench_checkpoint.run(threads, 2, 384, ceilings, repeats=3)
    if "features" in only:
        if args.quick:
            rows += bench_features.run(threads, 48, 0.3, (256, 128), ceilings, repeats=1)
        else:
            rows += bench_features.run(threads, 1024, 0.3, (4096, 2048), ceilings)
    report.annotate(rows)
    results = {"machine": harness.machine(), "quick": args.quick,
               "ceilings": [ceilings[t] for t in threads], "rows": rows,
               "seconds": time.perf_counter() - t0}
    harness.write_json(os.path.join(out, "results.json"), results)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report.markdown(results))
    figures = report.plots(results, out)
    failed = [r for r in rows if not r["checked"]]
    print(f"bench: {len(rows)} rows in {results['seconds']:.0f} s -> {out} "
          f"(results.json, results.md{', ' + str(len(figures)) + ' plots' if figures else ', no plots: matplotlib not installed'})"
          + (f"; {len(failed)} rows FAILED their check" if failed else "; every row checked"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
