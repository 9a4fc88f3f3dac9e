"""How many adapter pairs of each format the field uses find their weight.

Builds an LTX-2-named model (one transformer block's 28 Linears and the top-level Linears that
LoRAs target, at small shapes) in LTX-2's single-file naming and in diffusers' naming, writes
one adapter touching every module in each format -- LTX-2's trainer, PEFT, diffusers, kohya,
kohya flattened, ComfyUI's spellings, LyCORIS -- and counts, by a dry run of fuse_checkpoint,
the pairs that match.

    python bench/adapter_formats.py [--out FILE.json]
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, "tests"))

import ltx2blas  # noqa: E402
from ltx2blas.files import keys  # noqa: E402

import ckpt_helpers as ck  # noqa: E402

BLOCK = [f"transformer_blocks.0.{attn}.{p}" for attn in (
    "attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    for p in ("to_q", "to_k", "to_v", "to_out.0")] + [
    "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff.net.2",
    "transformer_blocks.0.audio_ff.net.0.proj", "transformer_blocks.0.audio_ff.net.2"]
TOP = ["patchify_proj", "audio_patchify_proj", "proj_out", "audio_proj_out",
       "adaln_single.linear", "adaln_single.emb.timestep_embedder.linear_1",
       "audio_adaln_single.linear", "caption_projection.linear_1",
       "av_ca_video_scale_shift_adaln_single.linear", "av_ca_a2v_gate_adaln_single.linear",
       "av_ca_audio_scale_shift_adaln_single.linear", "av_ca_v2a_gate_adaln_single.linear",
       "prompt_adaln_single.linear", "audio_prompt_adaln_single.linear"]
MODULES = BLOCK + TOP
SHAPE = (16, 16)

FORMATS = {
    "LTX-2 trainer": lambda m: (f"diffusion_model.{m}.lora_A.weight", f"diffusion_model.{m}.lora_B.weight"),
    "PEFT": lambda m: (f"base_model.model.{m}.lora_A.weight", f"base_model.model.{m}.lora_B.weight"),
    "diffusers": lambda m: (f"transformer.{keys.to_diffusers(m)}.lora_A.weight",
                            f"transformer.{keys.to_diffusers(m)}.lora_B.weight"),
    "kohya": lambda m: (f"{m}.lora_down.weight", f"{m}.lora_up.weight"),
    "kohya flattened": lambda m: (f"lora_unet_{m.replace('.', '_')}.lora_down.weight",
                                  f"lora_unet_{m.replace('.', '_')}.lora_up.weight"),
    "ComfyUI _lora.up": lambda m: (f"{m}_lora.down.weight", f"{m}_lora.up.weight"),
    "LyCORIS": lambda m: (f"lycoris_{m.replace('.', '_')}.lora_down.weight",
                          f"lycoris_{m.replace('.', '_')}.lora_up.weight"),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    zeros = np.zeros(SHAPE, np.uint16)
    result = {"modules": len(MODULES), "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "LTX-2 single file": ck.write(os.path.join(tmp, "ltx.safetensors"), {
                f"model.diffusion_model.{m}.weight": ("BF16", zeros) for m in MODULES}),
            "diffusers transformer": ck.write(os.path.join(tmp, "diffusers.safetensors"), {
                f"{keys.to_diffusers(m)}.weight": ("BF16", zeros) for m in MODULES}),
        }
        for fmt, names in FORMATS.items():
            tensors = {}
            for m in MODULES:
                a, b = names(m)
                tensors[a] = ("BF16", rng.integers(0, 2, (2, SHAPE[1])).astype(np.uint16))
                tensors[b] = ("BF16", rng.integers(0, 2, (SHAPE[0], 2)).astype(np.uint16))
            path = ck.write(os.path.join(tmp, f"{len(result['formats'])}.safetensors"), tensors)
            row = {}
            for model_name, model in models.items():
                report = ltx2blas.fuse_checkpoint(model, [(path, 1.0)], os.path.join(tmp, "o"),
                                                  dry_run=True, allow_unmatched=True)
                row[model_name] = {"fused": report.modules_fused,
                                   "unmatched": len(report.adapters[0].unmatched_modules)}
            result["formats"][fmt] = row
            print(f"{fmt:18s} " + "  ".join(f"{k}: {v['fused']}/{len(MODULES)}" for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
