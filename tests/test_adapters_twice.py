"""An adapter that would be added twice: one module under two spellings in one file (refused,
naming both keys), and one adapter file given twice (said in the report; refused by the command
unless --allow-repeated); and LyCORIS factors whose shapes are too large to be a weight's
factors (refused before anything is allocated)."""
import json
import os
import shutil
import struct
import subprocess
import sys

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
Q = "transformer_blocks.0.attn1.to_q"   # [64, 48] in ck.MODULES
FLAT = Q.replace(".", "_")


@pytest.fixture
def model(tmp_path, rng):
    return ck.write(tmp_path / "model.safetensors", ck.model(rng))


def read(path):
    with SafetensorsFile(path) as f:
        return {n: f.read(n) for n in f.tensors}


def lora(rng, key, down=".lora_A.weight", up=".lora_B.weight", rank=4):
    return {key + down: ("BF16", random_bf16(rng, (rank, 48), 0.1)),
            key + up: ("BF16", random_bf16(rng, (64, rank), 0.1))}


def lokr(rng, key):
    return {key + ".lokr_w1": ("BF16", random_bf16(rng, (4, 4), 0.3)),
            key + ".lokr_w2_a": ("BF16", random_bf16(rng, (16, 2), 0.3)),
            key + ".lokr_w2_b": ("BF16", random_bf16(rng, (2, 12), 0.3))}


def nothing_written(tmp_path, *kept):
    return sorted(p.name for p in tmp_path.iterdir()) == sorted(("model.safetensors",) + kept)


@pytest.mark.parametrize("kind", ["lora", "lokr"])
def test_one_module_in_two_spellings_is_refused_naming_both_keys(model, tmp_path, rng, kind):
    if kind == "lora":
        tensors = {**lora(rng, "diffusion_model." + Q),
                   **lora(rng, "lora_unet_" + FLAT, ".lora_down.weight", ".lora_up.weight")}
        first, second = (f"diffusion_model.{Q}.lora_A.weight",
                         f"lora_unet_{FLAT}.lora_down.weight")
    else:
        tensors = {**lokr(rng, "diffusion_model." + Q), **lokr(rng, "lycoris_" + FLAT)}
        first, second = f"diffusion_model.{Q}.lokr_w1", f"lycoris_{FLAT}.lokr_w1"
    path = ck.write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(errors.KeyMatchError) as exc:
        ltx2blas.fuse_checkpoint(model, [(path, 1.0)], tmp_path / "out.safetensors")
    text = str(exc.value)
    assert text.startswith(str(path)) and repr(first) in text and repr(second) in text
    assert f"{M}{Q}.weight in two spellings" in text
    assert nothing_written(tmp_path, "a.safetensors")


def test_two_spellings_of_different_modules_still_fuse(model, tmp_path, rng):
    tensors = {**lora(rng, "diffusion_model." + Q),
               **lora(rng, "lora_unet_transformer_blocks_0_attn1_to_k", ".lora_down.weight",
                      ".lora_up.weight")}
    path = ck.write(tmp_path / "a.safetensors", tensors)
    report = ltx2blas.fuse_checkpoint(model, [(path, 1.0)], tmp_path / "out.safetensors")
    assert report.modules_fused == 2


def expected_twice(model, rng_tensors, strengths):
    """The weight Q with the adapter's LoRA added once per strength, by the addmm rule."""
    base = read(model)[M + Q + ".weight"]
    a = rng_tensors[f"diffusion_model.{Q}.lora_A.weight"][1]
    b = rng_tensors[f"diffusion_model.{Q}.lora_B.weight"][1]
    return reference.fuse_loras(base, [(a, b, s) for s in strengths], rule="addmm")


@pytest.mark.parametrize("how", ["the same file", "a link", "the same bytes"])
def test_an_adapter_given_twice_is_fused_twice_and_the_report_says_so(model, tmp_path, rng,
                                                                       how):
    tensors = lora(rng, "diffusion_model." + Q)
    path = ck.write(tmp_path / "a.safetensors", tensors)
    again = path
    if how == "a link":
        again = tmp_path / "link.safetensors"
        os.link(path, again)
    elif how == "the same bytes":
        again = tmp_path / "copy.safetensors"
        shutil.copyfile(path, again)
    out = tmp_path / "out.safetensors"
    report = ltx2blas.fuse_checkpoint(model, [(path, 1.0), (again, 0.5)], out)
    said = "the same file" if how != "the same bytes" else "the same bytes"
    assert report.adapters[1].repeat_of == 0 and report.adapters[1].repeat_how == said
    assert report.adapters[0].repeat_of is None
    line = report.summary().splitlines()[-1]
    assert line.startswith("adapter 1: ") and f"{said} as adapter 0" in line
    assert "given twice" in line
    # the library keeps fusing it twice, as asked
    assert np.array_equal(read(out)[M + Q + ".weight"], expected_twice(model, tensors, (1.0, 0.5)))


def test_an_adapter_given_twice_is_refused_when_asked(model, tmp_path, rng):
    path = ck.write(tmp_path / "a.safetensors", lora(rng, "diffusion_model." + Q))
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(path, copy)
    other = ck.write(tmp_path / "b.safetensors", lora(rng, "diffusion_model." + Q))
    assert os.path.getsize(other) == os.path.getsize(path)  # same size, other bytes
    with pytest.raises(errors.ArgumentError, match=r"copy.safetensors: adapter 2 is adapter 0 "
                       r"again \(the same bytes as .*a.safetensors\).*allow_repeated=True"):
        ltx2blas.fuse_checkpoint(model, [(path, 1.0), (other, 1.0), (copy, 1.0)],
                                 tmp_path / "out.safetensors", allow_repeated=False)
    assert nothing_written(tmp_path, "a.safetensors", "copy.safetensors", "b.safetensors")
    # files of one size and other bytes are two adapters
    report = ltx2blas.fuse_checkpoint(model, [(path, 1.0), (other, 1.0)],
                                      tmp_path / "out.safetensors", allow_repeated=False)
    assert [a.repeat_of for a in report.adapters] == [None, None]


def test_a_mapping_given_twice_is_said_in_the_report(rng):
    tensors = {n: v for n, (_, v) in ck.model(rng).items() if n.endswith(Q + ".weight")}
    mapping = {k: v for k, (_, v) in lora(rng, "diffusion_model." + Q).items()}
    report = ltx2blas.fuse_state_dict(tensors, [(mapping, 1.0), (mapping, 1.0)])
    assert report.adapters[1].repeat_of == 0 and "the same mapping as adapter 0" in \
        report.summary()


def run(*args):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd="/", timeout=300)


def test_the_command_refuses_an_adapter_given_twice_unless_allowed(model, tmp_path, rng):
    path = ck.write(tmp_path / "a.safetensors", lora(rng, "diffusion_model." + Q))
    out = tmp_path / "out.safetensors"
    r = run("fuse", model, "--lora", path, "--lora", f"{path}:0.5", "-o", out, "-q")
    assert r.returncode == 2, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "adapter 1 is adapter 0 again (the same " \
        "file)" in r.stderr and "--allow-repeated" in r.stderr and "allow_repeated" not in r.stderr
    assert not out.exists()
    r = run("fuse", model, "--lora", path, "--lora", f"{path}:0.5", "-o", out, "-q",
            "--allow-repeated")
    assert r.returncode == 0, r.stderr
    assert "the same file as adapter 0" in r.stdout and out.exists()
    # and verify takes the adapter twice, as it was fused
    v = run("verify", out, "--model", model, "--lora", path, "--lora", f"{path}:0.5", "-q")
    assert v.returncode == 0, v.stdout + v.stderr


def raw_adapter(path, header):
    """A safetensors file of empty tensors, written by hand: numpy cannot shape them."""
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)
    return path


@pytest.mark.parametrize("kind", ["lokr", "lokr pair", "loha"])
def test_factors_too_large_for_any_weight_are_a_format_error(tmp_path, rng, kind):
    tensors = ck.model(rng)
    tensors[M + "empty.weight"] = ("BF16", np.zeros((0, 0), np.uint16))
    model = ck.write(tmp_path / "model.safetensors", tensors)
    big = 2**62

    def t(shape):
        return {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
    key = "diffusion_model.empty"
    header = {"lokr": {key + ".lokr_w1": t([0, big]), key + ".lokr_w2": t([big, 0])},
              "lokr pair": {key + ".lokr_w1_a": t([0, big]), key + ".lokr_w1_b": t([big, 0]),
                            key + ".lokr_w2": t([0, 0])},
              "loha": {key + ".hada_w1_a": t([0, big]), key + ".hada_w1_b": t([big, 0]),
                       key + ".hada_w2_a": t([0, 1]), key + ".hada_w2_b": t([1, 0])}}[kind]
    path = raw_adapter(tmp_path / "a.safetensors", header)
    with pytest.raises(errors.FormatError) as exc:
        ltx2blas.fuse_checkpoint(model, [(path, 1.0)], tmp_path / "out.safetensors")
    text = str(exc.value)
    first = next(iter(header))
    assert text.startswith(f"{path}: {first!r} has shape ") and str(big) in text
    assert nothing_written(tmp_path, "a.safetensors")
    r = run("fuse", model, "--lora", path, "-o", tmp_path / "out.safetensors", "-q")
    assert r.returncode == 3 and str(path) in r.stderr and first in r.stderr, r.stderr


def test_factors_larger_than_an_empty_weight_are_refused(tmp_path, rng):
    tensors = ck.model(rng)
    tensors[M + "empty.weight"] = ("BF16", np.zeros((0, 0), np.uint16))
    model = ck.write(tmp_path / "model.safetensors", tensors)
    key = "diffusion_model.empty"
    path = ck.write(tmp_path / "a.safetensors", {
        key + ".lokr_w1_a": ("BF16", random_bf16(rng, (3000, 1))),
        key + ".lokr_w1_b": ("BF16", random_bf16(rng, (1, 3000))),
        key + ".lokr_w2": ("BF16", np.zeros((0, 0), np.uint16))})
    with pytest.raises(errors.ShapeError, match=r"a.safetensors: diffusion_model.empty: w1 "
                       r"\[3000, 3000\] and w2 \[0, 0\] are factors larger than weight"):
        ltx2blas.fuse_checkpoint(model, [(path, 1.0)], tmp_path / "out.safetensors")
    assert nothing_written(tmp_path, "a.safetensors")
