"""The arithmetic contract as plain numpy loops: the oracle for tests and goldens.

Nothing here is fast and nothing here calls ltx2blas's own kernels.  Each function is the
textbook loop of docs (spec §1): one IEEE f32 operation per step, in the order written, with
numpy's elementwise float32 ``*`` and ``+`` (numpy never fuses them into an FMA).

bf16 values are uint16 bit patterns throughout.
"""
import numpy as np


def bf16_round(x):
    """f32 -> bf16 bits, round to nearest even.

    NaN becomes the quiet NaN 0x7FC0 with its sign kept (what ml_dtypes gives); values past the
    largest bf16 round to +-inf; subnormals are kept."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    rounded = ((u + 0x7FFF + lsb) >> 16) & 0xFFFF
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    quiet_nan = ((u >> 16) & 0x8000) | 0x7FC0
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


def bf16_widen(h):
    """bf16 bits -> f32, exact."""
    return (np.asarray(h, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def lora_delta(lora_a, lora_b, strength):
    """delta[o, i] = bf16(sum_k bf16(B[o, k] * s) * A[k, i]), f32 sum from 0.0 in k order."""
    lora_a = np.asarray(lora_a, dtype=np.uint16)
    lora_b = np.asarray(lora_b, dtype=np.uint16)
    rank, cols = lora_a.shape
    rows = lora_b.shape[0]
    s = np.float32(strength)
    bs = bf16_round(bf16_widen(lora_b) * s)  # strength rounds into B first
    a = bf16_widen(lora_a)
    acc = np.zeros((rows, cols), dtype=np.float32)
    for k in range(rank):
        acc = acc + bf16_widen(bs[:, k])[:, None] * a[k][None, :]
    return bf16_round(acc)


def fuse_lora(weight, lora_a, lora_b, strength=1.0):
    """W'[o, i] = bf16(f32(W[o, i]) + f32(delta[o, i])) -- one adapter (spec §1)."""
    delta = lora_delta(lora_a, lora_b, strength)
    return bf16_round(bf16_widen(weight) + bf16_widen(delta))


def fuse_loras(weight, adapters):
    """Several adapters (spec §1): total = bf16(0.0 + delta_1 + delta_2 + ...) in f32, adapter
    order, then W' = bf16(W + total).  ``adapters`` is a sequence of (lora_a, lora_b, strength)."""
    weight = np.asarray(weight, dtype=np.uint16)
    total = np.zeros(weight.shape, dtype=np.float32)
    for lora_a, lora_b, strength in adapters:
        total = total + bf16_widen(lora_delta(lora_a, lora_b, strength))
    return bf16_round(bf16_widen(weight) + bf16_widen(bf16_round(total)))
