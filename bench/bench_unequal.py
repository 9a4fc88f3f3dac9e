"""Cores of unequal speed, imitated: one thread more than the cores there are (3 threads on 2
cores make one core half as fast for two of them, as a big.LITTLE machine's little cores are
for its big ones).  For each workload, the throughput with cores + 1 threads over that with
one thread per core, the two timed interleaved in one run.  A work split into equal shares per
thread finishes at the pace of the slowest thread; work handed out in small pieces as threads
come free keeps the ratio near 1.

    python bench/bench_unequal.py [--quick] [--save FILE.json]

Each result is checked against the same call at one thread per core (byte for byte).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def workloads(quick):
    """name -> (call(threads) -> result): the fuse, the Linear at 8 and 256 rows, and
    text_features at 64 and 1024 valid tokens."""
    import ltx2blas

    rng = np.random.default_rng(0)
    n = 1024 if quick else 4096
    w = harness.random_bf16(rng, (n, n), 0.02)
    a, b = harness.random_bf16(rng, (384, n), 0.01), harness.random_bf16(rng, (n, 384), 0.01)
    width = 49 * 3840
    weight = harness.random_bf16(rng, (256 if quick else 2048, width), 0.01)
    xs = {rows: harness.random_bf16(rng, (rows, width), 1.0) for rows in (8, 256)}
    depth, layers = 3840, 49
    # 64 tokens into one 256-wide projection, where the statistics weigh most; 1024 into 2048
    tokens = {64: 256, 256 if quick else 1024: 256 if quick else 2048}
    hidden = {t: harness.random_bf16(rng, (1, t, depth, layers), 1.0) for t in tokens}
    projs = {o: [(harness.random_bf16(rng, (o, depth * layers), 0.01), None)]
             for o in set(tokens.values())}
    out = {
        "fuse 4096x4096 rank 384" if not quick else "fuse 1024x1024 rank 384":
            lambda t: ltx2blas.fuse_lora(w, a, b, 0.8, threads=t),
    }
    for rows, x in xs.items():
        out[f"linear {rows} rows, bf16 x"] = lambda t, x=x: ltx2blas.linear(x, weight, threads=t)
    for tok, h in hidden.items():
        mask, proj = np.ones((1, tok), bool), projs[tokens[tok]]
        out[f"text_features {tok} tokens, out {tokens[tok]}"] = (
            lambda t, h=h, mask=mask, proj=proj: ltx2blas.text_features(
                h, mask, proj, version="v2", threads=t)[0])
    return out


def run(quick=False, repeats=5, log=print):
    from ltx2blas._threads import available_cpus

    cores = available_cpus()
    rows = []
    for name, call in workloads(quick).items():
        want = call(cores)
        got = call(cores + 1)
        same = np.array_equal(np.asarray(want).view(np.uint8), np.asarray(got).view(np.uint8))
        t = harness.interleaved({"fair": lambda: call(cores), "more": lambda: call(cores + 1)},
                                repeats=repeats)
        ratio = t["fair"]["median"] / t["more"]["median"]
        rows.append({"workload": name, "cores": cores, "threads": [cores, cores + 1],
                     "seconds": {k: v["median"] for k, v in t.items()},
                     "spread": {k: v["spread"] for k, v in t.items()},
                     "throughput_ratio": ratio, "same_bytes": bool(same)})
        log(f"{name:32s} {cores + 1} threads / {cores}: {ratio:.3f} "
            f"({t['more']['median'] * 1e3:.1f} ms vs {t['fair']['median'] * 1e3:.1f} ms; "
            f"spreads {t['more']['spread']:.2f} / {t['fair']['spread']:.2f})"
            f"{'' if same else '  BYTES DIFFER'}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save", default=None, help="write the rows and the machine as JSON")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    rows = run(args.quick, args.repeats)
    if args.save:
        harness.write_json(args.save, {"machine": harness.machine(), "rows": rows})
    return 0 if all(r["same_bytes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
