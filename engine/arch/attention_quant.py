"""The native attention decode of a layer whose q/k/v/o projections are int8 / int4 QuantWeights (a
`--scope all` container): whether a layer qualifies, and its operands for
engine/native/attention_decode_int.cpp (one layer) and decode_step_int.cpp (every layer of a step).

A layer qualifies where the bf16 native attention would cover its shape (plain attention, no
clipping, no norm or a per-head one, rope over the whole head, bf16 norms) and its four projections
are QuantWeights of one kind that the int linear op itself would take for a bf16 token
(`QuantWeight.native_decode`: VNNI/VBMI present, the stored layout, int8 only while
COLIBRI_NATIVE_INT8 allows it), without biases, decided once per layer as the fused MoE layer is
(engine/arch/moe_quant.py). The op's projections are that op's bits (tests/test_native_attention_int.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.arch.args import ModelArgs, layer_prefix
from engine.weights.quantized import QuantWeight

_PROBE = torch.empty(1, 1, dtype=torch.bfloat16)  # what native_decode asks of x: one bf16 row on the CPU


@dataclass(frozen=True)
class QuantAttention:
    """A layer's operands: its norms (bf16; empty q/k norms = none) and its projections' codes and
    scales, q, k, v, o (8 tensors, the QuantWeights' own), group 0 = int8, else int4's group."""

    norm_w: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    proj: list
    group: int


def layer_operands(args: ModelArgs, w: dict, layer: int) -> QuantAttention | None:
    """The layer's QuantAttention, or None where the native int attention does not cover it."""
    a, p = args, layer_prefix(layer)
    if (a.attention_impl is not None or a.clip_qkv is not None or a.qk_norm not in ("none", "head")
            or a.head_dim % 2 or (a.rotary_dim or a.head_dim) != a.head_dim):
        return None
    names = [f"{p}.self_attn.{n}_proj" for n in "qkvo"]
    mats = [w.get(f"{n}.weight") for n in names]
    if any(f"{n}.bias" in w for n in names) or not _one_native_kind(mats):
        return None
    H, D = a.hidden_size, a.head_dim
    Q, KV = a.num_heads * D, a.num_kv_heads * D
    if [m.shape for m in mats] != [(Q, H), (KV, H), (KV, H), (H, Q)]:
        return None
    group = mats[0].group_size if mats[0].quant == "int4" else 0
    if group and any(k % group or n % 2 for n, k in (m.shape for m in mats)):
        return None
    norm_names = [f"{p}.input_layernorm.weight"]
    if a.qk_norm == "head":
        norm_names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    norms = [w.get(n) for n in norm_names]
    if not all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu"
               for t in norms):
        return None
    none = torch.empty(0, dtype=torch.bfloat16)
    norm_w, q_norm, k_norm = (norms + [none, none])[:3]
    return QuantAttention(norm_w, q_norm, k_norm, [t for m in mats for t in (m.qweight, m.qscale)], group)


def _one_native_kind(mats: list) -> bool:
    first = mats[0]
    if type(first) is not QuantWeight or not first.native_decode(_PROBE):
        return False
    return all(type(m) is QuantWeight and m.quant == first.quant and m.group_size == first.group_size
               and m.kernel == first.kernel and m.qweight.device.type == "cpu" and m.qweight.is_contiguous()
               and m.qscale.is_contiguous() and m.qscale.dtype in (torch.bfloat16, torch.float32) for m in mats)
