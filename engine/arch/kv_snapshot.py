"""Copies of a KV cache's positions out and back in: what prefix reuse (engine/run/prefix_cache.py)
and the KV files (engine/run/kv_store.py) hold, for every cache kind the architectures use.

A snapshot of positions [a, b) is a dict of named tensors, each the slice of one cache buffer
along its position axis:

    KVCache (MHA / GQA)        k.<layer>, v.<layer>                   [Nkv, n, D]
    LatentCache (MLA)          latent.<layer> [n, r], rope_key.<layer> [n, R],
                               index_key.<layer> [n, Di] (DSA indexer layers)
    WindowedKVCache (gpt_oss)  k.<layer>, v.<layer>                   [Nkv, n, D]
    quantized (int8 / fp8)     <name>.codes [..., n, L] and <name>.scales [..., n]

A position's K/V depends only on the tokens up to it, so a slice restored at the same positions
after the same tokens is what recomputing them would write (the forward pass reads nothing else
of the past: the DSA selection mask is rebuilt by every forward call).

Sliding windows: gpt_oss keeps a sliding layer as a ring of `window` positions, so once a prompt
is longer than the window its early positions are gone, and a prefix cut anywhere but the very
end could not be restored. With reuse on, the engine allocates every layer per position
(`allocate`, charged in the plan by `nbytes`); the attention code reads a ring of ctx_size slots
as positions, and queries still see only their window (its mask), so nothing else changes.
"""

from __future__ import annotations

import torch

from engine.arch.args import ModelArgs
from engine.arch.gpt_oss_layers import WindowedKVCache
from engine.arch.kvquant import QuantizedRows
from engine.arch.layers import KVCache
from engine.arch.mla import LatentCache


def _windowed(args: ModelArgs) -> bool:
    return hasattr(args.attention_impl, "windows")


def allocate(args: ModelArgs, ctx_size: int, kv_dtype, compute_dtype: torch.dtype, keep_positions: bool):
    """The engine's KV cache; keep_positions: every layer holds every position (see the module doc)."""
    if keep_positions and _windowed(args):
        impl = args.attention_impl
        shape = (impl.num_kv_heads, ctx_size, impl.head_dim)
        return WindowedKVCache([torch.zeros(shape, dtype=kv_dtype) for _ in range(args.num_layers)],
                               [torch.zeros(shape, dtype=kv_dtype) for _ in range(args.num_layers)], ctx_size)
    return KVCache.allocate(args, ctx_size, kv_dtype, compute_dtype)


def nbytes(args: ModelArgs, ctx_size: int, kv_dtype, keep_positions: bool) -> int:
    """What `allocate` takes (the memory plan's KV charge)."""
    if keep_positions and _windowed(args):
        impl = args.attention_impl
        return 2 * args.num_layers * impl.num_kv_heads * impl.head_dim * ctx_size * (torch.finfo(kv_dtype).bits // 8)
    return KVCache.nbytes_for(args, ctx_size, kv_dtype)


def position_bytes(args: ModelArgs, kv_dtype) -> int:
    """Bytes one position takes in a snapshot (every layer, codes and scales)."""
    return nbytes(args, 1, kv_dtype, keep_positions=True)


def reuse_unsupported(args: ModelArgs) -> str | None:
    """Why this model's KV cannot be reused, or None. Dynamic NTK RoPE rescales every key by the
    longest sequence seen so far, so a cached key depends on more than its prefix."""
    if (args.rope or {}).get("rope_type") == "dynamic":
        return "dynamic NTK RoPE: a key depends on the longest sequence seen, not only on its prefix"
    return None


def _buffers(kv):
    """(name, buffer, position axis) for every cache buffer: a tensor or QuantizedRows."""
    if isinstance(kv, LatentCache):
        out = [(f"latent.{i}", t, 0) for i, t in enumerate(kv.latent)]
        out += [(f"rope_key.{i}", t, 0) for i, t in enumerate(kv.rope_key)]
        return out + [(f"index_key.{i}", t, 0) for i, t in sorted(kv.index_key.items())]
    if isinstance(kv, (KVCache, WindowedKVCache)):
        if isinstance(kv, WindowedKVCache) and any(t.shape[1] != kv.ctx_size for t in kv.k):
            raise ValueError("a sliding layer's ring cannot be snapshotted (allocate with keep_positions)")
        return [(f"k.{i}", t, 1) for i, t in enumerate(kv.k)] + [(f"v.{i}", t, 1) for i, t in enumerate(kv.v)]
    raise TypeError(f"no snapshot for a {type(kv).__name__}")


def slots(kv) -> list[tuple[str, torch.Tensor, int]]:
    """(name, plain tensor, position axis): a quantized buffer as its codes and its scales."""
    out = []
    for name, buf, axis in _buffers(kv):
        if isinstance(buf, QuantizedRows):
            out += [(f"{name}.codes", buf.codes, axis), (f"{name}.scales", buf.scales, axis)]
        else:
            out.append((name, buf, axis))
    return out


def layout(kv, n: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name → (dtype, shape) a snapshot of n positions of `kv` must have: what a restored block is
    checked against before any of it is copied in."""
    out = {}
    for name, t, axis in slots(kv):
        shape = list(t.shape)
        shape[axis] = n
        out[name] = (t.dtype, tuple(shape))
    return out


def snapshot(kv, start: int, end: int) -> dict[str, torch.Tensor]:
    """Copies of positions [start, end) of every buffer (contiguous, so they serialize as they are)."""
    return {name: t.narrow(axis, start, end - start).clone(memory_format=torch.contiguous_format)
            for name, t, axis in slots(kv)}


def restore(kv, start: int, tensors: dict[str, torch.Tensor], count: int | None = None) -> None:
    """Write a snapshot back at positions [start, start + n), or only its first `count`. Checked
    whole first: a snapshot that does not fit this cache exactly (names, dtypes, shapes) changes
    nothing."""
    first = next(iter(tensors.values()), None)
    if first is None:
        raise ValueError("an empty snapshot")
    entries = slots(kv)
    axis0 = entries[0][2]
    n = tensors[entries[0][0]].shape[axis0] if entries[0][0] in tensors else -1
    want = layout(kv, n)
    got = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    if n <= 0 or got != want or start + n > kv.ctx_size:
        raise ValueError("the snapshot does not match this KV cache")
    count = n if count is None else count
    if not 0 <= count <= n:
        raise ValueError(f"cannot restore {count} of a snapshot's {n} positions")
    for name, t, axis in entries:
        t.narrow(axis, start, count).copy_(tensors[name].narrow(axis, 0, count))


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())
