"""olmoe: the llama layout with q/k RMSNorm over the whole projection, optional qkv clipping,
and softmax top-k routing (renormalised only when norm_topk_prob)."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, TinyOracle
from engine.arch.args import ModelArgs
from engine.arch.config_rules import COMMON, M4, MOE, Int, Number


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    return ModelArgs(
        **common, num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        top_k=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        qk_norm="full", clip_qkv=cfg.get("clip_qkv"),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


OLMOE = Architecture("olmoe", ("olmoe",), _parse, rules=lambda model_type: (
    *COMMON, *MOE, Int("intermediate_size", 1, M4, required=True), Number("clip_qkv", 0, nullable=True)),
    oracle=TinyOracle({"olmoe": dict(num_experts=8, num_experts_per_tok=2, eos_token_id=1, pad_token_id=0)}),
    gguf=GgufNames("olmoe"))
