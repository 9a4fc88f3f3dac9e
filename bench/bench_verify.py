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

    python bench/bench_verify.py [--blocks 2] [--ranks 32,384] [--threads 1,2] [--repeats 3]
"""
import argparse
import os
import shutil
import sys
import tempfile

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


def run(blocks, ranks, threads_list, repeats=3, folder=None, log=print, scale=1):
    """Rows per rank and thread count; ``scale`` divides every shape (a quick check)."""
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

                t = harness.interleaved(
                    {"fuse": fuse(True, fused), "fuse_plain": fuse(False, plain),
                     "verify_file": verify(), "verify_rebuild": verify(model, [lora])},
                    repeats=repeats, settle=0.25)
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
                       "checked": same_tensors(fused, plain) and all(
                           r.status == "verified" for r in results.values())}
                rows.append(row)
                log(f"rank {rank}, {threads} thread(s), {row['checkpoint_gib']:.2f} GiB: fuse "
                    f"{best['fuse']:.2f} s with digests, {best['fuse_plain']:.2f} s without "
                    f"(x {row['digests_cost']:.3f}); verify alone {best['verify_file']:.2f} s "
                    f"({row['verify_file_of_fuse']:.2f} of the fuse), with a rebuild "
                    f"{best['verify_rebuild']:.2f} s ({row['verify_rebuild_of_fuse']:.2f}), peak "
                    f"{peak:.0f} MiB; checked={row['checked']}")
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
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    rows = run(args.blocks, [int(r) for r in args.ranks.split(",")],
               harness.thread_counts(args.threads), args.repeats, folder=args.dir,
               scale=args.scale)
    if args.out:
        harness.write_json(args.out, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
