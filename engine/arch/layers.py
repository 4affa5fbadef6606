"""The building blocks every architecture shares: RMSNorm, SwiGLU (dense and routed experts),
top-k routing, and the KV cache.

Shape legend: T tokens, H hidden, I expert intermediate, E experts, K top-k, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native
from engine.arch.args import ModelArgs, layer_prefix
from engine.weights.quantized import QuantWeight
from engine.weights.stored import linear
from engine.arch.kvquant import cache_bytes, check_kv_dtype, kv_buffer

# An attention that materializes its scores (MLA's latent attention, whose q/k and v head dims
# differ, takes SDPA's math path; gpt-oss's sinks are written out) takes its queries in blocks whose
# fp32 scores [N, rows, S] stay within this: a long context's transients stay bounded, and the
# memory plan charges a few such blocks (engine/movement/plan.py, prefill_activation_bytes).
SCORES_BLOCK_BYTES = 16 << 20


# Up to this many rows a routed expert goes through the native multi-row kernel (native.experts_rows:
# passes of four rows, each row the one-row call's bits) instead of torch's bf16 GEMM, whose cost for
# a few rows is most of its cost for dozens: a short prompt routes a few rows to each expert (64
# tokens: ~9 on demo, 696 of its 920 expert calls 12 rows or fewer), and a lone short prompt's
# prefill was mostly that fixed cost. Measured on demo bf16 resident, 2 threads, one process, the
# thresholds alternated, min of 3 (a loaded 2-vCPU EPYC, 2026-12-06, issue 39): a 64-token prompt
# 0.628 s with torch for every expert against 0.363 (native up to 12 rows), 0.297 (32), 0.278 (64),
# 0.276 (128), 0.311 (every row count); four 64-token prompts in one pass 1.384 against 1.303, 1.061,
# 0.897, 0.863, 0.900; a 512-token prompt 2.041 against 2.013, 1.815, 1.814, 1.649, 1.621. Above 128
# rows (long prompts' groups) torch's GEMM stays: not measured there.
NATIVE_EXPERT_ROWS = 128


def query_rows(heads: int, positions: int, tokens: int) -> int:
    """Queries per block whose fp32 scores [heads, rows, positions] fit SCORES_BLOCK_BYTES (at least
    one, at most all `tokens`); each query's softmax is its own, so blocks change no result."""
    return max(1, min(tokens, SCORES_BLOCK_BYTES // max(1, 4 * heads * positions)))

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype, as the reference implementations do.
    # F.rms_norm is one fused op where the written-out form was five (x * rsqrt(mean(x^2) + eps)),
    # with the same result bit for bit. One token in bf16 (x [1, H], or per head [N, 1, D]) takes
    # the native op instead: one call where this is three, and the fused MoE layer's own norm, so
    # a layer computed fused or apart gives the same bits.
    if (native.ready and x.dtype is torch.bfloat16 and x.dim() >= 2 and x.shape[-2] == 1
            and type(weight) is torch.Tensor and weight.dtype is torch.bfloat16 and x.device.type == "cpu"):
        return native.rms_norm(x, weight, eps)
    return rms_norm_rows(x, weight, eps)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm without the one-token native op: each row's bits whichever rows come with it
    (a layer-major prefill norms an expert's rows gathered from the whole group)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense MLP or shared expert: x [T, H]; gate/up [I, H]; down [H, I]. Weights may be QuantWeights
    (quantized containers): `linear` picks their kernel. One bf16 row (decode) is one native call, the
    routed experts' kernel (native.experts): a verify's or batched step's rows take its multi-row form
    (row_ops.swiglu_rows), each row these bits, where the torch silu would need a call per row."""
    if native_swiglu(x, (gate, up, down)) and x.shape[0] == 1:
        return native.experts(x, [gate, up, down], 3)
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def native_swiglu(x: torch.Tensor, weights: tuple) -> bool:
    """Whether swiglu on x's bf16 rows takes the native experts kernels (plain bf16 weights on the CPU)."""
    return (native.ready and x.dim() == 2 and x.dtype is torch.bfloat16 and x.device.type == "cpu"
            and all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 and t.device.type == "cpu" for t in weights))


def swiglu_expert(x: torch.Tensor, weights: tuple) -> torch.Tensor:
    """One routed expert: x [T, H] → [T, H], from what layout.tensors_from_buffers made of its
    bytes: (gate_up [2I, H], down [H, I]), or (gate, up, down) where the file keeps them apart.

    The one place the MoE layer reads an expert's weights; a new format replaces both.
    """
    down = weights[-1]
    if down.device != x.device:  # the expert sits in the VRAM tier
        return swiglu_expert(x.to(down.device), weights).to(x.device)
    if native.ready and x.shape[0] == 1 and x.dtype is torch.bfloat16 and type(down) is torch.Tensor:
        return native.experts(x, list(weights), len(weights))  # [1, H]; what moe's batched call computes
    if (native.ready and 1 < x.shape[0] <= NATIVE_EXPERT_ROWS and x.dtype is torch.bfloat16 and x.device.type == "cpu"
            and all(type(t) is torch.Tensor and t.dtype is torch.bfloat16 for t in weights)):
        # A prefill's expert with few rows: the multi-row decode kernel (NATIVE_EXPERT_ROWS' note).
        rows = x.shape[0]
        return native.experts_rows(x.contiguous(), list(weights), len(weights), torch.arange(rows),
                                   torch.zeros(rows, dtype=torch.int64))
    quantized = native_quant_operands(x, [weights])
    if quantized is not None:  # int8/int4 decode: the same op as moe's batched call, with one expert
        return native.quant_experts(x, *quantized)
    if len(weights) == 3:
        return swiglu(x, *weights)
    gu = F.linear(x, weights[0])  # [T, 2I]
    inter = down.shape[1]
    return F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], down)


def native_quant_operands(x: torch.Tensor, experts: list) -> tuple[list, int] | None:
    """(tensors, group) for native.quant_experts when every expert is (gate, up, down) QuantWeights
    of one kind that the native int8/int4 kernel takes for x (group 0 = int8); else None."""
    first = experts[0][0]
    if type(first) is not QuantWeight or not first.native_decode(x):
        return None
    # What native_decode checks of x holds for every weight once it holds for the first; a weight of
    # the same quant, group, kernel and device answers as the first does (a per-token loop: K x 3).
    flat = []
    for expert in experts:
        if len(expert) != 3 or any(type(w) is not QuantWeight or w.quant != first.quant
                                   or w.group_size != first.group_size or w.kernel != first.kernel
                                   or w.qweight.device != first.qweight.device for w in expert):
            return None
        for w in expert:
            flat += [w.qweight, w.qscale]
    return flat, (first.group_size if first.quant == "int4" else 0)


def route(args: ModelArgs, router_weight: torch.Tensor, x: torch.Tensor):
    """Top-k routing with each architecture's normalisation. x: [T, H] → ids [T, K], weights [T, K]."""
    if (native.ready and x.shape[0] == 1 and x.dtype is torch.bfloat16 and type(router_weight) is torch.Tensor
            and router_weight.dtype is torch.bfloat16):  # one native call; the fused MoE layer's own routing
        return native.route_topk(x, router_weight, args.top_k, bool(args.norm_topk_prob))
    logits = linear(x, router_weight)  # [T, E]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, args.top_k, dim=-1)
    if args.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


def route_layer(args: ModelArgs, w: dict, layer: int, x: torch.Tensor, trim=None):
    """Layer `layer`'s routing rule (the architecture's own) on x: ids [T, K], weights [T, K].

    trim: an engine/arch/router.py RoutingTrim (lossy: fewer experts, skipped slots id -1), or None.
    """
    if args.router is not None:
        ids, weights = args.router.route(w, layer_prefix(layer), x)
    else:
        ids, weights = route(args, w[f"{layer_prefix(layer)}.{args.moe_prefix}.gate.weight"], x)
    return (ids, weights) if trim is None else trim.apply(ids, weights)


@dataclass
class KVCache:
    """Keys and values for every layer, preallocated for ctx_size positions.

    kv_dtype: a torch float dtype (plain tensors), or 'int8' / 'fp8' (engine/arch/kvquant.py:
    QuantizedRows, one scale per token per head; reads dequantize to the compute dtype).
    """

    k: list  # per layer [Nkv, ctx, D]: torch.Tensor or QuantizedRows
    v: list

    @classmethod
    def allocate(cls, args: ModelArgs, ctx_size: int, kv_dtype, compute_dtype: torch.dtype | None = None):
        check_kv_dtype(args, kv_dtype)
        compute_dtype = compute_dtype or (kv_dtype if isinstance(kv_dtype, torch.dtype) else torch.float32)
        if hasattr(args.attention_impl, "allocate_cache"):  # MLA: compressed latents instead
            return args.attention_impl.allocate_cache(args.num_layers, ctx_size, kv_dtype, compute_dtype)
        shape = (args.num_kv_heads, ctx_size, args.head_dim)
        return cls([kv_buffer(shape, kv_dtype, compute_dtype) for _ in range(args.num_layers)],
                   [kv_buffer(shape, kv_dtype, compute_dtype) for _ in range(args.num_layers)])

    @staticmethod
    def nbytes_for(args: ModelArgs, ctx_size: int, kv_dtype) -> int:
        check_kv_dtype(args, kv_dtype)
        if hasattr(args.attention_impl, "cache_nbytes"):
            return args.attention_impl.cache_nbytes(args.num_layers, ctx_size, kv_dtype)
        rows = 2 * args.num_layers * args.num_kv_heads * ctx_size  # one K and one V row per head per token
        return cache_bytes(rows * args.head_dim, rows, kv_dtype)

    @property
    def ctx_size(self) -> int:
        return self.k[0].shape[1]
