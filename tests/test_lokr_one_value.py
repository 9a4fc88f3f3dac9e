"""A LoKr one of whose factors is [1, 1] -- its other factor the weight's shape, a pair or
stored whole -- fused tile by tile, with no f32 copy of that factor: the same bytes as
ltx2blas.reference's Kronecker rule (w1 (x) w2 with w1 = [[v]] is v * w2, one f32 product an
element, then the scale, then one rounding), alone and among other adapters by both rules, and
peak memory within the bound docs/files.md states for a checkpoint fuse, for every kind."""
import json
import subprocess
import sys

import numpy as np
import pytest

import ltx2blas
from ltx2blas import LoHa, LoKr, reference
from ltx2blas.fuse import aggregate_delta

import ckpt_helpers as ck
from helpers import random_bf16

ROWS, COLS = 300, 200   # more than one tile each way, with edge tiles


def pair(rng, m, n, rank=3, scale=0.3):
    return random_bf16(rng, (m, rank), scale), random_bf16(rng, (rank, n), scale)


#: the single value: ordinary, -0.0, +0.0, subnormal, near bf16's largest (products overflow)
VALUES = [0xC0A0, 0x8000, 0x0000, 0x8001, 0x7F00]


def one_value_lokrs(rng, bits):
    v = np.array([[bits]], np.uint16)
    v_pair = (np.array([[bits, 0x3F80]], np.uint16), np.array([[0x3F80], [0x3C00]], np.uint16))
    return [LoKr(v, pair(rng, ROWS, COLS), np.float32(0.7)),                 # w1 [1, 1], w2 a pair
            LoKr(v, random_bf16(rng, (ROWS, COLS), 0.3), np.float32(3.0)),   # w2 whole
            LoKr(pair(rng, ROWS, COLS), v, np.float32(-1.3)),                # w2 [1, 1], w1 a pair
            LoKr(random_bf16(rng, (ROWS, COLS), 0.3), v, np.float32(0.25)),  # w1 whole
            LoKr(v_pair, pair(rng, ROWS, COLS), np.float32(1.5)),            # w1 a [1, 1] pair
            LoKr(random_bf16(rng, (ROWS, COLS), 0.3), v_pair, np.float32(2.0))]


@pytest.mark.parametrize("bits", VALUES)
@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_a_one_value_lokr_fuses_as_the_reference_kronecker_product(rng, bits, rule):
    w = random_bf16(rng, (ROWS, COLS), 0.05)
    lora = pair(rng, ROWS, COLS, rank=5, scale=0.1)[::-1] + (0.5,)
    loha = LoHa(*pair(rng, ROWS, COLS), *pair(rng, ROWS, COLS), 0.2)
    for lokr in one_value_lokrs(rng, bits):
        for adapters in ([lokr], [lora, lokr], [lokr, loha, lokr]):
            with np.errstate(all="ignore"):
                want = reference.fuse_loras(w, adapters, rule=rule)
            got = ltx2blas.fuse_loras(w, adapters, rule=rule, threads=2)
            assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


def test_one_value_lokr_deltas_and_fp8(rng):
    w = reference.fp8_round(rng.standard_normal((ROWS, COLS)).astype(np.float32) * 0.05,
                            "F8_E4M3")
    for lokr in one_value_lokrs(rng, 0xBE80):
        with np.errstate(all="ignore"):
            assert np.array_equal(aggregate_delta(ROWS, COLS, [lokr, lokr],
                                                  threads=2).view(np.uint16),
                                  reference.aggregate_delta([lokr, lokr]).view(np.uint16))
            got = ltx2blas.fuse_loras(w, [lokr], weight_format="F8_E4M3", threads=2)
            want = reference.fuse_loras_fp8(w, [lokr], "F8_E4M3")
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))


M = "model.diffusion_model."
Q, K = "transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_k"  # [64, 48]


@pytest.mark.parametrize("rule", ["addmm", "sum"])
def test_one_value_lokr_files_among_several_adapters(tmp_path, rng, rule):
    pytest.importorskip("safetensors")
    pytest.importorskip("ml_dtypes")
    tensors = ck.model(rng)
    model = ck.write(tmp_path / "model.safetensors", tensors)
    one = np.array([[0xBFC0]], np.uint16)
    a2, b2 = pair(rng, 64, 48, rank=4)
    kr = {f"lycoris_{Q.replace('.', '_')}.lokr_w1": ("BF16", one),
          f"lycoris_{Q.replace('.', '_')}.lokr_w2_a": ("BF16", a2),
          f"lycoris_{Q.replace('.', '_')}.lokr_w2_b": ("BF16", b2),
          f"lycoris_{Q.replace('.', '_')}.alpha": ("F32", np.array(2.0, np.float32)),
          f"diffusion_model.{K}.lokr_w1": ("BF16", random_bf16(rng, (64, 48), 0.3)),
          f"diffusion_model.{K}.lokr_w2": ("BF16", one)}
    lora = ck.adapter(rng, [Q, K], rank=6)
    ck.write(tmp_path / "kr.safetensors", kr)
    ck.write(tmp_path / "lora.safetensors", lora)
    out = tmp_path / "out.safetensors"
    ltx2blas.fuse_checkpoint(model, [(tmp_path / "lora.safetensors", 0.8),
                                     (tmp_path / "kr.safetensors", -1.1)], out, rule=rule)
    with ltx2blas.files.safetensors.SafetensorsFile(out) as f:
        fused = {n: f.read(n) for n in (M + Q + ".weight", M + K + ".weight")}
    for module, lokr in ((Q, LoKr(one, (a2, b2), reference.lycoris_scale(-1.1, 2.0, 4))),
                         (K, LoKr(kr[f"diffusion_model.{K}.lokr_w1"][1], one, np.float32(-1.1)))):
        a = lora[f"diffusion_model.{module}.lora_A.weight"][1]
        b = lora[f"diffusion_model.{module}.lora_B.weight"][1]
        want = reference.fuse_loras(tensors[M + module + ".weight"][1],
                                    [(a, b, 0.8), lokr], rule=rule)
        assert np.array_equal(fused[M + module + ".weight"], want.view(np.uint16)), module


MEMORY_SCRIPT = r"""
import json, os, sys, numpy as np
import ltx2blas
from ltx2blas.files.safetensors import SafetensorsWriter

def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024

def reset():
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # the peak (VmHWM) back to the resident size
    return status('VmRSS')

folder, tensors = {folder!r}, {tensors!r}
rows = cols = 8192  # a 128 MiB bf16 weight
name = "model.diffusion_model.transformer_blocks.0.attn1.to_q.weight"
module = "diffusion_model.transformer_blocks.0.attn1.to_q"
model, adapter = os.path.join(folder, "m.safetensors"), os.path.join(folder, "a.safetensors")
out = os.path.join(folder, "out.safetensors")
with SafetensorsWriter(model, [(name, "BF16", (rows, cols), rows * cols * 2)]) as w:
    w.write(name, np.full((rows, cols), 0x3C00, np.uint16))
    w.commit()
rng = np.random.default_rng(0)
entries = [(module + suffix, dtype, tuple(shape), 2 * int(np.prod(shape)) if dtype == "BF16"
            else 4 * int(np.prod(shape))) for suffix, dtype, shape in tensors]
with SafetensorsWriter(adapter, entries) as w:
    for key, dtype, shape, _ in entries:
        w.write(key, rng.integers(0x3800, 0x3C00, size=shape, dtype=np.uint16) if dtype == "BF16"
                else np.ones(shape, np.float32))
    w.commit()
ltx2blas.fuse_lora(np.zeros((512, 512), np.uint16), np.zeros((1, 512), np.uint16),
                   np.zeros((512, 1), np.uint16), threads=2)
before = reset()
ltx2blas.fuse_checkpoint(model, [(adapter, 0.5)], out, threads=2)
fuse = status('VmHWM') - before
before = reset()
report = ltx2blas.verify_checkpoint(out, model, [adapter], threads=2)
assert report.status == "verified" and report.tensors_rebuilt == 1, report.summary()
print(json.dumps({{"fuse": fuse, "verify": status('VmHWM') - before, "weight": rows * cols * 2,
                  "factors": sum(e[3] for e in entries)}}))
"""

N = 8192
KINDS = {
    "lokr w1 [1, 1], w2 a rank-1 pair": [(".lokr_w1", "BF16", (1, 1)),
                                        (".lokr_w2_a", "BF16", (N, 1)),
                                        (".lokr_w2_b", "BF16", (1, N))],
    "lokr w1 [1, 1], w2 whole": [(".lokr_w1", "BF16", (1, 1)), (".lokr_w2", "BF16", (N, N))],
}
SLOW_KINDS = {
    "lokr w1 a rank-1 pair, w2 [1, 1]": [(".lokr_w1_a", "BF16", (N, 1)),
                                        (".lokr_w1_b", "BF16", (1, N)),
                                        (".lokr_w2", "BF16", (1, 1))],
    "lora rank 1": [(".lora_A.weight", "BF16", (1, N)), (".lora_B.weight", "BF16", (N, 1))],
    "dora rank 1": [(".lora_A.weight", "BF16", (1, N)), (".lora_B.weight", "BF16", (N, 1)),
                    (".lora_magnitude_vector", "F32", (N,))],
    "diff": [(".diff", "BF16", (N, N))],
    "loha rank 1": [(".hada_w1_a", "BF16", (N, 1)), (".hada_w1_b", "BF16", (1, N)),
                    (".hada_w2_a", "BF16", (N, 1)), (".hada_w2_b", "BF16", (1, N))],
    "lokr w1 [2, 1], w2 a rank-1 pair": [(".lokr_w1", "BF16", (2, 1)),
                                        (".lokr_w2_a", "BF16", (N // 2, 1)),
                                        (".lokr_w2_b", "BF16", (1, N))],
    "lokr w1 [1, 1] as a pair, w2 a rank-1 pair": [(".lokr_w1_a", "BF16", (1, 2)),
                                                  (".lokr_w1_b", "BF16", (2, 1)),
                                                  (".lokr_w2_a", "BF16", (N, 1)),
                                                  (".lokr_w2_b", "BF16", (1, N))],
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("kind", list(KINDS) + [pytest.param(k, marks=pytest.mark.slow)
                                                for k in SLOW_KINDS])
def test_every_kind_fuses_and_verifies_within_the_memory_bound(tmp_path, kind):
    """docs/files.md: a checkpoint fuse's peak memory is about twice the largest fused tensor
    with its factors plus 64 MiB (here, with Python's own, 128 MiB); docs/verify.md: a rebuild
    holds the largest weight about four times and its factors.  A LoKr with a [1, 1] factor
    once widened its other factor, the weight's size, to f32 first: 256 MiB more here, twice
    that in a verify."""
    code = MEMORY_SCRIPT.format(folder=str(tmp_path), tensors={**KINDS, **SLOW_KINDS}[kind])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert m["fuse"] <= 2 * (m["weight"] + m["factors"]) + 128 * 2**20, m
    assert m["verify"] <= 4 * m["weight"] + m["factors"] + 128 * 2**20, m
