"""The routed experts of one MoE layer: each token's top-k experts, weighted and summed.

Shape legend: T tokens, H hidden, K experts per token (top-k), E distinct experts in the call.

Both paths compute experts in whatever order the store delivers them (hits first, misses as
they land) but sum them in ascending expert order: the sum is then the same bit for bit in
every placement, which the placement-invariance tests rely on.

Decode (T == 1) has a batched form: when the store holds every selected expert in RAM
(`ExpertStore.resident`) and the native kernels are loaded (bf16, or int8/int4 where the CPU has
VNNI and VBMI), the layer's K experts run in one call (engine/native: gate/up/down rows of all K experts spread over the threads, no
per-expert Python). Each expert's output is computed exactly as the per-expert call computes
it, so the batched and the per-expert (streaming) paths give the same bits.
"""

from __future__ import annotations

import torch

from engine import native
from engine.arch.layers import native_quant_operands, swiglu_expert


def routed_decode(store, expert_fn, layer: int, x: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """One token: x [1, H], ids/weights [1, K] → [1, H]; one [1,K] x [K,H] product sums the experts."""
    sorted_ids, order = torch.sort(ids[0])
    needed = sorted_ids.tolist()
    ys = _batched_decode(store, expert_fn, layer, x, needed)
    if ys is None:
        position = {e: j for j, e in enumerate(needed)}
        outs: list = [None] * len(needed)

        def run(e, expert_weights):
            outs[position[e]] = expert_fn(x, expert_weights)

        store.for_each_expert(layer, needed, run)
        ys = torch.cat(outs)  # [K, H]
    return torch.mm(weights[0, order][None], ys)  # [1, H]


def _batched_decode(store, expert_fn, layer: int, x: torch.Tensor, needed: list[int]) -> torch.Tensor | None:
    """[K, H] from one native call, or None where that does not apply (then: per expert)."""
    if not native.ready or expert_fn is not swiglu_expert:
        return None
    held = store.resident(layer, needed)
    if held is None:
        return None  # streaming store: the per-expert path
    quantized = native_quant_operands(x, held)
    if quantized is not None:  # int8/int4 experts: one native call, as swiglu_expert makes per expert
        return native.quant_experts(x, *quantized)
    if type(held[0][0]) is not torch.Tensor or held[0][-1].device != x.device or x.dtype is not torch.bfloat16:
        return None  # other formats or the VRAM tier: the per-expert path
    per_expert = len(held[0])
    return native.experts(x, [t for expert in held for t in expert], per_expert)


def routed_prefill(store, expert_fn, layer: int, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Several tokens: x [T, H] → [T, H]; each expert gets the rows routed to it (one sort groups them)."""
    K = ids.shape[1]
    flat = ids.flatten()
    if bool((flat < 0).any()):  # slots the routing threshold skipped (id -1): routed nowhere
        slots = torch.nonzero(flat >= 0).squeeze(1)
        sorted_ids, order = torch.sort(flat[slots], stable=True)
        order = slots[order]
    else:
        sorted_ids, order = torch.sort(flat, stable=True)  # [T*K], grouped by expert
    experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    needed, counts = experts.tolist(), counts.tolist()
    starts = [0] * len(counts)
    for j in range(1, len(counts)):
        starts[j] = starts[j - 1] + counts[j - 1]
    position = {e: j for j, e in enumerate(needed)}
    token_of = order // K  # the row of x each routed slot belongs to
    slot_weight = weights.flatten()[order, None]
    ys: list = [None] * len(needed)

    def run(e, expert_weights):
        j = position[e]
        rows = slice(starts[j], starts[j] + counts[j])
        ys[j] = expert_fn(x[token_of[rows]], expert_weights) * slot_weight[rows]

    store.for_each_expert(layer, needed, run)
    return torch.zeros_like(x).index_add_(0, token_of, torch.cat(ys))
