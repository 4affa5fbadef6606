"""Which route a decode token takes through the layers: decided once per engine, at load, not per call.

One token (T == 1) takes one of three routes; a prefill (T > 1) always takes the reference:

    native_step    every layer in one native call per token (engine/native/decode_step.cpp, or
                   decode_step_int.cpp where every projection and expert is int8 / int4 of one kind);
                   the same bits as native_layers. Several decode rows at once (decode_rows.py: a
                   batched step, a speculative verify) take one native call for all of them where
                   every row's plan has this route (native_step_rows)
    native_layers  per layer, the native attention (attention_decode*.cpp: input norm, q/k/v, per-head
                   norms, rope, the K/V write, attention, o_proj, residual) and the fused MoE layer
                   (moe.ResidentMoeLayer / moe_quant.ResidentQuantMoeLayer: norm, router, top-k,
                   experts, sum, residual) where that layer qualifies; the reference for the rest
    reference      model.py's own math for every layer (torch ops, and the per-op native kernels
                   layers.py takes for one bf16 token)

What decides it (Transformer.plan_decode, which the model calls when it is built and again when
something that changes the route changes, such as record_routing): the native kernels loaded
(engine/native), the compute dtype (the native decode is bf16; int8 / int4 weights also need
VNNI / VBMI), placement (layers streamed from disk per token, experts not all resident), the
architecture (attention, router and expert rules the kernels do not cover; MLA's and gpt-oss's own
caches), the KV cache's storage, and whatever watches the routing (a routing log, lookahead), which
needs each layer's expert ids that the fused calls keep inside. A routing trim does not change the
route: the fused calls apply it (engine/arch/router.py trim_operands).

The plan holds each native call's operands too (weights, the KV cache's tensors), so a decode step
only reads them: the per-call work is which layer, not whether.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine import native
from engine.arch import attention_quant, moe
from engine.arch.args import ModelArgs, layer_prefix
from engine.arch.kvquant import QuantizedRows
from engine.arch.layers import KVCache, swiglu_expert
from engine.arch.moe_quant import ResidentQuantMoeLayer

NATIVE_STEP, NATIVE_LAYERS, REFERENCE = "native_step", "native_layers", "reference"


class NativeAttention(NamedTuple):
    """One layer's operands for the native attention decode."""

    operands: tuple | attention_quant.QuantAttention  # bf16: (input norm, fused q/k/v, q norm, k norm, o_proj,
    #                                                   fused q/k/v bias or None, rotary dims or 0: the whole head)
    k_cache: tuple  # (rows or codes, scales) as _native_cache gives them
    v_cache: tuple


class NativeStep(NamedTuple):
    """The whole step's operands for decode_layers_bf16 (groups None) or decode_layers_int."""

    attention: list  # per layer: norm, q/k/v (or the 8 int tensors), q/k norms, o, the caches
    moe: list  # per layer: norm, router, the experts' address table
    inter: int  # the experts' intermediate size (one for every layer)
    groups: tuple | None  # (attention group, experts group) for int8 (0) / int4; None: bf16


@dataclass(frozen=True, eq=False)
class DecodePlan:
    """The route one decode token takes, why, and the native calls' operands.

    attention, moe: per layer, the native attention's / fused MoE layer's operands, or None (that
    layer's reference attention / MoE or dense MLP). step: the whole step's operands (native_step).
    """

    route: str  # NATIVE_STEP, NATIVE_LAYERS or REFERENCE
    why: str  # one line: what decided it (or kept a faster route out)
    attention: tuple = ()
    moe: tuple = ()
    step: NativeStep | None = None

    def describe(self) -> str:
        return f"{self.route} ({self.why})"


def plan_decode(args: ModelArgs, w: dict, qkv: dict, experts, expert_fn, kv, dtype: torch.dtype,
                streamed: frozenset, watched: str | None, *, qkv_bias: dict | None = None, whole_step: bool = True,
                native_attention: bool = True, fused_moe: bool = True) -> DecodePlan:
    """The decode route of a model whose resident weights are `w` (q/k/v fused per layer: `qkv`) over
    `kv` (their biases fused likewise: `qkv_bias`, where they have them). streamed: the layers read per
    token; watched: what needs each layer's expert ids (the fused
    MoE then stays off), or None. whole_step / native_attention / fused_moe: False keeps that native
    call out (tests and benchmarks/time/decode_profile.py compare the routes so)."""
    n = args.num_layers
    none = (None,) * n
    if not native.ready:
        return DecodePlan(REFERENCE, "native kernels not loaded", none, none)
    embed = w.get("model.embed_tokens.weight")
    if dtype is not torch.bfloat16 or type(embed) is not torch.Tensor or embed.dtype is not torch.bfloat16:
        return DecodePlan(REFERENCE, f"compute dtype {str(dtype).replace('torch.', '')}: the native decode is bf16",
                          none, none)
    attention = tuple(_attention_entry(args, w, qkv, qkv_bias or {}, kv, layer) if native_attention
                      and layer not in streamed
                      else None for layer in range(n))
    fused = tuple(moe.resident_layer(args, w, experts, layer, expert_fn)
                  if fused_moe and watched is None and layer not in streamed else None for layer in range(n))
    why = []
    if streamed:
        why.append(f"{len(streamed)} of {n} layers read from disk per token")
    if watched is not None:
        why.append(f"{watched} needs each layer's expert ids: no fused MoE")
    step = None
    if whole_step and type(kv) is KVCache:  # MLA's latent cache, gpt-oss's windowed one: per-layer paths
        step = _step_operands(args, attention, fused)
    if step is not None:
        kind = "bf16" if step.groups is None else f"int8/int4 groups {step.groups}"
        return DecodePlan(NATIVE_STEP, f"every layer's attention and fused MoE in one native call ({kind})",
                          attention, fused, step)
    why += [f"{name} turned off" for name, on in (("the whole step's call", whole_step),
                                                  ("native attention", native_attention), ("fused MoE", fused_moe))
            if not on]
    native_att, native_moe = n - attention.count(None), n - fused.count(None)
    if not native_att and native_attention:
        why.append(_why_no_native_attention(args, kv))
    if not native_moe and fused_moe and watched is None:
        why.append(_why_no_fused_moe(args, experts, expert_fn))
    if not native_att and not native_moe:
        return DecodePlan(REFERENCE, "; ".join(why), none, none)
    why.append(f"native attention in {native_att} of {n} layers, fused MoE in {native_moe}")
    if whole_step and native_att == native_moe == n:
        why.append("no whole step: " + ("the architecture's own KV cache" if type(kv) is not KVCache
                                        else "the layers' calls differ in kind (bf16 / int8 / int4) or size"))
    return DecodePlan(NATIVE_LAYERS, "; ".join(why), attention, fused)


def _why_no_native_attention(args: ModelArgs, kv) -> str:
    if args.attention_impl is not None:
        return f"{type(args.attention_impl).__name__} has no native attention"
    if type(kv) is KVCache and _native_cache(kv.k[0]) is None:
        return "the KV cache's storage has no native attention"
    return "no layer's attention weights fit the native attention"


def _why_no_fused_moe(args: ModelArgs, experts, expert_fn) -> str:
    if not args.is_moe:
        return "a dense model"
    if args.router is not None or expert_fn is not swiglu_expert:
        return "the architecture's router or experts have no fused MoE"
    if args.shared_experts_intermediate_size or args.shared_expert_intermediate_size:
        return "shared experts have no fused MoE"
    if experts is None or experts.streams:
        return "experts stream from disk: no fused MoE"
    return "no layer's experts fit the fused MoE"


def _native_cache(rows) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows or codes, scales) of one layer's K or V cache as the native attention reads it: a
    contiguous bf16 tensor (no scales), or a QuantizedRows read back as bf16 (its int8 / e4m3 codes
    and fp32 scales: the native op quantizes as QuantizedRows does and applies the scales per row); else None."""
    if type(rows) is torch.Tensor:
        return (rows, native.NO_SCALES) if rows.dtype is torch.bfloat16 and rows.is_contiguous() else None
    if type(rows) is QuantizedRows and rows.dtype is torch.bfloat16:
        return rows.codes, rows.scales
    return None


def _attention_entry(args: ModelArgs, w: dict, qkv: dict, qkv_bias: dict, kv, layer: int) -> NativeAttention | None:
    operands = _attention_operands(args, w, qkv, qkv_bias, layer)
    if operands is None:
        return None  # (before the cache: MLA's compressed cache has no k/v rows)
    if type(operands) is attention_quant.QuantAttention and not native.int_ready:
        return None
    k_cache, v_cache = _native_cache(kv.k[layer]), _native_cache(kv.v[layer])
    if k_cache is None or v_cache is None:
        return None
    return NativeAttention(operands, k_cache, v_cache)


def _attention_operands(a: ModelArgs, w: dict, qkv: dict, qkv_bias: dict, layer: int):
    """(input norm, fused q/k/v, q norm, k norm, o_proj, fused q/k/v bias or None, rotary dims or 0)
    of a layer the native attention decode covers (plain attention, q/k/v fused at load: bf16, with
    or without biases; no clipping; no norm or a per-head one; rope over the whole head or an even
    part of it); for int8 / int4 projections (scope all) the layer's attention_quant.QuantAttention,
    where the native int attention covers it; else None."""
    p = layer_prefix(layer)
    fused_qkv = qkv.get(layer)
    if fused_qkv is None:
        return attention_quant.layer_operands(a, w, layer) if native.int_ready else None
    rot = a.rotary_dim if a.rotary_dim and a.rotary_dim != a.head_dim else 0
    if a.clip_qkv is not None or a.qk_norm not in ("none", "head") or a.head_dim % 2 or rot % 2:
        return None
    none = torch.empty(0, dtype=torch.bfloat16)
    names = [f"{p}.input_layernorm.weight", f"{p}.self_attn.o_proj.weight"]
    if a.qk_norm == "head":
        names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
    tensors = [w.get(n) for n in names]
    if not all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.is_contiguous() for t in tensors):
        return None
    norm_w, o_w, q_norm, k_norm = (tensors + [none, none])[:4]
    return norm_w, fused_qkv, q_norm, k_norm, o_w, qkv_bias.get(layer), rot


def _step_operands(args: ModelArgs, attention: tuple, fused: tuple) -> NativeStep | None:
    """The whole step's operands where every layer takes both native per-layer calls, of one kind
    (bf16, or int8 / int4 with one group for the attention and one for the experts) and one expert
    intermediate size; else None."""
    att_tensors, moe_tensors, inters, kinds = [], [], set(), set()
    for layer in range(args.num_layers):
        entry, layer_moe = attention[layer], fused[layer]
        if entry is None or layer_moe is None:
            return None
        caches = [entry.k_cache[0], entry.v_cache[0], entry.k_cache[1], entry.v_cache[1]]
        op = entry.operands
        if type(op) is attention_quant.QuantAttention and type(layer_moe) is ResidentQuantMoeLayer:
            att_tensors += [op.norm_w, op.q_norm, op.k_norm, *op.proj, *caches]
            kinds.add((op.group, layer_moe.group))
        elif type(op) is tuple and type(layer_moe) is moe.ResidentMoeLayer:
            norm_w, qkv, q_norm, k_norm, o_w, qkv_b, rot = op
            if qkv_b is not None or rot:  # the whole step's attention: no biases, rope over the whole head
                return None
            att_tensors += [norm_w, qkv, q_norm, k_norm, o_w, *caches]
            kinds.add(None)
        else:
            return None
        moe_tensors += [layer_moe.norm_w, layer_moe.router_w, layer_moe.table]
        inters.add(layer_moe.inter)
    if len(inters) != 1 or len(kinds) != 1:
        return None
    groups = kinds.pop()
    if groups is not None and not native.int_ready:
        return None
    return NativeStep(att_tensors, moe_tensors, inters.pop(), groups)


def native_step(step: NativeStep, args: ModelArgs, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                start_pos: int, trim: tuple) -> torch.Tensor:
    """Every layer of one token: x [1, H] → [1, H], K/V written at start_pos. trim: trim_operands(...)."""
    a = args
    if step.groups is not None:
        return native.decode_layers_int(x, step.attention, step.moe, cos, sin, start_pos, a.num_heads,
                                        a.num_kv_heads, a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob), step.inter,
                                        *step.groups, *trim)
    return native.decode_layers(x, step.attention, step.moe, cos, sin, start_pos, a.num_heads, a.num_kv_heads,
                                a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob), step.inter, *trim)


def native_step_rows(steps: list[NativeStep], args: ModelArgs, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, positions: list[int], row_cache: list[int], trim: tuple) -> torch.Tensor:
    """Every layer of M tokens in one native call: x [M, H] → [M, H], row r at positions[r] of the
    cache whose plan step is steps[row_cache[r]] (one step per distinct cache, all of one kind), its
    K/V written there; each row native_step's bits on that row alone, each layer's weights read once."""
    a, step = args, steps[0]
    attention = step.attention if len(steps) == 1 else [t for s in steps for t in s.attention]
    if step.groups is not None:
        return native.decode_layers_int_rows(x, attention, row_cache, step.moe, cos, sin, positions, a.num_heads,
                                             a.num_kv_heads, a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob),
                                             step.inter, *step.groups, *trim)
    return native.decode_layers_rows(x, attention, row_cache, step.moe, cos, sin, positions, a.num_heads,
                                     a.num_kv_heads, a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob), step.inter,
                                     *trim)


def native_attention(entry: NativeAttention, args: ModelArgs, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, start_pos: int) -> torch.Tensor:
    """x + attention(rms_norm(x)) for one token: x [1, H] → [1, H], K/V written at start_pos."""
    a, op = args, entry.operands
    (k, k_scales), (v, v_scales) = entry.k_cache, entry.v_cache
    if type(op) is attention_quant.QuantAttention:  # int8 / int4 projections
        return native.attention_decode_int(x, op.norm_w, a.rms_norm_eps, op.proj, op.group, op.q_norm, op.k_norm,
                                           cos, sin, k, v, start_pos, a.num_heads, a.num_kv_heads, k_scales, v_scales)
    norm_w, qkv, q_norm, k_norm, o_w, qkv_b, rot = op
    return native.attention_decode(x, norm_w, a.rms_norm_eps, qkv, q_norm, k_norm, cos, sin, k, v, start_pos,
                                   a.num_heads, a.num_kv_heads, o_w, k_scales, v_scales, qkv_b, rot)
