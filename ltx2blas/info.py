"""What ltx2blas runs on: versions, BLAS, threads, CPU features, the BLAS's exact depth, and the
route each fuse rank and Linear row count takes here, with the reason."""
import platform
import sys

import numpy as np

from . import _gemm, _probe
from ._threads import available_cpus, blas_single_threaded, default_threads, scipy_blas
from .fuse import default_tile, dot_fuse_chosen, forced_fuse_kernel, route_of
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
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip().lower()
                if key == "flags":
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return [f for f in wanted if f in flags]


# ---- Arm: features from the auxiliary vector, cores from MIDR_EL1 -----------------------------
# On Arm, /proc/cpuinfo may not describe the CPU the program runs on (qemu-user passes the
# host's through), while the auxiliary vector is what the kernel -- or the emulator -- tells
# this process, and MIDR_EL1 names each core's design.

#: HWCAP and HWCAP2 bits (Linux, arch/arm64/include/uapi/asm/hwcap.h) of the features that
#: matter to ltx2blas's kernels, in the order info prints them.
ARM_HWCAP = {"asimd": 1, "asimdhp": 10, "asimddp": 20, "sve": 22}
ARM_HWCAP2 = {"sve2": 1, "svebf16": 12, "i8mm": 13, "bf16": 14, "sme": 23}
AT_HWCAP, AT_HWCAP2 = 16, 26

#: MIDR_EL1 (implementer, part number) -> the core's name.
ARM_CORES = {
    (0x41, 0xD03): "Cortex-A53", (0x41, 0xD08): "Cortex-A72", (0x41, 0xD0B): "Cortex-A76",
    (0x41, 0xD0C): "Neoverse-N1", (0x41, 0xD40): "Neoverse-V1", (0x41, 0xD41): "Cortex-A78",
    (0x41, 0xD44): "Cortex-X1", (0x41, 0xD46): "Cortex-A510", (0x41, 0xD47): "Cortex-A710",
    (0x41, 0xD48): "Cortex-X2", (0x41, 0xD49): "Neoverse-N2", (0x41, 0xD4D): "Cortex-A715",
    (0x41, 0xD4E): "Cortex-X3", (0x41, 0xD4F): "Neoverse-V2", (0x41, 0xD80): "Cortex-A520",
    (0x41, 0xD81): "Cortex-A720", (0x41, 0xD82): "Cortex-X4", (0x41, 0xD84): "Neoverse-V3",
    (0x41, 0xD85): "Cortex-X925", (0x41, 0xD87): "Cortex-A725", (0x41, 0xD8E): "Neoverse-N3",
    (0xC0, 0xAC3): "Ampere-1", (0xC0, 0xAC4): "Ampere-1A", (0x61, 0x022): "Apple M1",
    (0x61, 0x032): "Apple M2",
}


def arm_features(hwcap, hwcap2):
    """The feature names ltx2blas's kernels care about, from AT_HWCAP and AT_HWCAP2."""
    return ([name for name, bit in ARM_HWCAP.items() if hwcap >> bit & 1] +
            [name for name, bit in ARM_HWCAP2.items() if hwcap2 >> bit & 1])


def arm_cores(midrs, cpuinfo=""):
    """"10 x Cortex-X925, 10 x Cortex-A725": the cores by kind, from each CPU's MIDR_EL1
    (``midrs``), else from /proc/cpuinfo's "CPU implementer" and "CPU part" lines; None when
    neither names any core."""
    ids = [((m >> 24) & 0xFF, (m >> 4) & 0xFFF) for m in midrs]
    if not ids:
        implementer = None
        for line in cpuinfo.splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            try:
                if key == "cpu implementer":
                    implementer = int(value.strip(), 0)
                elif key == "cpu part" and implementer is not None:
                    ids.append((implementer, int(value.strip(), 0)))
            except ValueError:
                continue
    if not ids:
        return None
    counts = {}
    for implementer, part in ids:
        name = ARM_CORES.get((implementer, part), f"core 0x{implementer:02x}:0x{part:03x}")
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} x {name}" for name, n in counts.items())


def _arm_sources():
    """(AT_HWCAP, AT_HWCAP2, [MIDR_EL1 of each CPU], /proc/cpuinfo's text) of this machine."""
    hwcap = hwcap2 = 0
    try:
        import ctypes

        getauxval = ctypes.CDLL(None).getauxval
        getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
        hwcap, hwcap2 = getauxval(AT_HWCAP), getauxval(AT_HWCAP2)
    except (OSError, AttributeError):
        try:
            with open("/proc/self/auxv", "rb") as f:
                words = np.frombuffer(f.read(), np.uint64)
            pairs = dict(zip(words[::2].tolist(), words[1::2].tolist()))
            hwcap, hwcap2 = pairs.get(AT_HWCAP, 0), pairs.get(AT_HWCAP2, 0)
        except (OSError, ValueError):
            pass
    import glob

    midrs = []
    for path in sorted(glob.glob("/sys/devices/system/cpu/cpu[0-9]*/regs/identification/"
                                 "midr_el1")):
        try:
            with open(path) as f:
                midrs.append(int(f.read().strip(), 16))
        except (OSError, ValueError):
            continue
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return hwcap, hwcap2, midrs, cpuinfo


def arm_cpu(hwcap, hwcap2, midrs, cpuinfo):
    """(the CPU as info names it, its features) on Arm, from recorded or live sources."""
    cores = arm_cores(midrs, cpuinfo)
    return (cores or "cores not named (no MIDR_EL1 in /sys or /proc/cpuinfo)",
            arm_features(hwcap, hwcap2))


#: What each table with the dot-product kernels runs them on, as info prints it: the fuse's
#: instructions, and the Linear's (docs/arithmetic.md states each one's arithmetic).
DOT_INSTRUCTIONS = {
    "avx512bf16": ("adds two terms per instruction from bf16 pairs (VDPBF16PS)",
                   "two products per instruction (VDPBF16PS, each sum rounded to nearest)"),
    "neon_bf16": ("adds one term a lane per instruction straight from bf16 (BFMLALT, then "
                  "BFMLALB: a fused multiply-add)",
                  "two products a lane per instruction streaming (BFDOT), sixteen a 2 x 2 block "
                  "in the panel (BFMMLA, as two BFDOT steps): each pair's sum and its addition "
                  "rounded to odd, which error_bound counts"),
}


def cpu_and_features():
    """The CPU's name and the features that choose ltx2blas's kernels, on this machine."""
    if platform.machine().lower() in ("aarch64", "arm64"):
        return arm_cpu(*_arm_sources())
    return _cpu_model(), _cpu_features()


def collect(probe_depths=(32, 384, 450, 512)):
    """Everything ``ltx2blas info`` prints, as a dict (JSON-serialisable)."""
    import scipy
    import threadpoolctl

    from . import __version__

    blas = scipy_blas()
    cpu, features = cpu_and_features()
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
        "cpu": cpu,
        "cpu_features": features,
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
        # the one-adapter fuse kernels' in-cache rates (GFLOP/s) and which the fuse takes
        "fuse_rates": dict(zip(("dot", "fma"), (round(r, 1) for r in _gemm.fuse_rates()))),
        "fuse_kernel": "dot" if dot_fuse_chosen() else "fma",
        "fuse_kernel_forced": forced_fuse_kernel() is not None,
        # the dot-product Linear's lanes and unit roundoffs a pair (error_bound counts them)
        "dot_linear_rule": dict(zip(("lanes", "pair_units"), _gemm.dot_rule())),
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
    fuse_how, linear_how = DOT_INSTRUCTIONS.get(info["kernel"], ("", ""))
    if info.get("dot_product_fuse"):
        rates = info["fuse_rates"]
        why = ("forced (LTX2BLAS_FUSE_KERNEL)" if info["fuse_kernel_forced"] else
               "the faster on a 64 x 256 tile of depth 128, in cache, timed once a process")
        lines.append(f"  (kernels measured: dot-product {rates['dot']} GFLOP/s, f32 FMA "
                     f"{rates['fma']} GFLOP/s; the fuse takes the "
                     f"{'dot-product' if info['fuse_kernel'] == 'dot' else 'FMA'} kernel: {why})")
        lines.append(f"  (the dot-product kernel {fuse_how}, in the textbook order, where the "
                     "adapter's magnitudes rule out subnormal and infinite sums; it also takes "
                     "each adapter of several, and fp8 and quantised weights)")
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
        lines.append(f"  on bf16 x (what text_features multiplies), {linear_how}: " + ", ".join(f"M {m}: {r}" for m, r in bf16_x.items()) +
                     f" (dot streams both operands' rows; from {DOT_PANEL_ROWS} rows dot_panel "
                     "packs x into pairs)")
    return "\n".join(lines)
