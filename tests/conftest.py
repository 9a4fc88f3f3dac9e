import os
import sys
import zlib

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

try:
    import ltx2blas._gemm  # noqa: F401
except ImportError as exc:  # the checkout's ltx2blas/ folder shadowing the installed package
    raise ImportError(
        "tests need the installed (compiled) ltx2blas; install it as the README says and run "
        "`pytest` (not `python -m pytest` from the checkout root)") from exc

import _ltx2blas_hooks as hooks  # noqa: E402  (the kernel tables, one by one)
from ltx2blas import _gemm


@pytest.fixture
def rng(request):
    # A fixed seed per test, so failures reproduce: from the test's name by CRC-32, not hash(),
    # which Python salts differently in every process.
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture(params=[name for name in ("base", "avx2", "avx512", "avx512bf16", "neon", "neon_bf16")
                        if name in _gemm.kernels_built()])
def kernel_table(request):
    """Every kernel table this build has; skipped where the CPU lacks it."""
    try:
        _gemm.use_kernels(request.param)
    except ValueError:
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    yield request.param
    _gemm.use_kernels(None)


def _pairs_tables():
    names = []
    for name in ("avx512bf16", "neon_bf16"):
        try:
            if name in _gemm.kernels_built() and hooks.has_pairs_kernel(name):
                names.append(name)
        except ValueError:  # built, but this CPU cannot run it
            pass
    return names or [None]


@pytest.fixture(params=_pairs_tables())
def pairs_table(request):
    """Every kernel table with the dot-product fuse that this CPU runs (one skip if none), the
    fuse held to that kernel wherever it may take it, whatever the rates measured here."""
    from ltx2blas import fuse

    if request.param is None:
        pytest.skip("no kernel table with the dot-product fuse runs on this CPU")
    forced = fuse.forced_fuse_kernel()
    _gemm.use_kernels(request.param)
    fuse.use_fuse_kernel("dot")
    yield request.param
    fuse.use_fuse_kernel(forced)
    _gemm.use_kernels(None)


def pytest_runtest_teardown(item):
    """Files over a megabyte a test made in its tmp_path go when it ends: pytest keeps the temp
    folders of the last runs, and checkpoints would pile up there."""
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp is None or not os.path.isdir(tmp):
        return
    for root, _, names in os.walk(tmp):
        for name in names:
            path = os.path.join(root, name)
            try:
                if not os.path.islink(path) and os.path.getsize(path) > 1 << 20:
                    os.unlink(path)
            except OSError:
                pass
