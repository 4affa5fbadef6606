"""What each tensor may be: its dtype by role (tables), its shape from config.json (per model_type).

Dtypes: a routed expert or attention weight stored as I8/U8/BOOL used to be cast to float
silently (garbage logits) or crash in a matmul. Each tensor name maps to a role by the first
matching pattern; each role lists the dtypes it may have. A quantized format adds its own roles
— ahead of the plain ones, and only for checkpoints its `applies(config)` recognises:

    register_role("int8_expert", r"\\.experts\\.\\d+\\.\\w+\\.qweight$", {"I8"},
                  applies=lambda cfg: (cfg.get("quantization_config") or {}).get("format") == "int8")

Shapes: every resident tensor's shape follows from config.json (q_proj is [heads*head_dim,
hidden], ...); a mismatch is one line naming the tensor, both shapes and the fields, instead of
a matmul error deep in the forward pass. The shapes are engine/arch/args.dense_tensors's, the
same formula the parameter counts and the cost model use (every architecture, no per-family table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from engine.arch.args import dense_tensors
from engine.arch.registry import ARCHITECTURES
from engine.base.dtypes import FLOAT_NAMES, TAG_OF
from engine.base.errors import ModelFormatError

FLOATS = frozenset(TAG_OF[name] for name in FLOAT_NAMES)  # F32, BF16, F16


@dataclass(frozen=True)
class TensorRole:
    name: str
    pattern: re.Pattern
    dtypes: frozenset
    applies: Callable[[dict], bool] | None = None  # None: every checkpoint


# First match wins. Order: most specific first; the last one catches every other weight/bias.
_ROLES: list[TensorRole] = []


def register_role(name: str, pattern: str, dtypes, applies: Callable[[dict], bool] | None = None,
                  first: bool = True) -> TensorRole:
    """Add a role. first=True (the default) puts it ahead of the built-in roles, so a format can
    claim tensors (e.g. `*_blocks` U8 for MXFP4) that a generic pattern would otherwise take."""
    role = TensorRole(name, re.compile(pattern), frozenset(dtypes), applies)
    if first:
        _ROLES.insert(0, role)
    else:
        _ROLES.append(role)
    return role


for _name, _pattern in (
        ("routed expert weight", r"\.experts\."),
        ("router weight", r"\.(gate|router)\.weight$"),
        ("attention weight", r"\.self_attn\."),
        ("norm weight", r"norm\.weight$"),
        ("embedding", r"embed_tokens\.weight$"),
        ("output head", r"^lm_head\.weight$"),
        ("MLP weight", r"\.mlp\.|\.shared_expert"),
        ("weight", r"\.(weight|bias)$")):
    register_role(_name, _pattern, FLOATS, first=False)

# An architecture's own stored dtypes (gpt_oss: MXFP4 blocks and scales), for its checkpoints only.
for _arch in ARCHITECTURES:
    for _name, _pattern, _dtypes in _arch.tensor_roles:
        register_role(_name, _pattern, _dtypes,
                      applies=lambda config, types=_arch.model_types: config.get("model_type") in types)


# colibri int8/int4 containers (engine/format/container.py, docs/FORMAT.md): `<name>.qweight` codes
# (int8: I8; int4: U8 nibbles, packed) and `<name>.qscale` BF16 scales. Which of I8/U8 a quant
# level stores, a missing or unknown stamp, and shapes are the container's own checks, made
# where it reads the stamp, so they are not asked of config.json here.
register_role("quantized codes", r"\.qweight$", {"I8", "U8"})


def _is_fp8_checkpoint(config: dict) -> bool:
    qc = config.get("quantization_config")  # typed by config_rules; this may run on any dict
    return isinstance(qc, dict) and qc.get("quant_method") == "fp8"


# FP8 block-scaled checkpoints as published (engine/format/fp8_checkpoint.py): linear weights F8_E4M3 (or kept in
# bf16, as some releases keep a few), and one fp32 scale per block beside each FP8 weight.
register_role("FP8 block scales", r"\.weight_scale_inv$", {"F32", "BF16"}, applies=_is_fp8_checkpoint)
register_role("FP8 linear weight", r"_proj(_with_mqa)?\.weight$|\.indexer\.\w+\.weight$", FLOATS | {"F8_E4M3"},
              applies=_is_fp8_checkpoint)
register_role("quantization scales", r"\.qscale$", {"BF16"})


def role_of(tensor_name: str, config: dict) -> TensorRole | None:
    for role in _ROLES:
        if role.pattern.search(tensor_name) and (role.applies is None or role.applies(config)):
            return role
    return None


def check_dtypes(tensors: dict, config: dict) -> None:
    """Every tensor with a role must have one of that role's dtypes (never a silent cast)."""
    for info in tensors.values():
        role = role_of(info.name, config)
        if role is not None and info.dtype not in role.dtypes:
            raise ModelFormatError(
                f"{info.path}: tensor {info.name!r} ({role.name}) has dtype {info.dtype}; allowed: "
                f"{', '.join(sorted(role.dtypes))} (no silent cast from integer or bool)")


# --- shapes ----------------------------------------------------------------------------------------

def check_shapes(checkpoint, args, names) -> None:
    """Each listed tensor exists and has the shape config.json implies."""
    implied = dense_tensors(args)
    for name in names:
        info = checkpoint.info(name)
        expected = implied.get(name)
        if expected is not None and tuple(info.shape) != tuple(expected):
            raise ModelFormatError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(expected)} "
                f"(hidden {args.hidden_size}, heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim})")
