"""glm_moe_dsa (GLM-5): deepseek_v3's MLA and routing plus DeepSeek Sparse Attention, a small
indexer that picks the `index_topk` positions each query attends (engine/arch/mla.py); layers
may be listed dense/sparse in `mlp_layer_types`."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, SynthRecipe, TinyOracle
from engine.arch.args import ModelArgs
from engine.arch.config_rules import COMMON, K16, M4, Int
from engine.arch.families.deepseek_v3 import (MLA_RULES, finish_mla_config, mla_args, mla_attention,
                                              mla_synth_plan)
from engine.arch.families.routed import GGUF_SHARED_EXPERTS, ROUTED_RULES, bad, config_int, moe_flags, routed_fields
from engine.arch.families.synth_plans import synth_config
from engine.arch.mla import IndexerArgs


def dsa_indexer(cfg: dict, model_type: str, rope_dim: int, num_layers: int) -> IndexerArgs:
    topk = config_int(cfg, "index_topk", model_type)
    heads = config_int(cfg, "index_n_heads", model_type)
    dim = config_int(cfg, "index_head_dim", model_type)
    if dim < rope_dim:
        raise bad(model_type, f"index_head_dim {dim} is smaller than qk_rope_head_dim {rope_dim}")
    types = cfg.get("indexer_types") or ["full"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise bad(model_type, f"indexer_types must list 'full' or 'shared' for each of the {num_layers} layers")
    if types[0] != "full":
        raise bad(model_type, "indexer_types[0] must be 'full' (a 'shared' layer reuses an earlier layer's selection)")
    return IndexerArgs(heads, dim, topk, frozenset(i for i, t in enumerate(types) if t == "full"))


def _moe_flags(cfg: dict, model_type: str, num_layers: int) -> list[bool]:
    if cfg.get("mlp_layer_types"):
        kinds = cfg["mlp_layer_types"]
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
            raise bad(model_type, f"mlp_layer_types must list 'dense' or 'sparse' for each of the {num_layers} layers")
        return [k == "sparse" for k in kinds]
    return moe_flags(cfg, model_type, num_layers)


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    layers = common["num_layers"]
    fields = routed_fields(model_type, cfg, lambda: _moe_flags(cfg, model_type, layers))
    attention = mla_attention(cfg, model_type, common["rope"],
                              indexer=lambda rope_dim: dsa_indexer(cfg, model_type, rope_dim, layers))
    return mla_args(common, fields, attention)


GGUF_INDEXER_TENSORS = {  # GLM-5's sparse-attention indexer (gguf-py MODEL_TENSOR.INDEXER_*)
    "indexer.attn_q_b.weight": "self_attn.indexer.wq_b.weight", "indexer.attn_k.weight": "self_attn.indexer.wk.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_norm.weight", "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias",
    "indexer.proj.weight": "self_attn.indexer.weights_proj.weight",
}

GLM_MOE_DSA = Architecture(
    "glm_moe_dsa", ("glm_moe_dsa",), _parse,
    rules=lambda model_type: (*COMMON, *ROUTED_RULES, *MLA_RULES, Int("index_topk", 1, M4, required=True),
                              Int("index_n_heads", 1, K16, required=True), Int("index_head_dim", 1, K16, required=True)),
    synth=SynthRecipe(lambda g, eos, stamp: synth_config(g, "GlmMoeDsaForCausalLM", eos, stamp, finish_mla_config),
                      mla_synth_plan),
    # index_topk 6 < the oracle's 32-token prompt, so the indexer's selection decides what is
    # attended; layer 2 reuses layer 1's selection.
    oracle=TinyOracle({"glm_moe_dsa": dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, num_key_value_heads=4, index_topk=6, index_head_dim=16, index_n_heads=8,
        indexer_types=["full", "full", "shared"])}, randomize_zeros=True),
    gguf=GgufNames("glm-dsa", {**GGUF_SHARED_EXPERTS, **GGUF_INDEXER_TENSORS}))
