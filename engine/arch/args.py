"""ModelArgs (what the forward pass needs to know of a model), the fields every config.json
shares, and the tensor names (HF's names) the switches of ModelArgs imply.

The architectures differ only in a handful of switches, collected in `ModelArgs`: q/k norms
(none / per head / over the whole projection), qkv bias, shared expert, how the top-k routing
weights are normalised, and which layers are MoE. deepseek_v3, glm4_moe, glm_moe_dsa and
gpt_oss also swap in their own attention, routing rule and expert math through strategy
objects on ModelArgs. Each architecture's parse (engine/arch/families/) sets them;
engine/arch/registry.py turns a config.json into ModelArgs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.base.errors import UnsupportedModelError

# --- configuration ----------------------------------------------------------------------------

@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP (dense models, and MoE layers listed as mlp-only)
    rms_norm_eps: float
    rope: dict  # rope_type, rope_theta and the scaling parameters
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (qwen3: per head) | "full" (olmoe: whole projection)
    clip_qkv: float | None = None
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # MoE
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    moe_layer_flags: list[bool] = field(default_factory=list)
    moe_prefix: str = "mlp"  # mixtral: "block_sparse_moe"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Extensions (engine/arch/families/): None/0 keeps the behaviour of the architectures above.
    rotary_dim: int = 0  # 0 = all of head_dim; glm4_moe rotates partial_rotary_factor of it
    shared_experts_intermediate_size: int = 0  # deepseek-style ungated `mlp.shared_experts`
    attention_impl: object | None = None  # engine.arch.mla.MLAAttention | engine.arch.gpt_oss_layers.SinkAttention
    router: object | None = None  # engine.arch.router.*: names(prefix), route(w, prefix, x)
    expert_impl: object | None = None  # engine.arch.gpt_oss_layers.GptOssExperts: numel, forward

    def __post_init__(self):
        if not self.moe_layer_flags:
            self.moe_layer_flags = [self.num_experts > 0] * self.num_layers

    @property
    def is_moe(self) -> bool:
        return any(self.moe_layer_flags)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layer_flags[layer]

    @property
    def expert_numel(self) -> int:
        """Elements of one routed expert in the compute dtype."""
        if self.expert_impl is not None:
            return self.expert_impl.numel
        return 3 * self.hidden_size * self.moe_intermediate_size


def _rope_params(cfg: dict) -> dict:
    # transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` + `rope_scaling`.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return params


def common_fields(model_type: str, cfg: dict) -> dict:
    """The ModelArgs fields every architecture reads the same way (a family's parse adds its own)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    common = dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(cfg.get("intermediate_size") or 0),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_params(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=cfg.get("hidden_act", "silu"),
    )
    if common["hidden_act"] not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {common['hidden_act']!r} is not supported (silu only)")
    return common


def sliding_window(cfg: dict, used_by_default: bool) -> int | None:
    """The attention window, when the config turns sliding-window attention on."""
    return cfg.get("sliding_window") if cfg.get("use_sliding_window", used_by_default) else None


# --- tensor names -----------------------------------------------------------------------------

def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}"


def expert_tensor_names(args: ModelArgs, layer: int, expert: int) -> tuple[str, str, str]:
    """Per-expert (gate, up, down) tensor names, as save_pretrained writes them."""
    base = f"{layer_prefix(layer)}.{args.moe_prefix}.experts.{expert}"
    return tuple(f"{base}.{n}.weight" for n in args.expert_names)  # type: ignore[return-value]


def fused_expert_tensor_names(args: ModelArgs, layer: int) -> tuple[str, str]:
    """Fused 3-D layout: gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I]."""
    base = f"{layer_prefix(layer)}.{args.moe_prefix}.experts"
    return f"{base}.gate_up_proj", f"{base}.down_proj"


def dense_tensor_names(args: ModelArgs) -> list[str]:
    """Every tensor that stays resident: all but the routed experts."""
    return list(dense_tensors(args))


def dense_tensors(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every resident tensor (all but the routed experts), in file order, with the shape its
    config.json implies: the one size formula behind shape checks at load, parameter counts and
    the cost model's geometry. The architecture's own attention and router say theirs."""
    return dict(iter_dense_tensors(args))


def iter_dense_tensors(args: ModelArgs) -> Iterator[tuple[str, tuple[int, ...]]]:
    """dense_tensors one at a time (a count over a geometry of many layers holds none of them)."""
    H, V, D = args.hidden_size, args.vocab_size, args.head_dim
    q, kv, I = args.num_heads * D, args.num_kv_heads * D, args.intermediate_size
    yield "model.embed_tokens.weight", (V, H)
    yield "model.norm.weight", (H,)
    if not args.tie_word_embeddings:
        yield "lm_head.weight", (V, H)
    for i in range(args.num_layers):
        p = layer_prefix(i)
        yield f"{p}.input_layernorm.weight", (H,)
        yield f"{p}.post_attention_layernorm.weight", (H,)
        if args.attention_impl is not None:
            yield from args.attention_impl.layer_shapes(f"{p}.self_attn", i, H).items()
        else:
            for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                yield f"{p}.self_attn.{proj}.weight", (rows, H)
                if args.attention_bias:
                    yield f"{p}.self_attn.{proj}.bias", (rows,)
            yield f"{p}.self_attn.o_proj.weight", (H, q)
        if args.qk_norm != "none":  # qwen3: per head; olmoe: over the whole projection
            head = args.qk_norm == "head"
            yield f"{p}.self_attn.q_norm.weight", (D,) if head else (q,)
            yield f"{p}.self_attn.k_norm.weight", (D,) if head else (kv,)
        if args.is_moe_layer(i):
            weight, *bias = router_tensor_names(args, i)  # [E, H] (+ one [E] bias: the rules beyond softmax)
            yield weight, (args.num_experts, H)
            yield from ((b, (args.num_experts,)) for b in bias)
            if args.shared_experts_intermediate_size:
                yield from _mlp(f"{p}.mlp.shared_experts", H, args.shared_experts_intermediate_size)
            if args.shared_expert_intermediate_size:
                yield from _mlp(f"{p}.mlp.shared_expert", H, args.shared_expert_intermediate_size)
                yield f"{p}.mlp.shared_expert_gate.weight", (1, H)
        else:
            yield from _mlp(f"{p}.mlp", H, I)


def _mlp(p: str, H: int, I: int) -> tuple[tuple[str, tuple[int, int]], ...]:
    return (f"{p}.gate_proj.weight", (I, H)), (f"{p}.up_proj.weight", (I, H)), (f"{p}.down_proj.weight", (H, I))


def router_tensor_names(args: ModelArgs, layer: int) -> list[str]:
    if args.router is not None:
        return args.router.names(layer_prefix(layer))
    return [f"{layer_prefix(layer)}.{args.moe_prefix}.gate.weight"]
