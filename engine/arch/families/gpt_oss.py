"""gpt_oss: attention with sinks over alternating sliding/full layers, a biased softmax top-k
router, and fused experts with biases and a clamped SwiGLU, stored plain or as MXFP4
(engine/arch/gpt_oss_layers.py has the math, engine/weights/mxfp4.py MXFP4's; engine/format/layout.py
reads both storages). Synth writes either storage (`expert_format: "mxfp4"`: as the published
checkpoints store them, quantized from the same seeded weights the plain format would hold)."""

from __future__ import annotations

from engine.arch.architecture import Architecture, GgufNames, PlannedTensor as T, SynthRecipe, TinyOracle
from engine.arch.args import ModelArgs
from engine.arch.config_rules import COMMON, K16, M4, Int
from engine.arch.families.routed import bad, config_int
from engine.arch.families.synth_plans import gqa_plan, layered_plan, synth_config
from engine.arch.gpt_oss_layers import GptOssExperts, SinkAttention
from engine.arch.router import BiasedTopkSoftmax


def _parse(model_type: str, cfg: dict, common: dict) -> ModelArgs:
    mt, layers = model_type, common["num_layers"]
    E = config_int(cfg, "num_local_experts", mt)
    K = config_int(cfg, "num_experts_per_tok", mt)
    if K > E:
        raise bad(mt, f"num_experts_per_tok {K} exceeds num_local_experts {E}")
    heads, kv_heads = common["num_heads"], common["num_kv_heads"]
    if heads % kv_heads:
        raise bad(mt, f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise bad(mt, f"layer_types must list 'sliding_attention' or 'full_attention' for each of the {layers} layers")
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise bad(mt, f"sliding_window must be a positive integer for sliding layers, got {window!r}")
    intermediate = config_int(cfg, "intermediate_size", mt)
    return ModelArgs(
        **common, num_experts=E, top_k=K, moe_intermediate_size=intermediate,
        attention_impl=SinkAttention(heads, kv_heads, common["head_dim"],
                                     tuple(window if t == "sliding_attention" else None for t in types)),
        router=BiasedTopkSoftmax(K),
        expert_impl=GptOssExperts(E, common["hidden_size"], intermediate, float(cfg.get("swiglu_alpha", 1.702)),
                                  float(cfg.get("swiglu_limit", 7.0))),
    )


# --- synth ------------------------------------------------------------------------------------

def _finish_config(g: dict):
    def finish(cfg: dict) -> None:
        if g.get("expert_format") == "mxfp4":
            cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return finish


def _experts_plan(g: dict, args: ModelArgs, p: str, i: int) -> tuple[list, list[list]]:
    """The router, and one unit: the layer's fused experts (every expert is a slice of each)."""
    E, H, I, q = args.num_experts, args.hidden_size, args.moe_intermediate_size, f"{p}.mlp.experts"
    router = [T(f"{p}.mlp.router.weight", (E, H), "router", i), T(f"{p}.mlp.router.bias", (E,), "small", i)]
    if g.get("expert_format") == "mxfp4":
        return router, [[T(f"{q}.gate_up_proj_blocks", (E, 2 * I, H // 32, 16), "mx_blocks", i, dtype="uint8"),
                         T(f"{q}.gate_up_proj_scales", (E, 2 * I, H // 32), "mx_scales", i, dtype="uint8"),
                         T(f"{q}.gate_up_proj_bias", (E, 2 * I), "small", i, dtype="bfloat16"),
                         T(f"{q}.down_proj_blocks", (E, H, I // 32, 16), "mx_blocks", i, dtype="uint8"),
                         T(f"{q}.down_proj_scales", (E, H, I // 32), "mx_scales", i, dtype="uint8"),
                         T(f"{q}.down_proj_bias", (E, H), "write_bias", i, dtype="bfloat16")]]
    return router, [[T(f"{q}.gate_up_proj", (E, H, 2 * I), "fused_in", i),
                     T(f"{q}.gate_up_proj_bias", (E, 2 * I), "small", i),
                     T(f"{q}.down_proj", (E, I, H), "fused_out", i), T(f"{q}.down_proj_bias", (E, H), "write_bias", i)]]


def _synth_plan(g: dict, args: ModelArgs):
    return layered_plan(args, lambda p, i: gqa_plan(args, p, i, biases=True, sinks=True),
                        lambda p, i: _experts_plan(g, args, p, i))


GGUF_TENSORS = {  # beyond gguf_names.LAYER_NAMES; its experts are engine/format/gguf/gpt_oss_experts.py's
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
}

GPT_OSS = Architecture(
    "gpt_oss", ("gpt_oss",), _parse,
    rules=lambda model_type: (*COMMON, Int("num_local_experts", 1, M4, required=True),
                              Int("num_experts_per_tok", 1, K16, required=True),
                              Int("intermediate_size", 1, M4, required=True), Int("sliding_window", 1, M4, nullable=True)),
    # Checkpoints as published: MXFP4 experts are uint8 blocks and scales.
    tensor_roles=(("MXFP4 expert blocks/scales", r"\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales)$",
                   frozenset({"U8"})),),
    synth=SynthRecipe(lambda g, eos, stamp: synth_config(g, "GptOssForCausalLM", eos, stamp, _finish_config(g)),
                      _synth_plan, expert_formats=("plain", "mxfp4")),
    # sliding window 8 < the oracle's prompt; yarn as the published config (truncate=False).
    oracle=TinyOracle({"gpt_oss": dict(
        num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8, intermediate_size=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})},
        randomize_zeros=True),
    # llama.cpp's conversion/gpt_oss.py; the experts are fused back by engine/format/gguf/gpt_oss_experts.py.
    gguf=GgufNames("gpt-oss", GGUF_TENSORS))
