"""MXFP4 matrices as the published gpt-oss checkpoints store its experts, their math and the weight operator.

  `<proj>_blocks` [..., rows, cols/32, 16] uint8: two FP4 e2m1 codes per byte, low nibble first;
  `<proj>_scales` [..., rows, cols/32] uint8: a power-of-two exponent per 32 values, bias 127.

MXFP4 experts stay as stored where the native kernels load (engine/native/mxfp4_decode.cpp: the
FP4 codes and block exponents are decoded inside the matrix-vector product): the cache holds
them, and the plan counts them, at 4.25 bits per weight (`Mxfp4Matrix`). Without the native
kernels (COLIBRI_NATIVE=0, no AVX-512, no compiler) they are dequantized when read, before the
cache (`mxfp4_dequantize`), so the cache and torch's matmuls see ordinary tensors, as the
published weights would be in bf16. engine/arch/gpt_oss_layers.py computes the experts with them;
engine/format/layout.py reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import native
from engine.weights.stored import StoredMatrix

# FP4 e2m1 code → value (codes 8-15 are the negatives of 0-7).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_BLOCK = 32  # values sharing one scale
SCALE_BIAS = 127
MXFP4_FUSED = "mxfp4 fused (native)"  # what run/bench report as the experts' kernel
MXFP4_DEQUANT = "mxfp4 dequantized on read + F.linear"
DEQUANT_CHUNK = 1 << 20  # block bytes dequantized per step (bounds the transient index tensor)


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
