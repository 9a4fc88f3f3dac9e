"""The file layer: safetensors reading and writing, adapter key matching, and fusing adapter
files into checkpoints tensor by tensor."""
