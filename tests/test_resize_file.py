"""ltx2blas resize / resize_lora on files: each pair as resize_lora_weight makes it, the scale
folded in and .alpha the new rank, keys and order kept, the result fused back through
ltx2blas fuse, and what cannot be resized refused before anything is written."""
import json

import numpy as np
import pytest

import ltx2blas
from ltx2blas import cli, reference
from ltx2blas.errors import ArgumentError, FormatError, ShapeError
from ltx2blas.files.resize import resize_lora
from ltx2blas.files.safetensors import SafetensorsFile
from ltx2blas.resize import resize_lora_weight

import ckpt_helpers as ck
from helpers import random_bf16


def low_rank_lora(rng, path, spelling="comfy", rank=16, alpha=8.0, modules=ck.MODULES):
    """A LoRA of ``rank`` on every module of ck.MODULES, with a decaying spectrum (a trained
    one's falls off); kohya/ComfyUI keys with .alpha, or upstream's (``ltx``) without."""
    tensors = {}
    for module, (out, inn) in modules.items():
        a = random_bf16(rng, (rank, inn), 0.1)
        b = reference.bf16_round((reference.bf16_widen(random_bf16(rng, (out, rank), 0.1))
                                  * 0.8 ** np.arange(rank)).astype(np.float32))
        if spelling == "comfy":
            tensors[f"diffusion_model.{module}.lora_down.weight"] = ("BF16", a)
            tensors[f"diffusion_model.{module}.lora_up.weight"] = ("BF16", b)
            tensors[f"diffusion_model.{module}.alpha"] = ("F32", np.array(alpha, np.float32))
        else:
            tensors[f"diffusion_model.{module}.lora_A.weight"] = ("BF16", a)
            tensors[f"diffusion_model.{module}.lora_B.weight"] = ("BF16", b)
    return ck.write(path, tensors, {"ss_network_dim": str(rank), "ss_network_alpha": str(alpha)})


def tensors(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}, dict(f.metadata), list(f.tensors)


def test_each_pair_is_resize_lora_weight_of_its_scaled_delta(rng, tmp_path):
    """kohya/ComfyUI keys with alpha 8 at rank 16: each new pair is resize_lora_weight of the
    pair at scale 8 / 16, its .alpha the new rank; the keys in the input's order; kohya's
    network dim and alpha the new rank."""
    lora = low_rank_lora(rng, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    report = resize_lora(lora, out, rank=4)
    before, _, order_in = tensors(lora)
    after, metadata, order_out = tensors(out)
    assert order_out == order_in
    for module in ck.MODULES:
        stem = f"diffusion_model.{module}"
        want = resize_lora_weight(before[stem + ".lora_down.weight"],
                                  before[stem + ".lora_up.weight"], scale=0.5, rank=4)
        assert after[stem + ".lora_down.weight"].tobytes() == want.lora_a.tobytes()
        assert after[stem + ".lora_up.weight"].tobytes() == want.lora_b.tobytes()
        assert after[stem + ".alpha"] == np.float32(4)
        assert report.ranks[stem] == (16, 4, pytest.approx(want.kept))
    assert metadata["ss_network_dim"] == metadata["ss_network_alpha"] == "4"
    recorded = json.loads(metadata["ltx2blas.resized"])
    assert recorded["rule"] == "rank" and recorded["value"] == 4
    assert "resized 4 LoRA modules by rank 4" in report.summary()
    assert "its .alpha tensors" in report.summary()


def test_the_resized_file_fuses_to_the_optimum(rng, tmp_path):
    """Fused back through ltx2blas fuse: each weight is W + B'A' at scale 1 (alpha = rank),
    byte for byte fuse_loras of the new factors, and its distance from the original fuse's
    delta is the optimum's to within the bf16 rounding of the factors and of the weight."""
    base = ck.write(tmp_path / "model.safetensors", ck.model(rng))
    lora = low_rank_lora(rng, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    resize_lora(lora, out, sv_fro=0.95)
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(base, [(out, 1.0)], fused, digests=False)
    model_tensors, _, _ = tensors(base)
    new, _, _ = tensors(out)
    old, _, _ = tensors(lora)
    got, _, _ = tensors(fused)
    for module in ck.MODULES:
        stem = f"diffusion_model.{module}"
        w = model_tensors[f"model.diffusion_model.{module}.weight"]
        a, b = new[stem + ".lora_down.weight"], new[stem + ".lora_up.weight"]
        assert got[f"model.diffusion_model.{module}.weight"].tobytes() == \
            ltx2blas.fuse_loras(w, [(a, b, 1.0)]).tobytes()
        delta = 0.5 * (reference.bf16_widen(old[stem + ".lora_up.weight"]).astype(np.float64)
                       @ reference.bf16_widen(old[stem + ".lora_down.weight"]).astype(np.float64))
        s = np.linalg.svd(delta, compute_uv=False)
        k = a.shape[0]
        best = np.sqrt(np.sum(s[k:] ** 2))
        approx = reference.bf16_widen(b).astype(np.float64) @ reference.bf16_widen(a).astype(
            np.float64)
        # bf16 factors: each element's relative rounding 2^-8 at most, on the kept part
        assert np.linalg.norm(delta - approx) <= best + 2.0 ** -7 * np.sqrt(np.sum(s[:k] ** 2))


def test_upstream_keys_gain_an_alpha_and_alpha_ignore(rng, tmp_path):
    """Upstream LTX-2's keys (no alpha): scale 1 folded, an .alpha added after each lora_B.  A
    kohya file under alpha='ignore' (as upstream reads it): its alpha not folded in."""
    lora = low_rank_lora(rng, tmp_path / "in.safetensors", spelling="ltx")
    out = tmp_path / "out.safetensors"
    resize_lora(lora, out, rank=3)
    after, _, order = tensors(out)
    stem = "diffusion_model." + next(iter(ck.MODULES))
    assert order.index(stem + ".alpha") == order.index(stem + ".lora_B.weight") + 1
    assert after[stem + ".alpha"] == np.float32(3)
    before, _, _ = tensors(lora)
    want = resize_lora_weight(before[stem + ".lora_A.weight"], before[stem + ".lora_B.weight"],
                              rank=3)
    assert after[stem + ".lora_A.weight"].tobytes() == want.lora_a.tobytes()
    kohya = low_rank_lora(rng, tmp_path / "k.safetensors")
    ignored = tmp_path / "ignored.safetensors"
    report = resize_lora(kohya, ignored, rank=3, alpha="ignore")
    before, _, _ = tensors(kohya)
    after, _, _ = tensors(ignored)
    stem = "diffusion_model." + next(iter(ck.MODULES))
    want = resize_lora_weight(before[stem + ".lora_down.weight"],
                              before[stem + ".lora_up.weight"], rank=3)
    assert after[stem + ".lora_down.weight"].tobytes() == want.lora_a.tobytes()
    assert "alpha='ignore'" in report.summary()


def test_dynamic_rules_and_the_command_line(rng, tmp_path, capsys):
    lora = low_rank_lora(rng, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    assert cli.main([ "resize", str(lora), "-o", str(out), "--sv-fro", "0.9", "--max-rank",
                     "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rule"] == "sv_fro" and data["max_rank"] == 6
    ranks = {m: v["rank"] for m, v in data["ranks"].items()}
    assert all(1 <= r <= 6 for r in ranks.values())
    before, _, _ = tensors(lora)
    for module, r in ranks.items():
        want = resize_lora_weight(before[module + ".lora_down.weight"],
                                  before[module + ".lora_up.weight"], scale=0.5, sv_fro=0.9,
                                  max_rank=6)
        assert want.rank == r
    assert cli.main(["resize", str(lora), "-o", str(tmp_path / "v.safetensors"), "--energy",
                     "0.99", "-v", "-q"]) == 0
    text = capsys.readouterr().out
    assert "resized 4 LoRA modules by energy 0.99" in text and "rank 16 -> " in text


def test_refusals_write_nothing(rng, tmp_path, capsys):
    lora = low_rank_lora(rng, tmp_path / "in.safetensors")
    out = tmp_path / "out.safetensors"
    with pytest.raises(ShapeError, match="larger than the LoRA's product allows"):
        resize_lora(lora, out, rank=17)
    with pytest.raises(ArgumentError, match="is an input file"):
        resize_lora(lora, lora, rank=2)
    with pytest.raises(ArgumentError, match="give one of"):
        resize_lora(lora, out)
    assert cli.main(["resize", str(lora), "-o", str(out)]) == 2
    assert cli.main(["resize", str(lora), "-o", str(out), "--rank", "2", "--energy",
                     "0.5"]) == 2
    module = "diffusion_model." + next(iter(ck.MODULES))
    before, _, _ = tensors(lora)
    dora = dict((k, ("BF16" if v.dtype == np.uint16 else "F32", v)) for k, v in before.items())
    dora[module + ".lora_magnitude_vector"] = ("BF16", random_bf16(rng, (64,), 1.0))
    path = ck.write(tmp_path / "dora.safetensors", dora)
    with pytest.raises(FormatError, match="DoRA"):
        resize_lora(path, out, rank=2)
    loha = {module + ".hada_w1_a": ("BF16", random_bf16(rng, (64, 4))),
            module + ".hada_w1_b": ("BF16", random_bf16(rng, (4, 48))),
            module + ".hada_w2_a": ("BF16", random_bf16(rng, (64, 4))),
            module + ".hada_w2_b": ("BF16", random_bf16(rng, (4, 48)))}
    with pytest.raises(FormatError, match="LoHa"):
        resize_lora(ck.write(tmp_path / "loha.safetensors", loha), out, rank=2)
    half = {k: v for k, v in dora.items() if not k.endswith(".lora_up.weight")
            and "magnitude" not in k}
    with pytest.raises(FormatError, match="has no lora_B"):
        resize_lora(ck.write(tmp_path / "half.safetensors", half), out, rank=2)
    capsys.readouterr()
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_peft_metadata_scale_is_folded_and_the_metadata_left_out(rng, tmp_path):
    """A diffusers file (no .alpha; PEFT's lora_adapter_metadata, r 8, lora_alpha 4): the scale
    4 / 8 folded in, each pair given .alpha = its new rank, the metadata that described the old
    ranks left out; the result fuses as the original's optimum, at scale 1."""
    from test_peft_metadata import MODULES, diffusers_adapter, metadata

    adapter = diffusers_adapter(rng, {m: 8 for m in MODULES})
    lora = ck.write(tmp_path / "d.safetensors", adapter, metadata(lora_alpha=4))
    out = tmp_path / "out.safetensors"
    report = resize_lora(lora, out, rank=2)
    after, meta, _ = tensors(out)
    assert "lora_adapter_metadata" not in meta
    for m in MODULES:
        stem = "transformer." + m
        want = resize_lora_weight(adapter[stem + ".lora_A.weight"][1],
                                  adapter[stem + ".lora_B.weight"][1], scale=0.5, rank=2)
        assert after[stem + ".lora_A.weight"].tobytes() == want.lora_a.tobytes()
        assert after[stem + ".alpha"] == np.float32(2)
    assert "lora_adapter_metadata" in report.summary()


# ---- merge ----

def test_merge_of_stacked_loras_is_exact_where_the_rank_allows(rng, tmp_path):
    """Two LoRAs (kohya keys with alpha 8 at rank 16; upstream keys at rank 6, no alpha) at
    strengths 0.8 and -0.5: at --rank 22, the sum of the ranks, every module's delta is the
    summed delta to the factors' f32 rounding; below it the optimum of the sum (checked by an f64
    SVD of the formed sum); keys in the first input's spelling, .alpha the rank; fused back by
    ltx2blas fuse at scale 1."""
    from ltx2blas.files.resize import merge_loras

    first = low_rank_lora(rng, tmp_path / "a.safetensors")
    second = low_rank_lora(rng, tmp_path / "b.safetensors", spelling="ltx", rank=6)
    old_a, _, _ = tensors(first)
    old_b, _, _ = tensors(second)

    def summed(module):
        stem = f"diffusion_model.{module}"
        w = lambda t, k: reference.bf16_widen(t[k]).astype(np.float64)  # noqa: E731
        return (0.8 * 0.5 * w(old_a, stem + ".lora_up.weight") @ w(old_a, stem + ".lora_down.weight")
                - 0.5 * w(old_b, stem + ".lora_B.weight") @ w(old_b, stem + ".lora_A.weight"))

    whole = tmp_path / "whole.safetensors"
    report = merge_loras([(first, 0.8), (second, -0.5)], whole, rank=22, dtype="f32")
    got, metadata, order = tensors(whole)
    assert report.keys == "comfy" and report.exact == len(ck.MODULES)
    for module in ck.MODULES:
        stem = f"diffusion_model.{module}"
        assert got[stem + ".alpha"] == np.float32(22)
        product = got[stem + ".lora_up.weight"].astype(np.float64) @ \
            got[stem + ".lora_down.weight"].astype(np.float64)
        delta = summed(module)
        # f32 factors of a rank-22 SVD: 2^-23 relative on each, a few times ||delta||
        assert np.linalg.norm(product - delta) <= 1e-6 * np.linalg.norm(delta)
    assert json.loads(metadata["ltx2blas.merged"])["inputs"][1] == {"file": "b.safetensors",
                                                                     "strength": -0.5}
    small = tmp_path / "small.safetensors"
    merge_loras([(first, 0.8), (second, -0.5)], small, rank=5, dtype="f32")
    got, _, _ = tensors(small)
    for module in ck.MODULES:
        stem = f"diffusion_model.{module}"
        delta = summed(module)
        s = np.linalg.svd(delta, compute_uv=False)
        best = np.sqrt(np.sum(s[5:] ** 2))
        product = got[stem + ".lora_up.weight"].astype(np.float64) @ \
            got[stem + ".lora_down.weight"].astype(np.float64)
        assert np.linalg.norm(product - delta) <= 1.001 * best + 1e-6 * np.linalg.norm(delta)
    base = ck.write(tmp_path / "model.safetensors", ck.model(rng))
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(base, [(small, 1.0)], fused, digests=False)
    model_tensors, _, _ = tensors(base)
    out, _, _ = tensors(fused)
    for module in ck.MODULES:
        stem = f"diffusion_model.{module}"
        w = model_tensors[f"model.diffusion_model.{module}.weight"]
        # f32 factors: the fuse takes them rounded to bf16, as it does any f32 adapter
        a = reference.bf16_round(got[stem + ".lora_down.weight"])
        b = reference.bf16_round(got[stem + ".lora_up.weight"])
        assert out[f"model.diffusion_model.{module}.weight"].tobytes() == \
            ltx2blas.fuse_loras(w, [(a, b, 1.0)]).tobytes()


def test_merge_refusals_and_the_command_line(rng, tmp_path, capsys):
    from ltx2blas.files.resize import merge_loras

    first = low_rank_lora(rng, tmp_path / "a.safetensors")
    other = {m: (s[0] * 2, s[1]) for m, s in ck.MODULES.items()}
    wrong = low_rank_lora(rng, tmp_path / "w.safetensors", modules=other)
    out = tmp_path / "out.safetensors"
    with pytest.raises(ShapeError, match="differ in shape"):
        merge_loras([(first, 1.0), (wrong, 1.0)], out, rank=4)
    with pytest.raises(ArgumentError, match="is an input file"):
        merge_loras([(first, 1.0)], first, rank=4)
    module = "diffusion_model." + next(iter(ck.MODULES))
    before, _, _ = tensors(first)
    dora = dict((k, ("BF16" if v.dtype == np.uint16 else "F32", v)) for k, v in before.items())
    dora[module + ".lora_magnitude_vector"] = ("BF16", random_bf16(rng, (64,), 1.0))
    with pytest.raises(FormatError, match="DoRA"):
        merge_loras([(first, 1.0), (ck.write(tmp_path / "d.safetensors", dora), 1.0)], out,
                    rank=4)
    assert not out.exists()
    second = low_rank_lora(rng, tmp_path / "b.safetensors", spelling="ltx", rank=4)
    assert cli.main(["merge", f"{first}:0.7", str(second), "-o", str(out), "--energy", "0.99",
                     "--keys", "ltx", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["keys"] == "ltx" and data["inputs"][0]["strength"] == 0.7
    merged, _, _ = tensors(out)
    assert "diffusion_model." + next(iter(ck.MODULES)) + ".lora_A.weight" in merged
    assert cli.main(["merge", str(first), "-o", str(tmp_path / "x.safetensors")]) == 2


def test_merge_takes_loha_lokr_and_full_differences_exactly(rng, tmp_path):
    """A LoHa ((P Q) . (R S), alpha 4 over its rank 8: 0.5), a LoKr (kron(W1, W2a W2b), W1 whole,
    alpha 2 over W2's rank 4: 0.5) and a full difference, beside a LoRA: each written as a
    product of its own (Khatri-Rao rows, Kronecker factors, D I), stacked and re-factored, so at
    a rank that holds the sum the merged LoRA is the summed delta to f32 rounding, and below it
    the optimum of the sum (an f64 SVD of the formed sum, in this test)."""
    from ltx2blas.files.resize import merge_loras

    out_f, in_f = 64, 48
    module = "diffusion_model.transformer_blocks.0.attn1.to_q"
    f = lambda *shape: random_bf16(rng, shape, 0.1)  # noqa: E731
    w = lambda x: reference.bf16_widen(x).astype(np.float64)  # noqa: E731
    p, q, r, s = f(out_f, 8), f(8, in_f), f(out_f, 8), f(8, in_f)
    loha = ck.write(tmp_path / "loha.safetensors", {
        module + ".hada_w1_a": ("BF16", p), module + ".hada_w1_b": ("BF16", q),
        module + ".hada_w2_a": ("BF16", r), module + ".hada_w2_b": ("BF16", s),
        module + ".alpha": ("F32", np.array(4.0, np.float32))})
    w1, w2a, w2b = f(4, 4), f(16, 4), f(4, 12)
    lokr = ck.write(tmp_path / "lokr.safetensors", {
        module + ".lokr_w1": ("BF16", w1), module + ".lokr_w2_a": ("BF16", w2a),
        module + ".lokr_w2_b": ("BF16", w2b), module + ".alpha": ("F32", np.array(2.0,
                                                                                   np.float32))})
    d = rng.standard_normal((out_f, in_f)).astype(np.float32) * 0.01
    diff = ck.write(tmp_path / "diff.safetensors", {module + ".diff": ("F32", d)})
    a, b = f(6, in_f), f(out_f, 6)
    lora = ck.write(tmp_path / "lora.safetensors", {module + ".lora_A.weight": ("BF16", a),
                                                    module + ".lora_B.weight": ("BF16", b)})
    summed = (0.7 * 0.5 * (w(p) @ w(q)) * (w(r) @ w(s))
              + 0.5 * np.kron(w(w1), w(w2a) @ w(w2b))
              - 0.3 * d.astype(np.float64)
              + w(b) @ w(a))
    inputs = [(lora, 1.0), (loha, 0.7), (lokr, 1.0), (diff, -0.3)]
    whole = tmp_path / "whole.safetensors"
    report = merge_loras(inputs, whole, rank=48, dtype="f32")
    got, _, _ = tensors(whole)
    product = got[module + ".lora_B.weight"].astype(np.float64) @ \
        got[module + ".lora_A.weight"].astype(np.float64)
    assert report.exact == 1
    assert np.linalg.norm(product - summed) <= 1e-6 * np.linalg.norm(summed)
    small = tmp_path / "small.safetensors"
    merge_loras(inputs, small, rank=10, dtype="f32")
    got, _, _ = tensors(small)
    product = got[module + ".lora_B.weight"].astype(np.float64) @ \
        got[module + ".lora_A.weight"].astype(np.float64)
    sv = np.linalg.svd(summed, compute_uv=False)
    best = np.sqrt(np.sum(sv[10:] ** 2))
    assert np.linalg.norm(product - summed) <= 1.001 * best + 1e-6 * np.linalg.norm(summed)
