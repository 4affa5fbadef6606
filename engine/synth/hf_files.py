"""The Hugging Face side files of a synthetic model: config.json, generation_config.json and a
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json, trained by engine/synth/bpe_tokenizer.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.synth.geometry import EOS_TOKEN_ID
from engine.synth.recipe import SYNTH_VERSION


def hf_config(g: dict, seed: int, skew: float) -> dict:
    """config.json as transformers' Qwen3MoeConfig writes it, readable by transformers 4.x and 5.x."""
    from engine.synth import arch_writers as synth_archs
    if g["model_type"] in synth_archs.ARCH_TYPES:
        return synth_archs.hf_config(g, seed, skew)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": g["head_dim"],
        "hidden_act": "silu",
        "hidden_size": g["hidden_size"],
        "initializer_range": g["initializer_range"],
        "intermediate_size": g["intermediate_size"],
        "max_position_embeddings": g["max_position_embeddings"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "norm_topk_prob": bool(g["norm_topk_prob"]),
        "num_attention_heads": g["num_attention_heads"],
        "num_experts": g["num_experts"],          # transformers 4.x spelling
        "num_local_experts": g["num_experts"],    # transformers 5.x spelling
        "num_experts_per_tok": g["num_experts_per_tok"],
        "num_hidden_layers": g["num_hidden_layers"],
        "num_key_value_heads": g["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": g["rms_norm_eps"],
        "rope_theta": float(g["rope_theta"]),
        "rope_parameters": {"rope_theta": float(g["rope_theta"]), "rope_type": "default"},
        "rope_scaling": None,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": g["dtype"],
        "dtype": g["dtype"],
        "vocab_size": g["vocab_size"],
        "colibri_synth": {
            "version": SYNTH_VERSION,
            "preset": g.get("name", "custom"),
            "seed": seed,
            "routing_skew": skew,
        },
    }


def _write_tokenizer(dir_: Path, g: dict) -> None:
    from engine.synth.bpe_tokenizer import build_tokenizer, tokenizer_config
    from engine.format.safetensors_writer import write_json_atomic
    tok = build_tokenizer(g["vocab_size"])
    tmp = dir_ / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, dir_ / "tokenizer.json")
    write_json_atomic(dir_ / "tokenizer_config.json", tokenizer_config(g["max_position_embeddings"]))


def write_side_files(dir_: Path, g: dict, seed: int, skew: float) -> None:
    from engine.format.safetensors_writer import write_json_atomic
    write_json_atomic(dir_ / "config.json", hf_config(g, seed, skew))
    write_json_atomic(dir_ / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None, "do_sample": False,
    })
    _write_tokenizer(dir_, g)
