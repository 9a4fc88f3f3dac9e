"""The fuse against the sgemm rate measured in the same run.

For each thread count, shape and rank: the whole in-place fuse (widening, product, all three
rounding passes) timed interleaved with
  * ``sgemm_square``: one 2048^3 sgemm through the same BLAS at the same thread count (the
    machine's sgemm rate), and
  * ``sgemm_same``: one sgemm of the fuse's own product (out x rank x in) on f32 operands
    already widened, f32 result -- what a caller holding f32 copies would pay for the product
    alone.
Every fused result is checked byte for byte against ltx2blas.reference on sampled rows.

    python bench/bench_fuse.py [--quick] [--threads 1,2] [--out results-fuse.json]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = [(4096, 4096), (16384, 4096), (4096, 16384), (2048, 2048)]
RANKS = [32, 384, 450]


def run(threads_list, shapes, ranks, repeats, sample_rows=16):
    import ltx2blas
    from ltx2blas import _gemm, reference
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    n = 2048
    sq_x = rng.standard_normal((n, n), dtype=np.float32)
    sq_y = rng.standard_normal((n, n), dtype=np.float32)
    rows_out = []
    for threads in threads_list:
        for rows, cols in shapes:
            weight = harness.random_bf16(rng, (rows, cols), 0.02)
            out = weight.copy()
            for rank in ranks:
                lora_a = harness.random_bf16(rng, (rank, cols), 0.01)
                lora_b = harness.random_bf16(rng, (rows, rank), 0.01)
                bs32 = harness.widen(reference.bf16_round(harness.widen(lora_b) * np.float32(0.8)))
                a32 = harness.widen(lora_a)

                def fuse():
                    np.copyto(out, weight)
                    ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads, out=out)

                def sgemm_same():
                    with threadpool_limits(threads, user_api="blas"):
                        _gemm.sgemm(bs32, a32)

                def sgemm_square():
                    with threadpool_limits(threads, user_api="blas"):
                        _gemm.sgemm(sq_x, sq_y)

                def copy_only():  # the reset inside fuse(), timed alone so it can be taken out
                    np.copyto(out, weight)

                t = harness.interleaved({"fuse": fuse, "copy": copy_only, "sgemm_same": sgemm_same,
                                         "sgemm_square": sgemm_square}, repeats=repeats)
                fuse_s = t["fuse"]["median"] - t["copy"]["median"]
                flops = 2.0 * rows * cols * rank
                fuse_rate = flops / fuse_s / 1e9
                same_rate = flops / t["sgemm_same"]["median"] / 1e9
                peak = 2.0 * n**3 / t["sgemm_square"]["median"] / 1e9

                fuse()
                sample = np.sort(rng.choice(rows, size=min(rows, sample_rows), replace=False))
                expected = reference.fuse_lora(weight[sample], lora_a, lora_b[sample], 0.8)
                exact = bool(np.array_equal(out[sample], expected))
                row = {
                    "workload": "fuse", "rows": rows, "cols": cols, "rank": rank,
                    "threads": threads, "gflops": fuse_rate,
                    "sgemm_square_gflops": peak, "sgemm_same_gflops": same_rate,
                    "of_sgemm_square": fuse_rate / peak, "of_sgemm_same": fuse_rate / same_rate,
                    "spread": t["fuse"]["spread"], "checked_rows": len(sample), "exact": exact,
                }
                rows_out.append(row)
                print(f"threads={threads} W {rows}x{cols} rank {rank:>4}: {fuse_rate:6.1f} GFLOP/s"
                      f"  {row['of_sgemm_square']:.3f} of sgemm 2048^3 ({peak:.1f})"
                      f"  {row['of_sgemm_same']:.3f} of sgemm same shape ({same_rate:.1f})"
                      f"  spread {row['spread']:.2f}  exact={exact}", flush=True)
    return rows_out


def markdown(rows):
    """The README table: one line per (threads, shape, rank)."""
    lines = ["| threads | W (out × in) | rank | GFLOP/s | ÷ sgemm 2048³ | ÷ sgemm same shape | exact |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['threads']} | {r['rows']} × {r['cols']} | {r['rank']} | "
                     f"{r['gflops']:.0f} | {r['of_sgemm_square']:.2f} | {r['of_sgemm_same']:.2f} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats")
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--out", default=None, help="write rows as JSON here")
    parser.add_argument("--md", default=None, help="write a markdown table here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    from ltx2blas._threads import available_cpus

    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else list(range(1, available_cpus() + 1)))
    if args.quick:
        rows = run(threads, [(2048, 2048)], [32, 450], repeats=3)
    else:
        rows = run(threads, SHAPES, RANKS, repeats=7)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(rows) + "\n")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
