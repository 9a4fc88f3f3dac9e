"""An in-place fuse allocates panel buffers only: no full-size temporary of the weight.

Bound per thread (ltx2blas.fuse.buffer_bytes): 4 bytes x (tile_rows x rank + rank x tile_cols
+ tile_rows x tile_cols), plus, up to rank 4096 (PASS_DEPTH), tile_rows x ceil(rank / 2) x 4 bytes of pairs for
the dot-product kernel, whose adapters share one copy of A in pairs (ceil(rank / 2) x cols x 4
bytes) in place of the A panels, plus small fixed costs. Measured as the growth of the process's peak
resident memory (VmHWM, reset just before the call) over its resident memory before the call, in
a fresh subprocess."""
import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, numpy as np
import ltx2blas
from ltx2blas.fuse import buffer_bytes

def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024

rows, cols, rank, threads = {rows}, {cols}, {rank}, {threads}
rng = np.random.default_rng(0)
weight = rng.integers(0x3800, 0x3C00, size=(rows, cols), dtype=np.uint16)
lora_a = rng.integers(0x3800, 0x3C00, size=(rank, cols), dtype=np.uint16)
lora_b = rng.integers(0x3800, 0x3C00, size=(rows, rank), dtype=np.uint16)
# Warm up imports, thread pools and the depth probes of these shapes with a rank-8 call (its
# buffers are 50x smaller, so the measured growth still includes the real call's buffers).
ltx2blas.fuse_lora(weight[:512].copy(), lora_a[:8].copy(), lora_b[:512, :8].copy(), threads=threads)
from ltx2blas import _probe
from ltx2blas._threads import blas_single_threaded
_probe.verified_depth(256, 512, rank, rank, pin=blas_single_threaded)
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset the peak (VmHWM) to the current resident size
before = status('VmRSS')
ltx2blas.fuse_lora(weight, lora_a, lora_b, 0.5, threads=threads, out=weight)
print(json.dumps({{"growth": status('VmHWM') - before, "weight": weight.nbytes,
                  "buffers": buffer_bytes([rank], threads=threads, cols=cols)}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rank", [32, 384])  # the one-pass kernels, and sgemm
def test_in_place_fuse_allocates_panels_only(threads, rank):
    rows, cols = 4096, 8192  # a 64 MiB weight
    code = SCRIPT.format(rows=rows, cols=cols, rank=rank, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=300, check=True)
    m = json.loads(out.stdout)
    # The panel buffers, plus 4 MiB for what a call allocates besides (Python objects, the
    # per-tile flags, allocator rounding). A full-size temporary would add >= 64 MiB.
    assert m["growth"] <= m["buffers"] + 4 * 2**20, m


LINEAR_SCRIPT = r"""
import json, numpy as np
import ltx2blas
from ltx2blas.linear_layer import buffer_bytes

def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024

rows, cols, feats, threads, x_bf16 = {rows}, {cols}, {feats}, {threads}, {x_bf16}
rng = np.random.default_rng(0)
w = rng.integers(0x3800, 0x3C00, size=(feats, cols), dtype=np.uint16)
x = rng.standard_normal((rows, cols), dtype=np.float32)
if x_bf16:  # bf16 bits: the dot-product routes where the CPU has them
    x = (x.view(np.uint32) >> 16).astype(np.uint16)
y = np.empty((rows, feats), np.float32)
ltx2blas.linear(x[:, :4096].copy(), w[:8, :4096].copy(), threads=threads)  # warm up
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS')
ltx2blas.linear(x, w, threads=threads, out=y)
print(json.dumps({{"growth": status('VmHWM') - before, "weight": w.nbytes,
                  "buffers": buffer_bytes(rows, cols, w.dtype, x.dtype, threads=threads,
                                          feats=feats)}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("rows, x_bf16", [(4, False), (64, False), (100, False), (100, True)])
def test_linear_never_widens_the_whole_weight(rows, x_bf16):
    """f32 x: the streaming route with both block shapes, then sgemm or the panel kernel; bf16
    x: the dot-product panel route with x packed once, where the CPU has it."""
    cols, feats = 49 * 3840, 192  # a 69 MiB bf16 weight; an f32 copy would be 138 MiB
    code = LINEAR_SCRIPT.format(rows=rows, cols=cols, feats=feats, threads=2, x_bf16=x_bf16)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=300, check=True)
    m = json.loads(out.stdout)
    assert m["growth"] <= m["buffers"] + 4 * 2**20, m


CHECKPOINT_SCRIPT = r"""
import json, os, numpy as np
import ltx2blas
from ltx2blas.files.safetensors import SafetensorsWriter

def status(field):
    for line in open('/proc/self/status'):
        if line.startswith(field + ':'):
            return int(line.split()[1]) * 1024

folder = {folder!r}
rng = np.random.default_rng(0)
shape, count, fused = (2048, 2048), 48, 8       # 48 tensors of 8 MiB: a 384 MiB checkpoint
names = [f"model.diffusion_model.transformer_blocks.{{i}}.attn1.to_q.weight" for i in range(count)]
block = rng.integers(0x3800, 0x3C00, size=shape, dtype=np.uint16)
with SafetensorsWriter(os.path.join(folder, "m.safetensors"),
                       [(n, "BF16", shape, block.nbytes) for n in names]) as w:
    for n in names:
        w.write(n, block)
    w.commit()
lora = []
for i in range(fused):
    m = f"diffusion_model.transformer_blocks.{{i}}.attn1.to_q"
    lora += [(m + ".lora_A.weight", "BF16", (64, 2048)), (m + ".lora_B.weight", "BF16", (2048, 64))]
with SafetensorsWriter(os.path.join(folder, "a.safetensors"),
                       [(n, d, s, 2 * s[0] * s[1]) for n, d, s in lora]) as w:
    for n, d, s in lora:
        w.write(n, rng.integers(0x3000, 0x3400, size=s, dtype=np.uint16))
    w.commit()
ltx2blas.fuse_lora(block[:512].copy(), np.zeros((64, 2048), np.uint16), np.zeros((512, 64), np.uint16))
del block
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS')
ltx2blas.fuse_checkpoint(os.path.join(folder, "m.safetensors"), [(os.path.join(folder, "a.safetensors"), 1.0)],
                         os.path.join(folder, "out.safetensors"), threads=2)
print(json.dumps({{"growth": status('VmHWM') - before, "largest": 2048 * 2048 * 2,
                  "checkpoint": count * 2048 * 2048 * 2}}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_checkpoint_fuse_streams(tmp_path):
    """Fusing a 384 MiB checkpoint holds about one tensor at a time: peak memory grows by less
    than 2 x the largest tensor (the reader's two buffers: the one being fused, the next being
    read) + 128 MiB (the factors in those buffers, 64 MiB of write staging, Python) -- far below
    its size."""
    code = CHECKPOINT_SCRIPT.format(folder=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert m["growth"] <= 2 * m["largest"] + 128 * 2**20, m


VERIFY_SCRIPT = CHECKPOINT_SCRIPT.replace('''with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS')
ltx2blas.fuse_checkpoint(''', '''ltx2blas.fuse_checkpoint(''').replace('''print(json.dumps(''', '''with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
before = status('VmRSS')
report = ltx2blas.verify_checkpoint(os.path.join(folder, "out.safetensors"),
                                    os.path.join(folder, "m.safetensors"),
                                    [os.path.join(folder, "a.safetensors")], threads=2)
assert report.status == "verified" and report.tensors_rebuilt == fused, report.summary()
print(json.dumps(''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_verify_with_a_rebuild_streams(tmp_path):
    """Verifying a 384 MiB checkpoint against its inputs, every fused tensor rebuilt, holds
    about one tensor at a time: growth below 4 x the largest tensor (the base's, rebuilt in
    place; the file's; the next one of the base, read ahead; the base's kept for a file without
    a record) + 128 MiB (factors, the hashing threads' 1 MiB buffers, Python)."""
    code = VERIFY_SCRIPT.format(folder=str(tmp_path))
    assert "verify_checkpoint" in code and code.count("clear_refs") == 1
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert m["growth"] <= 4 * m["largest"] + 128 * 2**20, m


EXTRACT_SCRIPT = VERIFY_SCRIPT.replace(
    # factors large enough to change the fused weights, which the extraction then finds
    "rng.integers(0x3000, 0x3400, size=s", "rng.integers(0x3C00, 0x3C80, size=s").replace('''report = ltx2blas.verify_checkpoint(os.path.join(folder, "out.safetensors"),
                                    os.path.join(folder, "m.safetensors"),
                                    [os.path.join(folder, "a.safetensors")], threads=2)
assert report.status == "verified" and report.tensors_rebuilt == fused, report.summary()''', '''from ltx2blas.files.extract import extract_lora
report = extract_lora(os.path.join(folder, "out.safetensors"), os.path.join(folder, "m.safetensors"),
                      os.path.join(folder, "x.safetensors"), rank=64, threads=2)
assert report.weights_extracted == fused and report.weights_equal == count - fused, report.summary()''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_extract_streams(tmp_path):
    """Extracting a LoRA from two 384 MiB checkpoints holds about one weight at a time: growth
    below 4 x the largest tensor (the two weights read, their f32 difference of twice the
    size) + 128 MiB (the thin matrices, LAPACK's work, Python); the factors are spilled to a
    file, not kept."""
    code = EXTRACT_SCRIPT.format(folder=str(tmp_path))
    assert "extract_lora" in code and code.count("clear_refs") == 1
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout)
    assert m["growth"] <= 4 * m["largest"] + 128 * 2**20, m
