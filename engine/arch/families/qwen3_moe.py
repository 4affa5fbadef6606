"""qwen3_moe (and the parse it shares with qwen2_moe): the llama layout with per-head q/k norms,
softmax top-k routing, and layers that may be plain MLPs (`mlp_only_layers`,
`decoder_sparse_step`). Synth's own layout: its recipe's routing skew was made for this
attention (engine/synth/recipe.py).
"""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, PlannedTensor, SynthRecipe, TinyOracle
from engine.arch.args import ModelArgs, sliding_window
from engine.arch.config_rules import COMMON, MOE, QWEN_MOE


def parse_qwen_moe(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    """qwen2_moe / qwen3_moe: some layers may be plain MLPs."""
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    flags = [(i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(common["num_layers"])]
    return ModelArgs(
        **common, num_experts=num_experts, top_k=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "qwen3_moe")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2_moe")),
        qk_norm="head" if model_type == "qwen3_moe" else "none",
        sliding_window=sliding_window(cfg, used_by_default=False),
        moe_layer_flags=flags,
    )


# --- synth ------------------------------------------------------------------------------------

def synth_config(g: dict, eos_token_id: int, stamp: dict) -> dict:
    """config.json as transformers' Qwen3MoeConfig writes it, readable by transformers 4.x and 5.x."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
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
        "colibri_synth": stamp,
    }


def synth_plan(g: dict, args: ModelArgs) -> list[list[PlannedTensor]]:
    """Tensors in file order, grouped into units that must stay together in one shard.

    An expert's gate, up and down projections form one unit so they are adjacent on disk and
    the streaming engine can read an expert with a single request.
    """
    H, L = g["hidden_size"], g["num_hidden_layers"]
    nh, nkv, hd = g["num_attention_heads"], g["num_key_value_heads"], g["head_dim"]
    E, I, V = g["num_experts"], g["moe_intermediate_size"], g["vocab_size"]
    units: list[list[PlannedTensor]] = [[PlannedTensor("model.embed_tokens.weight", (V, H), "embed")]]
    for i in range(L):
        p = f"model.layers.{i}."
        for name, shape, kind in (
            ("input_layernorm.weight", (H,), "norm"),
            ("self_attn.q_proj.weight", (nh * hd, H), "q"),
            ("self_attn.k_proj.weight", (nkv * hd, H), "k"),
            ("self_attn.v_proj.weight", (nkv * hd, H), "v"),
            ("self_attn.o_proj.weight", (H, nh * hd), "o"),
            ("self_attn.q_norm.weight", (hd,), "qk_norm"),
            ("self_attn.k_norm.weight", (hd,), "qk_norm"),
            ("post_attention_layernorm.weight", (H,), "norm"),
            ("mlp.gate.weight", (E, H), "router"),
        ):
            units.append([PlannedTensor(p + name, shape, kind, i)])
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            units.append([
                PlannedTensor(q + "gate_proj.weight", (I, H), "expert_in", i, e),
                PlannedTensor(q + "up_proj.weight", (I, H), "expert_in", i, e),
                PlannedTensor(q + "down_proj.weight", (H, I), "expert_out", i, e),
            ])
    units.append([PlannedTensor("model.norm.weight", (H,), "norm")])
    units.append([PlannedTensor("lm_head.weight", (V, H), "lm_head")])
    return units


QWEN3_MOE = Architecture("qwen3_moe", ("qwen3_moe",), parse_qwen_moe,
                         rules=lambda model_type: (*COMMON, *MOE, *QWEN_MOE),
                         synth=SynthRecipe(synth_config, synth_plan, native_geometry=True),
                         # experts of a different size from the dense MLP, an mlp-only layer, per-head q/k norms
                         oracle=TinyOracle({"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                              norm_topk_prob=True, head_dim=16, mlp_only_layers=[1])}),
                         gguf=GgufNames("qwen3moe"))
