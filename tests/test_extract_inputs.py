"""extract's unusual inputs: scalar (0-d) tensors, tensors no fuse adds a difference to,
differences near f32's limit, outputs that cannot be written, and power iteration counts out of
range -- each handled, or refused by name with nothing written."""
import errno
import json
import os
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import errors, reference
from ltx2blas.extract import extract_lora_weight
from ltx2blas.files.extract import extract_lora
from ltx2blas.files.safetensors import SafetensorsFile

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
Q = M + "transformer_blocks.0.attn1.to_q.weight"


def read(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}, dict(f.metadata)


def files(tmp_path, base, tuned):
    return (ck.write(tmp_path / "tuned.safetensors", tuned),
            ck.write(tmp_path / "base.safetensors", base), tmp_path / "lora.safetensors")


def changed_q(rng, base, rank=2):
    """base with to_q changed by a rank-``rank`` product, as a fuse makes it."""
    tuned = dict(base)
    w = base[Q][1]
    a = random_bf16(rng, (rank, w.shape[1]), 0.05)
    b = random_bf16(rng, (w.shape[0], rank), 0.05)
    tuned[Q] = ("BF16", reference.fuse_lora(w, a, b, 1.0))
    return tuned


def only_the_inputs(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir()) == ["base.safetensors", "tuned.safetensors"]


# ---- scalar tensors ----

def test_scalar_tensors_are_compared_listed_when_they_differ_and_the_lora_fuses(tmp_path, rng):
    base = ck.model(rng)
    base[M + "logit_scale"] = ("F32", np.array(2.5, np.float32))     # differs
    base[M + "temperature"] = ("F32", np.array(0.75, np.float32))    # equal, F32
    base[M + "gate"] = ("BF16", np.array(0x3F80, np.uint16))         # equal, BF16 (1.0)
    tuned = changed_q(rng, base)
    tuned[M + "logit_scale"] = ("F32", np.array(3.0, np.float32))
    tuned_path, base_path, out = files(tmp_path, base, tuned)
    for full_diff in (False, True):
        report = extract_lora(tuned_path, base_path, out, rank=2, full_diff=full_diff)
        assert report.weights_extracted == 1
        assert report.other_differing == [M + "logit_scale"]       # the equal ones skipped
        assert report.full_diffs == 0                              # the fuse adds none to it
        assert ("1 listed only" if full_diff else "not in a LoRA") in report.summary()
        tensors, meta = read(out)
        assert not any("logit_scale" in key for key in tensors)
        assert json.loads(meta["ltx2blas.extracted"])["other_differing"] == [M + "logit_scale"]
        fused = tmp_path / "fused.safetensors"
        ltx2blas.fuse_checkpoint(base_path, [(out, 1.0)], fused)   # nothing it cannot add
        assert np.array_equal(read(fused)[0][M + "logit_scale"], base[M + "logit_scale"][1])
        fused.unlink()


def test_a_scalar_alone_differing_is_not_called_equal(tmp_path, rng):
    base = ck.model(rng)
    base[M + "logit_scale"] = ("F32", np.array(2.5, np.float32))
    tuned = dict(base)
    tuned[M + "logit_scale"] = ("F32", np.array(3.0, np.float32))
    tuned_path, base_path, out = files(tmp_path, base, tuned)
    for full_diff in (False, True):
        with pytest.raises(errors.ArgumentError, match=r"no Linear weight differs .*1 differ: "
                                                       r"model.diffusion_model.logit_scale"):
            extract_lora(tuned_path, base_path, out, rank=2, full_diff=full_diff)
        assert only_the_inputs(tmp_path)


def test_a_difference_the_fuse_cannot_add_is_listed_only(tmp_path, rng):
    """A 3-D weight (a patchify convolution): no LoRA or difference fuses into it, so its
    difference is listed, and the file written still fuses."""
    base = ck.model(rng)
    conv = M + "patchify.conv.weight"
    base[conv] = ("F32", rng.standard_normal((4, 3, 2)).astype(np.float32))
    tuned = changed_q(rng, base)
    tuned[conv] = ("F32", base[conv][1] + np.float32(1))
    norm = M + "norm_out.weight"
    tuned[norm] = ("F32", base[norm][1] + np.float32(0.5))
    tuned_path, base_path, out = files(tmp_path, base, tuned)
    report = extract_lora(tuned_path, base_path, out, rank=2, full_diff=True)
    assert sorted(report.other_differing) == sorted([conv, norm]) and report.full_diffs == 1
    assert "1 written as full differences, 1 listed only" in report.summary()
    tensors, _ = read(out)
    assert "diffusion_model.norm_out.diff" in tensors
    assert not any("patchify" in key for key in tensors)
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(base_path, [(out, 1.0)], fused)
    assert np.array_equal(read(fused)[0][norm], tuned[norm][1])   # one exact f32 add


# ---- differences near f32's limit ----

def huge_pair(rng, rows=64, cols=48, rank=2, top=2e38):
    """f32 (tuned, base) whose difference is a rank-``rank`` matrix with entries up to ``top``
    (f32's largest is 3.4e38), and that difference in f64."""
    d = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))
    d *= top / np.abs(d).max()
    base = (rng.standard_normal((rows, cols)) * 1e36).astype(np.float32)
    tuned = (base.astype(np.float64) + d).astype(np.float32)
    return tuned, base, tuned.astype(np.float64) - base.astype(np.float64)


@pytest.mark.parametrize("energy", [None, 0.999])
def test_a_difference_near_f32s_limit_gives_its_lora(rng, energy):
    tuned, base, d = huge_pair(rng)
    kwargs = {"energy": energy, "max_rank": 8} if energy else {"rank": 2}
    low = extract_lora_weight(tuned, base, dtype="f32", name="w", threads=2, **kwargs)
    assert low.rank == 2 and np.isfinite(low.lora_a).all() and np.isfinite(low.lora_b).all()
    got = low.lora_b.astype(np.float64) @ low.lora_a.astype(np.float64)
    # a rank-2 difference, f32 factors: as at any scale, within a few f32 roundings
    assert np.linalg.norm(got - d) <= 1e-5 * np.linalg.norm(d)
    s = np.linalg.svd(d, compute_uv=False)
    assert np.allclose(low.singular_values[:2], s[:2], rtol=1e-5, atol=0)
    assert low.norm == pytest.approx(np.linalg.norm(d), rel=1e-6)  # of the f32 difference
    assert low.kept == pytest.approx(1.0, abs=1e-6)


def test_a_checkpoint_with_a_difference_near_f32s_limit_extracts_and_fuses(tmp_path, rng):
    rows, cols = 64, 48
    d = rng.standard_normal((rows, 2)) @ rng.standard_normal((2, cols))
    d *= 2e38 / np.abs(d).max()
    base_bits = reference.bf16_round((rng.standard_normal((rows, cols)) * 1e37).astype(np.float32))
    b = reference.bf16_widen(base_bits).astype(np.float64)
    tuned_bits = reference.bf16_round((b + d).astype(np.float32))
    t = reference.bf16_widen(tuned_bits).astype(np.float64)
    tuned_path, base_path, out = files(tmp_path, {Q: ("BF16", base_bits)},
                                       {Q: ("BF16", tuned_bits)})
    report = extract_lora(tuned_path, base_path, out, rank=2)
    assert report.weights_extracted == 1 and 0.99 <= report.ranks[Q][1] <= 1.0
    fused = tmp_path / "fused.safetensors"
    ltx2blas.fuse_checkpoint(base_path, [(out, 1.0)], fused)
    f = reference.bf16_widen(read(fused)[0][Q]).astype(np.float64)
    # the tuned weight's bf16 rounding (2^-9 of it, full rank: what rank 2 leaves out), the
    # factors' bf16 rounding (2^-7 of the change) and the fuse's rounding (2^-8 of the weight)
    assert np.all(np.abs(f - t) <= 2.0**-7 * np.abs(t - b).max() + np.abs(t) * 2.0**-7)


def test_products_that_are_not_finite_are_an_error_naming_the_weight(tmp_path, rng, monkeypatch,
                                                                     capsys):
    """Were the scaling skipped, the products overflow: refused by name (exit 5), not by
    LAPACK's "A has a NaN entry"."""
    from ltx2blas import extract as lowrank
    from ltx2blas.cli import main

    monkeypatch.setattr(lowrank, "_scale_exponent", lambda *args: 0)
    tuned, base, _ = huge_pair(rng)
    with pytest.raises(errors.NumericsError, match=r"^w: the range finder's products are not "
                                                   r"finite"):
        extract_lora_weight(tuned, base, rank=2, name="w")
    tuned_path, base_path, out = files(tmp_path, {Q: ("F32", base)}, {Q: ("F32", tuned)})
    assert main(["extract", str(tuned_path), "--base", str(base_path), "-o", str(out),
                 "--rank", "2", "-q"]) == 5
    assert f"{Q}: the range finder's products are not finite" in capsys.readouterr().err
    assert only_the_inputs(tmp_path)


def test_ordinary_differences_are_not_scaled():
    """The scaling is taken only near f32's limit, so ordinary differences keep their bytes."""
    from ltx2blas.extract import _scale_exponent

    assert _scale_exponent(1e4**2, 4096, 4096) == 0           # ||D||_F 1e4, far past any tune
    assert _scale_exponent((2.0**112) ** 2, 65536, 1) == 0    # at the bound: 2^8 * 2^112
    assert _scale_exponent((2.0**113) ** 2, 65536, 1) > 0
    k = _scale_exponent((2e38 * 64) ** 2, 64, 48)
    assert k > 0 and k % 2 == 0


# ---- outputs that cannot be written ----

def _cli(args, capsys):
    from ltx2blas.cli import main

    code = main(args)
    return code, capsys.readouterr().err


@pytest.fixture
def pair(tmp_path, rng):
    base = ck.model(rng)
    return files(tmp_path, base, changed_q(rng, base))


def test_an_output_in_a_missing_folder_is_named(pair, tmp_path, capsys):
    tuned_path, base_path, _ = pair
    out = tmp_path / "missing" / "lora.safetensors"
    with pytest.raises(errors.Ltx2IOError, match=str(tmp_path / "missing")):
        extract_lora(tuned_path, base_path, out, rank=2)
    code, err = _cli(["extract", str(tuned_path), "--base", str(base_path), "-o", str(out),
                      "--rank", "2", "-q"], capsys)
    assert code == 4 and str(tmp_path / "missing") in err
    assert only_the_inputs(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /sys are Linux's")
@pytest.mark.parametrize("folder", ["/proc", "/sys"])
def test_an_output_where_no_file_can_be_made_is_named(pair, tmp_path, capsys, folder):
    if not os.path.isdir(folder):
        pytest.skip(f"no {folder} here")
    tuned_path, base_path, _ = pair
    out = os.path.join(folder, "lora.safetensors")
    with pytest.raises(errors.Ltx2IOError, match=f"output {out}: cannot create a file in "
                                                 f"{folder}: "):
        extract_lora(tuned_path, base_path, out, rank=2)
    code, err = _cli(["extract", str(tuned_path), "--base", str(base_path), "-o", out,
                      "--rank", "2", "-q"], capsys)
    assert code == 4 and f"cannot create a file in {folder}" in err
    assert not os.path.exists(out)


def test_a_spill_that_cannot_be_written_is_named(pair, tmp_path, monkeypatch):
    """A full disk while the factors are spilled: the folder named, nothing left behind."""
    import tempfile

    from ltx2blas.files import extract as module

    made = []
    temporary_file = tempfile.TemporaryFile

    class Full:
        def __init__(self, dir):
            self.file = temporary_file(dir=dir)
            made.append(self.file)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(module.tempfile, "TemporaryFile", lambda dir: Full(dir))
    tuned_path, base_path, out = pair
    with pytest.raises(errors.Ltx2IOError, match=f"output {out}: writing the spilled factors "
                                                 f"in {tmp_path}: No space left on device"):
        extract_lora(tuned_path, base_path, out, rank=2)
    assert made and made[0].closed and only_the_inputs(tmp_path)


# ---- power iterations ----

def test_power_iterations_are_bounded(tmp_path, rng, capsys):
    base = ck.model(rng)
    tuned_path, base_path, out = files(tmp_path, base, changed_q(rng, base))
    w = random_bf16(rng, (40, 24), 0.05)
    with pytest.raises(errors.ArgumentError, match="from 0 to 16, got 17"):
        extract_lora_weight(changed_q(rng, {Q: ("BF16", w)})[Q][1], w, rank=2,
                            power_iterations=17)
    # the bound is checked before anything is read, so a count too large is refused at once;
    # 2^40 is tried on a pair with no weight to extract, which is refused without the bound
    (tmp_path / "equal").mkdir()
    equal = files(tmp_path / "equal", base, base)
    differing = (tuned_path, base_path, out)
    for bad, (t, b, o) in [(17, differing), (-1, differing), (2.5, differing), (2**40, equal)]:
        with pytest.raises(errors.ArgumentError, match=r"power_iterations must be a whole number "
                                                       r"from 0 to 16, got"):
            extract_lora(t, b, o, rank=2, power_iterations=bad)
    from ltx2blas.cli import main

    for bad in ("17", "-1", "two", str(2**40)):
        with pytest.raises(SystemExit) as exit:    # argparse's error
            main(["extract", str(equal[0]), "--base", str(equal[1]), "-o", str(equal[2]),
                  "--rank", "2", "-q", "--power-iterations", bad])
        assert exit.value.code == 2
        assert "--power-iterations: expected" in capsys.readouterr().err
    assert not out.exists() and not equal[2].exists()
    # the bound itself is taken
    report = extract_lora(tuned_path, base_path, out, rank=2, power_iterations=16)
    assert report.weights_extracted == 1 and report.ranks[Q][1] == pytest.approx(1.0, abs=1e-2)
