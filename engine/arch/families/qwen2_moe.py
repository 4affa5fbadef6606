"""qwen2_moe: qwen3_moe's layout without q/k norms, with qkv biases and a gated shared expert."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, TinyOracle
from engine.arch.config_rules import COMMON, M4, MOE, QWEN_MOE, Int
from engine.arch.families.qwen3_moe import parse_qwen_moe

GGUF_TENSORS = {  # qwen2_moe: one gated shared expert
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}

QWEN2_MOE = Architecture("qwen2_moe", ("qwen2_moe",), parse_qwen_moe,
                         rules=lambda model_type: (*COMMON, *MOE, *QWEN_MOE,
                                                   Int("shared_expert_intermediate_size", 0, M4, nullable=True)),
                         # a gated shared expert; qkv biases by default
                         oracle=TinyOracle({"qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                              shared_expert_intermediate_size=48)}),
                         gguf=GgufNames("qwen2moe", GGUF_TENSORS))
