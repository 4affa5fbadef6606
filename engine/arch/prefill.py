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
        routed MoE    moe.routed_group over the whole group: each expert applied to all its rows
                      while it is in memory, in calls of at most sub*K rows (bounded transients),
                      its input rows normed per call (rms_norm's rows are independent), its
                      weighted output added into the group's routed sum at once, the experts
                      taken in ascending order (the store holds a read that lands early)
        shared / dense MLP, residual adds   per sub-chunk
        hint L+1      the lookahead rule (L+1's norm and router on the residual entering L+1),
                      unioned over the group → store.hint_experts, so L+1's reads run under its
                      attention

What lives for the whole group, and what the memory plan charges for it (engine/movement/plan.py,
prefill_group_bytes): the residual x [T, H], the routed sum [T, H] in index_add's accumulation
dtype (fp32 for bf16: each token's slots summed in ascending expert order, the bits of the
pass-wise routed_prefill whatever order the reads land in), the routing [T, K] and its sort, each
sub-chunk's rope rows, and for the DSA indexer each sub-chunk's selection [sub, S]; the MoE's
normed input [T, H] where the budget has room for it (plan.prefill_norm_held), else routing, the
experts' input rows and the shared experts each norm their rows again (K norms a token). Transients
beyond that are one sub-chunk's (prefill_activation_bytes).

Several sequences in one pass (layer_major_parts: the prompts of requests that arrived together,
engine/run/batch.py): the group is the parts' rows one after another; each part's attention runs in
its own KV cache in the sub-chunks its own pass would cut, its final norm and lm_head alone; the
routed MoE takes every part's rows at once, so an expert they share is read once per layer for all.
What the plan charges is the same for T rows whichever parts they come from (the scheduler keeps
the parts' total within the plan's group).

Shape legend: T tokens in the group (every part's), H hidden, E experts, K top-k, S positions
attended, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.arch import moe
from engine.arch.args import layer_prefix
from engine.arch.layers import rms_norm, rms_norm_rows, route_layer, swiglu
from engine.weights.stored import linear


def layer_major(model, tokens: torch.Tensor, start_pos: int, kv, sub_tokens: int,
                hidden: list | None = None) -> torch.Tensor:
    """tokens [T] → logits [1, V] of the last position; K/V written at start_pos..start_pos+T.
    hidden: a list every position's final hidden state [T, H] (after the model's norm) is appended
    to: what the MTP drafter reads (engine/arch/mtp.py)."""
    return layer_major_parts(model, [(tokens, start_pos, kv)], sub_tokens, hidden)[0]


@dataclass(frozen=True)
class _Chunk:
    rows: slice  # its rows of the pass's x
    kv: object  # its sequence's KV cache
    at: int  # its first position


def layer_major_parts(model, parts: list[tuple[torch.Tensor, int, object]], sub_tokens: int,
                      hidden: list | None = None) -> list[torch.Tensor]:
    """Several sequences' groups in one pass: parts [(tokens [T_p], start_pos, kv)] → each part's last
    position's logits [1, V]. Each part's attention runs in its own cache in its own sub-chunks (the
    ones its pass alone would cut), its final norm and lm_head alone; the routed MoE takes every part's
    rows at once, so each expert the parts need is read once per layer for all of them (the prompts of
    simultaneous arrivals: engine/run/batch.py). One part is layer_major itself. A part's bits differ
    from its pass alone only where an expert's matmul has other parts' rows beside its own."""
    a = model.args
    if hidden is not None and len(parts) > 1:
        raise ValueError("the MTP drafter's hidden states come from one sequence's pass")
    chunks: list[_Chunk] = []
    ends = []  # each part's last row + 1
    total = 0
    for tokens, start_pos, kv in parts:
        T = tokens.shape[0]
        if start_pos + T > kv.ctx_size:
            raise ValueError(f"{start_pos + T} positions exceed ctx_size {kv.ctx_size}")
        sub = max(1, min(int(sub_tokens), T))
        chunks += [_Chunk(slice(total + b, total + min(b + sub, T)), kv, start_pos + b) for b in range(0, T, sub)]
        total += T
        ends.append(total)
    rows = [c.rows for c in chunks]
    # Each sub-chunk's rope rows, computed in position order once: dynamic NTK grows its frequencies
    # with the furthest position seen, so asking per layer would give later layers other rows.
    ropes = [model._rope(c.at, c.rows.stop - c.rows.start) for c in chunks]
    x = F.embedding(torch.cat([t for t, _, _ in parts]) if len(parts) > 1 else parts[0][0],
                    model.w["model.embed_tokens.weight"])  # [T, H] (T: every part's), updated in place layer by layer
    # [T, H]: the routed experts' sum, in the dtype routed_prefill's index_add sums in
    routed = torch.empty(x.shape, dtype=moe.accumulation_dtype(x.dtype)) if a.is_moe else None
    # [T, H]: the MoE's normed input, held where the plan charged it (engine/movement/plan.py
    # prefill_norm_held); else each use norms its rows again
    held = torch.empty_like(x) if a.is_moe and getattr(model, "prefill_norm_held", False) else None
    # The DSA indexer's selection is per query, and a "shared" layer reuses the last full layer's:
    # kept per sub-chunk, as a pass of those tokens would have it.
    indexed = [hasattr(c.kv, "selection") for c in chunks]
    selections = [getattr(c.kv, "selection", None) for c in chunks]
    _hint_group(model, 0, x, rows)
    for layer in range(a.num_layers):
        p = layer_prefix(layer)
        w = model._layer_weights(layer)
        for i, c in enumerate(chunks):
            cos, sin = ropes[i]
            if indexed[i]:
                c.kv.selection = selections[i]
            x[c.rows].add_(model._attention(layer, w, rms_norm(x[c.rows], w[f"{p}.input_layernorm.weight"],
                                                               a.rms_norm_eps), c.at, c.kv, cos, sin,
                                               model._mask(c.at, c.rows.stop - c.rows.start)))
            if indexed[i]:
                selections[i] = c.kv.selection
        if a.is_moe_layer(layer):
            _moe(model, layer, w, x, rows, routed, max(1, min(int(sub_tokens), total)), held)
        else:
            for c in rows:
                x[c].add_(swiglu(rms_norm(x[c], w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps),
                                 w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"],
                                 w[f"{p}.mlp.down_proj.weight"]))
        _hint_group(model, layer + 1, x, rows)
    for i, c in enumerate(chunks):  # each cache left with its last sub-chunk's: what its last pass would leave
        if indexed[i]:
            c.kv.selection = selections[i]
    if hidden is not None:
        hidden.append(rms_norm(x, model.w["model.norm.weight"], a.rms_norm_eps))
    out = []
    for end in ends:
        last = rms_norm(x[end - 1:end], model.w["model.norm.weight"], a.rms_norm_eps)
        out.append(linear(last, model.lm_head).float())  # [1, V]
    return out


def _moe(model, layer: int, w: dict, x: torch.Tensor, chunks: list[slice], routed: torch.Tensor,
         sub: int, held: torch.Tensor | None = None) -> None:
    """x += MoE(norm(x)) over the group, in place: routing per sub-chunk, every routed expert once.
    routed [T, H]: the group's buffer for the routed sum (accumulation dtype); held [T, H]: where
    the plan charged it, the normed input kept for the group (None: normed again per use)."""
    p, a = layer_prefix(layer), model.args
    norm_w = w[f"{p}.post_attention_layernorm.weight"]
    ids, weights = [], []
    # A one-row sub-chunk's norm may come from the one-token native op (layers.rms_norm): where its
    # bits differ from rms_norm_rows', that row's input is kept as its pass makes it (one row each).
    kept = {}
    for c in chunks:
        normed = rms_norm(x[c], norm_w, a.rms_norm_eps)  # [t, H]
        i, g = route_layer(a, w, layer, normed, model.routing_trim)  # [t, K] each
        ids.append(i)
        weights.append(g)
        if held is not None:
            held[c] = normed
        elif c.stop - c.start == 1 and not torch.equal(normed, rms_norm_rows(x[c], norm_w, a.rms_norm_eps)):
            kept[c.start] = normed
        del normed
    ids, weights = torch.cat(ids), torch.cat(weights)  # [T, K]
    if model.routing_log is not None:
        model.routing_log[layer].append(ids)

    def inputs(token_rows: torch.Tensor) -> torch.Tensor:
        """The MoE's input for these rows of the group [n] → [n, H], normed `sub` rows at a time
        (one sub-chunk's norm transients). Each token is normed once per routed slot (K times): the
        price of not holding a [T, H] norm, several elementwise passes where a held norm's gather
        was one: paid only by a group the budget could not give room to hold the norm."""
        if held is not None:
            return held[token_rows]
        out = torch.empty(token_rows.shape[0], x.shape[1], dtype=x.dtype)
        for b in range(0, token_rows.shape[0], sub):
            out[b:b + sub] = rms_norm_rows(x[token_rows[b:b + sub]], norm_w, a.rms_norm_eps)
        for row, normed in kept.items():
            out[token_rows == row] = normed
        return out

    # sub*K rows per expert call: what one pass of `sub` tokens routes at most, so one call's
    # transients stay within the sub-chunk's charge.
    moe.routed_group(model.experts, model.expert_fn, layer, inputs, ids, weights, max_rows=sub * ids.shape[1],
                     acc=routed, dtype=x.dtype)
    del ids, weights
    for c in chunks:
        normed = held[c] if held is not None else rms_norm(x[c], norm_w, a.rms_norm_eps)
        x[c].add_(model._plus_shared(layer, w, normed, routed[c].to(x.dtype)))


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
