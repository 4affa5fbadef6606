"""Several decode tokens in one step: B rows, each one token at its own position in its own KV cache
(B sequences decoding together), or consecutive positions of one cache (a speculative verify).

A solo decode step reads, per MoE layer, the K experts its token routes to, and the dense weights
(attention, router, lm_head) once. Here the rows go through the model one layer at a time, so a
layer's routed experts are gathered over every row and each one the rows need is fetched from the
store once and applied to all its rows while it is in memory; a layer read from disk per token
(layer streaming) is read once for all rows too. Bytes per token fall with B (DESIGN.md, "Reuse:
many tokens per read").

    where every row's solo decode takes the whole step in one native call (decode_plan.py's
    native_step route, no sliding-window mask): all rows through every layer in ONE native call
    (decode_plan.native_step_rows: per layer attention_batch and moe_batch over the rows, the
    weights read once for all); else, in Python:
    for each layer L:
        attention     per row, in row order, exactly as that row's solo decode computes it (the
                      native attention of its own cache's decode plan, or the reference); rows of
                      one cache write their K/V before a later row of that cache reads them
        norm, router  per row (the solo path's one-row ops)
        routed MoE    the union of the rows' experts, ascending: each fetched once from the store
                      (store.for_each_expert) and applied to every slot routed to it; then each
                      row's K outputs summed in ascending expert order (native.combine), as
                      moe.routed_decode sums them
        shared / dense MLP, residual adds   per row
        lookahead     the next layers' experts predicted over every row, hinted as one union

Bits: every row gets the same bits as Transformer.forward([token], pos, kv) alone (so greedy tokens
are identical, batched or not, drafted or not): each op on a row is the one-row op the solo decode
runs, and the multi-row calls used here are row-independent (native.linear computes each output
element with the same dot in the same order whatever the row count; an expert's output on a row is
native.experts' on that row). The solo native whole step and fused MoE layer give the same bits as
these per-layer pieces (engine/arch/decode_plan.py, engine/arch/moe.py). The row-independent multi-row
ops, and where torch's own calls are row-independent without the native kernels: engine/arch/row_ops.py.

Shape legend: B rows, H hidden, K experts per token, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import native
from engine.arch import attention_quant, decode_plan
from engine.arch.args import layer_prefix
from engine.arch.layers import KVCache, rms_norm, route_layer
from engine.arch.router import SigmoidGroupRouter, native_rows, trim_operands
from engine.arch.row_ops import (experts_rows, rows_kernel_applies, rows_linear, rows_norm, shared_gate_rows,
                                 swiglu_rows, torch_expert_rows)


def forward_rows(model, tokens: torch.Tensor, positions: list[int], kvs: list,
                 hidden: list | None = None) -> torch.Tensor:
    """tokens [B] → fp32 logits [B, V]; row b writes its K/V at positions[b] of kvs[b].

    Rows that share a cache must be consecutive positions in increasing order (a verify pass).
    hidden: a list the rows' final hidden states [B, H] (after the model's norm, what lm_head reads)
    are appended to: what the MTP drafter reads (engine/arch/mtp.py)."""
    B = tokens.shape[0]
    if B != len(positions) or B != len(kvs):
        raise ValueError(f"{B} tokens, {len(positions)} positions and {len(kvs)} caches: one of each per row")
    _check_rows(positions, kvs)
    a = model.args
    ropes = [model._rope(pos, 1) for pos in positions]  # [1, D] cos and sin per row
    masks = [model._mask(pos, 1) for pos in positions]  # None, or [1, S] where a window has moved
    plans = [model.plan_for(kv) for kv in kvs]
    x = F.embedding(tokens, model.w["model.embed_tokens.weight"])  # [B, H]
    if all(plan.step is not None for plan in plans) and all(mask is None for mask in masks):
        # Where every row's solo decode would take the whole step in one native call, the rows take
        # it together: one call for every layer and row (each layer's weights read once for all).
        # The final norm in one call too: native.rms_norm normalises each row alone, the bits of
        # rms_norm on that row (which takes the same op for one bf16 row).
        x = native.rms_norm(_native_step_rows(model, x, ropes, positions, kvs, plans), model.w["model.norm.weight"],
                            a.rms_norm_eps)  # [B, H]
    else:
        rows = _layer_rows(model, x, positions, kvs, ropes, masks, plans)
        x = torch.cat([rms_norm(h, model.w["model.norm.weight"], a.rms_norm_eps) for h in rows])  # [B, H]
    if hidden is not None:
        hidden.append(x)
    return rows_linear(x, model.lm_head).float()  # [B, V]


def through_layers(model, x: torch.Tensor, positions: list[int], kvs: list, rope_positions=None) -> torch.Tensor:
    """x [B, H] (the rows' input to the first layer) → their residuals [B, H] after the last layer, row b
    at positions[b] of kvs[b] (the layer-at-a-time path below). rope_positions: where RoPE turns each
    row, where that is not its cache position (the MTP layer's cache, whose slot 0 holds a later
    position: engine/arch/mtp.py)."""
    _check_rows(positions, kvs)
    turns = positions if rope_positions is None else list(rope_positions)
    ropes = [model._rope(pos, 1) for pos in turns]  # [1, D] cos and sin per row
    masks = [model._mask(pos, 1) for pos in positions]
    plans = [model.plan_for(kv) for kv in kvs]
    return torch.cat(_layer_rows(model, x, positions, kvs, ropes, masks, plans))


def _native_step_rows(model, x: torch.Tensor, ropes: list, positions: list[int], kvs: list,
                      plans: list) -> torch.Tensor:
    """x [B, H] → [B, H] through every layer in one native call (decode_plan.native_step_rows), each
    distinct cache's plan step given once and each row pointing at its own."""
    index: dict[int, int] = {}  # id(cache) → its place among the distinct caches
    steps, row_cache = [], []
    for kv, plan in zip(kvs, plans):
        if id(kv) not in index:
            index[id(kv)] = len(steps)
            steps.append(plan.step)
        row_cache.append(index[id(kv)])
    cos = torch.cat([c for c, _ in ropes])  # [B, D]
    sin = torch.cat([s for _, s in ropes])
    return decode_plan.native_step_rows(steps, model.args, x, cos, sin, positions, row_cache,
                                        trim_operands(model.routing_trim))


def _layer_rows(model, x: torch.Tensor, positions: list[int], kvs: list, ropes: list, masks: list,
                plans: list) -> list[torch.Tensor]:
    """The rows [B, H] through the model one layer at a time (the module's header): each row's
    residual [1, H] after the last layer."""
    a = model.args
    B = x.shape[0]
    h = x  # [B, H]: the rows' residuals
    indexed = [hasattr(kv, "selection") for kv in kvs]  # the DSA indexer's per-token selection
    selections = [getattr(kv, "selection", None) for kv in kvs]
    # Rows whose attention is model.py's own (no architecture attention, a plain KVCache) go through
    # it together: one call per projection for all of them (_attention_rows); the rest one by one.
    together = [b for b in range(B) if a.attention_impl is None and type(kvs[b]) is KVCache]
    rope_rows = (torch.cat([c for c, _ in ropes]), torch.cat([s for _, s in ropes]))  # [B, D] each, for every layer
    for layer in range(a.num_layers):
        p = layer_prefix(layer)
        w = model._layer_weights(layer)  # once for every row (layer streaming reads it here)
        h, attended = _native_attention(model, layer, w, h, rope_rows, masks, plans, positions)
        if len(attended) < B:
            rows = [h[b:b + 1] for b in range(B)]  # each row's residual [1, H]
            _other_attention(model, layer, w, rows, attended, together, positions, kvs, ropes, masks, indexed,
                             selections)
            h = torch.cat(rows)  # [B, H]
        normed = rows_norm(h, w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)  # [B, H]
        model._lookahead(layer, normed, h)
        if a.is_moe_layer(layer):
            routed = _routed(model, layer, w, normed)  # [B, H]
            h = h + model._plus_shared(layer, w, normed, routed, mlp=swiglu_rows, gate=shared_gate_rows)
        else:
            h = h + swiglu_rows(normed, *(w[f"{p}.mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
    rows = [h[b:b + 1] for b in range(B)]
    for b in range(B):
        if indexed[b]:
            kvs[b].selection = selections[b]  # what this row's solo step would have left
    return rows


def _other_attention(model, layer: int, w: dict, rows: list, attended: set, together: list[int], positions: list[int],
                     kvs: list, ropes: list, masks: list, indexed: list, selections: list) -> None:
    """The attention of the rows the native call did not take (rows[b] replaced in place): model.py's
    own attention for several rows together (_attention_rows), else each row's solo attention in row order."""
    a, p = model.args, layer_prefix(layer)
    batch = [b for b in together if b not in attended]
    batch = batch if len(batch) > 1 else []  # one row alone: model._attention, as its solo step
    if batch:
        normed = rows_norm(torch.cat([rows[b] for b in batch]), w[f"{p}.input_layernorm.weight"], a.rms_norm_eps)
        outs = _attention_rows(model, layer, w, normed, [positions[b] for b in batch], [kvs[b] for b in batch],
                               [ropes[b] for b in batch], [masks[b] for b in batch])
        for b, out in zip(batch, outs):
            rows[b] = rows[b] + out
    for b in range(len(rows)):  # the others: each row its own cache and position, in row order
        if b in attended or b in batch:
            continue
        cos, sin = ropes[b]
        if indexed[b]:
            kvs[b].selection = selections[b]
        rows[b] = rows[b] + model._attention(layer, w, rms_norm(rows[b], w[f"{p}.input_layernorm.weight"],
                                                                a.rms_norm_eps),
                                             positions[b], kvs[b], cos, sin, masks[b])
        if indexed[b]:
            selections[b] = kvs[b].selection


def _attention_rows(model, layer: int, w: dict, x: torch.Tensor, positions: list[int], kvs: list, ropes: list,
                    masks: list) -> list[torch.Tensor]:
    """model._attention for R rows at once: x [R, H] (normed) → each row's output [1, H] (before the
    residual add), row r one token at positions[r] of kvs[r] (plain KVCaches), its K/V written there.

    Each row gets model._attention's bits on that row alone: the projections are row-independent
    (rows_linear), the norms per row (rows_norm), rope and clipping elementwise, and each row's
    scores and softmax are its own call over its own cache, shaped as the solo call shapes them.
    Every row's K/V is written before any row reads: a row reads its cache up to its own position
    only, where the rows before it in that cache (a verify's earlier positions) have written theirs."""
    a = model.args
    R = x.shape[0]
    cos = torch.cat([c for c, _ in ropes])  # [R, Dr]: row r's position
    sin = torch.cat([s for _, s in ropes])
    q, k, v = model._qkv_heads(layer, w, x, cos, sin, fused=True, project=rows_linear, norm=rows_norm)
    for r, (pos, kv) in enumerate(zip(positions, kvs)):
        kv.k[layer][:, pos:pos + 1] = k[:, r:r + 1]
        kv.v[layer][:, pos:pos + 1] = v[:, r:r + 1]
    outs = []
    for r, (pos, kv) in enumerate(zip(positions, kvs)):
        keys = kv.k[layer][:, :pos + 1].to(q.dtype)  # [Nkv, S, D]
        values = kv.v[layer][:, :pos + 1].to(q.dtype)
        out = F.scaled_dot_product_attention(q[:, r:r + 1].contiguous().unsqueeze(0), keys.unsqueeze(0),
                                             values.unsqueeze(0), attn_mask=masks[r],
                                             enable_gqa=a.num_heads != a.num_kv_heads)
        outs.append(out.squeeze(0).transpose(0, 1).reshape(1, a.num_heads * a.head_dim))  # [1, Nq*D]
    o = rows_linear(torch.cat(outs), w[f"{layer_prefix(layer)}.self_attn.o_proj.weight"])  # [R, H]
    return [o[r:r + 1] for r in range(R)]


def _check_rows(positions: list[int], kvs: list) -> None:
    last: dict[int, tuple[int, int]] = {}  # id(cache) → (row, position) of its latest row
    for b, (pos, kv) in enumerate(zip(positions, kvs)):
        if not 0 <= pos < kv.ctx_size:
            raise ValueError(f"row {b}: position {pos} is outside the cache's {kv.ctx_size} positions")
        seen = last.get(id(kv))
        if seen is not None and (seen[0] != b - 1 or seen[1] != pos - 1):
            raise ValueError(f"row {b}: rows that share a cache must be consecutive positions in order")
        last[id(kv)] = (b, pos)


def _routed(model, layer: int, w: dict, normed: torch.Tensor) -> torch.Tensor:
    """The rows' routed-expert sums [B, H] (each row moe.routed_decode's bits), every expert of the
    union of the rows' routes fetched from the store once and applied to all its rows."""
    B = normed.shape[0]
    routes = _route_rows(model, layer, w, normed)  # ids [B, K] ascending per row, their weights [B, K]
    if routes is not None:
        wanted = routes[0].tolist()
        weights = routes[1]
    else:  # one row at a time (a trim drops a row's skipped slots; a router without a rows kernel)
        wanted, weights = [], []
        for b in range(B):
            ids, row_weights = route_layer(model.args, w, layer, normed[b:b + 1], model.routing_trim)
            sorted_ids, order = torch.sort(ids[0])
            wanted.append(sorted_ids.tolist())
            weights.append(row_weights[0, order])
    if model.routing_log is not None:  # (counted, not ordered: Engine.save_routing)
        model.routing_log[layer].extend(torch.tensor([ids], dtype=torch.long) for ids in wanted)
    slots: dict[int, list[tuple[int, int]]] = {}  # expert → [(row, index in that row's ascending list)]
    for b, experts in enumerate(wanted):
        for j, e in enumerate(experts):
            slots.setdefault(e, []).append((b, j))
    union = sorted(slots)
    order = [(b, j) for e in union for b, j in slots[e]]  # the slots in the order the experts are applied
    held = model.experts.resident(layer, union) if rows_kernel_applies(model, normed) else None
    ys = experts_rows(normed, held, [slots[e] for e in union]) if held is not None else None
    if ys is None:  # the experts as they land (streamed), or one-row calls where no rows kernel applies
        outs: dict[tuple[int, int], torch.Tensor] = {}

        def run(e, expert_weights):  # as each expert's weights land
            got = (experts_rows(normed, [expert_weights], [slots[e]]) if rows_kernel_applies(model, normed)
                   else torch_expert_rows(model, normed, expert_weights, slots[e]))
            for i, (b, j) in enumerate(slots[e]):  # else the solo path's one-row call per row
                outs[b, j] = got[i:i + 1] if got is not None else model.expert_fn(normed[b:b + 1], expert_weights)

        model.experts.for_each_expert(layer, union, run)
        ys = torch.cat([outs[slot] for slot in order])
    # each row's K outputs in ascending expert order (routed_decode's order), then summed per row
    at = {slot: i for i, slot in enumerate(order)}
    per_row = [[at[b, j] for j in range(len(experts))] for b, experts in enumerate(wanted)]
    if routes is not None and native.ready and ys.dtype is torch.bfloat16 and weights.dtype is torch.bfloat16:
        return native.combine(ys.index_select(0, torch.tensor([i for row in per_row for i in row])), weights)
    out = []
    for b, row in enumerate(per_row):
        chosen = weights[b]
        row_ys = ys.index_select(0, torch.tensor(row))  # [K, H], ascending expert id
        if native.ready and row_ys.dtype is torch.bfloat16 and chosen.dtype is torch.bfloat16:
            out.append(native.combine(row_ys, chosen))
        else:
            out.append(torch.mm(chosen[None], row_ys))
    return torch.cat(out)


def _route_rows(model, layer: int, w: dict, normed: torch.Tensor):
    """Every row's route in one call where a router kernel gives each row its one-row bits: (ids [B, K]
    ascending per row, their weights [B, K]); else None (no trim: a trim drops a lone row's skipped
    slots, which a [B, K] result cannot)."""
    a = model.args
    if model.routing_trim is not None:
        return None
    if type(a.router) is SigmoidGroupRouter:
        weight = w[f"{layer_prefix(layer)}.{a.router.prefix}.weight"]
        if not native_rows(normed, weight):
            return None
        ids, weights = a.router.route(w, layer_prefix(layer), normed)
    elif a.router is None:
        weight = w[f"{layer_prefix(layer)}.{a.moe_prefix}.gate.weight"]
        if not native_rows(normed, weight):
            return None
        ids, weights = native.route_topk(normed, weight, a.top_k, bool(a.norm_topk_prob))
    else:
        return None
    ids, order = torch.sort(ids, dim=1)
    return ids, weights.gather(1, order)


def _native_attention(model, layer: int, w: dict, h: torch.Tensor, rope_rows: tuple, masks: list, plans: list,
                      positions: list[int]) -> tuple[torch.Tensor, set[int]]:
    """The rows whose solo decode takes the native attention at this layer, computed in one native
    call per kind (bf16 or int8 / int4 projections: the layer's weights read once for all of them,
    each row attention_decode's bits): (h [B, H] with those rows' residuals after the attention, their
    indices). rope_rows: every row's rope cos and sin, [B, D] each."""
    if w is not model.w:  # a layer read per token: the reference (its plan entries are None anyway)
        return h, set()
    by_kind: dict[str, list[tuple[int, object]]] = {}
    for b, plan in enumerate(plans):
        entry = plan.attention[layer] if plan.attention and masks[b] is None else None
        if entry is not None:
            kind = "int" if type(entry.operands) is attention_quant.QuantAttention else "bf16"
            by_kind.setdefault(kind, []).append((b, entry))
    done: set[int] = set()
    a, B = model.args, h.shape[0]
    out_h = h
    for kind, group in by_kind.items():
        idx = [b for b, _ in group]
        entries = [e for _, e in group]
        every = len(idx) == B  # (in row order: idx is then 0..B-1)
        x = h if every else h[idx]  # [R, H]
        cos, sin = rope_rows if every else (rope_rows[0][idx], rope_rows[1][idx])  # [R, D] each
        k_caches, k_scales = [e.k_cache[0] for e in entries], [e.k_cache[1] for e in entries]
        v_caches, v_scales = [e.v_cache[0] for e in entries], [e.v_cache[1] for e in entries]
        pos = [positions[b] for b in idx]
        op = entries[0].operands  # the layer's weights: the same in every row's plan
        if kind == "int":
            out = native.attention_decode_int_rows(x, op.norm_w, a.rms_norm_eps, op.proj, op.group, op.q_norm,
                                                   op.k_norm, cos, sin, k_caches, v_caches, pos, a.num_heads,
                                                   a.num_kv_heads, k_scales, v_scales)
        else:
            norm_w, qkv, q_norm, k_norm, o_w, qkv_b, rot = op
            out = native.attention_decode_rows(x, norm_w, a.rms_norm_eps, qkv, q_norm, k_norm, cos, sin, k_caches,
                                               v_caches, pos, a.num_heads, a.num_kv_heads, o_w, k_scales, v_scales,
                                               qkv_b, rot)
        if every:
            out_h = out
        else:
            out_h = out_h.clone() if out_h is h else out_h
            out_h[idx] = out
        done.update(idx)
    return out_h, done
