"""Every command's report as JSON (fuse, extract, verify, info: --json, alone on stdout),
extract's -v and --dry-run (the plan from the headers, nothing written), and every help line
naming its default."""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
CHANGED = ["transformer_blocks.0.attn1.to_q", "transformer_blocks.0.ff.net.0.proj"]


def run(*args, cwd="/"):
    return subprocess.run([sys.executable, "-m", "ltx2blas", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def nbytes(tensors):
    return sum(value.nbytes for _, value in tensors.values())


@pytest.fixture
def files(tmp_path, rng):
    model = ck.model(rng)
    tuned = dict(model)
    for module in CHANGED:
        shape = ck.MODULES[module]
        tuned[M + module + ".weight"] = ("BF16", random_bf16(rng, shape, 0.02))
    paths = {"model": ck.write(tmp_path / "model.safetensors", model),
             "tuned": ck.write(tmp_path / "tuned.safetensors", tuned),
             "lora": ck.write(tmp_path / "lora.safetensors",
                              ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4)),
             "out": tmp_path / "out.safetensors"}
    return paths, model


def test_fuse_json_is_the_report_alone_on_stdout(files):
    paths, model = files
    r = run("fuse", paths["model"], "--lora", f"{paths['lora']}:0.75", "-o", paths["out"],
            "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)  # nothing else on stdout
    assert r.stderr == ""          # and no progress: --json is for a program to read
    rows, cols = ck.MODULES["transformer_blocks.0.attn1.to_q"]
    assert report["output"] == str(paths["out"]) and report["dry_run"] is False
    assert report["modules_fused"] == 1 and report["tensors_total"] == len(model)
    assert report["tensors_copied"] == len(model) - 1
    assert report["fused"] == [{"name": M + "transformer_blocks.0.attn1.to_q.weight",
                                "adapters": [0], "kinds": ["LoRA"]}]
    assert report["gflop"] == pytest.approx(2 * rows * cols * 4 / 1e9)
    # every tensor of the base read once and written once
    assert report["bytes_read"] == report["bytes_written"] == nbytes(model)
    assert report["copy_bound"] is True and report["gb_per_s"] >= 0
    [adapter] = report["adapters"]
    assert adapter["path"] == str(paths["lora"]) and adapter["strength"] == 0.75
    assert adapter["pairs_used"] == 1 and adapter["keys_used"] == 2
    assert "metadata" not in report  # the record of digests is the output's, not the report's


def test_fuse_json_of_a_dry_run(files):
    paths, _ = files
    r = run("fuse", paths["model"], "--lora", paths["lora"], "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["dry_run"] is True and report["modules_fused"] == 1
    assert report["bytes_written"] == 0 and not paths["out"].exists()


def test_extract_json_is_the_report_alone_on_stdout(files):
    paths, model = files
    r = run("extract", paths["tuned"], "--base", paths["model"], "-o", paths["out"],
            "--rank", "4", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert r.stderr == ""
    assert report["weights_extracted"] == len(CHANGED) and report["rank"] == 4
    assert report["weights_equal"] == 5 - len(CHANGED)  # four Linear weights and the 4x4 one
    assert sorted(report["ranks"]) == sorted(M + m + ".weight" for m in CHANGED)
    assert all(v["rank"] == 4 and 0 < v["kept"] <= 1 for v in report["ranks"].values())
    assert report["bytes_written"] == os.path.getsize(paths["out"])
    assert report["bytes_read"] == 2 * nbytes(model)  # both sides, of the same sizes
    assert report["dry_run"] is False and report["planned"] == {}


def test_extract_verbose_lists_each_weight_its_rank_and_fraction(files):
    paths, _ = files
    r = run("extract", paths["tuned"], "--base", paths["model"], "-o", paths["out"],
            "--rank", "3", "-v", "-q")
    assert r.returncode == 0, r.stderr
    listed = [line.split() for line in r.stdout.splitlines() if line.startswith("  ")]
    assert sorted(words[0] for words in listed) == sorted(M + m + ".weight" for m in CHANGED)
    assert all(words[1:3] == ["rank", "3,"] and words[3] == "kept" for words in listed)


def test_extract_dry_run_writes_nothing_and_lists_the_plan(files):
    paths, model = files
    folder = sorted(os.listdir(paths["out"].parent))
    r = run("extract", paths["tuned"], "--base", paths["model"], "-o", paths["out"],
            "--rank", "4", "--dry-run", "-v")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(paths["out"].parent)) == folder  # no output, no spill
    assert r.stdout.startswith("would extract up to 5 Linear weights at rank 4")
    for module, shape in ck.MODULES.items():
        assert f"  {M}{module}.weight  {list(shape)}  rank 4" in r.stdout
    assert "  vae.decoder.conv.weight  [4, 4]  rank 4" in r.stdout
    # without -o: the plan alone
    r = run("extract", paths["tuned"], "--base", paths["model"], "--rank", "4", "--dry-run",
            "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    shapes = {M + m + ".weight": s for m, s in ck.MODULES.items()} | {
        "vae.decoder.conv.weight": (4, 4)}
    assert plan["dry_run"] is True and plan["output"] == ""
    assert plan["planned"] == {n: {"shape": list(s), "rank": 4} for n, s in shapes.items()}
    # bf16 A [4, cols] and B [rows, 4], and an F32 alpha, for every weight
    assert plan["bytes_planned"] == sum(4 * (r_ + c) * 2 + 4 for r_, c in shapes.values())
    assert plan["weights_extracted"] == 0 and plan["other_tensors"] == len(model) - 5


def test_extract_dry_run_in_energy_mode_gives_the_largest_ranks(files):
    paths, _ = files
    r = run("extract", paths["tuned"], "--base", paths["model"], "--energy", "0.9",
            "--max-rank", "40", "--dry-run", "--dtype", "f32", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    shapes = {M + m + ".weight": s for m, s in ck.MODULES.items()} | {
        "vae.decoder.conv.weight": (4, 4)}
    assert {n: p["rank"] for n, p in plan["planned"].items()} == {
        n: min(40, *s) for n, s in shapes.items()}
    assert plan["bytes_planned"] == sum(min(40, *s) * sum(s) * 4 + 4 for s in shapes.values())
    r = run("extract", paths["tuned"], "--base", paths["model"], "--energy", "0.9",
            "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "the ranks are known only once the SVD has run" in r.stdout
    assert "nothing written" in r.stdout


def test_extract_dry_run_reads_no_tensor(files, monkeypatch):
    """The plan is made from the headers: reading any tensor's data fails the test."""
    from ltx2blas.files import extract, safetensors

    paths, _ = files

    def no_read(*args, **kwargs):
        raise AssertionError("a dry run read a tensor")

    monkeypatch.setattr(safetensors.SafetensorsFile, "read", no_read)
    report = extract.extract_lora(paths["tuned"], paths["model"], None, rank=4, dry_run=True)
    assert report.dry_run and len(report.planned) == 5 and report.bytes_read == 0


def test_every_help_line_gives_its_default():
    """Every option of every command with a default other than None or False names it in its
    help line (the word and the value)."""
    from ltx2blas.cli import build_parser

    parser = build_parser()
    missing, checked = [], 0
    for command in ("fuse", "verify", "extract", "demo", "info"):
        for action in parser.commands[command]._actions:
            default = action.default
            if default in (None, False, argparse.SUPPRESS) or action.help == argparse.SUPPRESS:
                continue
            checked += 1
            text = action.help % {"default": default} if "%(" in action.help else action.help
            text = text.replace("%%", "%")
            if not ("default" in text and str(default) in text):
                missing.append((command, "/".join(action.option_strings), text))
    assert checked > 10 and missing == []
