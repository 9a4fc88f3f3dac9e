"""LoRA extraction (ltx2blas.extract, ltx2blas extract): an exact low-rank difference recovered,
the error against the optimum (the full SVD's, by Eckart-Young), extract-then-fuse within the
reported truncation, both rank modes, the same bytes for any thread count, and bad inputs
refused naming the tensor with nothing written."""
import json

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.extract import difference, extract_lora_weight
from ltx2blas.files.extract import extract_lora
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."


def widen(bits):
    return reference.bf16_widen(bits).astype(np.float64)


def tuned_by(rng, base, rank, noise=0.0):
    """f32 tuned weight = base + B A (bf16 factors, the product exact in f64 then rounded once
    to f32) + noise; returns (tuned, the f64 difference)."""
    rows, cols = base.shape
    a, b = random_bf16(rng, (rank, cols), 0.05), random_bf16(rng, (rows, rank), 0.05)
    d = widen(b) @ widen(a) + rng.standard_normal((rows, cols)) * noise
    return (widen(base) + d).astype(np.float32), d


def test_the_test_matrix_is_splitmix64s_top_bits():
    from ltx2blas import _lowrank, _quant

    out = np.empty((7, 5), np.float32)
    key = _quant.stochastic_key(3, "w")
    _lowrank.rademacher(key, out)
    want = [[-1.0 if reference.splitmix64((key + i * 5 + j) % 2**64) >> 63 else 1.0
             for j in range(5)] for i in range(7)]
    assert np.array_equal(out, np.array(want, np.float32))


@pytest.mark.parametrize("shape, rank", [((96, 64), 8), ((200, 333), 16), ((64, 64), 64)])
def test_an_exact_low_rank_difference_is_recovered(rng, shape, rank):
    base = random_bf16(rng, shape, 0.02)
    tuned, d = tuned_by(rng, base, rank)
    d32 = tuned.astype(np.float64) - widen(base)     # what extract sees: f32 values
    low = extract_lora_weight(tuned, base, rank=rank, dtype="f32", threads=2)
    got = low.lora_b.astype(np.float64) @ low.lora_a.astype(np.float64)
    # f32 factors of a rank-r matrix: the relative error is a few f32 roundings of the
    # factors (each ~2^-24), times the condition of the small SVD: well under 1e-5
    assert np.linalg.norm(got - d32) <= 1e-5 * np.linalg.norm(d32)
    assert low.rank == rank and low.kept == pytest.approx(1.0, abs=1e-6)
    bf = extract_lora_weight(tuned, base, rank=rank, threads=2)
    got = widen(bf.lora_b) @ widen(bf.lora_a)
    # bf16 factors: each entry rounded once (relative 2^-9), a product of two such entries
    # summed over the rank: the relative error of the product is at most about 2 x 2^-9 in
    # norm times the factors' norm ratio, which the even split keeps near 1; 2^-7 bounds it
    assert np.linalg.norm(got - d32) <= 2.0**-7 * np.linalg.norm(d32)


def test_the_error_is_within_the_stated_factor_of_the_optimum(rng):
    """A fine-tuning-like difference: a decaying spectrum (rank-48 signal of falling scale)
    plus full-rank noise; at rank 16 the range finder's error against the full SVD's."""
    rows, cols = 384, 320
    u, _ = np.linalg.qr(rng.standard_normal((rows, 48)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, 48)))
    d = (u * (0.9 ** np.arange(48))) @ v.T * 0.05 + rng.standard_normal((rows, cols)) * 2e-4
    base = random_bf16(rng, (rows, cols), 0.02)
    tuned = (widen(base) + d).astype(np.float32)
    d32 = tuned.astype(np.float64) - widen(base)
    s = np.linalg.svd(d32, compute_uv=False)
    for rank in (8, 16, 32):
        optimum = np.sqrt(np.sum(s[rank:] ** 2))
        low = extract_lora_weight(tuned, base, rank=rank, dtype="f32")
        err = np.linalg.norm(d32 - low.lora_b.astype(np.float64) @ low.lora_a.astype(np.float64))
        assert err <= 1.02 * optimum
        # the reported fraction kept gives the same error (an orthogonal projection)
        assert low.error * np.linalg.norm(d32) == pytest.approx(err, rel=1e-3)


def test_energy_mode_keeps_the_fraction_with_the_least_rank(rng):
    base = random_bf16(rng, (128, 96), 0.02)
    tuned, _ = tuned_by(rng, base, 12, noise=1e-4)
    d32 = tuned.astype(np.float64) - widen(base)
    s = np.linalg.svd(d32, compute_uv=False)
    fraction = np.sqrt(np.cumsum(s ** 2) / np.sum(s ** 2))
    low = extract_lora_weight(tuned, base, energy=0.9, max_rank=40)
    assert low.kept >= 0.9 and low.rank == int(np.argmax(fraction >= 0.9)) + 1
    capped = extract_lora_weight(tuned, base, energy=0.999999, max_rank=5)
    assert capped.rank == 5 and capped.kept < 0.999999


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_thread_counts_give_the_same_bytes(rng, threads):
    base = random_bf16(rng, (600, 520), 0.02)     # more blocks than threads, edge blocks
    tuned, _ = tuned_by(rng, base, 24, noise=1e-4)
    one = extract_lora_weight(tuned, base, rank=20, threads=1, name="w")
    again = extract_lora_weight(tuned, base, rank=20, threads=threads, name="w")
    assert one.lora_a.tobytes() == again.lora_a.tobytes()
    assert one.lora_b.tobytes() == again.lora_b.tobytes()
    other = extract_lora_weight(tuned, base, rank=20, threads=1, name="another")
    assert other.lora_a.tobytes() != one.lora_a.tobytes()   # the name seeds the test matrix


def test_the_difference_and_its_norm(rng):
    base = random_bf16(rng, (33, 47), 1.0)
    tuned = random_bf16(rng, (33, 47), 1.0)
    d, norm_sq = difference(tuned, base, threads=3)
    want = reference.bf16_widen(tuned) - reference.bf16_widen(base)   # one f32 subtraction
    assert np.array_equal(d, want)
    total = 0.0
    for row in want.astype(np.float64):   # each row in four partial sums, by column mod 4
        parts = [0.0, 0.0, 0.0, 0.0]
        for c, v in enumerate(row):
            parts[c % 4] += v * v
        total += (parts[0] + parts[1]) + (parts[2] + parts[3])
    assert norm_sq == total


def test_bad_arguments_are_refused(rng):
    base = random_bf16(rng, (16, 12), 0.02)
    tuned, _ = tuned_by(rng, base, 2)
    with pytest.raises(errors.ShapeError, match=r"rank 13 is larger than the weight \[16, 12\]"):
        extract_lora_weight(tuned, base, rank=13, name="w")
    with pytest.raises(errors.ShapeError, match="differ in shape"):
        extract_lora_weight(np.ascontiguousarray(tuned[:, :11]), base, rank=2)
    with pytest.raises(errors.ArgumentError, match="rank or energy"):
        extract_lora_weight(tuned, base)
    with pytest.raises(errors.ArgumentError, match="energy"):
        extract_lora_weight(tuned, base, energy=1.5)
    bad = tuned.copy()
    bad[3, 4] = np.inf
    with pytest.raises(errors.NonFiniteInputError, match=r"w: the difference is not finite at "
                                                         r"\(3, 4\)"):
        extract_lora_weight(bad, base, rank=2, name="w")
    same = extract_lora_weight(base, base, rank=2)
    assert same.rank == 0 and same.lora_a.shape == (0, 12) and same.lora_b.shape == (16, 0)


# ---- checkpoints ----

@pytest.fixture
def checkpoints(tmp_path, rng):
    """A base checkpoint and one tuned by rank-4 changes to three weights, a norm changed, a
    weight left equal."""
    base = ck.model(rng)
    tuned = dict(base)
    changed = {}
    for module in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.ff.net.0.proj",
                   "transformer_blocks.1.attn1.to_q"):
        key = M + module + ".weight"
        w = base[key][1]
        a = random_bf16(rng, (4, w.shape[1]), 0.05)
        b = random_bf16(rng, (w.shape[0], 4), 0.05)
        tuned[key] = ("BF16", reference.fuse_lora(w, a, b, 1.0))
        changed[key] = module
    norm = M + "norm_out.weight"
    tuned[norm] = ("F32", base[norm][1] + np.float32(0.5))
    paths = {"base": ck.write(tmp_path / "base.safetensors", base),
             "tuned": ck.write(tmp_path / "tuned.safetensors", tuned),
             "out": tmp_path / "lora.safetensors"}
    return paths, base, tuned, changed


def read(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}, dict(f.metadata)


def test_extract_then_fuse_gives_the_tuned_weights_back(checkpoints, tmp_path):
    paths, base, tuned, changed = checkpoints
    report = extract_lora(paths["tuned"], paths["base"], paths["out"], rank=4)
    assert report.weights_extracted == 3 and report.weights_equal == 2   # to_k, vae conv
    assert report.other_differing == [M + "norm_out.weight"] and report.full_diffs == 0
    tensors, meta = read(paths["out"])
    record = json.loads(meta["ltx2blas.extracted"])
    assert set(record["weights"]) == set(changed) and record["rank"] == 4
    for key, module in changed.items():
        assert tensors[f"diffusion_model.{module}.lora_A.weight"].shape[0] == 4
        assert float(tensors[f"diffusion_model.{module}.alpha"]) == 4.0
    refused = tmp_path / "refused.safetensors"
    ltx2blas.fuse_checkpoint(paths["base"], [(paths["out"], 1.0)], refused)
    fused, _ = read(refused)
    for key in changed:
        t, b, f = widen(tuned[key][1]), widen(base[key][1]), widen(fused[key])
        # the truncation keeps everything (rank 4 of a rank-4 change); what is left is the
        # factors' bf16 rounding and the fuse's: within 2^-7 of the change, plus one bf16
        # step of the weight (2^-8 relative) where the fuse rounds
        step = np.abs(t) * 2.0**-8
        assert np.all(np.abs(f - t) <= 2.0**-7 * np.abs(t - b).max() + step)
    # the tuned weights were rounded to bf16 (half a step of each at most, about 2^-9 of the
    # weights, a few percent of these changes): that full-rank part is what rank 4 leaves out
    assert all(0.99 <= kept <= 1.0 for _, kept in report.ranks.values())


def test_the_same_file_for_any_thread_count_and_the_energy_mode(checkpoints, tmp_path):
    paths, *_ = checkpoints
    extract_lora(paths["tuned"], paths["base"], paths["out"], energy=0.5, threads=1)
    again = tmp_path / "again.safetensors"
    extract_lora(paths["tuned"], paths["base"], again, energy=0.5, threads=3)
    assert paths["out"].read_bytes() == again.read_bytes()
    record = json.loads(read(again)[1]["ltx2blas.extracted"])
    assert record["energy"] == 0.5 and all(1 <= w["rank"] <= 4 and w["kept"] >= 0.5
                                           for w in record["weights"].values())


@pytest.mark.parametrize("threads, at_once", [(2, 2), (3, 3), (3, 2), (8, None)])
def test_weights_side_by_side_write_the_same_file(checkpoints, tmp_path, threads, at_once):
    """Weights extracted side by side (each on its share of the threads, the results taken in
    order) make the file one weight at a time makes, progress reported for every tensor."""
    from ltx2blas.files.extract import weight_lanes

    paths, *_ = checkpoints
    extract_lora(paths["tuned"], paths["base"], paths["out"], rank=3, threads=1)
    again = tmp_path / "again.safetensors"
    seen = []
    report = extract_lora(paths["tuned"], paths["base"], again, rank=3, threads=threads,
                          weights_at_once=at_once, progress=lambda p: seen.append(p))
    assert paths["out"].read_bytes() == again.read_bytes()
    assert [p.tensors_done for p in seen] == list(range(1, seen[0].tensors_total + 1))
    assert report.weights_extracted == 3
    assert weight_lanes(threads, at_once)[0] == (2 if at_once is None else at_once)


def test_the_weights_at_once_rule():
    from ltx2blas.files.extract import weight_lanes

    assert weight_lanes(1) == (1, 1) and weight_lanes(3) == (1, 3) and weight_lanes(4) == (1, 4)
    assert weight_lanes(8) == (2, 4) and weight_lanes(20) == (5, 4) and weight_lanes(9) == (2, 4)
    assert weight_lanes(2, 2) == (2, 1) and weight_lanes(2, 5) == (2, 1)
    for bad in (0, -1, 1.5, "two", True):
        with pytest.raises(errors.ArgumentError, match="weights_at_once must be a positive"):
            weight_lanes(2, bad)


@pytest.mark.parametrize("keys, a_key", [
    ("diffusers", "transformer.transformer_blocks.0.attn1.to_q.lora_A.weight"),
    ("comfy", "diffusion_model.transformer_blocks.0.attn1.to_q.lora_down.weight")])
def test_key_spellings_and_full_differences(checkpoints, tmp_path, keys, a_key):
    paths, base, tuned, _ = checkpoints
    report = extract_lora(paths["tuned"], paths["base"], paths["out"], rank=4, keys=keys,
                          full_diff=True, dtype="f32")
    tensors, _ = read(paths["out"])
    assert a_key in tensors and tensors[a_key].dtype == np.float32
    diff_key = ("transformer." if keys == "diffusers" else "diffusion_model.") + "norm_out.diff"
    norm = M + "norm_out.weight"
    assert np.array_equal(tensors[diff_key], tuned[norm][1] - base[norm][1])  # one f32 subtraction
    assert report.full_diffs == 1


def _refused(paths, tmp_path, tuned, error, match, **kwargs):
    path = ck.write(tmp_path / "bad.safetensors", tuned)
    with pytest.raises(error, match=match):
        extract_lora(path, paths["base"], paths["out"], **({"rank": 4} | kwargs))
    assert not paths["out"].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.safetensors", "base.safetensors",
                                                          "tuned.safetensors"]


def test_bad_checkpoints_are_refused_naming_the_tensor(checkpoints, tmp_path, rng):
    paths, base, tuned, changed = checkpoints
    key = next(iter(changed))
    wrong = dict(tuned)
    wrong[key] = ("BF16", random_bf16(rng, (64, 40), 0.02))
    _refused(paths, tmp_path, wrong, errors.ShapeError,
             r"transformer_blocks.0.attn1.to_q.weight is \[64, 40\] in the tuned checkpoint "
             r"and \[64, 48\] in the base")
    missing = {k: v for k, v in tuned.items() if k != key}
    _refused(paths, tmp_path, missing, errors.KeyMatchError,
             r"to_q.weight is in the base but not tuned checkpoint")
    nan = dict(tuned)
    bits = tuned[key][1].copy()
    bits[2, 5] = 0x7FC0
    nan[key] = ("BF16", bits)
    _refused(paths, tmp_path, nan, errors.NonFiniteInputError,
             r"to_q.weight: .*the difference is not finite at \(2, 5\)")
    _refused(paths, tmp_path, tuned, errors.ShapeError, r"rank 49 is larger than the weight "
             r"\[64, 48\]", rank=49)
    with pytest.raises(errors.ArgumentError, match="is an input file"):
        extract_lora(paths["tuned"], paths["base"], paths["base"], rank=4)
    with pytest.raises(errors.ArgumentError, match="power_iterations"):
        extract_lora(paths["tuned"], paths["base"], paths["out"], rank=4, power_iterations=-1)
    assert not paths["out"].exists()


def test_fp8_weights_are_read_by_their_values(tmp_path, rng):
    """A tuned bf16 checkpoint against an fp8 base: the base's codes widened exactly."""
    base = ck.model(rng, fp8="F8_E4M3")
    tuned = dict(base)
    key = M + "transformer_blocks.0.attn1.to_q.weight"
    wide = reference.bf16_round(reference.fp8_widen(base[key][1], "F8_E4M3"))
    a, b = random_bf16(rng, (3, 48), 0.05), random_bf16(rng, (64, 3), 0.05)
    tuned[key] = ("BF16", reference.fuse_lora(wide, a, b, 1.0))
    paths = [ck.write(tmp_path / "b.safetensors", base), ck.write(tmp_path / "t.safetensors", tuned)]
    report = extract_lora(paths[1], paths[0], tmp_path / "l.safetensors", rank=3)
    assert report.weights_extracted == 1 and 0.99 <= report.ranks[key][1] <= 1.0


def test_the_command(checkpoints, capsys):
    from ltx2blas.cli import main

    paths, *_ = checkpoints
    code = main(["extract", str(paths["tuned"]), "--base", str(paths["base"]), "-o",
                 str(paths["out"]), "--rank", "4", "-q"])
    out = capsys.readouterr().out
    assert code == 0 and "extracted 3 weights at rank 4" in out and "1 other tensor differs" in out
    assert main(["extract", str(paths["tuned"]), "--base", str(paths["base"]), "-o",
                 str(paths["out"]), "--rank", "4", "--energy", "0.9"]) == 2


@pytest.mark.parametrize("layout", ["fp8_block", "nvfp4"])
def test_upstreams_quantised_bases_are_read_by_their_rule(tmp_path, rng, layout):
    """A bf16 fine-tune of a blockwise fp8 or NVFP4 base: the difference is taken from the
    base's values as upstream dequantises them, so a rank-3 change comes back whole."""
    from ltx2blas import quantized
    from test_quantized import case

    weight, scales, kwargs = case(rng, layout)
    values = quantized.dequantized(layout, weight, **kwargs)
    rows, cols = values.shape
    key = M + "transformer_blocks.0.attn1.to_q.weight"
    base = {key: ("U8" if layout == "nvfp4" else "F8_E4M3", weight),
            M + "transformer_blocks.0.attn1.to_q.weight_scale":
                ("F8_E4M3" if layout == "nvfp4" else "F32", scales[0])}
    if layout == "nvfp4":
        base[M + "transformer_blocks.0.attn1.to_q.weight_scale_2"] = (
            "F32", np.asarray(scales[1], np.float32).reshape(()))
    a, b = random_bf16(rng, (3, cols), 0.05), random_bf16(rng, (rows, 3), 0.05)
    tuned = {key: ("BF16", reference.fuse_lora(values, a, b, 1.0))}
    paths = [ck.write(tmp_path / "b.safetensors", base), ck.write(tmp_path / "t.safetensors",
                                                                  tuned)]
    report = extract_lora(paths[1], paths[0], tmp_path / "l.safetensors", rank=3)
    assert report.weights_extracted == 1 and 0.99 <= report.ranks[key][1] <= 1.0


def test_comfyuis_own_quantised_layers_are_refused_naming_the_tensor(tmp_path, rng):
    key = M + "transformer_blocks.0.attn1.to_q.weight"
    stem = key[: -len(".weight")]
    marker = np.frombuffer(b'{"format": "int8_tensorwise"}', np.uint8).copy()
    base = {key: ("I8", rng.integers(-100, 100, (64, 48), dtype=np.int8)),
            stem + ".weight_scale": ("F32", np.array(0.01, np.float32)),
            stem + ".comfy_quant": ("U8", marker)}
    tuned = {key: ("BF16", random_bf16(rng, (64, 48), 0.5))}
    paths = [ck.write(tmp_path / "b.safetensors", base), ck.write(tmp_path / "t.safetensors", tuned)]
    with pytest.raises(errors.DTypeError, match=r"to_q.weight is stored as comfy_int8; extract "
                                                 r"reads"):
        extract_lora(paths[1], paths[0], tmp_path / "l.safetensors", rank=4)
    assert not (tmp_path / "l.safetensors").exists()


def test_full_differences_fuse_back(checkpoints, tmp_path):
    """--full-diff writes the norm's change as a .diff, which the fuse adds as it adds a bias
    term (f32 sum, rounded once into the vector's dtype)."""
    paths, base, tuned, changed = checkpoints
    extract_lora(paths["tuned"], paths["base"], paths["out"], rank=4, full_diff=True)
    refused = tmp_path / "refused.safetensors"
    report = ltx2blas.fuse_checkpoint(paths["base"], [(paths["out"], 1.0)], refused)
    assert report.adapters[0].kinds == {"lora": 3, "diff": 1}
    fused, _ = read(refused)
    diff = read(paths["out"])[0]["diffusion_model.norm_out.diff"]
    norm = M + "norm_out.weight"
    assert np.array_equal(fused[norm], reference.fuse_bias(base[norm][1], [(diff, 1.0)]))
    assert np.array_equal(fused[norm], tuned[norm][1])   # here the f32 round trip is exact


def test_a_changed_bias_is_written_under_its_modules_name(checkpoints, tmp_path, rng):
    paths, base, tuned, _ = checkpoints
    bias = M + "transformer_blocks.0.attn1.to_k.bias"
    changed = dict(tuned)
    changed[bias] = ("BF16", random_bf16(rng, (64,), 0.02))
    path = ck.write(tmp_path / "t2.safetensors", changed)
    extract_lora(path, paths["base"], paths["out"], rank=4, full_diff=True)
    assert "diffusion_model.transformer_blocks.0.attn1.to_k.diff_b" in read(paths["out"])[0]
    refused = tmp_path / "refused.safetensors"
    ltx2blas.fuse_checkpoint(paths["base"], [(paths["out"], 1.0)], refused)
    diff = read(paths["out"])[0]["diffusion_model.transformer_blocks.0.attn1.to_k.diff_b"]
    assert np.array_equal(read(refused)[0][bias], reference.fuse_bias(base[bias][1], [(diff, 1.0)]))


# ---- the factorisations between the products ----

def test_the_lu_basis_is_p_l_with_the_columns_span(rng):
    from scipy.linalg import lapack

    from ltx2blas import _lowrank

    a = rng.standard_normal((40, 7)).astype(np.float32)
    a[:, 4] = 0.0                                    # a dependent column: a zero pivot
    lu, pivots, info = lapack.sgetrf(np.asfortranarray(a))
    assert info > 0
    basis = np.empty((40, 7), np.float32)
    _lowrank.lu_basis(lu, pivots.astype(np.int32), basis, False)
    t = np.empty((7, 40), np.float32)
    _lowrank.lu_basis(lu, pivots.astype(np.int32), t, True)
    assert np.array_equal(t.T, basis)
    # P L U = a, with U read from getrf's upper triangle
    u = np.triu(lu[:7]).astype(np.float64)
    assert np.allclose(basis.astype(np.float64) @ u, a, atol=1e-5)
    # P L: each row of L once, in a's order: L's unit diagonal and zeros above it
    p = np.arange(40)
    for i, j in enumerate(pivots):
        p[i], p[j] = p[j], p[i]
    lower = basis[p]
    assert np.array_equal(np.diagonal(lower), np.ones(7, np.float32))
    assert np.array_equal(np.triu(lower[:7], 1), np.zeros((7, 7), np.float32))
    assert np.abs(basis).max() <= 1.0 and np.linalg.matrix_rank(basis) == 7


@pytest.mark.parametrize("dependent", [False, True])
def test_the_final_basis_is_orthonormal_either_way(rng, dependent):
    """CholeskyQR2 where the columns are well conditioned, Householder where they are not (a
    column dependent on the others: the Cholesky factorisation fails)."""
    from ltx2blas import extract

    y = rng.standard_normal((300, 24)).astype(np.float32)
    if dependent:
        y[:, 5] = y[:, 3]
    assert (extract._cholesky_r(np.asfortranarray(y, np.float64)) is None) == dependent
    q = extract._orthonormal(y)
    assert q.flags.f_contiguous and q.dtype == np.float64
    # orthonormal to f64 rounding: CholeskyQR2's error is a small multiple of 300 * 2^-53
    assert np.abs(q.T @ q - np.eye(24)).max() <= 1e-13
    # the span of y's columns: y's projection onto q is y
    y64 = y.astype(np.float64)
    assert np.linalg.norm(y64 - q @ (q.T @ y64)) <= 1e-12 * np.linalg.norm(y64)


def test_the_small_svd_from_the_gram_matrix(rng):
    """Ub, s, W of b against an f64 SVD: the singular values, the projection of b onto Ub's
    first columns, and b = Ub diag(s) (W / s)^T."""
    from ltx2blas import extract

    u, _ = np.linalg.qr(rng.standard_normal((20, 20)))
    v, _ = np.linalg.qr(rng.standard_normal((500, 20)))
    sigma = 10.0 ** -np.linspace(0, 6, 20)          # down to 1e-6 of the largest
    b = ((u * sigma) @ v.T).astype(np.float32)
    want = np.linalg.svd(b.astype(np.float64), compute_uv=False)
    ub, s, w = extract._projected_svd(b)
    # the norms of b^T Ub: f64 products of f32 data, each value to a few f64 roundings of the
    # largest (2^-53 * 20 * sigma_0); the square roots of eigenvalues would miss the small ones
    assert np.allclose(s, want, rtol=0, atol=1e-13)
    assert np.all(np.diff(s) <= 0)
    b64 = b.astype(np.float64)
    # Ub diag(s) (W / s)^T = Ub W^T = Ub Ub^T b: all of b, Ub being square here
    assert np.linalg.norm(b64 - (ub * s) @ (w / s).T) <= 1e-13 * np.linalg.norm(b64)
    for k in (1, 5, 12):   # truncated: the optimum's error, to rounding
        approx = ub[:, :k] @ (ub[:, :k].T @ b64)
        assert np.linalg.norm(b64 - approx) == pytest.approx(np.sqrt(np.sum(want[k:] ** 2)),
                                                             rel=1e-9, abs=1e-14)


def test_a_rank_below_the_asked_gives_finite_factors_and_the_difference(rng):
    """A difference of rank 3 asked for rank 8: the Householder basis, singular values of zero
    or rounding size past the third, factors finite, the product the difference."""
    base = random_bf16(rng, (64, 48), 0.02)
    tuned, _ = tuned_by(rng, base, 3)
    d32 = tuned.astype(np.float64) - widen(base)
    low = extract_lora_weight(tuned, base, rank=8, dtype="f32")
    assert np.all(np.isfinite(low.lora_a)) and np.all(np.isfinite(low.lora_b))
    assert low.singular_values[3] <= 1e-6 * low.singular_values[0]
    got = low.lora_b.astype(np.float64) @ low.lora_a.astype(np.float64)
    assert np.linalg.norm(got - d32) <= 1e-5 * np.linalg.norm(d32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_f64_products_by_blocks_of_rows(rng, threads):
    """The seam's f64 Gram matrix, triangular solve and product, cut into blocks of rows (1300
    rows: two whole blocks and a part): within f64 rounding of numpy's, and byte for byte the
    same for any thread count."""
    from ltx2blas import _gemm
    from ltx2blas._threads import blas_single_threaded

    a = np.asfortranarray(rng.standard_normal((1300, 37)))
    b = np.asfortranarray(rng.standard_normal((37, 11)))
    r = np.asfortranarray(np.triu(rng.standard_normal((37, 37))) + 8 * np.eye(37))
    with blas_single_threaded():
        g1, g = _gemm.gram_f64(a, 1), _gemm.gram_f64(a, threads)
        p1, p = _gemm.product_f64(a, b, 1), _gemm.product_f64(a, b, threads)
        s1 = _gemm.solve_upper_right(np.array(a, order="F"), r, 1)
        s = _gemm.solve_upper_right(np.array(a, order="F"), r, threads)
    for one, other in ((g1, g), (p1, p), (s1, s)):
        assert one.tobytes() == other.tobytes() and other.flags.f_contiguous
    # each entry a sum of 1300 products of unit-scale normals: f64 rounding of a few 1e-13
    assert np.array_equal(np.tril(g, -1), np.zeros((37, 37)))
    assert np.allclose(g, np.triu(a.T @ a), rtol=0, atol=1e-10)
    assert np.allclose(p, a @ b, rtol=0, atol=1e-11)
    assert np.allclose(s @ r, a, rtol=0, atol=1e-11)
