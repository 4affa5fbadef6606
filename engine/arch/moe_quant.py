"""The fused decode of an MoE layer whose experts are resident int8 / int4 weights: one native call
(engine/native/moe_decode_int.cpp) for the norm, router, top-k, the K experts, the weighted sum and
the residual add, the quantized twin of moe.ResidentMoeLayer.

It applies where the unfused decode would run the native batched experts op (every expert three
QuantWeights of one kind that `QuantWeight.native_decode` accepts for a bf16 token: VNNI/VBMI
present, the stored layout, int8 only while COLIBRI_NATIVE_INT8 allows it, decided when the layer is
first built) with bf16 scales; the op is made of the same kernels as that path, so the two give the
same bits (tests/test_native_int.py).
"""

from __future__ import annotations

import torch

from engine import native
from engine.arch.layers import native_quant_operands
from engine.arch.router import trim_operands
from engine.weights.quantized import QuantWeight


class ResidentQuantMoeLayer:
    """h [1, H] -> h + moe(rms_norm(h)) [1, H] for int8 (group 0) / int4 experts.

    The op reads each chosen expert through a table of addresses (int64 [E, 6]: gate, up, down codes
    and scales), built once here from the store's tensors, which this object holds so the addresses
    stay valid for its lifetime (ResidentExperts keeps them too)."""

    def __init__(self, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, top_k: int, norm_topk: bool,
                 experts: list[tuple], group: int):
        self.norm_w, self.eps, self.router_w = norm_w, float(eps), router_w
        self.top_k, self.norm_topk, self.group = int(top_k), bool(norm_topk), int(group)
        self.inter = experts[0][0].shape[0]
        self._tensors = experts  # what the addresses point into
        self.table = torch.tensor([[t.data_ptr() for w in expert for t in (w.qweight, w.qscale)] for expert in experts],
                                  dtype=torch.int64)  # [E, 6]

    def __call__(self, h: torch.Tensor, trim=None) -> torch.Tensor:
        """trim: a RoutingTrim the op applies, as moe.ResidentMoeLayer's, or None."""
        return native.moe_layer_int(h, self.norm_w, self.eps, self.router_w, self.top_k, self.norm_topk,
                                    self.table, self.inter, self.group, *trim_operands(trim))


def resident_layer(norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, top_k: int, norm_topk: bool,
                   held: list) -> ResidentQuantMoeLayer | None:
    """The fused layer for these resident experts (one tuple of weights per expert, every expert of
    the layer), or None where they are not quantized experts the native op takes."""
    if not native.int_ready or type(held[0][0]) is not QuantWeight:
        return None
    H = router_w.shape[1]
    operands = native_quant_operands(torch.empty(1, H, dtype=torch.bfloat16), held)
    if operands is None:
        return None
    _, group = operands
    inter = held[0][0].shape[0]
    for gate, up, down in held:  # native_quant_operands checked: three QuantWeights of one kind each
        if (gate.shape != (inter, H) or up.shape != (inter, H) or down.shape != (H, inter)
                or any(w.qscale.dtype is not torch.bfloat16 or not w.qscale.is_contiguous()
                       or not w.qweight.is_contiguous() for w in (gate, up, down))):
            return None
    if group and (H % group or inter % group or H % 2 or inter % 2):
        return None
    return ResidentQuantMoeLayer(norm_w, eps, router_w, top_k, norm_topk, held, group)
