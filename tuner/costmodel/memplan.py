"""The memory plan of a (geometry, quant, config): the engine's own `make_plan`, fed sizes.

The engine plans from a Checkpoint, its ModelArgs and an ExpertLayout. For a model directory at
its own dtype those are the real objects, so the prediction is exactly what the engine will
decide. For a geometry-only spec, or a quant level the directory is not stored in, no files
exist; this module hands `make_plan` stand-ins that answer the same questions (a tensor's
shape, an expert's on-disk size) from the geometry, so the placement arithmetic is still the
engine's and changes there reach the predictions without edits here.

`make_plan` counts resident bytes as elements × the compute dtype's size. A quantized tensor is
not a whole number of bf16 elements, so the stand-in checkpoint reports each tensor as a 1-D
tensor of (its stored bytes / 2) bf16 elements, and the stand-in args carry an expert width
that makes `3 × H × I × 2` equal the quantized expert's bytes. Every figure the plan prints is
then in stored bytes, which is what the engine keeps in RAM for a quantized container.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from engine.api import (BudgetError, Checkpoint, EngineConfig, ExpertLayout, MemoryPlan, align_up, checkpoint_dtype,
                        dense_tensor_names, kv_storage, make_plan, model_args, plan_drafting)
from tuner.costmodel.model_geometry import ModelGeometry

BF16 = 2  # bytes per element of the stand-in checkpoint's dtype


@dataclass(frozen=True)
class _Info:
    shape: tuple
    nbytes: int


class _SizedCheckpoint:
    """Answers `info(name)` for the resident tensors, in bf16-element units of stored bytes.

    A tensor the plan never asks for (MLA's projections, planned under qwen2_moe names) is
    charged to a tensor of the same layer that it does ask for, so no resident byte is lost and
    per-layer sums (layer streaming) stay right.
    """

    def __init__(self, geometry: ModelGeometry, quant: str, asked: set[str]):
        self._sizes: dict[str, float] = {}
        for t in geometry.dense:
            name = t.name if t.name in asked else _host(t.name)
            self._sizes[name] = self._sizes.get(name, 0.0) + t.nbytes(quant)

    def __contains__(self, name: str) -> bool:
        # Every resident tensor is "stored plain" here: its quantized size is already its size.
        return True

    def info(self, name: str) -> _Info:
        # A name the geometry does not list (an architecture's optional tensor) holds nothing.
        nbytes = self._sizes.get(name, 0.0)
        return _Info((nbytes / BF16,), int(nbytes))


def _host(name: str) -> str:
    parts = name.split(".")
    if len(parts) > 3 and parts[1] == "layers":
        return f"model.layers.{parts[2]}.input_layernorm.weight"
    return "model.norm.weight"


@dataclass(frozen=True)
class _SizedLayout:
    num_routed: int
    expert_nbytes: float
    # For engine code that sizes a cached expert from the layout (a plain expert: 3·H·I in the
    # compute dtype, with the stand-in width): the planning args and one plain location.
    args: object = None
    quant: None = None

    def zero_copy(self, dtype) -> bool:
        return True  # the stand-in width makes the stored size the compute size (see _stand_ins)

    def slot_bytes(self, direct: bool) -> int:
        """One span per expert: page-rounded, plus an O_DIRECT window's two edge pages."""
        return align_up(int(math.ceil(self.expert_nbytes))) + (2 * 4096 if direct else 0)

    @property
    def _locations(self) -> dict:
        from types import SimpleNamespace
        return {(0, 0): SimpleNamespace(quant=None)}


def planning_args(geometry: ModelGeometry):
    """ModelArgs the plan walks (tensor names, KV shape, top-k): the geometry's config.json parsed by
    the registry, as the engine parses it (every architecture in it, MLA included)."""
    return model_args(geometry.planning_config)


def plan_memory(geometry: ModelGeometry, quant: str, config: EngineConfig, overhead_bytes: int) -> MemoryPlan:
    """The engine's memory plan; raises BudgetError exactly when the engine would refuse."""
    if geometry.model_dir is not None and quant == geometry.native_quant:
        return _native_plan(geometry, config, overhead_bytes)
    ckpt, args, layout = _stand_ins(geometry, quant)
    kv_dtype = _kv_dtype(config, torch.bfloat16)
    return make_plan(ckpt, args, layout, config, torch.bfloat16, kv_dtype, overhead_bytes=overhead_bytes)


def _stand_ins(geometry: ModelGeometry, quant: str):
    """(checkpoint, args, layout) stand-ins for make_plan, built once per geometry and quant."""
    key = ("stand_ins", quant)
    if key not in geometry.memo:
        args = planning_args(geometry)
        expert = geometry.expert_bytes(quant)
        # The expert width that makes make_plan's 3·H·I·bf16 the stored size: no conversion copy.
        args = dataclasses.replace(args, moe_intermediate_size=expert / (3 * geometry.hidden_size * BF16))
        layout = _SizedLayout(geometry.routed_experts, expert, args) if geometry.routed_experts else None
        geometry.memo[key] = (_SizedCheckpoint(geometry, quant, set(dense_tensor_names(args))), args, layout)
    return geometry.memo[key]


def _native_plan(geometry: ModelGeometry, config: EngineConfig, overhead_bytes: int) -> MemoryPlan:
    model_dir = str(geometry.model_dir)
    ckpt, args, layout, dtype = _native_inputs(model_dir)
    kv_dtype = _kv_dtype(config, dtype)

    def make(layout_args, mtp_bytes):  # (with the MTP layer drafting: its experts as the layout's layer L)
        over = layout if layout_args is args else _layout_over(model_dir, layout_args)
        return make_plan(ckpt, args, over, config, dtype, kv_dtype, overhead_bytes=overhead_bytes, mtp_bytes=mtp_bytes)

    return plan_drafting(ckpt, args, config, dtype, kv_dtype, make)[0]  # as Engine plans, MTP layer and all


_MTP_LAYOUTS: dict[str, ExpertLayout] = {}


def _layout_over(model_dir: str, layout_args) -> ExpertLayout:
    """The expert layout over the model and its MTP layer (its experts are the layout's layer L), made
    once per directory (a search plans thousands of configs; the layer is the same for all)."""
    if model_dir not in _MTP_LAYOUTS:
        _MTP_LAYOUTS[model_dir] = ExpertLayout(_native_inputs(model_dir)[0], layout_args)
    return _MTP_LAYOUTS[model_dir]


@lru_cache(maxsize=8)
def _native_inputs(model_dir: str):
    """The engine's plan inputs for a directory, parsed once (a search plans thousands of configs)."""
    ckpt = Checkpoint(model_dir)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args) if args.is_moe else None
    dtype = checkpoint_dtype(ckpt)
    dtype = torch.float32 if dtype == torch.float16 else dtype  # the engine's rule: no fp16 CPU matmuls
    return ckpt, args, layout, dtype


def _kv_dtype(config: EngineConfig, compute: torch.dtype):
    return kv_storage(config.kv_dtype, compute)  # a torch dtype, or "int8" / "fp8"


def fits(geometry: ModelGeometry, quant: str, config: EngineConfig, overhead_bytes: int) -> bool:
    try:
        plan_memory(geometry, quant, config, overhead_bytes)
    except BudgetError:
        return False
    return True
