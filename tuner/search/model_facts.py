"""What the tuner knows about the model before any trial: its geometry, how it is stored, and the
engine's own memory plan for a config (the pre-check that spares a trial process).

The first step of the search's one-way flow: model facts → search space (space.py) → trial
(trial.py) → study (study.py) → report. The checkpoint index, model args, expert layout and
compute dtype are read once, here; the space asks `plan(config, overhead)` for every proposal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.api import (Checkpoint, EngineConfig, ExpertLayout, MemoryPlan, checkpoint_dtype, container_spec,
                        kv_storage, make_plan, model_args, short_name)


def stored_quant(ckpt: Checkpoint) -> str:
    """'int8' / 'int4-g64' for a quantized container, else the stored float dtype's short name."""
    spec = container_spec(ckpt)
    return spec.label if spec is not None else short_name(checkpoint_dtype(ckpt))


def compute_dtype(ckpt: Checkpoint) -> torch.dtype:
    """The dtype the engine computes this checkpoint in. Same rule as Engine._compute_dtype: fp16
    matmuls are slow on CPU, so fp16 weights are computed in fp32."""
    dtype = checkpoint_dtype(ckpt)
    return torch.float32 if dtype == torch.float16 else dtype


@dataclass
class ModelFacts:
    """What the space and the pre-check need from the checkpoint, read once."""

    model_dir: Path
    geometry: dict
    has_experts: bool
    max_position_embeddings: int
    quant: str = "bf16"  # the weights as stored: a container's label (int8, int4-g64) or the dtype (bf16)
    # The engine plan's inputs (checkpoint, model args, expert layout, compute dtype), kept from read().
    _plan_inputs: tuple | None = field(default=None, repr=False, compare=False)

    @classmethod
    def read(cls, model_dir) -> "ModelFacts":
        ckpt = Checkpoint(model_dir)
        args = model_args(ckpt.config)
        geometry = {
            "model_type": args.model_type, "layers": args.num_layers, "hidden_size": args.hidden_size,
            "experts": args.num_experts, "top_k": args.top_k, "moe_intermediate_size": args.moe_intermediate_size,
            "vocab_size": args.vocab_size, "total_bytes_on_disk": ckpt.nbytes(),
        }
        layout = ExpertLayout(ckpt, args) if args.is_moe else None
        return cls(Path(model_dir), geometry, args.is_moe, args.max_position_embeddings, stored_quant(ckpt),
                   (ckpt, args, layout, compute_dtype(ckpt)))

    @property
    def dtype(self) -> torch.dtype:
        return self._plan_inputs[3]

    def plan(self, config: EngineConfig, overhead_bytes: int) -> MemoryPlan:
        """The engine's memory plan for `config` (engine/movement/plan.py), without loading a
        weight; raises BudgetError where the config's fixed parts exceed its budget."""
        ckpt, args, layout, dtype = self._plan_inputs
        return make_plan(ckpt, args, layout, config, dtype, kv_storage(config.kv_dtype, dtype),
                         overhead_bytes=overhead_bytes)
