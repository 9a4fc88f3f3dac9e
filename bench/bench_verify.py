"""The provenance digests' cost to a checkpoint fuse, and ltx2blas verify's time against the fuse's.

On the synthetic LTX-2-shaped checkpoint of bench_checkpoint.py (``--blocks`` blocks of the
real Linear shapes, bf16, an adapter on every Linear), four calls are timed, interleaved
(A B C D A B C D ...), the files in the page cache after a warm-up run:

* ``fuse``: ``fuse_checkpoint`` as it runs by default, the digests recorded;
* ``fuse_plain``: the same with ``digests=False``;
* ``verify_file``: ``verify_checkpoint`` on the fused file alone (its tensors against the record);
* ``verify_rebuild``: ``verify_checkpoint`` with the base and the adapter (inputs against the
  record, every fused tensor rebuilt and compared).

Each row gives the fastest of the repeats of each, and the ratios fuse / fuse_plain (the
digests' cost) and verify / fuse; with the peak memory of the rebuild.  Both fused files are
checked to hold the same tensors, and the verifications to pass.

``--before DIR`` times, interleaved with the four, ``fuse`` and ``fuse_plain`` of another
ltx2blas (``before_fuse``, ``before_plain``): DIR holds its package folder ``ltx2blas``
(e.g. an older commit's Python files beside this build's compiled modules), imported by a
worker process that each timed call asks for one fuse, so that before and after are measured
in one run, on one machine's load.  ``--hash-rates`` also measures SHA-256's and BLAKE3's
hash rates on this CPU, 1 and 2 threads.

    python bench/bench_verify.py [--blocks 2] [--ranks 32,384] [--threads 1,2] [--repeats 3]
                                 [--before DIR] [--hash-rates]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_checkpoint  # noqa: E402
import harness  # noqa: E402


def same_tensors(a, b):
    """Whether two safetensors files hold the same tensors, byte for byte (their metadata
    differs: one has the record)."""
    from ltx2blas.files.safetensors import SafetensorsFile

    with SafetensorsFile(a) as fa, SafetensorsFile(b) as fb:
        if list(fa.tensors) != list(fb.tensors):
            return False
        return all(np.array_equal(fa.read(n).view(np.uint8), fb.read(n).view(np.uint8))
                   for n in fa.tensors)


def hash_rates(size=256 << 20, repeats=5):
    """GB/s of SHA-256 (hashlib) and BLAKE3 (the blake3 package) over ``size`` bytes a stream:
    one stream on one thread, two streams on two threads (the rate of both), and BLAKE3 with
    max_threads=2 on one stream; the fastest of ``repeats``."""
    import blake3

    buffers = [np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)
               for i in range(2)]

    def rate(fn, streams):
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            threads = [threading.Thread(target=fn, args=(buffers[i],)) for i in range(streams)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            best = min(best, time.perf_counter() - t)
        return streams * size / best / 1e9

    out = {}
    for name, fn in (("sha256", lambda b: hashlib.sha256(b).digest()),
                     ("blake3", lambda b: blake3.blake3(b).digest())):
        out[name + "_1_thread"] = rate(fn, 1)
        out[name + "_2_threads"] = rate(fn, 2)
    out["blake3_max_threads_2_one_stream"] = rate(
        lambda b: blake3.blake3(b, max_threads=2).digest(), 1)
    return out


class Before:
    """A worker process importing the ltx2blas of ``folder``; call(...) runs one fuse there."""

    def __init__(self, folder):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(folder))
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=os.path.abspath(folder), text=True)
        self.where = self.ask({"where": True})

    def ask(self, request):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        if "error" in answer:
            raise RuntimeError(answer["error"])
        return answer["ok"]

    def fuse(self, model, lora, out, threads, digests):
        return lambda: self.ask({"model": model, "lora": lora, "out": out, "threads": threads,
                                 "digests": digests})

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def worker():
    # an editable install's import hook would find this checkout's package first: set aside,
    # so that the folder's package (on PYTHONPATH) is the one imported
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "MesonpyMetaFinder"]
    import ltx2blas

    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request.get("where"):
                answer = {"ok": os.path.dirname(ltx2blas.__file__)}
            else:
                ltx2blas.fuse_checkpoint(request["model"], [(request["lora"], 1.0)],
                                         request["out"], threads=request["threads"],
                                         digests=request["digests"])
                answer = {"ok": True}
        except Exception as exc:  # told to the parent
            answer = {"error": repr(exc)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


def run(blocks, ranks, threads_list, repeats=3, folder=None, log=print, scale=1, before=None):
    """Rows per rank and thread count; ``scale`` divides every shape (a quick check);
    ``before``: a Before, whose fuses are timed too."""
    import ltx2blas

    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="ltx2blas-bench-")
    rows = []
    try:
        for rank in ranks:
            block = {m: (o // scale, i // scale) for m, (o, i) in bench_checkpoint.BLOCK.items()}
            model, lora = bench_checkpoint.build(folder, blocks, rank, np.random.default_rng(0),
                                                 log=log, block=block)
            fused = os.path.join(folder, "fused.safetensors")
            plain = os.path.join(folder, "plain.safetensors")
            for threads in threads_list:
                results = {}

                def fuse(digests, out):
                    return lambda: ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], out,
                                                            threads=threads, digests=digests)

                def verify(*inputs):
                    def call():
                        results[len(inputs)] = ltx2blas.verify_checkpoint(
                            fused, *inputs, threads=threads)
                    return call

                calls = {"fuse": fuse(True, fused), "fuse_plain": fuse(False, plain),
                         "verify_file": verify(), "verify_rebuild": verify(model, [lora])}
                if before is not None:
                    old = os.path.join(folder, "before.safetensors")
                    calls["before_fuse"] = before.fuse(model, lora, old, threads, True)
                    calls["before_plain"] = before.fuse(model, lora, old, threads, False)
                t = harness.interleaved(calls, repeats=repeats, settle=0.25)
                harness.reset_peak_rss()
                verify(model, [lora])()
                peak = harness.peak_rss_mib()
                best = {name: t[name][harness.STAT] for name in t}
                row = {"blocks": blocks, "rank": rank, "threads": threads, "scale": scale,
                       "checkpoint_gib": os.path.getsize(model) / 2**30,
                       "adapter_gib": os.path.getsize(lora) / 2**30,
                       "seconds": best, "spread": {name: t[name]["spread"] for name in t},
                       "digests_cost": best["fuse"] / best["fuse_plain"],
                       "verify_file_of_fuse": best["verify_file"] / best["fuse"],
                       "verify_rebuild_of_fuse": best["verify_rebuild"] / best["fuse"],
                       "verify_rebuild_peak_rss_mib": peak,
                       "before_digests_cost": (best["before_fuse"] / best["before_plain"]
                                               if before is not None else None),
                       "checked": same_tensors(fused, plain) and all(
                           r.status == "verified" for r in results.values())}
                rows.append(row)
                log(f"rank {rank}, {threads} thread(s), {row['checkpoint_gib']:.2f} GiB: fuse "
                    f"{best['fuse']:.2f} s with digests, {best['fuse_plain']:.2f} s without "
                    f"(x {row['digests_cost']:.3f}); verify alone {best['verify_file']:.2f} s "
                    f"({row['verify_file_of_fuse']:.2f} of the fuse), with a rebuild "
                    f"{best['verify_rebuild']:.2f} s ({row['verify_rebuild_of_fuse']:.2f}), peak "
                    f"{peak:.0f} MiB; checked={row['checked']}" + (
                        f"; before: {best['before_fuse']:.2f} s with digests, "
                        f"{best['before_plain']:.2f} s without (x {row['before_digests_cost']:.3f})"
                        if before is not None else ""))
        return rows
    finally:
        if own:
            shutil.rmtree(folder, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--ranks", default="32,384", help="comma list (default %(default)s)")
    parser.add_argument("--threads", default=None, help="comma list, default 1..all CPUs")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scale", type=int, default=1,
                        help="divide every shape by this (a quick check; default 1, LTX-2's)")
    parser.add_argument("--dir", default=None, help="where to build the files (default: a temp dir)")
    parser.add_argument("--out", default=None, help="write the rows and the machine as JSON")
    parser.add_argument("--before", default=None,
                        help="a folder holding another ltx2blas package, timed beside this one")
    parser.add_argument("--hash-rates", action="store_true",
                        help="measure SHA-256's and BLAKE3's hash rates too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker()
    harness.check_installed_not_checkout()
    rates = None
    if args.hash_rates:
        rates = hash_rates()
        print("hash rates, GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in rates.items()))
    before = Before(args.before) if args.before else None
    if before is not None:
        print(f"before: the ltx2blas of {before.where}")
    try:
        rows = run(args.blocks, [int(r) for r in args.ranks.split(",")],
                   harness.thread_counts(args.threads), args.repeats, folder=args.dir,
                   scale=args.scale, before=before)
    finally:
        if before is not None:
            before.close()
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows,
                                      "hash_rates_gb_s": rates,
                                      "before": before.where if before else None})
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
