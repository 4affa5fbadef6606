"""Synthetic checkpoints of deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss (synth's other writers).

engine/synth.py keeps the shard writer, the seeded weight recipe and the atomic directory
handling; this module gives it, per architecture, the geometry check, the tensor plan (names
and shapes exactly as transformers' save_pretrained writes them) and config.json. A geometry
uses config.json's own keys (n_routed_experts, q_lora_rank, index_topk, layer_types, ...);
the `*-small` presets are the published geometries scaled down with their structure kept.

gpt_oss geometries may set `expert_format: "mxfp4"`: experts are then written as the published
checkpoints store them (`*_blocks` + `*_scales` uint8, biases bf16), quantized from the same
seeded weights the plain format would hold.

Routing skew: the popularity part of synth's recipe applies (a constant residual channel
that each router reads with a per-expert weight); the locality kernel (q/k shaped into a
recency window) is specific to the plain GQA attention of qwen3_moe and is not applied, so
token-to-token expert reuse here is what random weights give.
"""

from __future__ import annotations

from engine.base.errors import ColibriError, ConfigError

ARCH_TYPES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "gpt_oss")
ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "glm_moe_dsa": "GlmMoeDsaForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# Geometry keys that describe how to synthesize, not the model: kept out of config.json.
SYNTH_ONLY = ("name", "description", "materializable", "source", "routing_skew", "max_shard_size",
              "expert_format", "published_total_params", "published_active_params", "initializer_range")
MLA_TYPES = ("deepseek_v3", "glm_moe_dsa")


def validate(geometry: dict, defaults: dict) -> dict:
    """A geometry of one of ARCH_TYPES, with defaults filled in and checked by the engine's own
    config parser (so synth can only write what the engine and transformers can run)."""
    from engine.arch.args import ModelArgs
    from engine.base.dtypes import FLOAT_NAMES as _DTYPES
    from engine.synth import EOS_TOKEN_ID, MIN_VOCAB

    g = {**{k: v for k, v in defaults.items() if k != "model_type"}, **geometry}
    name, mt = g.get("name", "custom"), g["model_type"]
    if g.get("intermediate_size") is None:
        g["intermediate_size"] = g.get("moe_intermediate_size")
    if g["dtype"] not in _DTYPES:
        raise ConfigError(f"{name}: dtype must be one of {', '.join(_DTYPES)}, got {g['dtype']!r}")
    vocab = g.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < MIN_VOCAB:
        raise ConfigError(f"{name}: vocab_size must be an integer of at least {MIN_VOCAB}, got {vocab!r}")
    fmt = g.setdefault("expert_format", "plain")
    if fmt not in ("plain", "mxfp4") or (fmt == "mxfp4" and mt != "gpt_oss"):
        raise ConfigError(f"{name}: expert_format must be 'plain'{' or mxfp4' if mt == 'gpt_oss' else ''}, got {fmt!r}")
    cfg = hf_config(g, seed=0, skew=0.0)
    try:
        args = ModelArgs.from_config(cfg)
    except ColibriError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if fmt == "mxfp4" and (args.hidden_size % 32 or args.moe_intermediate_size % 32):
        raise ConfigError(f"{name}: MXFP4 experts need hidden_size and intermediate_size divisible by 32")
    # What synth's recipe reads: the expert count, a rope dimension and theta.
    g["num_experts"] = args.num_experts
    g["head_dim"] = args.head_dim
    g["rope_theta"] = float(args.rope["rope_theta"])
    g["num_key_value_heads"] = args.num_kv_heads
    g["_eos"] = EOS_TOKEN_ID
    return g


def hf_config(g: dict, seed: int, skew: float) -> dict:
    from engine.synth import EOS_TOKEN_ID, SYNTH_VERSION
    mt = g["model_type"]
    cfg = {k: v for k, v in g.items() if k not in SYNTH_ONLY and not k.startswith("_") and k != "num_experts"}
    cfg.update(architectures=[ARCHITECTURES[mt]], bos_token_id=None, eos_token_id=EOS_TOKEN_ID, pad_token_id=None,
               hidden_act="silu", tie_word_embeddings=False, use_cache=True, torch_dtype=g["dtype"],
               initializer_range=g.get("initializer_range", 0.02))
    theta = float(cfg.pop("rope_theta", 10000.0))
    cfg.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": theta})
    cfg["rope_parameters"].setdefault("rope_theta", theta)
    if mt in MLA_TYPES:
        # As transformers writes them: head_dim is the rope head, kv heads = heads.
        cfg.update(head_dim=cfg["qk_rope_head_dim"], num_key_value_heads=cfg["num_attention_heads"])
    if g.get("expert_format") == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    cfg["colibri_synth"] = {"version": SYNTH_VERSION, "preset": g.get("name", "custom"), "seed": seed,
                            "routing_skew": skew}
    return cfg


# --- tensor plan ------------------------------------------------------------------------------
# Kinds beyond synth's: "read" reads the residual stream (its constant channel 0 is zeroed
# out of it, so only routers see that channel), "inner" acts on an inner representation,
# "write" writes the residual (row 0 zero: the constant channel stays constant), "small" for
# biases and sinks, "zero_bias" for LayerNorm biases.

def tensor_plan(g: dict) -> list:
    from engine.arch.args import ModelArgs
    from engine.synth import PlannedTensor as T
    args = ModelArgs.from_config(hf_config(g, 0, 0.0))
    H, V, mt = g["hidden_size"], g["vocab_size"], g["model_type"]
    units = [[T("model.embed_tokens.weight", (V, H), "embed")]]
    for i in range(args.num_layers):
        p = f"model.layers.{i}"
        layer = [T(f"{p}.input_layernorm.weight", (H,), "norm", i)]
        layer += _attention_plan(g, args, p, i)
        layer.append(T(f"{p}.post_attention_layernorm.weight", (H,), "norm", i))
        if not args.is_moe_layer(i):
            I = args.intermediate_size
            layer += [T(f"{p}.mlp.gate_proj.weight", (I, H), "read", i), T(f"{p}.mlp.up_proj.weight", (I, H), "read", i),
                      T(f"{p}.mlp.down_proj.weight", (H, I), "write", i)]
            units += [[t] for t in layer]
            continue
        E, I = args.num_experts, args.moe_intermediate_size
        if mt == "gpt_oss":
            layer += [T(f"{p}.mlp.router.weight", (E, H), "router", i), T(f"{p}.mlp.router.bias", (E,), "small", i)]
            units += [[t] for t in layer]
            units.append(_gpt_oss_experts(g, p, i, E, H, I))
            continue
        layer += [T(f"{p}.mlp.gate.weight", (E, H), "router", i),
                  T(f"{p}.mlp.gate.e_score_correction_bias", (E,), "small", i)]
        Is = args.shared_experts_intermediate_size
        if Is:
            layer += [T(f"{p}.mlp.shared_experts.gate_proj.weight", (Is, H), "read", i),
                      T(f"{p}.mlp.shared_experts.up_proj.weight", (Is, H), "read", i),
                      T(f"{p}.mlp.shared_experts.down_proj.weight", (H, Is), "write", i)]
        units += [[t] for t in layer]
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            units.append([T(f"{q}.gate_proj.weight", (I, H), "expert_in", i, e),
                          T(f"{q}.up_proj.weight", (I, H), "expert_in", i, e),
                          T(f"{q}.down_proj.weight", (H, I), "expert_out", i, e)])
    units.append([T("model.norm.weight", (H,), "norm")])
    units.append([T("lm_head.weight", (V, H), "lm_head")])
    return units


def _attention_plan(g: dict, args, p: str, i: int) -> list:
    from engine.synth import PlannedTensor as T
    H, a = g["hidden_size"], f"{p}.self_attn"
    if g["model_type"] in MLA_TYPES:
        m = args.attention_impl
        N, P, R, r, Vd = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        out = []
        if m.q_lora_rank is None:
            out.append(T(f"{a}.q_proj.weight", (N * (P + R), H), "read", i))
        else:
            qr = m.q_lora_rank
            out += [T(f"{a}.q_a_proj.weight", (qr, H), "read", i), T(f"{a}.q_a_layernorm.weight", (qr,), "norm", i),
                    T(f"{a}.q_b_proj.weight", (N * (P + R), qr), "inner", i)]
        out += [T(f"{a}.kv_a_proj_with_mqa.weight", (r + R, H), "read", i),
                T(f"{a}.kv_a_layernorm.weight", (r,), "norm", i),
                T(f"{a}.kv_b_proj.weight", (N * (P + Vd), r), "inner", i),
                T(f"{a}.o_proj.weight", (H, N * Vd), "write", i)]
        ix = m.indexer
        if ix is not None and i in ix.full_layers:
            out += [T(f"{a}.indexer.wq_b.weight", (ix.n_heads * ix.head_dim, m.q_lora_rank), "inner", i),
                    T(f"{a}.indexer.wk.weight", (ix.head_dim, H), "read", i),
                    T(f"{a}.indexer.k_norm.weight", (ix.head_dim,), "norm", i),
                    T(f"{a}.indexer.k_norm.bias", (ix.head_dim,), "zero_bias", i),
                    T(f"{a}.indexer.weights_proj.weight", (ix.n_heads, H), "read", i)]
        return out
    N, Nkv, D = args.num_heads, args.num_kv_heads, args.head_dim
    gpt_oss = g["model_type"] == "gpt_oss"
    out = []
    for proj, rows in (("q_proj", N * D), ("k_proj", Nkv * D), ("v_proj", Nkv * D)):
        out.append(T(f"{a}.{proj}.weight", (rows, H), "read", i))
        if gpt_oss or args.attention_bias:
            out.append(T(f"{a}.{proj}.bias", (rows,), "small", i))
    out.append(T(f"{a}.o_proj.weight", (H, N * D), "write", i))
    if gpt_oss:
        out += [T(f"{a}.o_proj.bias", (H,), "write_bias", i), T(f"{a}.sinks", (N,), "small", i)]
    if args.qk_norm == "head":
        out += [T(f"{a}.q_norm.weight", (D,), "norm", i), T(f"{a}.k_norm.weight", (D,), "norm", i)]
    return out


def _gpt_oss_experts(g: dict, p: str, i: int, E: int, H: int, I: int) -> list:
    """One unit: the layer's fused experts (every expert is a slice of each)."""
    from engine.synth import PlannedTensor as T
    q = f"{p}.mlp.experts"
    if g.get("expert_format") == "mxfp4":
        return [T(f"{q}.gate_up_proj_blocks", (E, 2 * I, H // 32, 16), "mx_blocks", i, dtype="uint8"),
                T(f"{q}.gate_up_proj_scales", (E, 2 * I, H // 32), "mx_scales", i, dtype="uint8"),
                T(f"{q}.gate_up_proj_bias", (E, 2 * I), "small", i, dtype="bfloat16"),
                T(f"{q}.down_proj_blocks", (E, H, I // 32, 16), "mx_blocks", i, dtype="uint8"),
                T(f"{q}.down_proj_scales", (E, H, I // 32), "mx_scales", i, dtype="uint8"),
                T(f"{q}.down_proj_bias", (E, H), "write_bias", i, dtype="bfloat16")]
    return [T(f"{q}.gate_up_proj", (E, H, 2 * I), "fused_in", i), T(f"{q}.gate_up_proj_bias", (E, 2 * I), "small", i),
            T(f"{q}.down_proj", (E, I, H), "fused_out", i), T(f"{q}.down_proj_bias", (E, H), "write_bias", i)]


# --- weight recipe ----------------------------------------------------------------------------

def make_recipe(g: dict, seed: int, skew: float):
    from engine.synth import Recipe

    class ArchRecipe(Recipe):
        """synth's recipe plus the kinds of these architectures' tensors."""

        _quantized: tuple | None = None  # (base name, blocks, scales): one quantization per weight

        def values(self, t):
            torch, kind, shape = self.torch, t.kind, t.shape
            if kind in ("read", "inner", "fused_in"):
                w = self._normal(t.name, shape, self.std)
                if self.structured and kind == "read":
                    w[:, 0] = 0.0
                return w
            if kind in ("write", "fused_out"):
                w = self._normal(t.name, shape, self.out_std)
                if self.structured:
                    if kind == "write":
                        w[0, :] = 0.0
                    else:  # x @ W layout: output channels are the last dimension
                        w[..., 0] = 0.0
                return w
            if kind in ("small", "write_bias"):
                w = self._normal(t.name, shape, self.std)
                if self.structured and kind == "write_bias":
                    w[..., 0] = 0.0
                return w
            if kind == "zero_bias":
                return torch.zeros(shape)
            if kind in ("mx_blocks", "mx_scales"):
                return self._mxfp4(t)[0 if kind == "mx_blocks" else 1]
            return super().values(t)

        def _mxfp4(self, t):
            """The MXFP4 form of the float weight the plain format would hold ([E, out, in])."""
            from engine.arch.gptoss import mxfp4_quantize
            base = t.name.rsplit("_", 1)[0]  # ...gate_up_proj_blocks → ...gate_up_proj
            if self._quantized is None or self._quantized[0] != base:
                E, rows, groups = t.shape[:3]
                w = self._normal(base, (E, rows, groups * 32), self.std if "gate_up" in base else self.out_std)
                if self.structured and "down" in base:
                    w[:, 0, :] = 0.0
                self._quantized = (base, *mxfp4_quantize(w))
            return self._quantized[1:]

    return ArchRecipe(g, seed, skew)
