"""Synthetic MoE models: a valid Hugging Face directory (qwen3_moe layout) of any geometry, from a seed.

    geometry.py  presets, geometry files, validation, parameter counts (any geometry)
    recipe.py    the tensor plan and the weight recipe (routing skew)
    hf_files.py  config.json, generation_config.json, tokenizer files (engine/synth/bpe_tokenizer.py trains it)
    writer.py    shard planning and the atomic writer

`routing_skew` and the recipe are explained in recipe.py and docs/SYNTH.md.
"""

from engine.synth.geometry import (EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB, PRESETS_DIR, describe_presets,
                                   list_presets, load_geometry_file, load_preset, param_counts, validate_geometry)
from engine.synth.bpe_tokenizer import build_tokenizer
from engine.synth.hf_files import hf_config
from engine.synth.recipe import SYNTH_VERSION, PlannedTensor, Recipe, tensor_plan
from engine.synth.writer import model_bytes, plan_shards, summarize, synthesize

__all__ = ["EOS_TOKEN", "EOS_TOKEN_ID", "MIN_VOCAB", "PRESETS_DIR", "SYNTH_VERSION", "PlannedTensor", "Recipe",
           "build_tokenizer", "describe_presets", "hf_config", "list_presets", "load_geometry_file", "load_preset",
           "model_bytes", "param_counts", "plan_shards", "summarize", "synthesize", "tensor_plan",
           "validate_geometry"]
