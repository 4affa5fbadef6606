"""Model geometry for the cost model: a model directory, or a bundled geometry-only spec.

What the cost model needs from a model is its tensor sizes, not its bytes: how many parameters
stay resident (attention, norms, embeddings, shared experts, dense layers), how big one routed
expert is, how many routed experts there are and how many a token uses, and how big the KV
cache is per position. A model directory gives these exactly from its safetensors headers; a
spec (engine/presets/*.json, a config.json-like dict) gives them from the architecture's
formulas, including multi-head latent attention (DeepSeek-V3, GLM-5), which the engine cannot
run yet but which users plan for.

Quant levels are bytes per weight, scale overhead included:
  bf16  2 bytes;  fp32  4 bytes;
  int8  1 byte + one bf16 scale per output row (2 / K bytes per weight);
  fp8   1 byte + one fp32 scale per 128x128 block (4 / 16384 bytes per weight): the published
        FP8 e4m3 checkpoints (DeepSeek-V3/R1, Kimi-K2, GLM/Qwen3 FP8; engine/format/fp8.py);
  int4  half a byte + a bf16 scale and a bf16 zero per group of 64 (4 / 64 bytes per weight),
        the layout of torch's _weight_int4pack_mm (scales_and_zeros [K/group, N, 2]).
These are engine/format/quant.py's containers (int8 per row, int4 group 64 by default) with scope
"all": every matrix quantized, embeddings included, as Colibrì keeps GLM-5's dense part at
int4; norms (1-D) stay in bf16.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from engine.arch.args import dense_tensor_names
from engine.arch.registry import model_args
from engine.base.errors import ConfigError
from engine.base.inputs import printable
from engine.format.checkpoint import Checkpoint
from engine.format.container import container_spec, dense_quantized
from engine.run.runtime import checkpoint_dtype
from engine.synth import list_presets, load_geometry_file, load_preset
from engine.synth.geometry_check import check_geometry

INT4_GROUP = 64
QUANTS = ("bf16", "fp32", "fp8", "int8", "int4")
FP8_BLOCK = 128 * 128
FP8_QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")  # the projections FP8 releases store in e4m3
MATERIALIZED_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
MLA_TYPES = ("deepseek_v3", "glm_moe_dsa", "glm4_moe_dsa")


def bytes_per_weight(quant: str, in_features: int) -> float:
    """Stored bytes per weight of a [out, in_features] matrix at this quant level."""
    if quant == "bf16":
        return 2.0
    if quant == "fp32":
        return 4.0
    if quant == "fp8":
        return 1.0 + 4.0 / FP8_BLOCK
    if quant == "int8":
        return 1.0 + 2.0 / max(in_features, 1)
    if quant == "int4":
        return 0.5 + 4.0 / INT4_GROUP
    raise ConfigError(f"unknown quant level {quant!r} (known: {', '.join(QUANTS)})")


@dataclass(frozen=True)
class Tensor:
    """A resident tensor: its name as the engine's plan asks for it, its shape and its role."""

    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, quant: str) -> float:
        if len(self.shape) < 2:  # norms and biases stay in bf16 whatever the quant level
            return 2.0 * self.numel if quant != "fp32" else 4.0 * self.numel
        if quant == "fp8" and not FP8_QUANTIZED.search(self.name):
            return 2.0 * self.numel  # as published: embeddings, routers and lm_head stay bf16
        return bytes_per_weight(quant, self.shape[-1]) * self.numel


@dataclass
class ModelGeometry:
    name: str
    model_type: str
    num_layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    vocab_size: int
    native_quant: str  # the dtype the weights are published in (bf16 for every bundled spec)
    # Resident tensors by the names the engine's plan asks for (see memplan.py).
    dense: list[Tensor] = field(default_factory=list)
    # KV elements per position per layer (K + V, or MLA's compressed latent + rope key).
    kv_elems_per_layer: int = 0
    source: str = ""
    model_dir: Path | None = None
    routing_skew: float | None = None  # synth's --routing-skew, when the model is synthetic
    published_total_params: float | None = None
    published_active_params: float | None = None
    # The config dict a planning ModelArgs is built from (memplan.py).
    planning_config: dict = field(default_factory=dict)
    # Per-quant sums and planning stand-ins, computed once: a search predicts thousands of configs.
    memo: dict = field(default_factory=dict, repr=False, compare=False)

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def routed_experts(self) -> int:
        return self.moe_layers * self.num_experts

    @property
    def dense_params(self) -> int:
        return sum(t.numel for t in self.dense)

    @property
    def total_params(self) -> int:
        return self.dense_params + self.routed_experts * self.expert_params

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one decode token multiplies with: all resident ones but the embedding
        table (one row is gathered), plus top_k routed experts in every MoE layer."""
        return self.dense_params - self.embed_params + self.moe_layers * self.top_k * self.expert_params

    def dense_bytes(self, quant: str) -> float:
        key = ("dense_bytes", quant)
        if key not in self.memo:
            self.memo[key] = sum(t.nbytes(quant) for t in self.dense)
        return self.memo[key]

    def expert_bytes(self, quant: str) -> float:
        """One routed expert as stored (gate, up: [I, H]; down: [H, I])."""
        H, I = self.hidden_size, self.moe_intermediate_size
        return 2 * I * H * bytes_per_weight(quant, H) + H * I * bytes_per_weight(quant, I)

    def to_dict(self) -> dict:
        return {
            "name": self.name, "model_type": self.model_type, "layers": self.num_layers, "moe_layers": self.moe_layers,
            "experts": self.num_experts, "top_k": self.top_k, "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size, "vocab_size": self.vocab_size,
            "total_params": self.total_params, "active_params": self.active_params,
            "dense_params": self.dense_params, "expert_params": self.expert_params,
            "published_total_params": self.published_total_params,
            "published_active_params": self.published_active_params, "source": self.source,
        }


# --- from a model directory ---------------------------------------------------------------------

def from_model_dir(model_dir: str | os.PathLike) -> ModelGeometry:
    """Exact sizes from a Hugging Face directory's headers (nothing but headers is read)."""
    import torch

    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    names = dense_tensor_names(args)
    # A `--scope all` container stores dense matrices as codes + scales: the matrix's shape from its codes.
    spec = container_spec(ckpt)
    quantized = dense_quantized(ckpt, spec, names)
    dense = [Tensor(n, _matrix_shape(quantized[n][0].shape, spec.quant) if n in quantized else tuple(ckpt.info(n).shape))
             for n in names]
    native = {torch.float32: "fp32"}.get(checkpoint_dtype(ckpt), "bf16")
    if (ckpt.config.get("quantization_config") or {}).get("quant_method") == "fp8":
        native = "fp8"  # as published: the engine keeps the FP8 bytes (engine/format/fp8.py)
    synth = ckpt.config.get("colibri_synth") or {}
    return ModelGeometry(
        name=Path(model_dir).name, model_type=args.model_type, num_layers=args.num_layers,
        moe_layers=sum(args.moe_layer_flags), num_experts=args.num_experts, top_k=args.top_k,
        hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        vocab_size=args.vocab_size, native_quant=native, dense=dense,
        kv_elems_per_layer=2 * args.num_kv_heads * args.head_dim, source=str(model_dir),
        model_dir=Path(model_dir), routing_skew=synth.get("routing_skew"), planning_config=dict(ckpt.config),
    )


def _matrix_shape(codes_shape: tuple[int, ...], quant: str) -> tuple[int, int]:
    """[N, K] of a quantized matrix from its codes: int4 packs two codes a byte."""
    n, k = codes_shape
    return (n, k * 2) if quant == "int4" else (n, k)


# --- from a geometry spec -----------------------------------------------------------------------

def from_spec(spec: dict) -> ModelGeometry:
    """Sizes from a config.json-like spec (a bundled preset or a user's geometry JSON)."""
    # The one geometry validator (synth's too): types, ranges, cross-field rules and a size
    # bound, before the per-layer loop below allocates anything.
    check_geometry(spec, f"geometry {printable(spec.get('name', '?') if isinstance(spec, dict) else '?')}")
    try:
        return _from_spec(spec)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"geometry {spec.get('name', '?')!r}: missing or bad field {exc}") from None


def _from_spec(g: dict) -> ModelGeometry:
    mt = g.get("model_type")
    H, L, V = int(g["hidden_size"]), int(g["num_hidden_layers"]), int(g["vocab_size"])
    nh = int(g["num_attention_heads"])
    E = int(g.get("n_routed_experts") or g.get("num_experts") or g.get("num_local_experts") or 0)
    K = int(g["num_experts_per_tok"])
    # Mixtral and OLMoE name the expert width intermediate_size; the others moe_intermediate_size.
    I = int(g.get("moe_intermediate_size") or g["intermediate_size"])
    first_dense = int(g.get("first_k_dense_replace", 0))
    dense_I = int(g.get("intermediate_size") or I)
    shared_I = int(g.get("n_shared_experts", 0)) * I
    tied = bool(g.get("tie_word_embeddings", False))

    dense: list[Tensor] = [Tensor("model.embed_tokens.weight", (V, H)), Tensor("model.norm.weight", (H,))]
    if not tied:
        dense.append(Tensor("lm_head.weight", (V, H)))
    if mt in MLA_TYPES:
        attn, kv_elems = _mla_attention(g, H, nh)
    elif mt in MATERIALIZED_TYPES:
        attn, kv_elems = _gqa_attention(g, H, nh)
    else:
        raise ConfigError(f"geometry {g.get('name', '?')!r}: model_type {mt!r} has no size formulas "
                          f"(known: {', '.join(MATERIALIZED_TYPES + MLA_TYPES)})")
    for i in range(L):
        p = f"model.layers.{i}."
        dense += [Tensor(p + "input_layernorm.weight", (H,)), Tensor(p + "post_attention_layernorm.weight", (H,))]
        dense += [Tensor(p + name, shape) for name, shape in attn]
        if i < first_dense:
            dense += [Tensor(p + f"mlp.{n}.weight", s) for n, s in
                      (("gate_proj", (dense_I, H)), ("up_proj", (dense_I, H)), ("down_proj", (H, dense_I)))]
        else:
            router = "block_sparse_moe" if mt == "mixtral" else "mlp"
            dense.append(Tensor(p + f"{router}.gate.weight", (E, H)))
            if shared_I:
                dense += [Tensor(p + f"mlp.shared_expert.{n}.weight", s) for n, s in
                          (("gate_proj", (shared_I, H)), ("up_proj", (shared_I, H)), ("down_proj", (H, shared_I)))]
    return ModelGeometry(
        name=str(g.get("name", "custom")), model_type=mt, num_layers=L, moe_layers=L - first_dense,
        num_experts=E, top_k=K, hidden_size=H, moe_intermediate_size=I, vocab_size=V,
        native_quant={"float32": "fp32"}.get(g.get("dtype"), "bf16"), dense=dense, kv_elems_per_layer=kv_elems,
        source=str(g.get("source", "spec")), routing_skew=g.get("routing_skew"),
        published_total_params=g.get("published_total_params"),
        published_active_params=g.get("published_active_params"), planning_config=dict(g),
    )


def _gqa_attention(g: dict, H: int, nh: int):
    nkv = int(g.get("num_key_value_heads") or nh)
    hd = int(g.get("head_dim") or H // nh)
    shapes = [("self_attn.q_proj.weight", (nh * hd, H)), ("self_attn.k_proj.weight", (nkv * hd, H)),
              ("self_attn.v_proj.weight", (nkv * hd, H)), ("self_attn.o_proj.weight", (H, nh * hd))]
    if g.get("model_type") == "olmoe":  # q/k norm over the whole projection
        shapes += [("self_attn.q_norm.weight", (nh * hd,)), ("self_attn.k_norm.weight", (nkv * hd,))]
    elif g.get("model_type") == "qwen3_moe":  # per-head q/k norm
        shapes += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
    return shapes, 2 * nkv * hd


def _mla_attention(g: dict, H: int, nh: int):
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-5), and GLM-5's sparse-attention indexer.

    The KV cache holds the compressed latent (kv_lora_rank) plus the shared rope key per
    position, not per-head K and V: that is what makes 128K contexts affordable.
    """
    q_lora, kv_lora = int(g["q_lora_rank"]), int(g["kv_lora_rank"])
    nope, rope, v = int(g["qk_nope_head_dim"]), int(g["qk_rope_head_dim"]), int(g["v_head_dim"])
    shapes = [
        ("self_attn.q_a_proj.weight", (q_lora, H)), ("self_attn.q_a_layernorm.weight", (q_lora,)),
        ("self_attn.q_b_proj.weight", (nh * (nope + rope), q_lora)),
        ("self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, H)),
        ("self_attn.kv_a_layernorm.weight", (kv_lora,)),
        ("self_attn.kv_b_proj.weight", (nh * (nope + v), kv_lora)),
        ("self_attn.o_proj.weight", (H, nh * v)),
    ]
    kv = kv_lora + rope
    if g.get("index_n_heads"):  # DeepSeek sparse attention's lightning indexer (GLM-5)
        ih, ihd = int(g["index_n_heads"]), int(g["index_head_dim"])
        shapes += [("self_attn.indexer.wq_b.weight", (ih * ihd, q_lora)), ("self_attn.indexer.wk.weight", (ihd, H)),
                   ("self_attn.indexer.weights_proj.weight", (ih, H))]
        kv += ihd  # the indexer caches one key per position
    return shapes, kv


# --- resolving the --model argument -------------------------------------------------------------

def resolve(model: str) -> ModelGeometry:
    """A model directory, a bundled preset name, or a geometry JSON file."""
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return from_model_dir(path)
    if path.is_file():
        return from_spec(load_geometry_file(path))
    if model in list_presets():
        return from_spec(load_preset(model))
    raise ConfigError(f"--model {model!r} is neither a model directory, a geometry JSON file nor a bundled "
                      f"preset ({', '.join(list_presets())})")
