"""The synth plan and config.json skeleton of the architectures beyond synth's own qwen3_moe
(deepseek_v3, glm4_moe, glm_moe_dsa, gpt_oss): each family gives its attention and MoE layer
plans, this gives the layer loop, the grouped-query attention they may share, and config.json.

A geometry uses config.json's own keys (n_routed_experts, q_lora_rank, index_topk,
layer_types, ...); the `*-small` presets are the published geometries scaled down with their
structure kept. Kinds beyond qwen3_moe's (engine/synth/recipe.py makes their values): "read"
reads the residual stream (its constant channel 0 is zeroed out of it, so only routers see that
channel), "inner" acts on an inner representation, "write" writes the residual (row 0 zero: the
constant channel stays constant), "small" for biases and sinks, "zero_bias" for LayerNorm biases.

Routing skew: the popularity part of synth's recipe applies (a constant residual channel that
each router reads with a per-expert weight); the locality kernel (q/k shaped into a recency
window) is specific to the plain GQA attention of qwen3_moe and is not applied, so
token-to-token expert reuse here is what random weights give.
"""

from __future__ import annotations

from typing import Callable

from engine.arch.architecture import PlannedTensor as T
from engine.arch.args import ModelArgs

# Geometry keys that describe how to synthesize, not the model: kept out of config.json.
SYNTH_ONLY = ("name", "description", "materializable", "source", "routing_skew", "max_shard_size",
              "expert_format", "published_total_params", "published_active_params", "initializer_range")


def synth_config(g: dict, hf_class: str, eos_token_id: int, stamp: dict,
                 finish: Callable[[dict], None] | None = None) -> dict:
    """config.json from a geometry of config.json keys; `finish` adds the architecture's own."""
    cfg = {k: v for k, v in g.items() if k not in SYNTH_ONLY and not k.startswith("_") and k != "num_experts"}
    cfg.update(architectures=[hf_class], bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None,
               hidden_act="silu", tie_word_embeddings=False, use_cache=True, torch_dtype=g["dtype"],
               initializer_range=g.get("initializer_range", 0.02))
    theta = float(cfg.pop("rope_theta", 10000.0))
    cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    cfg["rope_parameters"].setdefault("rope_theta", theta)
    if finish is not None:
        finish(cfg)
    cfg["colibri_synth"] = stamp
    return cfg


def layered_plan(args: ModelArgs, attention: Callable[[str, int], list],
                 moe: Callable[[str, int], tuple[list, list[list]]], mtp: int = 0) -> list[list[T]]:
    """Embeddings, each layer (norms, `attention(prefix, layer)`, a dense MLP or
    `moe(prefix, layer)` → (resident tensors, expert units)), the final norm and lm_head.

    mtp: the last `mtp` layers of args are multi-token-prediction modules (engine/arch/mtp.py:
    args from with_mtp_layers), each a decoder layer as above plus, as DeepSeek-V3 publishes them,
    its own copy of the embedding, enorm, hnorm, eh_proj and shared_head (norm and head)."""
    H, V = args.hidden_size, args.vocab_size
    units = [[T("model.embed_tokens.weight", (V, H), "embed")]]
    for i in range(args.num_layers):
        if i >= args.num_layers - mtp:
            p = f"model.layers.{i}"
            units += [[T(f"{p}.embed_tokens.weight", (V, H), "embed", i)], [T(f"{p}.enorm.weight", (H,), "norm", i)],
                      [T(f"{p}.hnorm.weight", (H,), "norm", i)], [T(f"{p}.eh_proj.weight", (H, 2 * H), "inner", i)],
                      [T(f"{p}.shared_head.norm.weight", (H,), "norm", i)],
                      [T(f"{p}.shared_head.head.weight", (V, H), "lm_head", i)]]
        p = f"model.layers.{i}"
        layer = [T(f"{p}.input_layernorm.weight", (H,), "norm", i)]
        layer += attention(p, i)
        layer.append(T(f"{p}.post_attention_layernorm.weight", (H,), "norm", i))
        if not args.is_moe_layer(i):
            I = args.intermediate_size
            layer += [T(f"{p}.mlp.gate_proj.weight", (I, H), "read", i), T(f"{p}.mlp.up_proj.weight", (I, H), "read", i),
                      T(f"{p}.mlp.down_proj.weight", (H, I), "write", i)]
            units += [[t] for t in layer]
            continue
        resident, experts = moe(p, i)
        units += [[t] for t in layer + resident]
        units += experts
    units.append([T("model.norm.weight", (H,), "norm")])
    units.append([T("lm_head.weight", (V, H), "lm_head")])
    return units


def gqa_plan(args: ModelArgs, p: str, i: int, biases: bool, sinks: bool = False) -> list[T]:
    """Grouped-query attention: q/k/v (with biases), o (with its bias and the sinks: gpt_oss),
    per-head q/k norms where the config has them."""
    H, a = args.hidden_size, f"{p}.self_attn"
    N, Nkv, D = args.num_heads, args.num_kv_heads, args.head_dim
    out = []
    for proj, rows in (("q_proj", N * D), ("k_proj", Nkv * D), ("v_proj", Nkv * D)):
        out.append(T(f"{a}.{proj}.weight", (rows, H), "read", i))
        if biases:
            out.append(T(f"{a}.{proj}.bias", (rows,), "small", i))
    out.append(T(f"{a}.o_proj.weight", (H, N * D), "write", i))
    if sinks:
        out += [T(f"{a}.o_proj.bias", (H,), "write_bias", i), T(f"{a}.sinks", (N,), "small", i)]
    if args.qk_norm == "head":
        out += [T(f"{a}.q_norm.weight", (D,), "norm", i), T(f"{a}.k_norm.weight", (D,), "norm", i)]
    return out
