"""FP8 test models: the published layout written by engine/synth/fp8_writer.py, and transformers'
model on the very values that layout stores (the oracle of an FP8 run).

transformers is the oracle only: tests import this module; the engine never does.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.synth.fp8_writer import write_fp8_checkpoint


def write_sharded_fp8(src: Path, dst: Path, block, oracle_dir: Path | None = None, **kw) -> None:
    """Three shards cut by layer, as the releases are; `oracle_dir`: the values as fp32."""
    write_fp8_checkpoint(src, dst, block=block, shards=3, values_dir=oracle_dir, **kw)


def oracle_model(oracle_dir: Path):
    """transformers' model on the FP8 file's values (fp32)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32, attn_implementation="eager").eval()
