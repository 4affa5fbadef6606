"""glm4_moe: grouped-query attention with partial RoPE (`partial_rotary_factor` of head_dim),
optional per-head q/k norms and qkv biases, over deepseek-style sigmoid-routed experts."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, SynthRecipe, TinyOracle
from engine.arch.args import ModelArgs
from engine.arch.config_rules import COMMON
from engine.arch.families.routed import (GGUF_SHARED_EXPERTS, ROUTED_RULES, bad, moe_flags, routed_fields,
                                         routed_moe_plan)
from engine.arch.families.synth_plans import gqa_plan, layered_plan, synth_config
from engine.arch.mtp import with_mtp_layers


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    fields = routed_fields(model_type, cfg, lambda: moe_flags(cfg, model_type, common["num_layers"],
                                                              first_dense_default=1))
    rope = common["rope"]
    factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    rotary = int(common["head_dim"] * factor)
    if not 0 < factor <= 1 or rotary % 2:
        raise bad(model_type, f"partial_rotary_factor {factor} must give an even rotary dimension in "
                              f"(0, head_dim {common['head_dim']}], got {rotary}")
    return ModelArgs(**common, **fields, rotary_dim=rotary, attention_bias=bool(cfg.get("attention_bias", False)),
                     qk_norm="head" if cfg.get("use_qk_norm") else "none")


def _synth_plan(g: dict, args: ModelArgs):
    mtp = int(g.get("num_nextn_predict_layers") or 0)  # the MTP modules after the last layer, as published
    args = with_mtp_layers(args, mtp)
    return layered_plan(args, lambda p, i: gqa_plan(args, p, i, biases=args.attention_bias),
                        lambda p, i: routed_moe_plan(args, p, i), mtp)


GLM4_MOE = Architecture(
    "glm4_moe", ("glm4_moe",), _parse, rules=lambda model_type: (*COMMON, *ROUTED_RULES),
    synth=SynthRecipe(lambda g, eos, stamp: synth_config(g, "Glm4MoeForCausalLM", eos, stamp), _synth_plan),
    oracle=TinyOracle({"glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                        n_shared_experts=1, first_k_dense_replace=1, head_dim=16, use_qk_norm=True,
                                        attention_bias=True, routed_scaling_factor=1.5, n_group=2, topk_group=1)},
                      randomize_zeros=True),
    # gguf-py maps GLM-4.5's post_attention_layernorm to ATTN_POST_NORM (no FFN_NORM in glm4moe)
    gguf=GgufNames("glm4moe", {**GGUF_SHARED_EXPERTS, "post_attention_norm.weight": "post_attention_layernorm.weight"}))
