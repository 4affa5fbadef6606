"""llama, qwen2, qwen3: dense decoder-only models in the llama layout (HF's tensor names).

`llama_family_shape` is the llama layout's resident tensor shapes, shared by the MoE families
that keep it (qwen2_moe, qwen3_moe, mixtral, olmoe).
"""

from __future__ import annotations

import re

from engine.arch.architecture import Architecture
from engine.arch.args import ModelArgs, sliding_window
from engine.arch.config_rules import COMMON, DENSE


def llama_family_shape(args: ModelArgs, name: str) -> tuple[int, ...] | None:
    """Expected shape of a resident tensor in the llama / qwen / mixtral / olmoe layouts (None: not known)."""
    H, D, V = args.hidden_size, args.head_dim, args.vocab_size
    q, kv = args.num_heads * D, args.num_kv_heads * D
    I, E, Is = args.intermediate_size, args.num_experts, args.shared_expert_intermediate_size
    norm_q, norm_k = ((D,), (D,)) if args.qk_norm == "head" else ((q,), (kv,))
    table = {
        "embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": norm_q, "self_attn.k_norm.weight": norm_k,
        f"{args.moe_prefix}.gate.weight": (E, H),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mlp.shared_expert.gate_proj.weight": (Is, H), "mlp.shared_expert.up_proj.weight": (Is, H),
        "mlp.shared_expert.down_proj.weight": (H, Is), "mlp.shared_expert_gate.weight": (1, H),
    }
    # "model.layers.3.self_attn.q_proj.weight" → "self_attn.q_proj.weight"; top-level names as they are.
    m = re.match(r"^model\.layers\.\d+\.(.+)$", name)
    key = m.group(1) if m else name.removeprefix("model.")
    return table.get(key)


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    return ModelArgs(
        **common,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm="head" if model_type == "qwen3" else "none",
        sliding_window=sliding_window(cfg, used_by_default=False),
    )


DENSE_LLAMA = Architecture("dense (llama layout)", ("llama", "qwen2", "qwen3"), _parse,
                           rules=lambda model_type: (*COMMON, *DENSE), tensor_shape=llama_family_shape)
