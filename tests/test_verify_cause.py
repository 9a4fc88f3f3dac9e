"""ltx2blas verify says what is wrong first: findings about the inputs before the tensors they
make differ, a class for every tensor that differs (the same inputs under another rounding, or
different inputs), measured against the magnitude of what was added, and the multiple of the
delta that fits every differing weight of every adapter kind.

Other tools' files are written here in numpy from their rules: ComfyUI's (the weight and each
adapter's f32 product added in f32, rounded to bf16 once), PEFT's (the f32 product times its
scaling rounded to bf16, added to the bf16 weight), and LyCORIS' merge_to, which applies
alpha / dim twice."""
import json
import subprocess
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import reference
from ltx2blas.files.verify import verify_checkpoint

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q, K, FF, Q1 = ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_k",
                "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.1.attn1.to_q")
P = "diffusion_model."


def f32(bits):
    return reference.bf16_widen(bits)


def lora_terms(a1, a2, strengths, absolute=False):
    """{module: [(f32 product B @ A in numpy's own order, scale)]} of the two LoRA files, each
    scale strength x alpha / rank as both tools take it (a1 has no alpha, a2 alpha 10 rank
    5); ``absolute``: |B| @ |A|."""
    value = (lambda bits: np.abs(f32(bits))) if absolute else f32
    terms = {}
    for tensors, prefix, down, up, k, s in (
            (a1, P, ".lora_A.weight", ".lora_B.weight", 1.0, strengths[0]),
            (a2, "", ".lora_down.weight", ".lora_up.weight", 10 / 5, strengths[1])):
        for key in tensors:
            if key.endswith(down):
                module = key[len(prefix):-len(down)]
                b, a = tensors[prefix + module + up][1], tensors[key][1]
                terms.setdefault(module, []).append((value(b) @ value(a), s * k))
    return terms


def comfyui(model, terms, dst):
    """ComfyUI's fuse: W in f32, each term's f32(scale) x its f32 product added in f32, one
    rounding to bf16."""
    tensors = dict(model)
    for module, ts in terms.items():
        acc = f32(model[M + module + ".weight"][1])
        for prod, s in ts:
            acc = acc + np.float32(s) * prod.astype(np.float32)
        tensors[M + module + ".weight"] = ("BF16", reference.bf16_round(acc))
    return ck.write(dst, tensors)


def peft(model, terms, dst):
    """PEFT's merge on a CPU: the f32 product times its scaling, rounded to bf16, added to the
    bf16 weight (one bf16 rounding per adapter)."""
    tensors = dict(model)
    for module, ts in terms.items():
        w = model[M + module + ".weight"][1]
        for prod, s in ts:
            d = reference.bf16_round(prod.astype(np.float32) * np.float32(s))
            w = reference.bf16_round(f32(w) + f32(d))
        tensors[M + module + ".weight"] = ("BF16", w)
    return ck.write(dst, tensors)


@pytest.fixture
def files(tmp_path, rng):
    model = ck.model(rng)
    a1 = ck.adapter(rng, [Q, FF], rank=8)
    a2 = ck.adapter(rng, [Q, Q1], rank=5, prefix="", style="kohya", alpha=10.0)
    wrong = ck.adapter(rng, [Q, FF], rank=8)
    paths = {"model": ck.write(tmp_path / "model.safetensors", model, {"format": "pt"}),
             "a1": ck.write(tmp_path / "a1.safetensors", a1),
             "a2": ck.write(tmp_path / "a2.safetensors", a2),
             "wrong": ck.write(tmp_path / "wrong.safetensors", wrong),
             "out": tmp_path / "out.safetensors"}
    ltx2blas.fuse_checkpoint(paths["model"], [(paths["a1"], 0.8), (paths["a2"], -1.5)],
                             paths["out"], threads=2)
    paths["comfyui"] = comfyui(model, lora_terms(a1, a2, (0.8, -1.5)),
                               tmp_path / "comfyui.safetensors")
    paths["peft"] = peft(model, lora_terms(a1, a2, (0.8, -1.5)), tmp_path / "peft.safetensors")
    paths["half"] = comfyui(model, lora_terms(a1, a2, (0.4, -0.75)),
                            tmp_path / "half.safetensors")
    return paths, model, a1, a2


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd="/")


def inputs(paths, first="a1", second="a2", s1=0.8, s2=-1.5):
    return ["--model", paths["model"], "--lora", f"{paths[first]}:{s1}",
            "--lora", f"{paths[second]}:{s2}"]


def verify_json(fused, args):
    """(exit code, --json's object) of verify_checkpoint with the command's arguments: the
    object the command prints (one test runs the command itself)."""
    model, loras = None, []
    for flag, value in zip(args[::2], args[1::2]):
        if flag == "--model":
            model = value
        else:
            path, _, strength = str(value).rpartition(":")
            loras.append((path, float(strength)) if path else value)
    report = verify_checkpoint(fused, model, loras)
    return report.exit_code, json.loads(json.dumps(report.as_dict()))


# -- 1. the cause first --------------------------------------------------------------------

def test_adapters_given_in_another_order_are_the_first_line(files):
    paths = files[0]
    r = run_cli("verify", paths["out"], *inputs(paths, "a2", "a1", -1.5, 0.8))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("DIFFERS: ") and "given in another order" in lines[0], r.stdout
    assert lines[1].startswith("  order: adapter 0 (a2.safetensors) was fused as adapter 1")
    assert lines[2].startswith("  order: adapter 1 (a1.safetensors) was fused as adapter 0")
    # then the class counts of the tensors, then the tensors: the one weight both adapters
    # change, whose addmm rounds the other adapter's delta first
    assert lines[3] == "  of the tensors that differ: 1 the same inputs under another rounding"
    assert lines[4].startswith(f"  rebuilt: {M + Q}.weight: differs from the rebuild")
    code, js = verify_json(paths["out"], inputs(paths, "a2", "a1", -1.5, 0.8))
    assert code == 1 and js["cause_class"] == "order" and "another order" in js["cause"]
    assert [f["what"] for f in js["findings"]] == ["order", "order", "rebuilt"]
    assert js["classes"] == {"rounding": 1}


def test_a_wrong_adapter_file_is_named_in_one_line_first(files):
    paths = files[0]
    r = run_cli("verify", paths["out"], *inputs(paths, "wrong", "a2"))
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert "adapter 0 (wrong.safetensors) is not the file fused" in lines[0], r.stdout
    assert "the record's a1.safetensors" in lines[0] and "4 of its 4 tensors differ" in lines[0]
    assert lines[1].startswith("  adapter: adapter 0 (wrong.safetensors) is not the file fused")
    code, js = verify_json(paths["out"], inputs(paths, "wrong", "a2"))
    assert js["cause_class"] == "adapter" and js["findings"][0]["what"] == "adapter"
    # every tensor of the file is still named, after the headline, and before any rebuilt one
    assert js["counts"]["adapter 0"] == 4
    order = [f["what"] for f in js["findings"]]
    assert order == ["adapter"] + ["adapter 0"] * 4 + ["rebuilt"] * 2


def test_a_file_changed_after_its_fuse_is_classed_so(files):
    """With a record, a tensor that differs from its rebuild and from the digest the fuse wrote
    for it was changed after the fuse: the inputs are not in question."""
    paths = files[0]
    data = bytearray(open(paths["out"], "rb").read())
    from ltx2blas.files.safetensors import SafetensorsFile
    with SafetensorsFile(paths["out"]) as f:
        at = f.tensors[M + Q + ".weight"].begin + 3
    data[at] ^= 0x01
    open(paths["out"], "wb").write(bytes(data))
    code, js = verify_json(paths["out"], inputs(paths))
    assert code == 1 and js["cause_class"] == "changed after the fuse", js
    assert js["classes"] == {"changed after the fuse": 1}
    assert js["findings"][0]["class"] == "changed after the fuse"


# -- 2. another rounding of the same inputs, told from different inputs ---------------------

def test_comfyuis_correct_fuse_is_another_rounding_of_the_same_inputs(files):
    paths = files[0]
    r = run_cli("verify", paths["comfyui"], *inputs(paths), "--json")
    assert r.returncode == 1, r.stderr  # exit 0 only where everything is ltx2blas's bytes
    js = json.loads(r.stdout)
    assert js["cause"].startswith("the same inputs under another rounding"), js
    assert "ComfyUI's f32 add makes them" in js["cause"]
    first = verify_checkpoint(paths["comfyui"], paths["model"], [
        (paths["a1"], 0.8), (paths["a2"], -1.5)]).summary().splitlines()[0]
    assert first.endswith(": " + js["cause"])
    assert js["cause_class"] == "rounding" and js["classes"] == {"rounding": 3}
    for f in js["findings"]:
        assert f["class"] == "rounding" and f["rule"] == "ComfyUI's f32 add", f
        assert 0 < f["scaled_steps"] <= 2 and abs(f["multiple"] - 1) < 0.01


def test_peft_s_merge_is_named_as_its_rule(files):
    paths = files[0]
    code, js = verify_json(paths["peft"], inputs(paths))
    differ = [f for f in js["findings"] if f["what"] == "unlike both"]
    assert differ and code == 1
    assert {(f["class"], f["rule"]) for f in differ} == {("rounding", "PEFT's scaled product")}


def test_steps_of_what_was_added_tell_another_rounding_from_another_strength(files):
    """The largest difference in bf16 steps of |W| + |delta|, from the files' values here: a
    step or two for the same inputs, many for half the strength; the raw distance between
    codes cannot tell them apart where a result crosses zero."""
    paths, model = files[0], files[1]
    import ml_dtypes  # noqa: F401  (safetensors' reader needs it for bf16)
    from safetensors.numpy import load_file

    a1, a2 = files[2], files[3]
    added = {}  # |scale| x |B| @ |A| summed over the adapters, from the files' values
    for module, ts in lora_terms(a1, a2, (0.8, -1.5), absolute=True).items():
        added[M + module + ".weight"] = sum(abs(s) * prod.astype(np.float64) for prod, s in ts)

    def largest(path, ref, base):
        got = {k: v.view(np.uint16) for k, v in load_file(str(path)).items()}
        out = {}
        for name, w in base.items():
            w = f32(w[1]).astype(np.float64)
            x, y = f32(got[name]).astype(np.float64), f32(ref[name]).astype(np.float64)
            mag = np.abs(w) + added[name]
            ulp = np.maximum(2.0 ** (np.floor(np.log2(np.where(mag > 0, mag, 1))) - 7),
                             2.0**-133)
            out[name] = float(np.max(np.abs(x - y) / ulp))
        return out

    weights = {M + m + ".weight": model[M + m + ".weight"] for m in (Q, FF, Q1)}
    ours = {k: v.view(np.uint16) for k, v in __import__("safetensors.numpy", fromlist=["x"])
            .load_file(str(paths["out"])).items()}
    for path, cls in ((paths["comfyui"], "rounding"), (paths["half"], "different inputs")):
        want = largest(path, ours, weights)
        report = verify_checkpoint(path, paths["model"], [(paths["a1"], 0.8),
                                                          (paths["a2"], -1.5)])
        got = {f.tensor: f for f in report.findings}
        for name, steps in want.items():
            assert got[name].cls == cls
            if cls == "rounding":
                # measured on every element to class it so
                # (elements one code apart count as one step, the bound they keep)
                assert steps * (1 - 1e-6) <= got[name].scaled_steps <= max(steps, 1.0) * (1 + 1e-6)
                assert got[name].steps_over == "every element" and steps <= 2
            else:
                # different inputs show on the sampled rows: their largest is measured there
                assert got[name].steps_over == "sampled rows"
                assert 8 < got[name].scaled_steps <= steps * (1 + 1e-6)


def test_a_wrong_strength_is_different_inputs_with_its_multiple(files):
    paths = files[0]
    r = run_cli("verify", paths["half"], *inputs(paths))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].endswith("different inputs (or options) in 3 of the 3 tensors that differ; "
                             "the change fits 0.5 x ltx2blas's delta in 3"), r.stdout
    assert any(line.startswith("  fit: ") and "at 0.5 x the delta: the strengths x 0.5" in line
               for line in lines), r.stdout
    code, js = verify_json(paths["half"], inputs(paths))
    assert js["cause_class"] == "different inputs"
    assert len(js["fits"]) == 3
    for fit in js["fits"]:
        assert fit["class"] == "different inputs" and fit["steps_over"] == "sampled rows"
        assert isinstance(fit["multiple"], float) and abs(fit["multiple"] - 0.5) < 0.005
        assert fit["residual"] < 0.05 and 0 < fit["rows"] <= 64
    q = next(fit for fit in js["fits"] if fit["tensor"] == M + Q + ".weight")
    # two adapters on one weight: each one's own multiple
    assert q["multiples"] == pytest.approx([0.5, 0.5], abs=0.01)


# -- 3. fits for every kind --------------------------------------------------------------------

def lycoris_files(rng, tmp_path, model):
    """A LoKr on Q (w1 whole, w2 a rank-4 pair), a LoHa on FF (rank 4) and a full difference
    on K, alpha 1 (alpha / dim 1/4), and LyCORIS' merge_to's file of them: each delta scaled by
    strength x (alpha / dim)^2, added in f32 to the weight and rounded once."""
    t, deltas = {}, {}
    m1, n1 = 8, 6
    m2, n2 = 64 // m1, 48 // n1
    t[P + Q + ".lokr_w1"] = ("BF16", random_bf16(rng, (m1, n1), 0.3))
    t[P + Q + ".lokr_w2_a"] = ("BF16", random_bf16(rng, (m2, 4), 0.3))
    t[P + Q + ".lokr_w2_b"] = ("BF16", random_bf16(rng, (4, n2), 0.3))
    t[P + Q + ".alpha"] = ("F32", np.array(1.0, np.float32))
    w2 = f32(t[P + Q + ".lokr_w2_a"][1]) @ f32(t[P + Q + ".lokr_w2_b"][1])
    deltas[Q] = (np.kron(f32(t[P + Q + ".lokr_w1"][1]), w2), 0.25 ** 2)
    out_f, in_f = ck.MODULES[FF]
    for n in ("1", "2"):
        t[P + FF + f".hada_w{n}_a"] = ("BF16", random_bf16(rng, (out_f, 4), 0.2))
        t[P + FF + f".hada_w{n}_b"] = ("BF16", random_bf16(rng, (4, in_f), 0.2))
    t[P + FF + ".alpha"] = ("F32", np.array(1.0, np.float32))
    deltas[FF] = ((f32(t[P + FF + ".hada_w1_a"][1]) @ f32(t[P + FF + ".hada_w1_b"][1])) *
                  (f32(t[P + FF + ".hada_w2_a"][1]) @ f32(t[P + FF + ".hada_w2_b"][1])),
                  0.25 ** 2)
    t[P + K + ".diff"] = ("BF16", random_bf16(rng, ck.MODULES[K], 0.01))
    deltas[K] = (f32(t[P + K + ".diff"][1]), 0.5)  # a difference has no alpha: at half
    path = ck.write(tmp_path / "lycoris.safetensors", t)
    tensors = dict(model)
    for module, (d, k) in deltas.items():
        acc = f32(model[M + module + ".weight"][1]) + np.float32(k) * d.astype(np.float32)
        tensors[M + module + ".weight"] = ("BF16", reference.bf16_round(acc))
    return path, ck.write(tmp_path / "merged.safetensors", tensors)


def test_lokr_loha_and_full_differences_are_fitted(tmp_path, rng):
    model = ck.model(rng)
    base = ck.write(tmp_path / "model.safetensors", model)
    adapter, merged = lycoris_files(rng, tmp_path, model)
    r = run_cli("verify", merged, "--model", base, "--lora", adapter)
    assert r.returncode == 1, r.stderr
    assert r.stdout.splitlines()[0].endswith(
        "the change fits 0.25 x ltx2blas's delta in 2, 0.5 x in 1"), r.stdout
    assert "alpha / rank (0.25) applied twice, as LyCORIS' merge_to applies it" in r.stdout
    code, js = verify_json(merged, ["--model", base, "--lora", adapter])
    fits = {fit["tensor"]: fit for fit in js["fits"]}
    assert set(fits) == {M + m + ".weight" for m in (Q, FF, K)}
    for m, want in ((Q, 0.25), (FF, 0.25), (K, 0.5)):
        assert fits[M + m + ".weight"]["multiple"] == pytest.approx(want, rel=0.01), fits
        assert fits[M + m + ".weight"]["residual"] < 0.1  # the bf16 rounding of a small change
    assert "applied twice" in fits[M + Q + ".weight"]["explains"]
    assert "applied twice" not in fits[M + K + ".weight"]["explains"]


def test_every_differing_weight_is_fitted(tmp_path, rng):
    """Four weights at half the strength: four fits (not the first three)."""
    model = ck.model(rng)
    a = ck.adapter(rng, list(ck.MODULES), rank=4)
    base = ck.write(tmp_path / "model.safetensors", model)
    adapter = ck.write(tmp_path / "a.safetensors", a)
    terms = {m: [(f32(a[P + m + ".lora_B.weight"][1]) @ f32(a[P + m + ".lora_A.weight"][1]),
                  0.5)] for m in ck.MODULES}
    half = comfyui(model, terms, tmp_path / "half.safetensors")
    report = verify_checkpoint(half, base, [adapter])
    assert report.classes == {"different inputs": 4}
    assert [fit["multiple"] for fit in report.fits] == pytest.approx([0.5] * 4, abs=0.005)


def test_a_dora_weight_that_differs_is_not_classed(tmp_path, rng):
    """DoRA normalises its weight: no multiple of a delta fits it, and no step of |W| + |delta|
    bounds its rounding; the tensor is counted as not classed, its fit holds no multiple."""
    model = ck.model(rng)
    base = ck.write(tmp_path / "model.safetensors", model)
    a, b = random_bf16(rng, (4, 48), 0.05), random_bf16(rng, (64, 4), 0.05)
    w = model[M + Q + ".weight"][1]
    m = np.sqrt((f32(w).astype(np.float64) ** 2).sum(axis=1)).astype(np.float32) * 1.05
    adapter = ck.write(tmp_path / "dora.safetensors", {
        Q + ".lora_down.weight": ("BF16", a), Q + ".lora_up.weight": ("BF16", b),
        Q + ".alpha": ("F32", np.array(2.0, np.float32)), Q + ".lora_magnitude_vector": ("F32", m)})
    tensors = dict(model)
    tensors[M + Q + ".weight"] = ("BF16", reference.fuse_dora(w, a, b, m, 2.0 / 4, 0.3, "peft"))
    other = ck.write(tmp_path / "other.safetensors", tensors)
    report = verify_checkpoint(other, base, [(adapter, 0.6)])
    assert report.classes == {"not classed": 1} and report.cause_class == "not classed"
    assert report.summary().splitlines()[0].endswith(
        "not classed (not a bf16 weight, or a DoRA one) in 1 of the 1 tensor that differs")
    assert [(f["multiple"], f["steps"], f["class"]) for f in report.fits] == [
        (None, None, "not classed")]
