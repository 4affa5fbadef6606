"""gpt_oss: attention with sinks over alternating sliding/full layers, and its experts.

Attention: grouped-query attention with biases on q/k/v/o; every head has a learned "sink"
logit that joins the softmax and is then dropped, so a head can attend to nothing; layers
alternate between a sliding window and full attention (`layer_types`).

Experts carry biases and use a clamped SwiGLU: gate ≤ limit, |up| ≤ limit,
out = (up + 1) · gate · σ(α·gate), with gate/up interleaved in one gate_up matrix. On disk
they are fused per layer, in one of two storages:
  * plain (bf16/fp32): gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I],
                       down_proj [E, I, H], down_proj_bias [E, H];
  * MXFP4, as the published checkpoints store them: `<proj>_blocks` [E, rows, cols/32, 16]
    uint8 (two FP4 e2m1 codes per byte, low nibble first) and `<proj>_scales`
    [E, rows, cols/32] uint8 (a power-of-two exponent per 32 values, bias 127), rows being the
    output features (gate_up: 2I, down: H). Biases stay in bf16.
An expert is a slice of each tensor (four or six reads). MXFP4 experts stay as stored where
the native kernels load (engine/native/mxfp4_decode.cpp: the FP4 codes and block exponents are
decoded inside the matrix-vector product): the cache holds them, and the plan counts them, at
4.25 bits per weight. Without the native kernels (COLIBRI_NATIVE=0, no AVX-512, no compiler)
they are dequantized when read, before the cache, so the cache and torch's matmuls see
ordinary tensors, as the published weights would be in bf16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.weights.quantized import StoredMatrix
from engine.arch.rope import apply_rope
from engine import native

# FP4 e2m1 code → value (codes 8-15 are the negatives of 0-7).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
MXFP4_FUSED = "mxfp4 fused (native)"  # what run/bench report as the experts' kernel
MXFP4_DEQUANT = "mxfp4 dequantized on read + F.linear"
DEQUANT_CHUNK = 1 << 20  # block bytes dequantized per step (bounds the transient index tensor)


# --- MXFP4 ------------------------------------------------------------------------------------

def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 → [..., G*32] in `dtype`.

    Exact, and bit-identical to transformers' dequantization: every FP4 value and every power
    of two 2^(scale-127) is representable in bf16 and fp32, and their product rounds the same.
    One index_select per byte from a 256-entry table of (low, high) value pairs, then one
    multiply by the block's power of two (measured 7-17x faster than two nibble gathers and
    torch.ldexp, see docs/BENCHMARKS.md). Rows go in chunks so the int32 index never exceeds
    4 x DEQUANT_CHUNK bytes, whatever the expert size.
    """
    pairs = _pair_table(dtype)
    lead, G = blocks.shape[:-2], blocks.shape[-2]
    rows = blocks.reshape(-1, G * 16)
    powers = torch.exp2((scales.reshape(-1, G).to(torch.int32) - SCALE_BIAS).to(torch.float32)).to(dtype)
    out = torch.empty(rows.shape[0], G, 32, dtype=dtype)
    step = max(1, DEQUANT_CHUNK // (G * 16))
    for r in range(0, rows.shape[0], step):
        chunk = out[r:r + step]
        torch.index_select(pairs, 0, rows[r:r + step].reshape(-1).to(torch.int32), out=chunk.view(-1, 2))
        chunk.mul_(powers[r:r + step].unsqueeze(-1))
    return out.view(*lead, G * 32)


def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: byte b → (FP4 value of its low nibble, of its high nibble)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=-1)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] (C a multiple of 32) → (blocks [..., C/32, 16] uint8, scales [..., C/32] uint8).

    Each block's exponent is the smallest that keeps its largest value within ±6 (no clipping);
    values round to the nearest FP4 magnitude."""
    *lead, C = w.shape
    if C % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {MX_BLOCK}, got {C}")
    g = w.float().reshape(*lead, C // MX_BLOCK, MX_BLOCK)
    amax = g.abs().amax(dim=-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -SCALE_BIAS))
    exp = exp.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = g / torch.exp2(exp).unsqueeze(-1)
    mags = torch.tensor(FP4_VALUES[:8])
    code = (scaled.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    code = (code + 8 * (scaled < 0)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)


def fused_kernel_available() -> bool:
    """Whether MXFP4 experts are computed from their stored bytes: the native kernels load
    (built on first use) and COLIBRI_MXFP4_FUSED is not 0 (the A/B switch of
    benchmarks/quant/mxfp4_fused.py: dequantize on read, the other kernels native as before).
    Decided before the layout and the plan."""
    return os.environ.get("COLIBRI_MXFP4_FUSED", "1") != "0" and native.load() is None


@dataclass(frozen=True)
class Mxfp4Matrix(StoredMatrix):
    """One expert matrix [N, K] as stored: blocks [N, K/32, 16] and scales [N, K/32] uint8,
    views of the read bytes. `linear` is x @ W.T + bias without a dequantized copy of W."""

    tensor_fields = ("blocks", "scales")
    blocks: torch.Tensor
    scales: torch.Tensor

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if native.ready and self.blocks.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return native.mxfp4_linear(x, self.blocks, self.scales, bias)
        # Another device (the VRAM tier) or dtype (fp16): torch's matmul on a transient copy.
        return F.linear(x, mxfp4_dequantize(self.blocks, self.scales, x.dtype), bias)

    def to(self, device, non_blocking: bool = False) -> "Mxfp4Matrix":
        return self.moved(device, non_blocking)


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
        keys = keys.to(q.dtype).repeat_interleave(N // Nkv, dim=0)  # [N, S', D]
        values = values.to(q.dtype).repeat_interleave(N // Nkv, dim=0)
        scores = torch.matmul(q, keys.transpose(1, 2)) * D ** -0.5  # [N, T, S']
        allowed = self._allowed(layer, start_pos, T, first)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = w[f"{p}.sinks"].to(scores.dtype).view(N, 1, 1).expand(N, T, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink's share is dropped
        out = torch.matmul(probs.to(values.dtype), values).transpose(0, 1).reshape(T, N * D)
        return F.linear(out, w[f"{p}.o_proj.weight"], w[f"{p}.o_proj.bias"])

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
