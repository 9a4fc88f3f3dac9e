"""Progress is of the work, bytes read and written plus arithmetic (Progress.fraction): a fuse
that copies most of a checkpoint is not shown done when its one weight is fused, the share
only grows and is 1.0 exactly at the end, in every command; the rate is in GB/s where copying
dominates, in GFLOP/s where arithmetic does."""
import io
import subprocess
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import cli
from ltx2blas.files.checkpoint import Progress
from ltx2blas.files.extract import extract_lora

import ckpt_helpers as ck
from helpers import random_bf16

pytest.importorskip("safetensors")
pytest.importorskip("ml_dtypes")

M = "model.diffusion_model."
FUSED = M + "transformer_blocks.0.attn1.to_q.weight"
COPIED = 16


@pytest.fixture
def copy_bound(tmp_path, rng):
    """One small weight an adapter fuses, then many large tensors copied (all bf16, named so
    that the weight comes first in the file)."""
    tensors = {FUSED: ("BF16", random_bf16(rng, ck.MODULES["transformer_blocks.0.attn1.to_q"],
                                           0.02))}
    for i in range(COPIED):
        tensors[f"{M}zz_copied.{i:02d}.weight"] = ("BF16", random_bf16(rng, (256, 256), 0.02))
    model = ck.write(tmp_path / "model.safetensors", tensors)
    lora = ck.write(tmp_path / "lora.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q"], rank=4))
    return model, lora, tmp_path / "out.safetensors", tensors


def check_steps(seen):
    """Each step's fractions never fall and end at exactly 1.0 (a step begins where the
    tensors count from 1 again)."""
    steps = []
    for p in seen:
        if p.tensors_done == 1 or not steps:
            steps.append([])
        steps[-1].append(p.fraction)
    for fractions in steps:
        assert all(0 <= f <= 1 for f in fractions)
        assert all(a <= b for a, b in zip(fractions, fractions[1:])), fractions
        assert fractions[-1] == 1.0
    return steps


def test_a_copy_bound_fuse_is_not_done_when_its_weight_is(copy_bound):
    model, lora, out, tensors = copy_bound
    seen = []
    ltx2blas.fuse_checkpoint(model, [(lora, 1.0)], out, progress=seen.append)
    names = [p.name for p in seen]
    assert names.index(FUSED) < len(seen) - COPIED  # copies follow the fused weight
    after = seen[names.index(FUSED)]
    assert after.gflop_done == after.gflop_total > 0  # all the arithmetic is done
    total = 2 * sum(value.nbytes for _, value in tensors.values())  # read and written
    assert after.bytes_total == total and after.bytes_done < total / COPIED
    assert after.fraction < 0.1  # the copying is yet to come
    assert after.copy_bound
    check_steps(seen)
    assert seen[-1].bytes_done == total and seen[-1].fraction == 1.0


def test_the_command_shows_a_copy_bound_fuse_by_its_bytes(copy_bound):
    """On a pipe: the first line, after the fused weight, is near 0 %, not 100 %; the rate is
    in GB/s."""
    model, lora, out, _ = copy_bound
    r = subprocess.run([sys.executable, "-m", "ltx2blas", "fuse", str(model), "--lora",
                        str(lora), "-o", str(out)], capture_output=True, text=True, cwd="/",
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"ltx2blas: 0% 1/{COPIED + 1} tensors"), lines
    assert lines[-1].startswith(f"ltx2blas: 100% {COPIED + 1}/{COPIED + 1} tensors")
    assert all("GB/s" in line and "GFLOP/s" not in line for line in lines)
    assert "GB/s read and written" in r.stdout


def test_the_printer_gives_the_rate_of_the_work_that_dominates():
    def shown(progress):
        stream = io.StringIO()
        cli._ProgressPrinter(stream)(progress)
        return stream.getvalue()

    # copying: 2 GB moved of 4 GB in 1 s, a little arithmetic
    copying = shown(Progress(1, 4, 0.5, 1.0, 1.0, "w", 2 * 10**9, 4 * 10**9))
    # arithmetic: 500 GFLOP of 1000 in 10 s, a few bytes
    arithmetic = shown(Progress(1, 2, 500.0, 1000.0, 10.0, "w", 10**6, 2 * 10**6))
    assert "2.00 GB/s" in copying and "GFLOP/s" not in copying
    assert "50.0 GFLOP/s" in arithmetic and "GB/s" not in arithmetic


def test_the_share_shown_is_rounded_down():
    """100 % only at the end, not when the tensors left are small."""
    stream = io.StringIO()
    printer = cli._ProgressPrinter(stream)
    printer(Progress(9, 10, 0.0, 0.0, 1.0, "w", 9995, 10000))
    printer(Progress(10, 10, 0.0, 0.0, 1.0, "w", 10000, 10000))
    first, last = stream.getvalue().splitlines()
    assert first.startswith("ltx2blas: 99% 9/10") and last.startswith("ltx2blas: 100% 10/10")


def test_a_progress_made_as_before_still_works():
    """Made with the six fields it had, a Progress counts GFLOP, or tensors without them."""
    assert Progress(1, 4, 0.0, 0.0, 0.5, "x").fraction == 0.25
    assert Progress(1, 4, 1.0, 4.0, 0.5, "x").fraction == 0.25
    assert Progress(4, 4, 3.999, 4.0, 0.5, "x").fraction == 1.0


def test_extract_progress_grows_to_one(tmp_path, rng):
    """Bytes of both sides read and the range finder's arithmetic; a weight found equal takes
    its arithmetic off the total, so the share never falls."""
    base = ck.model(rng)
    tuned = dict(base)
    module = "transformer_blocks.0.ff.net.0.proj"
    tuned[M + module + ".weight"] = ("BF16", random_bf16(rng, ck.MODULES[module], 0.02))
    bp = ck.write(tmp_path / "base.safetensors", base)
    tp = ck.write(tmp_path / "tuned.safetensors", tuned)
    seen = []
    report = extract_lora(tp, bp, tmp_path / "l.safetensors", rank=4, progress=seen.append)
    assert len(seen) == len(base)
    assert [s.tensors_done for s in seen] == list(range(1, len(base) + 1))
    total = 2 * sum(value.nbytes for _, value in base.values())
    assert all(s.bytes_total == total for s in seen) and seen[-1].bytes_done == total
    assert seen[-1].gflop_done == pytest.approx(report.gflop) and report.gflop > 0
    assert len(check_steps(seen)) == 1


def test_verify_progress_of_each_step_grows_to_one(tmp_path, rng):
    model = ck.model(rng)
    mp = ck.write(tmp_path / "model.safetensors", model)
    lora = ck.write(tmp_path / "lora.safetensors",
                    ck.adapter(rng, ["transformer_blocks.0.attn1.to_q",
                                     "transformer_blocks.1.attn1.to_q"], rank=4))
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(mp, [(lora, 1.0)], out)
    seen = []
    ltx2blas.verify_checkpoint(out, progress=seen.append)  # the file against its record
    assert len(check_steps(seen)) == 1
    assert seen[-1].bytes_total == seen[-1].bytes_done == sum(v.nbytes for _, v in
                                                              model.values())
    seen = []
    ltx2blas.verify_checkpoint(out, mp, [(lora, 1.0)], progress=seen.append)
    rebuild, hashing = check_steps(seen)
    assert len(rebuild) == 2 and len(hashing) == len(model) - 2
    # the rebuild reads each weight from the base and from the file
    weights = [M + m + ".weight" for m in ("transformer_blocks.0.attn1.to_q",
                                           "transformer_blocks.1.attn1.to_q")]
    assert seen[1].bytes_total == 2 * sum(model[w][1].nbytes for w in weights)
