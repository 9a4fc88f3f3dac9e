"""Make this folder's files: a small base checkpoint, two adapters, and the file that
ltx2blas 0.1.0 fused from them, whose provenance record is of format 1.

    python tests/data/format1/make.py LTX2BLAS-0.1.0-COMMAND

writes base.safetensors, a1.safetensors, a2.safetensors (numpy only, from a fixed seed) and runs
``LTX2BLAS-0.1.0-COMMAND fuse base.safetensors --lora a1.safetensors:0.8 --lora a2.safetensors:-1.5
-o fused.safetensors --threads 1`` here.  The fused file is kept as 0.1.0 wrote it: later
versions must still verify it (tests/test_record_format2.py).
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
M = "model.diffusion_model."
MODULES = {"transformer_blocks.0.attn1.to_q": (16, 8), "transformer_blocks.0.attn1.to_k": (16, 8),
           "transformer_blocks.0.ff.net.0.proj": (24, 8)}


def bf16(rng, shape, scale):
    """BF16 bits (uint16) of normal values, rounded to nearest even."""
    x = (rng.standard_normal(shape) * scale).astype(np.float32).view(np.uint32)
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)


def write(path, tensors, metadata=None):
    """A safetensors file: ``tensors`` {name: (dtype, array)}, in sorted order, 8-aligned."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        dtype, value = tensors[name]
        data = np.ascontiguousarray(value).tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def main(command):
    rng = np.random.default_rng(20250101)
    base = {}
    for module, shape in MODULES.items():
        base[M + module + ".weight"] = ("BF16", bf16(rng, shape, 0.02))
        base[M + module + ".bias"] = ("BF16", bf16(rng, shape[:1], 0.02))
    base[M + "norm_out.weight"] = ("F32", rng.standard_normal(8).astype(np.float32))
    write(os.path.join(HERE, "base.safetensors"), base, {"format": "pt"})
    a1 = {}
    for module in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.ff.net.0.proj"):
        out_f, in_f = MODULES[module]
        a1["diffusion_model." + module + ".lora_A.weight"] = ("BF16", bf16(rng, (2, in_f), 0.05))
        a1["diffusion_model." + module + ".lora_B.weight"] = ("BF16", bf16(rng, (out_f, 2), 0.05))
    write(os.path.join(HERE, "a1.safetensors"), a1)
    a2 = {}
    for module in ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_k"):
        out_f, in_f = MODULES[module]
        a2[module + ".lora_down.weight"] = ("BF16", bf16(rng, (3, in_f), 0.05))
        a2[module + ".lora_up.weight"] = ("BF16", bf16(rng, (out_f, 3), 0.05))
        a2[module + ".alpha"] = ("F32", np.array(6.0, np.float32))
    write(os.path.join(HERE, "a2.safetensors"), a2)
    subprocess.run([*command, "fuse", "base.safetensors", "--lora", "a1.safetensors:0.8",
                    "--lora", "a2.safetensors:-1.5", "-o", "fused.safetensors", "--threads", "1",
                    "-q"], cwd=HERE, check=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["ltx2blas"])
