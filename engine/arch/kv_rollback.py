"""What a speculative verify pass must undo in a KV cache when drafted tokens are rejected.

A verify writes K/V for positions start..end-1 (the last accepted token and the drafts); when
only the first `kept` positions are accepted, the rest must read as if never written. Per cache
kind (engine/arch/kv_snapshot.py lists them):

    KVCache (MHA / GQA, plain or quantized rows)   nothing: a position's row is only ever read by
    LatentCache (MLA latents, rope keys, the DSA   queries at later positions, and the next step
    indexer keys)                                  writes each rejected position again before any
                                                   query reads it (one scale per row when quantized,
                                                   so a row is rewritten whole). The DSA selection
                                                   (`selection`) is rebuilt by every forward call.
    WindowedKVCache (gpt_oss sliding layers)       a sliding layer keeps a ring of `window` slots,
                                                   position p in slot p % size: writing a rejected
                                                   position overwrote a slot that still holds an
                                                   older position the next queries attend. Those
                                                   slots are saved before the verify and put back.

So `save` copies the ring slots a verify of [start, end) will overwrite (nothing for the other
kinds), and `restore` puts back those of the rejected positions. A verify longer than the ring
would overwrite an accepted position's slot with a rejected one: `max_rows` bounds it.

Shape legend: Nkv key/value heads, n positions saved, D head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.arch.gpt_oss_layers import WindowedKVCache


@dataclass
class Saved:
    """The ring slots a verify of positions [start, end) overwrites: per layer (k [Nkv, n, D], v)."""

    start: int
    end: int
    rings: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _rings(kv) -> list[int]:
    """The layers of `kv` kept as a ring shorter than the context (gpt_oss's sliding layers)."""
    if not isinstance(kv, WindowedKVCache):
        return []
    return [i for i, t in enumerate(kv.k) if t.shape[1] < kv.ctx_size]


def max_rows(kv) -> int | None:
    """The most positions one verify may write so that `restore` can undo any rejection: the
    shortest ring (None: no ring, no bound)."""
    sizes = [kv.k[i].shape[1] for i in _rings(kv)]
    return min(sizes) if sizes else None


def save(kv, start: int, end: int) -> Saved:
    """Copies of the ring slots positions [start, end) map to (nothing to copy for other caches)."""
    saved = Saved(start, end)
    for layer in _rings(kv):
        size = kv.k[layer].shape[1]
        if end - start > size:
            raise ValueError(f"a verify of {end - start} positions exceeds layer {layer}'s ring of {size}")
        slots = torch.arange(start, end) % size
        saved.rings[layer] = (kv.k[layer].index_select(1, slots), kv.v[layer].index_select(1, slots))
    return saved


def restore(kv, saved: Saved, kept: int) -> None:
    """Undo the positions from saved.start + kept on: their ring slots get back what they held."""
    first = saved.start + kept
    if first >= saved.end:
        return
    for layer, (k, v) in saved.rings.items():
        size = kv.k[layer].shape[1]
        slots = torch.arange(first, saved.end) % size
        kv.k[layer].index_copy_(1, slots, k[:, kept:])
        kv.v[layer].index_copy_(1, slots, v[:, kept:])
