"""Weights on disk: Hugging Face checkpoints (safetensors headers validated), config.json validation,
tensor rules, quantized containers (stamp, names, checks), quantization math, the layout of each
expert's bytes, conversion, and the streaming safetensors writer.

Owns: bytes ↔ tensors and what a valid file is.
May import: engine.base, engine.native, engine.weights, engine.arch.args (names and shapes of an architecture's tensors).
"""
