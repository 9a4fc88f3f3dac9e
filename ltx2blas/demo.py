"""``ltx2blas demo``: fuse an LTX-2-shaped adapter in memory and report the speed as a fraction
of the sgemm rate measured in the same run (the best of several timings of each, taken in
turns, so that a busy host's moments weigh on both alike), checking that sampled rows come out
the same bytes when fused again on one thread with other tiles; then the same through files: a small
LTX-2-shaped checkpoint and adapter written to a temporary folder, fused by
``fuse_checkpoint``, checked against the in-memory fuse, and removed.  (Exactness against the
textbook loop is the test suite's to show, not the demo's.)"""
import os
import shutil
import tempfile
import time

import numpy as np

from ._threads import resolve_threads
from .fuse import fuse_lora


def random_bf16(rng, shape, scale):
    """Gaussian bf16 bits, rounded by the library's own rounding in place of a chain of numpy
    temporaries (the demo stays well under a gigabyte)."""
    from . import _quant

    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(scale)
    return _quant.round_bf16(x.reshape(-1)).reshape(shape)


#: How many times the fuse and the sgemm are each timed, in turns; the best of each is kept.
ROUNDS = 5


def sgemm_timer(threads, n=2048):
    """(a callable that times one square sgemm through scipy -- the BLAS ltx2blas calls -- at
    ``threads`` BLAS threads, in seconds; its GFLOP): the matrices are made and the BLAS
    thread pool warmed once, here."""
    from scipy.linalg.blas import sgemm
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(1)
    x = np.asfortranarray(rng.standard_normal((n, n), dtype=np.float32))
    y = np.asfortranarray(rng.standard_normal((n, n), dtype=np.float32))
    out = np.zeros((n, n), np.float32, order="F")

    def product():
        sgemm(1.0, x, y, beta=0.0, c=out, overwrite_c=True)

    def timed():
        with threadpool_limits(limits=threads, user_api="blas"):
            return _timed(product)[0]

    with threadpool_limits(limits=threads, user_api="blas"):
        product()  # warm up the BLAS thread pool
    return timed, 2.0 * n**3 / 1e9


def _timed(fn):
    """(seconds, what ``fn()`` returned)."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def run_demo(threads=None, rank=384, shape=(4096, 4096), strength=0.8, seed=0, echo=print,
             checkpoint=True):
    threads = resolve_threads(threads)
    rows, cols = shape
    rng = np.random.default_rng(seed)
    echo(f"building an LTX-2-shaped weight [{rows} x {cols}] bf16 and a rank-{rank} adapter ...")
    weight = random_bf16(rng, (rows, cols), 0.02)
    lora_a = random_bf16(rng, (rank, cols), 0.01)
    lora_b = random_bf16(rng, (rows, rank), 0.01)

    def fuse():
        return fuse_lora(weight, lora_a, lora_b, strength, threads=threads)

    fused = fuse()  # the first call probes
    sgemm, sgemm_gflop = sgemm_timer(threads)
    # one timing of either is at the mercy of whatever else the host runs then: the best of
    # several of each, taken in turns, so that a busy moment slows both alike
    fuse_times, sgemm_times = [], []
    for _ in range(ROUNDS):
        seconds, fused = _timed(fuse)
        fuse_times.append(seconds)
        sgemm_times.append(sgemm())
    seconds = min(fuse_times)
    gflops = 2.0 * rows * cols * rank / seconds / 1e9
    peak = sgemm_gflop / min(sgemm_times)

    sample = np.sort(rng.choice(rows, size=min(rows, 32), replace=False))
    again = fuse_lora(weight[sample], lora_a, lora_b[sample], strength, threads=1, tile=(1, 64))
    same = np.array_equal(fused[sample], again)

    echo(f"fused in {seconds * 1e3:.1f} ms on {threads} thread(s): {gflops:.1f} GFLOP/s "
         f"(the best of {ROUNDS})")
    echo(f"sgemm in this run: {peak:.1f} GFLOP/s (the best of {ROUNDS}, timed in turns with the "
         f"fuse) -> fuse at {gflops / peak:.2f} of the sgemm rate, a ratio measured in this run "
         "on this machine: a busy host moves it")
    echo(f"{len(sample)} sampled rows fused again alone, on one thread in 1 x 64 tiles: "
         f"{'byte-identical' if same else 'MISMATCH'}")
    files_same = run_checkpoint_demo(threads, rank, rng, echo) if checkpoint else True
    return 0 if (same and files_same) else 1


#: The small default checkpoint: a few Linears of one LTX-2 block, with their biases.
DEMO_MODULES = {"attn1.to_q": (4096, 4096), "attn1.to_k": (4096, 4096),
                "attn1.to_v": (4096, 4096), "ff.net.0.proj": (16384, 4096)}


def run_checkpoint_demo(threads, rank, rng, echo=print):
    from .files.checkpoint import fuse_checkpoint
    from .files.safetensors import SafetensorsFile, SafetensorsWriter
    from .fuse import fuse_loras

    folder = tempfile.mkdtemp(prefix="ltx2blas-demo-")
    try:
        prefix = "model.diffusion_model.transformer_blocks.0."
        model = os.path.join(folder, "model.safetensors")
        lora = os.path.join(folder, "lora.safetensors")
        tensors = {}
        for m, (o, i) in DEMO_MODULES.items():
            tensors[prefix + m + ".weight"] = random_bf16(rng, (o, i), 0.02)
            tensors[prefix + m + ".bias"] = random_bf16(rng, (o,), 0.02)
        factors = {}
        for m, (o, i) in DEMO_MODULES.items():
            base = "diffusion_model.transformer_blocks.0." + m
            factors[base + ".lora_A.weight"] = random_bf16(rng, (rank, i), 0.01)
            factors[base + ".lora_B.weight"] = random_bf16(rng, (o, rank), 0.01)
        for path, content in ((model, tensors), (lora, factors)):
            with SafetensorsWriter(path, [(n, "BF16", a.shape, a.nbytes) for n, a in content.items()]) as w:
                for n, a in content.items():
                    w.write(n, a)
                w.commit()
        echo(f"wrote an LTX-2-shaped checkpoint ({os.path.getsize(model) / 2**20:.0f} MiB) and a "
             f"rank-{rank} adapter to {folder}")
        output = os.path.join(folder, "fused.safetensors")
        report = fuse_checkpoint(model, [(lora, 0.8)], output, threads=threads)
        echo(report.summary())
        echo("(peak memory above is this whole process's, which built the checkpoint's tensors in "
             "memory first; ltx2blas fuse reports its own)")
        name = prefix + "attn1.to_q.weight"
        base = "diffusion_model.transformer_blocks.0.attn1.to_q"
        with SafetensorsFile(output) as f:
            got = f.read(name)
        expected = fuse_loras(tensors[name], [(factors[base + ".lora_A.weight"],
                                               factors[base + ".lora_B.weight"], 0.8)], threads=threads)
        same = np.array_equal(got, expected)
        echo(f"{name} in the written file against the tensor-level fuse: "
             f"{'byte-identical' if same else 'MISMATCH'}")
        return same
    finally:
        shutil.rmtree(folder, ignore_errors=True)
