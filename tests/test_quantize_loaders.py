"""What the owners' loaders make of ``ltx2blas quantize``'s output.

ComfyUI: its loader (``MixedPrecisionOps.Linear._load_from_state_dict``, comfy/ops.py) reads
each layer's ``comfy_quant`` marker, takes the format's layout from its ``QUANT_ALGOS`` table
(comfy/quant_ops.py) and builds comfy-kitchen's ``QuantizedTensor`` from ``weight``,
``weight_scale`` and ``weight_scale_2`` with the layer's logical (unpadded) shape and the
model's compute dtype; the layer's values are that tensor's ``dequantize()``.  Restated below
and run with comfy-kitchen 0.2.40 on the CPU (its eager backend), the dequantised layers are
compared with ltx2blas's own dequantisation rule of each layout (the first line of the
reference's fuse rules) and with the bf16 weights they were made from.

Upstream LTX-2 (ltx_core): its fp8 loader's discovery (a layer is fp8 where ``.weight`` is
F8_E4M3 and a ``.weight_scale`` sits beside it), the blockwise layout's shapes, and its
dequantisation of fp8_scaled (the fp8-cast fold), fp8_block and nvfp4 (its reference CUDA
dequantize kernel, transcribed into torch) against ``ltx2blas.quantized.dequantized``.
NVFP4 prequant discovery is tested in test_quantize_checkpoint.py.

The tests at the top need neither torch nor comfy-kitchen.
"""
import json

import numpy as np
import pytest

from ltx2blas import reference as ref
from ltx2blas.files.quantize import quantize_checkpoint
from ltx2blas.quantized import dequantized

from helpers import random_bf16
from test_quantize_checkpoint import B, P, model, read_all

F32 = np.float32
#: A Linear of the blocks whose sides are not whole groups of 16 or 32: ComfyUI pads it.
ODD = B + "audio_attn1.to_k.weight"
ODD_SHAPE = (40, 56)

# ComfyUI's QUANT_ALGOS (comfy/quant_ops.py, Comfy-Org/ComfyUI at cd9452e3), as far as the
# loader reads it: format name -> (storage dtype as safetensors names it, layout class).  The
# two fp8 layouts are ComfyUI's subclasses of comfy-kitchen's TensorCoreFP8Layout that change
# only how it quantises, so comfy-kitchen's class dequantises them.
QUANT_ALGOS = {
    "float8_e4m3fn": ("F8_E4M3", "TensorCoreFP8Layout"),
    "float8_e5m2": ("F8_E5M2", "TensorCoreFP8Layout"),
    "nvfp4": ("U8", "TensorCoreNVFP4Layout"),
    "mxfp8": ("F8_E4M3", "TensorCoreMXFP8Layout"),
    "int8_tensorwise": ("I8", "TensorWiseINT8Layout"),
    "convrot_w4a4": ("I8", "TensorCoreConvRotW4A4Layout"),
    "asym_w4a8_int8": ("I8", "AsymW4A8Int8Layout"),
}
#: (format, quantize_checkpoint keywords) for each of ComfyUI's formats ltx2blas writes.
COMFY_RUNS = [("comfy_fp8", {}), ("comfy_fp8", {"fp8_format": "F8_E5M2"}),
              ("comfy_nvfp4", {}), ("comfy_mxfp8", {}),
              ("comfy_int8", {}), ("comfy_int8", {"per_row": True})]
COMFY_IDS = ["fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp8", "int8", "int8_per_row"]


def up(n, m):
    return -(-n // m) * m


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small LTX-2-shaped bf16 model with one odd-shaped Linear, quantised once per run."""
    rng = np.random.default_rng(65)
    tmp = tmp_path_factory.mktemp("loaders")
    base = model(rng, tmp / "model.safetensors",
                 {ODD: ("BF16", random_bf16(rng, ODD_SHAPE, 0.02))})
    made = {}

    def make(fmt, **kw):
        key = (fmt, tuple(sorted(kw.items())))
        if key not in made:
            out = tmp / f"{fmt}-{len(made)}.safetensors"
            report = quantize_checkpoint(base, out, fmt, threads=1, digests=False, **kw)
            made[key] = (out, report)
        return made[key]

    make.base = base
    return make


def layers(report):
    return [name[: -len(".weight")] for name in report.quantized]


# ---------------------------------------------------------------- without torch

@pytest.mark.parametrize("fmt,kw", COMFY_RUNS, ids=COMFY_IDS)
def test_comfyui_reads_each_marker_and_finds_its_tensors(files, fmt, kw):
    """The loader's reading of a marker, restated: json.loads of the U8 bytes, "format" a name
    of QUANT_ALGOS, no other field it would act on; beside it the tensors the format's branch
    loads, in the dtypes it loads them as (the weight as the storage dtype; nvfp4's block
    scales viewed as e4m3, mxfp8's as uint8 then E8M0; the fp8 and int8 scales as f32)."""
    out, report = files(fmt, **kw)
    tensors, _ = read_all(out)
    shapes = {n: v[1] for n, v in read_all(files.base)[0].items()}
    assert ODD in report.quantized
    for stem in layers(report):
        assert stem.startswith(P)   # detect_layer_quantization looks under the model prefix
        dtype, shape, marker = tensors[stem + ".comfy_quant"]
        assert dtype == "U8" and len(shape) == 1
        conf = json.loads(marker.tobytes())
        assert set(conf) == {"format"}   # no full_precision_matrix_mult, no convrot
        name = conf["format"]
        assert name in QUANT_ALGOS
        assert name == {"comfy_fp8": "float8_" + ("e5m2" if kw else "e4m3fn"),
                        "comfy_nvfp4": "nvfp4", "comfy_mxfp8": "mxfp8",
                        "comfy_int8": "int8_tensorwise"}[fmt]
        rows, cols = shapes[stem + ".weight"]   # the layer's logical shape
        w_dtype, w_shape, _ = tensors[stem + ".weight"]
        assert w_dtype == QUANT_ALGOS[name][0]
        s_dtype, s_shape, scale = tensors[stem + ".weight_scale"]
        if name.startswith("float8"):
            assert w_shape == (rows, cols) and (s_dtype, s_shape) == ("F32", ())
        elif name == "int8_tensorwise":
            assert w_shape == (rows, cols) and s_dtype == "F32"
            assert s_shape == ((rows, 1) if kw else ())
        elif name == "nvfp4":
            r16, c16 = up(rows, 16), up(cols, 16)
            assert w_shape == (r16, c16 // 2)
            assert (s_dtype, s_shape) == ("F8_E4M3", (up(r16, 128), up(c16 // 16, 4)))
            assert tensors[stem + ".weight_scale_2"][:2] == ("F32", ())
        else:
            r32, c32 = up(rows, 32), up(cols, 32)
            assert w_shape == (r32, c32)
            assert (s_dtype, s_shape) == ("U8", (up(r32, 128), up(c32 // 32, 4)))
            assert not np.any(scale == 0xFF)   # E8M0's NaN
        assert stem + ".input_scale" not in tensors   # optional for every format


def test_upstream_fp8_discovery_and_blockwise_shapes(files):
    """ltx_core's fp8 loader (fp8_scaled_mm.get_fp8_swap_module_ops): a layer is fp8 where
    ``<L>.weight`` is F8_E4M3 in the header and ``<L>.weight_scale`` exists; FP8Linear's
    weight_scale is an f32 of shape ().  Its blockwise layout: an F8_E4M3 ``[out, in]`` weight
    and an F32 ``[out / 128, in / 128]`` weight_scale.  Neither is marked for ComfyUI."""
    for fmt in ("fp8_scaled", "fp8_block"):
        out, report = files(fmt)
        tensors, _ = read_all(out)
        found = {k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale")
                 and tensors.get(k[: -len(".weight_scale")] + ".weight", ("",))[0] == "F8_E4M3"}
        assert found == set(layers(report)) and found
        for stem in found:
            dtype, shape, _ = tensors[stem + ".weight"]
            s_dtype, s_shape, scale = tensors[stem + ".weight_scale"]
            assert s_dtype == "F32"
            if fmt == "fp8_scaled":
                assert s_shape == ()
            else:
                assert shape[0] % 128 == 0 and shape[1] % 128 == 0
                assert s_shape == (shape[0] // 128, shape[1] // 128)
            assert np.all(np.isfinite(scale)) and np.all(scale > 0)
            assert stem + ".comfy_quant" not in tensors
        # every other F8_E4M3 tensor would be a weight without its scale: there is none
        assert {k[: -len(".weight")] for k, v in tensors.items()
                if k.endswith(".weight") and v[0] == "F8_E4M3"} == found
        assert ODD not in report.quantized or fmt == "fp8_scaled"


# ---------------------------------------------------------------- with torch and comfy-kitchen

def _torch():
    return pytest.importorskip("torch", reason="the owners' loaders run in torch")


@pytest.fixture
def eager():
    _torch()
    ck = pytest.importorskip("comfy_kitchen", reason="comfy-kitchen is not installed")
    with ck.use_backend("eager"):
        yield ck


def load_torch(path):
    """The file as ComfyUI's load_torch_file reads a .safetensors: safetensors' torch loader."""
    _torch()
    st = pytest.importorskip("safetensors.torch")
    return st.load_file(str(path))


def comfy_layer(sd, stem, logical_shape, compute_dtype):
    """ComfyUI's loader for one layer, restated: the marker's format, QUANT_ALGOS' layout,
    the format's Params from the stored tensors, orig_shape the layer's (out, in) and
    orig_dtype the model's compute dtype; returns the QuantizedTensor."""
    torch = _torch()
    from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
    conf = json.loads(sd[stem + ".comfy_quant"].numpy().tobytes())
    name = conf["format"]
    storage = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
               "U8": torch.uint8, "I8": torch.int8}[QUANT_ALGOS[name][0]]
    layout = QUANT_ALGOS[name][1]
    cls = get_layout_class(layout)
    common = {"orig_dtype": compute_dtype, "orig_shape": tuple(logical_shape)}
    if name.startswith("float8") or name == "int8_tensorwise":
        params = cls.Params(scale=sd[stem + ".weight_scale"].float(), **common)
    elif name == "nvfp4":
        params = cls.Params(scale=sd[stem + ".weight_scale_2"],
                            block_scale=sd[stem + ".weight_scale"].view(torch.float8_e4m3fn),
                            **common)
    else:   # mxfp8: the U8 exponents viewed as E8M0
        params = cls.Params(scale=sd[stem + ".weight_scale"].view(torch.uint8).view(
            torch.float8_e8m0fnu), **common)
    return QuantizedTensor(sd[stem + ".weight"].to(dtype=storage), layout, params)


def ltx2blas_rule(fmt, weight, scale, scale_2, fp8_format):
    """ltx2blas's dequantisation of each of ComfyUI's layouts, the first line of its fuse rule
    (reference.fuse_scaled_fp8, fuse_comfy_nvfp4, fuse_comfy_mxfp8, fuse_comfy_int8), in f32,
    over the stored (padded) shape:
        comfy_fp8    w = f32(f32(code) * scale)
        comfy_nvfp4  w = f32(e2m1 * f32(scale_2 * f32(block scale)))
        comfy_mxfp8  w = f32(f32(code) * 2^(e - 127))
        comfy_int8   w = f32(f32(code) * scale)        (scale per tensor or per row)"""
    if fmt == "comfy_fp8":
        return ref.fp8_widen(weight, fp8_format) * F32(scale)
    if fmt == "comfy_nvfp4":
        rows, groups = weight.shape[0], weight.shape[1] * 2 // 16
        bs = ref.fp8_widen(ref.from_tiled(scale, rows, groups), "F8_E4M3")
        return ref.e2m1_widen(ref.nvfp4_unpack(weight)) * np.repeat(F32(scale_2) * bs, 16, 1)
    if fmt == "comfy_mxfp8":
        rows, groups = weight.shape[0], weight.shape[1] // 32
        e = ref.e8m0_widen(ref.from_tiled(scale, rows, groups))
        return ref.fp8_widen(weight, "F8_E4M3") * np.repeat(e, 32, 1)
    return ref.bits(weight, np.int8).astype(F32) * np.asarray(scale, F32)


def comfy_bf16_nvfp4(weight, scale, scale_2):
    """comfy-kitchen's eager dequantize_nvfp4 into bf16, restated: every step in bf16,
    total = bf16(bf16(scale_2) * bf16(block scale)), w = bf16(e2m1 * total)."""
    rows, groups = weight.shape[0], weight.shape[1] * 2 // 16
    bs = ref.fp8_widen(ref.from_tiled(scale, rows, groups), "F8_E4M3")
    total = ref.bf16_widen(ref.bf16_round(ref.bf16_widen(ref.bf16_round(F32(scale_2))) * bs))
    return ref.bf16_round(ref.e2m1_widen(ref.nvfp4_unpack(weight)) * np.repeat(total, 16, 1))


def code_gap(fmt, fp8_format, codes_value):
    """Per element, the larger distance from the code's value to a neighbouring code of the
    format's grid (the step above it, or below it at the grid's top)."""
    if fmt == "comfy_int8":
        return np.ones_like(codes_value)
    if fmt == "comfy_nvfp4":
        grid = ref.E2M1_VALUES.astype(np.float64)
    else:
        f = fp8_format if fmt == "comfy_fp8" else "F8_E4M3"
        v = ref.fp8_widen(np.arange(256, dtype=np.uint8), f).astype(np.float64)
        grid = np.unique(np.abs(v[np.isfinite(v)]))
    gaps = np.append(np.diff(grid), np.diff(grid)[-1])
    return gaps[np.searchsorted(grid, np.abs(codes_value.astype(np.float64)))]


def element_scale(fmt, weight, scale, scale_2):
    """Per element of the stored shape, the factor a code is multiplied by."""
    if fmt == "comfy_nvfp4":
        rows, groups = weight.shape[0], weight.shape[1] * 2 // 16
        bs = ref.fp8_widen(ref.from_tiled(scale, rows, groups), "F8_E4M3")
        return np.repeat(F32(scale_2) * bs, 16, 1), ref.e2m1_widen(ref.nvfp4_unpack(weight))
    if fmt == "comfy_mxfp8":
        rows, groups = weight.shape
        groups //= 32
        e = ref.e8m0_widen(ref.from_tiled(scale, rows, groups))
        return np.repeat(e, 32, 1), ref.fp8_widen(weight, "F8_E4M3")
    if fmt == "comfy_int8":
        codes = ref.bits(weight, np.int8).astype(F32)
        return np.broadcast_to(np.asarray(scale, F32), codes.shape), codes
    return None, None


@pytest.mark.parametrize("fmt,kw", COMFY_RUNS, ids=COMFY_IDS)
def test_comfyui_loader_reconstructs_each_layer(eager, files, fmt, kw):
    """Each quantised layer built as ComfyUI's loader builds it and dequantised by
    comfy-kitchen: in f32 (the dtype ComfyUI's LoRA patching casts a weight to before it
    dequantises it) byte for byte ltx2blas's rule; in bf16 (the loader's orig_dtype, what a
    forward pass that falls back to dequantising uses) byte for byte that rule rounded to bf16,
    except nvfp4, where comfy-kitchen rounds the block's total scale to bf16 first (its own
    double rounding, restated in comfy_bf16_nvfp4 and compared with that); and within the
    format's rounding of the bf16 weight it was made from."""
    torch = _torch()
    fp8_format = kw.get("fp8_format", "F8_E4M3")
    out, report = files(fmt, **kw)
    sd = load_torch(out)
    base = load_torch(files.base)
    stored, _ = read_all(out)
    nvfp4_double_rounding = 0
    for stem in layers(report):
        original = base[stem + ".weight"]
        rows, cols = original.shape
        qt = comfy_layer(sd, stem, (rows, cols), torch.bfloat16)
        assert tuple(qt.shape) == (rows, cols) and qt.dtype == torch.bfloat16
        as_bf16 = qt.dequantize()
        as_f32 = qt.to(torch.float32).dequantize()
        assert as_bf16.dtype == torch.bfloat16 and as_f32.dtype == torch.float32
        assert tuple(as_f32.shape) == (rows, cols)

        weight = stored[stem + ".weight"][2]
        scale = stored[stem + ".weight_scale"][2]
        scale_2 = stored[stem + ".weight_scale_2"][2] if fmt == "comfy_nvfp4" else None
        mine = ltx2blas_rule(fmt, weight, scale, scale_2, fp8_format)[:rows, :cols]
        assert mine.dtype == F32
        assert np.array_equal(as_f32.numpy().view(np.uint32), mine.view(np.uint32)), stem
        theirs = as_bf16.view(torch.int16).numpy().view(np.uint16)
        if fmt == "comfy_nvfp4":
            want = comfy_bf16_nvfp4(weight, scale, scale_2)[:rows, :cols]
            assert np.array_equal(theirs, want), stem
            # ltx2blas's f32 rule rounded once differs from that by at most one bf16 step
            once = ref.bf16_round(mine)
            step = np.abs(once.astype(np.int32) - theirs.astype(np.int32))
            assert step.max() <= 1, stem
            nvfp4_double_rounding += int(np.count_nonzero(step))
        else:
            assert np.array_equal(theirs, ref.bf16_round(mine)), stem

        # Against the bf16 weight.  With c a code's value and s the factor it is multiplied by
        # (per tensor, per 16- or 32-block, per row), nearest rounding of w / s leaves
        # |w / s - c| at most half the gap from c to a neighbouring code, which is at most the
        # larger of the gaps around c (code_gap), so |w - c * s| <= s * gap / 2.  The owners
        # reach w / s through roundings of their own (comfy-kitchen divides by a bf16 scale and
        # rounds the quotient to bf16 for fp8 and int8; nvfp4's block scale is an e4m3
        # rounding, a quotient just past the grid's top is clamped), each at most a relative
        # 2^-8 of w, so the bound allows |w| * 2^-6 more.
        w = ref.bf16_widen(original.view(torch.int16).numpy().view(np.uint16))
        s, c = element_scale(fmt, weight, scale, scale_2)
        if s is None:   # per-tensor fp8
            c = ref.fp8_widen(weight, fp8_format)
            s = np.full(c.shape, F32(scale))
        s, c = s[:rows, :cols], c[:rows, :cols]
        bound = s.astype(np.float64) * code_gap(fmt, fp8_format, c) / 2 + np.abs(w) * 2.0 ** -6
        err = np.abs(w.astype(np.float64) - mine.astype(np.float64))
        assert np.all(err <= bound), (stem, float(np.max(err - bound)))
        assert np.max(err) > 0   # quantising did lose something: the test compares values
    if fmt == "comfy_nvfp4":
        # comfy-kitchen's bf16 total scale (12 significant bits rounded to 8) does change
        # elements here; recorded so that a change in it shows
        assert nvfp4_double_rounding > 0


# ---------------------------------------------------------------- upstream's dequantisation (torch)

def upstream_fp8_cast(codes, scale):
    """ltx_core/quantization/fp8_cast.py, the fold of a prequant scale into its weight:
    ``(value.to(torch.float32) * scale).to(torch.bfloat16)``."""
    torch = _torch()
    return (codes.to(torch.float32) * scale).to(torch.bfloat16)


def upstream_blockwise_dequantize(codes, scales):
    """The blockwise fp8 dequantisation upstream's fuse reads (_blockwise_dequantize_2d), per
    element bf16(f32(code) * scale[block])."""
    torch = _torch()
    full = scales.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return (codes.to(torch.float32) * full).to(torch.bfloat16)


def upstream_nvfp4_dequantize(packed, scale_2, tiled):
    """ltx-kernels csrc/nvfp4/quantize.cu, dequantize_kernel (Lightricks/LTX-2 at 400fd310), the
    arithmetic of each line in f32 torch: scale = pts * e4m3_decode(scales[swizzled_offset]);
    the E2M1 pair of each byte, element 2j from the high nibble (hi_first);
    out = bf16(f32(value * scale))."""
    torch = _torch()
    rows, groups = packed.shape[0], packed.shape[1] * 2 // 16
    pcols = tiled.shape[1]
    r = torch.arange(rows)[:, None]
    c = torch.arange(groups)[None, :]
    tile = (r >> 7) * (pcols >> 2) + (c >> 2)
    rr = r & 127
    offset = tile * 512 + (rr & 31) * 16 + (rr >> 5) * 4 + (c & 3)
    sf = tiled.view(torch.uint8).reshape(-1)[offset.reshape(-1)].view(torch.float8_e4m3fn)
    scale = scale_2.float().reshape(()) * sf.float().view(rows, groups)
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    nib = torch.stack([packed >> 4, packed & 0xF], dim=-1).view(rows, -1).long()
    values = e2m1[nib].view(rows, groups, 16)
    return (values * scale[..., None]).view(rows, -1).to(torch.bfloat16)


def positive_zero(bits16):
    """-0.0 as +0.0: ``dequantized`` adds a +0.0 delta, as a fuse does (its docstring)."""
    return np.where(bits16 == 0x8000, np.uint16(0), bits16)


def test_upstream_dequantises_our_output_as_ltx2blas_does(files):
    """fp8_scaled folded as fp8-cast folds it, fp8_block and nvfp4 dequantised as upstream's
    code does, each equal to ltx2blas's dequantisation (``dequantized``) bit for bit, -0.0
    read as +0.0."""
    torch = _torch()
    for fmt in ("fp8_scaled", "fp8_block", "nvfp4"):
        out, report = files(fmt)
        sd = load_torch(out)
        stored, _ = read_all(out)
        for stem in layers(report):
            codes = sd[stem + ".weight"]
            scale = sd[stem + ".weight_scale"]
            w = stored[stem + ".weight"][2]
            s = stored[stem + ".weight_scale"][2]
            if fmt == "fp8_scaled":
                assert codes.dtype == torch.float8_e4m3fn and scale.shape == ()
                theirs = upstream_fp8_cast(codes, scale)
                # ltx2blas's per-tensor rule: bf16(f32(code) * scale); and, where the
                # weight is made of 128 x 128 blocks, dequantized with that scale in each
                mine = ref.bf16_round(ref.fp8_widen(w, "F8_E4M3") * F32(s))
                rows, cols = w.shape
                if rows % 128 == 0 and cols % 128 == 0:
                    blocks = np.full((rows // 128, cols // 128), F32(s))
                    also = dequantized("fp8_block", w, scale=blocks, threads=1)
                    assert np.array_equal(positive_zero(mine), also)
            elif fmt == "fp8_block":
                theirs = upstream_blockwise_dequantize(codes, scale)
                mine = dequantized("fp8_block", w, scale=s, threads=1)
            else:
                assert codes.dtype == torch.uint8
                assert scale.dtype == torch.float8_e4m3fn
                scale_2 = sd[stem + ".weight_scale_2"]
                theirs = upstream_nvfp4_dequantize(codes, scale_2, scale)
                mine = dequantized("nvfp4", w, scale=s,
                                   scale_2=stored[stem + ".weight_scale_2"][2], threads=1)
            theirs = theirs.view(torch.int16).numpy().view(np.uint16)
            assert np.array_equal(positive_zero(theirs), positive_zero(mine)), (fmt, stem)


# ---------------------------------------------------- reading a quantised base back to bf16

@pytest.mark.parametrize("fmt,kw", COMFY_RUNS, ids=COMFY_IDS)
def test_dequantize_bf16_is_comfyuis_own_dequantisation(eager, files, fmt, kw):
    """quantized.dequantize_bf16, how `ltx2blas quantize` reads a ComfyUI layer back before
    quantising it anew, is byte for byte comfy-kitchen's dequantisation to the model's bf16
    (the layer as ComfyUI's loader builds it)."""
    torch = _torch()
    from ltx2blas.quantized import dequantize_bf16
    out, report = files(fmt, **kw)
    sd = load_torch(out)
    stored, _ = read_all(out)
    for stem in layers(report):
        w = stored[stem + ".weight"][2]
        rows, cols = load_torch(files.base)[stem + ".weight"].shape
        theirs = comfy_layer(sd, stem, (rows, cols), torch.bfloat16).dequantize()
        theirs = theirs.view(torch.int16).numpy().view(np.uint16)
        mine = dequantize_bf16(fmt, w, scale=stored[stem + ".weight_scale"][2],
                               scale_2=stored[stem + ".weight_scale_2"][2]
                               if fmt == "comfy_nvfp4" else None,
                               fmt=kw.get("fp8_format"))[:rows, :cols]
        assert np.array_equal(theirs, mine), stem


def test_dequantize_bf16_is_upstreams_own_dequantisation(files):
    """The same for upstream's layouts: fp8_scaled as its fp8 cast folds it, fp8_block and
    nvfp4 as its code dequantises them (-0.0 read as +0.0 where the rule adds +0.0)."""
    torch = _torch()
    from ltx2blas.quantized import dequantize_bf16
    for fmt in ("fp8_scaled", "fp8_block", "nvfp4"):
        out, report = files(fmt)
        sd = load_torch(out)
        stored, _ = read_all(out)
        for stem in layers(report):
            codes, scale = sd[stem + ".weight"], sd[stem + ".weight_scale"]
            w, s = stored[stem + ".weight"][2], stored[stem + ".weight_scale"][2]
            s2 = stored[stem + ".weight_scale_2"][2] if fmt == "nvfp4" else None
            theirs = (upstream_fp8_cast(codes, scale) if fmt == "fp8_scaled" else
                      upstream_blockwise_dequantize(codes, scale) if fmt == "fp8_block" else
                      upstream_nvfp4_dequantize(codes, sd[stem + ".weight_scale_2"], scale))
            theirs = theirs.view(torch.int16).numpy().view(np.uint16)
            mine = dequantize_bf16(fmt, w, scale=s, scale_2=s2)
            assert np.array_equal(positive_zero(theirs), positive_zero(mine)), (fmt, stem)
