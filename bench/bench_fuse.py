"""The fuse against the sgemm rate and against its peers, in the same run.

For each thread count, weight shape and rank: the whole in-place fuse (widening, product, all
three rounding passes), interleaved with
  * ``sgemm_same``: one sgemm of the fuse's own product on f32 operands already widened, f32
    result -- what the product alone costs a caller holding f32 copies;
  * peers, where installed: numpy + ml_dtypes (widen, matmul, round, add) and torch with
    upstream's arithmetic (``matmul(B * s, A)`` in bf16, ``add_(W)``);
and compared with the rate of a square 2048^3 sgemm at the same thread count, interleaved with
them (harness.square_sgemm). Every candidate is judged by its fastest sample (harness.STAT),
medians recorded beside; the ratio against the best square sgemm of the ceilings at the start
of the run is recorded too (``of_sgemm_at_start``).  Once per
shape, the reports' scalar loop is timed on a slice of the rows (the "before" figure).
Our result is checked byte for byte against ltx2blas.reference on sampled rows; each peer's
result is compared with the reference too, and how many of its elements differ is recorded.

    python bench/run.py --only fuse          (the suite)
    python bench/bench_fuse.py [--quick] [--threads 1,2] [--ranks 32,64,128] [--shapes 2048x2048]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers  # noqa: E402

SHAPES = [(4096, 4096), (16384, 4096), (4096, 16384), (2048, 2048)]
RANKS = [32, 384, 450]
STRENGTH = 0.8


def run(threads_list, shapes, ranks, ceilings, repeats=5, sample_rows=16, log=print):
    import ltx2blas
    import _ltx2blas_hooks as hooks
    from ltx2blas import reference
    from ltx2blas.fuse import default_tile, route_of
    from threadpoolctl import threadpool_limits

    have_numpy_peer = peers.ml_dtypes_module() is not None
    have_torch = peers.torch_module() is not None
    rng = np.random.default_rng(0)
    rows_out = []
    for rows, cols in shapes:
        weight = harness.random_bf16(rng, (rows, cols), 0.02)
        out = weight.copy()
        for rank in ranks:
            lora_a = harness.random_bf16(rng, (rank, cols), 0.01)
            lora_b = harness.random_bf16(rng, (rows, rank), 0.01)
            bs = reference.bf16_round(harness.widen(lora_b) * np.float32(STRENGTH))
            bs32, a32 = harness.widen(bs), harness.widen(lora_a)
            product = np.empty((rows, cols), np.float32)  # reused: the baseline pays no page faults
            flops = 2.0 * rows * cols * rank
            scalar = peers.scalar_lora_rate(lora_a, bs, max(1, min(rows, 8)), harness.best_time)
            sample = np.sort(rng.choice(rows, size=min(rows, sample_rows), replace=False))
            expected = reference.fuse_lora(weight[sample], lora_a, lora_b[sample], STRENGTH)
            for threads in threads_list:
                state = {}
                square, square_flops = harness.square_sgemm(threads)

                def ours():
                    # In place. Each call adds one more delta to the weight, which changes no
                    # timing (no branch depends on the values); the result checked below comes
                    # from a fresh copy.
                    ltx2blas.fuse_lora(out, lora_a, lora_b, STRENGTH, threads=threads, out=out)

                def sgemm_same():
                    with threadpool_limits(threads, user_api="blas"):
                        hooks.sgemm(bs32, a32, out=product)

                cands = {"ltx2blas": ours, "sgemm_same": sgemm_same, "sgemm_square": square}
                if have_numpy_peer:
                    cands["numpy_ml_dtypes"] = lambda: state.__setitem__(
                        "numpy", peers.numpy_fuse(weight, lora_a, lora_b, STRENGTH, threads))
                if have_torch:
                    cands["torch_upstream"] = lambda: state.__setitem__(
                        "torch", peers.torch_fuse(weight, lora_a, lora_b, STRENGTH, threads))
                harness.reset_peak_rss()
                t = harness.interleaved(cands, repeats=repeats)
                ours_s = t["ltx2blas"][harness.STAT]
                rate = flops / ours_s / 1e9
                peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
                at_start = ceilings[threads]["sgemm_gflops"]
                np.copyto(out, weight)
                ours()
                row = {
                    "workload": "fuse", "rows": rows, "cols": cols, "rank": rank,
                    "threads": threads, "gflops": rate, "seconds": ours_s,
                    "seconds_median": t["ltx2blas"]["median"],
                    "of_sgemm_median": t["sgemm_square"]["median"] / square_flops * flops
                    / t["ltx2blas"]["median"],
                    "spread": t["ltx2blas"]["spread"],
                    "sgemm_gflops": peak, "of_sgemm": rate / peak,
                    "sgemm_gflops_at_start": at_start, "of_sgemm_at_start": rate / at_start,
                    "sgemm_same_gflops": flops / t["sgemm_same"][harness.STAT] / 1e9,
                    "of_sgemm_same": t["sgemm_same"][harness.STAT] / ours_s,
                    "peak_rss_mib": harness.peak_rss_mib(),
                    "checked": bool(np.array_equal(out[sample], expected)),
                    # the register-only peak of the instruction this rank's route runs on
                    **harness.of_instruction_peak(rate, route_of(rank, default_tile(rows, cols)),
                                                  ceilings[threads]),
                    "peers": {},
                }
                if scalar:
                    row["peers"]["reports_scalar_loop"] = {
                        "gflops": scalar, "speedup": rate / scalar,
                        "note": f"1 thread, timed on {max(1, min(rows, 8))} rows"}
                for name, key in (("numpy_ml_dtypes", "numpy"), ("torch_upstream", "torch")):
                    if name in t:
                        got = state[key][sample]
                        row["peers"][name] = {
                            "gflops": flops / t[name][harness.STAT] / 1e9,
                            "speedup": t[name][harness.STAT] / ours_s,
                            "elements_differing_from_reference": int(np.count_nonzero(got != expected)),
                            "elements_checked": int(expected.size)}
                rows_out.append(row)
                peer_text = "  ".join(f"{k} x{v['speedup']:.2f}" for k, v in row["peers"].items())
                log(f"fuse threads={threads} W {rows}x{cols} rank {rank:>4}: {rate:6.1f} GFLOP/s  "
                    f"{row['of_sgemm']:.2f} of sgemm ({peak:.0f}; {rate / at_start:.2f} of {at_start:.0f} "
                    f"at start)  {row['of_sgemm_same']:.2f} of "
                    f"same-shape sgemm  checked={row['checked']}  vs: {peer_text}")
    return rows_out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one small shape, few repeats")
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--ranks", default=None,
                        help=f"comma list, default {','.join(map(str, RANKS))}")
    parser.add_argument("--shapes", default=None,
                        help="comma list of ROWSxCOLS, default "
                             + ",".join(f"{r}x{c}" for r, c in SHAPES))
    parser.add_argument("--save", default=None, help="write the rows and the machine as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    threads = harness.thread_counts(args.threads)
    ceilings = {t: harness.ceilings(t) for t in threads}
    if args.quick:
        rows = run(threads, [(2048, 2048)], [32, 450], ceilings, repeats=3)
    else:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else RANKS
        shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
                  if args.shapes else SHAPES)
        rows = run(threads, shapes, ranks, ceilings)
    if args.save:
        harness.write_json(args.save, {"machine": harness.machine(), "fuse": rows})
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
