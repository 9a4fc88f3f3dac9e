"""ltx2blas.resize.resize_lora_weight against kohya-ss resize_lora.py's arithmetic, per module.

kohya's per module (networks/resize_lora.py, as written): the delta ``up @ down`` formed in f32,
``torch.linalg.svd`` of it (full matrices, f32), then the first k columns; the timing covers
those steps.  ltx2blas's: resize_lora_weight (QR of each factor, an r x r SVD, f64), the same
rank.  Interleaved (harness.interleaved), with ``torch.set_num_threads(t)`` for kohya's and
``threads=t`` for ltx2blas's (its two QR factorisations side by side from 2, each BLAS call on
one thread: its contract).

Each shape's error is checked against the optimum: ||delta - B'A'||_F (f64, the new factors in
f32) over sqrt(sum of the squared singular values past k) of an f64 SVD of the formed delta,
and the same for kohya's result.  The factors have a decaying spectrum (0.97^i), as a trained
LoRA's does.

``--merge`` adds a merge of two rank-128 LoRAs (4096 x 4096) to ranks 32 and 256 (the sum:
exact) against kohya-ss networks/svd_merge_lora.py's arithmetic (the summed delta formed, its
full SVD, the factors clamped to their 0.99 quantile); ``--merge-only`` runs only that.

    python bench/bench_resize.py [--threads 1,2] [--repeats 3] [--merge | --merge-only]
                                 [--out FILE.json]
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: (out, in, rank, new rank): LTX-2's attention projections at the ranks its LoRAs ship (the
#: distilled LoRA's 384, trained LoRAs' 128), cut to 32.  Its feed-forwards (16384 x 4096) are
#: left out: kohya's full SVD there builds a 16384 x 16384 U (1 GiB) and takes minutes a call.
SHAPES = ((4096, 4096, 128, 32), (4096, 4096, 384, 32))


def factors(out, inn, r, rng):
    a = (rng.standard_normal((r, inn)) * 0.05).astype(np.float32)
    b = (rng.standard_normal((out, r)) * 0.05 * 0.97 ** np.arange(r)).astype(np.float32)
    return a, b


def kohya(torch, a, b, k):
    """kohya's steps: the delta formed, its full SVD in f32, the first k columns (up takes S)."""
    up, down = torch.from_numpy(b), torch.from_numpy(a)
    full = up @ down
    u, s, vh = torch.linalg.svd(full)
    return (u[:, :k] @ torch.diag(s[:k])).numpy(), vh[:k, :].numpy()


def kohya_merge(torch, pairs, k):
    """kohya's svd_merge_lora steps for LoRA pairs [(down, up, ratio)]: the summed delta formed,
    its full SVD (f32), the first k columns, both factors clamped to the 0.99 quantile of their
    values."""
    full = None
    for down, up, ratio in pairs:
        term = ratio * (torch.from_numpy(up) @ torch.from_numpy(down))
        full = term if full is None else full + term
    u, s, vh = torch.linalg.svd(full)
    u = u[:, :k] @ torch.diag(s[:k])
    vh = vh[:k, :]
    hi = torch.quantile(torch.cat([u.flatten(), vh.flatten()]), 0.99)
    return u.clamp(-hi, hi).numpy(), vh.clamp(-hi, hi).numpy()


def merge_rows(torch, threads_list, repeats, rng):
    """Two rank-128 LoRAs of a 4096 x 4096 module at strengths 0.8 and 0.5, merged to rank 32
    (and to 256, the sum: exact): ltx2blas's stacked factors re-factored against kohya's
    svd_merge_lora arithmetic; the error of each against the optimum of the summed delta."""
    from ltx2blas.resize import resize_lora_weight

    (a1, b1), (a2, b2) = factors(4096, 4096, 128, rng), factors(4096, 4096, 128, rng)
    delta = 0.8 * (b1.astype(np.float64) @ a1.astype(np.float64)) + \
        0.5 * (b2.astype(np.float64) @ a2.astype(np.float64))
    s = np.linalg.svd(delta, compute_uv=False)
    a = np.concatenate([a1, a2]).astype(np.float64)
    b = np.concatenate([b1 * 0.8, b2 * 0.5], axis=1).astype(np.float64)
    rows = []
    for k in (32, 256):
        optimum = float(np.sqrt(np.sum(s[k:] ** 2)))
        ours = resize_lora_weight(a, b, rank=k, dtype="f32")
        ours_err = float(np.linalg.norm(delta - ours.lora_b.astype(np.float64)
                                        @ ours.lora_a.astype(np.float64)))
        torch.set_num_threads(1)
        ku, kv = kohya_merge(torch, [(a1, b1, 0.8), (a2, b2, 0.5)], k)
        kohya_err = float(np.linalg.norm(delta - ku.astype(np.float64) @ kv.astype(np.float64)))
        # at the sum of the ranks the optimum is 0 (an f64 SVD leaves rounding there): the
        # error is then taken relative to the summed delta's norm
        whole = k >= a.shape[0]
        scale = float(np.linalg.norm(delta)) if whole else optimum
        for t in harness.thread_counts(threads_list):
            torch.set_num_threads(t)
            times = harness.interleaved({
                "ltx2blas": lambda: resize_lora_weight(a, b, rank=k, dtype="f32", threads=t),
                "kohya": lambda: kohya_merge(torch, [(a1, b1, 0.8), (a2, b2, 0.5)], k)},
                repeats=repeats)
            row = {"merge": "2 x rank 128, 4096 x 4096", "new_rank": k, "threads": t,
                   "ltx2blas_s": times["ltx2blas"]["min"], "kohya_s": times["kohya"]["min"],
                   "kohya_over_ltx2blas": times["kohya"]["min"] / times["ltx2blas"]["min"],
                   "error_over": "the sum's norm (exact rank: optimum 0)" if whole else
                                 "optimum",
                   "error_ratio": ours_err / scale, "kohya_error_ratio": kohya_err / scale}
            rows.append(row)
            print(f"merge 2 x rank 128 -> {k}, {t} thread(s): ltx2blas "
                  f"{row['ltx2blas_s'] * 1e3:.1f} ms, kohya {row['kohya_s']:.2f} s: "
                  f"{row['kohya_over_ltx2blas']:.0f} x; error / {row['error_over']}: ltx2blas "
                  f"{row['error_ratio']:.6g}, kohya {row['kohya_error_ratio']:.6g}", flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--merge", action="store_true",
                        help="also merge two LoRAs against kohya's svd_merge_lora arithmetic")
    parser.add_argument("--merge-only", action="store_true", help="only that")
    args = parser.parse_args()
    import torch

    from ltx2blas.resize import resize_lora_weight

    rng = np.random.default_rng(0)
    rows = []
    print(f"CPU: {harness.machine().get('cpu', '?')}; torch {torch.__version__}")
    if args.merge_only:
        args.merge = True
    for out, inn, r, k in (() if args.merge_only else SHAPES):
        a, b = factors(out, inn, r, rng)
        delta = b.astype(np.float64) @ a.astype(np.float64)
        t0 = time.perf_counter()
        s = np.linalg.svd(delta, compute_uv=False)
        optimum = float(np.sqrt(np.sum(s[k:] ** 2)))
        svd_s = time.perf_counter() - t0
        ours = resize_lora_weight(a, b, rank=k, dtype="f32")
        ours_err = float(np.linalg.norm(delta - ours.lora_b.astype(np.float64)
                                        @ ours.lora_a.astype(np.float64)))
        torch.set_num_threads(1)
        ku, kv = kohya(torch, a, b, k)
        kohya_err = float(np.linalg.norm(delta - ku.astype(np.float64) @ kv.astype(np.float64)))
        for t in harness.thread_counts(args.threads):
            torch.set_num_threads(t)
            times = harness.interleaved({
                "ltx2blas": lambda: resize_lora_weight(a, b, rank=k, dtype="f32", threads=t),
                "kohya": lambda: kohya(torch, a, b, k)}, repeats=args.repeats)
            row = {"shape": [out, inn], "rank": r, "new_rank": k, "threads": t,
                   "ltx2blas_s": times["ltx2blas"]["min"], "kohya_s": times["kohya"]["min"],
                   "kohya_over_ltx2blas": times["kohya"]["min"] / times["ltx2blas"]["min"],
                   "error_over_optimum": ours_err / optimum,
                   "kohya_error_over_optimum": kohya_err / optimum,
                   "f64_svd_s": svd_s, "n": {n: v["n"] for n, v in times.items()}}
            rows.append(row)
            print(f"{out} x {inn} rank {r} -> {k}, {t} thread(s): ltx2blas "
                  f"{row['ltx2blas_s'] * 1e3:.1f} ms, kohya {row['kohya_s']:.2f} s: "
                  f"{row['kohya_over_ltx2blas']:.0f} x; error / optimum ltx2blas "
                  f"{row['error_over_optimum']:.6f}, kohya {row['kohya_error_over_optimum']:.6f}",
                  flush=True)
    merged = merge_rows(torch, args.threads, args.repeats, rng) if args.merge else []
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "torch": torch.__version__,
                                      "rows": rows, "merge_rows": merged})


if __name__ == "__main__":
    main()
