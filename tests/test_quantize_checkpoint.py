"""ltx2blas quantize / quantize_checkpoint: the owners' choice of layers, the tensors and markers
their loaders need, every quantised weight as quantize_weight makes it (tested against the
reference in test_quantize.py), what is kept and why, and the fuse's guarantees: nothing
written on an error, a dry run that writes nothing, the output never an input."""
import json
import os

import numpy as np
import pytest

import ltx2blas
from ltx2blas import cli
from ltx2blas.errors import ArgumentError, NonFiniteWeightError, Ltx2BlasError
from ltx2blas.files.quantize import CHOICES, NVFP4_SUFFIXES, quantize_checkpoint
from ltx2blas.files.safetensors import SafetensorsFile
from ltx2blas.quantized import QUANTIZE_FORMATS, quantize_weight

import ckpt_helpers as ck
from helpers import random_bf16

P = "model.diffusion_model."
B = P + "transformer_blocks.0."
#: module -> shape: every kind of Linear the owners' choices tell apart
MODULES = {
    "attn1.to_q": (128, 128), "attn1.to_k": (128, 128), "attn1.to_v": (128, 128),
    "attn1.to_out.0": (128, 128), "attn2.to_q": (128, 128), "attn2.to_k": (128, 256),
    "ff.net.0.proj": (256, 128), "ff.net.2": (128, 256),
    "audio_attn1.to_q": (128, 128), "audio_ff.net.0.proj": (256, 128),
    "audio_to_video_attn.to_q": (128, 128), "video_to_audio_attn.to_k": (128, 128),
    "video_to_audio_attn.to_q": (128, 128), "attn1.to_gate_logits": (32, 128),
}


def model(rng, path, extra=None):
    tensors = {}
    for module, shape in MODULES.items():
        tensors[B + module + ".weight"] = ("BF16", random_bf16(rng, shape, 0.02))
        tensors[B + module + ".bias"] = ("BF16", random_bf16(rng, (shape[0],), 0.02))
    tensors[P + "adaln_single.linear.weight"] = ("BF16", random_bf16(rng, (128, 128), 0.02))
    tensors[P + "proj_out.weight"] = ("BF16", random_bf16(rng, (128, 128), 0.02))
    tensors[B + "scale_shift_table"] = ("BF16", random_bf16(rng, (6, 128), 0.02))
    tensors[B + "norm1.weight"] = ("F32", rng.standard_normal(128).astype(np.float32))
    tensors.update(extra or {})
    return ck.write(path, tensors, {"format": "pt", "config": "{}"})


def read_all(path):
    with SafetensorsFile(path) as f:
        return {n: (info.dtype, tuple(info.shape), f.read(n) if info.dtype != "F8_E5M2" else
                    f.read(n, np.empty(info.shape, np.uint8)))
                for n, info in f.tensors.items()}, dict(f.metadata)


@pytest.fixture
def base(tmp_path, rng):
    return model(rng, tmp_path / "model.safetensors")


SUFFIXES = {"comfy_fp8": ("weight_scale",), "comfy_mxfp8": ("weight_scale",),
            "comfy_int8": ("weight_scale",), "comfy_nvfp4": ("weight_scale", "weight_scale_2"),
            "fp8_scaled": ("weight_scale",), "fp8_block": ("weight_scale",),
            "nvfp4": ("weight_scale", "weight_scale_2")}
COMFY = {"comfy_fp8": "float8_e4m3fn", "comfy_nvfp4": "nvfp4", "comfy_mxfp8": "mxfp8",
         "comfy_int8": "int8_tensorwise"}


@pytest.mark.parametrize("fmt", QUANTIZE_FORMATS)
def test_each_format_writes_the_owners_tensors_and_markers(fmt, base, tmp_path):
    out = tmp_path / f"{fmt}.safetensors"
    report = quantize_checkpoint(base, out, fmt, threads=2)
    before, _ = read_all(base)
    after, metadata = read_all(out)
    assert report.quantized and set(report.quantized) <= set(before)
    for name, (dtype, shape, value) in before.items():
        if name not in report.quantized:
            assert after[name][0] == dtype and after[name][2].tobytes() == value.tobytes()
            continue
        q = quantize_weight(fmt, value, threads=1)
        stem = name[: -len(".weight")]
        assert after[name][2].tobytes() == q.weight.tobytes()
        assert after[stem + ".weight_scale"][2].tobytes() == q.scale.tobytes()
        assert after[stem + ".weight_scale"][1] == q.scale.shape
        if q.scale_2 is not None:
            assert after[stem + ".weight_scale_2"][2].tobytes() == q.scale_2.tobytes()
            assert after[stem + ".weight_scale_2"][:2] == ("F32", ())
        # the dtypes the owners' loaders go by
        want = {"fp8_scaled": "F8_E4M3", "comfy_fp8": "F8_E4M3", "fp8_block": "F8_E4M3",
                "nvfp4": "U8", "comfy_nvfp4": "U8", "comfy_mxfp8": "F8_E4M3",
                "comfy_int8": "I8"}[fmt]
        assert after[name][0] == want
        if fmt in ("nvfp4", "comfy_nvfp4"):
            assert after[stem + ".weight_scale"][0] == "F8_E4M3"
        if fmt in COMFY:
            marker = after[stem + ".comfy_quant"]
            assert marker[0] == "U8"
            # ComfyUI's own writer: json.dumps with its default separators
            assert bytes(marker[2]) == json.dumps({"format": COMFY[fmt]}).encode()
        else:
            assert stem + ".comfy_quant" not in after
        assert not any(k.startswith(stem + ".") and k.split(".")[-1] not in
                       ("weight", "bias", "weight_scale", "weight_scale_2", "comfy_quant")
                       for k in after)
    # every other tensor kept, in the base's order, each quantised weight's scales after it
    names = list(after)
    assert [n for n in names if n in before] == list(before)
    for name in report.quantized:
        stem = name[: -len(".weight")]
        i = names.index(name)
        assert names[i + 1] == stem + ".weight_scale"
    info = json.loads(metadata["ltx2blas.quantized"])
    assert info["format"] == fmt and info["weights"] == len(report.quantized)
    assert metadata["config"] == "{}"   # the base's metadata kept
    assert os.path.getsize(out) == report.bytes_out < report.bytes_in


def modules(names):
    return {n[len(B):-len(".weight")] for n in names}


def test_the_owners_choices_of_layers(base, tmp_path):
    plan = {fmt: set(quantize_checkpoint(base, None, fmt, dry_run=True).quantized)
            for fmt in QUANTIZE_FORMATS}
    # upstream's NVFP4 allowlist: exactly its suffixes, anchored at the block
    assert modules(plan["nvfp4"]) == {m for m in MODULES if m in NVFP4_SUFFIXES}
    assert "attn1.to_gate_logits" not in modules(plan["nvfp4"])
    assert not any("audio_attn1" in m or "audio_ff" in m for m in modules(plan["nvfp4"]))
    # upstream's fp8 cast set: attention projections and feed-forwards, audio's too
    assert modules(plan["fp8_scaled"]) == {m for m in MODULES if m.endswith(
        (".to_q", ".to_k", ".to_v", ".to_out.0", "ff.net.0.proj", "ff.net.2"))}
    # blockwise and ComfyUI's: every Linear of the blocks but to_gate_logits and the adaln
    blockwise = {m for m in MODULES if m != "attn1.to_gate_logits"}
    for fmt in ("fp8_block", "comfy_fp8", "comfy_nvfp4", "comfy_mxfp8", "comfy_int8"):
        assert modules(plan[fmt]) == blockwise, fmt
    for fmt in QUANTIZE_FORMATS:  # never outside the blocks, never a 1-D or non-Linear tensor
        assert all(n.startswith(B) and n.endswith(".weight") for n in plan[fmt])
        assert CHOICES[fmt][0] in quantize_checkpoint(base, None, fmt, dry_run=True).summary()


def test_include_and_exclude_change_the_choice(base):
    report = quantize_checkpoint(base, None, "nvfp4", dry_run=True,
                                 include=["*proj_out"], exclude=["*attn1.to_[qk]"])
    got = set(report.quantized)
    assert P + "proj_out.weight" in got
    assert B + "attn1.to_q.weight" not in got and B + "attn1.to_k.weight" not in got
    assert B + "attn1.to_v.weight" in got
    assert "include *proj_out" in report.summary() and "exclude" in report.summary()


def test_a_weight_the_format_cannot_hold_is_kept_and_named(tmp_path, rng):
    odd = B + "attn1.to_v.weight"
    base = model(rng, tmp_path / "m.safetensors")
    tensors = {}
    with SafetensorsFile(base) as f:
        for n, info in f.tensors.items():
            tensors[n] = (info.dtype, f.read(n))
    tensors[odd] = ("BF16", random_bf16(rng, (128, 120), 0.02))          # 120 % 16 != 0
    tensors[B + "attn1.to_out.0.weight"] = ("F32", rng.standard_normal((128, 128)).astype(
        np.float32))                                                    # not bf16
    base = ck.write(tmp_path / "m2.safetensors", tensors)
    report = quantize_checkpoint(base, tmp_path / "o.safetensors", "nvfp4")
    assert odd in report.kept and "16-element" in report.kept[odd]
    assert "not bf16" in report.kept[B + "attn1.to_out.0.weight"]
    assert "kept bf16: 2 chosen weights" in report.summary()
    after, _ = read_all(tmp_path / "o.safetensors")
    assert after[odd][0] == "BF16" and odd[: -len(".weight")] + ".weight_scale" not in after
    # ComfyUI's nvfp4 pads the same weight instead
    report = quantize_checkpoint(base, tmp_path / "c.safetensors", "comfy_nvfp4")
    assert odd in report.quantized
    after, _ = read_all(tmp_path / "c.safetensors")
    assert after[odd][1] == (128, 64)


def test_a_dry_run_writes_nothing_and_gives_the_size(base, tmp_path):
    out = tmp_path / "o.safetensors"
    plan = quantize_checkpoint(base, out, "comfy_nvfp4", dry_run=True)
    assert not out.exists() and plan.dry_run and "would quantize" in plan.summary()
    done = quantize_checkpoint(base, out, "comfy_nvfp4")
    assert plan.bytes_out == done.bytes_out == os.path.getsize(out)
    assert plan.quantized == done.quantized


def test_nothing_is_written_on_an_error(tmp_path, rng):
    bad = random_bf16(rng, (128, 128), 0.02)
    bad[7, 9] = 0x7FC0   # NaN
    base = model(rng, tmp_path / "m.safetensors", {B + "attn2.to_out.0.weight": ("BF16", bad)})
    out = tmp_path / "o.safetensors"
    with pytest.raises(NonFiniteWeightError, match=r"\(7, 9\)"):
        quantize_checkpoint(base, out, "fp8_block")
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]
    out.write_bytes(b"old")
    with pytest.raises(NonFiniteWeightError):
        quantize_checkpoint(base, out, "comfy_fp8")
    assert out.read_bytes() == b"old"


def test_refusals(base, tmp_path):
    with pytest.raises(Ltx2BlasError):
        quantize_checkpoint(base, base, "comfy_fp8")
    with pytest.raises(ArgumentError, match="format"):
        quantize_checkpoint(base, tmp_path / "o.safetensors", "fp6_block")
    with pytest.raises(ArgumentError, match="nothing to quantize"):
        quantize_checkpoint(base, tmp_path / "o.safetensors", "nvfp4", exclude=["*"])
    with pytest.raises(ArgumentError):
        quantize_checkpoint(base, tmp_path / "o.safetensors", "nvfp4", per_row=True)
    assert not (tmp_path / "o.safetensors").exists()


def test_a_quantised_output_is_quantised_again_from_its_values_and_fuses(base, tmp_path, rng):
    """The output's quantised weights are read back by their owner's rule when quantised again
    (planned as such); ltx2blas reads each of its layouts back and fuses an adapter into it."""
    for fmt in ("fp8_scaled", "comfy_fp8", "nvfp4", "comfy_nvfp4", "comfy_mxfp8",
                "comfy_int8", "fp8_block"):
        out = tmp_path / f"{fmt}.safetensors"
        report = quantize_checkpoint(base, out, fmt)
        again = quantize_checkpoint(out, None, "comfy_fp8", dry_run=True,
                                    include=["*proj_out"])
        chosen = set(again.quantized) & set(report.quantized)
        assert chosen and again.requantized == len(chosen) and not set(again.kept) & chosen
        module = report.quantized[0][len(P):-len(".weight")]
        shape = MODULES[module[len("transformer_blocks.0."):]]
        lora = ck.write(tmp_path / f"lora_{fmt}.safetensors", {
            f"diffusion_model.{module}.lora_A.weight": ("BF16", random_bf16(rng, (4, shape[1]),
                                                                            0.05)),
            f"diffusion_model.{module}.lora_B.weight": ("BF16", random_bf16(rng, (shape[0], 4),
                                                                            0.05))})
        fused = ltx2blas.fuse_checkpoint(out, [(lora, 1.0)], tmp_path / f"f_{fmt}.safetensors")
        assert fused.modules_fused == 1, fmt


def test_the_upstream_nvfp4_output_is_what_prequant_discovery_takes(base, tmp_path):
    """Upstream's discovery (ltx_core.quantization.nvfp4.prequant), restated: a layer whose
    .weight is U8, .weight_scale F8_E4M3 and .weight_scale_2 F32, both scales or neither."""
    out = tmp_path / "o.safetensors"
    report = quantize_checkpoint(base, out, "nvfp4")
    with SafetensorsFile(out) as f:
        header = {n: (i.dtype, list(i.shape)) for n, i in f.tensors.items()}
    found = []
    for key in header:
        if not key.endswith(".weight"):
            continue
        layer = key[: -len(".weight")]
        has = [f"{layer}.weight_scale" in header, f"{layer}.weight_scale_2" in header]
        assert has[0] == has[1]
        if all(has) and header[key][0] == "U8" and \
                header[layer + ".weight_scale"][0] == "F8_E4M3" and \
                header[layer + ".weight_scale_2"][0] == "F32":
            found.append(key)
            rows, half = header[key][1]
            assert header[layer + ".weight_scale"][1] == [-(-rows // 128) * 128,
                                                          -(-(half * 2 // 16) // 4) * 4]
    assert sorted(found) == sorted(report.quantized)


def test_the_command_line(base, tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    assert cli.main(["quantize", str(base), "--format", "comfy_nvfp4", "--dry-run",
                     "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["dry_run"] and plan["format"] == "comfy_nvfp4" and not out.exists()
    assert cli.main(["quantize", str(base), "-o", str(out), "--format", "comfy_fp8", "--e5m2",
                     "-q", "-v"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("quantized 13 of") and "saved" in text and "largest error" in text
    with SafetensorsFile(out) as f:
        assert f.tensors[B + "attn1.to_q.weight"].dtype == "F8_E5M2"
        marker = bytes(f.read(B + "attn1.to_q.comfy_quant"))
    assert marker == b'{"format": "float8_e5m2"}'
    assert cli.main(["quantize", str(base), "-o", str(tmp_path / "x.safetensors"), "--format",
                     "nvfp4", "--e5m2"]) == 2
    assert cli.main(["quantize", str(base), "--format", "nvfp4"]) == 2   # no -o


def lora_for(rng, path, modules):
    tensors = {}
    for module in modules:
        rows, cols = MODULES.get(module, (128, 128))
        key = f"diffusion_model.transformer_blocks.0.{module}" if module in MODULES else \
            f"diffusion_model.{module}"
        tensors[key + ".lora_A.weight"] = ("BF16", random_bf16(rng, (4, cols), 0.05))
        tensors[key + ".lora_B.weight"] = ("BF16", random_bf16(rng, (rows, 4), 0.05))
    return ck.write(path, tensors)


@pytest.mark.parametrize("fmt", QUANTIZE_FORMATS)
def test_fuse_to_is_quantize_of_the_bf16_fuse(fmt, base, tmp_path, rng):
    """fuse --to F writes, in one pass, the file that quantize --format F makes of the bf16
    fuse: the same tensors in the same order, byte for byte; and verify rebuilds it."""
    lora = lora_for(rng, tmp_path / "lora.safetensors",
                    ["attn1.to_q", "ff.net.2", "audio_attn1.to_q", "proj_out"])
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(base, [(lora, 0.8)], fused, digests=False)
    two_steps = tmp_path / "two.safetensors"
    quantize_checkpoint(fused, two_steps, fmt, digests=False)
    one_pass = tmp_path / "one.safetensors"
    report = ltx2blas.fuse_checkpoint(base, [(lora, 0.8)], one_pass, to=fmt)
    a, _ = read_all(two_steps)
    b, metadata = read_all(one_pass)
    assert list(a) == list(b)
    for name in a:
        assert a[name][:2] == b[name][:2] and a[name][2].tobytes() == b[name][2].tobytes(), name
    assert report.quantized_to == fmt and report.quantized
    assert f"into {fmt}" in report.summary()
    assert json.loads(metadata["ltx2blas.quantized"])["format"] == fmt
    alone = ltx2blas.verify_checkpoint(one_pass)
    assert alone.status == "verified" and f"fused and quantized to {fmt}" in alone.origin
    full = ltx2blas.verify_checkpoint(one_pass, base, [(lora, 0.8)], threads=2)
    assert full.status == "verified", full.summary()
    wrong = ltx2blas.verify_checkpoint(one_pass, base, [(lora, 0.5)], threads=1)
    assert wrong.status == "differs"


def test_verify_rebuilds_a_quantized_file_from_its_base(base, tmp_path):
    out = tmp_path / "q.safetensors"
    report = quantize_checkpoint(base, out, "nvfp4")
    assert ltx2blas.verify_checkpoint(out).status == "verified"
    full = ltx2blas.verify_checkpoint(out, base)
    assert full.status == "verified" and full.tensors_rebuilt >= len(report.quantized) * 3
    assert "quantized to nvfp4" in full.origin
    from test_verify import flip_byte
    edited = tmp_path / "base2.safetensors"
    edited.write_bytes(open(base, "rb").read())
    flip_byte(edited, report.quantized[0])
    blamed = ltx2blas.verify_checkpoint(out, edited)
    assert blamed.status == "differs" and blamed.cause_class == "base", blamed.summary()
    flip_byte(out, report.quantized[1])
    assert ltx2blas.verify_checkpoint(out).status == "differs"


def test_fuse_to_on_the_command_line(base, tmp_path, rng, capsys):
    lora = lora_for(rng, tmp_path / "lora.safetensors", ["attn1.to_q"])
    out = tmp_path / "o.safetensors"
    assert cli.main(["fuse", str(base), "--lora", f"{lora}:0.5", "-o", str(out), "--to",
                     "comfy_mxfp8", "-q"]) == 0
    assert "quantized 13 weights into comfy_mxfp8" in capsys.readouterr().out
    with SafetensorsFile(out) as f:
        assert bytes(f.read(B + "attn1.to_q.comfy_quant")) == b'{"format": "mxfp8"}'
    assert cli.main(["verify", str(out), "--model", str(base), "--lora", f"{lora}:0.5",
                     "-q"]) == 0
    with pytest.raises(SystemExit):
        cli.main(["fuse", str(base), "--lora", str(lora), "-o", str(out), "--to", "fp6_block"])
    plain = tmp_path / "p.safetensors"
    assert cli.main(["quantize", str(base), "-o", str(plain), "--format", "nvfp4",
                     "--no-digests", "-q"]) == 0
    with SafetensorsFile(plain) as f:
        assert "ltx2blas.provenance" not in f.metadata


@pytest.mark.parametrize("first,then", [("comfy_fp8", "comfy_nvfp4"), ("fp8_scaled", "nvfp4"),
                                        ("comfy_nvfp4", "comfy_mxfp8"),
                                        ("comfy_int8", "fp8_block"), ("nvfp4", "comfy_fp8"),
                                        ("comfy_mxfp8", "comfy_int8"), ("fp8_block", "fp8_scaled")])
def test_a_quantised_base_is_read_back_by_its_owners_rule_and_quantised_anew(first, then, base,
                                                                            tmp_path):
    """Each stored weight is dequantised to bf16 as its owner's loader does
    (quantized.dequantize_bf16; tested against the owners in test_quantize_loaders.py), then
    quantised into the new format; its old scales and marker are left out, and verify
    rebuilds the file from the quantised base."""
    stored = tmp_path / "stored.safetensors"
    quantize_checkpoint(base, stored, first)
    out = tmp_path / "out.safetensors"
    report = quantize_checkpoint(stored, out, then, include=["*proj_out"])
    assert report.requantized and "read back by their owner's rule" in report.summary()
    from ltx2blas.quantized import dequantize_bf16
    from ltx2blas.files.quantize import source_layouts
    from ltx2blas.files.checkpoint import Checkpoint
    before, _ = read_all(stored)
    after, metadata = read_all(out)
    with Checkpoint(stored) as ckpt:
        layouts = source_layouts(ckpt, {n: (i.dtype, tuple(i.shape))
                                        for n, (_, i) in ckpt.entries.items()})
    for name in report.quantized:
        stem = name[: -len(".weight")]
        if name in layouts:
            lay = layouts[name]
            weight = dequantize_bf16(lay.kind, before[name][2],
                                     scale=before[lay.scale][2] if lay.scale else None,
                                     scale_2=before[lay.scale_2][2] if lay.scale_2 else None)
        else:
            weight = before[name][2]
        q = quantize_weight(then, weight)
        assert after[name][2].tobytes() == q.weight.tobytes(), name
        assert after[stem + ".weight_scale"][2].tobytes() == q.scale.tobytes()
        if then not in COMFY:
            assert stem + ".comfy_quant" not in after
    assert not any(n.endswith(".comfy_quant") and n[: -len(".comfy_quant")] + ".weight"
                   not in report.quantized and n not in before for n in after)
    assert ltx2blas.verify_checkpoint(out).status == "verified"
    full = ltx2blas.verify_checkpoint(out, stored)
    assert full.status == "verified", full.summary()


def test_comfyuis_metadata_markers_of_layers_quantised_anew_are_taken_out(base, tmp_path):
    stored = tmp_path / "stored.safetensors"
    quantize_checkpoint(base, stored, "comfy_fp8")
    tensors, metadata = {}, {}
    with SafetensorsFile(stored) as f:
        for n, info in f.tensors.items():
            if not n.endswith(".comfy_quant"):
                tensors[n] = (info.dtype, f.read(n))
        layers = {n[len(P):-len(".comfy_quant")]: {"format": "float8_e4m3fn"}
                  for n in f.tensors if n.endswith(".comfy_quant")}
    marked = ck.write(tmp_path / "marked.safetensors", tensors,
                      {"_quantization_metadata": json.dumps({"format_version": "1.0",
                                                             "layers": layers})})
    out = tmp_path / "out.safetensors"
    report = quantize_checkpoint(marked, out, "comfy_nvfp4")
    assert report.requantized == len(layers)
    _, metadata = read_all(out)
    assert json.loads(metadata["_quantization_metadata"])["layers"] == {}


def test_the_command_lines_format_names_are_the_library_s():
    """The parser spells the formats out (it loads no compiled module); they are the same."""
    assert set(cli.FORMATS_TEXT) == set(QUANTIZE_FORMATS)


@pytest.mark.parametrize("fmt", ["comfy_mxfp8", "comfy_nvfp4", "comfy_fp8"])
def test_weights_padded_to_more_codes_than_their_bytes(fmt, tmp_path, rng):
    """ComfyUI pads a tiled format's weight to whole 128-row tiles: a [3, 32] weight has more
    codes than bf16 bytes, which cannot go over its own memory.  quantize and fuse --to write
    such weights (and unpadded ones beside them) as quantize_weight makes them."""
    shapes = {"attn1.to_q": (3, 32), "attn1.to_k": (130, 48), "ff.net.2": (256, 256)}
    weights = {B + m + ".weight": random_bf16(rng, s, 0.02) for m, s in shapes.items()}
    base = ck.write(tmp_path / "odd.safetensors", {k: ("BF16", v) for k, v in weights.items()})
    out = tmp_path / "q.safetensors"
    quantize_checkpoint(base, out, fmt, include=["*"], digests=False)
    got, _ = read_all(out)
    for name, w in weights.items():
        assert got[name][2].tobytes() == quantize_weight(fmt, w).weight.tobytes(), name
    tensors = {}
    for module, (rows, cols) in shapes.items():
        key = f"diffusion_model.transformer_blocks.0.{module}"
        tensors[key + ".lora_A.weight"] = ("BF16", random_bf16(rng, (2, cols), 0.05))
        tensors[key + ".lora_B.weight"] = ("BF16", random_bf16(rng, (rows, 2), 0.05))
    lora = ck.write(tmp_path / "lora.safetensors", tensors)
    fused, one, two = (tmp_path / f"{n}.safetensors" for n in ("fused", "one", "two"))
    ltx2blas.fuse_checkpoint(base, [(lora, 1.0)], fused, digests=False)
    quantize_checkpoint(fused, two, fmt, include=["*"], digests=False)
    ltx2blas.fuse_checkpoint(base, [(lora, 1.0)], one, to=fmt, digests=False)
    a, b = read_all(two)[0], read_all(one)[0]
    assert list(a) != [] and {n: v[2].tobytes() for n, v in a.items()} == {
        n: v[2].tobytes() for n, v in b.items()}
