"""GGUF metadata and tensor names → config.json and HF tensor names, per MoE architecture.

The names every architecture shares are here (LAYER_NAMES, GLOBAL_NAMES, the stacked experts);
each architecture's own (its GGUF `general.architecture`, shared experts, sinks, indexer, llama's
q/k permutation) are its registry record's `gguf` (engine/arch/architecture.GgufNames, in its
module under engine/arch/families/); the metadata → config.json functions are here, one per
record (CONFIGS). The HF names of routed experts and the router come from the parsed ModelArgs.

This inverts what llama.cpp's convert_hf_to_gguf.py does (conversion/{qwen,olmo,llama,deepseek,
glm}.py and gguf-py's tensor_mapping.py):
- names: `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`, and so on (LAYER_NAMES);
- routed experts: llama.cpp stacks each layer's experts into one 3-D tensor per projection
  (`ffn_{gate,up,down}_exps`, or `ffn_gate_up_exps` when fused); they are split back into HF's
  per-expert tensors, written next to each other so an expert stays one contiguous byte range;
- q/k of the llama family (mixtral): the converter permutes the rows of q_proj and k_proj from
  HF's rotate-half RoPE layout to ggml's interleaved one; `unpermute` reverses it exactly;
- DeepSeek MLA: newer converters split `kv_b_proj` into `attn_k_b` (transposed) and `attn_v_b`;
  they are joined back;
- multi-token-prediction layers (GLM's `nextn`) are left out and listed as skipped;
- gpt-oss (conversion/gpt_oss.py): attention sinks, q/k/v/o biases, the biased router, and the
  experts fused back into HF's per-layer tensors, MXFP4 kept as stored (gpt_oss_experts.py);
- glm-dsa (GLM-5, conversion/glm.py GlmMoeDsaModel): deepseek2's MLA plus the DSA indexer's
  tensors and its `attention.indexer.*` metadata.
A GGUF whose architecture no record names (engine/arch/registry.BY_GGUF_ARCH) is refused with one
line naming it.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from engine.arch.architecture import Architecture
from engine.arch.registry import BY_GGUF_ARCH
from engine.base.errors import ModelFormatError, UnsupportedModelError
from engine.format.gguf import gpt_oss_experts
from engine.format.gguf.reader import GGUFModel

# GGUF tensor (after `blk.N.`) → HF tensor (after `model.layers.N.`), the names every architecture
# shares; an architecture's own are its record's GgufNames.tensors. `{moe}` is ModelArgs.moe_prefix.
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    # MLA (deepseek2)
    "attn_q_a.weight": "self_attn.q_a_proj.weight", "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight", "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    # dense MLP layers
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # router
    "ffn_gate_inp.weight": "{moe}.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
EXPERT_PARTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
FUSED_GATE_UP = "ffn_gate_up_exps.weight"
# Tensors llama.cpp derives and the HF model does not have (RoPE frequency tables).
DERIVED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's LlamaModel.permute (rows per head: interleaved → halves)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


# --- config.json from the metadata ---------------------------------------------------------------

def _rope_scaling(m: GGUFModel) -> dict | None:
    kind = m.arch_key("rope.scaling.type")
    factor = m.arch_key("rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor),
               "original_max_position_embeddings": int(m.arch_key("rope.scaling.original_context_length", 4096))}
        for key, hf in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow"),
                        ("rope.scaling.yarn_ext_factor", "extrapolation_factor")):
            if m.arch_key(key) is not None:
                out[hf] = float(m.arch_key(key))
        if m.arch_key("rope.scaling.yarn_log_multiplier") is not None:
            # deepseek2 stores 0.1 * mscale_all_dim (convert_hf_to_gguf's TAG_DEEPSEEK2_YARN_LOG_MUL_FIX)
            out["mscale_all_dim"] = float(m.arch_key("rope.scaling.yarn_log_multiplier")) / 0.1
            out["mscale"] = out["mscale_all_dim"]
        return out
    raise UnsupportedModelError(f"{m.paths[0]}: RoPE scaling type {kind!r} is not supported by import")


def _common_config(m: GGUFModel, layers: int) -> dict:
    embd = m.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{m.paths[0]}: no token_embd.weight tensor")
    heads = int(m.require("attention.head_count"))
    hidden = int(m.require("embedding_length"))
    cfg = {
        "vocab_size": embd.shape[0], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(m.arch_key("attention.head_count_kv", heads)),
        "head_dim": int(m.arch_key("attention.key_length", hidden // heads)),
        "intermediate_size": int(m.arch_key("feed_forward_length", 0) or 0),
        "rms_norm_eps": float(m.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m.arch_key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(m.arch_key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in m.tensors,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "dtype": "bfloat16",
    }
    for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")):
        if m.get(key) is not None:
            cfg[hf] = int(m.get(key))
    if (scaling := _rope_scaling(m)) is not None:
        cfg["rope_scaling"] = scaling
    return cfg


def expert_width(m: GGUFModel) -> int:
    """Experts' intermediate size: the metadata's, else the stacked down projection's input width
    (olmoe and mixtral GGUFs write only feed_forward_length)."""
    if m.arch_key("expert_feed_forward_length"):
        return int(m.arch_key("expert_feed_forward_length"))
    for name, t in m.tensors.items():
        if name.endswith(".ffn_down_exps.weight"):
            return t.shape[2]
    return int(m.require("feed_forward_length"))


def _experts_common(m: GGUFModel) -> dict:
    return {"num_experts_per_tok": int(m.require("expert_used_count")), "moe_intermediate_size": expert_width(m)}


def config_qwen_moe(m: GGUFModel, model_type: str, layers: int, moe_layers: list[bool]) -> dict:
    cfg = {**_common_config(m, layers), **_experts_common(m), "model_type": model_type,
           "architectures": ["Qwen3MoeForCausalLM" if model_type == "qwen3_moe" else "Qwen2MoeForCausalLM"],
           "num_experts": int(m.require("expert_count")), "decoder_sparse_step": 1,
           "mlp_only_layers": [i for i, moe in enumerate(moe_layers) if not moe],
           # llama.cpp's qwen3moe always renormalises the top-k weights and qwen2moe never does.
           "norm_topk_prob": bool(m.arch_key("expert_weights_norm", model_type == "qwen3_moe"))}
    if model_type == "qwen2_moe":
        cfg["shared_expert_intermediate_size"] = int(m.arch_key("expert_shared_feed_forward_length", 0) or 0)
    else:
        cfg["attention_bias"] = "blk.0.attn_q.bias" in m.tensors
    return cfg


def config_olmoe(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    return {**_common_config(m, layers), **_experts_common(m), "model_type": "olmoe",
            "architectures": ["OlmoeForCausalLM"], "num_experts": int(m.require("expert_count")),
            "intermediate_size": expert_width(m),
            "norm_topk_prob": bool(m.arch_key("expert_weights_norm", False)), "clip_qkv": None}


def config_mixtral(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    if not m.arch_key("expert_count"):
        raise UnsupportedModelError(f"{m.paths[0]}: llama GGUF without experts (a dense llama); import handles "
                                    f"the MoE form (mixtral) only")
    cfg = {**_common_config(m, layers), "model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
           "num_local_experts": int(m.require("expert_count")),
           "num_experts_per_tok": int(m.require("expert_used_count")), "sliding_window": None}
    cfg["intermediate_size"] = expert_width(m)  # Mixtral's experts are `intermediate_size` wide
    return cfg


def _sigmoid_router_config(m: GGUFModel) -> dict:
    gating = m.arch_key("expert_gating_func")
    if gating is not None and int(gating) != 2:  # ExpertGatingFuncType: 1 softmax, 2 sigmoid
        raise UnsupportedModelError(f"{m.paths[0]}: expert gating function {int(gating)} (softmax: DeepSeek-V2 "
                                    f"style) is not supported; the engine runs sigmoid routers (V3, GLM-4.5)")
    return {"n_routed_experts": int(m.require("expert_count")),
            "n_shared_experts": int(m.arch_key("expert_shared_count", 0) or 0),
            "n_group": int(m.arch_key("expert_group_count", 1) or 1),
            "topk_group": int(m.arch_key("expert_group_used_count", 1) or 1),
            "routed_scaling_factor": float(m.arch_key("expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(m.arch_key("expert_weights_norm", False)),
            "first_k_dense_replace": int(m.arch_key("leading_dense_block_count", 0) or 0),
            "scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def config_deepseek2(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    cfg = {**_common_config(m, layers), **_experts_common(m), **_sigmoid_router_config(m),
           "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    rope_dim = int(m.require("rope.dimension_count"))
    kv_rank = int(m.require("attention.kv_lora_rank"))
    qk_head = int(m.arch_key("attention.key_length_mla") or (int(m.require("attention.key_length")) - kv_rank + rope_dim))
    cfg.update(q_lora_rank=int(m.arch_key("attention.q_lora_rank")) if m.arch_key("attention.q_lora_rank") else None,
               kv_lora_rank=kv_rank, qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head - rope_dim,
               v_head_dim=int(m.arch_key("attention.value_length_mla") or m.require("attention.value_length")),
               # llama.cpp turns MLA into MQA (head_count_kv 1); HF counts the decompressed heads.
               num_key_value_heads=cfg["num_attention_heads"], head_dim=qk_head, rope_interleave=True,
               attention_bias=False)
    return cfg


def config_glm4moe(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    cfg = {**_common_config(m, layers), **_experts_common(m), **_sigmoid_router_config(m),
           "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"],
           "num_nextn_predict_layers": 0, "use_qk_norm": "blk.0.attn_q_norm.weight" in m.tensors,
           "attention_bias": "blk.0.attn_q.bias" in m.tensors}
    rotary = int(m.arch_key("rope.dimension_count", cfg["head_dim"]))
    cfg["partial_rotary_factor"] = rotary / cfg["head_dim"]
    return cfg


def config_glm_dsa(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    """deepseek2's MLA and routing (GlmMoeDsaModel derives from DeepseekV2Model) plus the indexer."""
    cfg = {**config_deepseek2(m, layers, moe_layers), "model_type": "glm_moe_dsa",
           "architectures": ["GlmMoeDsaForCausalLM"], "num_nextn_predict_layers": 0,
           "index_n_heads": int(m.require("attention.indexer.head_count")),
           "index_head_dim": int(m.require("attention.indexer.key_length")),
           "index_topk": int(m.require("attention.indexer.top_k"))}
    types = m.arch_key("attention.indexer.types")  # per layer: True runs the indexer, False reuses
    if types is not None:
        if not isinstance(types, list) or len(types) < layers:
            raise ModelFormatError(f"{m.paths[0]}: {m.arch}.attention.indexer.types does not list the {layers} layers")
        cfg["indexer_types"] = ["full" if t else "shared" for t in types[:layers]]
    return cfg


def config_gpt_oss(m: GGUFModel, layers: int, moe_layers: list[bool]) -> dict:
    """What llama.cpp's gpt-oss graph assumes and the GGUF does not store is set as the published
    config has it: sliding window on even layers (llama.cpp's swa pattern 2, HF's layer_types),
    q/k/v/o biases, SwiGLU alpha 1.702 and limit 7.0, and YaRN without truncation."""
    cfg = {**_common_config(m, layers), "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"],
           "num_local_experts": int(m.require("expert_count")),
           "num_experts_per_tok": int(m.require("expert_used_count")), "intermediate_size": expert_width(m),
           "sliding_window": int(m.require("attention.sliding_window")),
           "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
           "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
    if cfg.get("rope_scaling", {}).get("rope_type") == "yarn":
        cfg["rope_scaling"]["truncate"] = False
    if gpt_oss_experts.stores_mxfp4(m):
        cfg["quantization_config"] = dict(gpt_oss_experts.MXFP4_QUANT_CONFIG)
    return cfg


# The metadata → config.json mapping of each registry record with GGUF names (Architecture.gguf),
# keyed by the record's name; gpt-oss's experts have their own items (FUSED_EXPERTS). These stay in
# engine/format rather than joining the records in engine/arch/families/: they read GGUF keys and
# tensors through the reader (GGUFModel) and, for gpt-oss, the experts' ggml types through gguf-py
# (gpt_oss_experts), which engine/arch may not import (format sits above arch). The records hold
# the names, plain data; tests/test_gguf_import.py checks that every such record has its function.
CONFIGS: dict[str, Callable[[GGUFModel, int, list[bool]], dict]] = {
    "qwen3_moe": lambda m, n, f: config_qwen_moe(m, "qwen3_moe", n, f),
    "qwen2_moe": lambda m, n, f: config_qwen_moe(m, "qwen2_moe", n, f),
    "olmoe": config_olmoe,
    "mixtral": config_mixtral,
    "deepseek_v3": config_deepseek2,
    "glm4_moe": config_glm4moe,
    "glm_moe_dsa": config_glm_dsa,
    "gpt_oss": config_gpt_oss,
}
FUSED_EXPERTS: dict[str, Callable] = {"gpt_oss": gpt_oss_experts.experts}


def arch_for(m: GGUFModel) -> Architecture:
    """The registry record this GGUF's `general.architecture` imports as."""
    arch = BY_GGUF_ARCH.get(m.arch)
    if arch is None:
        raise UnsupportedModelError(f"{m.paths[0]}: GGUF architecture {m.arch!r} is not supported by import "
                                    f"(supported: {', '.join(sorted(BY_GGUF_ARCH))})")
    return arch
