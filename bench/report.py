"""Tables and plots from the suite's rows: results.md and PNG figures."""
import os


def _scaling(rows, key):
    """Thread-scaling efficiency: rate(t) / (t * rate(1)) for rows that share ``key``."""
    one = {key(r): r["gflops"] for r in rows if r["threads"] == 1}
    for r in rows:
        base = one.get(key(r))
        r["scaling_efficiency"] = (r["gflops"] / (r["threads"] * base)) if base else None


def annotate(rows):
    _scaling([r for r in rows if r["workload"] == "fuse"],
             lambda r: (r["rows"], r["cols"], r["rank"]))
    _scaling([r for r in rows if r["workload"] == "linear"], lambda r: (r["out"], r["rows"]))
    _scaling([r for r in rows if r["workload"] == "checkpoint"], lambda r: (r["blocks"], r["rank"]))
    _scaling([r for r in rows if r["workload"] == "features"], lambda r: (r["tokens"], tuple(r["outs"])))


def _peers(r):
    parts = []
    for name, p in r.get("peers", {}).items():
        text = f"{name.replace('_', ' ')} {p['speedup']:.2f}×"
        if "elements_differing_from_reference" in p:
            text += f" ({p['elements_differing_from_reference']} of {p['elements_checked']} differ)"
        parts.append(text)
    return "; ".join(parts) or "—"


def _eff(r):
    e = r.get("scaling_efficiency")
    return f"{e:.2f}" if e is not None else "—"


def _section(lines, rows, workload, title, columns, cells):
    """Appends a table of the rows of one workload (nothing if it has none)."""
    mine = [r for r in rows if r["workload"] == workload]
    if not mine:
        return
    lines += ["", title, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in mine:
        lines.append("| " + " | ".join(str(c) for c in cells(r)) + " |")


def _at_start(row, key):
    """The row's ratio against the ceilings from the start of the run ("" in older results)."""
    value = row.get(key + "_at_start")
    return "" if value is None else f"{value:.2f}"


def markdown(results):
    machine, rows = results["machine"], results["rows"]
    lines = [f"# ltx2blas benchmark — {machine.get('date', '')}", "",
             f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} CPUs, "
             f"BLAS {machine.get('blas', {}).get('library')} {machine.get('blas', {}).get('version')}"
             f" ({machine.get('blas', {}).get('architecture')}), kernels {machine.get('kernel')}, "
             f"ltx2blas {machine.get('ltx2blas')}, numpy {machine.get('numpy')}, "
             f"torch {machine.get('torch') or 'not installed'}.", "",
             "Ratios are of timings in the same run; peers' speedups are their time ÷ ours "
             "(above 1: ltx2blas is faster). Every candidate is timed by its fastest of the "
             "interleaved samples (noise on a shared host only slows calls down); medians are "
             "in results.json. \"÷ sgemm\" and \"÷ roofline\" divide by ceilings measured "
             "interleaved with the workload's calls (a 2048³ sgemm; the memory read rate); "
             "\"at start\" divides by the best of five of the ceilings below, measured once "
             "before the workloads.", "", "## Ceilings", "",
             "| threads | sgemm GFLOP/s | dgemm GFLOP/s | read GB/s | register-only peaks, "
             "GFLOP/s (bench/peaks.c) |", "|---|---|---|---|---|"]
    for c in results["ceilings"]:
        peaks = ", ".join(f"{k} {v:.0f}" for k, v in (c.get("peaks_gflops") or {}).items())
        lines.append(f"| {c['threads']} | {c['sgemm_gflops']:.0f} | {c['dgemm_gflops']:.0f} | "
                     f"{c['read_gbs']:.1f} | {peaks or '–'} |")
    def yes(r):
        return "yes" if r["checked"] else "NO"

    _section(lines, rows, "fuse", "## Fuse (in place, rank-r adapter, strength 0.8)",
             ["threads", "W", "rank", "GFLOP/s", "÷ sgemm", "÷ sgemm at start",
              "÷ same-shape sgemm", "÷ its instruction's peak", "scaling", "peak RSS MiB",
              "checked", "vs peers"],
             lambda r: [r["threads"], f"{r['rows']}×{r['cols']}", r["rank"], f"{r['gflops']:.0f}",
                        f"{r['of_sgemm']:.2f}", _at_start(r, "of_sgemm"), f"{r['of_sgemm_same']:.2f}",
                        (f"{r['of_instruction_peak']:.2f} ({r['instruction_peak']})"
                         if "of_instruction_peak" in r else "–"),
                        _eff(r),
                        f"{r['peak_rss_mib']:.0f}", yes(r), _peers(r)])
    _section(lines, rows, "linear", "## Linear (in = 188,160, bf16 weight, f32 accumulation)",
             ["threads", "out", "M", "ms", "GFLOP/s", "÷ roofline", "÷ roofline at start", "bound",
              "scaling", "peak RSS MiB", "checked", "vs peers"],
             lambda r: [r["threads"], r["out"], r["rows"], f"{r['ms']:.1f}", f"{r['gflops']:.0f}",
                        f"{r['of_roofline']:.2f}", _at_start(r, "of_roofline"), r["bound"], _eff(r),
                        f"{r['peak_rss_mib']:.0f}", yes(r), _peers(r)])
    _section(lines, rows, "checkpoint", "## Checkpoint fuse, end to end (read, fuse, write, fsync)",
             ["threads", "checkpoint", "rank", "GFLOP", "s", "GFLOP/s", "÷ sgemm",
              "÷ sgemm at start", "scaling", "peak RSS MiB", "checked"],
             lambda r: [r["threads"], f"{r['blocks']} blocks, {r['checkpoint_gib']:.2f} GiB",
                        r["rank"], f"{r['gflop']:.0f}", f"{r['seconds']:.2f}", f"{r['gflops']:.0f}",
                        f"{r['of_sgemm']:.2f}", _at_start(r, "of_sgemm"), _eff(r), f"{r['peak_rss_mib']:.0f}", yes(r)])
    _section(lines, rows, "features",
             "## Text feature extractor (V2: normalise, flatten, video + audio projections)",
             ["threads", "tokens (valid)", "outs", "s", "GFLOP/s", "÷ sgemm", "÷ sgemm at start",
              "all rows s", "saving", "scaling", "peak RSS MiB", "checked"],
             lambda r: [r["threads"], f"{r['tokens']} ({r['valid']})", "+".join(map(str, r["outs"])),
                        f"{r['seconds']:.2f}", f"{r['gflops']:.0f}", f"{r['of_sgemm']:.2f}",
                        _at_start(r, "of_sgemm"),
                        f"{r['all_rows_seconds']:.2f}", f"{r['saving']:.0%}", _eff(r),
                        f"{r['peak_rss_mib']:.0f}", yes(r)])
    return "\n".join(lines) + "\n"


def plots(results, folder):
    """GFLOP/s against threads per workload with the sgemm ceiling drawn, and the Linear's
    fraction of roofline against M. Returns the files written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows, written = results["rows"], []
    threads = [c["threads"] for c in results["ceilings"]]
    sgemm = [c["sgemm_gflops"] for c in results["ceilings"]]
    groups = {
        "fuse": lambda r: f"fuse {r['rows']}x{r['cols']} r{r['rank']}",
        "linear": lambda r: f"linear out {r['out']} M {r['rows']}",
        "checkpoint": lambda r: f"checkpoint {r['blocks']} blocks r{r['rank']}",
        "features": lambda r: f"features T {r['tokens']} outs {'+'.join(map(str, r['outs']))}",
    }
    for workload, label in groups.items():
        mine = [r for r in rows if r["workload"] == workload]
        if not mine:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot(threads, sgemm, "k--", label="sgemm 2048³ (ceiling)")
        for name in dict.fromkeys(label(r) for r in mine):
            pts = sorted((r["threads"], r["gflops"]) for r in mine if label(r) == name)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=name)
        ax.set_xlabel("threads")
        ax.set_ylabel("GFLOP/s")
        ax.set_xticks(threads)
        ax.set_title(f"{workload}: GFLOP/s against threads")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = os.path.join(folder, f"{workload}_threads.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    linear = [r for r in rows if r["workload"] == "linear"]
    if linear:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key in dict.fromkeys((r["out"], r["threads"]) for r in linear):
            pts = sorted((r["rows"], r["of_roofline"]) for r in linear if (r["out"], r["threads"]) == key)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"out {key[0]}, {key[1]} threads")
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows M")
        ax.set_ylabel("fraction of roofline")
        ax.set_ylim(0, 1.1)
        ax.set_title("linear: fraction of the same-run roofline against M")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        path = os.path.join(folder, "linear_roofline.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
