"""Every dtype the engine knows, in one table: its safetensors tag, its name (torch's, which is
also Hugging Face's `torch_dtype` spelling), its size, and the short name configs and flags use.

Torch-free at import, so engine/base/config.py (and the CLI's argument parser) can read the names
without loading torch; the torch dtypes are looked up on first use.
"""

from __future__ import annotations

from functools import lru_cache

# (safetensors tag, torch/HF name, bytes per element, short name or None)
_ROWS = (
    ("F64", "float64", 8, None),
    ("F32", "float32", 4, "fp32"),
    ("BF16", "bfloat16", 2, "bf16"),
    ("F16", "float16", 2, "fp16"),
    ("I64", "int64", 8, None),
    ("I32", "int32", 4, None),
    ("I16", "int16", 2, None),
    ("I8", "int8", 1, None),
    ("U8", "uint8", 1, None),
    ("BOOL", "bool", 1, None),
    # FP8 e4m3 weights of published block-scaled checkpoints (engine/weights/fp8.py): never a compute dtype.
    ("F8_E4M3", "float8_e4m3fn", 1, None),
)

# The floats weights are stored and computed in (synth writes them; a checkpoint's torch_dtype).
FLOAT_NAMES = ("float32", "bfloat16", "float16")
SHORT_NAMES = tuple(short for _, name, _, short in _ROWS if name in FLOAT_NAMES)  # fp32, bf16, fp16
ITEMSIZE = {name: size for _, name, size, _ in _ROWS}
TAG_OF = {name: tag for tag, name, _, _ in _ROWS}


def _torch(name: str):
    import torch
    return getattr(torch, name)


@lru_cache(maxsize=1)
def safetensors_dtypes() -> dict:
    """safetensors tag → (torch dtype, bytes per element)."""
    return {tag: (_torch(name), size) for tag, name, size, _ in _ROWS}


@lru_cache(maxsize=1)
def short_dtypes() -> dict:
    """'fp32' / 'bf16' / 'fp16' → torch dtype (EngineConfig.dtype and kv_dtype)."""
    return {short: _torch(name) for _, name, _, short in _ROWS if short}


def torch_dtype(name: str):
    """A torch dtype from its short ('bf16') or full ('bfloat16') name; None if unknown."""
    full = {short: name for _, name, _, short in _ROWS if short}.get(name, name)
    return _torch(full) if full in ITEMSIZE else None


def short_name(dtype) -> str:
    """'bf16' for torch.bfloat16 (or 'bfloat16'); the full name where there is no short one."""
    name = str(dtype).replace("torch.", "")
    return next((short for _, full, _, short in _ROWS if full == name and short), name)
