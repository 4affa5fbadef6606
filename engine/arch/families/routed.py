"""What deepseek_v3, glm4_moe and glm_moe_dsa share: sigmoid group routing with a score
correction bias (engine/arch/router.SigmoidGroupRouter), deepseek-style always-on shared experts,
the first dense layers, their config rules, and the synth plan of such a MoE layer.

A config that cannot describe a working model is refused here with one line naming the field,
before any tensor is read.
"""

from __future__ import annotations

from typing import Callable

from engine.arch.architecture import PlannedTensor as T
from engine.arch.args import ModelArgs
from engine.arch.config_rules import K16, M4, Int, Number
from engine.arch.router import SigmoidGroupRouter
from engine.base.errors import ModelFormatError

# GGUF names of the ungated shared experts (deepseek2, glm4moe, glm-dsa: GgufNames.tensors).
GGUF_SHARED_EXPERTS = {
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}

# The field ranges; the cross-field checks (groups, top-k per group, indexer layers, layer
# types) are the parsers', each one line naming the field.
ROUTED_RULES = (Int("n_routed_experts", 1, M4, required=True), Int("num_experts_per_tok", 1, K16, required=True),
                Int("moe_intermediate_size", 1, M4, required=True), Int("n_shared_experts", 0, K16, nullable=True),
                Int("n_group", 1, K16, nullable=True), Int("topk_group", 1, K16, nullable=True),
                Int("first_k_dense_replace", 0, M4, nullable=True), Number("routed_scaling_factor", 0, nullable=True))


def bad(model_type: str, message: str) -> ModelFormatError:
    return ModelFormatError(f"config.json for {model_type}: {message}")


def config_int(cfg: dict, key: str, model_type: str, default=None, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(model_type, f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise bad(model_type, f"{key} must be >= {minimum}, got {value}")
    return value


def sigmoid_router(cfg: dict, model_type: str, prefix: str = "mlp.gate") -> SigmoidGroupRouter:
    E = config_int(cfg, "n_routed_experts", model_type)
    K = config_int(cfg, "num_experts_per_tok", model_type)
    groups = config_int(cfg, "n_group", model_type, default=1)
    topk_group = config_int(cfg, "topk_group", model_type, default=1)
    if K > E:
        raise bad(model_type, f"num_experts_per_tok {K} exceeds n_routed_experts {E}")
    if E % groups:
        raise bad(model_type, f"n_routed_experts {E} is not divisible by n_group {groups}")
    if E // groups < 2:
        raise bad(model_type, f"n_group {groups} leaves fewer than 2 experts per group (groups are scored by their best two)")
    if topk_group > groups:
        raise bad(model_type, f"topk_group {topk_group} exceeds n_group {groups}")
    if K > topk_group * (E // groups):
        raise bad(model_type, f"num_experts_per_tok {K} exceeds the {topk_group * (E // groups)} experts "
                              f"in topk_group {topk_group} groups of {E // groups}")
    return SigmoidGroupRouter(E, K, groups, topk_group, bool(cfg.get("norm_topk_prob", True)),
                              float(cfg.get("routed_scaling_factor", 1.0)), prefix)


def moe_flags(cfg: dict, model_type: str, num_layers: int, first_dense_default: int = 3) -> list[bool]:
    """Which layers are MoE: all but the first `first_k_dense_replace`."""
    first_dense = config_int(cfg, "first_k_dense_replace", model_type, default=first_dense_default, minimum=0)
    if first_dense > num_layers:
        raise bad(model_type, f"first_k_dense_replace {first_dense} exceeds num_hidden_layers {num_layers}")
    return [i >= first_dense for i in range(num_layers)]


def routed_fields(model_type: str, cfg: dict, flags: Callable[[], list[bool]]) -> dict:
    """The ModelArgs fields of a sigmoid-routed MoE with deepseek-style shared experts; `flags()`
    says which layers are MoE (asked after the router's checks: the first bad field is reported)."""
    router = sigmoid_router(cfg, model_type)
    return dict(
        num_experts=router.num_experts, top_k=router.top_k,
        moe_intermediate_size=config_int(cfg, "moe_intermediate_size", model_type),
        norm_topk_prob=router.norm_topk_prob,
        shared_experts_intermediate_size=config_int(cfg, "n_shared_experts", model_type, default=1, minimum=0)
        * int(cfg["moe_intermediate_size"]),
        moe_layer_flags=flags(), router=router,
    )


def routed_moe_plan(args: ModelArgs, p: str, i: int) -> tuple[list, list[list]]:
    """One MoE layer for synth: (its resident tensors, one unit per expert)."""
    H, E, I = args.hidden_size, args.num_experts, args.moe_intermediate_size
    layer = [T(f"{p}.mlp.gate.weight", (E, H), "router", i),
             T(f"{p}.mlp.gate.e_score_correction_bias", (E,), "small", i)]
    Is = args.shared_experts_intermediate_size
    if Is:
        layer += [T(f"{p}.mlp.shared_experts.gate_proj.weight", (Is, H), "read", i),
                  T(f"{p}.mlp.shared_experts.up_proj.weight", (Is, H), "read", i),
                  T(f"{p}.mlp.shared_experts.down_proj.weight", (H, Is), "write", i)]
    experts = []
    for e in range(E):
        q = f"{p}.mlp.experts.{e}"
        experts.append([T(f"{q}.gate_proj.weight", (I, H), "expert_in", i, e),
                        T(f"{q}.up_proj.weight", (I, H), "expert_in", i, e),
                        T(f"{q}.down_proj.weight", (H, I), "expert_out", i, e)])
    return layer, experts
