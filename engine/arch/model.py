"""The forward pass (after gpt-fast's model.py): the transformer over resident dense weights
and an ExpertStore for routed experts.

Supported `model_type`s: qwen3_moe, qwen2_moe, mixtral, olmoe (MoE) and llama, qwen2, qwen3
(dense), plus deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss through the strategy objects on
ModelArgs (each architecture's parse in engine/arch/families/ builds them; engine/arch/mla.py,
engine/arch/router.py, engine/arch/gpt_oss_layers.py implement them). The parts live beside this file, one job each:

    args.py        ModelArgs; tensor names (registry.py: config.json → ModelArgs)
    rope.py        rotary embeddings
    layers.py      RMSNorm, SwiGLU, routing, KV cache
    moe.py         the routed experts of one MoE layer (decode and prefill paths)
    model.py       this file: attention, the layer loop, lookahead, layer streaming

Shape legend used in comments:
    T  tokens in this forward call        S  positions attended (start + T)
    H  hidden size                        D  head_dim
    Nq query heads   Nkv key/value heads  V  vocab
    E  routed experts   K  experts per token (top-k)   I  expert intermediate size

Weights are plain tensors in dicts, not nn.Modules: the runtime decides where each one lives
(resident, streamed from disk, cached), and the math here only asks for them. Routed experts
come from an ExpertStore (engine/movement/store.py), the seam between this file and the streaming runtime;
the MoE layer hands each expert's weights to one function, `Transformer.expert_fn`, which a new
weight format replaces together with the layout's bytes → weights step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.arch import attention_quant, moe
from engine import native
from engine.arch.kvquant import QuantizedRows
from engine.arch.moe_quant import ResidentQuantMoeLayer
from engine.arch.layers import KVCache, rms_norm, route_layer, swiglu, swiglu_expert
from engine.arch.args import ModelArgs, layer_prefix
from engine.weights.stored import linear
from engine.arch.router import trim_operands
from engine.arch.rope import RopeTable, apply_rope, rope_cos_sin, rope_inv_freq


def _native_cache(rows) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows or codes, scales) of one layer's K or V cache as the native attention reads it: a
    contiguous bf16 tensor (no scales), or a QuantizedRows read back as bf16 (its int8 / e4m3 codes
    and fp32 scales: the native op quantizes as QuantizedRows does and applies the scales per row); else None."""
    if type(rows) is torch.Tensor:
        return (rows, native.NO_SCALES) if rows.dtype is torch.bfloat16 and rows.is_contiguous() else None
    if type(rows) is QuantizedRows and rows.dtype is torch.bfloat16:
        return rows.codes, rows.scales
    return None


def _adjacent_rows(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The row-concatenation of `parts` as a view, where they already lie back to back in one
    storage (the runtime loads a layer's q, k, v so, into its huge-page arena), else None."""
    first = parts[0]
    storage, offset = first.untyped_storage(), first.storage_offset()
    for t in parts:
        if (not t.is_contiguous() or t.dim() != 2 or t.shape[1] != first.shape[1]
                or t.untyped_storage().data_ptr() != storage.data_ptr() or t.storage_offset() != offset):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in parts)
    return torch.empty(0, dtype=first.dtype).set_(storage, first.storage_offset(), (rows, first.shape[1]))


class Transformer:
    """Forward pass over resident dense weights and an ExpertStore for routed experts."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], experts, dtype: torch.dtype):
        self.args = args
        self.w = weights
        self.experts = experts
        self.dtype = dtype
        self.lm_head = weights["model.embed_tokens.weight"] if args.tie_word_embeddings else weights["lm_head.weight"]
        self._rope_seq = 0
        self._inv_freq, self._rope_scale = rope_inv_freq(args)
        self._rope_table: RopeTable | None = None  # decode's cos/sin rows (not for dynamic NTK: it changes)
        # Router lookahead: after layer L's attention, layer L+1's router applied to the same
        # hidden state predicts L+1's experts well enough to start their reads early.
        self.lookahead_depth = 0
        # Layer streaming (dense models over budget): these layers are read per token.
        self.layer_source = None
        self.streamed_layers: list[int] = []
        self._streamed: frozenset[int] = frozenset()  # membership test on the per-layer path
        # What computes one routed expert from its weights: the architecture's own (gpt_oss:
        # biases + clamped SwiGLU), else SwiGLU over what layout.tensors_from_buffers made.
        self.expert_fn = swiglu_expert if args.expert_impl is None else args.expert_impl.forward
        self.routing_log: list[list[torch.Tensor]] | None = None  # per layer, ids [T, K] per call
        # Lossy routing (EngineConfig.top_k_reduction / expert_threshold): None = the rule as is.
        # The MoE layer and lookahead both apply it, so lookahead predicts the experts used.
        self.routing_trim = None
        self._qkv = self._fuse_qkv(weights)
        self._fused_moe: dict[int, moe.ResidentMoeLayer | None] = {}  # per layer, built at its first decode
        self._fused_attention: dict[int, tuple | None] = {}  # per layer: the native attention's operands
        # The whole step's layers as one native call where every layer qualifies (_decode_step);
        # False keeps the per-layer calls (benchmarks/time/decode_profile.py times the layers' parts so).
        self.step_loop = True
        self._step_operands: tuple | None = None  # (kv, its cache tensors, decode_layers' operands)

    def _fuse_qkv(self, weights: dict) -> dict[int, torch.Tensor]:
        """Per layer, q/k/v projections as one [Nq*D + 2*Nkv*D, H] matrix (concatenated once,
        here), so decode runs one native call for the three. The dict's q/k/v entries become
        row views of it: the same bytes, no second copy, and prefill's F.linear reads them as
        before. Only for plain bf16 weights without biases (the native path's condition);
        layers read per token (layer streaming) are not in `weights` and stay apart."""
        a = self.args
        if a.attention_impl is not None or self.dtype is not torch.bfloat16:
            return {}
        fused = {}
        for layer in range(a.num_layers):
            p = f"{layer_prefix(layer)}.self_attn"
            names = [f"{p}.{n}_proj.weight" for n in "qkv"]
            parts = [weights.get(n) for n in names]
            if (any(type(t) is not torch.Tensor or t.dtype is not torch.bfloat16 for t in parts)
                    or any(f"{p}.{n}_proj.bias" in weights for n in "qkv")):
                continue
            fused[layer] = _adjacent_rows(parts)
            if fused[layer] is None:
                fused[layer] = torch.cat(parts)
            for name, view in zip(names, fused[layer].split([t.shape[0] for t in parts])):
                weights[name] = view
        return fused

    def _rope(self, start_pos: int, T: int):
        if self.args.rope.get("rope_type") == "dynamic":
            seq = start_pos + T
            if seq > self._rope_seq:  # dynamic NTK only ever grows, as in transformers
                self._rope_seq = seq
                self._inv_freq, self._rope_scale = rope_inv_freq(self.args, seq)
        elif T == 1:  # decode: a row of the table, no per-token ops
            if self._rope_table is None:
                self._rope_table = RopeTable(self._inv_freq, self._rope_scale, self.dtype)
            return self._rope_table.row(start_pos)
        return rope_cos_sin(self._inv_freq, self._rope_scale, torch.arange(start_pos, start_pos + T), self.dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start_pos: int, kv: KVCache, last_only: bool = False) -> torch.Tensor:
        """tokens: [T] int64 → logits [T, V] (fp32), writing K/V at positions start_pos..start_pos+T.

        last_only: logits of the last position only ([1, V]); generation needs no more, and the
        lm_head is the largest matmul of a prefill.
        """
        T = tokens.shape[0]
        if start_pos + T > kv.ctx_size:
            raise ValueError(f"{start_pos + T} positions exceed ctx_size {kv.ctx_size}")
        cos, sin = self._rope(start_pos, T)
        mask = self._mask(start_pos, T)
        x = F.embedding(tokens, self.w["model.embed_tokens.weight"])  # [T, H]
        step = self._decode_step(x, start_pos, kv, cos, sin, mask)  # every layer in one native call, or None
        if step is not None:
            x = step
        else:
            for layer in range(self.args.num_layers):
                x = self._layer(layer, x, start_pos, kv, cos, sin, mask)
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.w["model.norm.weight"], self.args.rms_norm_eps)
        return linear(x, self.lm_head).float()

    def _decode_step(self, x, start_pos, kv, cos, sin, mask):
        """Every layer of one bf16 token as one native call (decode_step.cpp: per layer the attention
        half, then the fused MoE layer; decode_step_int.cpp where every projection and expert is int8 /
        int4), where every layer would take both per-layer native calls (_decode_attention,
        _resident_moe) anyway; else None. The same bits as those calls."""
        if (x.shape[0] != 1 or mask is not None or not native.ready or x.dtype is not torch.bfloat16
                or cos.dtype is not torch.bfloat16 or self._streamed or self.routing_log is not None
                or self.lookahead_depth or not self.step_loop
                or type(kv) is not KVCache):  # MLA's latent cache, gpt-oss's windowed one: per-layer paths
            return None
        operands = self._step_operands
        if operands is None or operands[0] is not kv or any(a is not b for a, b in zip(operands[1], kv.k + kv.v)):
            operands = self._step_operands = (kv, list(kv.k + kv.v), self._step_lists(kv))
        if operands[2] is None:
            return None
        attention, moe_operands, inter, groups = operands[2]
        a = self.args
        if groups is not None:  # int8 / int4 projections and experts (their per-layer ops' own condition)
            if not native.int_ready:
                return None
            return native.decode_layers_int(x, attention, moe_operands, cos, sin, start_pos, a.num_heads,
                                            a.num_kv_heads, a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob), inter,
                                            *groups, *trim_operands(self.routing_trim))
        return native.decode_layers(x, attention, moe_operands, cos, sin, start_pos, a.num_heads, a.num_kv_heads,
                                    a.rms_norm_eps, a.top_k, bool(a.norm_topk_prob), inter,
                                    *trim_operands(self.routing_trim))  # the trim applied inside

    def _step_lists(self, kv) -> tuple | None:
        """(attention tensors, MoE tensors, inter, groups) for decode_layers_bf16 (groups None) or, every
        layer's projections and experts int8 / int4, decode_layers_int (groups: the attention's and the
        experts' kind); None where a layer would not take both fused per-layer calls, or the layers'
        kinds differ (operands decided once per layer, as those calls do)."""
        attention, moe_operands, inters, kinds = [], [], set(), set()
        for layer in range(self.args.num_layers):
            if layer not in self._fused_attention:
                self._fused_attention[layer] = self._attention_operands(layer)
            if layer not in self._fused_moe:
                self._fused_moe[layer] = moe.resident_layer(self.args, self.w, self.experts, layer, self.expert_fn)
            att, fused = self._fused_attention[layer], self._fused_moe[layer]
            k_cache, v_cache = _native_cache(kv.k[layer]), _native_cache(kv.v[layer])
            if att is None or fused is None or k_cache is None or v_cache is None:
                return None
            caches = [k_cache[0], v_cache[0], k_cache[1], v_cache[1]]
            if type(att) is attention_quant.QuantAttention and type(fused) is ResidentQuantMoeLayer:
                attention += [att.norm_w, att.q_norm, att.k_norm, *att.proj, *caches]
                kinds.add((att.group, fused.group))
            elif type(att) is tuple and type(fused) is moe.ResidentMoeLayer:
                norm_w, qkv, q_norm, k_norm, o_w = att
                attention += [norm_w, qkv, q_norm, k_norm, o_w, *caches]
                kinds.add(None)
            else:
                return None
            moe_operands += [fused.norm_w, fused.router_w, fused.table]
            inters.add(fused.inter)
        if len(inters) != 1 or len(kinds) != 1:
            return None
        return attention, moe_operands, inters.pop(), kinds.pop()

    def _mask(self, start_pos: int, T: int) -> torch.Tensor | None:
        window = self.args.sliding_window
        S = start_pos + T
        if T == 1 and (window is None or S <= window):
            return None  # one new token sees every cached position
        q_pos = torch.arange(start_pos, S)[:, None]
        k_pos = torch.arange(S)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        return allowed  # [T, S] bool

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        """This layer's weights: the resident dict, or (layer streaming) a fresh read."""
        if layer not in self._streamed:
            return self.w
        # Reads for the next streamed layers (wrapping to the next token's) are in flight while
        # this one computes.
        for step in range(1, self.lookahead_depth + 1):
            ahead = (layer + step) % self.args.num_layers
            if ahead in self._streamed:
                self.layer_source.hint_layer(ahead)
        return self.layer_source.layer_weights(layer)

    def stream_layers(self, source, layers: list[int]) -> None:
        """Read `layers` from `source` per forward pass instead of keeping them resident."""
        self.layer_source, self.streamed_layers = source, list(layers)
        self._streamed = frozenset(layers)

    def _layer(self, layer, x, start_pos, kv, cos, sin, mask):
        p, a = layer_prefix(layer), self.args
        w = self._layer_weights(layer)
        h = self._decode_attention(layer, w, x, start_pos, kv, cos, sin, mask)  # one native call, or None
        if h is None:
            h = x + self._attention(layer, w, rms_norm(x, w[f"{p}.input_layernorm.weight"], a.rms_norm_eps),
                                    start_pos, kv, cos, sin, mask)
        fused = self._resident_moe(layer, w, h)
        if fused is not None:
            return self._resident_moe_call(layer, fused, h)
        normed = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)
        self._lookahead(layer, normed, h)
        if a.is_moe_layer(layer):
            return h + self._moe(layer, w, normed)
        return h + swiglu(normed, w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"],
                          w[f"{p}.mlp.down_proj.weight"])

    def _resident_moe(self, layer: int, w: dict, h: torch.Tensor):
        """The fused decode of this MoE layer (moe.ResidentMoeLayer) when it applies to this call:
        one bf16 token, native ops loaded, resident weights, and nothing that watches the routing
        (routing log, lookahead); else None. A routing trim runs inside the fused call (the same
        experts and weights as RoutingTrim.apply). Whether the layer itself qualifies is decided
        once per layer."""
        if (h.shape[0] != 1 or not native.ready or h.dtype is not torch.bfloat16 or w is not self.w
                or self.routing_log is not None or self.lookahead_depth):
            return None
        if layer not in self._fused_moe:
            self._fused_moe[layer] = moe.resident_layer(self.args, self.w, self.experts, layer, self.expert_fn)
        return self._fused_moe[layer]

    def _decode_attention(self, layer, w, x, start_pos, kv, cos, sin, mask):
        """x + attention(rms_norm(x)) for one bf16 token as one native call (attention_decode.cpp:
        norm, q/k/v, per-head norms, rope, the K/V write, attention, o_proj, residual), or None where
        it does not apply (then _attention). Whether the layer qualifies is decided once per layer."""
        if (x.shape[0] != 1 or mask is not None or not native.ready or w is not self.w
                or x.dtype is not torch.bfloat16 or cos.dtype is not torch.bfloat16):
            return None
        if layer not in self._fused_attention:
            self._fused_attention[layer] = self._attention_operands(layer)
        operands = self._fused_attention[layer]
        if operands is None:
            return None  # (before the cache: MLA's compressed cache has no k/v rows)
        k_cache, v_cache = _native_cache(kv.k[layer]), _native_cache(kv.v[layer])
        if k_cache is None or v_cache is None:
            return None
        a = self.args
        if type(operands) is attention_quant.QuantAttention:  # int8 / int4 projections
            if not native.int_ready:
                return None
            return native.attention_decode_int(x, operands.norm_w, a.rms_norm_eps, operands.proj, operands.group,
                                               operands.q_norm, operands.k_norm, cos, sin, k_cache[0], v_cache[0],
                                               start_pos, a.num_heads, a.num_kv_heads, k_cache[1], v_cache[1])
        norm_w, qkv, q_norm, k_norm, o_w = operands
        return native.attention_decode(x, norm_w, a.rms_norm_eps, qkv, q_norm, k_norm, cos, sin, k_cache[0], v_cache[0],
                                       start_pos, a.num_heads, a.num_kv_heads, o_w, k_cache[1], v_cache[1])

    def _attention_operands(self, layer: int):
        """(input norm, fused q/k/v, q norm, k norm, o_proj) of a layer the native attention decode
        covers (plain attention, q/k/v fused at load: bf16, no biases; no clipping; no norm or a per-head
        one; rope over the whole head); for int8 / int4 projections (scope all) the layer's
        attention_quant.QuantAttention, where the native int attention covers it; else None."""
        a, p = self.args, layer_prefix(layer)
        qkv = self._qkv.get(layer)
        if qkv is None:
            return attention_quant.layer_operands(a, self.w, layer) if native.int_ready else None
        if (a.clip_qkv is not None or a.qk_norm not in ("none", "head") or a.head_dim % 2
                or (a.rotary_dim or a.head_dim) != a.head_dim):
            return None
        none = torch.empty(0, dtype=torch.bfloat16)
        names = [f"{p}.input_layernorm.weight", f"{p}.self_attn.o_proj.weight"]
        if a.qk_norm == "head":
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        tensors = [self.w.get(n) for n in names]
        if not all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.is_contiguous() for t in tensors):
            return None
        norm_w, o_w, q_norm, k_norm = (tensors + [none, none])[:4]
        return norm_w, qkv, q_norm, k_norm, o_w

    def _resident_moe_call(self, layer: int, fused, h: torch.Tensor) -> torch.Tensor:
        # norm, router, top-k, experts, sum and residual: one native call (a seam of its own for
        # benchmarks/time/decode_profile.py, which times the layer's parts by method)
        return fused(h, self.routing_trim)

    def _attention(self, layer, w, x, start_pos, kv, cos, sin, mask):
        p, a = f"{layer_prefix(layer)}.self_attn", self.args
        if a.attention_impl is not None:
            return a.attention_impl.forward(w, p, layer, x, start_pos, kv, cos, sin, mask)
        T = x.shape[0]
        qkv = self._qkv.get(layer) if T == 1 and native.ready and x.dtype is torch.bfloat16 else None
        if qkv is not None and w is self.w:  # one native call; its rows are q, k, v's own (same bits)
            q, k, v = linear(x, qkv).split(
                [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], dim=1)
        else:
            q = linear(x, w[f"{p}.q_proj.weight"], w.get(f"{p}.q_proj.bias"))  # [T, Nq*D]
            k = linear(x, w[f"{p}.k_proj.weight"], w.get(f"{p}.k_proj.bias"))  # [T, Nkv*D]
            v = linear(x, w[f"{p}.v_proj.weight"], w.get(f"{p}.v_proj.bias"))
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        if a.qk_norm == "full":
            q = rms_norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        q = q.view(T, a.num_heads, a.head_dim).transpose(0, 1)  # [Nq, T, D]
        k = k.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)  # [Nkv, T, D]
        v = v.view(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        if a.qk_norm == "head":
            q = rms_norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = rms_norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        S = start_pos + T
        kv.k[layer][:, start_pos:S] = k
        kv.v[layer][:, start_pos:S] = v
        keys = kv.k[layer][:, :S].to(q.dtype)  # [Nkv, S, D]
        values = kv.v[layer][:, :S].to(q.dtype)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads)
        out = out.squeeze(0).transpose(0, 1).reshape(T, a.num_heads * a.head_dim)  # [T, Nq*D]
        return linear(out, w[f"{p}.o_proj.weight"])

    def _lookahead(self, layer: int, normed: torch.Tensor, residual: torch.Tensor) -> None:
        if self.experts is None or not self.lookahead_depth:
            return
        a = self.args
        for ahead in range(1, self.lookahead_depth + 1):
            target = layer + ahead
            if target >= a.num_layers or not a.is_moe_layer(target):
                continue
            tp = layer_prefix(target)
            # The target layer's own norm and router on today's residual stream: cheap (an
            # [T,H]x[H,E] product) and right most of the time, because the residual changes
            # slowly from layer to layer.
            guess_in = rms_norm(residual, self.w[f"{tp}.post_attention_layernorm.weight"], a.rms_norm_eps)
            ids, _ = route_layer(a, self.w, target, guess_in, self.routing_trim)  # the architecture's own rule
            # -1: a slot the routing threshold skipped (several tokens only)
            predicted = ids[0].tolist() if ids.shape[0] == 1 else [e for e in torch.unique(ids).tolist() if e >= 0]
            self.experts.hint_experts(target, predicted)

    def _moe(self, layer: int, w: dict, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]
        p, a = layer_prefix(layer), self.args
        ids, weights = route_layer(a, w, layer, x, self.routing_trim)  # [T, K] each
        if self.routing_log is not None:
            self.routing_log[layer].append(ids)
        if x.shape[0] == 1:
            out = moe.routed_decode(self.experts, self.expert_fn, layer, x, ids, weights)
        else:
            out = moe.routed_prefill(self.experts, self.expert_fn, layer, x, ids, weights)
        if a.shared_experts_intermediate_size:  # deepseek-style: resident, always on, no gate
            out = out + swiglu(x, *(w[f"{p}.mlp.shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
        if a.shared_expert_intermediate_size:
            shared = swiglu(x, w[f"{p}.mlp.shared_expert.gate_proj.weight"],
                            w[f"{p}.mlp.shared_expert.up_proj.weight"],
                            w[f"{p}.mlp.shared_expert.down_proj.weight"])
            out = out + torch.sigmoid(F.linear(x, w[f"{p}.mlp.shared_expert_gate.weight"])) * shared
        return out
