"""The fuse into scaled and quantised layouts against the bf16 fuse and sgemm, in the same run.

For each thread count, rank and layout: fuse_quantized on an LTX-2-shaped weight (the delta
through the GEMM seam, then the layout's merge and requantisation passes), interleaved with the
in-place bf16 fuse of the same shape and rank and a square 2048^3 sgemm at the same thread count.
Reported: the layout's time divided by the bf16 fuse's (what the layout costs on top), and its
rate as a fraction of the sgemm rate; on CPUs with the dot-product kernel (AVX512_BF16) also
the time of the same call with that kernel off over the time with it (``f32_time_ratio``).  The block layouts' first 128 rows are checked against ltx2blas.reference.

    python bench/bench_layouts.py [--threads 1,2] [--ranks 32,384] [--shape 4096x4096]
    python bench/bench_layouts.py --passes [--threads 1,2]   (the layouts' passes alone,
                                         the AVX-512 path against the scalar one, interleaved)
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

LAYOUTS = ("fp8_scaled", "comfy_fp8", "fp8_block", "fp6_block", "nvfp4")


def weights(rng, rows, cols):
    """Stored weights of every layout, from one bf16 weight quantised simply (the values only
    need to be plausible: the timing does not depend on them)."""
    from ltx2blas import reference

    w = harness.widen(harness.random_bf16(rng, (rows, cols), 0.02))
    scale = np.array(np.abs(w).max() / 448, np.float32)
    codes = reference.fp8_round(w / scale, "F8_E4M3")
    bs = (np.abs(w).reshape(rows // 128, 128, cols // 128, 128).max(axis=(1, 3)) / 448).astype(np.float32)
    bcodes = reference.fp8_round(w / np.repeat(np.repeat(bs, 128, 0), 128, 1), "F8_E4M3")
    bs6 = (bs * np.float32(448 / 0.1172)).astype(np.float32)
    packed6 = reference.fp6_pack(reference.fp8_round(
        w / np.repeat(np.repeat(bs6, 128, 0), 128, 1), "F8_E4M3"))
    padded = (-(-rows // 128) * 128, -(-(cols // 16) // 4) * 4)
    block = np.full(padded, 0x38, np.uint8)
    packed4 = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    return {
        "fp8_scaled": (codes, {"scale": scale}),
        "comfy_fp8": (codes, {"scale": scale}),
        "fp8_block": (bcodes, {"scale": bs}),
        "fp6_block": (packed6, {"scale": bs6}),
        "nvfp4": (packed4, {"scale": block, "scale_2": np.array(1e-3, np.float32)}),
    }


def run(threads_list, shape, ranks, repeats=3, log=print):
    import ltx2blas
    from ltx2blas import _gemm, reference

    rng = np.random.default_rng(0)
    rows, cols = shape
    stored = weights(rng, rows, cols)
    bf16_weight = harness.random_bf16(rng, (rows, cols), 0.02)
    out = []
    for rank in ranks:
        a = harness.random_bf16(rng, (rank, cols), 0.01)
        b = harness.random_bf16(rng, (rows, rank), 0.01)
        flops = 2.0 * rows * cols * rank
        delta = np.empty((rows, cols), np.uint16)
        for threads in threads_list:
            square, square_flops = harness.square_sgemm(threads)
            work = bf16_weight.copy()
            cands = {"bf16": lambda: ltx2blas.fuse_lora(work, a, b, 0.8, threads=threads, out=work),
                     "sgemm_square": square}
            for layout, (w, kw) in stored.items():
                cands[layout] = (lambda w=w, kw=kw, layout=layout: ltx2blas.fuse_quantized(
                    layout, w, [(a, b, 0.8)], threads=threads, delta_buffer=delta, **kw))
                if _gemm.has_pairs_kernel():
                    cands[layout + "_f32"] = harness.without_dot_product(cands[layout])
            t = harness.interleaved(cands, repeats=repeats)
            base = t["bf16"][harness.STAT]
            peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
            for layout, (w, kw) in stored.items():
                got = ltx2blas.fuse_quantized(layout, w, [(a, b, 0.8)], threads=threads, **kw)
                # the block rules work 128 rows at a time: check the first block row against
                # the reference (the per-tensor rules see the whole tensor; the tests hold them)
                checked = None
                if layout in ("fp8_block", "fp6_block"):
                    ref = reference.fuse_quantized(layout, w[:128], (kw["scale"][:1],),
                                                   [(a, b[:128], 0.8)])
                    checked = bool(np.array_equal(got.weight[:128], ref[0]))
                s = t[layout][harness.STAT]
                row = {"workload": "fuse_layout", "layout": layout, "rows": rows, "cols": cols,
                       "rank": rank, "threads": threads, "seconds": s,
                       "seconds_median": t[layout]["median"], "gflops": flops / s / 1e9,
                       "sgemm_gflops": peak, "of_sgemm": flops / s / 1e9 / peak,
                       "of_bf16_fuse": base / s, "bf16_fuse_seconds": base, "checked": checked}
                extra = ""
                if layout + "_f32" in t:
                    row["f32_time_ratio"] = t[layout + "_f32"][harness.STAT] / s
                    extra = f"  dot-product kernel off {row['f32_time_ratio']:.2f}x its time"
                out.append(row)
                log(f"layout {layout:10s} threads={threads} {rows}x{cols} rank {rank:>4}: "
                    f"{row['gflops']:6.1f} GFLOP/s  {row['of_sgemm']:.2f} of sgemm ({peak:.0f})  "
                    f"{s / base:.2f}x the bf16 fuse's time  checked={checked}{extra}")
    return out


def run_passes(threads_list, shape, repeats=7, log=print):
    """The layouts' element passes alone -- per-tensor fp8 (the maximum, then the rounding
    store), blockwise fp8 and NVFP4 (the merge, then each block's or group's requantisation)
    -- on the AVX-512 path
    against the scalar path (the AVX2 table forced, which sends them one element at a time),
    interleaved, the bytes checked the same; each call copies what its passes overwrite
    first, as a fuse that is not in place does."""
    from ltx2blas import _gemm, _quant, reference

    if not any(name.startswith("avx512") for name in _gemm.kernels_built()):
        log("layout passes: this build has no AVX-512 table")
        return []
    rng = np.random.default_rng(0)
    rows, cols = shape
    w = harness.widen(harness.random_bf16(rng, shape, 0.02))
    scale = np.float32(np.abs(w).max() / 448)
    codes = reference.fp8_round(w / scale, "F8_E4M3")
    block_scales = np.full((rows // 128, cols // 128), scale, np.float32)
    delta = harness.random_bf16(rng, shape, 1e-3)
    stored = weights(rng, rows, cols)

    def per_tensor(threads):
        out = codes.copy()
        top = np.float32(_quant.scaled_fp8_max(codes.reshape(-1), delta.reshape(-1), scale,
                                               False, threads))
        mult = (np.float32(1.0) / top) * np.float32(448.0)
        _quant.scaled_fp8_store(out.reshape(-1), delta.reshape(-1), scale, mult,
                                np.float32(448.0), False, threads)
        return (out,)

    def blockwise(threads):
        merged, out, new_scales = delta.copy(), codes.copy(), block_scales.copy()
        _quant.block_merge(codes, False, block_scales, merged, threads)
        _quant.block_quantize(merged, False, out, new_scales, threads)
        return out, new_scales

    nvfp4_codes, nvfp4_scales = stored["nvfp4"][0], stored["nvfp4"][1]["scale"]

    def nvfp4(threads):
        merged, out, new_scales = delta.copy(), nvfp4_codes.copy(), nvfp4_scales.copy()
        top = _quant.nvfp4_merge(nvfp4_codes, nvfp4_scales, np.float32(1e-3), merged, threads)
        _quant.nvfp4_quantize(merged, np.float32(np.float32(top) / np.float32(2688.0)), out,
                              new_scales, threads)
        return out, new_scales

    fast = next(n for n in ("avx512bf16", "avx512") if n in _gemm.kernels_built())
    out_rows = []
    for threads in threads_list:
        for layout, passes in (("per-tensor fp8", per_tensor), ("blockwise fp8", blockwise),
                               ("nvfp4", nvfp4)):
            outs = {}

            def on(table, passes=passes, threads=threads, outs=outs):
                def call():
                    _gemm.use_kernels(table)
                    try:
                        outs[table] = passes(threads)
                    finally:
                        _gemm.use_kernels(None)
                return call

            try:
                t = harness.interleaved({"avx512": on(fast), "scalar": on("avx2")},
                                        repeats=repeats)
            except ValueError as exc:  # the CPU cannot run the table
                log(f"layout passes: {exc}")
                return out_rows
            same = all(np.array_equal(a, b) for a, b in zip(outs[fast], outs["avx2"]))
            row = {"workload": "layout_passes", "passes": layout, "rows": rows, "cols": cols,
                   "threads": threads, "avx512_seconds": t["avx512"][harness.STAT],
                   "scalar_seconds": t["scalar"][harness.STAT],
                   "scalar_time_ratio": t["scalar"][harness.STAT] / t["avx512"][harness.STAT],
                   "same_bytes": same}
            out_rows.append(row)
            log(f"layout passes ({layout}) threads={threads} {rows}x{cols}: AVX-512 "
                f"{row['avx512_seconds'] * 1e3:.1f} ms, scalar "
                f"{row['scalar_seconds'] * 1e3:.1f} ms, scalar {row['scalar_time_ratio']:.2f}x "
                f"its time, same bytes {same}")
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--ranks", default="32,384")
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--passes", action="store_true",
                        help="instead: the layouts' passes alone, AVX-512 against scalar")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    shape = tuple(int(v) for v in args.shape.split("x"))
    threads = harness.thread_counts(args.threads)
    if args.passes:
        rows = run_passes(threads, shape)
    else:
        rows = run(threads, shape, [int(r) for r in args.ranks.split(",")])
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r.get("checked") is not False and r.get("same_bytes", True)
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
