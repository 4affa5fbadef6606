"""Multi-head latent attention (deepseek_v3, glm_moe_dsa) and GLM-5's sparse-attention indexer.

MLA compresses each token's keys and values into one latent c [r] (r = kv_lora_rank) plus one
rope key k_r [R] shared by all heads (R = qk_rope_head_dim). The cache stores exactly that,
(r + R) numbers per token per layer instead of 2·N·D for a per-head cache. Per head n,
    k_n = [W_uk[n] c ; k_r]        v_n = W_uv[n] c        (W_uk, W_uv: halves of kv_b_proj)
so q_n·k_n = (W_uk[n]ᵀ q_nope_n)·c + q_rope_n·k_r: the query is projected into latent space
once ("absorbed"), attention runs over the cached latents directly, and W_uv is applied to the
attended latent afterwards. No per-head K/V is ever materialised, in prefill or decode (the one
latent "head" is broadcast to the N query heads, not repeated); a prefill's scores [N, T, S] are,
by SDPA's math path, so its queries go in blocks (layers.query_rows).

GLM-5 (glm_moe_dsa) adds DeepSeek Sparse Attention: a small indexer (its own heads over a
per-token indexer key, also cached) scores every past position, and each query attends only to
its top-`index_topk` positions. Layers marked "shared" reuse the previous indexer's selection.

Shape legend: T new tokens, S positions attended, N heads, r kv_lora_rank, R rope dim,
P qk_nope_head_dim, Vd v_head_dim, Hi/Di indexer heads/head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.arch.kvquant import cache_bytes, kv_buffer
from engine.arch.rope import apply_rope
from engine.arch.layers import query_rows, rms_norm
from engine.weights.stored import linear


def _project(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T: F.linear for a plain weight, as always; a stored-quantized one (FP8 projections
    of a published checkpoint, engine/weights/fp8.py; int8/int4 of a `convert --scope all`
    container, the indexer's included) through its own kernel. Every projection goes through
    here; kv_b_proj, viewed per head, is a plain tensor whatever the format (dequantized at load)."""
    return F.linear(x, w, bias) if type(w) is torch.Tensor else linear(x, w, bias)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0,x1),(x2,x3)…, output de-interleaved (evens' rotations, then
    odds'), as DeepSeek's checkpoints expect. cos/sin: [T, R] in the cat(freqs, freqs) layout."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


INDEX_QUERY_BLOCK = 128  # queries scored at once by the indexer (bounds prefill memory)


@dataclass(frozen=True)
class IndexerArgs:
    n_heads: int
    head_dim: int
    topk: int
    full_layers: frozenset[int]  # layers with their own indexer; the others reuse the last selection


@dataclass
class LatentCache:
    """Per layer: latent [ctx, r] and rope key [ctx, R]; indexer keys [ctx, Di] where used.
    Each a torch.Tensor, or QuantizedRows (kv_dtype int8 / fp8, engine/arch/kvquant.py)."""

    latent: list
    rope_key: list
    index_key: dict = field(default_factory=dict)
    selection: torch.Tensor | None = None  # the last indexer's [T, S] mask, within one forward

    @property
    def ctx_size(self) -> int:
        return self.latent[0].shape[0]


@dataclass(frozen=True)
class MLAAttention:
    num_heads: int
    q_lora_rank: int | None  # None: a plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)²
    rope_interleave: bool
    attention_bias: bool = False
    norm_eps: float = 1e-6  # q_a/kv_a layernorms use the module default, not rms_norm_eps
    indexer: IndexerArgs | None = None

    # --- what the runtime needs to know ------------------------------------------------------

    def layer_shapes(self, p: str, layer: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """Resident tensors of one layer's attention and their shapes; p = "model.layers.{i}.self_attn"."""
        H, N, R, r = hidden, self.num_heads, self.qk_rope_head_dim, self.kv_lora_rank
        qk, qr = self.qk_nope_head_dim + R, self.q_lora_rank
        if qr is None:
            out = {f"{p}.q_proj.weight": (N * qk, H)}
        else:
            out = {f"{p}.q_a_proj.weight": (qr, H), f"{p}.q_a_layernorm.weight": (qr,), f"{p}.q_b_proj.weight": (N * qk, qr)}
        out.update({f"{p}.kv_a_proj_with_mqa.weight": (r + R, H), f"{p}.kv_a_layernorm.weight": (r,),
                    f"{p}.kv_b_proj.weight": (N * (self.qk_nope_head_dim + self.v_head_dim), r),
                    f"{p}.o_proj.weight": (H, N * self.v_head_dim)})
        if self.attention_bias:
            out.update({f"{p}.kv_a_proj_with_mqa.bias": (r + R,), f"{p}.o_proj.bias": (H,)})
            if qr is not None:
                out[f"{p}.q_a_proj.bias"] = (qr,)
        ix = self.indexer
        if ix is not None and layer in ix.full_layers:
            i, Di = f"{p}.indexer", ix.head_dim
            out.update({f"{i}.wq_b.weight": (ix.n_heads * Di, qr), f"{i}.wk.weight": (Di, H),
                        f"{i}.k_norm.weight": (Di,), f"{i}.k_norm.bias": (Di,), f"{i}.weights_proj.weight": (ix.n_heads, H)})
        return out

    def per_token_elems(self, num_layers: int) -> int:
        """Cache elements one token costs over all layers: the latent, the rope key, and the
        indexer key on layers that run an indexer."""
        n = num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        if self.indexer is not None:
            n += len(self.indexer.full_layers) * self.indexer.head_dim
        return n

    def prefill_scores_bytes(self, tokens: int, positions: int) -> int:
        """What a prefill of `tokens` queries over `positions` materializes beyond its per-token
        tensors (the memory plan charges it): the key [S, r+R] and, from a quantized cache, the
        latents and rope keys in the compute dtype; about three copies of one query block's fp32 scores
        [N, rows, S] on SDPA's math path (the product, the masked sum, the softmax); with the
        indexer, its keys [Di, S] and one block's scores [rows, Hi, S] and relu in fp32, the block's
        [rows, S] index twice, and the [T, S] causal and selection masks."""
        N, width = self.num_heads, self.kv_lora_rank + self.qk_rope_head_dim
        # The key [S, r+R] (a cat) and the latents and rope keys read back from a quantized cache.
        n = 2 * 4 * positions * width + 3 * 4 * N * query_rows(N, positions, tokens) * positions
        ix = self.indexer
        if ix is not None:
            rows = min(tokens, INDEX_QUERY_BLOCK)
            n += 4 * positions * ix.head_dim + 2 * 4 * rows * (ix.n_heads + 1) * positions + 2 * tokens * positions
        return n

    quantized_cache = True  # int8 / fp8 latents work (engine/arch/kvquant.py): one scale per row

    def cache_rows(self, num_layers: int) -> int:
        """Rows one token adds over all layers (each gets its own scale when quantized)."""
        return 2 * num_layers + (len(self.indexer.full_layers) if self.indexer is not None else 0)

    def cache_nbytes(self, num_layers: int, ctx_size: int, kv_dtype) -> int:
        return cache_bytes(self.per_token_elems(num_layers) * ctx_size, self.cache_rows(num_layers) * ctx_size,
                           kv_dtype)

    def allocate_cache(self, num_layers: int, ctx_size: int, kv_dtype,
                       compute_dtype: torch.dtype | None = None) -> LatentCache:
        compute_dtype = compute_dtype or (kv_dtype if isinstance(kv_dtype, torch.dtype) else torch.float32)
        index = {}
        if self.indexer is not None:
            index = {i: kv_buffer((ctx_size, self.indexer.head_dim), kv_dtype, compute_dtype)
                     for i in sorted(self.indexer.full_layers)}
        return LatentCache([kv_buffer((ctx_size, self.kv_lora_rank), kv_dtype, compute_dtype)
                            for _ in range(num_layers)],
                           [kv_buffer((ctx_size, self.qk_rope_head_dim), kv_dtype, compute_dtype)
                            for _ in range(num_layers)],
                           index)

    # --- the forward pass --------------------------------------------------------------------

    def forward(self, w: dict, p: str, layer: int, x: torch.Tensor, start_pos: int, cache: LatentCache,
                cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        T, N = x.shape[0], self.num_heads
        P, R, r, Vd = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank, self.v_head_dim
        rope = rope_interleaved if self.rope_interleave else apply_rope
        if self.q_lora_rank is None:
            q_resid = None
            q = _project(x, w[f"{p}.q_proj.weight"])
        else:
            q_resid = rms_norm(_project(x, w[f"{p}.q_a_proj.weight"], w.get(f"{p}.q_a_proj.bias")),
                               w[f"{p}.q_a_layernorm.weight"], self.norm_eps)  # [T, q_lora_rank]
            q = _project(q_resid, w[f"{p}.q_b_proj.weight"])
        q = q.view(T, N, P + R).transpose(0, 1)  # [N, T, P+R]
        q_nope, q_rope = q[..., :P], rope(q[..., P:], cos, sin)

        compressed = _project(x, w[f"{p}.kv_a_proj_with_mqa.weight"], w.get(f"{p}.kv_a_proj_with_mqa.bias"))
        latent = rms_norm(compressed[:, :r], w[f"{p}.kv_a_layernorm.weight"], self.norm_eps)  # [T, r]
        k_rope = rope(compressed[:, r:], cos, sin)  # [T, R]
        S = start_pos + T
        cache.latent[layer][start_pos:S] = latent
        cache.rope_key[layer][start_pos:S] = k_rope
        latents = cache.latent[layer][:S].to(q.dtype)  # [S, r]
        rope_keys = cache.rope_key[layer][:S].to(q.dtype)  # [S, R]

        if self.indexer is not None:
            mask = self._sparse_mask(w, p, layer, x, q_resid, start_pos, cache, cos, sin, mask)

        kv_b = w[f"{p}.kv_b_proj.weight"].view(N, P + Vd, r)
        q_latent = torch.matmul(q_nope, kv_b[:, :P])  # [N, T, r]: W_ukᵀ absorbed into the query
        query = torch.cat([q_latent, q_rope], dim=-1)  # [N, T, r+R]
        # [1, 1, S, r+R]: one "head" shared by all N, broadcast, never expanded (enable_gqa on SDPA's
        # math path copied it N times: [N, S, r+R], gigabytes at a long context on DeepSeek-V3).
        key, value = torch.cat([latents, rope_keys], dim=-1)[None, None], latents[None, None]
        # The math path writes the scores [N, rows, S] out: queries in blocks bound them (layers.py).
        rows = query_rows(N, S, T)
        out = torch.cat([F.scaled_dot_product_attention(query[None, :, b:b + rows], key, value,
                                                        attn_mask=None if mask is None else mask[b:b + rows],
                                                        scale=self.softmax_scale)
                         for b in range(0, T, rows)], dim=2) if rows < T else \
            F.scaled_dot_product_attention(query[None], key, value, attn_mask=mask, scale=self.softmax_scale)
        out = torch.matmul(out.squeeze(0), kv_b[:, P:].transpose(1, 2))  # [N, T, Vd]: W_uv after attention
        out = out.transpose(0, 1).reshape(T, N * Vd)
        return _project(out, w[f"{p}.o_proj.weight"], w.get(f"{p}.o_proj.bias"))

    def _sparse_mask(self, w, p, layer, x, q_resid, start_pos, cache, cos, sin, causal):
        """[T, S] bool: causal and among the query's top-`index_topk` positions by the indexer."""
        ix = self.indexer
        if layer not in ix.full_layers:
            if cache.selection is None:
                raise ValueError(f"layer {layer} reuses an indexer selection but no earlier layer made one")
            return cache.selection
        T, S, R = x.shape[0], start_pos + x.shape[0], self.qk_rope_head_dim
        i = f"{p}.indexer"
        q = _project(q_resid, w[f"{i}.wq_b.weight"]).view(T, ix.n_heads, ix.head_dim)  # [T, Hi, Di]
        q = torch.cat([rope_interleaved(q[..., :R].transpose(0, 1), cos, sin).transpose(0, 1), q[..., R:]], dim=-1)
        k = F.layer_norm(_project(x, w[f"{i}.wk.weight"]), (ix.head_dim,), w[f"{i}.k_norm.weight"],
                         w[f"{i}.k_norm.bias"], 1e-6)  # [T, Di]
        k = torch.cat([rope_interleaved(k[:, :R], cos, sin), k[:, R:]], dim=-1)
        cache.index_key[layer][start_pos:S] = k
        keys = cache.index_key[layer][:S].float().t()  # [Di, S]
        head_w = _project(x, w[f"{i}.weights_proj.weight"]).float() * ix.n_heads ** -0.5  # [T, Hi]
        if causal is None:
            causal = torch.ones(T, S, dtype=torch.bool)
        selected = torch.zeros(T, S, dtype=torch.bool)
        top = min(ix.topk, S)
        # Queries in blocks: the per-head scores [rows, Hi, S] are the big transient (a 2k-token
        # prompt on GLM-5 would be 0.5 GB at once); top-k is per query, so blocks change nothing.
        for r in range(0, T, INDEX_QUERY_BLOCK):
            rows = slice(r, r + INDEX_QUERY_BLOCK)
            # Same association as the reference ([T,Hi,Di]·[Di,S], then the head weights as a
            # [1,Hi]·[Hi,S] product per query), so equal scores tie-break the same way in top-k.
            scores = F.relu(torch.matmul(q[rows].float(), keys) * ix.head_dim ** -0.5)  # [rows, Hi, S]
            index = torch.matmul(head_w[rows].unsqueeze(1), scores).squeeze(1)  # [rows, S]
            index = index.masked_fill(~causal[rows], float("-inf"))
            selected[rows].scatter_(1, index.topk(top, dim=-1).indices, True)
        selected &= causal
        cache.selection = selected
        return selected
