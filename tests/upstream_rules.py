"""The owners' fuse arithmetic, run in torch on the CPU, for comparison with ltx2blas.

Each function restates one rule as its owner's code evaluates it: upstream LTX-2's aggregation
(``matmul(B * s, A)`` in bf16, then ``addmm_`` or a stacked sum) and its quantisation policies'
fuse rules (fp8_scaled_mm, blockwise fp8/fp6, NVFP4), and ComfyUI's per-tensor fp8
requantisation.  Where the owner runs a step only on CUDA (the fp6 packing, the NVFP4 kernels,
the blockwise dequantise kernel), the step is written out here with torch's CPU operations,
following the kernel's arithmetic.  Needs torch; the tests skip without it.
"""
import math

import numpy as np
import torch

E4M3 = torch.float8_e4m3fn


def bf16_tensor(bits):
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


def bits(tensor):
    t = tensor.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy().copy()
    return t.numpy().copy()


def fp8_tensor(codes, fmt="F8_E4M3"):
    dtype = E4M3 if fmt == "F8_E4M3" else torch.float8_e5m2
    return torch.from_numpy(np.ascontiguousarray(codes, np.uint8)).view(dtype)


# ---- aggregation (ltx_core/loader/fuse_loras.py) ----

def aggregate(adapters, rule):
    """The bf16 aggregate delta: the first adapter as matmul(B * s, A); later ones by addmm_
    (today's rule) or all deltas stacked and summed (the first release)."""
    deltas = []
    agg = None
    for a, b, s in adapters:
        A, B = bf16_tensor(a), bf16_tensor(b)
        if rule == "sum":
            deltas.append(torch.matmul(B * s, A))
        elif agg is None:
            agg = torch.matmul(B * s, A).to(torch.bfloat16)
        else:
            agg.addmm_(B, A, alpha=s)
    if rule == "sum":
        return torch.sum(torch.stack(deltas), dim=0)
    return agg


def fuse_bf16(weight, agg):
    return agg.clone().add_(bf16_tensor(weight))


# ---- fp8_cast (quantization/fp8_cast.py), the CPU path: plain fp8 codes, no scale ----

def fuse_fp8_cast(codes, agg, fmt="F8_E4M3"):
    w = fp8_tensor(codes, fmt)
    return bits(agg.clone().add_(w.to(torch.bfloat16)).to(w.dtype))


# ---- fp8_scaled_mm (quantization/fp8_scaled_mm.py) ----

def fuse_fp8_scaled_mm(codes, scale, agg):
    w = fp8_tensor(codes).to(torch.float32) * torch.from_numpy(np.asarray(scale, np.float32))
    merged = w + agg.to(torch.float32)
    top = torch.amax(torch.abs(merged))
    mult = torch.finfo(E4M3).max / top
    q = torch.clamp(merged * mult, min=torch.finfo(E4M3).min, max=torch.finfo(E4M3).max).to(E4M3)
    return bits(q), bits(mult.reciprocal())


# ---- blockwise fp8 / fp6 (quantization/blockwise, ltx_kernels.blockwise) ----

def _dequant_blockwise(codes_f8, scales):
    """The blockwise dequantise kernel: each row's codes times its blocks' scales, in f32,
    rounded to bf16."""
    per_row = scales.repeat_interleave(128, dim=0)
    per_elem = per_row.repeat_interleave(128, dim=1)
    return (codes_f8.to(torch.float32) * per_elem).to(torch.bfloat16)


def _quant_blockwise(w, scale_max):
    rows, cols = w.shape
    blocks = w.view(rows // 128, 128, cols // 128, 128).transpose(1, 2).contiguous()
    top = blocks.float().abs().view(rows // 128, cols // 128, 128 * 128).max(dim=-1).values
    mult = scale_max / top
    q = (blocks.float() * mult[:, :, None, None].float()).to(E4M3)
    q = q.transpose(1, 2).contiguous().view(rows, cols)
    return q, (1 / mult).contiguous()


def fuse_block_fp8(codes, scales, agg):
    w = _dequant_blockwise(fp8_tensor(codes), torch.from_numpy(scales))
    merged = w + agg.to(w.dtype)
    q, s = _quant_blockwise(merged, 448.0)
    return bits(q), bits(s)


def fp6_unpack(packed, cols):
    """The fp6 unpack kernel: three bytes to four six-bit codes, to e4m3 codes with the two
    dropped exponent bits 0."""
    p = torch.from_numpy(packed).to(torch.int32).view(packed.shape[0], -1, 3)
    six = torch.stack([(p[..., 0] >> 2) & 0x3F,
                       ((p[..., 0] << 4) | (p[..., 1] >> 4)) & 0x3F,
                       ((p[..., 1] << 2) | (p[..., 2] >> 6)) & 0x3F,
                       p[..., 2] & 0x3F], dim=-1).view(packed.shape[0], cols)
    code = (((six >> 5) & 1) << 7) | (((six >> 4) & 1) << 4) | (six & 0x0F)
    return code.to(torch.uint8)


def fp6_pack(codes_u8):
    c = codes_u8.to(torch.int32)
    six = ((((c >> 7) & 1) << 5) | (((c >> 4) & 1) << 4) | (c & 0x0F)) & 0x3F
    v = six.view(c.shape[0], -1, 4)
    out = torch.stack([((v[..., 0] << 2) | (v[..., 1] >> 4)) & 0xFF,
                       ((v[..., 1] << 4) | (v[..., 2] >> 2)) & 0xFF,
                       ((v[..., 2] << 6) | v[..., 3]) & 0xFF], dim=-1)
    return out.view(c.shape[0], -1).to(torch.uint8)


def fuse_block_fp6(packed, scales, agg):
    cols = packed.shape[1] * 4 // 3
    w = _dequant_blockwise(fp6_unpack(packed, cols).view(E4M3), torch.from_numpy(scales))
    merged = w + agg.to(w.dtype)
    q, s = _quant_blockwise(merged, 0.1172)
    # the CUDA cast of 0 * inf (an all-zero block) is the positive NaN code 0x7F
    q8 = q.view(torch.uint8).clone()
    q8[torch.isnan(q.float())] = 0x7F
    return bits(fp6_pack(q8)), bits(s)


# ---- NVFP4 (quantization/nvfp4, ltx_kernels.nvfp4's CUDA kernels written out) ----

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float32)


def _e2m1_rne(x):
    """cvt.rn.satfinite.e2m1: nearest on the grid, ties to the even code, saturating at 6."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.int32)
    for c in range(1, 8):
        mid = float(E2M1[c - 1] + E2M1[c]) / 2
        code = torch.where((a > mid) | ((a == mid) & (c % 2 == 0)), torch.tensor(c), code)
    return code | torch.where(torch.signbit(x), 8, 0)


def _swizzled(rows, groups, padded_cols):
    r = torch.arange(rows)[:, None]
    c = torch.arange(groups)[None, :]
    tile = (r // 128) * (padded_cols // 4) + c // 4
    rr = r % 128
    return tile * 512 + (rr % 32) * 16 + (rr // 32) * 4 + c % 4


def fuse_nvfp4(packed, block_scales, scale_2, agg):
    rows, cols = packed.shape[0], packed.shape[1] * 2
    groups = cols // 16
    where = _swizzled(rows, groups, block_scales.shape[1])
    sf = torch.from_numpy(block_scales.reshape(-1).copy())[where].view(E4M3).to(torch.float32)
    pts = torch.tensor(float(np.float32(scale_2)), dtype=torch.float32)
    p = torch.from_numpy(packed).to(torch.int32)
    nib = torch.stack([p >> 4, p & 0xF], dim=-1).view(rows, cols)
    value = torch.where(nib >= 8, -E2M1[nib & 7], E2M1[nib & 7])
    total = pts * sf                                               # scale = pts * decode(sf)
    w = (value * total.repeat_interleave(16, dim=1)).to(torch.bfloat16)
    merged = w + agg.to(torch.bfloat16)
    m = merged.float()
    t = m.abs().nan_to_num().amax() * torch.tensor(1.0 / 2688.0, dtype=torch.float32)
    g = m.view(rows, groups, 16)
    top = g.abs().amax(dim=-1)
    s = torch.where(t > 0, torch.minimum((top / 6.0) / t, torch.tensor(448.0)), torch.zeros(()))
    s_code = s.to(E4M3)
    tot = t * s_code.to(torch.float32)
    inv = torch.where(tot > 0, 1.0 / torch.where(tot > 0, tot, torch.ones(())), torch.zeros(()))
    codes = _e2m1_rne(g * inv[:, :, None]).view(rows, cols)
    out = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    scales = torch.zeros(block_scales.size, dtype=torch.uint8)
    scales[where.reshape(-1)] = s_code.view(torch.uint8).reshape(-1)
    return bits(out), scales.numpy().reshape(block_scales.shape), bits(t)


# ---- ComfyUI per-tensor fp8, on the CPU (dequantise to f32, add, requantise) ----

def fuse_comfy_fp8(codes, scale, agg, fmt="F8_E4M3"):
    dtype = E4M3 if fmt == "F8_E4M3" else torch.float8_e5m2
    w = fp8_tensor(codes, fmt).to(torch.float32) * torch.from_numpy(np.asarray(scale, np.float32))
    w = _added(w, agg)
    new_scale = torch.amax(w.abs()).to(torch.float32) / torch.finfo(dtype).max
    lp = torch.finfo(dtype).max
    q = torch.clamp(w * (1 / new_scale).to(w.dtype), min=-lp, max=lp).to(dtype)
    return bits(q), bits(new_scale)


# ---- ComfyUI's nvfp4, mxfp8 and int8_tensorwise, on the CPU: comfy-kitchen's eager
# dequantisers into f32, the delta added in f32, its eager quantisers (the rounding ComfyUI's
# own quantize() uses without the stochastic noise), every step a torch f32 operation ----

def _added(w, deltas):
    """w plus a delta (a tensor), or plus each of several in turn (a list), in f32."""
    for d in deltas if isinstance(deltas, (list, tuple)) else [deltas]:
        w = w + d.to(torch.float32)
    return w


def comfy_deltas(adapters):
    """ComfyUI's deltas on the CPU: each adapter's product in f32 times its strength, added to
    the f32 weight in turn (none rounded to bf16)."""
    return [(s * torch.mm(bf16_tensor(b).float(), bf16_tensor(a).float())) for a, b, s in adapters]


def _tiled_index(rows, groups, padded_cols):
    """For each [rows, groups] block scale, its place in the flat tiled array (comfy-kitchen's
    to_blocked: 128-row x 4-column tiles, each stored as 32 x 16)."""
    return _swizzled(rows, groups, padded_cols)


def _untile(scales, rows, groups):
    flat = torch.from_numpy(np.ascontiguousarray(scales).reshape(-1).copy())
    return flat[_tiled_index(rows, groups, scales.shape[1])]


def _tile(values_u8, shape):
    out = torch.zeros(int(np.prod(shape)), dtype=torch.uint8)
    rows, groups = values_u8.shape
    out[_tiled_index(rows, groups, shape[1]).reshape(-1)] = values_u8.reshape(-1)
    return out.numpy().reshape(shape)


def comfy_nvfp4(packed, block_scales, scale_2, agg):
    rows, cols = packed.shape[0], packed.shape[1] * 2
    groups = cols // 16
    p = torch.from_numpy(packed).to(torch.int64)
    nib = torch.stack([p >> 4, p & 0xF], dim=-1).view(rows, cols)
    lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    values = lut[nib].view(rows, groups, 16)
    bs = _untile(block_scales, rows, groups).view(E4M3).to(torch.float32)
    pts = torch.tensor(float(np.float32(scale_2)), dtype=torch.float32)
    w = (values * (pts * bs).unsqueeze(-1)).view(rows, cols)          # dequantise, f32 out
    x = _added(w, agg)
    t = torch.amax(x.abs()) / (448.0 * 6.0)                            # ComfyUI's new scale_2
    blocks = x.view(rows, groups, 16)
    top = torch.amax(blocks.abs(), dim=-1)
    s = torch.clamp((top / 6.0) / t, max=448.0).to(E4M3)
    total = t * s.to(torch.float32)
    zero = total == 0
    scaled = blocks / torch.where(zero, torch.ones_like(total), total).unsqueeze(-1)
    scaled = torch.where(zero.unsqueeze(-1), torch.zeros_like(scaled), scaled)
    codes = _e2m1_rne(torch.clamp(scaled, -6.0, 6.0)).view(rows, cols)
    out = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    return bits(out), _tile(s.view(torch.uint8), block_scales.shape), bits(t)


def comfy_mxfp8(codes, block_scales, agg):
    rows, cols = codes.shape
    groups = cols // 32
    e = _untile(block_scales, rows, groups).to(torch.int32)
    scale = torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)
    q = fp8_tensor(codes).to(torch.float32).view(rows, groups, 32)
    w = (q * scale.unsqueeze(-1)).view(rows, cols)                     # dequantise, f32 out
    x = _added(w, agg).view(rows, groups, 32)
    top = torch.amax(x.abs(), dim=-1)
    needed = torch.clamp(top / 448.0, min=2.0 ** -127)
    e_new = torch.clamp(torch.ceil(torch.log2(needed)).to(torch.int32) + 127, 0, 254)
    step = torch.where(e_new == 0, torch.zeros_like(e_new), e_new << 23).view(torch.float32)
    zero = top == 0
    step = torch.where(zero, torch.ones_like(step), step)
    scaled = torch.where(zero.unsqueeze(-1), torch.zeros_like(x), x / step.unsqueeze(-1))
    out = torch.clamp(scaled, -448.0, 448.0).view(rows, cols).to(E4M3)
    e_new = torch.where(zero, torch.zeros_like(e_new), e_new)
    return bits(out), _tile(e_new.to(torch.uint8), block_scales.shape)


def comfy_int8(codes, scale, agg):
    s = torch.from_numpy(np.asarray(scale, np.float32).copy())
    w = torch.from_numpy(codes.copy()).float() * s                     # dequantise, f32 out
    x = _added(w, agg)
    if s.dim() > 0:   # ComfyUI requantises a scale with dimensions per row
        top = x.abs().amax(dim=-1, keepdim=True)
    else:
        top = x.abs().max()
    new = (top.float() / 127.0).clamp(min=1e-30)
    q = (x / new.to(x.dtype)).round().clamp(-128.0, 127.0).to(torch.int8)
    return q.numpy().copy(), new.numpy().copy()


# ---- the text feature extractor (text_encoders/gemma/feature_extractor.py), in the hidden
# states' dtype as upstream runs it ----

def features_v1(hidden, mask):
    """V1: per sample and layer, the masked mean and range over tokens x hidden dim;
    8 * (x - mean) / (range + 1e-6), padded positions zeroed; [B, T, D * L]."""
    b, t, d, l = hidden.shape
    m = mask.bool()[:, :, None, None]
    lengths = mask.sum(dim=-1)
    mean = hidden.masked_fill(~m, 0.0).sum(dim=(1, 2), keepdim=True) / (
        (lengths * d).view(b, 1, 1, 1) + 1e-6)
    lo = hidden.masked_fill(~m, float("inf")).amin(dim=(1, 2), keepdim=True)
    hi = hidden.masked_fill(~m, float("-inf")).amax(dim=(1, 2), keepdim=True)
    normed = (8 * (hidden - mean) / (hi - lo + 1e-6)).reshape(b, t, d * l)
    return normed.masked_fill(~mask.bool()[:, :, None], 0.0).to(hidden.dtype)


def features_v2(hidden, mask, out_features):
    """V2: per token, x * rsqrt(mean_d(x^2) + 1e-6), padded positions zeroed, cast to the
    hidden states' dtype, then rescaled by sqrt(out / D) for the projection."""
    b, t, d, l = hidden.shape
    normed = hidden * torch.rsqrt(torch.mean(hidden ** 2, dim=2, keepdim=True) + 1e-6)
    normed = normed.reshape(b, t, d * l)
    normed = torch.where(mask.bool()[:, :, None], normed, torch.zeros_like(normed))
    return normed.to(hidden.dtype) * math.sqrt(out_features / d)


# ---- ComfyUI's LoRA-family patches on the CPU (comfy/lora.py, weight_adapter): the weight in
# f32, the product in f32, scaled, added, cast back to the weight's dtype ----

def comfy_lora(weight, up, down, strength, alpha=None):
    w = bf16_tensor(weight).to(torch.float32)
    mat1, mat2 = bf16_tensor(up).to(torch.float32), bf16_tensor(down).to(torch.float32)
    scale = alpha / mat2.shape[0] if alpha is not None else 1.0
    diff = torch.mm(mat1, mat2)
    w += ((strength * scale) * diff).type(w.dtype)
    return bits(w.to(torch.bfloat16))


def comfy_lycoris_diff(kind, tensors):
    """A LoHa's or LoKr's f32 diff and its dim as ComfyUI's weight_adapter/loha.py and lokr.py
    compute them (the factors cast to f32, torch.mm, then the element-wise or Kronecker
    product); ``tensors`` by role name without the kind's prefix (w1_a, w1, ...), bf16 bits."""
    t = {k: bf16_tensor(v).to(torch.float32) for k, v in tensors.items()}
    if kind == "loha":
        return (torch.mm(t["w1_a"], t["w1_b"]) * torch.mm(t["w2_a"], t["w2_b"]),
                t["w1_b"].shape[0])
    dim = None
    w1 = t.get("w1")
    if w1 is None:
        dim = t["w1_b"].shape[0]
        w1 = torch.mm(t["w1_a"], t["w1_b"])
    w2 = t.get("w2")
    if w2 is None:
        dim = t["w2_b"].shape[0]
        w2 = torch.mm(t["w2_a"], t["w2_b"])
    return torch.kron(w1, w2), dim


def comfy_lycoris(weight, kind, tensors, strength, alpha=None):
    """ComfyUI's LoHa or LoKr patch on the CPU: the weight widened to f32,
    ``weight += (strength * (alpha / dim)) * diff`` (alpha / dim only with both), back to bf16."""
    w = bf16_tensor(weight).to(torch.float32)
    diff, dim = comfy_lycoris_diff(kind, tensors)
    scale = alpha / dim if alpha is not None and dim is not None else 1.0
    w += ((strength * scale) * diff.reshape(w.shape)).type(w.dtype)
    return bits(w.to(torch.bfloat16))


def comfy_diff(weight, diff, strength):
    w = bf16_tensor(weight).to(torch.float32)
    w += strength * bf16_tensor(diff).to(torch.float32)
    return bits(w.to(torch.bfloat16))


def comfy_dora(weight, up, down, dora_scale, strength, alpha=None):
    """weight_decompose: the norm on the output axis of the unpatched weight, on the input axis
    of the patched one, plus f32's eps; strength blends."""
    w = bf16_tensor(weight).to(torch.float32)
    mat1, mat2 = bf16_tensor(up).to(torch.float32), bf16_tensor(down).to(torch.float32)
    scale = alpha / mat2.shape[0] if alpha is not None else 1.0
    diff = torch.mm(mat1, mat2) * scale
    calc = w + diff
    m = torch.from_numpy(np.asarray(dora_scale, np.float32))
    if m.shape[0] == calc.shape[0]:
        norm = w.reshape(w.shape[0], -1).norm(dim=1, keepdim=True)
    else:
        norm = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True).transpose(0, 1)
    norm = norm + torch.finfo(w.dtype).eps
    calc *= (m / norm).type(w.dtype)
    if strength != 1.0:
        calc -= w
        w += strength * calc
    else:
        w[:] = calc
    return bits(w.to(torch.bfloat16))


def peft_dora(weight, lora_a, lora_b, magnitude, scaling):
    """PEFT's merge of a DoRA Linear, in the weight's dtype (bf16): delta = B @ A * scaling,
    norm of W + delta per output row, W' = (m / norm) * (W + delta)."""
    w = bf16_tensor(weight)
    delta = (bf16_tensor(lora_b) @ bf16_tensor(lora_a)) * scaling
    norm = torch.linalg.norm(w + delta, dim=1).to(w.dtype)
    factor = torch.from_numpy(np.asarray(magnitude, np.float32)).to(w.dtype) / norm
    return bits(factor.view(-1, 1) * (w + delta))
