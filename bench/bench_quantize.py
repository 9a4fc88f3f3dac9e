"""ltx2blas quantize against copying the same file, and against comfy-kitchen's and torch's quantisers.

On the synthetic LTX-2-shaped checkpoint of bench_checkpoint.py (``--blocks`` blocks of the
real Linear shapes, bf16; 0.72 GiB a block), for each format and thread count:

* ``copy``: the checkpoint copied with ``shutil.copyfile`` into ``--out-dir`` (the same bytes
  read and written), then the copy fsynced (``copy_fsync``, the copy with its fsync: the
  quantiser fsyncs its output before renaming it into place); and once per row, for
  reference, one pass reading the file (``read``);
* ``quantize``: ``ltx2blas.quantize_checkpoint(model, out, fmt, threads=t)``, whole.

They are timed in turns (copy, quantize, copy, quantize, ...) after one untimed round, each
call in a fresh process (timed inside it, after its imports) so that its peak resident memory
(``getrusage``) is its own; the outputs are removed after each call.  Rates are input bytes /
seconds; the row's ratio is quantize's rate / copy's, by the fastest of ``--repeats`` (medians
recorded too).  The warm-up's output is checked: every quantised weight byte for byte against
``quantize_weight`` on the input, every other tensor against the input's.  Memory: the peak
beyond the process's resident size after its imports, beside the fuse's bound (twice the
largest weight, plus 64 MiB; docs/files.md).

``--peers`` (needs torch and comfy-kitchen) times, on two of the checkpoint's weights
(``attn1.to_q``, 4096 x 4096, and ``ff.net.2``, 4096 x 16384), with ``torch.set_num_threads(t)``
and ``threads=t``, interleaved with ``ltx2blas.quantize_weight`` of the same format:

* comfy-kitchen 0.2.40's layouts' ``quantize`` on the CPU (the backend it picks there, eager):
  ``TensorCoreFP8Layout`` (comfy_fp8), ``TensorCoreNVFP4Layout`` (comfy_nvfp4),
  ``TensorCoreMXFP8Layout`` (comfy_mxfp8), ``TensorWiseINT8Layout`` (comfy_int8), then their
  ``state_dict_tensors``, as ComfyUI stores them;
* upstream LTX-2's torch quantisers (fp8_scaled, fp8_block), as in tests/test_quantize_owners.py;
* a typical torch script, per-tensor fp8 (``amax = w.abs().max(); scale = amax / 448;
  q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)``), against comfy_fp8 (the
  same rule with the scale rounded to bf16; its codes are counted, not required, equal).

Each peer's bytes are checked equal to ltx2blas's; the ratio is the peer's time / ltx2blas's.

    python bench/bench_quantize.py [--blocks 1] [--formats all] [--threads 1,2] [--repeats 5]
                                   [--dir DIR] [--out-dir DIR] [--peers] [--no-checkpoint]
                                   [--no-digests] [--out FILE.json]

``--no-digests`` quantises without the provenance record's digests (the BLAKE3 pass over the
output), to show what that pass costs.
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

FORMATS = ("fp8_scaled", "comfy_fp8", "fp8_block", "nvfp4", "comfy_nvfp4", "comfy_mxfp8",
           "comfy_int8")
#: Every Linear of a block is 4096 x 16384 or smaller; the staging of the fuse's bound.
STAGING = 64 << 20
PEER_WEIGHTS = ("attn1.to_q", "ff.net.2")


# ------------------------------------------------------------------ the timed processes

def _status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return 0.0


def _rss_mib():
    return _status_mib("VmRSS:")


def worker(request):
    """One timed call in this process: {"copy": src, "out": dst} or {"quantize": model,
    "out": out, "format": f, "threads": t}; prints the times and the peak memory as JSON."""
    if "quantize" in request:
        import ltx2blas  # noqa: F401 -- imported before the clock and the baseline RSS
        from ltx2blas.files.quantize import quantize_checkpoint
    before = _rss_mib()
    answer = {"rss_before_mib": before}
    t0 = time.perf_counter()
    if "copy" in request:
        shutil.copyfile(request["copy"], request["out"])
        answer["seconds"] = time.perf_counter() - t0
        fd = os.open(request["out"], os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        answer["seconds_fsync"] = time.perf_counter() - t0
    elif "read" in request:
        with open(request["read"], "rb", buffering=0) as f:
            buf = bytearray(16 << 20)
            while f.readinto(buf):
                pass
        answer["seconds"] = time.perf_counter() - t0
    else:
        report = quantize_checkpoint(request["quantize"], request["out"], request["format"],
                                     threads=request["threads"],
                                     digests=request.get("digests", True))
        answer["seconds"] = time.perf_counter() - t0
        answer["bytes_out"] = report.bytes_out
        answer["weights"] = len(report.quantized)
    # the process's own high-water mark (VmHWM): getrusage's ru_maxrss keeps, across the exec,
    # the larger resident size of the parent this process was forked from
    answer["peak_rss_mib"] = _status_mib("VmHWM:")
    sys.stdout.write(json.dumps(answer) + "\n")
    return 0


def call(request):
    """Run one timed call in a fresh process of this Python; its answer.  The process has the
    OpenMP wait policy the ``ltx2blas`` command sets (idle threads sleep), unless the
    environment sets one."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker",
                           json.dumps(request)], stdout=subprocess.PIPE, check=True, text=True,
                          env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the checkpoint

def check_output(model, output, fmt, threads):
    """Every quantised weight of ``output`` byte for byte against quantize_weight on the
    input; every other tensor of the input copied unchanged."""
    import ltx2blas
    from ltx2blas.files.safetensors import SafetensorsFile

    with SafetensorsFile(model) as m, SafetensorsFile(output) as o:
        for name in m.tensors:
            got = o.read(name)
            if name + "_scale" in o.tensors:
                q = ltx2blas.quantize_weight(fmt, m.read(name), threads=threads)
                pairs = [(got, q.weight), (o.read(name + "_scale"), q.scale)]
                if q.scale_2 is not None:
                    pairs.append((o.read(name + "_scale_2"), q.scale_2))
            else:
                pairs = [(got, m.read(name))]
            for a, b in pairs:
                a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
                if a.nbytes != b.nbytes or not np.array_equal(a.reshape(-1).view(np.uint8),
                                                              b.reshape(-1).view(np.uint8)):
                    return False
    return True


def largest_weight_bytes(model):
    from ltx2blas.files.safetensors import SafetensorsFile

    with SafetensorsFile(model) as m:
        return max(int(np.prod(m.read(n).shape)) * 2 for n in m.tensors if n.endswith(".weight"))


def run_checkpoint(model, out_dir, formats, threads_list, repeats, settle=0.25, log=print,
                   digests=True):
    size = os.path.getsize(model)
    largest = largest_weight_bytes(model)
    fuse_bound = (2 * largest + STAGING) / 2**20
    copy_path = os.path.join(out_dir, "copy.safetensors")
    out_path = os.path.join(out_dir, "quantized.safetensors")
    rows = []

    def timed(request, path):
        time.sleep(settle)
        try:
            return call(request)
        finally:
            if os.path.exists(path):
                os.unlink(path)

    for fmt in formats:
        for n, threads in enumerate(threads_list):
            qreq = {"quantize": model, "out": out_path, "format": fmt, "threads": threads,
                    "digests": digests}
            creq = {"copy": model, "out": copy_path}
            # the untimed round; the first thread count's output is checked
            timed(creq, copy_path)
            time.sleep(settle)
            first = call(qreq)
            checked = check_output(model, out_path, fmt, threads) if n == 0 else None
            os.unlink(out_path)
            copies, quants = [], []
            for _ in range(repeats):
                copies.append(timed(creq, copy_path))
                quants.append(timed(qreq, out_path))
            read = timed({"read": model}, model + ".none")
            best = {
                "copy": min(c["seconds"] for c in copies),
                "copy_fsync": min(c["seconds_fsync"] for c in copies),
                "quantize": min(q["seconds"] for q in quants),
                "read": read["seconds"],
            }
            median = {
                "copy": float(np.median([c["seconds"] for c in copies])),
                "copy_fsync": float(np.median([c["seconds_fsync"] for c in copies])),
                "quantize": float(np.median([q["seconds"] for q in quants])),
            }
            peak = max(q["peak_rss_mib"] for q in quants)
            beyond = max(q["peak_rss_mib"] - q["rss_before_mib"] for q in quants)
            row = {
                "format": fmt, "threads": threads, "out_dir": out_dir, "digests": digests,
                "checkpoint_bytes": size, "bytes_out": first["bytes_out"],
                "weights": first["weights"],
                "seconds": best, "median_seconds": median,
                "all_seconds": {"copy": [c["seconds"] for c in copies],
                                "copy_fsync": [c["seconds_fsync"] for c in copies],
                                "quantize": [q["seconds"] for q in quants]},
                "gb_s": {k: size / v / 1e9 for k, v in best.items()},
                "of_copy": best["copy"] / best["quantize"],
                "of_copy_fsync": best["copy_fsync"] / best["quantize"],
                "of_copy_median": median["copy"] / median["quantize"],
                "peak_rss_mib": peak, "peak_beyond_imports_mib": beyond,
                "largest_weight_mib": largest / 2**20,
                "fuse_bound_mib": fuse_bound,
                "copy_peak_rss_mib": max(c["peak_rss_mib"] for c in copies),
                "checked": checked,
            }
            rows.append(row)
            log(f"{fmt:12s} {threads} thread(s): quantize {best['quantize']:.2f} s "
                f"({row['gb_s']['quantize']:.2f} GB/s), copy {best['copy']:.2f} s "
                f"({row['gb_s']['copy']:.2f} GB/s; with fsync {best['copy_fsync']:.2f} s), read "
                f"{best['read']:.2f} s ({row['gb_s']['read']:.2f} GB/s); ratio {row['of_copy']:.2f} "
                f"of copy ({row['of_copy_fsync']:.2f} of copy+fsync, medians "
                f"{row['of_copy_median']:.2f}); peak {peak:.0f} MiB, {beyond:.0f} MiB beyond the "
                f"imports (fuse's bound {fuse_bound:.0f} MiB); checked={checked}")
    return rows


# ------------------------------------------------------------------ the peers

def upstream_fp8_per_tensor(weight):
    """upstream LTX-2's quantize_weight_to_fp8_per_tensor (ltx-core, fp8_scaled_mm.py, at
    400fd310), as in tests/test_quantize_owners.py."""
    import torch

    weight_fp32 = weight.to(torch.float32)
    fp8_min = torch.finfo(torch.float8_e4m3fn).min
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    max_abs = torch.amax(torch.abs(weight_fp32))
    scale = fp8_max / max_abs
    quantized_weight = torch.clamp(weight_fp32 * scale, min=fp8_min, max=fp8_max).to(torch.float8_e4m3fn)
    weight_scale = scale.reciprocal()
    return quantized_weight, weight_scale


def upstream_blockwise(w, block_size=128, scale_max=448.0):
    """upstream LTX-2's blockwise_quantize_weights (ltx-kernels, blockwise/functional.py, at
    400fd310), as in tests/test_quantize_owners.py."""
    import torch

    w = w.view(w.shape[0]//block_size, block_size, w.shape[1]//block_size, block_size).transpose(1, 2).contiguous()  # noqa: E501
    w_absmax = w.float().abs().view(w.shape[0], w.shape[1], block_size*block_size).max(dim=-1, keepdim=False).values  # noqa: E501
    w_scales = scale_max/w_absmax
    w_quant = (w.float()*w_scales[:, :, None, None].float()).to(torch.float8_e4m3fn)  # noqa: E501
    w_quant = w_quant.transpose(1, 2).contiguous()
    w_quant = w_quant.view(w.shape[0]*block_size, -1)
    return w_quant, (1/w_scales).contiguous()


def typical_fp8(w):
    """The per-tensor fp8 quantisation people write."""
    import torch

    amax = w.abs().max()
    scale = amax / 448
    q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def _bytes(t):
    import torch

    t = t.detach().contiguous()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.uint8,
                   torch.int8):
        return t.view(torch.uint8).numpy().reshape(-1)
    return t.numpy().reshape(-1).view(np.uint8)


def _np_bytes(a):
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def peer_candidates(w_bits):
    """name -> (our format, the peer's call, compare(peer result, ours) -> bool or a count)."""
    import torch
    from comfy_kitchen.tensor import (TensorCoreFP8Layout, TensorCoreMXFP8Layout,
                                      TensorCoreNVFP4Layout, TensorWiseINT8Layout)

    w = torch.from_numpy(w_bits.view(np.int16)).view(torch.bfloat16)

    def layout(cls, **kw):
        def fn():
            qdata, params = cls.quantize(w, **kw)
            return cls.state_dict_tensors(qdata, params)
        return fn

    def same_layout(theirs, q):
        ours = [q.weight, q.scale] + ([q.scale_2] if q.scale_2 is not None else [])
        keys = ["", "_scale"] + (["_scale_2"] if q.scale_2 is not None else [])
        return all(np.array_equal(_bytes(theirs[k]), _np_bytes(o)) for k, o in zip(keys, ours))

    def same_pair(theirs, q):
        return (np.array_equal(_bytes(theirs[0]), _np_bytes(q.weight))
                and np.array_equal(_bytes(theirs[1].float()), _np_bytes(q.scale)))

    def codes_differing(theirs, q):
        return int(np.count_nonzero(_bytes(theirs[0]) != _np_bytes(q.weight)))

    return {
        "comfy_kitchen TensorCoreFP8Layout": ("comfy_fp8", layout(TensorCoreFP8Layout,
                                                                  dtype=torch.float8_e4m3fn),
                                              same_layout),
        "comfy_kitchen TensorCoreNVFP4Layout": ("comfy_nvfp4", layout(TensorCoreNVFP4Layout),
                                                same_layout),
        "comfy_kitchen TensorCoreMXFP8Layout": ("comfy_mxfp8", layout(TensorCoreMXFP8Layout),
                                                same_layout),
        "comfy_kitchen TensorWiseINT8Layout": ("comfy_int8", layout(TensorWiseINT8Layout),
                                               same_layout),
        "upstream fp8 per tensor": ("fp8_scaled", lambda: upstream_fp8_per_tensor(w), same_pair),
        "upstream blockwise fp8": ("fp8_block", lambda: upstream_blockwise(w), same_pair),
        "typical torch fp8 script": ("comfy_fp8", lambda: typical_fp8(w), codes_differing),
    }


def run_peers(model, threads_list, repeats, log=print):
    try:
        import comfy_kitchen  # noqa: F401
        import torch
    except ImportError as exc:
        log(f"peers skipped: {exc} (they need torch and comfy-kitchen 0.2.40)")
        return []
    import ltx2blas
    import bench_checkpoint
    from ltx2blas.files.safetensors import SafetensorsFile

    with SafetensorsFile(model) as m:
        weights = {mod: np.array(m.read(f"{bench_checkpoint.PREFIX}0.{mod}.weight"))
                   for mod in PEER_WEIGHTS}
    rows = []
    for mod, w_bits in weights.items():
        candidates = peer_candidates(w_bits)
        for threads in threads_list:
            torch.set_num_threads(threads)
            for peer, (fmt, fn, compare) in candidates.items():
                result = {}

                def ours():
                    result["ours"] = ltx2blas.quantize_weight(fmt, w_bits, threads=threads)

                def theirs():
                    result["theirs"] = fn()

                t = harness.interleaved({"ltx2blas": ours, "peer": theirs}, repeats=repeats)
                verdict = compare(result["theirs"], result["ours"])
                best = {k: t[k][harness.STAT] for k in t}
                row = {"weight": mod, "shape": list(w_bits.shape), "threads": threads,
                       "peer": peer, "format": fmt, "seconds": best,
                       "median_seconds": {k: t[k]["median"] for k in t},
                       "samples": {k: t[k]["n"] for k in t},
                       "peer_of_ours": best["peer"] / best["ltx2blas"],
                       "peer_of_ours_median": t["peer"]["median"] / t["ltx2blas"]["median"]}
                if isinstance(verdict, bool):
                    row["checked"] = verdict
                else:
                    row["checked"] = True
                    row["codes_differing"] = verdict
                rows.append(row)
                log(f"{mod} {w_bits.shape[0]}x{w_bits.shape[1]}, {threads} thread(s), {fmt:11s}: "
                    f"ltx2blas {best['ltx2blas'] * 1e3:.1f} ms, {peer} {best['peer'] * 1e3:.1f} ms "
                    f"(x {row['peer_of_ours']:.1f}); "
                    + (f"same bytes={verdict}" if isinstance(verdict, bool)
                       else f"{verdict} of {w_bits.size} codes differ from comfy_fp8's"))
    torch.set_num_threads(os.cpu_count())
    return rows


# ------------------------------------------------------------------ main

def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--formats", default="all", help="comma list (default: all seven)")
    parser.add_argument("--threads", default="1,2", help="comma list (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None,
                        help="where the checkpoint is built, or reused if there (default: a "
                             "temp dir, removed)")
    parser.add_argument("--out-dir", default=None,
                        help="where copies and outputs are written (default: the model's "
                             "folder; /dev/shm for a run bound by the CPU)")
    parser.add_argument("--peers", action="store_true",
                        help="time comfy-kitchen's and torch's quantisers too")
    parser.add_argument("--no-checkpoint", action="store_true",
                        help="skip the checkpoint rows (with --peers: the peers alone)")
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    parser.add_argument("--no-digests", action="store_true",
                        help="quantize without the provenance record's digests (digests=False)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    harness.check_installed_not_checkout()
    import bench_checkpoint

    formats = FORMATS if args.formats == "all" else tuple(args.formats.split(","))
    threads_list = harness.thread_counts(args.threads)
    own = args.dir is None
    folder = args.dir or tempfile.mkdtemp(prefix="ltx2blas-bench-")
    try:
        os.makedirs(folder, exist_ok=True)
        model = os.path.join(folder, "model.safetensors")
        if not os.path.exists(model):
            model, lora = bench_checkpoint.build(folder, args.blocks, 1,
                                                 np.random.default_rng(0))
            os.unlink(lora)
        else:
            print(f"reusing {model} ({os.path.getsize(model) / 2**30:.2f} GiB)")
        out_dir = args.out_dir or folder
        rows, peers = [], []
        with open("/proc/loadavg") as f:
            load = f.read().split()[:3]
        print(f"load average {' '.join(load)}")
        if not args.no_checkpoint:
            rows = run_checkpoint(model, out_dir, formats, threads_list, args.repeats,
                                  digests=not args.no_digests)
        if args.peers:
            peers = run_peers(model, threads_list, args.repeats)
        if args.out:
            machine = harness.machine()
            machine["cpu_model"] = cpu_model()
            harness.write_json(args.out, {"machine": machine, "load_average": load,
                                          "argv": sys.argv[1:], "rows": rows, "peers": peers,
                                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY",
                                                                            "passive")})
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(r["checked"] is not False for r in rows + peers) else 1


if __name__ == "__main__":
    sys.exit(main())
