"""Fusing adapter files into a checkpoint, end to end, in the same run as the sgemm rate.

A synthetic LTX-2-shaped checkpoint (``--blocks`` transformer blocks of the real Linear shapes,
28 per block, bf16) and a rank-384 adapter on every one of those Linears are written to
``--dir``; then ``ltx2blas.fuse_checkpoint`` runs on them (the files already in the page cache
after one warm-up run), and reports GFLOP/s as a fraction of the rate of a 2048^3 sgemm at the
same thread count, timed before each run (the fastest run against the fastest sgemm, as
harness.STAT; medians and the ratio against the best sgemm of the ceilings at the start of the
run recorded too), and the process's peak resident memory.  Every fused tensor of the output is
checked byte for byte against ``ltx2blas.fuse_loras`` on the same inputs, at sampled rows against
``ltx2blas.reference``.

    python bench/run.py --only checkpoint                     (the suite)
    python bench/bench_checkpoint.py [--blocks 2] [--threads N] [--dir DIR]
    python bench/bench_checkpoint.py --large-gb 14   # peak memory on a checkpoint > half of RAM
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

#: One LTX-2 transformer block's Linears (docs/arithmetic.md §5): module -> (out, in).
BLOCK = {
    **{f"attn1.{p}": (4096, 4096) for p in ("to_q", "to_k", "to_v", "to_out.0")},
    **{f"attn2.{p}": (4096, 4096) for p in ("to_q", "to_k", "to_v", "to_out.0")},
    "ff.net.0.proj": (16384, 4096), "ff.net.2": (4096, 16384),
    **{f"audio_attn1.{p}": (2048, 2048) for p in ("to_q", "to_k", "to_v", "to_out.0")},
    **{f"audio_attn2.{p}": (2048, 2048) for p in ("to_q", "to_k", "to_v", "to_out.0")},
    "audio_ff.net.0.proj": (8192, 2048), "audio_ff.net.2": (2048, 8192),
    "audio_to_video_attn.to_q": (2048, 2048), "audio_to_video_attn.to_k": (2048, 4096),
    "audio_to_video_attn.to_v": (2048, 4096), "audio_to_video_attn.to_out.0": (2048, 2048),
    "video_to_audio_attn.to_q": (2048, 4096), "video_to_audio_attn.to_k": (2048, 2048),
    "video_to_audio_attn.to_v": (2048, 2048), "video_to_audio_attn.to_out.0": (4096, 2048),
}
PREFIX = "model.diffusion_model.transformer_blocks."


def fill(rng, shape, lo=0x3800, hi=0x3C00):
    """Plausible bf16 bits (|x| in about 2^-15..2^-7, random signs), cheaply: a random block
    repeated, since the values only have to be finite and not subnormal for timing."""
    block = rng.integers(lo, hi, size=min(int(np.prod(shape)), 1 << 20), dtype=np.uint16)
    block |= rng.integers(0, 2, size=block.size, dtype=np.uint16) << 15
    return np.resize(block, shape)


def build(folder, blocks, rank, rng, log=print, block=None):
    """The checkpoint and adapter files: ``block`` (module -> (out, in)) per block, BLOCK's
    shapes by default."""
    block = block or BLOCK
    from ltx2blas.files.safetensors import SafetensorsWriter

    model = os.path.join(folder, "model.safetensors")
    lora = os.path.join(folder, "lora.safetensors")
    entries = []
    for b in range(blocks):
        for m, (o, i) in block.items():
            entries.append((f"{PREFIX}{b}.{m}.weight", "BF16", (o, i), 2 * o * i))
            entries.append((f"{PREFIX}{b}.{m}.bias", "BF16", (o,), 2 * o))
    t0 = time.perf_counter()
    with SafetensorsWriter(model, entries, {"source": "bench_checkpoint"}) as w:
        for name, _, shape, _ in entries:
            w.write(name, fill(rng, shape))
        w.commit()
    lentries = []
    for b in range(blocks):
        for m, (o, i) in block.items():
            base = f"diffusion_model.transformer_blocks.{b}.{m}"
            lentries.append((base + ".lora_A.weight", "BF16", (rank, i), 2 * rank * i))
            lentries.append((base + ".lora_B.weight", "BF16", (o, rank), 2 * o * rank))
    with SafetensorsWriter(lora, lentries) as w:
        for name, _, shape, _ in lentries:
            w.write(name, fill(rng, shape, 0x3400, 0x3800))
        w.commit()
    log(f"built {blocks} blocks: {os.path.getsize(model) / 2**30:.2f} GiB checkpoint, "
        f"{os.path.getsize(lora) / 2**30:.2f} GiB rank-{rank} adapter in "
        f"{time.perf_counter() - t0:.0f} s")
    return model, lora


def verify(model, lora, output, samples=2, rows=4):
    """Byte-compare every fused tensor with fuse_loras, and sampled rows with the reference."""
    import ltx2blas
    from ltx2blas import reference
    from ltx2blas.files.safetensors import SafetensorsFile

    rng = np.random.default_rng(5)
    with SafetensorsFile(model) as m, SafetensorsFile(lora) as a, SafetensorsFile(output) as o:
        names = [n for n in m.tensors if n.endswith(".weight")]
        for name in names:
            base = "diffusion_model." + name[len("model.diffusion_model."):-len(".weight")]
            w, la, lb = m.read(name), a.read(base + ".lora_A.weight"), a.read(base + ".lora_B.weight")
            got = o.read(name)
            if not np.array_equal(got, ltx2blas.fuse_loras(w, [(la, lb, 1.0)])):
                return False
        for name in rng.choice(names, size=min(samples, len(names)), replace=False):
            base = "diffusion_model." + name[len("model.diffusion_model."):-len(".weight")]
            w, la, lb = m.read(name), a.read(base + ".lora_A.weight"), a.read(base + ".lora_B.weight")
            pick = np.sort(rng.choice(w.shape[0], size=rows, replace=False))
            if not np.array_equal(o.read(name)[pick], reference.fuse_loras(w[pick], [(la, lb[pick], 1.0)])):
                return False
        for name in m.tensors:
            if not name.endswith(".weight") and not np.array_equal(o.read(name), m.read(name)):
                return False
    return True


def run(threads_list, blocks, rank, ceilings, repeats=3, folder=None, log=print):
    """End-to-end rows, one per thread count, on one generated checkpoint."""
    import ltx2blas

    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="ltx2blas-bench-")
    rows = []
    try:
        model, lora = build(folder, blocks, rank, np.random.default_rng(0), log=log)
        output = os.path.join(folder, "fused.safetensors")
        exact = None
        for threads in threads_list:
            ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], output, threads=threads)  # warm
            reports, squares = [], []
            square, square_flops = harness.square_sgemm(threads)
            square()  # warm
            for _ in range(repeats):
                os.unlink(output)  # timing the fuse, not the removal of the last run's output
                time.sleep(0.25)
                t0 = time.perf_counter()
                square()
                squares.append(time.perf_counter() - t0)
                time.sleep(0.25)
                harness.reset_peak_rss()
                reports.append(ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], output, threads=threads))
                reports[-1].peak_rss_mib = harness.peak_rss_mib()
            reports.sort(key=lambda r: r.seconds)
            best = reports[0]  # the fastest run (harness.STAT)
            median = reports[len(reports) // 2]
            if exact is None:
                exact = verify(model, lora, output)
            peak = square_flops / min(squares) / 1e9
            at_start = ceilings[threads]["sgemm_gflops"]
            row = {"workload": "checkpoint", "blocks": blocks, "rank": rank, "threads": threads,
                   "gflop": best.gflop, "seconds": best.seconds, "gflops": best.gflops,
                   "seconds_median": median.seconds,
                   "of_sgemm_median": median.gflops / (
                       square_flops / sorted(squares)[len(squares) // 2] / 1e9),
                   "sgemm_gflops": peak, "of_sgemm": best.gflops / peak,
                   "sgemm_gflops_at_start": at_start, "of_sgemm_at_start": best.gflops / at_start,
                   "spread": (reports[-1].seconds - reports[0].seconds) / best.seconds,
                   "peak_rss_mib": max(r.peak_rss_mib for r in reports),
                   "checkpoint_gib": os.path.getsize(model) / 2**30, "checked": exact}
            rows.append(row)
            log(f"checkpoint threads={threads} {blocks} blocks rank {rank}: {best.gflop:.0f} GFLOP "
                f"in {best.seconds:.2f} s = {best.gflops:.1f} GFLOP/s end to end, "
                f"{row['of_sgemm']:.2f} of sgemm ({peak:.0f}; {row['of_sgemm_at_start']:.2f} of {at_start:.0f} "
                f"at start); peak RSS {row['peak_rss_mib']:.0f} MiB;"
                f" checked={exact}")
        return rows
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)


LARGE_CHILD = r"""
import json, resource, sys, time
import ltx2blas
t0 = time.perf_counter()
r = ltx2blas.fuse_checkpoint(sys.argv[1], [(sys.argv[2], 1.0)], sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t0, "gflop": r.gflop, "modules": r.modules_fused,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def large(args):
    """Peak memory of a fuse on a checkpoint larger than half of this machine's memory, in a
    fresh process (so the figure is the fuse's own)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    per_block = sum(2 * o * i for o, i in BLOCK.values())
    blocks = max(1, int(np.ceil(args.large_gb * 2**30 / per_block)))
    folder = args.dir or tempfile.mkdtemp(prefix="ltx2blas-large-")
    try:
        need = 2.3 * blocks * per_block
        if shutil.disk_usage(folder).free < need:
            sys.exit(f"bench: {folder} has too little space for {need / 2**30:.0f} GiB")
        model, lora = build(folder, blocks, 32, np.random.default_rng(0))
        output = os.path.join(folder, "fused.safetensors")
        out = subprocess.run([sys.executable, "-c", LARGE_CHILD, model, lora, output],
                             capture_output=True, text=True, check=True, cwd="/")
        m = json.loads(out.stdout)
        largest = max(2 * o * i for o, i in BLOCK.values())
        row = {"workload": "checkpoint-large", "checkpoint_gib": os.path.getsize(model) / 2**30,
               "machine_gib": total / 2**30, "largest_tensor_mib": largest / 2**20,
               "bound_mib": (2 * largest + 512 * 2**20) / 2**20, **m}
        print(f"{row['checkpoint_gib']:.1f} GiB checkpoint ({row['machine_gib']:.0f} GiB machine): "
              f"peak RSS {m['peak_rss_mib']:.0f} MiB, bound 2 x {largest / 2**20:.0f} MiB + 512 MiB "
              f"= {row['bound_mib']:.0f} MiB; {m['modules']} modules in {m['seconds']:.0f} s", flush=True)
        return row
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--large-gb", type=float, default=None,
                        help="instead: peak memory on a checkpoint of this many GiB")
    parser.add_argument("--dir", default=None, help="where to build the files (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="with --large-gb: keep the files")
    parser.add_argument("--out", default=None, help="write the row as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    if args.large_gb:
        rows = [large(args)]
    else:
        from ltx2blas._threads import resolve_threads

        threads = [resolve_threads(args.threads)]
        rows = run(threads, args.blocks, 384, {t: harness.ceilings(t) for t in threads},
                   args.repeats, folder=args.dir)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r.get("checked", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
