"""LoRA extraction: ltx2blas's randomized range finder against the same run's sgemm, torch's
``svd_lowrank`` and a full ``torch.linalg.svd``, per weight; and a whole LTX-2-shaped
checkpoint against the time to read both files.

Per weight (a fine-tuning-like difference: a decaying spectrum of 512 directions, 0.05 (i+1)^-0.8,
plus full-rank noise, added to a bf16 base and rounded to bf16 like a tuned checkpoint), for
each rank and thread count, interleaved:
  * ``ltx2blas``: extract_lora_weight at the rank (oversampling 10, 2 power iterations);
  * ``products``: its GEMM part alone, the 2 x (iterations + 1) products of the difference with
    a thin matrix (d_times, dt_times), and their rate against ``sgemm_square`` (2048^3, same
    threads);
  * ``difference``: the f32 difference of the two weights alone, the first step of ltx2blas's;
  * where torch is installed, ``svd_lowrank`` on the same f32 difference with the same columns
    and iterations (given the difference: the range finder alone), the same from the two bf16
    weights (``tuned.float() - base.float()`` first, as a torch script extracts), and a full
    ``torch.linalg.svd`` (timed once per weight; its truncation is the optimum).
Errors are ||D - B A||_F / ||D||_F with the factors as returned (bf16 for ltx2blas, f32 for
torch), and their ratio to the optimum's.  Then the checkpoint: ``--blocks`` blocks of LTX-2's
transformer, tuned by a LoRA of ``--checkpoint-rank`` fused in, extracted at that rank (a weight
at a time on every thread, and with two or more threads a weight per thread side by side),
against reading every tensor of both files.

    python bench/bench_extract.py [--threads 1,2] [--ranks 32,64,128,384] [--shape 4096x4096]
                                  [--blocks 2] [--out F]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_checkpoint  # noqa: E402
import harness  # noqa: E402
import peers  # noqa: E402

OVERSAMPLE, ITERATIONS = 10, 2


def sample_weights(shape, rng):
    """(tuned, base) bf16 bits: a base and a fine-tuning-like difference (see the docstring)."""
    from ltx2blas import reference

    rows, cols = shape
    k = min(512, rows, cols)
    sigma = (0.05 * (np.arange(k) + 1.0) ** -0.8).astype(np.float32)
    u = rng.standard_normal((rows, k), dtype=np.float32) / np.float32(np.sqrt(rows))
    v = rng.standard_normal((k, cols), dtype=np.float32) / np.float32(np.sqrt(cols))
    d = (u * sigma) @ v + rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(1e-4)
    base = harness.random_bf16(rng, shape, 0.02)
    tuned = reference.bf16_round(harness.widen(base) + d)
    return tuned, base


def relative_error(d, b, a):
    return float(np.linalg.norm(d - b.astype(np.float32) @ a.astype(np.float32)) /
                 np.linalg.norm(d))


def run_weights(threads_list, shape, ranks, repeats=3, full_svd=True, log=print):
    from ltx2blas import _lowrank, reference
    from ltx2blas._threads import blas_single_threaded
    from ltx2blas.extract import difference, extract_lora_weight, range_width

    rng = np.random.default_rng(0)
    tuned, base = sample_weights(shape, rng)
    d, _ = difference(tuned, base)
    rows, cols = shape
    torch = peers.torch_module()
    full = None
    if torch is not None and full_svd:
        t0 = time.perf_counter()
        u, s, vh = torch.linalg.svd(torch.from_numpy(d), full_matrices=False)
        full = {"seconds": time.perf_counter() - t0, "s": s.double().numpy()}
        log(f"full torch.linalg.svd of {rows}x{cols}: {full['seconds']:.1f} s "
            f"({torch.get_num_threads()} torch threads)")
    out_rows = []
    for rank in ranks:
        width = range_width(rank, OVERSAMPLE, min(rows, cols))
        x = np.ones((cols, width), np.float32)
        y = np.empty((rows, width), np.float32)
        yt = np.ones((width, rows), np.float32)
        zt = np.empty((width, cols), np.float32)
        for threads in threads_list:
            square, square_flops = harness.square_sgemm(threads)
            made = {}

            def ours():
                made["low"] = extract_lora_weight(tuned, base, rank=rank, threads=threads,
                                                  name="w")

            def products():
                with blas_single_threaded():
                    for _ in range(ITERATIONS + 1):
                        _lowrank.d_times(d, x, y, threads)
                        _lowrank.dt_times(d, yt, zt, threads)
            cands = {"ltx2blas": ours, "products": products, "sgemm_square": square,
                     "difference": lambda: difference(tuned, base, threads)}
            if torch is not None:
                torch.set_num_threads(threads)
                dt = torch.from_numpy(d)
                tt = torch.from_numpy(tuned.view(np.int16)).view(torch.bfloat16)
                bt = torch.from_numpy(base.view(np.int16)).view(torch.bfloat16)

                def lowrank():
                    made["torch"] = torch.svd_lowrank(dt, q=width, niter=ITERATIONS)

                def lowrank_pair():   # from the weights, as a torch script extracts
                    torch.svd_lowrank(tt.float() - bt.float(), q=width, niter=ITERATIONS)
                cands["svd_lowrank"] = lowrank
                cands["svd_lowrank_pair"] = lowrank_pair
            t = harness.interleaved(cands, repeats=repeats)
            peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
            product_flops = 2.0 * rows * cols * width * 2 * (ITERATIONS + 1)
            rate = product_flops / t["products"][harness.STAT] / 1e9
            low = made["low"]
            a, b = reference.bf16_widen(low.lora_a), reference.bf16_widen(low.lora_b)
            row = {"workload": "extract", "rows": rows, "cols": cols, "rank": rank,
                   "threads": threads, "seconds": t["ltx2blas"][harness.STAT],
                   "products_seconds": t["products"][harness.STAT], "products_gflops": rate,
                   "sgemm_gflops": peak, "products_of_sgemm": rate / peak,
                   "error": relative_error(d, b, a), "kept": low.kept}
            text = (f"extract threads={threads} {rows}x{cols} rank {rank:>3}: "
                    f"{row['seconds'] * 1e3:8.1f} ms, products {rate:6.1f} GFLOP/s = "
                    f"{rate / peak:.2f} of sgemm ({peak:.0f}), error {row['error']:.5f}")
            if full is not None:
                s = full["s"]
                row["optimum"] = float(np.sqrt(np.sum(s[rank:] ** 2) / np.sum(s ** 2)))
                row["error_of_optimum"] = row["error"] / row["optimum"]
                row["full_svd_seconds"] = full["seconds"]
                row["full_svd_time_ratio"] = full["seconds"] / row["seconds"]
                text += (f" = {row['error_of_optimum']:.4f} x the optimum; full SVD "
                         f"{row['full_svd_time_ratio']:.1f}x its time")
            if "svd_lowrank" in t:
                u_, s_, v_ = made["torch"]
                tb = (u_[:, :rank] * s_[:rank]).numpy()
                ta = v_[:, :rank].T.contiguous().numpy()
                row["svd_lowrank_columns"] = width
                row["svd_lowrank_time_ratio"] = t["svd_lowrank"][harness.STAT] / row["seconds"]
                row["svd_lowrank_error"] = relative_error(d, tb, ta)
                row["svd_lowrank_round_ratios"] = harness.round_ratios(t, "svd_lowrank",
                                                                       "ltx2blas")
                row["svd_lowrank_pair_time_ratio"] = (t["svd_lowrank_pair"][harness.STAT]
                                                      / row["seconds"])
                row["difference_seconds"] = t["difference"][harness.STAT]
                text += (f"; svd_lowrank {row['svd_lowrank_time_ratio']:.2f}x its time "
                         f"(rounds {min(row['svd_lowrank_round_ratios']):.2f}-"
                         f"{max(row['svd_lowrank_round_ratios']):.2f}), from the weights "
                         f"{row['svd_lowrank_pair_time_ratio']:.2f}x, error "
                         f"{row['svd_lowrank_error']:.5f}")
            out_rows.append(row)
            log(text)
    return out_rows


def run_checkpoint(threads_list, blocks, rank, log=print, scale=1):
    import ltx2blas
    from ltx2blas.files.checkpoint import Checkpoint
    from ltx2blas.files.extract import extract_lora

    folder = tempfile.mkdtemp(prefix="ltx2blas-bench-")
    out_rows = []
    try:
        block = {m: (o // scale, i // scale) for m, (o, i) in bench_checkpoint.BLOCK.items()}
        base, lora = bench_checkpoint.build(folder, blocks, rank, np.random.default_rng(1),
                                            log=log, block=block)
        # the built adapter's factors are too small to change the weights; these do, by a few
        # percent, as a fine-tuning does
        from ltx2blas.files.safetensors import SafetensorsFile, SafetensorsWriter

        rng = np.random.default_rng(2)
        with SafetensorsFile(lora) as f:
            entries = [(n, "BF16", tuple(i.shape), 2 * int(np.prod(i.shape)))
                       for n, i in f.tensors.items()]
        with SafetensorsWriter(lora, entries) as w:
            for name, _, shape, _ in entries:
                w.write(name, harness.random_bf16(rng, shape, 0.05))
            w.commit()
        tuned = os.path.join(folder, "tuned.safetensors")
        ltx2blas.fuse_checkpoint(base, [(lora, 1.0)], tuned, digests=False)
        out = os.path.join(folder, "extracted.safetensors")

        def read_both():
            for path in (tuned, base):
                with Checkpoint(path) as ckpt:
                    for name, (f, _) in ckpt.entries.items():
                        f.read(name)
        for threads in threads_list:
            made = {}

            def extract():
                made["report"] = extract_lora(tuned, base, out, rank=rank, threads=threads,
                                              weights_at_once=1)

            def side_by_side():   # a weight per thread, each on one
                extract_lora(tuned, base, out, rank=rank, threads=threads,
                             weights_at_once=threads)
            cands = {"extract": extract, "read_both": read_both}
            if threads > 1:
                cands["side_by_side"] = side_by_side
            t = harness.interleaved(cands, repeats=2)
            report = made["report"]
            row = {"workload": "extract_checkpoint", "blocks": blocks, "rank": rank,
                   "threads": threads, "weights": report.weights_extracted,
                   "seconds": t["extract"][harness.STAT],
                   "read_seconds": t["read_both"][harness.STAT],
                   "of_read": t["extract"][harness.STAT] / t["read_both"][harness.STAT],
                   "least_kept": min(k for _, k in report.ranks.values())}
            text = (f"extract checkpoint threads={threads} {blocks} blocks, {row['weights']} "
                    f"weights at rank {rank}: {row['seconds']:.2f} s = {row['of_read']:.1f}x "
                    f"reading both files ({row['read_seconds']:.2f} s); least fraction kept "
                    f"{row['least_kept']:.5f}")
            if "side_by_side" in t:
                row["side_by_side_seconds"] = t["side_by_side"][harness.STAT]
                row["side_by_side_speedup"] = row["seconds"] / row["side_by_side_seconds"]
                text += (f"; {threads} weights side by side {row['side_by_side_seconds']:.2f} s "
                         f"({row['side_by_side_speedup']:.2f}x)")
            out_rows.append(row)
            log(text)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--ranks", default="32,64,128,384")
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-full-svd", action="store_true", help="skip torch's full SVD")
    parser.add_argument("--blocks", type=int, default=2, help="blocks of the checkpoint (0: none)")
    parser.add_argument("--checkpoint-rank", type=int, default=64)
    parser.add_argument("--scale", type=int, default=1, help="divide the checkpoint's shapes")
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    threads = harness.thread_counts(args.threads)
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = run_weights(threads, shape, [int(r) for r in args.ranks.split(",")], args.repeats,
                       not args.no_full_svd)
    if args.blocks:
        rows += run_checkpoint(threads, args.blocks, args.checkpoint_rank, scale=args.scale)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
