"""Rotary position embeddings: inverse frequencies per rope_type, cos/sin tables, rotation.

Shapes: D head_dim (Dr the rotated part of it), T positions, N heads.
"""

from __future__ import annotations

import math

import torch

from engine.base.errors import UnsupportedModelError
from engine.arch.args import ModelArgs

def rope_inv_freq(args: ModelArgs, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the attention (cos/sin) scale, per the config's rope_type."""
    p, dim = args.rope, args.rotary_dim or args.head_dim
    base = float(p["rope_theta"])
    kind = p.get("rope_type", "default")
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(p["factor"]), 1.0
    if kind == "dynamic":
        # NTK-aware: the base grows once the sequence passes the trained length.
        max_pos = args.max_position_embeddings
        seq_len = max(seq_len or max_pos, max_pos)
        factor = float(p["factor"])
        base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if kind == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old_ctx = float(p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / high) * ~(wavelen > old_ctx / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(args, base, dim)
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported (default, linear, dynamic, llama3, yarn)")


def _yarn_inv_freq(args: ModelArgs, base: float, dim: int) -> tuple[torch.Tensor, float]:
    p = args.rope
    orig = p.get("original_max_position_embeddings") or args.max_position_embeddings
    factor = p.get("factor") or args.max_position_embeddings / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attn = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attn = mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attn)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D] (rotate-half layout, as in HF)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class RopeTable:
    """cos/sin rows of one position for decode, computed a block of positions at a time and kept.

    A decode step otherwise builds its own row (arange, the product, cat, cos, sin, scale, casts: ~8
    small ops a token). Each block is rope_cos_sin of consecutive positions, sized to stay one
    thread's work (torch splits elementwise ops at 32,768 elements) with a length a multiple of 32,
    so every element takes the vectorised path; a position alone takes it too when D is a multiple
    of 32, and then a row from here is the row rope_cos_sin makes for that position by itself
    (tests/test_native_attention.py checks it). Every placement of a model reads the same table."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
        self.inv_freq, self.scale, self.dtype = inv_freq, scale, dtype
        self.block = max(32, 32768 // (2 * inv_freq.shape[0]) // 32 * 32)  # positions per block
        self._blocks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def row(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, D] (views into the block) for position pos."""
        b, i = divmod(pos, self.block)
        block = self._blocks.get(b)
        if block is None:
            positions = torch.arange(b * self.block, (b + 1) * self.block)
            block = self._blocks[b] = rope_cos_sin(self.inv_freq, self.scale, positions, self.dtype)
        return block[0][i:i + 1], block[1][i:i + 1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [N, T, D]; cos/sin: [T, Dr], Dr <= D (partial rotary: the rest passes through)
    if cos.shape[-1] < x.shape[-1]:
        rot = cos.shape[-1]
        return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
