"""llama, qwen2, qwen3: dense decoder-only models in the llama layout (HF's tensor names)."""

from __future__ import annotations

from engine.arch.architecture import Architecture, TinyOracle
from engine.arch.args import ModelArgs, sliding_window
from engine.arch.config_rules import COMMON, DENSE


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    return ModelArgs(
        **common,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm="head" if model_type == "qwen3" else "none",
        sliding_window=sliding_window(cfg, used_by_default=False),
    )


DENSE_LLAMA = Architecture("dense (llama layout)", ("llama", "qwen2", "qwen3"), _parse,
                           rules=lambda model_type: (*COMMON, *DENSE),
                           # llama3 and yarn RoPE scaling; qwen3's per-head q/k norms
                           oracle=TinyOracle({
                               "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                              "original_max_position_embeddings": 64}),
                               "qwen3": dict(head_dim=16, max_position_embeddings=256,
                                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                              "original_max_position_embeddings": 64})}))
