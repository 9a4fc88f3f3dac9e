"""Small LTX-2-shaped checkpoints and adapters for the file-layer tests."""
import numpy as np

from ltx2blas import reference

from helpers import random_bf16

MODULES = {
    "transformer_blocks.0.attn1.to_q": (64, 48),
    "transformer_blocks.0.attn1.to_k": (64, 48),
    "transformer_blocks.0.ff.net.0.proj": (96, 48),
    "transformer_blocks.1.attn1.to_q": (64, 48),
}


def write(path, tensors, metadata=None):
    """Write with the reference safetensors package (BF16 given as uint16 bits)."""
    from safetensors.numpy import save_file

    import ml_dtypes

    out = {}
    for name, (dtype, value) in tensors.items():
        if dtype == "BF16":
            out[name] = value.view(ml_dtypes.bfloat16)
        elif dtype == "F8_E4M3":
            out[name] = value.view(ml_dtypes.float8_e4m3fn)
        elif dtype == "F8_E5M2":
            out[name] = value.view(ml_dtypes.float8_e5m2)
        else:
            out[name] = value
    save_file(out, str(path), metadata=metadata)
    return path


def model(rng, prefix="model.diffusion_model.", fp8=None):
    tensors = {}
    for module, shape in MODULES.items():
        if fp8:
            w = reference.fp8_round(rng.standard_normal(shape).astype(np.float32) * 0.05, fp8)
            tensors[prefix + module + ".weight"] = (fp8, w)
        else:
            tensors[prefix + module + ".weight"] = ("BF16", random_bf16(rng, shape, 0.02))
        tensors[prefix + module + ".bias"] = ("BF16", random_bf16(rng, (shape[0],), 0.02))
    tensors[prefix + "norm_out.weight"] = ("F32", rng.standard_normal(48).astype(np.float32))
    tensors["vae.decoder.conv.weight"] = ("F32", rng.standard_normal((4, 4)).astype(np.float32))
    return tensors


def adapter(rng, modules, rank=8, prefix="diffusion_model.", style="peft", alpha=None):
    tensors = {}
    a_suffix, b_suffix = ((".lora_A.weight", ".lora_B.weight") if style == "peft" else
                          (".lora_down.weight", ".lora_up.weight"))
    for module in modules:
        out_f, in_f = MODULES[module]
        name = module.replace(".", "_") if style == "kohya_flat" else module
        tensors[prefix + name + a_suffix] = ("BF16", random_bf16(rng, (rank, in_f), 0.05))
        tensors[prefix + name + b_suffix] = ("BF16", random_bf16(rng, (out_f, rank), 0.05))
        if alpha is not None:
            tensors[prefix + name + ".alpha"] = ("F32", np.array(alpha, np.float32))
    return tensors
