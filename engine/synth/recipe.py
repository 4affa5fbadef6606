"""The weight recipe: every tensor of a synthetic model, a pure function of (geometry, seed, skew, name).

Every tensor comes from a torch.Generator seeded by sha256(seed, tensor name), so the same seed
gives the same bytes.

`routing_skew` (X) shapes the weights so that the engine's ordinary routing is closer to a real
MoE model's than uniform random routing (see docs/SYNTH.md for the measured effect):
  * popularity: every embedding carries a constant "massive activation" on channel 0 and each
    layer's router reads that channel with a per-expert weight spread like normal quantiles
    (scaled by X), so some experts win far more often than others, differently per layer;
  * locality: q/k projections also read channel 0 (share min(X, 1)), which makes q and k nearly
    constant per head; through RoPE that turns attention into a smooth window over the last few
    tokens, and o_proj (gain grows with X) writes that windowed context back into the residual,
    so consecutive tokens' router inputs share most of their context and pick overlapping experts.
X = 0 gives the plain random initialisation (near-uniform routing).

The tensors themselves (names, shapes, kinds) are each architecture's synth plan
(engine/arch/families/); the kinds beyond qwen3_moe's are explained in
engine/arch/families/synth_plans.py. MXFP4 experts (gpt_oss) are quantized from the same seeded
weights the plain format would hold.
"""

from __future__ import annotations

import hashlib
import math

from engine.arch.architecture import PlannedTensor
from engine.weights.mxfp4 import mxfp4_quantize

SYNTH_VERSION = 1  # bump when the weight recipe changes (the same seed then gives other bytes)

# Recipe constants, calibrated with benchmarks/tuning/routing_skew.py (docs/SYNTH.md has the table).
EMBED_STD = 1.0        # token content must dominate the residual at X=0 (near-uniform routing)
POPULARITY = 0.9       # router bias spread per unit of X, in units of the token-driven logit std
CONTEXT_GAIN = 1.3     # layer-0 windowed-context scale per unit of X, relative to the embedding
ATTN_PEAK = 14.0       # score of a token attending to itself under the positional kernel
ROPE_BAND = (0.01, 0.3)  # RoPE frequencies (rad/token) the positional kernel uses: a ~4-6 token window


# --- the weight recipe ------------------------------------------------------------------------

def _seed_for(seed: int, key: str) -> int:
    # Not Python's hash(): that is salted per process, and the bytes must not be.
    digest = hashlib.sha256(f"colibri-synth/v{SYNTH_VERSION}|{seed}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Recipe:
    """Values of each tensor as a float32 torch tensor, a pure function of (geometry, seed, skew, name)."""

    _quantized: tuple | None = None  # (base name, blocks, scales): one MXFP4 quantization per weight

    def __init__(self, g: dict, seed: int, skew: float):
        import torch
        self.torch = torch
        self.g, self.seed, self.x = g, seed, float(skew)
        H, L, hd = g["hidden_size"], g["num_hidden_layers"], g["head_dim"]
        self.std = g["initializer_range"]
        self.out_std = self.std / math.sqrt(2 * L)  # residual branches: keep the stream's scale over depth
        self.lam = min(1.0, self.x)                  # share of q/k given to the positional kernel
        self.structured = self.x > 0
        # q_norm/k_norm gain so that the positional kernel's self-score is ATTN_PEAK at lam = 1.
        self.qk_gain = math.sqrt(1.0 + self.lam * (ATTN_PEAK / math.sqrt(hd) - 1.0))
        self.band = self._rope_band_vector(hd, g["rope_theta"])
        self.massive = EMBED_STD * math.sqrt(H)      # channel-0 value shared by every token
        self._popularity: dict[int, "torch.Tensor"] = {}
        self._scratch = None

    def _normal(self, name: str, shape, std: float):
        """N(0, std) values in a reused scratch buffer (valid until the next call).

        One buffer for all tensors spares a fresh multi-MB allocation (and its page faults) per tensor.
        """
        torch = self.torch
        n = math.prod(shape)
        if self._scratch is None or self._scratch.numel() < n:
            self._scratch = torch.empty(n, dtype=torch.float32)
        t = self._scratch[:n].view(shape)
        gen = torch.Generator().manual_seed(_seed_for(self.seed, name))
        torch.randn(shape, generator=gen, out=t)
        return t.mul_(std)

    def _rope_band_vector(self, hd: int, theta: float):
        """Unit vector over head_dim with its energy on the RoPE pairs whose frequency is in ROPE_BAND.

        With q = k = this vector at every position, q·k after RoPE is sum_i w_i cos(theta_i * distance):
        largest at distance 0 and falling off over a few tokens, i.e. a recency window.
        """
        torch = self.torch
        half = hd // 2
        freqs = [theta ** (-2.0 * i / hd) for i in range(half)]
        pairs = [i for i, f in enumerate(freqs) if ROPE_BAND[0] <= f <= ROPE_BAND[1]]
        if len(pairs) < 2:  # small head_dim: fall back to the pairs nearest the band's middle
            mid = math.sqrt(ROPE_BAND[0] * ROPE_BAND[1])
            pairs = sorted(range(half), key=lambda i: abs(math.log(freqs[i] / mid)))[: max(2, half // 4)]
        u = torch.zeros(hd)
        for i in pairs:
            u[i] = u[i + half] = 1.0
        return u / u.norm()

    def _o_std(self, layer: int) -> float:
        """o_proj std. Layer 0 carries the context: its windowed average of the embeddings is written
        into the residual with CONTEXT_GAIN * X times the per-element scale of the token's own
        embedding, so every later router sees the same mix of token and recent context.
        """
        if not self.structured or layer != 0:
            return self.out_std
        g = self.g
        # v elements ~ std * |h_rest| = std * sqrt(H/2); a ~4-token window averages them down by 2;
        # o_proj sums nh*hd of them.
        v_avg = self.std * math.sqrt(g["hidden_size"] / 2) / 2
        ctx = CONTEXT_GAIN * self.x * EMBED_STD / (v_avg * math.sqrt(g["num_attention_heads"] * g["head_dim"]))
        return math.sqrt(self.out_std ** 2 + ctx ** 2)

    def popularity(self, layer: int):
        """Per-expert router weight on channel 0: normal quantiles, shuffled differently per layer."""
        if layer not in self._popularity:
            torch = self.torch
            E = self.g["num_experts"]
            gen = torch.Generator().manual_seed(_seed_for(self.seed, f"popularity.{layer}"))
            perm = torch.randperm(E, generator=gen)
            quantiles = torch.special.ndtri((torch.arange(E, dtype=torch.float64) + 0.5) / E).float()
            self._popularity[layer] = quantiles[perm]
        return self._popularity[layer]

    def values(self, t: PlannedTensor):
        torch, g, x = self.torch, self.g, self.x
        kind, shape = t.kind, t.shape
        if kind == "norm":
            return torch.ones(shape)
        if kind == "qk_norm":
            return torch.full(shape, self.qk_gain)
        if kind == "embed":
            w = self._normal(t.name, shape, EMBED_STD)
            if self.structured:
                w[:, 0] = self.massive
            return w
        if kind == "lm_head":
            return self._normal(t.name, shape, self.std)
        if kind in ("q", "k"):
            w = self._normal(t.name, shape, self.std * math.sqrt(1.0 - self.lam ** 2))
            if self.structured:
                # Structured share of each head's q/k energy is lam^2 (token content ~ H/2 of |h|^2,
                # the massive channel the other half), so the scale is std * sqrt(head_dim).
                heads = shape[0] // g["head_dim"]
                w[:, 0] = self.lam * self.std * math.sqrt(g["head_dim"]) * self.band.repeat(heads)
            return w
        if kind == "v":
            w = self._normal(t.name, shape, self.std)
            if self.structured:
                w[:, 0] = 0.0  # values carry token content only, not the shared constant
            return w
        if kind == "o":
            w = self._normal(t.name, shape, self._o_std(t.layer))
            if self.structured:
                w[0, :] = 0.0  # keep the massive channel exactly constant through depth
            return w
        if kind == "router":
            w = self._normal(t.name, shape, self.std)
            if self.structured:
                w[:, 0] = x * POPULARITY * self.std * self.popularity(t.layer)
            return w
        if kind == "expert_in":
            return self._normal(t.name, shape, self.std)
        if kind == "expert_out":
            w = self._normal(t.name, shape, self.out_std)
            if self.structured:
                w[0, :] = 0.0
            return w
        return self._other_values(t)

    def _other_values(self, t: PlannedTensor):
        """The kinds of the architectures beyond qwen3_moe (engine/arch/families/synth_plans.py)."""
        torch, kind, shape = self.torch, t.kind, t.shape
        if kind in ("read", "inner", "fused_in"):
            w = self._normal(t.name, shape, self.std)
            if self.structured and kind == "read":
                w[:, 0] = 0.0
            return w
        if kind in ("write", "fused_out"):
            w = self._normal(t.name, shape, self.out_std)
            if self.structured:
                if kind == "write":
                    w[0, :] = 0.0
                else:  # x @ W layout: output channels are the last dimension
                    w[..., 0] = 0.0
            return w
        if kind in ("small", "write_bias"):
            w = self._normal(t.name, shape, self.std)
            if self.structured and kind == "write_bias":
                w[..., 0] = 0.0
            return w
        if kind == "zero_bias":
            return torch.zeros(shape)
        if kind in ("mx_blocks", "mx_scales"):
            return self._mxfp4(t)[0 if kind == "mx_blocks" else 1]
        raise AssertionError(f"no recipe for tensor kind {kind!r}")

    def _mxfp4(self, t: PlannedTensor):
        """The MXFP4 form of the float weight the plain format would hold ([E, out, in])."""
        base = t.name.rsplit("_", 1)[0]  # ...gate_up_proj_blocks → ...gate_up_proj
        if self._quantized is None or self._quantized[0] != base:
            E, rows, groups = t.shape[:3]
            w = self._normal(base, (E, rows, groups * 32), self.std if "gate_up" in base else self.out_std)
            if self.structured and "down" in base:
                w[:, 0, :] = 0.0
            self._quantized = (base, *mxfp4_quantize(w))
        return self._quantized[1:]
