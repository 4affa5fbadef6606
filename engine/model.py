"""The architectures, in one readable file (after gpt-fast's model.py).

Supported `model_type`s: qwen3_moe, qwen2_moe, mixtral, olmoe (MoE) and llama, qwen2, qwen3
(dense). They differ only in a handful of switches, collected in `ModelArgs`:
q/k norms (none / per head / over the whole projection), qkv bias, shared expert, how the
top-k routing weights are normalised, and which layers are MoE. deepseek_v3, glm4_moe,
glm_moe_dsa and gpt_oss also swap in their own attention, routing rule and expert math
through strategy objects on ModelArgs (engine/archs.py builds them; engine/mla.py,
engine/routing.py, engine/gptoss.py implement them).

Shape legend used in comments:
    T  tokens in this forward call        S  positions attended (start + T)
    H  hidden size                        D  head_dim
    Nq query heads   Nkv key/value heads  V  vocab
    E  routed experts   K  experts per token (top-k)   I  expert intermediate size

Weights are plain tensors in dicts, not nn.Modules: the runtime decides where each one lives
(resident, streamed from disk, cached), and the math here only asks for them. Routed experts
come from an ExpertStore (engine/store.py), the seam between this file and the streaming runtime;
the MoE layer hands each expert's weights to one function, `Transformer.expert_fn`, which a new
weight format replaces together with the layout's bytes → weights step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import UnsupportedModelError, ModelFormatError
from .quant import linear

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
DENSE_TYPES = ("llama", "qwen2", "qwen3")
# Parsed by engine/archs.py; they plug in through the strategy fields at the end of ModelArgs.
EXT_MOE_TYPES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "gpt_oss")
SUPPORTED_TYPES = MOE_TYPES + EXT_MOE_TYPES + DENSE_TYPES


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
    # Extensions (engine/archs.py): None/0 keeps the behaviour of the architectures above.
    rotary_dim: int = 0  # 0 = all of head_dim; glm4_moe rotates partial_rotary_factor of it
    shared_experts_intermediate_size: int = 0  # deepseek-style ungated `mlp.shared_experts`
    attention_impl: object | None = None  # engine.mla.MLAAttention | engine.gptoss.SinkAttention
    router: object | None = None  # engine.routing.*: names(prefix), route(w, prefix, x)
    expert_impl: object | None = None  # engine.gptoss.GptOssExperts: numel, locations, forward

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

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
        try:
            return _args_from_config(model_type, cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelFormatError(f"config.json for {model_type} is missing or has a bad field: {exc}") from None


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


def _args_from_config(model_type: str, cfg: dict) -> ModelArgs:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    common = dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
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
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", model_type == "mixtral") else None
    if model_type in EXT_MOE_TYPES:
        from .archs import ext_fields
        fields = ext_fields(model_type, cfg, common)
        return ModelArgs(**common, **fields)

    if model_type in ("llama", "qwen2", "qwen3"):
        return ModelArgs(
            **common,
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm="head" if model_type == "qwen3" else "none",
            sliding_window=window,
        )

    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    if model_type == "mixtral":
        return ModelArgs(
            **common, num_experts=num_experts, top_k=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,  # Mixtral: softmax over the top-k logits == renormalised top-k
            sliding_window=window,
            moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"),
        )
    if model_type == "olmoe":
        return ModelArgs(
            **common, num_experts=num_experts, top_k=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            qk_norm="full", clip_qkv=cfg.get("clip_qkv"),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )
    # qwen2_moe / qwen3_moe: some layers may be plain MLPs.
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    flags = [(i not in mlp_only) and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)]
    return ModelArgs(
        **common, num_experts=num_experts, top_k=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", model_type == "qwen3_moe")),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2_moe")),
        qk_norm="head" if model_type == "qwen3_moe" else "none",
        sliding_window=window,
        moe_layer_flags=flags,
    )


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
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not args.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(args.num_layers):
        p = layer_prefix(i)
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        if args.attention_impl is not None:
            names += args.attention_impl.layer_names(f"{p}.self_attn", i)
        else:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                names.append(f"{p}.self_attn.{proj}.weight")
                if args.attention_bias and proj != "o_proj":
                    names.append(f"{p}.self_attn.{proj}.bias")
        if args.qk_norm != "none":
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        if args.is_moe_layer(i):
            names += router_tensor_names(args, i)
            if args.shared_experts_intermediate_size:
                names += [f"{p}.mlp.shared_experts.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
            if args.shared_expert_intermediate_size:
                names += [f"{p}.mlp.shared_expert.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
                names.append(f"{p}.mlp.shared_expert_gate.weight")
        else:
            names += [f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def router_tensor_names(args: ModelArgs, layer: int) -> list[str]:
    if args.router is not None:
        return args.router.names(layer_prefix(layer))
    return [f"{layer_prefix(layer)}.{args.moe_prefix}.gate.weight"]


# --- rotary embeddings ------------------------------------------------------------------------

def rope_inv_freq(args: ModelArgs, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the attention (cos/sin) scale, per the config's rope_type."""
    p, dim = args.rope, args.rotary_dim or args.head_dim
    base = float(p["rope_theta"])
    kind = p.get("rope_type", "default")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if kind == "dynamic":
        # NTK-aware: the base grows once the sequence passes the trained length.
        max_pos = args.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = float(p["factor"])
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if kind == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(args, base, dim)
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported (default, linear, dynamic, llama3, yarn)")


def _yarn_inv_freq(args: ModelArgs, base: float, dim: int) -> tuple[torch.Tensor, float]:
    p = args.rope
    orig = p.get("original_max_position_embeddings") or args.max_position_embeddings
    factor = p.get("factor") or args.max_position_embeddings / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D] (rotate-half layout, as in HF)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, T, D]; cos/sin: [T, Dr], Dr <= D (partial rotary: the rest passes through)
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# --- building blocks --------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype, as the reference implementations do.
    # F.rms_norm is one fused op where the written-out form was five (x * rsqrt(mean(x^2) + eps)),
    # with the same result bit for bit.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    # x: [T, H]; gate/up: [I, H]; down: [H, I]
    # Weights may be QuantWeights (quantized containers): `linear` picks their kernel.
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def swiglu_expert(x: torch.Tensor, weights: tuple) -> torch.Tensor:
    """One routed expert: x [T, H] → [T, H], from what layout.tensors_from_buffers made of its
    bytes: (gate_up [2I, H], down [H, I]), or (gate, up, down) where the file keeps them apart.

    The one place the MoE layer reads an expert's weights; a new format replaces both.
    """
    down = weights[-1]
    if down.device != x.device:  # the expert sits in the VRAM tier
        return swiglu_expert(x.to(down.device), weights).to(x.device)
    if len(weights) == 3:
        return swiglu(x, *weights)
    gu = F.linear(x, weights[0])  # [T, 2I]
    inter = down.shape[1]
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def route(args: ModelArgs, router_weight: torch.Tensor, x: torch.Tensor):
    """Top-k routing with each architecture's normalisation. x: [T, H] → ids [T, K], weights [T, K]."""
    logits = F.linear(x, router_weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, args.top_k, dim=-1)
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def route_layer(args: ModelArgs, w: dict, layer: int, x: torch.Tensor):
    """Layer `layer`'s routing rule (the architecture's own) on x: ids [T, K], weights [T, K]."""
    if args.router is not None:
        return args.router.route(w, layer_prefix(layer), x)
    return route(args, w[f"{layer_prefix(layer)}.{args.moe_prefix}.gate.weight"], x)


@dataclass
class KVCache:
    """Keys and values for every layer, preallocated for ctx_size positions."""

    k: list[torch.Tensor]  # per layer [Nkv, ctx, D]
    v: list[torch.Tensor]

    @classmethod
    def allocate(cls, args: ModelArgs, ctx_size: int, dtype: torch.dtype) -> "KVCache":
        if hasattr(args.attention_impl, "allocate_cache"):  # MLA: compressed latents instead
            return args.attention_impl.allocate_cache(args.num_layers, ctx_size, dtype)
        shape = (args.num_kv_heads, ctx_size, args.head_dim)
        return cls([torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)],
                   [torch.zeros(shape, dtype=dtype) for _ in range(args.num_layers)])

    @staticmethod
    def nbytes_for(args: ModelArgs, ctx_size: int, dtype: torch.dtype) -> int:
        if hasattr(args.attention_impl, "cache_nbytes"):
            return args.attention_impl.cache_nbytes(args.num_layers, ctx_size, dtype)
        elem = torch.finfo(dtype).bits // 8
        return 2 * args.num_layers * args.num_kv_heads * ctx_size * args.head_dim * elem

    @property
    def ctx_size(self) -> int:
        return self.k[0].shape[1]


# --- the transformer --------------------------------------------------------------------------

class Transformer:
    """Forward pass over resident dense weights and an ExpertStore for routed experts."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], experts, dtype: torch.dtype):
        self.args = args
        self.w = weights
        self.experts = experts
        self.dtype = dtype
        self.lm_head = weights["model.embed_tokens.weight"] if args.tie_word_embeddings else weights["lm_head.weight"]
        self._rope_seq = 0
        self._inv_freq, self._rope_scale = rope_inv_freq(args)
        # Router lookahead: after layer L's attention, layer L+1's router applied to the same
        # hidden state predicts L+1's experts well enough to start their reads early.
        self.lookahead_depth = 0
        # Layer streaming (dense models over budget): these layers are read per token.
        self.layer_source = None
        self.streamed_layers: list[int] = []
        self._streamed: frozenset[int] = frozenset()  # membership test on the per-layer path
        # What computes one routed expert from its weights: the architecture's own (gpt_oss:
        # biases + clamped SwiGLU), else SwiGLU over what layout.tensors_from_buffers made.
        self.expert_fn = swiglu_expert if args.expert_impl is None else args.expert_impl.forward
        self.routing_log: list[list[torch.Tensor]] | None = None  # per layer, ids [T, K] per call

    def _rope(self, positions: torch.Tensor):
        if self.args.rope.get("rope_type") == "dynamic":
            seq = int(positions[-1]) + 1
            if seq > self._rope_seq:  # dynamic NTK only ever grows, as in transformers
                self._rope_seq = seq
                self._inv_freq, self._rope_scale = rope_inv_freq(self.args, seq)
        return rope_cos_sin(self._inv_freq, self._rope_scale, positions, self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, kv: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens: [T] int64 → logits [T, V] (fp32), writing K/V at positions start_pos..start_pos+T.

        last_only: logits of the last position only ([1, V]); generation needs no more, and the
        lm_head is the largest matmul of a prefill.
        """
        T = tokens.shape[0]
        if start_pos + T > kv.ctx_size:
            raise ValueError(f"{start_pos + T} positions exceed ctx_size {kv.ctx_size}")
        positions = torch.arange(start_pos, start_pos + T)
        cos, sin = self._rope(positions)
        mask = self._mask(start_pos, T)
        x = F.embedding(tokens, self.w["model.embed_tokens.weight"])  # [T, H]
        for layer in range(self.args.num_layers):
            x = self._layer(layer, x, start_pos, kv, cos, sin, mask)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.w["model.norm.weight"], self.args.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def _mask(self, start_pos: int, T: int) -> torch.Tensor | None:
        window = self.args.sliding_window
        S = start_pos + T
        if T == 1 and (window is None or S <= window):
            return None  # one new token sees every cached position
        q_pos = torch.arange(start_pos, S)[:, None]
        k_pos = torch.arange(S)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        return allowed  # [T, S] bool

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """This layer's weights: the resident dict, or (layer streaming) a fresh read."""
        if layer not in self._streamed:
            return self.w
        # Reads for the next streamed layers (wrapping to the next token's) are in flight while
        # this one computes.
        for step in range(1, self.lookahead_depth + 1):
            ahead = (layer + step) % self.args.num_layers
            if ahead in self._streamed:
                self.layer_source.hint_layer(ahead)
        return self.layer_source.layer_weights(layer)

    def stream_layers(self, source, layers: list[int]) -> None:
        """Read `layers` from `source` per forward pass instead of keeping them resident."""
        self.layer_source, self.streamed_layers = source, list(layers)
        self._streamed = frozenset(layers)

    def _layer(self, layer, x, start_pos, kv, cos, sin, mask):
        p, a = layer_prefix(layer), self.args
        w = self._layer_weights(layer)
        h = x + self._attention(layer, w, rms_norm(x, w[f"{p}.input_layernorm.weight"], a.rms_norm_eps),
                                start_pos, kv, cos, sin, mask)
        normed = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)
        self._lookahead(layer, normed, h)
        if a.is_moe_layer(layer):
            return h + self._moe(layer, w, normed)
        return h + swiglu(normed, w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"],
                          w[f"{p}.mlp.down_proj.weight"])

    def _attention(self, layer, w, x, start_pos, kv, cos, sin, mask):
        p, a = f"{layer_prefix(layer)}.self_attn", self.args
        if a.attention_impl is not None:
            return a.attention_impl.forward(w, p, layer, x, start_pos, kv, cos, sin, mask)
        T = x.shape[0]
        q = linear(x, w[f"{p}.q_proj.weight"], w.get(f"{p}.q_proj.bias"))  # [T, Nq*D]
        k = linear(x, w[f"{p}.k_proj.weight"], w.get(f"{p}.k_proj.bias"))  # [T, Nkv*D]
        v = linear(x, w[f"{p}.v_proj.weight"], w.get(f"{p}.v_proj.bias"))
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        if a.qk_norm == "full":
            q = rms_norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        q = q.view(T, a.num_heads, a.head_dim).transpose(0, 1)  # [Nq, T, D]
        k = k.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)  # [Nkv, T, D]
        v = v.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        if a.qk_norm == "head":
            q = rms_norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        S = start_pos + T
        kv.k[layer][:, start_pos:S] = k
        kv.v[layer][:, start_pos:S] = v
        keys = kv.k[layer][:, :S].to(q.dtype)  # [Nkv, S, D]
        values = kv.v[layer][:, :S].to(q.dtype)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads)
        out = out.squeeze(0).transpose(0, 1).reshape(T, a.num_heads * a.head_dim)  # [T, Nq*D]
        return linear(out, w[f"{p}.o_proj.weight"])

    def _lookahead(self, layer: int, normed: torch.Tensor, residual: torch.Tensor) -> None:
        if self.experts is None or not self.lookahead_depth:
            return
        a = self.args
        for ahead in range(1, self.lookahead_depth + 1):
            target = layer + ahead
            if target >= a.num_layers or not a.is_moe_layer(target):
                continue
            tp = layer_prefix(target)
            # The target layer's own norm and router on today's residual stream: cheap (an
            # [T,H]x[H,E] product) and right most of the time, because the residual changes
            # slowly from layer to layer.
            guess_in = rms_norm(residual, self.w[f"{tp}.post_attention_layernorm.weight"], a.rms_norm_eps)
            ids, _ = route_layer(a, self.w, target, guess_in)  # the architecture's own rule
            predicted = ids[0].tolist() if ids.shape[0] == 1 else torch.unique(ids).tolist()
            self.experts.hint_experts(target, predicted)

    def _moe(self, layer: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        p, a = layer_prefix(layer), self.args
        ids, weights = route_layer(a, w, layer, x)  # [T, K] each
        if self.routing_log is not None:
            self.routing_log[layer].append(ids)
        out = self._routed_decode(layer, x, ids, weights) if x.shape[0] == 1 else self._routed(layer, x, ids, weights)
        if a.shared_experts_intermediate_size:  # deepseek-style: resident, always on, no gate
            out = out + swiglu(x, *(w[f"{p}.mlp.shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
        if a.shared_expert_intermediate_size:
            shared = swiglu(x, w[f"{p}.mlp.shared_expert.gate_proj.weight"],
                            w[f"{p}.mlp.shared_expert.up_proj.weight"],
                            w[f"{p}.mlp.shared_expert.down_proj.weight"])
            out = out + torch.sigmoid(F.linear(x, w[f"{p}.mlp.shared_expert_gate.weight"])) * shared
        return out

    # Both paths compute experts in whatever order the store delivers them (hits first, misses
    # as they land) but sum them in ascending expert order: the sum is then the same bit for bit
    # in every placement, which the placement-invariance tests rely on.

    def _routed_decode(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One token (T == 1): K experts on the same row, summed by one [1,K] x [K,H] product."""
        sorted_ids, order = torch.sort(ids[0])
        needed = sorted_ids.tolist()
        position = {e: j for j, e in enumerate(needed)}
        ys: list = [None] * len(needed)
        expert_fn = self.expert_fn

        def run(e, expert_weights):
            ys[position[e]] = expert_fn(x, expert_weights)

        self.experts.for_each_expert(layer, needed, run)
        return torch.mm(weights[0, order][None], torch.cat(ys))  # [1, H]

    def _routed(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Several tokens: each expert gets the rows routed to it (one sort groups them)."""
        K = ids.shape[1]
        sorted_ids, order = torch.sort(ids.flatten(), stable=True)  # [T*K], grouped by expert
        experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        needed, counts = experts.tolist(), counts.tolist()
        starts = [0] * len(counts)
        for j in range(1, len(counts)):
            starts[j] = starts[j - 1] + counts[j - 1]
        position = {e: j for j, e in enumerate(needed)}
        token_of = order // K  # the row of x each routed slot belongs to
        slot_weight = weights.flatten()[order, None]
        ys: list = [None] * len(needed)
        expert_fn = self.expert_fn

        def run(e, expert_weights):
            j = position[e]
            rows = slice(starts[j], starts[j] + counts[j])
            ys[j] = expert_fn(x[token_of[rows]], expert_weights) * slot_weight[rows]

        self.experts.for_each_expert(layer, needed, run)
        return torch.zeros_like(x).index_add_(0, token_of, torch.cat(ys))
