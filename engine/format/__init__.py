"""Weights on disk: Hugging Face checkpoints (safetensors headers validated), config.json validation,
tensor rules, quantized containers (stamp, names, checks), published FP8 checkpoints
(fp8_checkpoint.py), the layout of each expert's bytes, conversion, GGUF import (gguf/), and the
streaming safetensors writer. What it reads becomes engine/weights' operators (QuantWeight,
Fp8Weight, Mxfp4Matrix), whose math lives there.

Owns: bytes ↔ tensors and what a valid file is.
May import: engine.base, engine.native, engine.weights, engine.arch (the registry's records: tensor
names and shapes, config rules, each architecture's GGUF names).
"""
