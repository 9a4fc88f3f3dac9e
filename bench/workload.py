"""One fixed workload, run as a whole process: for timing two builds of ltx2blas against each
other from outside (A B A B ..., e.g. ``/usr/bin/time``, or ``hyperfine`` with
``PYTHONPATH`` naming the other build), where the benchmarks' in-process ratios cannot see two
versions at once.

The inputs are made the same way for every build (a fixed seed, the reference's bf16
rounding), then the calls run ``--calls`` times after one untimed call; the script prints the
fastest call and the total, and checks that every call gave the first call's bytes.

    python bench/workload.py fuse   [--shape 4096x4096] [--rank 384] [--adapters 1] [--fp8]
    python bench/workload.py nvfp4  [--shape 4096x4096] [--rank 384] [--adapters 1]
    python bench/workload.py linear [--rows 8] [--outs 2048] [--x f32|bf16]
                                    [--threads 2] [--calls 5]
"""
import argparse
import sys
import time

import numpy as np

from harness import random_bf16

WIDTH = 188_160    # the caption projection's in-features


def fuse_call(args, rng):
    import ltx2blas

    rows, cols = (int(v) for v in args.shape.split("x"))
    weight = random_bf16(rng, (rows, cols), 0.02)
    adapters = [(random_bf16(rng, (args.rank, cols), 0.02),
                 random_bf16(rng, (rows, args.rank), 0.02), 0.8) for _ in range(args.adapters)]
    if args.fp8:
        from ltx2blas.reference import fp8_round, bf16_widen

        weight = fp8_round(bf16_widen(weight), "F8_E4M3")
        out = np.empty_like(weight)
        return lambda: ltx2blas.fuse_loras(weight, adapters, threads=args.threads, out=out,
                                           weight_format="F8_E4M3")
    work = weight.copy()

    def call():
        np.copyto(work, weight)
        return ltx2blas.fuse_loras(work, adapters, threads=args.threads, out=work)
    return call


def nvfp4_call(args, rng):
    """LTX-2.3's NVFP4 layout: the delta through the seam, then the layout's passes."""
    import ltx2blas

    rows, cols = (int(v) for v in args.shape.split("x"))
    if rows % 128 or cols % 64:
        sys.exit("nvfp4: rows a multiple of 128 and columns of 64 (a tiled scale array without "
                 "padding, whose random bytes need no placing)")
    packed = rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8)
    scales = rng.integers(0x28, 0x60, (rows, cols // 16)).astype(np.uint8)
    adapters = [(random_bf16(rng, (args.rank, cols), 0.02),
                 random_bf16(rng, (rows, args.rank), 0.02), 0.8) for _ in range(args.adapters)]

    def call():
        q = ltx2blas.fuse_quantized("nvfp4", packed, adapters, scale=scales,
                                    scale_2=np.array(0.0007, np.float32), threads=args.threads)
        return np.concatenate([a.reshape(-1).view(np.uint8) for a in q if a is not None])
    return call


def linear_call(args, rng):
    import ltx2blas

    # A million random values repeated: a weight of the real size made in well under a second.
    w = np.resize(random_bf16(rng, (1 << 20,), 0.01), (args.outs, WIDTH))
    if args.x == "bf16":
        x = random_bf16(rng, (args.rows, WIDTH), 1.0)
    else:
        x = rng.standard_normal((args.rows, WIDTH), dtype=np.float32)
    return lambda: ltx2blas.linear(x, w, threads=args.threads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workload", choices=["fuse", "nvfp4", "linear"])
    p.add_argument("--shape", default="4096x4096")
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--adapters", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="the fuse into an F8_E4M3 weight")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--outs", type=int, default=2048)
    p.add_argument("--x", choices=["f32", "bf16"], default="f32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    call = {"fuse": fuse_call, "nvfp4": nvfp4_call, "linear": linear_call}[args.workload](args, rng)
    first = np.array(call(), copy=True)
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        got = call()
        times.append(time.perf_counter() - t0)
        if not np.array_equal(np.asarray(got).view(np.uint8), first.view(np.uint8)):
            sys.exit("a call gave other bytes than the first")
    print(f"{args.workload}: fastest call {min(times) * 1e3:.1f} ms, {args.calls} calls "
          f"{sum(times):.2f} s")


if __name__ == "__main__":
    main()
