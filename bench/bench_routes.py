"""The fuse's two exact routes above SEQUENTIAL_DEPTH, against each other and the sgemm rate,
in the same run.

  * ``one_pass``: the sequential kernel takes every term, rounds and adds in registers -- the
    route wherever sgemm's verified depth covers less than _probe.BLAS_MIN_SHARE of the rank;
  * ``sgemm_first``: sgemm for its verified depth, however short, then the sequential kernel
    continuing each element's sum over the stored f32 tile, then the rounding pass (the route
    with BLAS_MIN_SHARE = 0).

Both are interleaved with a square 2048^3 sgemm at the same thread count
(harness.square_sgemm); each result is checked equal byte for byte to the other. Reported per
row: the sgemm depth probed for the tile, each route's rate as a fraction of the sgemm rate
(fastest samples), and one_pass's speed over sgemm_first.

    python bench/bench_routes.py [--threads 1,2] [--ranks 384,450] [--shapes 2048x2048] [--out FILE.json]
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = [(2048, 2048), (4096, 4096)]
RANKS = [384, 450]


def run(threads_list, shapes, ranks, repeats=5, log=print):
    import ltx2blas
    from ltx2blas import _probe
    from ltx2blas._threads import blas_single_threaded
    from ltx2blas.fuse import default_tile

    rng = np.random.default_rng(0)
    share = _probe.BLAS_MIN_SHARE
    rows_out = []
    for shape in shapes:
        weight = harness.random_bf16(rng, shape, 0.02)
        tile = default_tile(*shape)
        for rank in ranks:
            lora_a = harness.random_bf16(rng, (rank, shape[1]), 0.02)
            lora_b = harness.random_bf16(rng, (shape[0], rank), 0.02)
            depth = _probe.verified_depth(tile.rows, tile.cols, rank, rank,
                                          pin=blas_single_threaded)
            for threads in threads_list:
                outs = {"one_pass": weight.copy(), "sgemm_first": weight.copy()}

                def fuse(name, share_now):
                    def call():
                        _probe.BLAS_MIN_SHARE = share_now
                        try:
                            ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8, threads=threads,
                                               out=outs[name])
                        finally:
                            _probe.BLAS_MIN_SHARE = share
                    return call

                sgemm, flops = harness.square_sgemm(threads)
                times = harness.interleaved({"one_pass": fuse("one_pass", 1.01),
                                             "sgemm_first": fuse("sgemm_first", 0.0),
                                             "sgemm": sgemm}, repeats=repeats)
                same = outs["one_pass"].tobytes() == outs["sgemm_first"].tobytes()
                fuse_flops = 2.0 * shape[0] * shape[1] * rank
                rate = {name: (fuse_flops / times[name]["min"]) / (flops / times["sgemm"]["min"])
                        for name in ("one_pass", "sgemm_first")}
                row = {"shape": list(shape), "rank": rank, "threads": threads,
                       "tile": list(tile), "sgemm_depth": depth,
                       "one_pass_of_sgemm": rate["one_pass"],
                       "sgemm_first_of_sgemm": rate["sgemm_first"],
                       "one_pass_speedup": times["sgemm_first"]["min"] / times["one_pass"]["min"],
                       "one_pass_speedup_median": (times["sgemm_first"]["median"]
                                                   / times["one_pass"]["median"]),
                       "times": times, "same_bytes": same}
                rows_out.append(row)
                log(f"{shape[0]}x{shape[1]} rank {rank} threads {threads} (sgemm exact for "
                    f"{depth} terms): one pass x{rate['one_pass']:.2f} of sgemm, sgemm first "
                    f"x{rate['sgemm_first']:.2f}; one pass faster x{row['one_pass_speedup']:.3f}"
                    f" (medians x{row['one_pass_speedup_median']:.3f}); same bytes: {same}")
    return rows_out


def main(argv=None):
    return harness.shapes_and_ranks_main(__doc__, run, SHAPES, RANKS, argv)


if __name__ == "__main__":
    sys.exit(main())
