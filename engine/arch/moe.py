"""The routed experts of one MoE layer: each token's top-k experts, weighted and summed.

Shape legend: T tokens, H hidden, K experts per token (top-k), E distinct experts in the call.

Every path sums each token's experts in ascending expert order: the sum is then the same bit for
bit in every placement, which the placement-invariance tests rely on. Decode and routed_prefill
compute the experts in whatever order the store delivers them (hits first, misses as they land)
and sum afterwards; routed_group (a layer-major prefill's whole group) adds each expert's rows
into the group's output as it computes them, so it asks the store for them in ascending order.

Decode (T == 1) has a batched form: when the store holds every selected expert in RAM
(`ExpertStore.resident`) and the native kernels are loaded (bf16, or int8/int4 where the CPU has
VNNI and VBMI), the layer's K experts run in one call (engine/native: gate/up/down rows of all K experts spread over the threads, no
per-expert Python). Each expert's output is computed exactly as the per-expert call computes
it, so the batched and the per-expert (streaming) paths give the same bits.

With every expert of the layer resident in bf16 and the softmax top-k rule, the whole layer (its
norm, router, top-k, the K experts, the weighted sum, the residual add) is one native call instead
(ResidentMoeLayer, engine/native/moe_decode.cpp); the unfused decode path calls the same pieces as
separate native ops (layers.rms_norm, layers.route, native.combine), so the two give the same bits.
A routing trim (router.RoutingTrim) runs inside the call too (moe_kernels.h trim_experts), with
apply's experts and weights bit for bit.
"""


from __future__ import annotations

import torch

from engine import native
from engine.arch.args import ModelArgs, layer_prefix
from engine.arch import moe_quant
from engine.arch.router import trim_operands
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
    chosen = weights[0, order]  # [K], ascending expert id as ys
    if native.ready and ys.dtype is torch.bfloat16 and chosen.dtype is torch.bfloat16:
        return native.combine(ys, chosen)  # [1, H]; the sum the fused layer (ResidentMoeLayer) makes
    return torch.mm(chosen[None], ys)  # [1, H]


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
    """Several tokens: x [T, H] → [T, H]; each expert gets the rows routed to it (one sort groups them).

    Each routed slot's weighted output lands in its place of one [T*K, H] buffer in ascending expert
    order whatever order the store delivers the experts in; one index_add then sums each token's
    slots in that order (in fp32 for a bf16 or fp16 x: index_add's own accumulation), so every
    placement gives the same bits. routed_group is the same sum without the buffer."""
    slots = _Slots(ids, weights)
    ys = torch.empty(slots.n, x.shape[1], dtype=x.dtype)  # [routed slots, H]

    def run(e, expert_weights):
        for rows in slots.calls(e, None):
            ys[rows] = expert_fn(x[slots.token_of[rows]], expert_weights) * slots.weight[rows]

    store.for_each_expert(layer, slots.needed, run)
    return torch.zeros_like(x).index_add_(0, slots.token_of, ys)


def routed_group(store, expert_fn, layer: int, inputs, ids: torch.Tensor, weights: torch.Tensor,
                 max_rows: int, acc: torch.Tensor, dtype: torch.dtype) -> None:
    """A layer-major prefill's group (engine/arch/prefill.py): acc [T, H] ← each token's weighted
    routed slots summed, bit for bit routed_prefill's sum before its rounding to `dtype`.

    inputs(token_rows [n]) → the MoE's input rows [n, H] (the group's norm: held where the plan has room
    for it, else made per call).
    An expert's rows go through it in calls of at most max_rows, so the [rows, I] transients stay
    bounded while the expert is read once. Each call's weighted output (rounded to `dtype`, as
    routed_prefill's buffer holds it) is added into acc (accumulation_dtype(dtype): the dtype
    routed_prefill's index_add sums in) at once; the store delivers the experts in ascending order
    (for_each_expert in_order), so each token's slots are summed in routed_prefill's order whatever
    order the reads land in, and no [T*K, H] buffer is held."""
    slots = _Slots(ids, weights)

    def run(e, expert_weights):
        for rows in slots.calls(e, max_rows):
            token_rows = slots.token_of[rows]
            x = inputs(token_rows)
            y = expert_fn(x, expert_weights)
            del x  # freed before the weighted copy: a call holds at most three [rows, H] at once
            y = (y * slots.weight[rows]).to(dtype)
            acc.index_add_(0, token_rows, y.to(acc.dtype))

    acc.zero_()
    store.for_each_expert(layer, slots.needed, run, in_order=True)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What index_add sums a reduced-precision tensor in on the CPU (fp32), else the dtype itself."""
    return torch.promote_types(dtype, torch.float32)


class _Slots:
    """The routed slots of [T, K] routing grouped by expert (one stable sort): needed (ascending
    expert ids), token_of [n] (each slot's row), weight [n, 1]; slots skipped by the routing
    threshold (id -1) are routed nowhere."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor):
        K = ids.shape[1]
        flat = ids.flatten()
        if bool((flat < 0).any()):
            kept = torch.nonzero(flat >= 0).squeeze(1)
            sorted_ids, order = torch.sort(flat[kept], stable=True)
            order = kept[order]
        else:
            sorted_ids, order = torch.sort(flat, stable=True)  # [T*K], grouped by expert
        experts, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
        self.needed, self.counts = experts.tolist(), counts.tolist()
        self.starts = [0] * len(self.counts)
        for j in range(1, len(self.counts)):
            self.starts[j] = self.starts[j - 1] + self.counts[j - 1]
        self.position = {e: j for j, e in enumerate(self.needed)}
        self.token_of = order // K  # the row of x each routed slot belongs to
        self.weight = weights.flatten()[order, None]
        self.n = order.shape[0]

    def calls(self, e: int, max_rows: int | None) -> list[slice]:
        """Expert e's slots, in runs of at most max_rows (None: one)."""
        j = self.position[e]
        begin, end = self.starts[j], self.starts[j] + self.counts[j]
        step = max_rows or (end - begin) or 1
        return [slice(b, min(b + step, end)) for b in range(begin, end, step)]


class ResidentMoeLayer:
    """One MoE layer of a decode step as one native call: h [1, H] → h + moe(rms_norm(h)) [1, H].

    The op reads each chosen expert's rows through a table of addresses (int64 [E, 3]: gate, up,
    down), built once here from the store's tensors, which this object holds so the addresses stay
    valid for its lifetime (the store keeps them too: ResidentExperts loads every expert for good)."""

    def __init__(self, norm_w: torch.Tensor, eps: float, router_w: torch.Tensor, top_k: int, norm_topk: bool,
                 experts: list[tuple]):
        self.norm_w, self.eps, self.router_w = norm_w, float(eps), router_w
        self.top_k, self.norm_topk = int(top_k), bool(norm_topk)
        self.inter = experts[0][-1].shape[1]
        self._tensors = experts  # what the addresses point into
        rows = []
        for expert in experts:
            if len(expert) == 2:  # gate_up [2I, H]: up's rows start I rows in
                gate_up, down = expert
                rows.append([gate_up.data_ptr(), gate_up[self.inter:].data_ptr(), down.data_ptr()])
            else:
                rows.append([t.data_ptr() for t in expert])
        self.table = torch.tensor(rows, dtype=torch.int64)  # [E, 3]

    def __call__(self, h: torch.Tensor, trim=None) -> torch.Tensor:
        """trim: an engine/arch/router.py RoutingTrim the op applies (the same experts and weights as
        RoutingTrim.apply on the unfused path's routing), or None."""
        return native.moe_layer(h, self.norm_w, self.eps, self.router_w, self.top_k, self.norm_topk,
                                self.table, self.inter, *trim_operands(trim))


def resident_layer(args: ModelArgs, w: dict, store, layer: int, expert_fn) -> ResidentMoeLayer | None:
    """The fused decode of `layer` where it applies, else None (the unfused path): an MoE layer with
    the softmax top-k rule (rules in engine/arch/router.py and shared experts stay unfused), SwiGLU
    experts all resident in RAM as plain contiguous bf16 tensors of one shape, a bf16 router and norm."""
    if (not args.is_moe_layer(layer) or args.router is not None or expert_fn is not swiglu_expert
            or args.shared_experts_intermediate_size or args.shared_expert_intermediate_size):
        return None
    p = layer_prefix(layer)
    norm_w = w.get(f"{p}.post_attention_layernorm.weight")
    router_w = w.get(f"{p}.{args.moe_prefix}.gate.weight")
    if not all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.is_contiguous()
               and t.device.type == "cpu" for t in (norm_w, router_w)):
        return None
    held = store.resident(layer, list(range(args.num_experts))) if store is not None else None
    if not held or router_w.shape[0] != len(held):
        return None
    quantized = moe_quant.resident_layer(norm_w, args.rms_norm_eps, router_w, args.top_k, args.norm_topk_prob, held)
    if quantized is not None:  # int8 / int4 experts: the fused layer's quantized twin
        return quantized
    H = router_w.shape[1]
    down = held[0][-1]
    if not _plain_bf16(down) or down.shape[0] != H:
        return None
    shapes = ((2 * down.shape[1], H), tuple(down.shape)) if len(held[0]) == 2 else \
        ((down.shape[1], H), (down.shape[1], H), tuple(down.shape))
    if any(len(e) != len(shapes) or any(not _plain_bf16(t) or tuple(t.shape) != s for t, s in zip(e, shapes))
           for e in held):
        return None
    return ResidentMoeLayer(norm_w, args.rms_norm_eps, router_w, args.top_k, args.norm_topk_prob, held)


def _plain_bf16(t) -> bool:
    return type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu"
