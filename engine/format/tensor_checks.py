"""What each tensor may be: its dtype by role (tables), its shape from config.json (per model_type).

Dtypes: a routed expert or attention weight stored as I8/U8/BOOL used to be cast to float
silently (garbage logits) or crash in a matmul. Each tensor name maps to a role by the first
matching pattern; each role lists the dtypes it may have. A quantized format adds its own roles
— ahead of the plain ones, and only for checkpoints its `applies(config)` recognises:

    register_role("int8_expert", r"\\.experts\\.\\d+\\.\\w+\\.qweight$", {"I8"},
                  applies=lambda cfg: (cfg.get("quantization_config") or {}).get("format") == "int8")

Shapes: every resident tensor's shape follows from config.json (q_proj is [heads*head_dim,
hidden], ...); a mismatch is one line naming the tensor, both shapes and the fields, instead of
a matmul error deep in the forward pass. Per model_type, a function name → expected shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

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

# gpt_oss checkpoints as published: MXFP4 experts are uint8 blocks and scales (engine/arch/gptoss.py).
register_role("MXFP4 expert blocks/scales", r"\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales)$", {"U8"},
              applies=lambda config: config.get("model_type") == "gpt_oss")


# colibri int8/int4 containers (engine/format/container.py, docs/FORMAT.md): `<name>.qweight` codes
# (int8: I8; int4: U8 nibbles, packed) and `<name>.qscale` BF16 scales. Which of I8/U8 a quant
# level stores, a missing or unknown stamp, and shapes are the container's own checks, made
# where it reads the stamp, so they are not asked of config.json here.
register_role("quantized codes", r"\.qweight$", {"I8", "U8"})
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

def llama_family_shape(args, name: str) -> tuple[int, ...] | None:
    """Expected shape of a resident tensor in the llama / qwen / mixtral / olmoe layouts (None: not known)."""
    H, D, V = args.hidden_size, args.head_dim, args.vocab_size
    q, kv = args.num_heads * D, args.num_kv_heads * D
    I, E, Is = args.intermediate_size, args.num_experts, args.shared_expert_intermediate_size
    norm_q, norm_k = ((D,), (D,)) if args.qk_norm == "head" else ((q,), (kv,))
    table = {
        "embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,),
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,), "self_attn.q_norm.weight": norm_q, "self_attn.k_norm.weight": norm_k,
        f"{args.moe_prefix}.gate.weight": (E, H),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mlp.shared_expert.gate_proj.weight": (Is, H), "mlp.shared_expert.up_proj.weight": (Is, H),
        "mlp.shared_expert.down_proj.weight": (H, Is), "mlp.shared_expert_gate.weight": (1, H),
    }
    # "model.layers.3.self_attn.q_proj.weight" → "self_attn.q_proj.weight"; top-level names as they are.
    m = re.match(r"^model\.layers\.\d+\.(.+)$", name)
    key = m.group(1) if m else name.removeprefix("model.")
    return table.get(key)


SHAPES: dict[str, Callable] = {t: llama_family_shape for t in
                               ("llama", "qwen2", "qwen3", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")}


def register_shapes(model_type: str, expected: Callable) -> None:
    """expected(args, tensor_name) → the shape config.json implies, or None when it has no opinion."""
    SHAPES[model_type] = expected


def check_shapes(checkpoint, args, names) -> None:
    """Each listed tensor exists and has the shape config.json implies."""
    expected_of = SHAPES.get(args.model_type)
    for name in names:
        info = checkpoint.info(name)
        expected = expected_of(args, name) if expected_of else None
        if expected is not None and tuple(info.shape) != tuple(expected):
            raise ModelFormatError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)}, config.json implies {list(expected)} "
                f"(hidden {args.hidden_size}, heads {args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim})")
