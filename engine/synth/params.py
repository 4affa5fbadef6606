"""Parameter counts of any geometry by role, from its config.json-like keys: arithmetic over the
tensors' shapes, one at a time, nothing allocated, so it can bound a geometry's size before
anything else looks at it.

The sizes are the architecture's own (engine/arch/registry.model_args parses the geometry as the
config.json it is; engine/arch/args.dense_tensors gives every resident tensor's shape, the
ModelArgs one expert's size), so a new architecture in the registry is counted with no formula here.
"""

from __future__ import annotations

import math

from engine.arch.args import iter_dense_tensors
from engine.arch.registry import model_args
from engine.base.errors import ConfigError, ModelFormatError


def param_counts(geometry: dict) -> dict:
    """Parameter counts by role, for every architecture the registry parses.

    Returns total, active (per token), routed_expert (one expert), routed_total, dense (everything
    that is not a routed expert: the part a streaming engine keeps resident), num_moe_layers,
    num_experts, top_k. Multi-token-prediction layers are not counted (inference skips them).
    """
    g = geometry
    try:
        args = model_args({"model_type": "qwen3_moe", **g})  # synth's default architecture
    except ModelFormatError as exc:  # a geometry is a file the user wrote, not a model's config.json
        raise ConfigError(str(exc)) from None
    if not args.num_experts:
        raise ConfigError(f"{g.get('name', args.model_type)}: geometry has no expert count")
    expert = args.expert_numel  # gpt_oss experts carry biases
    moe_layers = sum(args.moe_layer_flags)
    resident = sum(math.prod(shape) for _, shape in iter_dense_tensors(args))  # one at a time: nothing held
    routed_total = moe_layers * args.num_experts * expert
    return {
        "total": resident + routed_total,
        "active": resident + moe_layers * args.top_k * expert,
        "routed_expert": expert,
        "routed_total": routed_total,
        "dense": resident,
        "num_moe_layers": moe_layers,
        "num_experts": args.num_experts,
        "top_k": args.top_k,
    }
