"""Model geometry for the cost model: a model directory, or a bundled geometry-only spec.

What the cost model needs from a model is its tensor sizes, not its bytes: how many parameters
stay resident (attention, norms, embeddings, shared experts, dense layers), how big one routed
expert is, how many routed experts there are and how many a token uses, and how big the KV
cache is per position. A model directory gives these exactly from its safetensors headers; a
spec (engine/presets/*.json, a config.json-like dict) gives them from the shapes the engine itself
implies for that config (engine/arch/args.dense_tensors: one formula for every architecture in the
registry, multi-head latent attention included), so a spec plans what the engine would load.

Quant levels are bytes per weight, scale overhead included:
  bf16  2 bytes;  fp32  4 bytes;
  int8  1 byte + one bf16 scale per output row (2 / K bytes per weight);
  fp8   1 byte + one fp32 scale per 128x128 block (4 / 16384 bytes per weight): the published
        FP8 e4m3 checkpoints (DeepSeek-V3/R1, Kimi-K2, GLM/Qwen3 FP8; engine/weights/fp8.py);
  int4  half a byte + a bf16 scale and a bf16 zero per group of 64 (4 / 64 bytes per weight),
        the layout of torch's _weight_int4pack_mm (scales_and_zeros [K/group, N, 2]).
These are engine/weights/quantized.py's containers (int8 per row, int4 group 64 by default) with scope
"all": every matrix quantized, embeddings included, as Colibrì keeps GLM-5's dense part at
int4; norms (1-D) stay in bf16.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.api import (Checkpoint, ConfigError, ModelFormatError, check_geometry, checkpoint_dtype, container_spec,
                        dense_quantized, dense_tensor_names, dense_tensors, list_presets, load_geometry_file,
                        load_preset, model_args, printable)

INT4_GROUP = 64
QUANTS = ("bf16", "fp32", "fp8", "int8", "int4")
FP8_BLOCK = 128 * 128
FP8_QUANTIZED = re.compile(r"_proj(_with_mqa)?\.weight$")  # the projections FP8 releases store in e4m3


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
        native = "fp8"  # as published: the engine keeps the FP8 bytes (engine/weights/fp8.py)
    synth = ckpt.config.get("colibri_synth") or {}
    return ModelGeometry(
        name=Path(model_dir).name, model_type=args.model_type, num_layers=args.num_layers,
        moe_layers=sum(args.moe_layer_flags), num_experts=args.num_experts, top_k=args.top_k,
        hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size,
        vocab_size=args.vocab_size, native_quant=native, dense=dense,
        source=str(model_dir),
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
    # The geometry is the config.json it describes (synth's default architecture when it names
    # none): the registry parses it, and the resident tensors' shapes are the engine's own
    # (engine/arch/args.dense_tensors), so every architecture the engine runs is planned alike.
    config = {"model_type": "qwen3_moe", **g}
    try:
        args = model_args(config)
    except ModelFormatError as exc:  # a geometry is a file the user wrote, not a model's config.json
        raise ConfigError(str(exc)) from None
    if not args.num_experts:
        raise ConfigError(f"geometry {g.get('name', '?')!r}: model_type {args.model_type} has no routed experts")
    dense = [Tensor(name, shape) for name, shape in dense_tensors(args).items()]
    return ModelGeometry(
        name=str(g.get("name", "custom")), model_type=args.model_type, num_layers=args.num_layers,
        moe_layers=sum(args.moe_layer_flags), num_experts=args.num_experts, top_k=args.top_k,
        hidden_size=args.hidden_size, moe_intermediate_size=args.moe_intermediate_size, vocab_size=args.vocab_size,
        native_quant={"float32": "fp32"}.get(g.get("dtype"), "bf16"), dense=dense,
        source=str(g.get("source", "spec")), routing_skew=g.get("routing_skew"),
        published_total_params=g.get("published_total_params"),
        published_active_params=g.get("published_active_params"), planning_config=config,
    )


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
