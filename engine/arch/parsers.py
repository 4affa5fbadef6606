"""config.json → ModelArgs for deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss, with their checks.

These architectures plug into the transformer through strategy objects on ModelArgs:
`attention_impl` (engine/arch/mla.py: MLA and GLM-5's indexer; engine/arch/gptoss.py: attention with
sinks), `router` (engine/arch/router.py) and `expert_impl` (engine/arch/gptoss.py). Everything else
(embeddings, norms, dense MLP layers, expert streaming) is the shared code in model.py.

A config that cannot describe a working model is refused here with one line naming the field,
before any tensor is read.
"""

from __future__ import annotations

import math

from engine.base.errors import ModelFormatError
from engine.arch.gptoss import GptOssExperts, SinkAttention
from engine.arch.mla import IndexerArgs, MLAAttention
from engine.arch.router import BiasedTopkSoftmax, SigmoidGroupRouter

EXT_MOE_TYPES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "gpt_oss")


def _bad(model_type: str, message: str) -> ModelFormatError:
    return ModelFormatError(f"config.json for {model_type}: {message}")


def _int(cfg: dict, key: str, model_type: str, default=None, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(model_type, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise _bad(model_type, f"{key} must be >= {minimum}, got {value}")
    return value


def _yarn_mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def sigmoid_router(cfg: dict, model_type: str, prefix: str = "mlp.gate") -> SigmoidGroupRouter:
    E = _int(cfg, "n_routed_experts", model_type)
    K = _int(cfg, "num_experts_per_tok", model_type)
    groups = _int(cfg, "n_group", model_type, default=1)
    topk_group = _int(cfg, "topk_group", model_type, default=1)
    if K > E:
        raise _bad(model_type, f"num_experts_per_tok {K} exceeds n_routed_experts {E}")
    if E % groups:
        raise _bad(model_type, f"n_routed_experts {E} is not divisible by n_group {groups}")
    if E // groups < 2:
        raise _bad(model_type, f"n_group {groups} leaves fewer than 2 experts per group (groups are scored by their best two)")
    if topk_group > groups:
        raise _bad(model_type, f"topk_group {topk_group} exceeds n_group {groups}")
    if K > topk_group * (E // groups):
        raise _bad(model_type, f"num_experts_per_tok {K} exceeds the {topk_group * (E // groups)} experts "
                               f"in topk_group {topk_group} groups of {E // groups}")
    return SigmoidGroupRouter(E, K, groups, topk_group, bool(cfg.get("norm_topk_prob", True)),
                              float(cfg.get("routed_scaling_factor", 1.0)), prefix)


def mla_attention(cfg: dict, model_type: str, rope: dict, num_layers: int) -> MLAAttention:
    heads = _int(cfg, "num_attention_heads", model_type)
    q_rank = cfg.get("q_lora_rank")
    if q_rank is not None:
        q_rank = _int(cfg, "q_lora_rank", model_type)
    elif model_type == "glm_moe_dsa":
        raise _bad(model_type, "q_lora_rank is required (the indexer reads the compressed query)")
    kv_rank = _int(cfg, "kv_lora_rank", model_type)
    nope = _int(cfg, "qk_nope_head_dim", model_type)
    rope_dim = _int(cfg, "qk_rope_head_dim", model_type)
    v_dim = _int(cfg, "v_head_dim", model_type)
    if rope_dim % 2:
        raise _bad(model_type, f"qk_rope_head_dim {rope_dim} must be even (RoPE rotates pairs)")
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        # YaRN's attention temperature, applied to the softmax scale as DeepSeek does.
        m = _yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
        scale *= m * m
    indexer = None
    if model_type == "glm_moe_dsa":
        indexer = dsa_indexer(cfg, model_type, rope_dim, num_layers)
    return MLAAttention(heads, q_rank, kv_rank, nope, rope_dim, v_dim, scale,
                        rope_interleave=bool(cfg.get("rope_interleave", True)) or model_type == "glm_moe_dsa",
                        attention_bias=bool(cfg.get("attention_bias", False)), indexer=indexer)


def dsa_indexer(cfg: dict, model_type: str, rope_dim: int, num_layers: int) -> IndexerArgs:
    topk = _int(cfg, "index_topk", model_type)
    heads = _int(cfg, "index_n_heads", model_type)
    dim = _int(cfg, "index_head_dim", model_type)
    if dim < rope_dim:
        raise _bad(model_type, f"index_head_dim {dim} is smaller than qk_rope_head_dim {rope_dim}")
    types = cfg.get("indexer_types") or ["full"] * num_layers
    if not isinstance(types, list) or len(types) != num_layers or any(t not in ("full", "shared") for t in types):
        raise _bad(model_type, f"indexer_types must list 'full' or 'shared' for each of the {num_layers} layers")
    if types[0] != "full":
        raise _bad(model_type, "indexer_types[0] must be 'full' (a 'shared' layer reuses an earlier layer's selection)")
    return IndexerArgs(heads, dim, topk, frozenset(i for i, t in enumerate(types) if t == "full"))


def _moe_flags(cfg: dict, model_type: str, num_layers: int) -> list[bool]:
    if model_type == "glm_moe_dsa" and cfg.get("mlp_layer_types"):
        kinds = cfg["mlp_layer_types"]
        if not isinstance(kinds, list) or len(kinds) != num_layers or any(k not in ("dense", "sparse") for k in kinds):
            raise _bad(model_type, f"mlp_layer_types must list 'dense' or 'sparse' for each of the {num_layers} layers")
        return [k == "sparse" for k in kinds]
    first_dense = _int(cfg, "first_k_dense_replace", model_type, default=1 if model_type == "glm4_moe" else 3,
                       minimum=0)
    if first_dense > num_layers:
        raise _bad(model_type, f"first_k_dense_replace {first_dense} exceeds num_hidden_layers {num_layers}")
    return [i >= first_dense for i in range(num_layers)]


def ext_fields(model_type: str, cfg: dict, common: dict) -> dict:
    """The ModelArgs fields of one of EXT_MOE_TYPES, beyond `common` (which this may adjust)."""
    layers, rope = common["num_layers"], common["rope"]
    if model_type == "gpt_oss":
        return _gpt_oss_fields(cfg, common)
    router = sigmoid_router(cfg, model_type)
    fields = dict(
        num_experts=router.num_experts, top_k=router.top_k,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", model_type),
        norm_topk_prob=router.norm_topk_prob,
        shared_experts_intermediate_size=_int(cfg, "n_shared_experts", model_type, default=1, minimum=0)
        * int(cfg["moe_intermediate_size"]),
        moe_layer_flags=_moe_flags(cfg, model_type, layers), router=router,
    )
    if model_type == "glm4_moe":
        factor = float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
        rotary = int(common["head_dim"] * factor)
        if not 0 < factor <= 1 or rotary % 2:
            raise _bad(model_type, f"partial_rotary_factor {factor} must give an even rotary dimension in "
                                   f"(0, head_dim {common['head_dim']}], got {rotary}")
        return dict(fields, rotary_dim=rotary, attention_bias=bool(cfg.get("attention_bias", False)),
                    qk_norm="head" if cfg.get("use_qk_norm") else "none")
    attention = mla_attention(cfg, model_type, rope, layers)
    # RoPE covers only the decoupled rope head; head_dim is what the shared rope code rotates.
    common.update(head_dim=attention.qk_rope_head_dim, num_kv_heads=common["num_heads"])
    return dict(fields, attention_impl=attention)


def _gpt_oss_fields(cfg: dict, common: dict) -> dict:
    mt, layers = "gpt_oss", common["num_layers"]
    E = _int(cfg, "num_local_experts", mt)
    K = _int(cfg, "num_experts_per_tok", mt)
    if K > E:
        raise _bad(mt, f"num_experts_per_tok {K} exceeds num_local_experts {E}")
    heads, kv_heads = common["num_heads"], common["num_kv_heads"]
    if heads % kv_heads:
        raise _bad(mt, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise _bad(mt, f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise _bad(mt, f"sliding_window must be a positive integer for sliding layers, got {window!r}")
    intermediate = _int(cfg, "intermediate_size", mt)
    return dict(
        num_experts=E, top_k=K, moe_intermediate_size=intermediate,
        attention_impl=SinkAttention(heads, kv_heads, common["head_dim"],
                                     tuple(window if t == "sliding_attention" else None for t in types)),
        router=BiasedTopkSoftmax(K),
        expert_impl=GptOssExperts(E, common["hidden_size"], intermediate, float(cfg.get("swiglu_alpha", 1.702)),
                                  float(cfg.get("swiglu_limit", 7.0))),
    )
