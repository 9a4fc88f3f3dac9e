"""LoHa and LoKr adapter files fused into checkpoints: every spelling (ComfyUI's dotted names,
LyCORIS' and kohya's flattened ones, LTX-2's and diffusers' module names), mixed with LoRA
files by both rules, into bf16 and fp8 weights, byte for byte against ltx2blas.reference with the
scale computed as ComfyUI computes it; and malformed files refused, naming the file and key,
with nothing written."""
import numpy as np
import pytest

import ltx2blas
from ltx2blas import LoHa, LoKr, errors, reference

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q, K, FF = ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_k",
            "transformer_blocks.0.ff.net.0.proj")


def loha_tensors(rng, key, shape, ranks=(4, 6), alpha=None, dtype="BF16"):
    """A LoHa's tensors for the module spelled ``key`` (its prefix included)."""
    (out_f, in_f), (r1, r2) = shape, ranks
    t = {}
    for n, r in (("1", r1), ("2", r2)):
        t[f"{key}.hada_w{n}_a"] = random_bf16(rng, (out_f, r), 0.2)
        t[f"{key}.hada_w{n}_b"] = random_bf16(rng, (r, in_f), 0.2)
    tensors = {k: ("BF16", v) for k, v in t.items()}
    if dtype == "F16":
        tensors = {k: ("F16", reference.bf16_widen(v).astype(np.float16)) for k, v in t.items()}
    if alpha is not None:
        tensors[f"{key}.alpha"] = ("F32", np.array(alpha, np.float32))
    return tensors


def loha_item(tensors, key, scale):
    v = {k.rpartition(".")[2]: val for k, (_, val) in tensors.items() if k.startswith(key + ".")}
    bits = {k: (x if x.dtype == np.uint16 else reference.bf16_round(x.astype(np.float32)))
            for k, x in v.items() if k != "alpha"}
    return LoHa(bits["hada_w1_a"], bits["hada_w1_b"], bits["hada_w2_a"], bits["hada_w2_b"], scale)


def lokr_tensors(rng, key, shape, w1, w2_rank=None, w1_rank=None, alpha=None):
    """A LoKr's tensors: w1 [w1] whole (or a pair of w1_rank), w2 the rest, whole or a pair of
    w2_rank."""
    m1, n1 = w1
    m2, n2 = shape[0] // m1, shape[1] // n1
    t = {}
    for name, (m, n), rank in (("w1", (m1, n1), w1_rank), ("w2", (m2, n2), w2_rank)):
        if rank is None:
            t[f"{key}.lokr_{name}"] = ("BF16", random_bf16(rng, (m, n), 0.3))
        else:
            t[f"{key}.lokr_{name}_a"] = ("BF16", random_bf16(rng, (m, rank), 0.3))
            t[f"{key}.lokr_{name}_b"] = ("BF16", random_bf16(rng, (rank, n), 0.3))
    if alpha is not None:
        t[f"{key}.alpha"] = ("F32", np.array(alpha, np.float32))
    return t


def lokr_item(tensors, key, scale):
    v = {k.rpartition(".")[2]: val for k, (_, val) in tensors.items() if k.startswith(key + ".")}

    def factor(name):
        return v[name] if name in v else (v[name + "_a"], v[name + "_b"])
    return LoKr(factor("lokr_w1"), factor("lokr_w2"), scale)


def read(path):
    with ltx2blas.files.safetensors.SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}


@pytest.fixture
def model(tmp_path, rng):
    tensors = ck.model(rng)
    tensors[M + "patchify_proj.weight"] = ("BF16", random_bf16(rng, (64, 32), 0.02))
    return ck.write(tmp_path / "model.safetensors", tensors), tensors


SPELLINGS = {
    # ComfyUI's generic map, dotted; LyCORIS' own prefix, flattened; kohya's, flattened;
    # diffusers' module names with PEFT's transformer prefix
    "comfy": lambda m: "diffusion_model." + m,
    "lycoris": lambda m: "lycoris_" + m.replace(".", "_"),
    "kohya": lambda m: "lora_unet_" + m.replace(".", "_"),
    "diffusers": lambda m: "transformer." + ltx2blas.files.keys.to_diffusers(m),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_a_loha_and_a_lokr_in_every_spelling(model, tmp_path, rng, spelling):
    path, tensors = model
    name = SPELLINGS[spelling]
    ha = {**loha_tensors(rng, name(Q), (64, 48), alpha=2.0),
          **loha_tensors(rng, name("patchify_proj"), (64, 32), ranks=(3, 3))}
    kr = {**lokr_tensors(rng, name(K), (64, 48), (4, 6), w2_rank=5, alpha=3.0),
          **lokr_tensors(rng, name(FF), (96, 48), (8, 4), w1_rank=2, alpha=4.0)}
    ck.write(tmp_path / "ha.safetensors", ha)
    ck.write(tmp_path / "kr.safetensors", kr)
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(path, [(tmp_path / "ha.safetensors", 0.7),
                                             (tmp_path / "kr.safetensors", -1.2)], out)
    got = read(out)
    want = {
        Q: [loha_item(ha, name(Q), reference.lycoris_scale(0.7, 2.0, 4))],
        "patchify_proj": [loha_item(ha, name("patchify_proj"), np.float32(0.7))],  # no alpha
        K: [lokr_item(kr, name(K), reference.lycoris_scale(-1.2, 3.0, 5))],
        FF: [lokr_item(kr, name(FF), reference.lycoris_scale(-1.2, 4.0, 2))],
    }
    for module, items in want.items():
        assert np.array_equal(got[M + module + ".weight"],
                              reference.fuse_loras(tensors[M + module + ".weight"][1], items)), module
    assert report.modules_fused == 4
    summary = report.summary()
    assert "2 modules (2 LoHa;" in summary and "2 modules (2 LoKr;" in summary


@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_mixed_with_a_lora_by_each_rule(model, tmp_path, rng, rule):
    path, tensors = model
    lora = ck.adapter(rng, [Q, K], rank=8)
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48), alpha=8.0)
    kr = lokr_tensors(rng, "lycoris_" + Q.replace(".", "_"), (64, 48), (2, 3), w2_rank=4)
    files = [ck.write(tmp_path / f"{n}.safetensors", t)
             for n, t in (("lora", lora), ("ha", ha), ("kr", kr))]
    out = tmp_path / "out.safetensors"
    strengths = (0.8, 0.5, 1.5)
    ltx2blas.fuse_checkpoint(path, list(zip(files, strengths)), out, rule=rule, threads=2)
    items = [(lora["diffusion_model." + Q + ".lora_A.weight"][1],
              lora["diffusion_model." + Q + ".lora_B.weight"][1], 0.8),
             loha_item(ha, "diffusion_model." + Q, reference.lycoris_scale(0.5, 8.0, 4)),
             lokr_item(kr, "lycoris_" + Q.replace(".", "_"), np.float32(1.5))]
    got = read(out)
    assert np.array_equal(got[M + Q + ".weight"],
                          reference.fuse_loras(tensors[M + Q + ".weight"][1], items, rule=rule))


def test_fp8_weights(tmp_path, rng):
    tensors = ck.model(rng, fp8="F8_E4M3")
    path = ck.write(tmp_path / "model.safetensors", tensors)
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48), alpha=2.0)
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (8, 8), w2_rank=2)
    ck.write(tmp_path / "ha.safetensors", ha)
    ck.write(tmp_path / "kr.safetensors", kr)
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(path, [(tmp_path / "ha.safetensors", 1.0),
                                    (tmp_path / "kr.safetensors", 1.0)], out)
    items = [loha_item(ha, "diffusion_model." + Q, reference.lycoris_scale(1.0, 2.0, 4)),
             lokr_item(kr, "diffusion_model." + Q, np.float32(1.0))]
    assert np.array_equal(read(out)[M + Q + ".weight"],
                          reference.fuse_loras_fp8(tensors[M + Q + ".weight"][1], items, "F8_E4M3"))


def test_f16_factors_are_rounded_to_bf16_and_reported(model, tmp_path, rng):
    path, tensors = model
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48), dtype="F16")
    ck.write(tmp_path / "ha.safetensors", ha)
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(path, [(tmp_path / "ha.safetensors", 1.0)], out)
    assert len(report.adapters[0].rounded_to_bf16) == 4
    assert np.array_equal(read(out)[M + Q + ".weight"], reference.fuse_loras(
        tensors[M + Q + ".weight"][1], [loha_item(ha, "diffusion_model." + Q, np.float32(1.0))]))


def test_an_alpha_beside_two_whole_lokr_factors_is_not_applied(model, tmp_path, rng):
    """ComfyUI divides alpha by a low-rank factor's rank; with none it leaves alpha out."""
    path, tensors = model
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (4, 4), alpha=16.0)
    ck.write(tmp_path / "kr.safetensors", kr)
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(path, [(tmp_path / "kr.safetensors", 0.9)], out)
    assert report.adapters[0].alpha_ignored == 1 and report.adapters[0].alpha_scaled == 0
    assert np.array_equal(read(out)[M + Q + ".weight"], reference.fuse_loras(
        tensors[M + Q + ".weight"][1], [lokr_item(kr, "diffusion_model." + Q, np.float32(0.9))]))


def _refused(model, tmp_path, adapter, error, match):
    path, _ = model
    ck.write(tmp_path / "bad.safetensors", adapter)
    out = tmp_path / "out.safetensors"
    with pytest.raises(error, match=match):
        ltx2blas.fuse_checkpoint(path, [(tmp_path / "bad.safetensors", 1.0)], out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()
            if p.name not in ("model.safetensors", "bad.safetensors")] == []


def test_a_missing_factor_is_refused(model, tmp_path, rng):
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48))
    del ha["diffusion_model." + Q + ".hada_w2_b"]
    _refused(model, tmp_path, ha, errors.KeyMatchError,
             r"bad.safetensors: module 'diffusion_model.transformer_blocks.0.attn1.to_q' is a "
             r"LoHa without .hada_w2_b")
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (4, 4), w2_rank=3)
    del kr["diffusion_model." + Q + ".lokr_w2_a"]
    _refused(model, tmp_path, kr, errors.KeyMatchError, r"is a LoKr without .lokr_w2 or "
             r".lokr_w2_a and .lokr_w2_b \(it has .lokr_w2_b alone\)")


def test_factors_whose_product_is_not_the_weights_are_refused(model, tmp_path, rng):
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (4, 4))
    kr["diffusion_model." + Q + ".lokr_w2"] = ("BF16", random_bf16(rng, (16, 10)))
    _refused(model, tmp_path, kr, errors.ShapeError,
             r"the Kronecker product of w1 \[4, 4\] and w2 \[16, 10\] is \[64, 40\], not weight "
             r"model.diffusion_model.transformer_blocks.0.attn1.to_q.weight \[64, 48\]")
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48))
    ha["diffusion_model." + Q + ".hada_w1_b"] = ("BF16", random_bf16(rng, (4, 40)))
    _refused(model, tmp_path, ha, errors.ShapeError,
             r"hada_w1_a \[64, 4\] and hada_w1_b \[4, 40\] do not fit")


def test_non_finite_values_are_refused_naming_file_and_tensor(model, tmp_path, rng):
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48))
    ha["diffusion_model." + Q + ".hada_w2_a"][1][5, 1] = 0x7FC0
    _refused(model, tmp_path, ha, errors.NonFiniteInputError,
             r"bad.safetensors: adapter tensor 'diffusion_model.transformer_blocks.0.attn1.to_q"
             r".hada_w2_a' holds nan at \(5, 1\)")


@pytest.mark.parametrize("key, match", [
    (".lokr_t2", "LoKr with a Tucker core"),
    (".dora_scale", "DoRA's weight decomposition"),
    (".lora_down.weight", "mixes the tensors of two adapter kinds"),
])
def test_forms_not_fused_are_refused(model, tmp_path, rng, key, match):
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (4, 4), w2_rank=3)
    kr["diffusion_model." + Q + key] = ("BF16", random_bf16(rng, (3, 3)))
    _refused(model, tmp_path, kr, errors.KeyMatchError, match)


def test_a_whole_factor_beside_its_pair_is_refused(model, tmp_path, rng):
    kr = lokr_tensors(rng, "diffusion_model." + Q, (64, 48), (4, 4), w2_rank=3)
    kr["diffusion_model." + Q + ".lokr_w2"] = ("BF16", random_bf16(rng, (16, 12)))
    _refused(model, tmp_path, kr, errors.KeyMatchError, "holds .lokr_w2 whole and as the pair")


def test_a_fused_loha_and_lokr_verify_and_a_changed_factor_is_named(model, tmp_path, rng):
    path, _ = model
    ha = loha_tensors(rng, "diffusion_model." + Q, (64, 48), alpha=2.0)
    kr = lokr_tensors(rng, "lycoris_" + K.replace(".", "_"), (64, 48), (4, 6), w2_rank=5,
                      alpha=3.0)
    files = [ck.write(tmp_path / "ha.safetensors", ha), ck.write(tmp_path / "kr.safetensors", kr)]
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(path, [(files[0], 0.7), (files[1], -1.2)], out)
    report = ltx2blas.verify_checkpoint(out, path, [files[0], files[1]], threads=1)
    assert report.status == "verified", report.summary()
    kr["lycoris_" + K.replace(".", "_") + ".lokr_w2_b"][1][0, 0] ^= 1
    ck.write(files[1], kr)
    report = ltx2blas.verify_checkpoint(out, path, [files[0], files[1]], threads=1)
    assert report.status == "differs" and "lokr_w2_b" in report.summary()


def test_a_state_dict_in_place(model, tmp_path, rng):
    _, tensors = model
    state = {name: value.copy() for name, (_, value) in tensors.items()}
    kr = lokr_tensors(rng, "diffusion_model." + FF, (96, 48), (8, 4), w1_rank=2, alpha=4.0)
    ck.write(tmp_path / "kr.safetensors", kr)
    ltx2blas.fuse_state_dict(state, [(tmp_path / "kr.safetensors", 0.6)])
    want = reference.fuse_loras(tensors[M + FF + ".weight"][1],
                                [lokr_item(kr, "diffusion_model." + FF,
                                           reference.lycoris_scale(0.6, 4.0, 2))])
    assert np.array_equal(state[M + FF + ".weight"], want)
    assert np.array_equal(state[M + Q + ".weight"], tensors[M + Q + ".weight"][1])
