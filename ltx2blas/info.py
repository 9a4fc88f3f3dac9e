"""What ltx2blas runs on: versions, BLAS, threads, CPU features, and the BLAS's exact depth."""
import os
import platform
import sys

import numpy as np

from . import _gemm, _probe
from ._threads import available_cpus, blas_single_threaded, default_threads
from .fuse import DEFAULT_TILE


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


def _blas_libraries():
    from threadpoolctl import threadpool_info

    return [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]


def _scipy_blas(libraries):
    """The BLAS library that scipy.linalg.cython_blas calls (scipy's own, when bundled)."""
    for lib in libraries:
        if "scipy" in os.path.basename(os.path.dirname(lib.get("filepath", ""))) or \
                "scipy.libs" in lib.get("filepath", ""):
            return lib
    return libraries[-1] if libraries else None


def collect(probe_depths=(32, 384, 450, 512)):
    """Everything ``ltx2blas info`` prints, as a dict (JSON-serialisable)."""
    import scipy
    import threadpoolctl

    from . import __version__

    libraries = _blas_libraries()
    blas = _scipy_blas(libraries)
    mb, nb = DEFAULT_TILE
    depths = {k: _probe.verified_depth(mb, nb, k, k, pin=blas_single_threaded)
              for k in probe_depths}
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
        "exact depth of sgemm on a %dx%d tile (probed now, bit for bit):" % tuple(info["sgemm_exact_depth"]["tile"]),
    ]
    for k, d in info["sgemm_exact_depth"]["by_rank"].items():
        if int(d) == int(k):
            how = "one sgemm call, exact"
        elif int(d) == 0:
            how = "sgemm not exact here: all terms by the sequential kernel"
        else:
            how = f"sgemm for the first {d} terms, the sequential kernel for the other {int(k) - int(d)}"
        lines.append(f"  rank {k:>5}: {how}")
    lines.append(f"the fuse calls sgemm only above rank {info['sgemm_above_rank']}; up to it, the "
                 "sequential kernel fuses each tile in one pass")
    if info.get("dot_product_fuse"):
        lines.append("  two terms per instruction (VDPBF16PS) where the adapter's magnitudes "
                     "rule out subnormal and infinite sums")
    return "\n".join(lines)
