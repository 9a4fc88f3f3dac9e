"""Fuses beyond one adapter into a bf16 weight, against that fuse and sgemm, in the same run.

For each thread count and rank, on one weight shape, interleaved:
  * ``bf16_one``: one adapter into the bf16 weight, in place (the fuse bench_fuse measures);
  * ``bf16_two``: two adapters of that rank, fuse_loras with upstream's addmm rule, in place;
  * ``fp8_one``: one adapter into an F8_E4M3 weight (an LTX-2.3 fp8 checkpoint's), into a
    preallocated output;
  * on CPUs with the dot-product kernel (AVX512_BF16), ``bf16_two_f32`` and ``fp8_one_f32``:
    the same calls with that kernel turned off (the f32 kernels and sgemm it replaces);
  * where torch is installed, upstream LTX-2's arithmetic in torch on the same tensors:
    ``torch_two`` (``matmul(B1 * s1, A1)``, ``addmm_(B2, A2, alpha=s2)``, ``add_`` into W) and
    ``torch_fp8`` (W widened to bf16, ``add_(matmul(B * s, A))``, cast back to float8_e4m3fn);
  * a square 2048^3 sgemm at the same thread count (harness.square_sgemm).
Reported: each fuse's rate (2 x rows x cols x the ranks it adds, per second) as a fraction of
the sgemm rate, its time divided by ``bf16_one``'s, and the ratios of the f32-kernel and torch
times to ltx2blas's (``f32_time_ratio``, ``torch_time_ratio``: above 1, ltx2blas is faster).
Sampled rows of every ltx2blas result are checked byte for byte against ltx2blas.reference.

    python bench/bench_fuse_kinds.py [--threads 1,2] [--ranks 32,384] [--shapes 4096x4096] [--out F]
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers  # noqa: E402

STRENGTHS = (0.8, -0.5)


def torch_calls(weight, fp8, adapters, threads):
    """Upstream's two-adapter and fp8 fuses in torch, on tensors made once (the calls time
    the arithmetic alone); {} without torch."""
    torch = peers.torch_module()
    if torch is None:
        return {}
    torch.set_num_threads(threads)

    def tensor(bits):
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)

    w = tensor(weight.copy())
    codes = torch.from_numpy(fp8.copy()).view(torch.float8_e4m3fn)
    (a1, b1, s1), (a2, b2, s2) = [(tensor(a), tensor(b), s) for a, b, s in adapters]

    def two():
        agg = torch.matmul(b1 * s1, a1)
        agg.addmm_(b2, a2, alpha=s2)
        w.add_(agg)

    def fp8_one():
        wide = codes.to(torch.bfloat16)
        wide.add_(torch.matmul(b1 * s1, a1))
        return wide.to(torch.float8_e4m3fn)

    return {"torch_two": two, "torch_fp8": fp8_one}


def run(threads_list, shapes, ranks, repeats=5, sample_rows=16, log=print):
    out_rows = []
    for shape in shapes:
        out_rows += run_shape(threads_list, shape, ranks, repeats, sample_rows, log)
    return out_rows


def run_shape(threads_list, shape, ranks, repeats, sample_rows, log):
    import ltx2blas
    from ltx2blas import reference

    rows, cols = shape
    rng = np.random.default_rng(0)
    weight = harness.random_bf16(rng, shape, 0.02)
    fp8 = reference.fp8_round(harness.widen(weight), "F8_E4M3")
    out_rows = []
    for rank in ranks:
        adapters = [(harness.random_bf16(rng, (rank, cols), 0.01),
                     harness.random_bf16(rng, (rows, rank), 0.01), s) for s in STRENGTHS]
        sample = np.sort(rng.choice(rows, size=min(rows, sample_rows), replace=False))
        sampled = [(a, b[sample], s) for a, b, s in adapters]
        expected = {
            "bf16_one": reference.fuse_loras(weight[sample], sampled[:1]),
            "bf16_two": reference.fuse_loras(weight[sample], sampled),
            "fp8_one": reference.fuse_loras_fp8(fp8[sample], sampled[:1], "F8_E4M3"),
        }
        flops = {"bf16_one": 2.0 * rows * cols * rank, "bf16_two": 4.0 * rows * cols * rank,
                 "fp8_one": 2.0 * rows * cols * rank}
        for threads in threads_list:
            square, square_flops = harness.square_sgemm(threads)
            bf16_out, fp8_out = weight.copy(), np.empty_like(fp8)
            # In place: each call adds the deltas once more, which changes no timing (no
            # branch depends on the values); the results checked below come from fresh copies.
            cands = {
                "bf16_one": lambda: ltx2blas.fuse_lora(bf16_out, *adapters[0], threads=threads,
                                                       out=bf16_out),
                "bf16_two": lambda: ltx2blas.fuse_loras(bf16_out, adapters, threads=threads,
                                                        out=bf16_out),
                "fp8_one": lambda: ltx2blas.fuse_lora(fp8, *adapters[0], weight_format="F8_E4M3",
                                                      threads=threads, out=fp8_out),
                "sgemm_square": square,
            }
            from ltx2blas import _gemm
            if _gemm.has_pairs_kernel():
                cands["bf16_two_f32"] = harness.without_dot_product(cands["bf16_two"])
                cands["fp8_one_f32"] = harness.without_dot_product(cands["fp8_one"])
            cands.update(torch_calls(weight, fp8, adapters, threads))
            t = harness.interleaved(cands, repeats=repeats)
            peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
            one = t["bf16_one"][harness.STAT]
            checked = {}
            for name in ("bf16_one", "bf16_two", "bf16_two_f32"):
                if name in cands:
                    np.copyto(bf16_out, weight)
                    cands[name]()
                    checked[name] = bool(np.array_equal(bf16_out[sample], expected[name[:8]]))
            for name in ("fp8_one", "fp8_one_f32"):
                if name in cands:
                    cands[name]()
                    checked[name] = bool(np.array_equal(fp8_out[sample], expected["fp8_one"]))
            peer_of = {"bf16_two": "torch_two", "fp8_one": "torch_fp8"}
            for name, same in checked.items():
                seconds = t[name][harness.STAT]
                rate = flops[name.removesuffix("_f32")] / seconds / 1e9
                row = {"workload": "fuse_kinds", "kind": name, "rows": rows, "cols": cols,
                       "rank": rank, "threads": threads, "seconds": seconds,
                       "seconds_median": t[name]["median"], "gflops": rate,
                       "sgemm_gflops": peak, "of_sgemm": rate / peak,
                       "time_of_bf16_one": seconds / one, "same_bytes": same}
                extra = ""
                if name + "_f32" in t:
                    row["f32_time_ratio"] = t[name + "_f32"][harness.STAT] / seconds
                    extra += f"  f32 kernels {row['f32_time_ratio']:.2f}x its time"
                if peer_of.get(name) in t:
                    row["torch_time_ratio"] = t[peer_of[name]][harness.STAT] / seconds
                    extra += f"  torch {row['torch_time_ratio']:.2f}x its time"
                out_rows.append(row)
                log(f"fuse_kinds threads={threads} W {rows}x{cols} rank {rank:>4} {name:12s}: "
                    f"{seconds * 1e3:7.1f} ms  {rate:6.1f} GFLOP/s  {rate / peak:.2f} of sgemm "
                    f"({peak:.0f})  {seconds / one:.2f}x the one-adapter bf16 time  "
                    f"checked={same}{extra}")
    return out_rows


def main(argv=None):
    return harness.shapes_and_ranks_main(__doc__, run, [(4096, 4096)], [32, 384], argv)


if __name__ == "__main__":
    sys.exit(main())
