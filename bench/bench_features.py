"""The text feature extractor forward, V2 shapes, against the same-run sgemm rate.

Hidden states [1, T, 3840, 49] bf16 with a share of padded tokens, the video (4096) and audio
(2048) projections with bias: time, GFLOP/s over the valid rows as a fraction of the rate of a
square 2048^3 sgemm interleaved with the calls (each by its fastest sample, harness.STAT; the
ratio against the best sgemm of the ceilings at the start of the run is recorded too), peak RSS, the saving from skipping padded rows (the same call with every row
marked valid, interleaved), and the call against its Linears alone: ``ltx2blas.linear`` of
each projection on the valid tokens' features, materialised before (normalized_features),
interleaved too -- what the features' normalisation and their passage through the panels
cost on top of the products (``of_linear``: the Linears' time / the call's). The Linears'
outputs must be the call's bytes.  Checked: sampled tokens' features against
ltx2blas.reference.text_features_normalized (V2 statistics are per token, so a slice of tokens
suffices), and sampled outputs against the exact sum of those features times the weights,
within the derived bound.

    python bench/run.py --only features          (the suite)
    python bench/bench_features.py [--quick]     (this workload alone)
"""
import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

D, L = 3840, 49


def check(h, mask, projections, outputs, rng, tokens=2, samples=6):
    from ltx2blas import reference
    from ltx2blas.linear_layer import gamma

    valid = np.flatnonzero(mask[0])
    pick = np.sort(rng.choice(valid, size=min(tokens, valid.size), replace=False))
    n = int(mask.sum())
    for (w, b), y in zip(projections, outputs):
        feats = reference.text_features_normalized(h[:, pick], np.ones((1, pick.size), bool), "v2",
                                                   w.shape[0])[0]
        x = reference.bf16_widen(feats).astype(np.float64)
        for _ in range(samples):
            i, o = rng.integers(pick.size), rng.integers(w.shape[0])
            terms = x[i] * reference.bf16_widen(w[o]).astype(np.float64)
            exact = math.fsum(list(terms) + [float(b[o])])
            # the bound of the route the bf16 features take (the dot-product routes' flushing
            # of subnormals can lose 2 in 2^-126 more on these normal values)
            g = gamma(n, x.shape[1], w.dtype, x_dtype=np.uint16)
            bound = g * (np.abs(terms).sum() + abs(float(b[o]))) + 2 * x.shape[1] * 2.0**-125
            got = float(y[0, pick[i], o])
            if abs(got - exact) > bound + np.spacing(np.float32(abs(got))) / 2:
                return False
        if not np.array_equal(y[0, ~mask[0]], np.broadcast_to(b, y[0, ~mask[0]].shape)):
            return False  # padded rows: the bias, what the Linear gives on zero features
    return True


def run(threads_list, tokens, padding, outs, ceilings, repeats=2, log=print):
    import ltx2blas
    from ltx2blas import linear_layer

    rng = np.random.default_rng(0)
    h = harness.random_bf16(rng, (1, tokens, D, L), 1.0)
    mask = np.ones((1, tokens), bool)
    mask[0, int(round(tokens * (1 - padding))):] = False
    full = np.ones_like(mask)
    projections = [(harness.random_bf16(rng, (o, D * L), 0.02),
                    rng.standard_normal(o).astype(np.float32)) for o in outs]
    n = int(mask.sum())
    flops = 2.0 * n * D * L * sum(outs)
    route = linear_layer.plan(n, np.uint16, x_dtype=np.uint16)[0]
    valid_rows = np.flatnonzero(mask[0])
    alone = [np.empty((n, w.shape[0]), np.float32) for w, _ in projections]
    # VDPBF16PS does two products per instruction where an FMA does one
    ceiling = 2.0 if route in linear_layer.DOT_ROUTES else 1.0
    rows = []
    for threads in threads_list:
        state = {}
        square, square_flops = harness.square_sgemm(threads)
        harness.reset_peak_rss()  # the call's peak memory, before the features exist whole
        for call in ({"h": h, "mask": mask}, {"h": h, "mask": full}):
            ltx2blas.text_features(call["h"], call["mask"], projections, version="v2",
                                   threads=threads)
        peak_rss = harness.peak_rss_mib()
        features = [ltx2blas.normalized_features(h, mask, version="v2", out_features=w.shape[0],
                                                 threads=threads)[0, valid_rows]
                    for w, _ in projections]
        t = harness.interleaved({
            "sgemm_square": square,
            "valid": lambda: state.__setitem__("y", ltx2blas.text_features(
                h, mask, projections, version="v2", threads=threads)),
            "all_rows": lambda: ltx2blas.text_features(h, full, projections, version="v2",
                                                       threads=threads),
            "linear_alone": lambda: [ltx2blas.linear(x, w, b, threads=threads, out=y)
                                     for x, (w, b), y in zip(features, projections, alone)],
        }, repeats=repeats, warmup=0)
        seconds = t["valid"][harness.STAT]
        rate = flops / seconds / 1e9
        peak = square_flops / t["sgemm_square"][harness.STAT] / 1e9
        at_start = ceilings[threads]["sgemm_gflops"]
        row = {"workload": "features", "version": "v2", "tokens": tokens, "valid": n,
               "outs": list(outs), "threads": threads, "seconds": seconds, "gflops": rate,
               "route": route, "compute_ceiling_of_sgemm": ceiling,
               "sgemm_gflops": peak, "of_sgemm": rate / peak, "of_ceiling": rate / peak / ceiling,
               "sgemm_gflops_at_start": at_start, "of_sgemm_at_start": rate / at_start,
               "seconds_median": t["valid"]["median"],
               "all_rows_seconds": t["all_rows"][harness.STAT],
               "saving": 1 - seconds / t["all_rows"][harness.STAT],
               "linear_alone_seconds": t["linear_alone"][harness.STAT],
               "of_linear": t["linear_alone"][harness.STAT] / seconds,
               "same_bytes_as_linear": all(
                   np.array_equal(y[0, valid_rows].view(np.uint32), a.view(np.uint32))
                   for y, a in zip(state["y"], alone)),
               "peak_rss_mib": peak_rss, "spread": t["valid"]["spread"],
               "checked": check(h, mask, projections, state["y"], rng)}
        rows.append(row)
        features = None  # freed before the next thread count measures its peak memory
        log(f"features v2 threads={threads} T={tokens} ({n} valid) outs {list(outs)}: "
            f"({route}) {seconds:.2f} s, {rate:.1f} GFLOP/s, {row['of_sgemm']:.2f} of sgemm "
            f"({peak:.0f}), {row['of_ceiling']:.2f} of the compute ceiling; "
            f"all {tokens} rows {row['all_rows_seconds']:.2f} s -> skipping padding saves "
            f"{row['saving']:.0%}; its Linears alone {row['linear_alone_seconds']:.2f} s "
            f"({row['of_linear']:.3f} of the call's time, same bytes: "
            f"{row['same_bytes_as_linear']}); peak RSS {row['peak_rss_mib']:.0f} MiB; "
            f"checked={row['checked']}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", default=None)
    parser.add_argument("--save", default=None, help="write the rows and the machine as JSON here")
    args = parser.parse_args(argv)
    harness.check_installed_not_checkout()
    threads = harness.thread_counts(args.threads)
    ceilings = {t: harness.ceilings(t) for t in threads}
    if args.quick:
        rows = run(threads, 48, 0.3, (256, 128), ceilings, repeats=1)
    else:
        rows = run(threads, 1024, 0.3, (4096, 2048), ceilings, repeats=3)
    if args.save:
        harness.write_json(args.save, {"machine": harness.machine(), "features": rows})
    return 0 if all(r["checked"] and r["same_bytes_as_linear"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
