"""The multi-token-prediction (next-n) layer of deepseek_v3, glm4_moe and glm_moe_dsa: its tensors
and its forward pass, for speculative decoding's MTP drafter (engine/run/mtp_drafter.py).

DeepSeek-V3/R1 and GLM-4.5/4.6/5 publish `num_nextn_predict_layers` MTP modules as layers after the
last (`model.layers.{L}.*`, L = num_hidden_layers): a full decoder layer (attention, an MoE block
with its routed and shared experts) fed by the previous position's hidden state and the next
token's embedding, as DeepSeek's MTP objective trained it and vLLM / SGLang run it:

    e = enorm(embed(t[j+1]))           [T, H]   (embed: the model's own, shared, as vLLM loads it;
                                                 zero at position 0, as vLLM's deepseek_mtp.py does)
    h = hnorm(hidden[j])               [T, H]   (the main model's final hidden state after its norm;
                                                 for a further draft, the layer's own output)
    x = eh_proj(cat(e, h))             [T, H]   (eh_proj: [H, 2H])
    x = decoder_layer(x, position j)   [T, H]   (its own KV cache, positions as the main model's)
    logits = shared_head.head(shared_head.norm(x))   (the layer's own head where the file has one
                                                      that is not the model's lm_head byte for
                                                      byte, else the model's lm_head)

so row j predicts t[j+2]. The layer's own `embed_tokens` (DeepSeek's files carry a copy) is not
read. Its routed experts are layer L of the expert layout, read through the store like any layer's.

The decoder layer is the model's own code: a one-layer Transformer (engine/arch/model.py) over the
layer's tensors renamed to layer 0, whose experts come from the store's layer L (LayerShift).

Shape legend: T rows, H hidden, V vocab.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.arch import decode_rows
from engine.arch.args import ModelArgs, dense_tensors, layer_prefix
from engine.arch.layers import KVCache, rms_norm
from engine.arch.model import Transformer
from engine.weights.stored import linear

# Checkpoint names of an MTP layer beyond its decoder layer's, relative to model.layers.{L}.
EXTRAS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
OWN_HEAD = "shared_head.head.weight"  # absent in some files: then the model's lm_head
OWN_EMBED = "embed_tokens.weight"  # DeepSeek's files carry a copy; never read (shared)
MTP_ARCHITECTURES = ("deepseek_v3", "glm4_moe", "glm_moe_dsa")


def with_mtp_layers(args: ModelArgs, n: int) -> ModelArgs:
    """args with `n` more layers after the last, MoE, each with its own DSA indexer: the model and
    its MTP layers as one layer list (the expert layout and synth's tensor plan walk it)."""
    if n <= 0:
        return args
    L = args.num_layers
    impl = args.attention_impl
    indexer = getattr(impl, "indexer", None)
    if indexer is not None:
        indexer = dataclasses.replace(indexer, full_layers=indexer.full_layers | frozenset(range(L, L + n)))
        impl = dataclasses.replace(impl, indexer=indexer)
    return dataclasses.replace(args, num_layers=L + n, moe_layer_flags=[*args.moe_layer_flags, *[True] * n],
                               attention_impl=impl)


def layer_args(args: ModelArgs) -> ModelArgs:
    """The one-layer model an MTP layer is (its decoder layer as layer 0, MoE, with an indexer)."""
    impl = args.attention_impl
    indexer = getattr(impl, "indexer", None)
    if indexer is not None:
        impl = dataclasses.replace(impl, indexer=dataclasses.replace(indexer, full_layers=frozenset({0})))
    return dataclasses.replace(args, num_layers=1, moe_layer_flags=[True], attention_impl=impl)


def decoder_names(args: ModelArgs, layer: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The MTP decoder layer's resident tensors: name as layer 0 → (checkpoint name, shape)."""
    one, p0, pl = layer_args(args), layer_prefix(0) + ".", layer_prefix(layer) + "."
    return {name: (pl + name[len(p0):], shape) for name, shape in dense_tensors(one).items() if name.startswith(p0)}


def extra_names(args: ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """The MTP module's own tensors (checkpoint name → shape), the head included."""
    H, V, p = args.hidden_size, args.vocab_size, layer_prefix(layer) + "."
    shapes = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H),
              "shared_head.norm.weight": (H,), OWN_HEAD: (V, H)}
    return {p + n: s for n, s in shapes.items()}


class LayerShift:
    """An ExpertStore whose layer 0 is the store's layer `layer` (the MTP layer's experts)."""

    def __init__(self, store, layer: int):
        self.store, self.layer = store, layer

    def for_each_expert(self, layer, experts, fn, in_order: bool = False) -> None:
        self.store.for_each_expert(self.layer + layer, experts, fn, in_order)

    def hint_experts(self, layer, experts) -> None:
        self.store.hint_experts(self.layer + layer, experts)

    def resident(self, layer, experts):
        return self.store.resident(self.layer + layer, experts)


class MtpLayer:
    """One MTP module over loaded weights: `extras` (enorm, hnorm, eh_proj, shared_head.norm by their
    short names, and `head`), `decoder` (the decoder layer's tensors as layer 0), the model's
    embedding, the expert store (its layer `layer` is this one's), and its own KV cache."""

    def __init__(self, args: ModelArgs, layer: int, decoder: dict, extras: dict, embed: torch.Tensor,
                 experts, dtype: torch.dtype, kv):
        self.args, self.layer, self.dtype, self.kv = args, layer, dtype, kv
        self.x = extras
        one = layer_args(args)
        weights = {**decoder, "model.embed_tokens.weight": embed, "model.norm.weight": extras["shared_head.norm.weight"],
                   "lm_head.weight": extras["head"]}
        self.model = Transformer(one, weights, LayerShift(experts, layer) if experts is not None else None, dtype)
        self.embed = embed

    @staticmethod
    def cache(args: ModelArgs, ctx_size: int, kv_dtype, compute_dtype: torch.dtype):
        """The MTP layer's own KV cache: one layer, ctx_size positions."""
        return KVCache.allocate(layer_args(args), ctx_size, kv_dtype, compute_dtype)

    @staticmethod
    def cache_bytes(args: ModelArgs, ctx_size: int, kv_dtype) -> int:
        return KVCache.nbytes_for(layer_args(args), ctx_size, kv_dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, start_pos: int, base: int = 0,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] (t[j+1]), hidden [T, H] (the state at j) at positions start_pos.. → (logits [T, V]
        fp32, or [1, V] of the last row with last_only; the layer's output [T, H]: the `hidden` of a
        further draft), the cache written there.

        base: the first position the rows attend to, held in the cache's slot 0 (position p in slot
        p - base; RoPE turns at p itself, so scores are those of a cache indexed by position). The
        drafter computes only a recent window of positions when it drafts after a while gated off
        (engine/run/mtp_drafter.py): what came before it was never computed. Drafts need not be exact
        (verification keeps the output lossless); they must not read garbage. Every cached slot below
        a row is this sequence's, so a row needs no mask: one row takes the decode plan's native
        attention and MoE, several the verify's row path (engine/arch/decode_rows.py), as the main
        model's decode does."""
        a, m = self.args, self.model
        T = tokens.shape[0]
        slot = start_pos - base
        if slot < 0 or slot + T > self.kv.ctx_size:
            raise ValueError(f"MTP rows at positions {start_pos}..{start_pos + T - 1} from base {base} do not fit "
                             f"the layer's {self.kv.ctx_size}-slot cache")
        e = F.embedding(tokens, self.embed)  # [T, H]
        if start_pos == 0:
            e = e.clone()
            e[0] = 0  # position 0 has no previous state: vLLM zeroes its embedding
        x = torch.cat([rms_norm(e, self.x["enorm.weight"], a.rms_norm_eps),
                       rms_norm(hidden.to(self.dtype), self.x["hnorm.weight"], a.rms_norm_eps)], dim=-1)  # [T, 2H]
        x = linear(x, self.x["eh_proj.weight"])  # [T, H]
        if T == 1:
            plan = m.plan_for(self.kv)
            cos, sin = m._rope(start_pos, 1)
            mask = m._mask(slot, 1)  # None: the row sees every slot below it
            x = m._layer(0, x, slot, self.kv, cos, sin, mask, plan.attention[0] if mask is None else None,
                         plan.moe[0])
        else:
            x = decode_rows.through_layers(m, x, list(range(slot, slot + T)), [self.kv] * T,
                                           rope_positions=range(start_pos, start_pos + T))
        y = x[-1:] if last_only else x  # the head only where logits are wanted ([V, H] is the big product)
        logits = linear(rms_norm(y, self.x["shared_head.norm.weight"], a.rms_norm_eps), self.x["head"]).float()
        return logits, x
