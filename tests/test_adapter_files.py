"""Adapter files as the field writes them: every key spelling and prefix, every adapter kind
(fused by its rule or refused with nothing written), diffusers names both ways, alpha scaled or
ignored, and unmatched pairs as an error."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.files import keys
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q = "transformer_blocks.0.attn1.to_q"   # [64, 48] in ck.MODULES
FF = "transformer_blocks.0.ff.net.0.proj"


@pytest.fixture
def model(tmp_path, rng):
    tensors = ck.model(rng)
    return ck.write(tmp_path / "model.safetensors", tensors), tensors


def read(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}


def factors(rng, module=Q, rank=6):
    out_f, in_f = ck.MODULES[module]
    return random_bf16(rng, (rank, in_f), 0.05), random_bf16(rng, (out_f, rank), 0.05)


def fuse(model_path, tmp_path, tensors, strength=0.8, name="a.safetensors", **kwargs):
    path = ck.write(tmp_path / name, tensors)
    out = tmp_path / ("out-" + name)
    report = ltx2blas.fuse_checkpoint(model_path, [(path, strength)], out, **kwargs)
    return read(out), report


SPELLINGS = [
    ("diffusion_model.{m}.lora_A.weight", "diffusion_model.{m}.lora_B.weight"),     # LTX-2 trainer
    ("diffusion_model.{m}.lora_down.weight", "diffusion_model.{m}.lora_up.weight"),  # kohya
    ("{m}_lora.down.weight", "{m}_lora.up.weight"),
    ("{m}.lora.down.weight", "{m}.lora.up.weight"),
    ("{m}.lora_linear_layer.down.weight", "{m}.lora_linear_layer.up.weight"),
    ("transformer.{m}.lora_A", "transformer.{m}.lora_B"),                           # no .weight
    ("base_model.model.{m}.lora_A.default.weight", "base_model.model.{m}.lora_B.default.weight"),
    ("base_model.model.diffusion_model.{m}.lora_A.weight", "base_model.model.diffusion_model.{m}.lora_B.weight"),
    ("lycoris_{flat}.lora_down.weight", "lycoris_{flat}.lora_up.weight"),
    ("lora_unet_{flat}.lora_down.weight", "lora_unet_{flat}.lora_up.weight"),
]


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: s[0].split("{")[0] + s[0].split("}")[1])
def test_every_spelling_fuses_the_same_bytes(model, tmp_path, rng, spelling):
    path, tensors = model
    a, b = factors(rng)
    names = [s.format(m=Q, flat=Q.replace(".", "_")) for s in spelling]
    out, report = fuse(path, tmp_path, {names[0]: ("BF16", a), names[1]: ("BF16", b)})
    assert np.array_equal(out[M + Q + ".weight"],
                          reference.fuse_lora(tensors[M + Q + ".weight"][1], a, b, 0.8))
    assert report.modules_fused == 1


@pytest.mark.parametrize("dtype", ["I64", "I32", "F16", "BF16", "F32"])
def test_alpha_of_every_dtype_and_the_alpha_switch(model, tmp_path, rng, dtype):
    path, tensors = model
    a, b = factors(rng, rank=4)
    alpha = {"I64": np.array(8, np.int64), "I32": np.array(8, np.int32),
             "F16": np.array(8, np.float16), "F32": np.array(8, np.float32),
             "BF16": np.array(0x4100, np.uint16)}[dtype]
    ad = {Q + ".lora_down.weight": ("BF16", a), Q + ".lora_up.weight": ("BF16", b),
          Q + ".alpha": (dtype, alpha)}
    out, report = fuse(path, tmp_path, ad)
    w = tensors[M + Q + ".weight"][1]
    assert np.array_equal(out[M + Q + ".weight"], reference.fuse_lora(w, a, b, 0.8 * 8 / 4))
    assert report.adapters[0].alpha_scaled == 1
    assert "1 scaled by alpha / rank from its .alpha tensors" in report.summary()
    out, report = fuse(path, tmp_path, ad, alpha="ignore", name="b.safetensors")
    assert np.array_equal(out[M + Q + ".weight"], reference.fuse_lora(w, a, b, 0.8))
    assert report.adapters[0].alpha_ignored == 1
    assert "alpha not applied to 1 module (alpha='ignore'; the file's alpha is 8)" in \
        report.summary()
    with pytest.raises(ValueError, match="alpha"):
        fuse(path, tmp_path, ad, alpha="halve", name="c.safetensors")


def test_lora_bias_and_diff_b_into_the_bias(model, tmp_path, rng):
    path, tensors = model
    a, b = factors(rng, rank=4)
    bias_term = random_bf16(rng, (64,), 0.01)
    diff_b = rng.standard_normal(96).astype(np.float32) * np.float32(0.01)
    ad = {f"diffusion_model.{Q}.lora_A.weight": ("BF16", a),
          f"diffusion_model.{Q}.lora_B.weight": ("BF16", b),
          f"diffusion_model.{Q}.lora_B.bias": ("BF16", bias_term),
          f"diffusion_model.{FF}.diff_b": ("F32", diff_b)}
    out, report = fuse(path, tmp_path, ad, strength=0.5)
    bias_q = tensors[M + Q + ".bias"][1]
    assert np.array_equal(out[M + Q + ".bias"], reference.fuse_bias(bias_q, [(bias_term, 0.5)]))
    assert not np.array_equal(out[M + Q + ".bias"], bias_q)
    bias_ff = tensors[M + FF + ".bias"][1]
    assert np.array_equal(out[M + FF + ".bias"], reference.fuse_bias(bias_ff, [(diff_b, 0.5)]))
    assert np.array_equal(out[M + FF + ".weight"], tensors[M + FF + ".weight"][1])  # bias only
    assert report.biases_fused == 2 and report.adapters[0].kinds == {"lora": 1, "bias": 2}


def test_full_weight_diff(model, tmp_path, rng):
    path, tensors = model
    diff = random_bf16(rng, (96, 48), 0.002)
    a, b = factors(rng, FF, rank=3)
    d1 = {f"{FF}.diff": ("BF16", diff)}
    d2 = {f"diffusion_model.{FF}.lora_A.weight": ("BF16", a), f"diffusion_model.{FF}.lora_B.weight": ("BF16", b)}
    ck.write(tmp_path / "d1.safetensors", d1)
    ck.write(tmp_path / "d2.safetensors", d2)
    for rule in ("addmm", "sum"):
        out = tmp_path / f"out-{rule}.safetensors"
        ltx2blas.fuse_checkpoint(path, [(tmp_path / "d1.safetensors", 0.7), (tmp_path / "d2.safetensors", -1.1)],
                                 out, rule=rule)
        assert np.array_equal(read(out)[M + FF + ".weight"], reference.fuse_loras(
            tensors[M + FF + ".weight"][1], [(diff, 0.7), (a, b, -1.1)], rule))


@pytest.mark.parametrize("style", ["peft", "peft_2d", "comfy_out", "comfy_in"])
def test_dora(model, tmp_path, rng, style):
    path, tensors = model
    a, b = factors(rng, rank=4)
    w = tensors[M + Q + ".weight"][1]
    rows = np.sqrt((reference.bf16_widen(w).astype(np.float64) ** 2).sum(axis=1))
    cols = np.sqrt((reference.bf16_widen(w).astype(np.float64) ** 2).sum(axis=0))
    m, key = {"peft": (rows.astype(np.float32), ".lora_magnitude_vector"),
              "peft_2d": (rows.astype(np.float32).reshape(64, 1), ".lora_magnitude_vector.weight"),
              "comfy_out": (rows.astype(np.float32).reshape(64, 1), ".dora_scale"),
              "comfy_in": (cols.astype(np.float32).reshape(1, 48), ".dora_scale")}[style]
    m = m * np.float32(1.05)
    ad = {Q + ".lora_down.weight": ("BF16", a), Q + ".lora_up.weight": ("BF16", b),
          Q + ".alpha": ("F32", np.array(2.0, np.float32)), Q + key: ("F32", m)}
    out, report = fuse(path, tmp_path, ad, strength=0.6)
    expected = reference.fuse_dora(w, a, b, m.reshape(-1) if style.startswith("peft") else m,
                                   2.0 / 4, 0.6, "peft" if style.startswith("peft") else "comfy")
    assert np.array_equal(out[M + Q + ".weight"], expected)
    assert report.adapters[0].kinds == {"dora": 1}


def test_dora_refusals(model, tmp_path, rng):
    path, tensors = model
    a, b = factors(rng, rank=4)
    dora = {Q + ".lora_down.weight": ("BF16", a), Q + ".lora_up.weight": ("BF16", b),
            Q + ".dora_scale": ("F32", np.ones((64, 1), np.float32))}
    ck.write(tmp_path / "dora.safetensors", dora)
    ck.write(tmp_path / "plain.safetensors", {Q + ".lora_down.weight": ("BF16", a),
                                              Q + ".lora_up.weight": ("BF16", b)})
    with pytest.raises(errors.KeyMatchError, match="DoRA adapter rescales the whole weight"):
        ltx2blas.fuse_checkpoint(path, [(tmp_path / "dora.safetensors", 1.0),
                                        (tmp_path / "plain.safetensors", 1.0)], tmp_path / "o.safetensors")
    bad = dict(dora)
    bad[Q + ".dora_scale"] = ("F32", np.ones((3, 1), np.float32))
    with pytest.raises(errors.ShapeError, match="DoRA magnitude"):
        fuse(path, tmp_path, bad, name="bad.safetensors")
    fp8 = ck.write(tmp_path / "fp8.safetensors", ck.model(rng, fp8="F8_E4M3"))
    with pytest.raises(errors.DTypeError, match="DoRA into bf16 weights"):
        ltx2blas.fuse_checkpoint(fp8, [(tmp_path / "dora.safetensors", 1.0)], tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("suffixes, kind", [
    ([".lora_down.weight", ".lora_up.weight", ".lora_mid.weight"], "LoCon with a Tucker core"),
    ([".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1"],
     "LoHa with a Tucker core"),
    ([".lokr_w1", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2"], "LoKr with a Tucker core"),
    ([".a1.weight", ".a2.weight", ".b1.weight", ".b2.weight"], "GLoRA"),
    ([".oft_blocks"], "OFT/BOFT"),
    ([".set_weight"], "set_weight"),
])
def test_kinds_not_fused_are_refused_naming_the_kind(model, tmp_path, rng, suffixes, kind):
    path, _ = model
    ad = {f"diffusion_model.{Q}{s}": ("BF16", random_bf16(rng, (4, 4), 0.1)) for s in suffixes}
    ad[f"diffusion_model.{FF}.lora_A.weight"] = ("BF16", random_bf16(rng, (2, 48), 0.1))
    ad[f"diffusion_model.{FF}.lora_B.weight"] = ("BF16", random_bf16(rng, (96, 2), 0.1))
    with pytest.raises(errors.KeyMatchError, match=kind):
        fuse(path, tmp_path, ad)
    assert not (tmp_path / "out-a.safetensors").exists()


def test_bias_term_without_a_model_bias_is_refused(tmp_path, rng):
    tensors = {M + Q + ".weight": ("BF16", random_bf16(rng, (64, 48), 0.02))}
    path = ck.write(tmp_path / "m.safetensors", tensors)
    with pytest.raises(errors.KeyMatchError, match="has no bias"):
        fuse(path, tmp_path, {f"{Q}.diff_b": ("F32", np.ones(64, np.float32))})


def test_lone_magnitude_and_mixed_kinds_are_errors(model, tmp_path, rng):
    path, _ = model
    with pytest.raises(errors.KeyMatchError, match="DoRA scale"):
        fuse(path, tmp_path, {f"{Q}.dora_scale": ("F32", np.ones((64, 1), np.float32))})
    a, b = factors(rng)
    with pytest.raises(errors.KeyMatchError, match="full-weight diff"):
        fuse(path, tmp_path, {f"{Q}.lora_A.weight": ("BF16", a), f"{Q}.lora_B.weight": ("BF16", b),
                              f"{Q}.diff": ("BF16", random_bf16(rng, (64, 48), 0.01))},
             name="mixed.safetensors")


# ---- diffusers names ----

def test_rename_table_entry_by_entry():
    """Every entry of the one table, both ways, and the names it must leave alone."""
    for ltx, diff, anchored in keys.RENAMES:
        name = (ltx + "linear") if anchored else f"x.{ltx}.linear"
        want = (diff + "linear") if anchored else f"x.{diff}.linear"
        assert keys.to_diffusers(name) == want, ltx
        assert keys.to_ltx(want) == name, diff
    cases = {
        "adaln_single.linear": "time_embed.linear",
        "adaln_single.emb.timestep_embedder.linear_1": "time_embed.emb.timestep_embedder.linear_1",
        "audio_adaln_single.linear": "audio_time_embed.linear",
        "av_ca_a2v_gate_adaln_single.linear": "av_cross_attn_video_a2v_gate.linear",
        "av_ca_video_scale_shift_adaln_single.linear": "av_cross_attn_video_scale_shift.linear",
        "av_ca_audio_scale_shift_adaln_single.linear": "av_cross_attn_audio_scale_shift.linear",
        "av_ca_v2a_gate_adaln_single.linear": "av_cross_attn_audio_v2a_gate.linear",
        "prompt_adaln_single.linear": "prompt_adaln.linear",
        "audio_prompt_adaln_single.linear": "audio_prompt_adaln.linear",
        "patchify_proj": "proj_in", "audio_patchify_proj": "audio_proj_in",
        "transformer_blocks.3.attn1.q_norm": "transformer_blocks.3.attn1.norm_q",
        "transformer_blocks.3.audio_attn2.k_norm": "transformer_blocks.3.audio_attn2.norm_k",
        "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
        "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table",
        # the same in both namings
        "transformer_blocks.0.attn1.to_q": "transformer_blocks.0.attn1.to_q",
        "transformer_blocks.7.audio_to_video_attn.to_out.0": "transformer_blocks.7.audio_to_video_attn.to_out.0",
        "transformer_blocks.2.ff.net.0.proj": "transformer_blocks.2.ff.net.0.proj",
        "caption_projection.linear_1": "caption_projection.linear_1",
        "proj_out": "proj_out", "audio_proj_out": "audio_proj_out",
    }
    for ltx, diff in cases.items():
        assert keys.to_diffusers(ltx) == diff and keys.to_ltx(diff) == ltx, ltx


#: LTX-2 modules, one per rename rule a LoRA pair can target, and the shape of their weight
RENAMED = {
    "patchify_proj": (32, 16), "audio_patchify_proj": (32, 16),
    "adaln_single.linear": (48, 32), "adaln_single.emb.timestep_embedder.linear_1": (32, 16),
    "audio_adaln_single.linear": (48, 32),
    "av_ca_video_scale_shift_adaln_single.linear": (48, 32),
    "av_ca_a2v_gate_adaln_single.linear": (48, 32),
    "av_ca_audio_scale_shift_adaln_single.linear": (48, 32),
    "av_ca_v2a_gate_adaln_single.linear": (48, 32),
    "prompt_adaln_single.linear": (48, 32), "audio_prompt_adaln_single.linear": (48, 32),
    "transformer_blocks.0.attn1.to_q": (32, 32), "proj_out": (16, 32),
}


def renamed_model(rng, naming):
    out = {}
    for m, shape in RENAMED.items():
        name = m if naming == "ltx" else keys.to_diffusers(m)
        prefix = M if naming == "ltx" else ""
        out[prefix + name + ".weight"] = ("BF16", random_bf16(rng, shape, 0.02))
    return out


def renamed_adapter(rng, naming):
    out, fac = {}, {}
    for m, (o, i) in RENAMED.items():
        a, b = random_bf16(rng, (4, i), 0.05), random_bf16(rng, (o, 4), 0.05)
        name = ("diffusion_model." + m) if naming == "ltx" else ("transformer." + keys.to_diffusers(m))
        out[name + ".lora_A.weight"] = ("BF16", a)
        out[name + ".lora_B.weight"] = ("BF16", b)
        fac[m] = (a, b)
    return out, fac


def test_diffusers_adapter_into_an_ltx_checkpoint(tmp_path, rng):
    model = renamed_model(rng, "ltx")
    path = ck.write(tmp_path / "ltx.safetensors", model)
    adapter, fac = renamed_adapter(rng, "diffusers")
    adapter["connectors.text_proj_in.lora_A.weight"] = ("BF16", random_bf16(rng, (2, 8), 0.1))
    adapter["connectors.text_proj_in.lora_B.weight"] = ("BF16", random_bf16(rng, (8, 2), 0.1))
    with pytest.raises(errors.KeyMatchError, match=r"connectors\.text_proj_in; its name points "
                                                   r"to the connectors"):
        fuse(path, tmp_path, adapter)
    out, report = fuse(path, tmp_path, adapter, allow_unmatched=True)
    assert report.modules_fused == len(RENAMED)
    for m, (a, b) in fac.items():
        assert np.array_equal(out[M + m + ".weight"],
                              reference.fuse_lora(model[M + m + ".weight"][1], a, b, 0.8)), m


def test_ltx_adapter_into_a_diffusers_transformer_folder(tmp_path, rng):
    """A trainer-format adapter into a sharded diffusers transformer (a folder with
    diffusion_pytorch_model-0000N-of-00002.safetensors and their index)."""
    model = renamed_model(rng, "diffusers")
    folder = tmp_path / "transformer"
    folder.mkdir()
    names = sorted(model)
    shards = {f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    weight_map = {}
    for shard, members in shards.items():
        ck.write(folder / shard, {n: model[n] for n in members}, {"format": "pt"})
        weight_map.update({n: shard for n in members})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    (folder / "config.json").write_text("{}")
    adapter, fac = renamed_adapter(rng, "ltx")
    ck.write(tmp_path / "trainer.safetensors", adapter)
    out = tmp_path / "fused.safetensors"
    report = ltx2blas.fuse_checkpoint(folder, [(tmp_path / "trainer.safetensors", 0.8)], out)
    assert report.modules_fused == len(RENAMED)
    got = read(out)
    for m, (a, b) in fac.items():
        d = keys.to_diffusers(m) + ".weight"
        assert np.array_equal(got[d], reference.fuse_lora(model[d][1], a, b, 0.8)), m


def test_folder_without_diffusers_weights_is_refused(tmp_path, model):
    with pytest.raises(errors.ArgumentError, match="folder without"):
        ltx2blas.fuse_checkpoint(tmp_path, [(model[0], 1.0)], tmp_path / "o.safetensors")


def test_cli_alpha_and_allow_unmatched(model, tmp_path, rng):
    path, tensors = model
    a, b = factors(rng, rank=4)
    lora = ck.write(tmp_path / "l.safetensors", {
        Q + ".lora_down.weight": ("BF16", a), Q + ".lora_up.weight": ("BF16", b),
        Q + ".alpha": ("I64", np.array(2, np.int64)),
        "lora_te1_text_model_encoder_layers_0_q_proj.lora_down.weight": ("BF16", a),
        "lora_te1_text_model_encoder_layers_0_q_proj.lora_up.weight": ("BF16", b)})

    def run(*args):
        return subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(path), "--lora",
                               f"{lora}:0.5", *map(str, args)], capture_output=True, text=True,
                              cwd="/", timeout=120)

    r = run("-o", tmp_path / "o.safetensors")
    assert r.returncode == 2 and "matches no weight" in r.stderr and "text encoder" in r.stderr
    assert not (tmp_path / "o.safetensors").exists()
    r = run("-o", tmp_path / "o.safetensors", "--allow-unmatched", "--alpha", "ignore")
    assert r.returncode == 0, r.stderr
    assert "alpha not applied to 1 module (--alpha ignore; the file's alpha is 2)" in r.stdout
    assert "1 module matches no weight" in r.stdout
    assert np.array_equal(read(tmp_path / "o.safetensors")[M + Q + ".weight"],
                          reference.fuse_lora(tensors[M + Q + ".weight"][1], a, b, 0.5))
    assert os.path.exists(tmp_path / "o.safetensors")


def test_state_dict_takes_every_kind(rng):
    """fuse_state_dict plans the same kinds in place: DoRA, a difference, bias terms."""
    tensors = ck.model(rng)
    state = {n: v.copy() for n, (_, v) in tensors.items()}
    a, b = factors(rng, rank=4)
    m = rng.uniform(0.3, 0.5, 64).astype(np.float32)
    diff = random_bf16(rng, (96, 48), 0.002)
    term = random_bf16(rng, (96,), 0.01)
    adapter = {f"{Q}.lora_A.weight": a, f"{Q}.lora_B.weight": b, f"{Q}.lora_magnitude_vector": m,
               f"{FF}.diff": diff, f"{FF}.diff_b": term}
    report = ltx2blas.fuse_state_dict(state, [(adapter, 0.5)])
    assert report.adapters[0].kinds == {"dora": 1, "diff": 1, "bias": 1}
    assert np.array_equal(state[M + Q + ".weight"],
                          reference.fuse_dora(tensors[M + Q + ".weight"][1], a, b, m, 1.0, 0.5, "peft"))
    assert np.array_equal(state[M + FF + ".weight"],
                          reference.fuse_loras(tensors[M + FF + ".weight"][1], [(diff, 0.5)]))
    assert np.array_equal(state[M + FF + ".bias"],
                          reference.fuse_bias(tensors[M + FF + ".bias"][1], [(term, 0.5)]))
