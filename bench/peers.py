"""What a user would reach for instead, measured beside ltx2blas in the same run.

* numpy + ml_dtypes: widen, matmul (numpy's BLAS), round, add -- the spec's arithmetic by hand.
* torch: upstream LTX-2's arithmetic (``matmul(B * s, A)`` in bf16, ``add_(W)``), and
  ``F.linear`` in f32 (weight held in f32) and in bf16.
* the reports' scalar loops (scalar_loops.c), compiled here at -O2 and timed on a slice.
Each is only offered where its package (or a C compiler) is installed.
"""
import ctypes
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import harness  # noqa: E402


def torch_module():
    try:
        import torch
    except ImportError:
        return None
    return torch


def ml_dtypes_module():
    try:
        import ml_dtypes
    except ImportError:
        return None
    return ml_dtypes


# ---- fuse peers ------------------------------------------------------------------------------

def numpy_fuse(weight, lora_a, lora_b, strength, threads):
    """The spec's arithmetic with numpy + ml_dtypes (numpy's BLAS order of additions)."""
    ml = ml_dtypes_module()
    from threadpoolctl import threadpool_limits

    bf16 = ml.bfloat16
    with threadpool_limits(threads, user_api="blas"):
        bs = (lora_b.view(bf16).astype(np.float32) * np.float32(strength)).astype(bf16)
        delta = (bs.astype(np.float32) @ lora_a.view(bf16).astype(np.float32)).astype(bf16)
        return (weight.view(bf16).astype(np.float32) + delta.astype(np.float32)).astype(bf16).view(np.uint16)


def torch_fuse(weight, lora_a, lora_b, strength, threads):
    """Upstream LTX-2's arithmetic: matmul(B * s, A) in bf16, then add_ into the weight."""
    torch = torch_module()
    torch.set_num_threads(threads)
    w = torch.from_numpy(weight.astype(np.int16)).view(torch.bfloat16)
    a = torch.from_numpy(lora_a.astype(np.int16)).view(torch.bfloat16)
    b = torch.from_numpy(lora_b.astype(np.int16)).view(torch.bfloat16)
    delta = torch.matmul(b * strength, a)
    w.add_(delta)
    return w.view(torch.int16).numpy().view(np.uint16)


# ---- the reports' scalar loops -----------------------------------------------------------------

_LIB = None


def scalar_library():
    """scalar_loops.c compiled to a shared library (cached), or None without a C compiler."""
    global _LIB
    if _LIB is not None:
        return _LIB or None
    lib = harness.c_library("scalar_loops.c")
    if lib is None:
        _LIB = False
        return None
    p = ctypes.c_void_p
    n = ctypes.c_ssize_t
    lib.lora_scalar.argtypes = [p, p, p, n, n, n]
    lib.linear_scalar.argtypes = [p, p, p, p, n, n, n]
    _LIB = lib
    return lib


def scalar_lora_rate(lora_a, lora_b_scaled, rows, timer):
    """GFLOP/s of the reports' LoRA loop on the first ``rows`` rows (a slice: the whole product
    would take minutes)."""
    lib = scalar_library()
    if lib is None:
        return None
    rank, cols = lora_a.shape
    agg = np.empty((rows, cols), np.uint16)
    bs = np.ascontiguousarray(lora_b_scaled[:rows])
    seconds = timer(lambda: lib.lora_scalar(bs.ctypes.data, lora_a.ctypes.data, agg.ctypes.data,
                                            rows, cols, rank))
    return 2.0 * rows * cols * rank / seconds / 1e9


def scalar_linear_rate(x, w32, feats, timer):
    """GFLOP/s of the reports' Linear loop on ``feats`` output features of one row."""
    lib = scalar_library()
    if lib is None:
        return None
    out = np.empty((1, feats), np.float32)
    xr = np.ascontiguousarray(x[:1])
    seconds = timer(lambda: lib.linear_scalar(xr.ctypes.data, w32.ctypes.data, None,
                                              out.ctypes.data, 1, x.shape[1], feats))
    return 2.0 * feats * x.shape[1] / seconds / 1e9
