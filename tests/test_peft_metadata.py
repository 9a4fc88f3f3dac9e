"""diffusers' adapters carry PEFT's LoraConfig as JSON in ``__metadata__["lora_adapter_metadata"]``
and no ``.alpha`` tensor; diffusers and PEFT scale each module by (strength * alpha_m) / r_m
(alpha / sqrt(r) with use_rslora), r_m and alpha_m from rank_pattern / alpha_pattern.  Under
alpha="scale" ltx2blas applies exactly that, says where each alpha came from, and refuses
metadata that the tensors contradict."""
import json

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
MODULES = {"transformer_blocks.0.attn1.to_q": (64, 48), "transformer_blocks.0.attn1.to_k": (64, 48),
           "transformer_blocks.0.audio_attn1.to_k": (32, 48), "transformer_blocks.1.ff.net.0.proj": (96, 48)}
#: The fields diffusers writes with PEFT 0.20 (LoraConfig.to_dict(), sorted, under "transformer."),
#: at PEFT's defaults but for those a test sets.
PEFT_FIELDS = {
    "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None,
    "auto_mapping": None, "base_model_name_or_path": None, "bias": "none", "corda_config": None,
    "ensure_weight_tying": False, "eva_config": None, "exclude_modules": None,
    "fan_in_fan_out": False, "inference_mode": False, "init_lora_weights": "gaussian",
    "kasa_config": None, "layer_replication": None, "layers_pattern": None,
    "layers_to_transform": None, "loftq_config": {}, "lora_alpha": 8, "lora_bias": False,
    "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None,
    "megatron_core": "megatron.core", "modules_to_save": None, "monteclora_config": None,
    "peft_type": "LORA", "peft_version": "0.20.1.dev0@UNKNOWN", "qalora_group_size": 16, "r": 8,
    "rank_pattern": {}, "revision": None, "target_modules": ["to_q", "to_k", "proj"],
    "target_parameters": None, "task_type": None, "trainable_token_indices": None,
    "use_bdlora": None, "use_dora": False, "use_qalora": False, "use_rslora": False,
    "velora_config": None,
}


def model(rng):
    t = {}
    for m, shape in MODULES.items():
        t[M + m + ".weight"] = ("BF16", random_bf16(rng, shape, 0.02))
        t[M + m + ".bias"] = ("BF16", random_bf16(rng, (shape[0],), 0.02))
    return t


def diffusers_adapter(rng, ranks, component="transformer.", dora=False):
    """Tensors as diffusers' save_lora_weights names them (no .alpha)."""
    t = {}
    for m, r in ranks.items():
        out_f, in_f = MODULES[m]
        t[component + m + ".lora_A.weight"] = ("BF16", random_bf16(rng, (r, in_f), 0.05))
        t[component + m + ".lora_B.weight"] = ("BF16", random_bf16(rng, (out_f, r), 0.05))
        if dora:
            w = np.linspace(0.5, 1.5, out_f).astype(np.float32)
            t[component + m + ".lora_magnitude_vector"] = ("F32", w)
    return t


def metadata(prefix="transformer.", **fields):
    config = {**PEFT_FIELDS, **fields}
    return {"format": "pt", "lora_adapter_metadata": json.dumps(
        {prefix + k: v for k, v in config.items()}, indent=2, sort_keys=True)}


def fuse(tmp_path, rng, adapter, meta, strength=0.8, **kwargs):
    base = model(rng)
    ck.write(tmp_path / "m.safetensors", base)
    ck.write(tmp_path / "a.safetensors", adapter, meta)
    report = ltx2blas.fuse_checkpoint(tmp_path / "m.safetensors",
                                      [(tmp_path / "a.safetensors", strength)],
                                      tmp_path / "out.safetensors", **kwargs)
    with SafetensorsFile(tmp_path / "out.safetensors") as f:
        out = {n: f.read(n) for n in f.tensors}
        return base, out, report, f.metadata


def expected(base, adapter, module, scale, component="transformer."):
    a = adapter[component + module + ".lora_A.weight"][1]
    b = adapter[component + module + ".lora_B.weight"][1]
    return reference.fuse_lora(base[M + module + ".weight"][1], a, b, scale)


def test_lora_alpha_over_r_is_applied(tmp_path, rng):
    """r 8, lora_alpha 4: diffusers scales by 4 / 8, half of what the file's tensors alone give;
    the summary and the fused file's record say where alpha came from."""
    ranks = {m: 8 for m in MODULES}
    ad = diffusers_adapter(rng, ranks)
    base, out, report, meta = fuse(tmp_path, rng, ad, metadata(lora_alpha=4), strength=0.8)
    for m in MODULES:
        want = expected(base, ad, m, 0.8 * 4 / 8)
        assert np.array_equal(out[M + m + ".weight"], want), m
        assert not np.array_equal(want, expected(base, ad, m, 0.8))
    text = report.summary()
    assert "4 scaled by alpha / rank from its lora_adapter_metadata (transformer: r 8, " \
           "lora_alpha 4)" in text
    (record,) = json.loads(meta["ltx2blas.fused"])
    assert record["alpha_scaled"] == 4 and "lora_adapter_metadata" in record["alpha_source"]


def test_patterns_and_rslora(tmp_path, rng):
    """rank_pattern and alpha_pattern as PEFT >= 0.15 matches them (the whole name, or a
    suffix starting after a dot; the first key that matches), each looked up on its own; with
    use_rslora the scale is alpha / sqrt(r)."""
    ranks = {"transformer_blocks.0.attn1.to_q": 16, "transformer_blocks.0.attn1.to_k": 8,
             "transformer_blocks.0.audio_attn1.to_k": 8, "transformer_blocks.1.ff.net.0.proj": 4}
    ad = diffusers_adapter(rng, ranks)
    fields = dict(r=8, lora_alpha=8, use_rslora=True,
                  rank_pattern={"^transformer_blocks.0.attn1.to_q": 16, "ff.net.0.proj": 4},
                  alpha_pattern={"attn1.to_k": 2, "to_q": 32})
    base, out, report, _ = fuse(tmp_path, rng, ad, metadata(**fields), strength=1.5)
    alphas = {"transformer_blocks.0.attn1.to_q": 32,          # "to_q" matches as a suffix
              "transformer_blocks.0.attn1.to_k": 2,           # "attn1.to_k" does
              "transformer_blocks.0.audio_attn1.to_k": 8,     # it does not: audio_attn1
              "transformer_blocks.1.ff.net.0.proj": 8}
    for m, r in ranks.items():
        assert np.array_equal(out[M + m + ".weight"],
                              expected(base, ad, m, 1.5 * alphas[m] / np.sqrt(r))), m
    assert "use_rslora, 2 rank_pattern and 2 alpha_pattern entries" in report.summary()


def test_unprefixed_metadata_and_keys(tmp_path, rng):
    """A model that saved its own adapter (save_lora_adapter) writes neither the component in
    the metadata's keys nor in the tensors'."""
    ranks = {m: 4 for m in MODULES}
    ad = diffusers_adapter(rng, ranks, component="")
    base, out, _, _ = fuse(tmp_path, rng, ad, metadata(prefix="", r=4, lora_alpha=6), strength=1.0)
    m = "transformer_blocks.0.attn1.to_k"
    assert np.array_equal(out[M + m + ".weight"], expected(base, ad, m, 6 / 4, component=""))


def test_dora_takes_the_scale_inside(tmp_path, rng):
    ranks = {"transformer_blocks.0.attn1.to_q": 8}
    ad = diffusers_adapter(rng, ranks, dora=True)
    base, out, _, _ = fuse(tmp_path, rng, ad, metadata(lora_alpha=16, use_dora=True),
                           strength=1.0)
    m = "transformer_blocks.0.attn1.to_q"
    want = reference.fuse_dora(base[M + m + ".weight"][1], ad["transformer." + m + ".lora_A.weight"][1],
                               ad["transformer." + m + ".lora_B.weight"][1],
                               ad["transformer." + m + ".lora_magnitude_vector"][1], 16 / 8, 1.0)
    assert np.array_equal(out[M + m + ".weight"], want)


def test_alpha_ignore_reads_no_metadata(tmp_path, rng):
    """alpha="ignore" is upstream LTX-2, which never reads alpha: the metadata, even one that
    would be refused, is not applied, and the summary says so."""
    ranks = {m: 8 for m in MODULES}
    ad = diffusers_adapter(rng, ranks)
    base, out, report, _ = fuse(tmp_path, rng, ad, metadata(r=16, lora_alpha=4), strength=0.5,
                                alpha="ignore")
    m = "transformer_blocks.0.attn1.to_q"
    assert np.array_equal(out[M + m + ".weight"], expected(base, ad, m, 0.5))
    assert "alpha not applied to 4 modules (alpha='ignore')" in report.summary()


@pytest.mark.parametrize("case, match", [
    ("rank", "gives rank 16, but its lora_A has 8 rows"),
    ("dora", "says use_dora true, but the module has no DoRA magnitudes"),
    ("bias", "says lora_bias false"),
    ("alpha_tensor", "gives alpha 4, but"),
    ("not_json", "is not valid JSON"),
    ("variant", "use_bdlora"),
    ("pissa", "rewrite the base weight"),
    ("bad_r", "r is 'eight'"),
    ("component", "belongs to the transformer, which its lora_adapter_metadata does not "
                  "configure"),
])
def test_metadata_the_tensors_contradict_is_refused(tmp_path, rng, case, match):
    """Nothing is written when the metadata does not describe the tensors beside it, or asks
    PEFT for more than a LoRA: diffusers would load something else than what is fused."""
    ranks = {m: 8 for m in MODULES}
    ad = diffusers_adapter(rng, ranks)
    fields = {"lora_alpha": 4}
    meta = None
    if case == "rank":
        fields["rank_pattern"] = {"to_q": 16}
    elif case == "dora":
        fields["use_dora"] = True
    elif case == "bias":
        ad["transformer.transformer_blocks.0.attn1.to_q.lora_B.bias"] = (
            "BF16", random_bf16(rng, (64,), 0.01))
    elif case == "alpha_tensor":
        ad["transformer.transformer_blocks.0.attn1.to_q.alpha"] = ("F32", np.array(5.0, np.float32))
    elif case == "not_json":
        meta = {"lora_adapter_metadata": "{r: 8"}
    elif case == "variant":
        fields["use_bdlora"] = {"blocks": 4}
    elif case == "pissa":
        fields["init_lora_weights"] = "pissa_niter_4"
    elif case == "bad_r":
        fields["r"] = "eight"
    elif case == "component":
        meta = metadata(prefix="connectors.", **fields)
    with pytest.raises(errors.FormatError, match=match):
        fuse(tmp_path, rng, ad, meta or metadata(**fields))
    assert not (tmp_path / "out.safetensors").exists()


def test_read_configs_follows_peft_defaults():
    """Fields the JSON leaves out take PEFT's defaults: r 8 and lora_alpha 8 (not r)."""
    from ltx2blas.files import peft

    configs, _ = peft.read_configs({"lora_adapter_metadata": '{"transformer.r": 4}'}, "x")
    config = configs["transformer"]
    assert (config.r, config.lora_alpha, config.use_rslora) == (4, 8, False)
    assert config.rank_and_alpha("transformer_blocks.0.attn1.to_q") == (4, 8)
    assert config.scale(0.7, 4, 8) == 0.7 * 8 / 4
