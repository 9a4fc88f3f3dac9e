"""The per-tensor fp8 layouts' element passes alone (the maximum, then the rounding store) on
the AVX-512 path against the scalar path, interleaved, in the same run.

The passes take sixteen elements at a time when the kernel table in use is an AVX-512 one;
forcing the AVX2 table sends them one at a time (the same bytes, checked). An LTX-2-shaped
weight's F8_E4M3 codes and a bf16 delta; each call copies the codes first (as a fuse that is
not in place does); each candidate by its fastest sample (harness.STAT).

    python bench/bench_layout_passes.py [--threads 1,2] [--shape 4096x4096] [--out F]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def run(threads_list, shape, repeats=7, log=print):
    from ltx2blas import _gemm, _quant, reference

    if not any(name.startswith("avx512") for name in _gemm.kernels_built()):
        log("layout passes: this build has no AVX-512 table")
        return []
    rng = np.random.default_rng(0)
    rows, cols = shape
    w = harness.widen(harness.random_bf16(rng, shape, 0.02))
    scale = np.float32(np.abs(w).max() / 448)
    codes = reference.fp8_round(w / scale, "F8_E4M3").reshape(-1)
    delta = harness.random_bf16(rng, (rows * cols,), 1e-3)
    out_rows = []
    for threads in threads_list:
        outs = {}

        def passes(table, threads=threads, outs=outs):
            def call():
                _gemm.use_kernels(table)
                try:
                    out = codes.copy()
                    top = np.float32(_quant.scaled_fp8_max(codes, delta, scale, False, threads))
                    mult = (np.float32(1.0) / top) * np.float32(448.0)
                    _quant.scaled_fp8_store(out, delta, scale, mult, np.float32(448.0), False,
                                            threads)
                    outs[table] = out
                finally:
                    _gemm.use_kernels(None)
            return call

        fast = next(n for n in ("avx512bf16", "avx512") if n in _gemm.kernels_built())
        try:
            t = harness.interleaved({"avx512": passes(fast), "scalar": passes("avx2")},
                                    repeats=repeats)
        except ValueError as exc:  # the CPU cannot run the table
            log(f"layout passes: {exc}")
            return out_rows
        same = bool(np.array_equal(outs[fast], outs["avx2"]))
        row = {"workload": "layout_passes", "rows": rows, "cols": cols, "threads": threads,
               "avx512_seconds": t["avx512"][harness.STAT],
               "scalar_seconds": t["scalar"][harness.STAT],
               "scalar_time_ratio": t["scalar"][harness.STAT] / t["avx512"][harness.STAT],
               "same_bytes": same}
        out_rows.append(row)
        log(f"layout passes threads={threads} {rows}x{cols}: AVX-512 "
            f"{row['avx512_seconds'] * 1e3:.1f} ms, scalar {row['scalar_seconds'] * 1e3:.1f} ms, "
            f"scalar {row['scalar_time_ratio']:.2f}x "
            f"its time, same bytes {same}")
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = run(harness.thread_counts(args.threads), shape)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
