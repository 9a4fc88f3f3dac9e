"""One process of plain bf16 fuses, for timing two installs against each other from outside
(the whole process, run in turns with the other install's): the cost of a change to the
fuse's kernels on the common path, where no result overflows.

    python bench/fuse_process.py RANK FUSES THREADS

A 4096 x 4096 bf16 weight and one LoRA of rank RANK, fused FUSES times into the same output
buffer on THREADS threads; prints the fastest fuse on stderr.  Run it under each install's
Python, alternating, and compare the processes' CPU and wall times pair by pair.
"""
import sys
import time

import numpy as np

import ltx2blas


def bf16_bits(rng, shape, scale):
    values = rng.standard_normal(shape).astype(np.float32) * scale
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def main(argv):
    rank, fuses, threads = (int(x) for x in argv)
    rng = np.random.default_rng(0)
    weight = bf16_bits(rng, (4096, 4096), 0.02)
    lora_a, lora_b = bf16_bits(rng, (rank, 4096), 0.05), bf16_bits(rng, (4096, rank), 0.05)
    out = np.empty_like(weight)
    ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, out=out, threads=threads)  # probe, pages
    best = float("inf")
    for _ in range(fuses):
        t0 = time.perf_counter()
        ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, out=out, threads=threads)
        best = min(best, time.perf_counter() - t0)
    print(f"rank {rank}, {threads} thread(s): fastest fuse {best * 1e3:.1f} ms", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
