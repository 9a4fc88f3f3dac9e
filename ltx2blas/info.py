"""What ltx2blas runs on: versions, BLAS, threads, CPU features, the BLAS's exact depth, and the
route each fuse rank and Linear row count takes here, with the reason."""
import platform
import sys

import numpy as np

from . import _gemm, _probe
from ._threads import available_cpus, blas_single_threaded, default_threads, scipy_blas
from .fuse import default_tile, route_of
from .linear_layer import (
    DOT_PANEL_ROWS,
    DOT_ROUTES,
    STREAM_ROWS,
    _panel_min_rows,
    panel_above_stream_rows,
    plan,
    segments,
    task_count,
)

# The shapes the routes are shown for: the fuse's tile of an attention weight (4096 x 4096),
# the Linear's row counts from one prompt to a batch, and the text tower's output widths.
ROUTE_WEIGHT = (4096, 4096)
LINEAR_ROWS = (1, 8, 64, 256, 1024)
LINEAR_OUTPUTS = (2048, 3840, 4096)
LINEAR_WIDTH = 49 * 3840


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model", "hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_features():
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "sve", "sve2", "bf16")
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key in ("flags", "features"):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return [f for f in wanted if f in flags]


def collect(probe_depths=(32, 384, 450, 512)):
    """Everything ``ltx2blas info`` prints, as a dict (JSON-serialisable)."""
    import scipy
    import threadpoolctl

    from . import __version__

    blas = scipy_blas()
    mb, nb = default_tile(*ROUTE_WEIGHT)
    depths = {k: _probe.verified_depth(mb, nb, k, k, pin=blas_single_threaded)
              for k in probe_depths}
    handed = {k: _probe.blas_depth(mb, nb, k, k, pin=blas_single_threaded)
              for k in probe_depths}
    linear_routes, bf16_x_routes = {}, {}
    for rows in LINEAR_ROWS:
        bf16_x_routes[str(rows)] = plan(rows, np.uint16, x_dtype=np.uint16)[0]
        route, blocks = plan(rows, np.uint16)
        linear_routes[str(rows)] = {
            "route": route, "blocks": list(blocks),
            "segments": {str(o): segments(rows, o, LINEAR_WIDTH, route, blocks)[0]
                         for o in LINEAR_OUTPUTS},
            "segment_length": segments(rows, LINEAR_OUTPUTS[-1], LINEAR_WIDTH, route, blocks)[1],
            "tasks": {str(o): task_count(rows, o, LINEAR_WIDTH, np.uint16)
                      for o in LINEAR_OUTPUTS}}
    return {
        "ltx2blas": __version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "threadpoolctl": threadpoolctl.__version__,
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_features": _cpu_features(),
        "cpus_available": available_cpus(),
        "openmp": _gemm.have_openmp(),
        "threads_default": default_threads(),
        "kernels_built": _gemm.kernels_built(),
        "kernel": _gemm.kernel_name(),
        "blas": None if blas is None else {
            "library": blas.get("internal_api"),
            "version": blas.get("version"),
            "architecture": blas.get("architecture"),
            "threads": blas.get("num_threads"),
            "threading_layer": blas.get("threading_layer"),
            "path": blas.get("filepath"),
        },
        "sgemm_exact_depth": {
            "tile": [mb, nb],
            "by_rank": {str(k): d for k, d in depths.items()},
        },
        "sgemm_above_rank": _probe.SEQUENTIAL_DEPTH,
        "sgemm_min_share": _probe.BLAS_MIN_SHARE,
        "fuse_routes": {str(k): {"sgemm_exact": depths[k], "sgemm_terms": handed[k],
                                 "route": route_of(k, (mb, nb)),
                                 "otherwise": route_of(k, (mb, nb), pairs=False)}
                        for k in probe_depths},
        "linear_routes": linear_routes,
        "linear_panel_above_stream_rows": panel_above_stream_rows(),
        "linear_routes_bf16_x": bf16_x_routes,
        "dot_product_fuse": _gemm.has_pairs_kernel(),
    }


def format_info(info):
    blas = info["blas"] or {}
    lines = [
        f"ltx2blas {info['ltx2blas']}  (python {info['python']}, numpy {info['numpy']}, "
        f"scipy {info['scipy']}, threadpoolctl {info['threadpoolctl']})",
        f"cpu        {info['cpu']} [{info['machine']}], features: {' '.join(info['cpu_features']) or '-'}",
        f"threads    {info['threads_default']} by default ({info['cpus_available']} CPUs available; "
        f"OpenMP {'on' if info['openmp'] else 'OFF: one thread'})",
        f"kernels    {info['kernel']} (built: {', '.join(info['kernels_built'])})",
        f"blas       {blas.get('library')} {blas.get('version')} ({blas.get('architecture')}), "
        f"{blas.get('threads')} threads outside ltx2blas calls, 1 inside; {blas.get('path')}",
        "the fuse, on a %dx%d tile (the default for a 4096 x 4096 weight; sgemm probed now, bit "
        "for bit):" % tuple(info["sgemm_exact_depth"]["tile"]),
    ]
    share = info["sgemm_min_share"]
    for k, route in info["fuse_routes"].items():
        d, h = route["sgemm_exact"], route["sgemm_terms"]
        if int(k) <= info["sgemm_above_rank"]:
            how = (f"the one-pass kernel (up to rank {info['sgemm_above_rank']} a BLAS call's "
                   "fixed costs outweigh its speed)")
        elif h == 0:
            exact = f"exact for the first {d} terms only" if d else "not exact here"
            how = (f"the one-pass kernel for all {k} terms (sgemm {exact}, under "
                   f"{share:.0%} of them)")
        elif h == int(k):
            how = "one sgemm call, exact for every term"
        else:
            how = f"sgemm for the first {h} terms, the sequential kernel for the other {int(k) - h}"
        if route["route"] == "dot-product":
            how = f"the dot-product kernel; otherwise {how}"
        lines.append(f"  rank {k:>5}: {how}")
    if info.get("dot_product_fuse"):
        lines.append("  (the dot-product kernel adds two terms per instruction (VDPBF16PS), in "
                     "the textbook order, where the adapter's magnitudes rule out subnormal and "
                     "infinite sums; it also takes each adapter of several, and fp8 and "
                     "quantised weights)")
    lines.append(f"the Linear, bf16 weight, in {LINEAR_WIDTH} (at out " +
                 " / ".join(next(iter(info["linear_routes"].values()))["tasks"]) + "):")
    for rows, route in info["linear_routes"].items():
        tasks = " / ".join(str(t) for t in route["tasks"].values())
        parts = " / ".join(str(t) for t in route["segments"].values())
        cut = ("the whole in-dimension" if set(route["segments"].values()) == {1}
               else f"one of {parts} segments")
        r, f, c = route["blocks"]
        lines.append(f"  M {rows:>5}: {route['route']:<6} {r} rows x {f} features x {cut} a task, "
                     f"chunks of {min(c, route['segment_length'])}: {tasks} tasks")
    panel_rows = _panel_min_rows()
    panel = (f"; from {panel_rows} rows the panel kernel, the fuse's register blocks on weight "
             f"rows widened {_gemm.PANEL_CHUNK} at a time, where the streaming kernel's widening "
             "would share the FMA pipes" if panel_rows else "")
    above = (f"the panel kernel too, its vectors wider than the BLAS's sgemm kernel "
             f"({blas.get('architecture')})" if info.get("linear_panel_above_stream_rows")
             else "sgemm on widened weight panels")
    lines.append(f"  (up to {STREAM_ROWS} rows ltx2blas's kernels read the bf16 weight rows "
                 "once, where a BLAS would spend longer packing each weight panel than "
                 f"multiplying it{panel}; above, {above})")
    bf16_x = info.get("linear_routes_bf16_x", {})
    if any(r in DOT_ROUTES for r in bf16_x.values()):
        lines.append("  on bf16 x (what text_features multiplies), two products per instruction "
                     "(VDPBF16PS): " + ", ".join(f"M {m}: {r}" for m, r in bf16_x.items()) +
                     f" (dot streams both operands' rows; from {DOT_PANEL_ROWS} rows dot_panel "
                     "packs x into pairs)")
    return "\n".join(lines)
