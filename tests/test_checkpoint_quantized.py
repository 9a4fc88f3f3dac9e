"""Checkpoints whose weights are stored in scaled or quantised layouts: every layout is found
from the tensors beside the weight, fused by its rule (byte-identical to reference.fuse_quantized),
its scales rewritten, everything else copied; layouts that cannot be fused are refused, naming
the tensor, before anything is written."""
import json

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16
from test_quantized import block_case, int8_case, mxfp8_case, nvfp4_case, per_tensor_case

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
B0 = "transformer_blocks.0."
SHAPE = (256, 384)


def read_all(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}, f.metadata, list(f.tensors)


def lora(rng, modules, rank=8, shape=SHAPE, prefix="diffusion_model."):
    out = {}
    for m in modules:
        out[prefix + m + ".lora_A.weight"] = ("BF16", random_bf16(rng, (rank, shape[1]), 0.03))
        out[prefix + m + ".lora_B.weight"] = ("BF16", random_bf16(rng, (shape[0], rank), 0.03))
    return out


def factors(ad, module, strength, prefix="diffusion_model."):
    return (ad[prefix + module + ".lora_A.weight"][1], ad[prefix + module + ".lora_B.weight"][1],
            strength)


def ltx_model(rng):
    """One weight per upstream layout, with the companions its files carry."""
    t = {}
    codes, scale = per_tensor_case(rng)
    t[M + B0 + "attn1.to_q.weight"] = ("F8_E4M3", codes)
    t[M + B0 + "attn1.to_q.weight_scale"] = ("F32", scale.reshape(()))
    t[M + B0 + "attn1.to_q.input_scale"] = ("F32", np.array(0.25, np.float32))
    codes, scales = block_case(rng)
    t[M + B0 + "attn1.to_k.weight"] = ("F8_E4M3", codes)
    t[M + B0 + "attn1.to_k.weight_scale"] = ("F32", scales)
    packed, scales = block_case(rng, fp6=True)
    t[M + B0 + "attn1.to_v.weight"] = ("U8", packed)
    t[M + B0 + "attn1.to_v.weight_scale"] = ("F32", scales)
    packed, block, s2 = nvfp4_case(rng)
    t[M + B0 + "ff.net.2.weight"] = ("U8", packed)
    t[M + B0 + "ff.net.2.weight_scale"] = ("F8_E4M3", block)
    t[M + B0 + "ff.net.2.weight_scale_2"] = ("F32", s2.reshape(()))
    t[M + B0 + "ff.net.2.input_scale"] = ("F32", np.array(3.5, np.float32))
    t[M + B0 + "attn2.to_q.weight"] = ("BF16", random_bf16(rng, SHAPE, 0.02))
    t[M + B0 + "attn2.to_k.weight"] = ("F8_E4M3", per_tensor_case(rng)[0])
    t[M + "norm_out.weight"] = ("F32", rng.standard_normal(48).astype(np.float32))
    return t


EXPECT = {"attn1.to_q": ("fp8_scaled", ["weight_scale"]), "attn1.to_k": ("fp8_block", ["weight_scale"]),
          "attn1.to_v": ("fp6_block", ["weight_scale"]),
          "ff.net.2": ("nvfp4", ["weight_scale", "weight_scale_2"])}


@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_every_upstream_layout_is_fused_by_its_rule(tmp_path, rng, rule):
    model = ltx_model(rng)
    modules = [B0 + m for m in list(EXPECT) + ["attn2.to_q", "attn2.to_k"]]
    a1, a2 = lora(rng, modules, 8), lora(rng, modules[:3] + modules[4:], 40)
    ck.write(tmp_path / "m.safetensors", model)
    ck.write(tmp_path / "a1.safetensors", a1)
    ck.write(tmp_path / "a2.safetensors", a2)
    report = ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors",
                                      [(tmp_path / "a1.safetensors", 0.8), (tmp_path / "a2.safetensors", -1.2)],
                                      tmp_path / "out.safetensors", rule=rule, threads=2)
    out, meta, order = read_all(tmp_path / "out.safetensors")
    assert sorted(order) == sorted(model)
    for short, (layout, scale_names) in EXPECT.items():
        m = B0 + short
        ads = [factors(a1, m, 0.8)] + ([factors(a2, m, -1.2)] if m in modules[:3] + modules[4:] else [])
        scales = tuple(model[M + m + "." + n][1] for n in scale_names)
        expected = reference.fuse_quantized(layout, model[M + m + ".weight"][1], scales, ads, rule)
        assert np.array_equal(out[M + m + ".weight"], expected[0]), m
        for n, want in zip(scale_names, expected[1:]):
            got = out[M + m + "." + n]
            assert got.shape == model[M + m + "." + n][1].shape
            assert np.array_equal(got.reshape(-1).view(np.uint8),
                                  np.asarray(want, got.dtype).reshape(-1).view(np.uint8)), (m, n)
            # rewritten scales come right after their weight
            assert order.index(M + m + "." + n) > order.index(M + m + ".weight")
    q2 = B0 + "attn2.to_q"
    assert np.array_equal(out[M + q2 + ".weight"], reference.fuse_loras(
        model[M + q2 + ".weight"][1], [factors(a1, q2, 0.8), factors(a2, q2, -1.2)], rule))
    k2 = B0 + "attn2.to_k"
    assert np.array_equal(out[M + k2 + ".weight"], reference.fuse_loras_fp8(
        model[M + k2 + ".weight"][1], [factors(a1, k2, 0.8), factors(a2, k2, -1.2)], "F8_E4M3", rule))
    for name in (M + B0 + "attn1.to_q.input_scale", M + B0 + "ff.net.2.input_scale", M + "norm_out.weight"):
        assert np.array_equal(out[name], model[name][1])
    assert report.layouts == {"fp8_scaled": 1, "fp8_block": 1, "fp6_block": 1, "nvfp4": 1,
                              "bf16": 1, "fp8 (F8_E4M3)": 1}
    assert meta["ltx2blas.rule"].startswith(rule + ":")
    assert json.loads(meta["ltx2blas.layouts"])["nvfp4"] == 1
    assert "nvfp4" in report.summary() and f"{rule} rule" in report.summary()
    from safetensors import safe_open  # the reference reader takes the output
    with safe_open(str(tmp_path / "out.safetensors"), framework="np") as f:
        assert set(f.keys()) == set(model)


def comfy_model(rng, style):
    t = {}
    codes, scale = per_tensor_case(rng)
    codes5, scale5 = per_tensor_case(rng, "F8_E5M2")
    if style == "old":
        t[M + "scaled_fp8"] = ("F8_E4M3", np.zeros(2, np.uint8))
        t[M + B0 + "attn1.to_q.scale_weight"] = ("F32", scale)
        t[M + B0 + "attn1.to_k.scale_weight"] = ("F32", scale5)
        t[M + B0 + "attn1.to_q.scale_input"] = ("F32", np.array(1.5, np.float32))
    else:
        t[M + B0 + "attn1.to_q.weight_scale"] = ("F32", scale)
        t[M + B0 + "attn1.to_k.weight_scale"] = ("F32", scale5)
    t[M + B0 + "attn1.to_q.weight"] = ("F8_E4M3", codes)
    t[M + B0 + "attn1.to_k.weight"] = ("F8_E5M2", codes5)
    meta = None
    if style == "tensor":
        for m, fmt in (("attn1.to_q", "float8_e4m3fn"), ("attn1.to_k", "float8_e5m2")):
            raw = np.frombuffer(json.dumps({"format": fmt}).encode(), np.uint8).copy()
            t[M + B0 + m + ".comfy_quant"] = ("U8", raw)
    elif style == "metadata":
        meta = {"_quantization_metadata": json.dumps({"layers": {
            M + B0 + "attn1.to_q": {"format": "float8_e4m3fn"},
            B0 + "attn1.to_k": {"format": "float8_e5m2"}}})}
    return t, meta


@pytest.mark.parametrize("style", ["old", "tensor", "metadata"])
def test_comfy_scaled_fp8(tmp_path, rng, style):
    model, meta = comfy_model(rng, style)
    modules = [B0 + "attn1.to_q", B0 + "attn1.to_k"]
    ad = lora(rng, modules, 16)
    ck.write(tmp_path / "m.safetensors", model, meta)
    ck.write(tmp_path / "a.safetensors", ad)
    report = ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors", [(tmp_path / "a.safetensors", 1.1)],
                                      tmp_path / "out.safetensors")
    out, _, _ = read_all(tmp_path / "out.safetensors")
    scale_name = "scale_weight" if style == "old" else "weight_scale"
    for m, fmt in zip(modules, ("F8_E4M3", "F8_E5M2")):
        scale = model[M + m + "." + scale_name][1]
        codes, new_scale = reference.fuse_quantized("comfy_fp8", model[M + m + ".weight"][1], (scale,),
                                                    [factors(ad, m, 1.1)], fmt=fmt)
        assert np.array_equal(out[M + m + ".weight"], codes)
        assert out[M + m + "." + scale_name].view(np.uint32) == np.float32(new_scale).view(np.uint32)
    assert report.layouts == {"comfy_fp8": 2}
    for name in model:  # markers and input scales copied
        if not name.endswith((".weight", scale_name)):
            assert np.array_equal(out[name], model[name][1])


def _refused(tmp_path, model, ad, match, error=errors.DTypeError, **kwargs):
    ck.write(tmp_path / "m.safetensors", model)
    ck.write(tmp_path / "a.safetensors", ad)
    with pytest.raises(error, match=match):
        ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors", [(tmp_path / "a.safetensors", 1.0)],
                                 tmp_path / "out.safetensors", **kwargs)
    assert not (tmp_path / "out.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors", "a.safetensors"] or \
        sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "m.safetensors"]


def marker(conf):
    return ("U8", np.frombuffer(json.dumps(conf).encode(), np.uint8).copy())


def write_entries(path, tensors, metadata=None):
    """Write with the library's writer, which takes every safetensors dtype name (F8_E8M0 too)."""
    from ltx2blas.files.safetensors import SafetensorsWriter

    entries = [(n, d, np.shape(v), np.asarray(v).nbytes) for n, (d, v) in tensors.items()]
    with SafetensorsWriter(path, entries, metadata) as w:
        for n, (_, v) in tensors.items():
            w.write(n, np.ascontiguousarray(v))
        w.commit()
    return path


def comfy_quantised_model(rng):
    """A ComfyUI checkpoint with one layer in each format its comfy_quant markers name beyond
    per-tensor fp8: nvfp4, mxfp8 (E8M0 scales as F8_E8M0), int8 with one scale and per row."""
    t = {}
    packed, block, s2 = nvfp4_case(rng)
    t[M + B0 + "ff.net.2.weight"] = ("U8", packed)
    t[M + B0 + "ff.net.2.weight_scale"] = ("F8_E4M3", block)
    t[M + B0 + "ff.net.2.weight_scale_2"] = ("F32", s2.reshape(()))
    t[M + B0 + "ff.net.2.input_scale"] = ("F32", np.array(2.0, np.float32))
    t[M + B0 + "ff.net.2.comfy_quant"] = marker({"format": "nvfp4"})
    codes, mx = mxfp8_case(rng)
    t[M + B0 + "attn1.to_q.weight"] = ("F8_E4M3", codes)
    t[M + B0 + "attn1.to_q.weight_scale"] = ("F8_E8M0", mx)
    t[M + B0 + "attn1.to_q.comfy_quant"] = marker({"format": "mxfp8"})
    for m, per_row in (("attn1.to_k", False), ("attn1.to_v", True)):
        q, scale = int8_case(rng, per_row)
        t[M + B0 + m + ".weight"] = ("I8", q)
        t[M + B0 + m + ".weight_scale"] = ("F32", scale)
        t[M + B0 + m + ".comfy_quant"] = marker({"format": "int8_tensorwise"})
    return t


COMFY_EXPECT = {"ff.net.2": ("comfy_nvfp4", ["weight_scale", "weight_scale_2"]),
                "attn1.to_q": ("comfy_mxfp8", ["weight_scale"]),
                "attn1.to_k": ("comfy_int8", ["weight_scale"]),
                "attn1.to_v": ("comfy_int8", ["weight_scale"])}


def test_comfy_quantised_formats(tmp_path, rng):
    """nvfp4, mxfp8 and int8_tensorwise layers of a ComfyUI checkpoint fused by ComfyUI's rules
    (reference.fuse_comfy_*), two adapters, their scales rewritten in their shapes and dtypes,
    the markers and input scales copied; fuse_state_dict the same in place."""
    model = comfy_quantised_model(rng)
    modules = [B0 + m for m in COMFY_EXPECT]
    a1, a2 = lora(rng, modules, 8), lora(rng, modules, 24)
    write_entries(tmp_path / "m.safetensors", model)
    ck.write(tmp_path / "a1.safetensors", a1)
    ck.write(tmp_path / "a2.safetensors", a2)
    loras = [(tmp_path / "a1.safetensors", 0.7), (tmp_path / "a2.safetensors", -1.1)]
    report = ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors", loras,
                                      tmp_path / "out.safetensors", threads=2)
    assert report.layouts == {"comfy_nvfp4": 1, "comfy_mxfp8": 1, "comfy_int8": 2}
    with SafetensorsFile(tmp_path / "out.safetensors") as f:
        dtypes = {n: (i.dtype, i.shape) for n, i in f.tensors.items()}
    assert dtypes == {n: (d, tuple(np.shape(v))) for n, (d, v) in model.items()}
    out, _, _ = read_all(tmp_path / "out.safetensors")
    import ml_dtypes

    state = {n: np.array(v, copy=True) for n, (_, v) in model.items()}
    state[M + B0 + "attn1.to_q.weight"] = state[M + B0 + "attn1.to_q.weight"].view(
        ml_dtypes.float8_e4m3fn)                     # as a loader's float8 tensor comes
    ltx2blas.fuse_state_dict(state, [(str(p), s) for p, s in loras], threads=3)
    for short, (layout, scale_names) in COMFY_EXPECT.items():
        m = B0 + short
        ads = [factors(a1, m, 0.7), factors(a2, m, -1.1)]
        scales = tuple(model[M + m + "." + n][1] for n in scale_names)
        expected = reference.fuse_quantized(layout, model[M + m + ".weight"][1], scales, ads)
        for got in (out, state):
            assert np.array_equal(got[M + m + ".weight"].view(np.uint8), expected[0].view(np.uint8)), m
            for n, want in zip(scale_names, expected[1:]):
                assert np.array_equal(got[M + m + "." + n].reshape(-1).view(np.uint8),
                                      np.asarray(want, got[M + m + "." + n].dtype)
                                      .reshape(-1).view(np.uint8)), (m, n)
    for name in model:
        if name.endswith((".comfy_quant", ".input_scale")):
            assert np.array_equal(out[name], model[name][1])


@pytest.mark.parametrize("conf, extra, match", [
    ({"format": "convrot_w4a4"}, None, "'convrot_w4a4' is not one ltx2blas fuses"),
    ({"format": "awq_w4a16"}, None, "'awq_w4a16' is not one ltx2blas fuses"),
    ({"format": "int8_tensorwise", "convrot": True}, None, "convrot"),
    ({"format": "int8_tensorwise"}, "one_scale", r"per row"),
    ({"format": "int8_tensorwise"}, "pre_quant_scale", "AWQ"),
    ({"format": "mxfp8"}, None, "whose weight is F8_E4M3"),
])
def test_comfy_formats_not_handled_are_refused(tmp_path, rng, conf, extra, match):
    """A format ComfyUI lists that ltx2blas does not fuse is refused naming it, before anything
    is written, as is a layer whose stored weight the rule cannot take."""
    q, scale = int8_case(rng)
    w = M + B0 + "ff.net.2"
    model = {w + ".weight": ("I8", q), w + ".weight_scale": ("F32", scale),
             w + ".comfy_quant": marker(conf)}
    if extra == "one_scale":
        model[w + ".weight_scale"] = ("F32", scale.reshape(1))
    if extra == "pre_quant_scale":
        model[w + ".pre_quant_scale"] = ("F32", np.ones(384, np.float32))
    _refused(tmp_path, model, lora(rng, [B0 + "ff.net.2"], 4, (256, 384)),
             r"ff\.net\.2\.weight.*" + match)


@pytest.mark.parametrize("what", ["scale_shape", "scale_dtype", "bf16_with_scale", "scale_weight_alone",
                                  "nvfp4_scales", "nvfp4_no_scale", "bad_comfy_json"])
def test_unhandled_layouts_are_refused_before_writing(tmp_path, rng, what):
    codes, scale = per_tensor_case(rng)
    w = M + B0 + "attn1.to_q.weight"
    model = {w: ("F8_E4M3", codes)}
    if what == "scale_shape":
        model[w + "_scale"] = ("F32", np.ones((3, 3), np.float32))
    elif what == "scale_dtype":
        model[w + "_scale"] = ("F16", np.ones((), np.float16))
    elif what == "bf16_with_scale":
        model[w] = ("BF16", random_bf16(rng, SHAPE, 0.02))
        model[w + "_scale"] = ("F32", scale)
    elif what == "scale_weight_alone":
        model[M + B0 + "attn1.to_q.scale_weight"] = ("F32", scale)
    elif what == "nvfp4_scales":
        packed, block, s2 = nvfp4_case(rng)
        model = {w: ("U8", np.ascontiguousarray(packed)), w + "_scale": ("F8_E4M3", block[:128]),
                 w + "_scale_2": ("F32", s2)}
    elif what == "nvfp4_no_scale":
        packed, block, s2 = nvfp4_case(rng)
        model = {w: ("U8", packed), w + "_scale_2": ("F32", s2)}
    else:
        model[M + B0 + "attn1.to_q.comfy_quant"] = ("U8", np.frombuffer(b"{not json", np.uint8).copy())
    error = errors.FormatError if what == "bad_comfy_json" else errors.DTypeError
    _refused(tmp_path, model, lora(rng, [B0 + "attn1.to_q"], 4), r"attn1\.to_q", error)


def test_stochastic_rounding_is_refused_for_scaled_layouts(tmp_path, rng):
    codes, scale = per_tensor_case(rng)
    model = {M + B0 + "attn1.to_q.weight": ("F8_E4M3", codes),
             M + B0 + "attn1.to_q.weight_scale": ("F32", scale)}
    _refused(tmp_path, model, lora(rng, [B0 + "attn1.to_q"], 4), "stochastic rounding applies",
             ValueError, fp8_rounding="stochastic")
    _refused(tmp_path, model, lora(rng, [B0 + "attn1.to_q"], 4), "rule", ValueError, rule="stack")


def test_adapter_must_fit_the_logical_shape(tmp_path, rng):
    packed, block, s2 = nvfp4_case(rng)
    model = {M + B0 + "ff.net.2.weight": ("U8", packed), M + B0 + "ff.net.2.weight_scale": ("F8_E4M3", block),
             M + B0 + "ff.net.2.weight_scale_2": ("F32", s2)}
    # an adapter shaped for the packed bytes [256, 192] rather than the weight [256, 384]
    _refused(tmp_path, model, lora(rng, [B0 + "ff.net.2"], 4, (256, 192)), r"nvfp4, stored \[256, 192\]",
             errors.ShapeError)


def test_state_dict_quantized_in_place(rng):
    model = ltx_model(rng)
    modules = [B0 + m for m in EXPECT]
    ad = lora(rng, modules, 8)
    state = {n: v.copy() for n, (_, v) in model.items()}
    # the scaled fp8 codes as an ml_dtypes array, the rest as the raw bytes a loader keeps
    import ml_dtypes
    state[M + B0 + "attn1.to_q.weight"] = state[M + B0 + "attn1.to_q.weight"].view(ml_dtypes.float8_e4m3fn)
    state[M + B0 + "attn1.to_k.weight"] = state[M + B0 + "attn1.to_k.weight"].view(ml_dtypes.float8_e4m3fn)
    state[M + B0 + "ff.net.2.weight_scale"] = state[M + B0 + "ff.net.2.weight_scale"].view(ml_dtypes.float8_e4m3fn)
    adapters = {k: v for k, (_, v) in ad.items()}
    report = ltx2blas.fuse_state_dict(state, [(adapters, 0.7)], threads=2)
    assert report.layouts == {"fp8_scaled": 1, "fp8_block": 1, "fp6_block": 1, "nvfp4": 1}
    for short, (layout, scale_names) in EXPECT.items():
        m = B0 + short
        scales = tuple(model[M + m + "." + n][1] for n in scale_names)
        expected = reference.fuse_quantized(layout, model[M + m + ".weight"][1], scales,
                                            [factors(ad, m, 0.7)])
        assert np.array_equal(state[M + m + ".weight"].view(np.uint8), expected[0])
        for n, want in zip(scale_names, expected[1:]):
            got = state[M + m + "." + n]
            assert np.array_equal(got.reshape(-1).view(np.uint8),
                                  np.asarray(want).astype(got.dtype if got.dtype.kind == "f" and got.dtype.itemsize == 4 else np.uint8).reshape(-1).view(np.uint8))


def test_state_dict_of_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    model = ltx_model(rng)
    m = B0 + "ff.net.2"
    ad = lora(rng, [m], 8)
    state = {n: torch.from_numpy(v.copy()) for n, (_, v) in model.items() if n.startswith(M + m)}
    state[M + m + ".weight_scale"] = state[M + m + ".weight_scale"].view(torch.float8_e4m3fn)
    ltx2blas.fuse_state_dict(state, [({k: v for k, (_, v) in ad.items()}, 0.7)])
    expected = reference.fuse_quantized("nvfp4", model[M + m + ".weight"][1],
                                        (model[M + m + ".weight_scale"][1], model[M + m + ".weight_scale_2"][1]),
                                        [factors(ad, m, 0.7)])
    assert np.array_equal(state[M + m + ".weight"].numpy(), expected[0])
    assert np.array_equal(state[M + m + ".weight_scale"].view(torch.uint8).numpy(), expected[1])
    assert state[M + m + ".weight_scale_2"].item() == float(expected[2])


def test_dry_run_reports_layouts(tmp_path, rng):
    model = ltx_model(rng)
    ck.write(tmp_path / "m.safetensors", model)
    ck.write(tmp_path / "a.safetensors", lora(rng, [B0 + m for m in EXPECT], 4))
    report = ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors", [(tmp_path / "a.safetensors", 1.0)],
                                      tmp_path / "out.safetensors", dry_run=True)
    assert report.layouts == {"fp8_scaled": 1, "fp8_block": 1, "fp6_block": 1, "nvfp4": 1}
    assert report.tensors_copied == len(model) - 4 - 5
    assert not (tmp_path / "out.safetensors").exists()
