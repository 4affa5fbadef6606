"""The forward pass (after gpt-fast's model.py): the transformer over resident dense weights
and an ExpertStore for routed experts.

Supported `model_type`s: qwen3_moe, qwen2_moe, mixtral, olmoe (MoE) and llama, qwen2, qwen3
(dense), plus deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss through the strategy objects on
ModelArgs (each architecture's parse in engine/arch/families/ builds them; engine/arch/mla.py,
engine/arch/router.py, engine/arch/gpt_oss_layers.py implement them). The parts this file uses,
one job each:

    args.py          ModelArgs; tensor names (registry.py: config.json → ModelArgs)
    rope.py          rotary embeddings
    layers.py        RMSNorm, SwiGLU, routing, KV cache
    moe.py           the routed experts of one MoE layer (decode and prefill paths)
    decode_plan.py   the route a decode token takes (native whole step, native per layer, or this
                     file's reference), decided once per engine, and the native calls' operands
    router.py        the routing rules beyond softmax top-k; the lossy routing trim
    model.py         this file: the reference math (attention, MoE, dense MLP), the layer loop,
                     lookahead, layer streaming
    prefill.py       a prompt's group through one layer at a time (each expert read once per layer)
    decode_rows.py   several decode tokens in one step (B sequences, or a speculative verify): each
                     row's solo bits, each routed expert fetched once for every row
and below them engine/weights (`linear` over plain, int8 / int4 and FP8 weights) and engine/native
(the kernels; this file asks it only whether they are loaded, for the fused q/k/v of one token).

Shape legend used in comments:
    T  tokens in this forward call        S  positions attended (start + T)
    H  hidden size                        D  head_dim
    Nq query heads   Nkv key/value heads  V  vocab
    E  routed experts   K  experts per token (top-k)   I  expert intermediate size
(one sequence: there is no batch axis)

Weights are plain tensors in dicts, not nn.Modules: the runtime decides where each one lives
(resident, streamed from disk, cached), and the math here only asks for them. Routed experts
come from an ExpertStore (engine/movement/store.py), the seam between this file and the streaming runtime;
the MoE layer hands each expert's weights to one function, `Transformer.expert_fn`, which a new
weight format replaces together with the layout's bytes → weights step.

Everything that sets how the model runs (the KV cache, lookahead, the routing trim, the layers
streamed from disk) is a constructor argument (and record_routing a method); the decode route follows from it once
(`Transformer.plan`, engine/arch/decode_plan.py), not per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import native
import weakref

from engine.arch import decode_plan, decode_rows, moe, prefill
from engine.arch.args import ModelArgs, layer_prefix
from engine.arch.decode_plan import DecodePlan
from engine.arch.layers import KVCache, rms_norm, route_layer, swiglu, swiglu_expert
from engine.arch.rope import RopeTable, apply_rope, rope_cos_sin, rope_inv_freq
from engine.arch.router import RoutingTrim, trim_operands
from engine.weights.stored import linear


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
    """Forward pass over resident dense weights and an ExpertStore for routed experts.

    kv: the KV cache the engine decodes into (the decode plan holds its tensors).
    prefetch_depth: after layer L's attention, hint the experts (or the streamed layers) of the
    next layers to the store, so their reads start early; 0 = off.
    routing_trim: lossy routing (EngineConfig.top_k_reduction / expert_threshold), or None.
    layer_source, streamed_layers: layer streaming (dense models over budget): these layers'
    weights are read from the source per token instead of kept in `weights`.
    """

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], experts, dtype: torch.dtype,
                 kv=None, *, prefetch_depth: int = 0, routing_trim: RoutingTrim | None = None,
                 layer_source=None, streamed_layers: list[int] = ()):
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
        self.prefetch_depth = prefetch_depth
        self.layer_source = layer_source
        self.streamed_layers = list(streamed_layers)
        self._streamed = frozenset(streamed_layers)  # membership test on the per-layer path
        # What computes one routed expert from its weights: the architecture's own (gpt_oss:
        # biases + clamped SwiGLU), else SwiGLU over what layout.tensors_from_buffers made.
        self.expert_fn = swiglu_expert if args.expert_impl is None else args.expert_impl.forward
        self.routing_log: list[list[torch.Tensor]] | None = None  # per layer, ids [T, K] per call (record_routing)
        # The MoE layer and lookahead both apply the trim, so lookahead predicts the experts used;
        # the fused native calls apply it inside (the same experts and weights).
        self.routing_trim = routing_trim
        self._qkv, self._qkv_bias = self._fuse_qkv(weights)
        self._no_native = (None,) * args.num_layers  # a prefill's per-layer native calls: none
        self._route_limits: dict = {}
        self._plan_kv = None
        self.plan: DecodePlan | None = None
        # The decode plans of other caches (batched decode: one per running sequence), made once each,
        # by the cache's id while it lives.
        self._other_plans: dict[int, DecodePlan] = {}
        if kv is not None:
            self.plan_decode(kv)

    def plan_decode(self, kv, **limits) -> DecodePlan:
        """Decide the decode route over `kv` (engine/arch/decode_plan.py) and keep it: the model calls
        this when built and when what decides the route changes (record_routing); later forward calls
        only follow it. limits (whole_step, native_attention, fused_moe = False): keep a native call
        out, for tests and benchmarks that compare the routes; they hold until the next call."""
        self._route_limits, self._plan_kv = limits, kv
        self._other_plans.clear()  # made under the old route: decided again when next asked
        self.plan = decode_plan.plan_decode(self.args, self.w, self._qkv, self.experts, self.expert_fn, kv,
                                            self.dtype, self._streamed, self._watched(), qkv_bias=self._qkv_bias,
                                            **limits)
        return self.plan

    def _watched(self) -> str | None:
        """What needs each layer's expert ids, which the fused MoE keeps inside (dense models: no MoE to fuse)."""
        return ("the routing log" if self.routing_log is not None
                else "lookahead" if self.prefetch_depth and self.experts is not None else None)

    def plan_for(self, kv) -> DecodePlan:
        """The decode plan over `kv`: the model's own cache's, or another cache's (a batched sequence's),
        made the first time that cache decodes and kept while it lives. The same route decision as
        plan_decode (its limits too); only the operands that point into the cache differ."""
        if kv is self._plan_kv or self._plan_kv is None:
            return self.plan if kv is self._plan_kv else self.plan_decode(kv, **self._route_limits)
        held = self._other_plans.get(id(kv))
        if held is not None:
            return held
        plan = decode_plan.plan_decode(self.args, self.w, self._qkv, self.experts, self.expert_fn, kv,
                                       self.dtype, self._streamed, self._watched(), qkv_bias=self._qkv_bias,
                                       **self._route_limits)
        self._other_plans[id(kv)] = plan
        # The plan holds the cache's tensors (the native calls' operands): dropped with the cache, so a
        # finished sequence's KV is freed with it (and its id, which a new cache may take, forgotten).
        weakref.finalize(kv, self._other_plans.pop, id(kv), None)
        return plan

    def record_routing(self, on: bool = True) -> None:
        """Log every layer's expert ids [T, K] per call into routing_log (a fresh log), or stop (on=False).
        The fused MoE calls keep the ids inside, so the decode route is decided again."""
        self.routing_log = [[] for _ in range(self.args.num_layers)] if on else None
        if self._plan_kv is not None:
            self.plan_decode(self._plan_kv, **self._route_limits)

    def _fuse_qkv(self, weights: dict) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Per layer, q/k/v projections as one [Nq*D + 2*Nkv*D, H] matrix (concatenated once,
        here), so decode runs one native call for the three; and where they have biases (glm4_moe,
        qwen2_moe), the three biases as one [Nq*D + 2*Nkv*D] vector (the second dict). The dict's
        q/k/v entries become row views of them: the same bytes, no second copy, and prefill's
        F.linear reads them as before. Only for plain bf16 weights (the native path's condition);
        layers read per token (layer streaming) are not in `weights` and stay apart."""
        a = self.args
        if a.attention_impl is not None or self.dtype is not torch.bfloat16:
            return {}, {}
        fused, fused_bias = {}, {}
        for layer in range(a.num_layers):
            p = f"{layer_prefix(layer)}.self_attn"
            names = [f"{p}.{n}_proj.weight" for n in "qkv"]
            parts = [weights.get(n) for n in names]
            bias_names = [f"{p}.{n}_proj.bias" for n in "qkv"]
            biases = [weights.get(n) for n in bias_names]
            if any(type(t) is not torch.Tensor or t.dtype is not torch.bfloat16 for t in parts):
                continue
            if any(b is not None for b in biases):  # all three bf16, or the layer stays apart
                if any(type(b) is not torch.Tensor or b.dtype is not torch.bfloat16 for b in biases):
                    continue
                fused_bias[layer] = torch.cat(biases)
                for name, view in zip(bias_names, fused_bias[layer].split([b.shape[0] for b in biases])):
                    weights[name] = view
            fused[layer] = _adjacent_rows(parts)
            if fused[layer] is None:
                fused[layer] = torch.cat(parts)
            for name, view in zip(names, fused[layer].split([t.shape[0] for t in parts])):
                weights[name] = view
        return fused, fused_bias

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
    def forward(self, tokens: torch.Tensor, start_pos: int, kv: KVCache, last_only: bool = False,
                hidden: list | None = None) -> torch.Tensor:
        """tokens: [T] int64 → logits [T, V] (fp32), writing K/V at positions start_pos..start_pos+T.

        last_only: logits of the last position only ([1, V]); generation needs no more, and the
        lm_head is the largest matmul of a prefill.
        hidden: a list the final hidden states the lm_head reads ([T, H] or [1, H], after the model's
        norm) are appended to: what the MTP drafter reads (engine/arch/mtp.py), at no cost to the route.

        One token follows the decode plan (self.plan); several take the reference.
        """
        T = tokens.shape[0]
        if start_pos + T > kv.ctx_size:
            raise ValueError(f"{start_pos + T} positions exceed ctx_size {kv.ctx_size}")
        cos, sin = self._rope(start_pos, T)  # [T, D] each
        mask = self._mask(start_pos, T)  # [T, S] bool, or None: one token that sees every cached position
        x = F.embedding(tokens, self.w["model.embed_tokens.weight"])  # [T, H]
        plan = None  # several tokens (a prefill): the reference
        if T == 1:  # the decode plan, made for this cache at load (another cache gets its own, once)
            plan = self.plan_for(kv)
        if plan is not None and plan.step is not None and mask is None:
            x = self._decode_step(x, start_pos, cos, sin, plan.step)
        else:
            attention = plan.attention if plan is not None and mask is None else self._no_native
            fused_moe = plan.moe if plan is not None else self._no_native
            for layer in range(self.args.num_layers):
                x = self._layer(layer, x, start_pos, kv, cos, sin, mask, attention[layer], fused_moe[layer])
        if last_only:
            x = x[-1:]
        x = rms_norm(x, self.w["model.norm.weight"], self.args.rms_norm_eps)
        if hidden is not None:
            hidden.append(x)
        return linear(x, self.lm_head).float()  # [T, V]

    @torch.inference_mode()
    def forward_rows(self, tokens: torch.Tensor, positions: list[int], kvs: list) -> torch.Tensor:
        """tokens [B] → fp32 logits [B, V]: row b one decode token at positions[b] of cache kvs[b], with
        the bits of its solo forward; each routed expert fetched once for every row (decode_rows.py)."""
        return decode_rows.forward_rows(self, tokens, positions, kvs)

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, start_pos: int, kv, sub_tokens: int) -> torch.Tensor:
        """tokens [T] → logits [1, V] of the last position, the group taken through one layer at a
        time (engine/arch/prefill.py): each routed expert read once per layer for all T tokens, the
        attention in causal sub-chunks of sub_tokens. forward() is the pass-wise reference."""
        return prefill.layer_major(self, tokens, start_pos, kv, sub_tokens)

    @torch.inference_mode()
    def prefill_parts(self, parts: list[tuple[torch.Tensor, int, object]], sub_tokens: int) -> list[torch.Tensor]:
        """Several sequences' groups [(tokens [T_p], start_pos, kv)] in one layer-major pass → each
        one's last logits [1, V]: each routed expert read once per layer for all of them
        (engine/arch/prefill.py layer_major_parts)."""
        return prefill.layer_major_parts(self, parts, sub_tokens)

    # --- the native calls the decode plan picks (a seam each for benchmarks/time/decode_profile.py) ------

    def _decode_step(self, x, start_pos, cos, sin, step):
        """Every layer of one bf16 token as one native call (decode_step.cpp / decode_step_int.cpp):
        the same bits as the per-layer native calls."""
        return decode_plan.native_step(step, self.args, x, cos, sin, start_pos, trim_operands(self.routing_trim))

    def _decode_attention(self, layer, x, start_pos, cos, sin, entry):
        """x + attention(rms_norm(x)) of one token as one native call (attention_decode*.cpp)."""
        return decode_plan.native_attention(entry, self.args, x, cos, sin, start_pos)

    def _resident_moe_call(self, layer, fused, h):
        """h + moe(rms_norm(h)) of one token as one native call: norm, router, top-k, experts, sum."""
        return fused(h, self.routing_trim)

    # --- the reference ---------------------------------------------------------------------------

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
        for step in range(1, self.prefetch_depth + 1):
            ahead = (layer + step) % self.args.num_layers
            if ahead in self._streamed:
                self.layer_source.hint_layer(ahead)
        return self.layer_source.layer_weights(layer)

    def _layer(self, layer, x, start_pos, kv, cos, sin, mask, native_attention=None, fused_moe=None):
        """x [T, H] → [T, H]: x + attention(norm(x)), then h + MoE or dense MLP of norm(h).
        native_attention, fused_moe: this layer's native calls where the decode plan gives them."""
        p, a = layer_prefix(layer), self.args
        w = self._layer_weights(layer)
        if native_attention is not None:
            h = self._decode_attention(layer, x, start_pos, cos, sin, native_attention)
        else:
            h = x + self._attention(layer, w, rms_norm(x, w[f"{p}.input_layernorm.weight"], a.rms_norm_eps),
                                    start_pos, kv, cos, sin, mask)
        if fused_moe is not None:
            return self._resident_moe_call(layer, fused_moe, h)
        normed = rms_norm(h, w[f"{p}.post_attention_layernorm.weight"], a.rms_norm_eps)  # [T, H]
        self._lookahead(layer, normed, h)
        if a.is_moe_layer(layer):
            return h + self._moe(layer, w, normed)
        return h + swiglu(normed, w[f"{p}.mlp.gate_proj.weight"], w[f"{p}.mlp.up_proj.weight"],
                          w[f"{p}.mlp.down_proj.weight"])


    def _attention(self, layer, w, x, start_pos, kv, cos, sin, mask):
        """Self-attention of the normed x [T, H] → [T, H] (before the residual add), writing this call's
        K/V rows at start_pos..start_pos+T; mask [T, S] bool, or None (one token, every position)."""
        p, a = f"{layer_prefix(layer)}.self_attn", self.args
        if a.attention_impl is not None:
            return a.attention_impl.forward(w, p, layer, x, start_pos, kv, cos, sin, mask)
        T = x.shape[0]
        q, k, v = self._qkv_heads(layer, w, x, cos, sin, fused=T == 1)
        S = start_pos + T
        kv.k[layer][:, start_pos:S] = k
        kv.v[layer][:, start_pos:S] = v
        keys = kv.k[layer][:, :S].to(q.dtype)  # [Nkv, S, D]
        values = kv.v[layer][:, :S].to(q.dtype)
        out = F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                             attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads)
        out = out.squeeze(0).transpose(0, 1).reshape(T, a.num_heads * a.head_dim)  # [T, Nq*D]
        return linear(out, w[f"{p}.o_proj.weight"])

    def _qkv_heads(self, layer, w, x, cos, sin, fused: bool, project=linear, norm=rms_norm):
        """q [Nq, T, D], k and v [Nkv, T, D] of the normed x [T, H]: the projections (one call over
        the fused q/k/v and their biases where `fused`), clipping, the q/k norms, rope. decode_rows
        passes its row-independent `project` and `norm`, so each of its rows gets this path's bits."""
        p, a = f"{layer_prefix(layer)}.self_attn", self.args
        T = x.shape[0]
        qkv = self._qkv.get(layer) if fused and native.ready and x.dtype is torch.bfloat16 else None
        if qkv is not None and w is self.w:  # one native call; its rows are q, k, v's own (same bits)
            q, k, v = project(x, qkv, self._qkv_bias.get(layer)).split(
                [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim], dim=1)
        else:  # [T, Nq*D], [T, Nkv*D], [T, Nkv*D]
            q, k, v = (project(x, w[f"{p}.{n}_proj.weight"], w.get(f"{p}.{n}_proj.bias")) for n in "qkv")
        if a.clip_qkv is not None:
            q, k, v = (t.clamp(-a.clip_qkv, a.clip_qkv) for t in (q, k, v))
        if a.qk_norm == "full":
            q = norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        q = q.reshape(T, a.num_heads, a.head_dim).transpose(0, 1)  # [Nq, T, D]
        k = k.reshape(T, a.num_kv_heads, a.head_dim).transpose(0, 1)  # [Nkv, T, D]
        v = v.reshape(T, a.num_kv_heads, a.head_dim).transpose(0, 1)
        if a.qk_norm == "head":
            q = norm(q, w[f"{p}.q_norm.weight"], a.rms_norm_eps)
            k = norm(k, w[f"{p}.k_norm.weight"], a.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _lookahead(self, layer: int, normed: torch.Tensor, residual: torch.Tensor) -> None:
        """Hint the store the experts the next prefetch_depth MoE layers will likely route residual [T, H] to."""
        if self.experts is None or not self.prefetch_depth:
            return
        a = self.args
        for ahead in range(1, self.prefetch_depth + 1):
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
        """The MoE block of the normed x [T, H] → [T, H]: each token's K routed experts, weighted and
        summed (moe.py), plus the shared experts where the architecture has them."""
        p, a = layer_prefix(layer), self.args
        ids, weights = route_layer(a, w, layer, x, self.routing_trim)  # [T, K] each
        if self.routing_log is not None:
            self.routing_log[layer].append(ids)
        if x.shape[0] == 1:
            out = moe.routed_decode(self.experts, self.expert_fn, layer, x, ids, weights)
        else:
            out = moe.routed_prefill(self.experts, self.expert_fn, layer, x, ids, weights)
        return self._plus_shared(layer, w, x, out)

    def _plus_shared(self, layer: int, w: dict, x: torch.Tensor, out: torch.Tensor, mlp=swiglu,
                     gate=None) -> torch.Tensor:
        """out (the routed experts' sum for the normed x [T, H]) plus the shared experts of x, where
        the architecture has them (a layer-major prefill adds them per sub-chunk: rows are independent).
        decode_rows passes its row-independent `mlp` and `gate` (x, gate weight) → sigmoid gate [T, 1]."""
        p, a = layer_prefix(layer), self.args
        if a.shared_experts_intermediate_size:  # deepseek-style: resident, always on, no gate
            out = out + mlp(x, *(w[f"{p}.mlp.shared_experts.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
        if a.shared_expert_intermediate_size:
            shared = mlp(x, *(w[f"{p}.mlp.shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
            gate_w = w[f"{p}.mlp.shared_expert_gate.weight"]
            out = out + (torch.sigmoid(F.linear(x, gate_w)) if gate is None else gate(x, gate_w)) * shared
        return out
