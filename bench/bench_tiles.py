"""The fuse's default tiles (at least MIN_TILES per weight, for many cores) against the largest
tile, DEFAULT_TILE, in the same run.

For each thread count, LTX-2 fuse shape and rank: the in-place fuse with the default tile and
with DEFAULT_TILE, interleaved (harness.interleaved), each result checked equal byte for byte.
Reported: the tile counts and the speed ratio (DEFAULT_TILE's time / the default's; above 1 the
default is faster), by fastest and by median sample.

    python bench/bench_tiles.py [--threads 1,2] [--ranks 32,384,450] [--out FILE.json]
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SHAPES = [(2048, 2048), (4096, 4096), (2048, 4096), (4096, 2048), (4096, 16384),
          (16384, 4096)]
RANKS = [32, 384, 450]


def run(threads_list, shapes, ranks, repeats=5, log=print):
    import ltx2blas
    from ltx2blas.fuse import DEFAULT_TILE, default_tile

    rng = np.random.default_rng(0)
    rows_out = []
    for shape in shapes:
        weight = harness.random_bf16(rng, shape, 0.02)
        tile = default_tile(*shape)
        count = lambda t: -(-shape[0] // t[0]) * -(-shape[1] // t[1])  # noqa: E731
        for rank in ranks:
            lora_a = harness.random_bf16(rng, (rank, shape[1]), 0.02)
            lora_b = harness.random_bf16(rng, (shape[0], rank), 0.02)
            for threads in threads_list:
                out_default, out_largest = weight.copy(), weight.copy()
                times = harness.interleaved({
                    "default": lambda: ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8,
                                                          threads=threads, out=out_default),
                    "largest": lambda: ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.8,
                                                          threads=threads, out=out_largest,
                                                          tile=DEFAULT_TILE),
                }, repeats=repeats)
                same = out_default.tobytes() == out_largest.tobytes()
                row = {"shape": list(shape), "rank": rank, "threads": threads,
                       "tile": list(tile), "tiles": count(tile),
                       "largest_tile": list(DEFAULT_TILE), "largest_tiles": count(DEFAULT_TILE),
                       "ratio_best": times["largest"]["min"] / times["default"]["min"],
                       "ratio_median": times["largest"]["median"] / times["default"]["median"],
                       "default_s": times["default"], "largest_s": times["largest"],
                       "same_bytes": same}
                rows_out.append(row)
                log(f"{shape[0]}x{shape[1]} rank {rank:3d} threads {threads}: tiles "
                    f"{tile[0]}x{tile[1]} ({row['tiles']}) vs {DEFAULT_TILE[0]}x"
                    f"{DEFAULT_TILE[1]} ({row['largest_tiles']}): speed x{row['ratio_best']:.3f}"
                    f" best, x{row['ratio_median']:.3f} median; same bytes: {same}")
    return rows_out


def main(argv=None):
    return harness.shapes_and_ranks_main(__doc__, run, SHAPES, RANKS, argv)


if __name__ == "__main__":
    sys.exit(main())
