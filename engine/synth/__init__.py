"""Synthetic MoE models: a valid Hugging Face directory of any geometry, from a seed, for every
architecture whose record (engine/arch/families/) has a synth recipe: qwen3_moe (synth's own
layout), deepseek_v3, glm4_moe, glm_moe_dsa, gpt_oss.

    geometry.py  presets, geometry files, validation, parameter counts (any geometry)
    recipe.py    the weight recipe (routing skew); the tensor plan is the architecture's
    hf_files.py  config.json (the architecture's), generation_config.json, tokenizer files
                 (engine/synth/bpe_tokenizer.py trains it)
    writer.py    the tensor plan, shard planning and the atomic writer

`routing_skew` and the recipe are explained in recipe.py and docs/SYNTH.md.
"""

from engine.synth.geometry import (EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB, PRESETS_DIR, describe_presets,
                                   list_presets, load_geometry_file, load_preset, param_counts, validate_geometry)
from engine.synth.bpe_tokenizer import build_tokenizer
from engine.synth.hf_files import hf_config
from engine.arch.architecture import PlannedTensor
from engine.synth.recipe import SYNTH_VERSION, Recipe
from engine.synth.writer import model_bytes, plan_shards, summarize, synthesize, tensor_plan

__all__ = ["EOS_TOKEN", "EOS_TOKEN_ID", "MIN_VOCAB", "PRESETS_DIR", "SYNTH_VERSION", "PlannedTensor", "Recipe",
           "build_tokenizer", "describe_presets", "hf_config", "list_presets", "load_geometry_file", "load_preset",
           "model_bytes", "param_counts", "plan_shards", "summarize", "synthesize", "tensor_plan",
           "validate_geometry"]
