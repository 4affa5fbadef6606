"""Every architecture the engine runs, listed once: config.json → its `Architecture` record
(engine/arch/architecture.py), ModelArgs and the validation of its fields.

Adding an architecture is one module under engine/arch/families/ (its record) and its line in
ARCHITECTURES below; docs/ARCHITECTURE.md has the recipe.
"""

from __future__ import annotations

from typing import Any

from engine.arch.architecture import Architecture
from engine.arch.args import ModelArgs, common_fields
from engine.arch.config_rules import config_problems, short_repr
from engine.arch.families.deepseek_v3 import DEEPSEEK_V3
from engine.arch.families.dense import DENSE_LLAMA
from engine.arch.families.glm4_moe import GLM4_MOE
from engine.arch.families.glm_moe_dsa import GLM_MOE_DSA
from engine.arch.families.gpt_oss import GPT_OSS
from engine.arch.families.mixtral import MIXTRAL
from engine.arch.families.olmoe import OLMOE
from engine.arch.families.qwen2_moe import QWEN2_MOE
from engine.arch.families.qwen3_moe import QWEN3_MOE
from engine.base.errors import ModelFormatError, UnsupportedModelError


ARCHITECTURES: tuple[Architecture, ...] = (
    QWEN3_MOE,
    QWEN2_MOE,
    MIXTRAL,
    OLMOE,
    DEEPSEEK_V3,
    GLM4_MOE,
    GLM_MOE_DSA,
    GPT_OSS,
    DENSE_LLAMA,
)

BY_TYPE: dict[str, Architecture] = {t: a for a in ARCHITECTURES for t in a.model_types}
SUPPORTED_TYPES: tuple[str, ...] = tuple(BY_TYPE)
# Each model_type's config.json rules (engine/arch/config_rules.py).
RULES: dict[str, tuple] = {t: tuple(a.rules(t)) for t, a in BY_TYPE.items()}
# The model_types `colibri synth` can write.
SYNTH_TYPES: tuple[str, ...] = tuple(t for t, a in BY_TYPE.items() if a.synth is not None)
# GGUF `general.architecture` → the record `colibri convert model.gguf` imports it as.
BY_GGUF_ARCH: dict[str, Architecture] = {a.gguf.arch: a for a in ARCHITECTURES if a.gguf is not None}


def _unsupported(model_type: Any) -> UnsupportedModelError:
    return UnsupportedModelError(f"model_type {short_repr(model_type)} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_TYPES)})")


def architecture(model_type: Any) -> Architecture:
    arch = BY_TYPE.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise _unsupported(model_type)
    return arch


def model_args(cfg: dict) -> ModelArgs:
    """config.json (validated or not) → ModelArgs; a missing or bad field is one ModelFormatError line."""
    model_type = cfg.get("model_type")
    if model_type not in BY_TYPE:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    try:
        return BY_TYPE[model_type].parse(model_type, cfg, common_fields(model_type, cfg))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"config.json for {model_type} is missing or has a bad field: {exc}") from None


def validate_config(cfg: Any, source: str = "config.json") -> None:
    """Raise one ModelFormatError line for the first problem (with how many more there are)."""
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{source}: not a JSON object")
    model_type = cfg.get("model_type")
    rules = RULES.get(model_type) if isinstance(model_type, str) else None
    if rules is None:
        raise _unsupported(model_type)
    problems = config_problems(cfg, rules)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ModelFormatError(f"{source}: {problems[0].line()}{more}")
