"""Prefix reuse: the KV of recent sequences, so a prompt that begins as an earlier one did
prefills only what follows (llama-server's cache_prompt, vLLM's automatic prefix caching).

Three places a prompt's prefix may already be, tried in this order of cost:
  1. the engine's own KV cache, token by token: the previous sequence's positions are still
     there (`Engine.kv_tokens` says which tokens they hold), so a conversation's next turn,
     which resends the history, costs nothing to restore;
  2. RAM blocks of BLOCK_TOKENS positions (EngineConfig.prefix_cache bytes, LRU), each keyed by
     a hash chain over the model key and every token up to its end, so a block matches only
     after the very same prefix (longest common prefix at block granularity; a prompt that
     diverges inside a block recomputes from that block's start);
  3. blocks evicted from RAM, on the SSD (engine/run/kv_store.py), loaded back when a later
     prompt needs them, and written when they leave RAM and when the engine closes.
At least the prompt's last token is always recomputed: its logits are what generation needs.

The KV a block holds depends on everything in `model_key`: the engine version, the checkpoint
(config.json and every shard's header: engine/format/convert.py:fingerprint), the compute and KV
dtypes, RoPE, the routing trim and the cache's own layout. A block computed under any other
of these has another key and is never found.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import __version__
from engine.arch import kv_snapshot
from engine.run.kv_store import MAX_HEADER, KVFileError, KVStore, write_file, decode, encode, warn

BLOCK_TOKENS = 64  # positions per block: small enough to share most of a prefix, large enough
# that a block's copy and its file are worth their bookkeeping (64 x a few KiB per token)


def model_key(engine) -> tuple[str, dict]:
    """(hex key, the facts it hashes): everything a position's K/V depends on besides the tokens."""
    from_config = engine.config
    facts = {"engine_version": __version__, "model": engine.fingerprint,
             "dtype": str(engine.dtype).replace("torch.", ""), "kv_dtype": str(engine.kv_dtype).replace("torch.", ""),
             "rope": engine.args.rope, "top_k_reduction": from_config.top_k_reduction,
             "expert_threshold": from_config.expert_threshold, "cache": type(engine.kv).__name__}
    text = json.dumps(facts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), facts


def block_key(model: str, parent: str, start: int, tokens) -> str:
    h = hashlib.sha256(f"{model}:{parent}:{start}:".encode())
    h.update(torch.tensor(list(tokens), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Block:
    key: str
    parent: str
    start: int
    tokens: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    nbytes: int


def copyable(kv) -> bool:
    """Whether a cache's positions can be copied out and back (not a sliding layer's ring: a
    batched sequence's cache, Engine.new_cache, of a windowed model)."""
    try:
        kv_snapshot.slots(kv)
    except (ValueError, TypeError):
        return False
    return True


class PrefixCache:
    """RAM blocks (capacity bytes, LRU) over an optional KVStore; restore/remember act on `kv`
    (the engine's cache), or on the cache they are given (another sequence's, of the same layout)."""

    def __init__(self, kv, key: str, capacity: int, store: KVStore | None = None, block_tokens: int = BLOCK_TOKENS):
        self.kv, self.key, self.capacity, self.store = kv, key, capacity, store
        self.block_tokens = block_tokens
        self.blocks: OrderedDict[str, Block] = OrderedDict()  # least recently used first
        self.used = 0
        self.stats = {"lookups": 0, "hits": 0, "cached_tokens": 0, "restored_bytes": 0, "evicted_blocks": 0}

    # --- keys ------------------------------------------------------------------------------------

    def chain(self, ids: list[int], n_blocks: int) -> list[tuple[str, str, int, tuple]]:
        """(key, parent, start, tokens) of the first n_blocks full blocks of ids."""
        out, parent, B = [], "", self.block_tokens
        for i in range(n_blocks):
            tokens = tuple(ids[i * B:(i + 1) * B])
            key = block_key(self.key, parent, i * B, tokens)
            out.append((key, parent, i * B, tokens))
            parent = key
        return out

    def _expect(self, key, parent, start, tokens) -> dict:
        return {"key": key, "parent": parent, "start": start, "tokens": list(tokens), "model_key": self.key}

    # --- restore ---------------------------------------------------------------------------------

    def restore(self, ids: list[int], live: list[int], kv=None) -> int:
        """Make positions [0, m) of the KV cache (`kv`, else the engine's) hold ids[:m], for the
        largest m this can (at most len(ids) - 1), and return m. `live`: the tokens that cache
        holds now (Engine.kv_tokens for the engine's)."""
        kv = self.kv if kv is None else kv
        self.stats["lookups"] += 1
        limit = len(ids) - 1
        have = min(common_prefix(live, ids), limit)
        B = self.block_tokens
        # Blocks are in the engine's cache's layout: another cache of another layout reuses only its own positions.
        chain = self.chain(ids, limit // B) if self._fits(kv) else []
        # The blocks present, from the first; a missing or unusable one ends the prefix.
        found: list[tuple[int, dict]] = []
        for key, parent, start, tokens in chain:
            if start + B <= have:  # already in the live cache
                found.append((start, {}))
                continue
            tensors = self._lookup(key, parent, start, tokens)
            if tensors is None:
                break
            found.append((start, tensors))
        reach = len(found) * B
        if reach > have:
            for start, tensors in found:
                if tensors:
                    kv_snapshot.restore(kv, start, tensors)
                    self.stats["restored_bytes"] += kv_snapshot.nbytes_of(tensors)
            have = reach
        if have:
            self.stats["hits"] += 1
            self.stats["cached_tokens"] += have
        return have

    def _fits(self, kv) -> bool:
        return kv is self.kv or kv_snapshot.layout(kv, 1) == kv_snapshot.layout(self.kv, 1)

    def _lookup(self, key, parent, start, tokens) -> dict[str, torch.Tensor] | None:
        block = self.blocks.get(key)
        if block is not None:
            if block.tokens != tokens or block.parent != parent or block.start != start:
                return None  # a hash collision would be the only way here: recompute
            self.blocks.move_to_end(key)
            return block.tensors
        if self.store is None or not self.store.has(key):
            return None
        tensors = self.store.get(key, self._expect(key, parent, start, tokens),
                                 kv_snapshot.layout(self.kv, self.block_tokens))
        if tensors is not None:
            self._insert(Block(key, parent, start, tokens, tensors, kv_snapshot.nbytes_of(tensors)), spill=False)
        return tensors

    # --- remember --------------------------------------------------------------------------------

    def remember(self, tokens: list[int], kv=None) -> None:
        """Keep the full blocks of `tokens`, whose K/V the cache (`kv`, else the engine's) holds at
        positions 0..len-1. Deepest first, so a prefix's first blocks are the most recently used
        and leave RAM last (a later block is useless without every block before it)."""
        kv = self.kv if kv is None else kv
        if not self._fits(kv):
            return
        chain = self.chain(tokens, len(tokens) // self.block_tokens)
        for key, parent, start, toks in reversed(chain):
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            tensors = kv_snapshot.snapshot(kv, start, start + self.block_tokens)
            self._insert(Block(key, parent, start, toks, tensors, kv_snapshot.nbytes_of(tensors)), spill=True)

    def _insert(self, block: Block, spill: bool) -> None:
        if block.nbytes > self.capacity:
            if spill:
                self._spill(block)
            return
        while self.used + block.nbytes > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.used -= old.nbytes
            self.stats["evicted_blocks"] += 1
            self._spill(old)
        self.blocks[block.key] = block
        self.used += block.nbytes

    def _spill(self, block: Block) -> None:
        if self.store is not None and self.store.enabled:
            self.store.put(block.key, self._expect(block.key, block.parent, block.start, block.tokens),
                           block.tensors)

    # --- life ------------------------------------------------------------------------------------

    def clear(self) -> None:
        self.blocks.clear()
        self.used = 0

    def close(self) -> None:
        """Write the RAM blocks to the SSD (a restarted server finds them there), then let go."""
        if self.store is not None:
            for block in list(self.blocks.values()):
                if not self.store.enabled:
                    break
                self._spill(block)
            self.store.close()

    def metrics(self) -> dict:
        out = dict(self.stats)
        out.update(ram_bytes=self.used, ram_blocks=len(self.blocks))
        if self.store is not None:
            out.update(spilled_bytes=self.store.spilled_bytes, disk_read_bytes=self.store.read_bytes,
                       disk_bytes=self.store.used_bytes, disk_enabled=self.store.enabled,
                       skipped_files=self.store.skipped)
        return out


def open_prefix_cache(engine, kv_dir: str | Path | None, kv_disk_bytes: int) -> PrefixCache | None:
    """The engine's prefix cache per its config (None: off, or a model whose KV cannot be reused)."""
    if engine.config.prefix_cache <= 0 or kv_snapshot.reuse_unsupported(engine.args):
        return None
    key, _facts = model_key(engine)
    store = KVStore(Path(kv_dir), engine.fingerprint, kv_disk_bytes) if kv_dir and kv_disk_bytes > 0 else None
    return PrefixCache(engine.kv, key, engine.config.prefix_cache, store)


# --- `run --prompt-cache FILE` (llama.cpp's flag): one prompt's KV, token by token ---------------

def load_prompt_file(engine, path: str | Path, ids: list[int]) -> int:
    """Restore the longest prefix of `ids` that the file's prompt shares (at most len(ids) - 1
    positions) and return its length; 0 when there is no file, or (one warning) an unusable one."""
    path = Path(path)
    if not path.exists():
        return 0
    if kv_snapshot.reuse_unsupported(engine.args):
        return 0
    key, _facts = model_key(engine)
    limit = MAX_HEADER + 8 + kv_snapshot.position_bytes(engine.args, engine.kv_dtype) * engine.kv.ctx_size
    try:
        meta, tensors = decode(path, None, limit)
        tokens = meta.get("tokens")
        if meta.get("model_key") != key:
            raise KVFileError(f"{path}: written for another model or engine settings (foreign or stale)")
        if (not isinstance(tokens, list) or not tokens or len(tokens) > engine.kv.ctx_size
                or not all(type(t) is int for t in tokens)):
            raise KVFileError(f"{path}: its token list is missing or malformed")
        if {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()} != kv_snapshot.layout(engine.kv, len(tokens)):
            raise KVFileError(f"{path}: its tensors do not fit this model's KV cache")
    except KVFileError as exc:
        warn(f"prompt cache skipped, the prompt is recomputed: {exc}")
        return 0
    reuse = min(common_prefix(tokens, ids), len(ids) - 1)
    if reuse > 0:
        kv_snapshot.restore(engine.kv, 0, tensors, count=reuse)
        del engine.kv_tokens[:]
        engine.kv_tokens.extend(ids[:reuse])
    return reuse


def save_prompt_file(engine, path: str | Path, n: int) -> None:
    """Write the K/V of the cache's first n positions (a prompt's) and their tokens."""
    if kv_snapshot.reuse_unsupported(engine.args) or n <= 0 or len(engine.kv_tokens) < n:
        return
    key, facts = model_key(engine)
    meta = {"model_key": key, "facts": facts, "start": 0, "tokens": list(engine.kv_tokens[:n])}
    write_file(Path(path), encode(meta, kv_snapshot.snapshot(engine.kv, 0, n)))
