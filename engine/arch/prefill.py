"""Layer-major prefill: a group of prompt tokens goes through one layer at a time.

The pass-wise reference (Transformer.forward) takes T tokens through every layer before the next
T; under a budget an expert the cache cannot hold is then read again in every pass. Here the whole
group finishes layer L before any token starts L+1, so each routed expert the group needs is read
at most once per layer (DESIGN.md, "Reuse: many tokens per read"):

    for each layer L:
        attention     in causal sub-chunks of `sub` tokens, in position order, each writing its
                      K/V rows before the next reads them (what pass-wise passes of `sub` tokens
                      do, so the same math); the score matrix stays [sub, S]
        norm, router  per sub-chunk (rows are independent) → the group's routing ids/weights [T, K]
        routed MoE    moe.routed_prefill over the whole group: each expert applied to all its rows
                      while it is in memory, in calls of at most sub*K rows (bounded transients)
        shared / dense MLP, residual adds   per sub-chunk
        hint L+1      the lookahead rule (L+1's norm and router on the residual entering L+1),
                      unioned over the group → store.hint_experts, so L+1's reads run under its
                      attention

What lives for the whole group, and what the memory plan charges for it (engine/movement/plan.py,
prefill_group_bytes): the residual x and its norm [T, H], the routed output [T, H] and every routed
slot's weighted output [T*K, H] (summed in ascending expert order whatever order the reads land
in), the routing [T, K] and its sort, each sub-chunk's rope rows, and for the DSA indexer each
sub-chunk's selection [sub, S]. Transients beyond that are one sub-chunk's (prefill_activation_bytes).

Shape legend: T tokens in the group, H hidden, E experts, K top-k, S positions attended, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.arch import moe
from engine.arch.args import layer_prefix
from engine.arch.layers import rms_norm, route_layer, swiglu
from engine.weights.stored import linear


def layer_major(model, tokens: torch.Tensor, start_pos: int, kv, sub_tokens: int,
                hidden: list | None = None) -> torch.Tensor:
    """tokens [T] → logits [1, V] of the last position; K/V written at start_pos..start_pos+T.
    hidden: a list every position's final hidden state [T, H] (after the model's norm) is appended
    to: what the MTP drafter reads (engine/arch/mtp.py)."""
    a = model.args
    T = tokens.shape[0]
    if start_pos + T > kv.ctx_size:
        raise ValueError(f"{start_pos + T} positions exceed ctx_size {kv.ctx_size}")
    sub = max(1, min(int(sub_tokens), T))
    chunks = [slice(b, min(b + sub, T)) for b in range(0, T, sub)]
    # Each sub-chunk's rope rows, computed in position order once: dynamic NTK grows its frequencies
    # with the furthest position seen, so asking per layer would give later layers other rows.
    ropes = [model._rope(start_pos + c.start, c.stop - c.start) for c in chunks]
    x = F.embedding(tokens, model.w["model.embed_tokens.weight"])  # [T, H], updated in place layer by layer
    normed = torch.empty_like(x)  # [T, H]: the MoE's input for the whole group
    routed_out = slot_out = None
    if a.is_moe:
        routed_out = torch.empty_like(x)  # [T, H]
        slot_out = torch.empty(T * a.top_k, a.hidden_size, dtype=x.dtype)  # [T*K, H]
    # The DSA indexer's selection is per query, and a "shared" layer reuses the last full layer's:
    # kept per sub-chunk, as a pass of those tokens would have it.
    indexed = hasattr(kv, "selection")
    selections = [getattr(kv, "selection", None)] * len(chunks)
    _hint_group(model, 0, x, chunks)
    for layer in range(a.num_layers):
        p = layer_prefix(layer)
        w = model._layer_weights(layer)
        for i, c in enumerate(chunks):
            cos, sin = ropes[i]
            at = start_pos + c.start
            if indexed:
                kv.selection = selections[i]
            x[c].add_(model._attention(layer, w, rms_norm(x[c], w[f"{p}.input_layernorm.weight"], a.rms_norm_eps),
                                       at, kv, cos, sin, model._mask(at, c.stop - c.start)))
            if indexed:
                selections[i] = kv.selection
        if a.is_moe_layer(layer):
            _moe(model, layer, w, x, normed, chunks, routed_out, slot_out, sub)
        else:
            for c in chunks:
                normed[c] = rms_norm(x[c], w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)
                x[c].add_(swiglu(normed[c], w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"],
                                 w[f"{p}.mlp.down_proj.weight"]))
        _hint_group(model, layer + 1, x, chunks)
    if indexed:
        kv.selection = selections[-1]  # what the last pass would have left
    if hidden is not None:
        hidden.append(rms_norm(x, model.w["model.norm.weight"], a.rms_norm_eps))
    last = rms_norm(x[-1:], model.w["model.norm.weight"], a.rms_norm_eps)
    return linear(last, model.lm_head).float()  # [1, V]


def _moe(model, layer: int, w: dict, x: torch.Tensor, normed: torch.Tensor, chunks: list[slice],
         routed_out: torch.Tensor, slot_out: torch.Tensor, sub: int) -> None:
    """x += MoE(norm(x)) over the group, in place: routing per sub-chunk, every routed expert once."""
    p, a = layer_prefix(layer), model.args
    ids, weights = [], []
    for c in chunks:
        normed[c] = rms_norm(x[c], w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)
        i, g = route_layer(a, w, layer, normed[c], model.routing_trim)  # [t, K] each
        ids.append(i)
        weights.append(g)
    ids, weights = torch.cat(ids), torch.cat(weights)  # [T, K]
    if model.routing_log is not None:
        model.routing_log[layer].append(ids)
    # sub*K rows per expert call: what one pass of `sub` tokens routes at most, so one call's
    # transients stay within the sub-chunk's charge.
    out = moe.routed_prefill(model.experts, model.expert_fn, layer, normed, ids, weights,
                             max_rows=sub * ids.shape[1], slot_out=slot_out, out=routed_out)
    for c in chunks:
        x[c].add_(model._plus_shared(layer, w, normed[c], out[c]))


def _hint_group(model, target: int, x: torch.Tensor, chunks: list[slice]) -> None:
    """Before layer `target` runs: its experts for the whole group, predicted by the lookahead rule
    (its own norm and router on the residual x [T, H] entering it), hinted to the store in
    ascending order, the order the MoE will ask for them. Only the next layer: a prompt's union is
    most of a layer's experts, more than the read slots of several layers."""
    a = model.args
    if (model.experts is None or not model.prefetch_depth or target >= a.num_layers
            or not a.is_moe_layer(target)):
        return
    norm_w = model.w[f"{layer_prefix(target)}.post_attention_layernorm.weight"]
    union = set()
    for c in chunks:
        ids, _ = route_layer(a, model.w, target, rms_norm(x[c], norm_w, a.rms_norm_eps), model.routing_trim)
        union.update(torch.unique(ids).tolist())
    union.discard(-1)  # a slot the routing threshold skipped
    model.experts.hint_experts(target, sorted(union))
