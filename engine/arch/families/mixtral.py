"""mixtral: the llama layout with softmax top-k routing over `block_sparse_moe` experts w1/w3/w2,
sliding-window attention on by default."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, TinyOracle
from engine.arch.args import ModelArgs, sliding_window
from engine.arch.config_rules import COMMON, M4, MOE, Int, sliding_window_rule


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    return ModelArgs(
        **common, num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
        top_k=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,  # Mixtral: softmax over the top-k logits == renormalised top-k
        sliding_window=sliding_window(cfg, used_by_default=True),
        moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
    )


MIXTRAL = Architecture("mixtral", ("mixtral",), _parse, rules=lambda model_type: (
    *COMMON, *MOE, Int("intermediate_size", 1, M4, required=True), sliding_window_rule(True)),
    oracle=TinyOracle({"mixtral": dict(num_local_experts=4, num_experts_per_tok=2)}),
    # llama.cpp writes Mixtral as a "llama" with experts, its q/k rows permuted for ggml's RoPE.
    gguf=GgufNames("llama", permute_qk=True))
