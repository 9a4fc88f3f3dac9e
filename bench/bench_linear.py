"""The text-tower Linear against its roofline and against torch, in the same run.

For each thread count, out_features and row count M (in_features = 188,160, bf16 weight):
  * ``ltx2blas``: ltx2blas.linear (f32 accumulation, the default);
  * ``torch_f32``: torch.nn.functional.linear on f32, the weight held in f32 (what a torch user
    holds), when torch is installed;
interleaved with the ceilings measured at the same thread count:
  * the sgemm rate (one 2048^3 sgemm through the same BLAS), and
  * the memory read bandwidth (the bf16 weight's bytes read by ltx2blas's scan kernel, one
    stripe per thread).
roofline = max(2 M out in / sgemm rate, weight bytes / read bandwidth).  Every row is checked:
sampled outputs against the exact sum (math.fsum), within ltx2blas.linear_layer.error_bound.

    python bench/bench_linear.py [--quick] [--threads 1,2] [--out rows.json] [--md table.md]
    python bench/bench_linear.py --accuracy     # the accumulation table of the README
"""
import argparse
import math
import os
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

IN_FEATURES = 49 * 3840
OUTS = [2048, 4096]
ROWS = [1, 8, 64, 256, 1024]


def read_bandwidth(weight, threads, repeats=3):
    """GB/s reading ``weight`` once, split into ``threads`` stripes read concurrently."""
    from ltx2blas import _gemm

    flat = weight.reshape(-1)
    stripes = np.array_split(flat, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=_gemm.scan_bf16, args=(s,)) for s in stripes]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
        time.sleep(0.1)
    return flat.nbytes / best / 1e9


def exact_sample(x, w, m_idx, o_idx):
    w64 = (w[o_idx].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.array([math.fsum(x[m].astype(np.float64) * w64[i]) for i, m in enumerate(m_idx)])


def check_rows(x, w, y, rng, samples=8):
    """Sampled outputs against the exact sum, within the derived bound of the route taken."""
    from ltx2blas.linear_layer import gamma

    m_idx = rng.integers(0, x.shape[0], samples)
    o_idx = rng.integers(0, w.shape[0], samples)
    ref = exact_sample(x, w, m_idx, o_idx)
    w64 = harness.widen(w[o_idx]).astype(np.float64)
    mag = np.array([np.sum(np.abs(x[m].astype(np.float64) * w64[i])) for i, m in enumerate(m_idx)])
    bound = gamma(x.shape[0], x.shape[1], w.dtype) * mag
    got = y[m_idx, o_idx].astype(np.float64)
    ulp = np.spacing(np.abs(got).astype(np.float32)).astype(np.float64)
    return bool(np.all(np.abs(got - ref) <= bound + ulp / 2))


def ceilings(threads, weight, repeats=5):
    """(sgemm GFLOP/s, read GB/s) at ``threads``: best of ``repeats``, each after the worker
    threads of the last parallel call have gone quiet."""
    from ltx2blas import _gemm
    from threadpoolctl import threadpool_limits

    n = 2048
    sq = np.random.default_rng(2).standard_normal((n, n), dtype=np.float32)
    best = float("inf")
    with threadpool_limits(threads, user_api="blas"):
        _gemm.sgemm(sq[:256], sq)
        for _ in range(repeats):
            time.sleep(0.2)
            t0 = time.perf_counter()
            _gemm.sgemm(sq, sq)
            best = min(best, time.perf_counter() - t0)
    time.sleep(0.2)
    return 2.0 * n**3 / best / 1e9, read_bandwidth(weight, threads, repeats)


def run(threads_list, outs, rows_list, repeats):
    import ltx2blas

    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    results = []
    for out in outs:
        weight = harness.random_bf16(rng, (out, IN_FEATURES), 0.02)
        w32 = torch.from_numpy(harness.widen(weight)) if torch is not None else None
        x_all = rng.standard_normal((max(rows_list), IN_FEATURES), dtype=np.float32)
        for threads in threads_list:
            peak, bw = ceilings(threads, weight)
            for rows in rows_list:
                x = x_all[:rows]
                y = np.empty((rows, out), np.float32)
                cands = {"ltx2blas": lambda: ltx2blas.linear(x, weight, threads=threads, out=y)}
                if torch is not None:
                    tx = torch.from_numpy(x)

                    def torch_f32():
                        torch.set_num_threads(threads)
                        torch.nn.functional.linear(tx, w32)

                    cands["torch_f32"] = torch_f32
                t = harness.interleaved(cands, repeats=repeats, warmup=1)
                flops = 2.0 * rows * out * IN_FEATURES
                compute_s, memory_s = flops / (peak * 1e9), weight.nbytes / (bw * 1e9)
                roofline_s = max(compute_s, memory_s)
                ours = t["ltx2blas"]["median"]
                row = {
                    "workload": "linear", "rows": rows, "out": out, "in": IN_FEATURES,
                    "threads": threads, "ms": ours * 1e3, "gflops": flops / ours / 1e9,
                    "sgemm_gflops": peak, "read_gbs": bw, "roofline_ms": roofline_s * 1e3,
                    "of_roofline": roofline_s / ours,
                    "bound": "compute" if compute_s > memory_s else "memory",
                    "spread": t["ltx2blas"]["spread"],
                    "checked": check_rows(x, weight, y, rng),
                }
                if "torch_f32" in t:
                    row["torch_f32_ms"] = t["torch_f32"]["median"] * 1e3
                    row["vs_torch_f32"] = t["torch_f32"]["median"] / ours
                results.append(row)
                torch_text = (f"  torch f32 {row['torch_f32_ms']:.0f} ms -> {row['vs_torch_f32']:.2f}x"
                              if "vs_torch_f32" in row else "")
                print(f"threads={threads} out={out} M={rows:>4}: {row['ms']:8.1f} ms "
                      f"{row['gflops']:6.1f} GFLOP/s  {row['of_roofline']:.2f} of roofline "
                      f"({row['bound']}: sgemm {peak:.0f} GFLOP/s, read {bw:.1f} GB/s){torch_text}"
                      f"  checked={row['checked']}", flush=True)
        weight = w32 = x_all = None  # freed before the next (larger) weight is made
    return results


def accuracy(rows=4, out=2048, samples=48):
    """Max error of each way of computing the caption projection, on the real width, against
    the exact sum: in f32 ulps of the exact value, and relative to sum |x w|."""
    import ltx2blas

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
        "ltx2blas f32, sgemm route": lambda: ltx2blas.linear(
            np.ascontiguousarray(np.resize(x, (32, IN_FEATURES))), weight)[:rows],
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


def markdown(rows):
    lines = ["| threads | out | M | ms | GFLOP/s | ÷ roofline | bound | vs torch f32 | checked |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        torch_text = f"{r['vs_torch_f32']:.2f}×" if "vs_torch_f32" in r else "—"
        lines.append(f"| {r['threads']} | {r['out']} | {r['rows']} | {r['ms']:.0f} | "
                     f"{r['gflops']:.0f} | {r['of_roofline']:.2f} | {r['bound']} | {torch_text} | "
                     f"{'yes' if r['checked'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="out = 256, M up to 64, 2 repeats")
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--accuracy", action="store_true", help="print the accuracy table only")
    parser.add_argument("--out", default=None, help="write rows as JSON here")
    parser.add_argument("--md", default=None, help="write a markdown table here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    if args.accuracy:
        table = accuracy()
        if args.out:
            harness.write_json(args.out, {"machine": harness.machine(), "accuracy": table})
        return 0
    from ltx2blas._threads import available_cpus

    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else list(range(1, available_cpus() + 1)))
    if args.quick:
        rows = run(threads, [256], [1, 8, 64], repeats=2)
    else:
        rows = run(threads, OUTS, ROWS, repeats=3)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows) + "\n")
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
