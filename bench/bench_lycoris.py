"""LoHa and LoKr fuses into a bf16 weight, against a LoRA's, sgemm and ComfyUI's arithmetic in
torch, in the same run.

For each thread count, on one weight shape, interleaved:
  * ``lora``: one rank-R LoRA into the bf16 weight, in place (the fuse bench_fuse measures);
  * ``loha``: a LoHa whose two pairs have rank R (twice the LoRA's products, then their
    element-wise product);
  * ``lokr_f8``, ``lokr_f16``: LoKrs of factor 8 and 16 (LyCORIS' layout: w1 [f, f] whole,
    w2 [rows / f, cols / f] a pair of rank R): a small product, then the Kronecker pass over the
    weight;
  * where torch is installed, ComfyUI's arithmetic on the same tensors (``torch_*``: the weight
    widened to f32, the factors' f32 products, the element-wise or Kronecker product, scaled,
    added, cast back to bf16 -- weight_adapter/loha.py and lokr.py on the CPU);
  * a square 2048^3 sgemm at the same thread count.
Reported: each fuse's time, its rate where it multiplies (2 x rows x cols x R per low-rank
product over the weight) as a fraction of the sgemm rate, its time over the LoRA's, and torch's
time over ltx2blas's (above 1, ltx2blas is faster).  Sampled rows of every ltx2blas result are
checked byte for byte against ltx2blas.reference.

    python bench/bench_lycoris.py [--threads 1,2] [--rank 32] [--shape 4096x4096] [--out F]
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers  # noqa: E402

STRENGTH = 0.8


def adapters(rng, rows, cols, rank):
    """The adapters by kind, as ltx2blas takes them, and their tensors by role for torch."""
    import ltx2blas

    def bf16(shape, scale):
        return harness.random_bf16(rng, shape, scale)

    lora = (bf16((rank, cols), 0.01), bf16((rows, rank), 0.01), STRENGTH)
    ha = {"w1_a": bf16((rows, rank), 0.1), "w1_b": bf16((rank, cols), 0.1),
          "w2_a": bf16((rows, rank), 0.1), "w2_b": bf16((rank, cols), 0.1)}
    kinds = {"lora": (lora, None),
             "loha": (ltx2blas.LoHa(ha["w1_a"], ha["w1_b"], ha["w2_a"], ha["w2_b"], STRENGTH), ha)}
    for f in (8, 16):
        kr = {"w1": bf16((f, f), 0.5), "w2_a": bf16((rows // f, rank), 0.05),
              "w2_b": bf16((rank, cols // f), 0.05)}
        kinds[f"lokr_f{f}"] = (ltx2blas.LoKr(kr["w1"], (kr["w2_a"], kr["w2_b"]), STRENGTH), kr)
    return kinds


def flops(kind, rows, cols, rank, f=None):
    """The multiply-adds' work, 2 x m x n x k per low-rank product."""
    if kind == "lora":
        return 2.0 * rows * cols * rank
    if kind == "loha":
        return 4.0 * rows * cols * rank
    return 2.0 * (rows // f) * (cols // f) * rank


def torch_calls(weight, kinds, threads):
    """ComfyUI's LoHa and LoKr patches in torch on tensors made once; {} without torch."""
    torch = peers.torch_module()
    if torch is None:
        return {}
    torch.set_num_threads(threads)

    def f32(bits):
        return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(torch.float32)

    w = torch.from_numpy(weight.view(np.int16)).view(torch.bfloat16)
    calls = {}
    for name, (_, t) in kinds.items():
        if t is None:
            continue
        t = {k: f32(v) for k, v in t.items()}
        if name == "loha":
            def call(t=t):
                wide = w.to(torch.float32)
                wide += STRENGTH * (torch.mm(t["w1_a"], t["w1_b"]) * torch.mm(t["w2_a"], t["w2_b"]))
                return wide.to(torch.bfloat16)
        else:
            def call(t=t):
                wide = w.to(torch.float32)
                diff = torch.kron(t["w1"], torch.mm(t["w2_a"], t["w2_b"])).reshape(wide.shape)
                wide += STRENGTH * diff
                return wide.to(torch.bfloat16)
        calls["torch_" + name] = call
    return calls


def run(threads_list, shape, rank, repeats=5, sample_rows=16, log=print):
    import ltx2blas
    from ltx2blas import reference

    rows, cols = shape
    rng = np.random.default_rng(0)
    weight = harness.random_bf16(rng, shape, 0.02)
    kinds = adapters(rng, rows, cols, rank)
    sample = np.sort(rng.choice(rows, size=min(rows, sample_rows), replace=False))
    out_rows = []
    for threads in threads_list:
        square, square_flops = harness.square_sgemm(threads)
        out = weight.copy()

        def fuse(item):
            # In place: each call adds the delta once more, which changes no timing (no branch
            # depends on the values); the results checked below come from a fresh copy.
            return lambda: ltx2blas.fuse_loras(out, [item], threads=threads, out=out)
        cands = {name: fuse(item) for name, (item, _) in kinds.items()}
        cands["sgemm_square"] = square
        cands.update(torch_calls(weight, kinds, threads))
        t = harness.interleaved(cands, repeats=repeats)
        peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
        lora_time = t["lora"][harness.STAT]
        for name, (item, _) in kinds.items():
            np.copyto(out, weight)
            cands[name]()
            same = bool(np.array_equal(out[sample],
                                       reference.fuse_loras(weight, [item])[sample]))
            seconds = t[name][harness.STAT]
            work = flops(name.split("_")[0], rows, cols, rank,
                         int(name[6:]) if name.startswith("lokr") else None)
            rate = work / seconds / 1e9
            row = {"workload": "fuse_lycoris", "kind": name, "rows": rows, "cols": cols,
                   "rank": rank, "threads": threads, "seconds": seconds,
                   "seconds_median": t[name]["median"], "gflops": rate, "sgemm_gflops": peak,
                   "of_sgemm": rate / peak, "time_of_lora": seconds / lora_time,
                   "same_bytes": same}
            extra = ""
            if "torch_" + name in t:
                row["torch_time_ratio"] = t["torch_" + name][harness.STAT] / seconds
                extra = f"  ComfyUI's arithmetic in torch {row['torch_time_ratio']:.2f}x its time"
            out_rows.append(row)
            log(f"fuse_lycoris threads={threads} W {rows}x{cols} rank {rank} {name:9s}: "
                f"{seconds * 1e3:7.1f} ms  {rate:6.1f} GFLOP/s  {rate / peak:.2f} of sgemm "
                f"({peak:.0f})  {seconds / lora_time:.2f}x the LoRA's time  checked={same}{extra}")
    return out_rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--shape", default="4096x4096", help="RxC, both multiples of 16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    shape = tuple(int(v) for v in args.shape.split("x"))
    rows = run(harness.thread_counts(args.threads), shape, args.rank, args.repeats)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
