"""gpt_oss: attention with sinks over alternating sliding/full layers, and its experts.

Attention: grouped-query attention with biases on q/k/v/o; every head has a learned "sink"
logit that joins the softmax and is then dropped, so a head can attend to nothing; layers
alternate between a sliding window and full attention (`layer_types`).

Experts carry biases and use a clamped SwiGLU: gate ≤ limit, |up| ≤ limit,
out = (up + 1) · gate · σ(α·gate), with gate/up interleaved in one gate_up matrix. On disk
they are fused per layer, in one of two storages:
  * plain (bf16/fp32): gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I],
                       down_proj [E, I, H], down_proj_bias [E, H];
  * MXFP4, as the published checkpoints store them: `<proj>_blocks` and `<proj>_scales`
    (engine/weights/mxfp4.py has the format, its math and `Mxfp4Matrix`), rows being the
    output features (gate_up: 2I, down: H). Biases stay in bf16.
An expert is a slice of each tensor (four or six reads); its matrices are tensors or Mxfp4Matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.arch.layers import query_rows
from engine.arch.rope import apply_rope
from engine.weights.mxfp4 import Mxfp4Matrix


def _linear(x: torch.Tensor, w, bias: torch.Tensor) -> torch.Tensor:
    return w.linear(x, bias) if isinstance(w, Mxfp4Matrix) else F.linear(x, w, bias)


# --- attention --------------------------------------------------------------------------------

@dataclass
class WindowedKVCache:
    """Keys and values per layer, [Nkv, positions, D]. Full-attention layers hold ctx_size
    positions; a sliding layer holds a ring of min(window, ctx_size), position p in slot
    p % size: its queries never look further back than the window, so more would be memory
    no query reads (half the layers of gpt-oss-120b at its 128K context)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    ctx_size: int


@dataclass(frozen=True)
class SinkAttention:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per layer: the sliding window, or None for full attention

    def layer_shapes(self, p: str, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """One layer's attention tensors and their shapes: q/k/v/o with biases, one sink per head."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        out = {}
        for proj, (rows, cols) in (("q_proj", (q, hidden)), ("k_proj", (kv, hidden)), ("v_proj", (kv, hidden)),
                                   ("o_proj", (hidden, q))):
            out.update({f"{p}.{proj}.weight": (rows, cols), f"{p}.{proj}.bias": (rows,)})
        out[f"{p}.sinks"] = (self.num_heads,)
        return out

    # --- the cache (KVCache.allocate / nbytes_for call these) ---------------------------------

    def cache_positions(self, layer: int, ctx_size: int) -> int:
        window = self.windows[layer]
        return ctx_size if window is None else min(window, ctx_size)

    def cache_nbytes(self, num_layers: int, ctx_size: int, dtype: torch.dtype) -> int:
        per_position = 2 * self.num_kv_heads * self.head_dim * (torch.finfo(dtype).bits // 8)
        return per_position * sum(self.cache_positions(i, ctx_size) for i in range(num_layers))

    def allocate_cache(self, num_layers: int, ctx_size: int, dtype: torch.dtype,
                       compute_dtype: torch.dtype | None = None) -> WindowedKVCache:
        # compute_dtype is what quantized caches read back in; this one is never quantized
        # (engine/arch/kvquant.py:check_kv_dtype refuses int8/fp8 here).
        shapes = [(self.num_kv_heads, self.cache_positions(i, ctx_size), self.head_dim) for i in range(num_layers)]
        return WindowedKVCache([torch.zeros(s, dtype=dtype) for s in shapes],
                               [torch.zeros(s, dtype=dtype) for s in shapes], ctx_size)

    # --- the forward pass --------------------------------------------------------------------

    def forward(self, w: dict, p: str, layer: int, x: torch.Tensor, start_pos: int, kv,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        T, N, Nkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q = F.linear(x, w[f"{p}.q_proj.weight"], w[f"{p}.q_proj.bias"]).view(T, N, D).transpose(0, 1)
        k = F.linear(x, w[f"{p}.k_proj.weight"], w[f"{p}.k_proj.bias"]).view(T, Nkv, D).transpose(0, 1)
        v = F.linear(x, w[f"{p}.v_proj.weight"], w[f"{p}.v_proj.bias"]).view(T, Nkv, D).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values, first = self._attended(layer, kv, k, v, start_pos)
        keys, values = keys.to(q.dtype), values.to(q.dtype)  # [Nkv, S', D]: each serves N // Nkv heads
        allowed = self._allowed(layer, start_pos, T, first)  # [T, S'] or None
        sinks = w[f"{p}.sinks"]
        # The scores [N, rows, S'] are written out: queries in blocks bound them (layers.query_rows).
        rows = query_rows(N, keys.shape[1] + 1, T)
        out = [self._scores_block(q[:, b:b + rows], keys, values, None if allowed is None else allowed[b:b + rows],
                                  sinks) for b in range(0, T, rows)]
        out = (out[0] if len(out) == 1 else torch.cat(out, dim=1)).transpose(0, 1).reshape(T, N * D)
        return F.linear(out, w[f"{p}.o_proj.weight"], w[f"{p}.o_proj.bias"])

    def _scores_block(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      allowed: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
        """Attention of the queries q [N, t, D] over keys/values [Nkv, S', D] → [N, t, D]. Head n reads
        key head n // G (G = N // Nkv): its G query heads go as one [G*t, D] matrix against it, so the
        keys are never repeated per head ([N, S', D] twice was gigabytes at a 128K context)."""
        N, t, D = q.shape
        Nkv = keys.shape[0]
        grouped = q.reshape(Nkv, N // Nkv * t, D)  # [Nkv, G*t, D]: head n = kv * G + g
        scores = (torch.matmul(grouped, keys.transpose(1, 2)) * D ** -0.5).view(N, t, -1)  # [N, t, S']
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        logits = torch.cat([scores, sinks.to(scores.dtype).view(N, 1, 1).expand(N, t, 1)], dim=-1)
        del scores
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's share is dropped
        return torch.matmul(probs.reshape(Nkv, N // Nkv * t, -1).to(values.dtype), values).view(N, t, D)

    def prefill_scores_bytes(self, tokens: int, positions: int) -> int:
        """What a prefill of `tokens` queries over `positions` materializes beyond its per-token
        tensors (the memory plan charges it): one query block's scores [N, rows, S'+1], about three
        copies at once (the scores, the logits with the sink, the softmax, and the softmax's
        grouped copy), taken as fp32."""
        N = self.num_heads
        return 4 * 4 * N * query_rows(N, positions + 1, tokens) * (positions + 1)

    def _attended(self, layer: int, kv, k: torch.Tensor, v: torch.Tensor, start_pos: int):
        """Store this step's k/v; return the keys and values its queries may attend, in position
        order, with the position of the first. A full layer: positions 0..S-1 of its cache. A
        sliding layer: the window's earlier positions from the ring, then this step's own
        (read before they are written: a long prefill overwrites the ring it reads)."""
        T, S = k.shape[1], start_pos + k.shape[1]
        ck, cv = kv.k[layer], kv.v[layer]
        if self.windows[layer] is None:
            ck[:, start_pos:S] = k
            cv[:, start_pos:S] = v
            return ck[:, :S], cv[:, :S], 0
        size = ck.shape[1]
        first = max(0, start_pos - (self.windows[layer] - 1))  # the oldest position a query here sees
        earlier = torch.arange(first, start_pos) % size
        keys = torch.cat([ck.index_select(1, earlier), k], dim=1)
        values = torch.cat([cv.index_select(1, earlier), v], dim=1)
        kept = torch.arange(max(start_pos, S - size), S)  # the newest `size` positions stay
        ck.index_copy_(1, kept % size, k[:, kept - start_pos])
        cv.index_copy_(1, kept % size, v[:, kept - start_pos])
        return keys, values, first

    def _allowed(self, layer: int, start_pos: int, T: int, first: int) -> torch.Tensor | None:
        """Which of the attended positions (first..S-1) each query may see; None: all of them."""
        window, S = self.windows[layer], start_pos + T
        if T == 1:  # one query: every attended position is causal and, by `first`, in its window
            return None
        q_pos = torch.arange(start_pos, S)[:, None]
        k_pos = torch.arange(first, S)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        return allowed


# --- experts ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GptOssExperts:
    num_experts: int
    hidden_size: int
    intermediate_size: int
    alpha: float
    limit: float

    @property
    def numel(self) -> int:
        """Elements of one expert in the compute dtype (weights and biases)."""
        H, I = self.hidden_size, self.intermediate_size
        return 2 * I * H + 2 * I + H * I + H

    def forward(self, x: torch.Tensor, expert) -> torch.Tensor:
        gate_up_w, gate_up_b, down_w, down_b = expert  # [2I, H] (or its Mxfp4Matrix), [2I], [H, I], [H]
        gate_up = _linear(x, gate_up_w, gate_up_b)
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return _linear((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), down_w, down_b)
