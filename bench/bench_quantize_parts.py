"""The parts of ``ltx2blas quantize`` one at a time, each on one thread, on the checkpoint of
bench_quantize.py: the CPU time a whole run must spend, whatever it overlaps.

For each format: the pass over the file that reads it into memory (pread into a reused buffer,
in the quantiser's pieces, each piece's maxima taken as it does), the quantising kernels over
every chosen weight (quantize_weight on one thread, its codes over the weight's own memory as
the quantiser writes them), the BLAKE3 of the output's bytes, and writing them into a new file
in ``--out-dir`` (write(2) from memory).  Beside them, the copy of the file (shutil.copyfile)
that the quantiser is compared with.  The sum is the work; over the machine's CPUs it is a floor
for the run's time, which overlap can approach but not pass.  Best of ``--repeats``.

    python bench/bench_quantize_parts.py --model /tmp/qbench/model.safetensors --out-dir /dev/shm
"""
import argparse
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out-dir", default="/dev/shm")
    parser.add_argument("--formats", default="fp8_scaled,comfy_nvfp4,fp8_block,comfy_mxfp8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import blake3

    from ltx2blas import quantized as qz
    from ltx2blas.files.checkpoint import Checkpoint
    from ltx2blas.files.quantize import READ_PIECE, Quantizing, source_layouts
    from ltx2blas.files.safetensors import read_into

    ckpt = Checkpoint(args.model)
    entries_of = {n: (i.dtype, tuple(i.shape)) for n, (_, i) in ckpt.entries.items()}
    size = os.path.getsize(args.model)
    largest = max(i.nbytes for _, i in ckpt.entries.values())
    buffer = np.empty(largest // 2 + 1, np.uint16)
    buffer[:] = 0  # touched once, as the quantiser's reused buffers are after the first weight
    target = os.path.join(args.out_dir, "parts.bin")
    rows = []

    def copy():
        shutil.copyfile(args.model, target)
        os.unlink(target)

    copy_s = best(copy, args.repeats)
    for fmt in args.formats.split(","):
        plan = Quantizing(entries_of, fmt, sources=source_layouts(ckpt, entries_of))
        chosen = [n for n in plan.planned if n not in plan.sources]

        def read_all():
            for name in chosen:
                f, info = ckpt.entries[name]
                rows_, cols = info.shape
                w = buffer[:rows_ * cols].reshape(rows_, cols)
                step = max(1, READ_PIECE // max(1, 2 * cols))
                for r0 in range(0, rows_, step):
                    read_into(f.fileno(), w[r0:r0 + step], info.begin + 2 * r0 * cols, f.path)
                    qz.weight_maxima(w[r0:r0 + step], 1)

        weights = {}
        for name in chosen:
            f, info = ckpt.entries[name]
            weights[name] = f.read(name)
        codes = []

        def kernels():
            codes.clear()
            for name, w in weights.items():
                held = w.copy()
                q = qz.quantize_weight(fmt, held, threads=1,
                                       out=held.reshape(-1).view(np.uint8))
                codes.append(q.weight.reshape(-1).view(np.uint8))

        read_s = best(read_all, args.repeats)
        kernel_s = best(kernels, args.repeats)
        out_bytes = sum(c.nbytes for c in codes)

        def hash_all():
            for c in codes:
                blake3.blake3(memoryview(c)).digest()

        def write_all():
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for c in codes:
                    os.write(fd, memoryview(c))
            finally:
                os.close(fd)
                os.unlink(target)

        hash_s, write_s = best(hash_all, args.repeats), best(write_all, args.repeats)
        # the kernels' time above includes a copy of each weight (the quantiser's memory is its
        # read buffer): taken off, as timed alone
        copies_s = best(lambda: [w.copy() for w in weights.values()], args.repeats)
        kernel_s = max(0.0, kernel_s - copies_s)
        work = read_s + kernel_s + hash_s + write_s
        row = {"format": fmt, "weights": len(chosen), "bytes_in": size, "codes_bytes": out_bytes,
               "read_s": read_s, "kernels_s": kernel_s, "blake3_s": hash_s, "write_s": write_s,
               "work_s": work, "floor_2_cpus_s": work / 2, "copy_s": copy_s,
               "copy_over_floor_2_cpus": copy_s / (work / 2)}
        rows.append(row)
        print(f"{fmt}: read+maxima {read_s:.3f} s, kernels {kernel_s:.3f} s, BLAKE3 {hash_s:.3f} s, "
              f"write {write_s:.3f} s: work {work:.3f} s, floor on 2 CPUs {work / 2:.3f} s; the "
              f"copy {copy_s:.3f} s: at best {copy_s / (work / 2):.2f} of its rate on 2 CPUs",
              flush=True)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})


if __name__ == "__main__":
    main()
