"""Multi-row ops whose every row gets the bits the one-row op gives it alone (engine/arch/decode_rows.py's
rows: B sequences in one step, or a speculative verify's consecutive positions).

native.linear and the native experts kernels compute each output element alone, whatever the row count.
Without the native kernels, torch's bf16 linear is row-independent too where ATen computes it itself (no
oneDNN bf16 matmul on this CPU: each output one dot product; torch_rows_independent probes it once), and
there the rows' projections and each expert's rows go through one call (a verify of 9 rows had taken
~500 one-row linear calls, 9 plain steps' worth, on an AVX2 box); elsewhere one row at a time.
Transcendental elementwise ops (silu, sigmoid) go per row (per_row): their bits follow the tensor's length.

Shape legend: B rows, H hidden, I expert intermediate.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine import native
from engine.arch.layers import native_quant_operands, native_swiglu, rms_norm_rows, swiglu_expert
from engine.weights.stored import linear


def rows_norm(x: torch.Tensor, weight, eps: float) -> torch.Tensor:
    """rms_norm over the last dim of x [..., R, H] with each row rms_norm's bits on that row alone
    (a one-token bf16 row takes the native op, which normalises each row by itself)."""
    if (native.ready and x.dtype is torch.bfloat16 and type(weight) is torch.Tensor
            and weight.dtype is torch.bfloat16 and x.device.type == "cpu"):
        return native.rms_norm(x, weight, eps)
    return rms_norm_rows(x, weight, eps)


def swiglu_rows(x: torch.Tensor, gate, up, down) -> torch.Tensor:
    """layers.swiglu on x [B, H], each row its one-row bits: native.experts' multi-row form where the
    one row takes native.experts, else row-independent projections and a silu per row."""
    if native_swiglu(x, (gate, up, down)):
        return native.experts_rows(x.contiguous(), [gate, up, down], 3, *_one_expert_slots(x.shape[0]))
    return rows_linear(per_row(F.silu, rows_linear(x, gate)) * rows_linear(x, up), down)


_SLOTS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _one_expert_slots(B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot_row, slot_expert) of one expert on rows 0..B-1, kept per B: a verify makes them for every
    dense MLP and shared expert, and building two small tensors costs as much as the call's own work."""
    slots = _SLOTS.get(B)
    if slots is None:
        slots = _SLOTS[B] = (torch.arange(B), torch.zeros(B, dtype=torch.int64))
    return slots


def per_row(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (a transcendental elementwise op: silu, sigmoid) on each row of x [B, N] alone. torch takes
    a vectorised approximation for most elements and a scalar one for a tail; which elements fall in
    the tail depends on the tensor's length, so a row's bits follow its neighbours unless it goes alone
    (exact ops such as + and * give the same bits either way)."""
    return torch.cat([fn(x[b:b + 1]) for b in range(x.shape[0])])


def shared_gate_rows(x: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    """qwen2_moe's shared-expert gate on each row alone: F.linear as the solo path calls it, and the
    sigmoid (a transcendental op: per_row)."""
    return torch.cat([torch.sigmoid(F.linear(x[b:b + 1], gate_w)) for b in range(x.shape[0])])


def rows_kernel_applies(model, x: torch.Tensor) -> bool:
    """Whether the experts may go through the multi-row native kernels: the solo path's expert is
    swiglu_expert over native kernels (an architecture's own expert function keeps its one-row calls)."""
    return native.ready and model.expert_fn is swiglu_expert and x.device.type == "cpu"


def experts_rows(x: torch.Tensor, experts: list, slots: list[list[tuple[int, int]]]) -> torch.Tensor | None:
    """[S, H]: expert i of `experts` on the rows of slots[i] (in that order, experts in the given order),
    through native.experts_rows / quant_experts_rows, each slot the one-row call's bits; None where
    the weights are not what those kernels take (then the one-row calls)."""
    slot_row, slot_expert = torch.tensor([[b for rows in slots for b, _ in rows],
                                          [i for i, rows in enumerate(slots) for _ in rows]], dtype=torch.int64)
    quantized = native_quant_operands(x[:1], experts)
    if quantized is not None:
        tensors, group = quantized
        return native.quant_experts_rows(x, tensors, group, slot_row, slot_expert)
    per_expert = len(experts[0])
    if (x.dtype is not torch.bfloat16 or any(len(e) != per_expert for e in experts)
            or any(type(t) is not torch.Tensor or t.dtype is not torch.bfloat16 or t.device.type != "cpu"
                   for e in experts for t in e)):
        return None
    return native.experts_rows(x, [t for e in experts for t in e], per_expert, slot_row, slot_expert)


def rows_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H] @ weight.T (+ bias), each row's bits those of the one-row `linear`: native.linear
    computes each output element alone (row-independent) where it runs, and torch's own bf16 linear
    where torch_rows_independent; elsewhere one row at a time, because a multi-row matmul may sum in
    another order than the one-row call."""
    plain = (type(weight) is torch.Tensor and weight.dtype is torch.bfloat16 and x.dtype is torch.bfloat16
             and (bias is None or bias.dtype is torch.bfloat16))
    if plain and native.ready:
        return native.linear(x, weight, bias)
    if plain and x.device.type == "cpu" and weight.device.type == "cpu" and torch_rows_independent():
        return linear(x, weight, bias)
    return torch.cat([linear(x[b:b + 1], weight, bias) for b in range(x.shape[0])])


def torch_expert_rows(model, x: torch.Tensor, weights, rows: list[tuple[int, int]]) -> torch.Tensor | None:
    """Without the native kernels: the expert (swiglu_expert's torch path, plain bf16 weights on the
    CPU) on the rows of `rows` [R, H] in one call per projection where torch_rows_independent, the silu
    per row (per_row: a transcendental op's bits follow the tensor's length) → [R, H]; else None
    (the one-row calls)."""
    if (native.ready or model.expert_fn is not swiglu_expert or x.dtype is not torch.bfloat16
            or x.device.type != "cpu" or not all(type(t) is torch.Tensor and t.dtype is torch.bfloat16
                                                 and t.device.type == "cpu" for t in weights)
            or not torch_rows_independent()):
        return None
    xs = x[[b for b, _ in rows]]  # [R, H]
    if len(weights) == 3:  # layers.swiglu's torch form
        gate, up, down = weights
        return linear(per_row(F.silu, linear(xs, gate)) * linear(xs, up), down)
    gu = F.linear(xs, weights[0])  # [R, 2I]: swiglu_expert's fused form, each row's slice as the solo one
    inter = weights[-1].shape[1]
    return F.linear(per_row(F.silu, gu[:, :inter]) * gu[:, inter:], weights[-1])


@functools.lru_cache(maxsize=1)
def torch_rows_independent() -> bool:
    """Whether torch's bf16 linear gives each row of a multi-row call the bits of that row alone, here.
    Where oneDNN takes bf16 matmuls (AVX-512 BF16, AMX: torch's mkldnn bf16 check) it blocks rows
    together and may sum in another order; ATen's own kernel computes each output element as one dot
    product whatever the row count. Probed once (shapes with vector tails, row counts up to a verify's,
    with and without a bias) rather than assumed from the version."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    g = torch.Generator().manual_seed(0)
    for H, O in ((64, 48), (256, 100), (200, 520)):
        w = torch.randn(O, H, generator=g).to(torch.bfloat16)
        bias = torch.randn(O, generator=g).to(torch.bfloat16)
        for B in (2, 9, 17):
            x = torch.randn(B, H, generator=g).to(torch.bfloat16)
            for b in (None, bias):
                if not torch.equal(F.linear(x, w, b), torch.cat([F.linear(x[i:i + 1], w, b) for i in range(B)])):
                    return False
    return True
