"""deepseek_v3: multi-head latent attention (engine/arch/mla.py) over sigmoid-routed experts
with always-on shared experts; the first `first_k_dense_replace` layers are dense. The MLA
parse and synth plan here serve glm_moe_dsa too.
"""

from __future__ import annotations

import math
from typing import Callable

from engine.arch.architecture import Architecture, GgufNames, PlannedTensor as T, SynthRecipe, TinyOracle
from engine.arch.args import ModelArgs
from engine.arch.config_rules import COMMON, K16, M4, Int
from engine.arch.families.routed import (GGUF_SHARED_EXPERTS, ROUTED_RULES, bad, config_int, moe_flags, routed_fields,
                                         routed_moe_plan)
from engine.arch.families.synth_plans import layered_plan, synth_config
from engine.arch.mla import IndexerArgs, MLAAttention
from engine.arch.mtp import with_mtp_layers

MLA_RULES = (Int("kv_lora_rank", 1, M4, required=True), Int("q_lora_rank", 1, M4, nullable=True),
             Int("qk_nope_head_dim", 1, K16, required=True), Int("qk_rope_head_dim", 1, K16, required=True),
             Int("v_head_dim", 1, K16, required=True))


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def mla_attention(cfg: dict, model_type: str, rope: dict,
                  indexer: Callable[[int], IndexerArgs] | None = None) -> MLAAttention:
    """MLA from config.json. `indexer(rope_dim)`: GLM-5's sparse-attention indexer, which reads the
    compressed query (so q_lora_rank is required) and always uses interleaved RoPE."""
    heads = config_int(cfg, "num_attention_heads", model_type)
    q_rank = cfg.get("q_lora_rank")
    if q_rank is not None:
        q_rank = config_int(cfg, "q_lora_rank", model_type)
    elif indexer is not None:
        raise bad(model_type, "q_lora_rank is required (the indexer reads the compressed query)")
    kv_rank = config_int(cfg, "kv_lora_rank", model_type)
    nope = config_int(cfg, "qk_nope_head_dim", model_type)
    rope_dim = config_int(cfg, "qk_rope_head_dim", model_type)
    v_dim = config_int(cfg, "v_head_dim", model_type)
    if rope_dim % 2:
        raise bad(model_type, f"qk_rope_head_dim {rope_dim} must be even (RoPE rotates pairs)")
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        # YaRN's attention temperature, applied to the softmax scale as DeepSeek does.
        m = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    index = indexer(rope_dim) if indexer is not None else None
    return MLAAttention(heads, q_rank, kv_rank, nope, rope_dim, v_dim, scale,
                        rope_interleave=bool(cfg.get("rope_interleave", True)) or indexer is not None,
                        attention_bias=bool(cfg.get("attention_bias", False)), indexer=index)


def mla_args(common: dict, fields: dict, attention: MLAAttention) -> ModelArgs:
    # RoPE covers only the decoupled rope head; head_dim is what the shared rope code rotates.
    common = dict(common, head_dim=attention.qk_rope_head_dim, num_kv_heads=common["num_heads"])
    return ModelArgs(**common, **fields, attention_impl=attention)


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    fields = routed_fields(model_type, cfg, lambda: moe_flags(cfg, model_type, common["num_layers"]))
    return mla_args(common, fields, mla_attention(cfg, model_type, common["rope"]))


# --- synth ------------------------------------------------------------------------------------

def finish_mla_config(cfg: dict) -> None:
    # As transformers writes them: head_dim is the rope head, kv heads = heads.
    cfg.update(head_dim=cfg["qk_rope_head_dim"], num_key_value_heads=cfg["num_attention_heads"])


def mla_plan(args: ModelArgs, p: str, i: int) -> list[T]:
    H, a, m = args.hidden_size, f"{p}.self_attn", args.attention_impl
    N, P, R, r, Vd = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
    out = []
    if m.q_lora_rank is None:
        out.append(T(f"{a}.q_proj.weight", (N * (P + R), H), "read", i))
    else:
        qr = m.q_lora_rank
        out += [T(f"{a}.q_a_proj.weight", (qr, H), "read", i), T(f"{a}.q_a_layernorm.weight", (qr,), "norm", i),
                T(f"{a}.q_b_proj.weight", (N * (P + R), qr), "inner", i)]
    out += [T(f"{a}.kv_a_proj_with_mqa.weight", (r + R, H), "read", i),
            T(f"{a}.kv_a_layernorm.weight", (r,), "norm", i),
            T(f"{a}.kv_b_proj.weight", (N * (P + Vd), r), "inner", i),
            T(f"{a}.o_proj.weight", (H, N * Vd), "write", i)]
    ix = m.indexer
    if ix is not None and i in ix.full_layers:
        out += [T(f"{a}.indexer.wq_b.weight", (ix.n_heads * ix.head_dim, m.q_lora_rank), "inner", i),
                T(f"{a}.indexer.wk.weight", (ix.head_dim, H), "read", i),
                T(f"{a}.indexer.k_norm.weight", (ix.head_dim,), "norm", i),
                T(f"{a}.indexer.k_norm.bias", (ix.head_dim,), "zero_bias", i),
                T(f"{a}.indexer.weights_proj.weight", (ix.n_heads, H), "read", i)]
    return out


def mla_synth_plan(g: dict, args: ModelArgs) -> list[list[T]]:
    mtp = int(g.get("num_nextn_predict_layers") or 0)  # the MTP modules after the last layer, as published
    args = with_mtp_layers(args, mtp)
    return layered_plan(args, lambda p, i: mla_plan(args, p, i), lambda p, i: routed_moe_plan(args, p, i), mtp)


DEEPSEEK_V3 = Architecture(
    "deepseek_v3", ("deepseek_v3",), _parse, rules=lambda model_type: (*COMMON, *ROUTED_RULES, *MLA_RULES),
    synth=SynthRecipe(lambda g, eos, stamp: synth_config(g, "DeepseekV3ForCausalLM", eos, stamp, finish_mla_config),
                      mla_synth_plan),
    # Four groups of two with topk_group 2 make the group limit bite; a dense first layer; yarn
    # with mscale_all_dim moves the softmax scale; rope_interleave is DeepSeek's default.
    oracle=TinyOracle({"deepseek_v3": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, num_key_value_heads=4,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                         "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})},
        randomize_zeros=True),
    gguf=GgufNames("deepseek2", GGUF_SHARED_EXPERTS))
