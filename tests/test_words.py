"""What the messages say, word for word where the words are the point: a count is of the thing
it counts and takes the singular for one, a name is printed once, a position is (row, column),
a refusal is a sentence (never a record's raw JSON), and a speed figure says how it was taken."""
import json

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.files.extract import extract_lora
from ltx2blas.files.safetensors import SafetensorsFile
from ltx2blas.files.verify import verify_checkpoint

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q = "transformer_blocks.0.attn1.to_q"   # [64, 48] in ck.MODULES


@pytest.fixture
def model(tmp_path, rng):
    return ck.write(tmp_path / "model.safetensors", ck.model(rng))


def adapter_line(report):
    return report.summary().splitlines()[-1]


# ---- alpha not applied ----

def test_alpha_ignore_counts_modules_and_names_the_files_alpha(model, tmp_path, rng):
    """4 modules, each with alpha 16: the count is of modules, and the alpha is named as such
    (it was "alpha of 4 not applied")."""
    lora = ck.write(tmp_path / "a.safetensors", ck.adapter(rng, list(ck.MODULES), alpha=16.0))
    report = ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors",
                                      alpha="ignore")
    assert adapter_line(report).endswith(
        "; alpha not applied to 4 modules (alpha='ignore'; the file's alpha is 16)")


def test_two_alphas_ignored_are_both_named(model, tmp_path, rng):
    ad = ck.adapter(rng, [Q], alpha=8.0) | ck.adapter(rng, ["transformer_blocks.1.attn1.to_q"],
                                                      alpha=2.0)
    lora = ck.write(tmp_path / "a.safetensors", ad)
    report = ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors",
                                      alpha="ignore")
    assert adapter_line(report).endswith(
        "; alpha not applied to 2 modules (alpha='ignore'; the file's alphas are 2 and 8)")


def test_a_whole_factor_lokrs_alpha_says_why_it_is_not_applied(model, tmp_path, rng):
    """A LoKr of two whole factors has no rank to divide its alpha 4 by (ComfyUI leaves it
    out too): the line names the one module, the reason and the 4 (it was "alpha of 1")."""
    lora = ck.write(tmp_path / "k.safetensors", {
        f"diffusion_model.{Q}.lokr_w1": ("BF16", random_bf16(rng, (8, 8), 0.05)),
        f"diffusion_model.{Q}.lokr_w2": ("BF16", random_bf16(rng, (8, 6), 0.05)),
        f"diffusion_model.{Q}.alpha": ("F32", np.array(4, np.float32))})
    report = ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert adapter_line(report).endswith(
        "; alpha not applied to 1 module (a LoKr of two whole factors has no rank to divide "
        "it by; the file's alpha is 4)")


# ---- an already fused checkpoint ----

def test_an_already_fused_checkpoint_is_refused_naming_its_adapters(model, tmp_path, rng,
                                                                    capsys):
    from ltx2blas.cli import main

    a = ck.write(tmp_path / "a.safetensors", ck.adapter(rng, [Q], rank=4))
    b = ck.write(tmp_path / "b.safetensors", ck.adapter(rng, [Q], rank=2))
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(model, [(a, 0.8), (b, -1.5)], fused)
    with pytest.raises(errors.AlreadyFusedError) as err:
        ltx2blas.fuse_checkpoint(fused, [(a, 1.0)], tmp_path / "again.safetensors")
    assert str(err.value) == (
        f"{fused}: its metadata says ltx2blas already fused 2 adapters into it (a.safetensors "
        "at strength 0.8 and b.safetensors at strength -1.5); pass force=True to fuse again")
    assert main(["fuse", str(fused), "--lora", str(a), "-o", str(tmp_path / "again.safetensors"),
                 "-q"]) == 2
    err = capsys.readouterr().err
    assert "(a.safetensors at strength 0.8 and b.safetensors at strength -1.5); pass --force" \
        in err and "sha256" not in err and "{" not in err
    assert not (tmp_path / "again.safetensors").exists()


def test_an_unreadable_history_is_refused_saying_so_not_quoted(tmp_path, rng):
    model = ck.write(tmp_path / "m.safetensors", ck.model(rng),
                     {"ltx2blas.fused": '[{"file": "a.safetensors", "sha256": "d7f8'})
    lora = ck.write(tmp_path / "a.safetensors", ck.adapter(rng, [Q], rank=4))
    with pytest.raises(errors.AlreadyFusedError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    text = str(err.value)
    assert text.startswith(f"{model}: its metadata says adapters are already fused into it "
                           "(its ltx2blas.fused entry cannot be read: ")
    assert text.endswith("; pass force=True to fuse again") and "d7f8" not in text


# ---- kinds, modules and ranks ----

@pytest.mark.parametrize("suffix, words", [
    (".oft_blocks", "belongs to an OFT/BOFT adapter"),
    (".set_weight", "belongs to a weight-replacing (set_weight) adapter"),
    (".reshape_weight", "belongs to a reshaping LoRA (reshape_weight) adapter"),
])
def test_a_refused_kind_takes_its_article(model, tmp_path, suffix, words):
    lora = ck.write(tmp_path / "x.safetensors",
                    {f"diffusion_model.{Q}{suffix}": ("F32", np.zeros((4, 4), np.float32))})
    with pytest.raises(errors.KeyMatchError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert str(err.value) == (f"{lora}: 'diffusion_model.{Q}{suffix}' {words}, which ltx2blas "
                              "does not fuse")


def test_unmatched_modules_name_their_component_once(model, tmp_path, rng):
    """One component: named once, after the modules (it was "connectors.x (connectors) (the
    names point to the connectors, ...)"); one module: in the singular."""
    ad = ck.adapter(rng, [Q], rank=4)
    ad["connectors.text_proj_in.lora_A.weight"] = ("BF16", random_bf16(rng, (2, 8), 0.1))
    ad["connectors.text_proj_in.lora_B.weight"] = ("BF16", random_bf16(rng, (8, 2), 0.1))
    ad["notes"] = ("F32", np.zeros(1, np.float32))
    lora = ck.write(tmp_path / "u.safetensors", ad)
    with pytest.raises(errors.KeyMatchError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert str(err.value) == (
        f"{lora}: 1 adapter module matches no weight of the model: connectors.text_proj_in; "
        "its name points to the connectors, which this checkpoint does not hold; and 1 key is "
        "not a tensor of any adapter kind ltx2blas knows (LoRA factors, alpha, DoRA "
        "magnitudes, bias terms, differences): 'notes'; nothing was written (allow_unmatched="
        "True fuses the rest and lists these)")


def test_modules_of_several_components_are_each_named_with_theirs(model, tmp_path, rng):
    ad = ck.adapter(rng, [Q], rank=4)
    for name in ("connectors.text_proj_in", "text_encoders.gemma.layers.0.q_proj"):
        ad[name + ".lora_A.weight"] = ("BF16", random_bf16(rng, (2, 8), 0.1))
        ad[name + ".lora_B.weight"] = ("BF16", random_bf16(rng, (8, 2), 0.1))
    lora = ck.write(tmp_path / "u.safetensors", ad)
    with pytest.raises(errors.KeyMatchError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    text = str(err.value)
    assert ("2 adapter modules match no weight of the model: connectors.text_proj_in "
            "(connectors), text_encoders.gemma.layers.0.q_proj (text encoder); their names "
            "point to the connectors and the text encoder, which this checkpoint does not "
            "hold;") in text
    assert ") (" not in text


def test_a_pair_of_two_ranks_names_both(model, tmp_path, rng):
    """lora_A of rank 16 and lora_B of rank 8, each fitting the weight: the ranks are the
    fault (it was "do not fit weight ... [64, 48]")."""
    a_key, b_key = f"diffusion_model.{Q}.lora_A.weight", f"diffusion_model.{Q}.lora_B.weight"
    lora = ck.write(tmp_path / "r.safetensors", {
        a_key: ("BF16", random_bf16(rng, (16, 48), 0.05)),
        b_key: ("BF16", random_bf16(rng, (64, 8), 0.05))})
    with pytest.raises(errors.ShapeError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert str(err.value) == (
        f"{lora}: diffusion_model.{Q}: lora_A '{a_key}' [16, 48] has rank 16 but lora_B "
        f"'{b_key}' [64, 8] has rank 8; the two factors of a pair share one rank")


def test_a_loha_pair_of_two_ranks_names_both(model, tmp_path, rng):
    stem = f"diffusion_model.{Q}."
    ad = {stem + "hada_w1_a": ("BF16", random_bf16(rng, (64, 4), 0.05)),
          stem + "hada_w1_b": ("BF16", random_bf16(rng, (6, 48), 0.05)),
          stem + "hada_w2_a": ("BF16", random_bf16(rng, (64, 4), 0.05)),
          stem + "hada_w2_b": ("BF16", random_bf16(rng, (4, 48), 0.05))}
    lora = ck.write(tmp_path / "h.safetensors", ad)
    with pytest.raises(errors.ShapeError) as err:
        ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], tmp_path / "o.safetensors")
    assert str(err.value).endswith(
        f"diffusion_model.{Q}: hada_w1_a [64, 4] has rank 4 but hada_w1_b [6, 48] has rank 6; "
        "the two factors of a pair share one rank")


# ---- extract ----

@pytest.fixture
def checkpoints(tmp_path, rng):
    """A base and a tuned checkpoint: three weights changed by rank-4 products, one Linear
    weight and the VAE's 2-D table equal, one norm changed."""
    base = ck.model(rng)
    tuned = dict(base)
    for module in (Q, "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.1.attn1.to_q"):
        key = M + module + ".weight"
        w = base[key][1]
        a = random_bf16(rng, (4, w.shape[1]), 0.05)
        b = random_bf16(rng, (w.shape[0], 4), 0.05)
        tuned[key] = ("BF16", reference.fuse_lora(w, a, b, 1.0))
    norm = M + "norm_out.weight"
    tuned[norm] = ("F32", base[norm][1] + np.float32(0.5))
    return (ck.write(tmp_path / "tuned.safetensors", tuned),
            ck.write(tmp_path / "base.safetensors", base), base, tuned)


def kept_fractions(base, tuned, rank):
    """Each changed weight's fraction of ||D||_F kept at ``rank``, from numpy's full SVD of
    the difference in f64 (Eckart-Young)."""
    out = {}
    for name, (_, t) in tuned.items():
        if name.endswith(".weight") and t.ndim == 2 and not np.array_equal(t, base[name][1]):
            d = (reference.bf16_widen(t).astype(np.float64) -
                 reference.bf16_widen(base[name][1]).astype(np.float64))
            s = np.linalg.svd(d, compute_uv=False)
            out[name] = float(np.sqrt(np.sum(s[:rank] ** 2) / np.sum(s ** 2)))
    return out


def test_extract_says_how_many_weights_missed_the_energy_and_the_least_kept(checkpoints,
                                                                           tmp_path):
    """--energy 0.95 with --max-rank 2 on rank-4 changes: every weight falls short, and the
    summary says so (before, it printed the least fraction with no word of the target)."""
    tuned_path, base_path, base, tuned = checkpoints
    out = tmp_path / "lora.safetensors"
    report = extract_lora(tuned_path, base_path, out, energy=0.95, max_rank=2)
    want = kept_fractions(base, tuned, 2)
    missed = {n: k for n, k in want.items() if k < 0.95}
    assert len(missed) == 3
    least = min(missed, key=missed.get)
    line = report.summary().splitlines()[2]
    head = (f"3 of 3 weights missed the energy target 0.95 at max rank 2 (least fraction kept ")
    assert line.startswith(head)
    assert line.endswith(f", by {least}); a larger max rank keeps more")
    assert float(line[len(head):].split(",")[0]) == pytest.approx(missed[least], abs=2e-4)
    with SafetensorsFile(out) as f:
        record = json.loads(f.metadata["ltx2blas.extracted"])
    assert record["energy_missed"] == 3
    assert record["least_kept"] == pytest.approx(missed[least], abs=2e-4)
    assert record["least_kept"] == min(w["kept"] for w in record["weights"].values())


def test_extract_says_every_weight_reached_the_energy(checkpoints, tmp_path):
    tuned_path, base_path, *_ = checkpoints
    out = tmp_path / "lora.safetensors"
    report = extract_lora(tuned_path, base_path, out, energy=0.5, max_rank=8)
    assert "every weight reached the energy target 0.5" in report.summary()
    with SafetensorsFile(out) as f:
        assert json.loads(f.metadata["ltx2blas.extracted"])["energy_missed"] == 0


def test_extract_counts_in_the_singular_for_one(checkpoints, tmp_path):
    tuned_path, base_path, *_ = checkpoints
    report = extract_lora(tuned_path, base_path, tmp_path / "lora.safetensors", rank=4)
    text = report.summary()
    assert "2 equal weights skipped" in text   # the unchanged Linear and the VAE's table
    assert f"1 other tensor differs ({M}norm_out.weight)" in text
    report.weights_equal = 1
    assert "; 1 equal weight skipped" in report.summary()


def test_an_extract_error_names_the_weight_once(checkpoints, tmp_path):
    tuned_path, base_path, *_ = checkpoints
    with pytest.raises(errors.ShapeError) as err:
        extract_lora(tuned_path, base_path, tmp_path / "lora.safetensors", rank=5000)
    assert str(err.value) == (f"{M}{Q}.weight: rank 5000 is larger than the weight [64, 48] "
                              "allows (48)")


# ---- verify ----

def test_verify_gives_a_position_as_row_and_column(model, tmp_path, rng):
    """One element of a fused [64, 48] weight changed, at row 3, column 5: "1 element
    differs, the first at (3, 5)" (it was "1 elements differ, the first at 149")."""
    lora = ck.write(tmp_path / "a.safetensors", ck.adapter(rng, [Q], rank=4))
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(model, [(lora, 0.8)], fused)
    with SafetensorsFile(fused) as f:
        offset = f.tensors[M + Q + ".weight"].begin + (3 * 48 + 5) * 2 + 1   # the high byte
    with open(fused, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))
    report = verify_checkpoint(fused, model, [(lora, 0.8)])
    rebuilt = next(f for f in report.findings if f.what == "rebuilt")
    assert (rebuilt.count, rebuilt.first, tuple(rebuilt.at)) == (1, 3 * 48 + 5, (3, 5))
    assert "1 element differs, the first at (3, 5)" in report.summary()
    assert "elements differ" not in report.summary()


# ---- demo ----

def test_demo_times_in_turns_and_keeps_the_best_of_each(monkeypatch):
    """The fuse and the sgemm timed in turns (fuse, sgemm, fuse, ...), ROUNDS of each, and the
    ratio of the best of each printed as this run's: timings given by the test, not a clock."""
    from ltx2blas import demo

    events = []
    fuse_seconds = iter([4e-5, 1e-5, 3e-5, 2e-5, 5e-5])
    sgemm_seconds = iter([1.0, 3.0, 2.0, 0.5, 4.0])

    def timed(fn):
        events.append("fuse")
        return next(fuse_seconds), fn()

    def sgemm_timer(threads, n=2048):
        def one():
            events.append("sgemm")
            return next(sgemm_seconds)
        return one, 10.0   # GFLOP of one product

    monkeypatch.setattr(demo, "_timed", timed)
    monkeypatch.setattr(demo, "sgemm_timer", sgemm_timer)
    lines = []
    assert demo.run_demo(threads=1, rank=8, shape=(64, 128), echo=lines.append,
                         checkpoint=False) == 0
    assert demo.ROUNDS == 5 and events == ["fuse", "sgemm"] * 5
    gflops = 2.0 * 64 * 128 * 8 / 1e-5 / 1e9         # the best fuse: 10 us, 13.1 GFLOP/s
    assert lines[1] == f"fused in 0.0 ms on 1 thread(s): {gflops:.1f} GFLOP/s (the best of 5)"
    assert lines[2] == ("sgemm in this run: 20.0 GFLOP/s (the best of 5, timed in turns with the "
                        "fuse) -> fuse at 0.66 of the sgemm rate, a ratio "
                        "measured in this run on this machine: a busy host moves it")
