"""``ltx2blas fuse``: the whole job as one command, with progress, a summary, one-line errors
and an exit code per kind of error."""
import subprocess
import sys

import pytest

import ckpt_helpers as ck

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")


def run(*args, cwd="/"):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def paths(tmp_path, rng):
    model = ck.write(tmp_path / "model.safetensors", ck.model(rng))
    lora = ck.write(tmp_path / "lora.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    return model, lora, tmp_path / "out.safetensors"


def test_fuse_writes_and_summarises(paths):
    model, lora, out = paths
    r = run("fuse", model, "--lora", f"{lora}:0.75", "-o", out, "--threads", "2")
    assert r.returncode == 0, r.stderr
    assert out.exists()
    assert "fused 1 modules" in r.stdout and "GFLOP/s" in r.stdout and "peak memory" in r.stdout
    assert "x 0.75" in r.stdout
    # not a terminal: plain log lines, ending at 100 %
    assert r.stderr.strip().splitlines()[-1].startswith("ltx2blas: 100%")


def test_dry_run(paths):
    model, lora, out = paths
    r = run("fuse", model, "--lora", lora, "-o", out, "--dry-run", "-v")
    assert r.returncode == 0 and "would fuse 1 modules" in r.stdout
    assert "transformer_blocks.0.attn1.to_q.weight" in r.stdout
    assert not out.exists()


@pytest.mark.parametrize("case, code, text", [
    ("missing", 4, "cannot open"),
    ("malformed", 3, "too short"),
    ("nomatch", 2, "matches no weight"),
    ("same", 2, "is an input"),  # an argument that does not fit (README: exit 2)
])
def test_errors_are_one_line_with_an_exit_code_per_kind(paths, tmp_path, case, code, text):
    model, lora, out = paths
    if case == "missing":
        args = ("fuse", tmp_path / "absent.safetensors", "--lora", lora, "-o", out)
    elif case == "malformed":
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(b"\0\0")
        args = ("fuse", bad, "--lora", lora, "-o", out)
    elif case == "nomatch":
        args = ("fuse", lora, "--lora", lora, "-o", out)  # an adapter has no *.weight to fuse
    else:
        args = ("fuse", model, "--lora", lora, "-o", model)
    r = run(*args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stderr.startswith("ltx2blas: error:") and text in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_lora_argument_parsing():
    from ltx2blas.cli import _lora_arg

    assert _lora_arg("a.safetensors") == ("a.safetensors", 1.0)
    assert _lora_arg("a.safetensors:0.5") == ("a.safetensors", 0.5)
    assert _lora_arg("dir:with:colons/a.safetensors") == ("dir:with:colons/a.safetensors", 1.0)
    assert _lora_arg("c:/x.safetensors:-1") == ("c:/x.safetensors", -1.0)


def test_rule_option(paths, tmp_path, rng):
    """--rule picks the several-adapter rule (default addmm); the output records it, and the two
    rules' outputs are the tensor-level fuse by that rule."""
    import json

    import numpy as np

    import ltx2blas
    from ltx2blas.files.safetensors import SafetensorsFile

    model, lora, _ = paths
    second = ck.write(tmp_path / "second.safetensors",
                      ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=300))
    got = {}
    for rule in ("addmm", "sum", None):
        out = tmp_path / f"out-{rule}.safetensors"
        extra = () if rule is None else ("--rule", rule)
        r = run("fuse", model, "--lora", f"{lora}:0.8", "--lora", f"{second}:1.5", "-o", out, *extra)
        assert r.returncode == 0, r.stderr
        assert f"{rule or 'addmm'} rule" in r.stdout
        with SafetensorsFile(out) as f:
            assert f.metadata["ltx2blas.rule"].startswith((rule or "addmm") + ":")
            assert json.loads(f.metadata["ltx2blas.layouts"]) == {"bf16": 1}
            got[rule] = f.read("model.diffusion_model.transformer_blocks.0.attn1.to_q.weight")
    assert np.array_equal(got[None], got["addmm"]) and not np.array_equal(got["addmm"], got["sum"])
    with SafetensorsFile(model) as m, SafetensorsFile(lora) as a, SafetensorsFile(second) as b:
        w = m.read("model.diffusion_model.transformer_blocks.0.attn1.to_q.weight")
        key = "diffusion_model.transformer_blocks.0.attn1.to_q.lora_"
        ads = [(a.read(key + "A.weight"), a.read(key + "B.weight"), 0.8),
               (b.read(key + "A.weight"), b.read(key + "B.weight"), 1.5)]
    for rule in ("addmm", "sum"):
        assert np.array_equal(got[rule], ltx2blas.fuse_loras(w, ads, rule=rule))
    r = run("fuse", model, "--lora", lora, "-o", tmp_path / "x.safetensors", "--rule", "stack")
    assert r.returncode == 2 and "invalid choice" in r.stderr
