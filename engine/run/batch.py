"""Continuous batching: several sequences decoding together on one engine, each in its own KV cache.

The scheduler runs steps on one thread (the caller's; serve's worker thread). Each step:

    1. sequences cancelled since the last step leave (their cache goes back to the pool)
    2. admission, FIFO: the head of the waiting line starts when the pool has a cache free for each
       of its sequences (up to EngineConfig.max_batch caches: the engine's own and new_cache()
       ones, made once and reused, so memory stays what the plan charged); its prompt's prefix is
       restored from the prefix cache into its cache (engine/run/prefix_cache.py), the cache
       chosen among the free ones for the longest live prefix (a chat's next turn finds its own)
    3. one decode step over every sequence past its first token: Engine.decode_rows for two or
       more (each routed expert fetched once per layer for all rows, each row with its solo bits),
       the solo decode for one
    4. one prefill pass: the oldest prefilling prompt's next group (a group prefill_into would cut),
       joined by the next groups of the prompts admitted after it while their total stays within
       one group (the tokens the memory plan charged a pass for), so prompts that arrived together
       are prefilled together, each routed expert read once for all of them (Engine.prefill_parts);
       while other sequences are decoding, the pass takes at most `stall_tokens` prompt tokens (one
       sub-chunk, PREFILL_CHUNK, by default), so a running sequence waits at most one sub-chunk's
       pass between its tokens however large the plan's group is (under a budget it can be the
       whole context: a 2,048-token newcomer stalled demo's streams ~8 s cold); a prompt with
       nothing decoding beside it keeps the whole group (the fewest expert reads); after a prompt's
       last group each of its sequences takes its first token
    5. a sequence that has finished (Decoding.settle: max_new_tokens, a stop id, on_token, a
       processor's done()), failed or been cancelled leaves at once; its prompt and answer are
       remembered in the prefix cache

Every token is chosen by the sequence's own Decoding (engine/run/generate.py), the code generate()
runs, with its own sampler, processors and log-probs.

A group: sequences that share one prompt (an OpenAI request with n > 1). The first one prefills
it; the others wait in caches of their own and, when its last group is done, receive a copy of
its prompt positions and the same last logits, then each samples with its own sampler. A group
starts only when the pool has a cache for each of its sequences, so n may not exceed max_batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.arch import kv_snapshot
from engine.arch.gpt_oss_layers import WindowedKVCache
from engine.arch.kvquant import QuantizedRows
from engine.base.config import PREFILL_CHUNK
from engine.base.errors import PromptError
from engine.run.generate import Decoding
from engine.run.prefix_cache import common_prefix


@dataclass(eq=False)
class BatchSequence:
    """One sequence the scheduler runs. `cancelled()` True: it leaves at the next step (its client
    has gone); `on_done(sequence)` is called once when it leaves, on the scheduler's thread."""

    decoding: Decoding
    cancelled: Callable[[], bool] | None = None
    on_done: Callable[["BatchSequence"], None] | None = None
    # Set by the scheduler.
    state: str = "new"  # waiting → prefill (a group's first) or follow (the others) → decode → done
    outcome: str | None = None  # "finished" | "cancelled" | "error"
    error: BaseException | None = None
    submitted: float = 0.0  # time.perf_counter() at submit
    admitted: float | None = None  # when it got its cache
    first_token_at: float | None = None
    last_token_at: float | None = None
    group: list["BatchSequence"] = field(default_factory=list, repr=False)
    slot: "_Slot | None" = field(default=None, repr=False)
    _group: int = 0  # the leader's prefill group: tokens per pass (Engine.prefill_group_tokens)
    _done_tokens: int = 0  # prompt tokens of the suffix its prefill has written so far
    _reused: int = 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.decoding.prompt_ids

    @property
    def wait_seconds(self) -> float | None:
        """Time from submit to admission (queue wait)."""
        return None if self.admitted is None else self.admitted - self.submitted

    @property
    def decode_seconds(self) -> float:
        """Time from its first token to its last."""
        if self.first_token_at is None or self.last_token_at is None:
            return 0.0
        return self.last_token_at - self.first_token_at

    def is_cancelled(self) -> bool:
        return bool(self.cancelled and self.cancelled())


@dataclass
class StepInfo:
    """What one scheduler step did (serve's /metrics and `bench --batch` read it)."""

    rows: int = 0  # sequences decoded this step
    prefill_tokens: int = 0  # prompt tokens prefilled this step: one group at most, stall_tokens while others decode
    decode_seconds: float = 0.0  # the decode forward and its rows' token choices
    # Experts fetched per MoE layer by a step of two rows or more (the union of the rows' routes);
    # None on a one-row step (the solo decode's fused paths fetch no union) or a dense model.
    union_experts: float | None = None
    bytes_read: int | None = None  # read by the expert store during the decode (streaming only)
    admitted: list[BatchSequence] = field(default_factory=list)


class _Slot:
    """A KV cache of the pool and the tokens whose K/V it holds at positions 0.. (the engine's own
    cache's list is Engine.kv_tokens itself)."""

    def __init__(self, kv, tokens: list[int]):
        self.kv, self.tokens = kv, tokens
        self.used = False
        self.released = 0  # when it last went back to the pool (the pool's counter)


class CachePool:
    """Up to `size` KV caches: the engine's own, then Engine.new_cache() ones made when first
    needed and kept (the memory plan charged max_batch of them; none is freed, none made beyond)."""

    def __init__(self, engine, size: int):
        self.engine, self.size = engine, size
        self.slots = [_Slot(engine.kv, engine.kv_tokens)]
        self._clock = 0

    def free(self) -> int:
        return sum(not s.used for s in self.slots) + self.size - len(self.slots)

    def take(self, prompt: list[int]) -> _Slot:
        """A free cache: the one whose live tokens share the longest prefix with `prompt` (its K/V is
        reused), else a new one while under `size` (so other live prefixes stay), else the least
        recently released."""
        free = [s for s in self.slots if not s.used]
        best = max(free, key=lambda s: (common_prefix(s.tokens, prompt), -s.released), default=None)
        if (best is None or not common_prefix(best.tokens, prompt)) and len(self.slots) < self.size:
            best = _Slot(self.engine.new_cache(), [])
            self.slots.append(best)
        if best is None:
            raise RuntimeError("no KV cache free (admission checks the pool first)")
        best.used = True
        return best

    def give(self, slot: _Slot) -> None:
        self._clock += 1
        slot.used, slot.released = False, self._clock


class Scheduler:
    """Admission, prefill groups and batched decode steps for sequences on one engine (module doc)."""

    def __init__(self, engine, max_batch: int | None = None, stall_tokens: int = PREFILL_CHUNK):
        """stall_tokens: the most prompt tokens one prefill pass takes while other sequences are
        decoding (their longest wait between two tokens is one such pass); 0: the plan's group.
        The attention's sub-chunk by default: layer-major prefill's unit (a pass of one sub-chunk
        cuts the group's own sub-chunk boundaries), the issue's "never stall longer than one chunk".
        The newcomer pays for it: each pass applies (under a budget, reads) most routed experts
        again. Measured on demo bf16, three streams and a 1,900-token newcomer, 2 threads, one
        process, rounds alternated (benchmarks/serving/newcomer_stall.py, 2026-12-06): resident, the
        streams' worst gap 7.1 s -> 1.5 s for the newcomer's TTFT 7.1 s -> 10.3 s; under a 2 GiB
        budget (direct reads) 7.6 s -> 2.4 s for 7.2 s -> 16.6 s (29 GiB of expert reads against
        3.3), where 1,024 tokens a pass gave 4.8 s for 8.7 s."""
        self.engine = engine
        self.max_batch = max_batch or engine.config.max_batch
        self.stall_tokens = stall_tokens
        self.pool = CachePool(engine, self.max_batch)
        self.waiting: deque[list[BatchSequence]] = deque()
        self.running: list[BatchSequence] = []  # admission order
        self.moe_layers = sum(engine.args.moe_layer_flags) if engine.experts is not None else 0
        self.steps = 0

    # --- what callers use -------------------------------------------------------------------------

    def submit(self, group: list[BatchSequence] | BatchSequence) -> list[BatchSequence]:
        """Queue one sequence, or a group sharing one prompt (the first prefills it for all)."""
        group = [group] if isinstance(group, BatchSequence) else list(group)
        if not group:
            raise ValueError("an empty group")
        if len(group) > self.max_batch:
            raise PromptError(f"{len(group)} sequences of one prompt: more than max_batch {self.max_batch} "
                              "can run at once")
        if any(s.prompt_ids != group[0].prompt_ids for s in group):
            raise ValueError("the sequences of a group share one prompt")
        now = time.perf_counter()
        for s in group:
            s.state, s.group, s.submitted = "waiting", group, s.submitted or now  # a caller's own clock kept
        if all(s.decoding.done for s in group):  # nothing to generate (max_new_tokens 0): as generate() returns
            for s in group:
                s.admitted = now
                self._leave(s, "finished")
            return group
        self.waiting.append(group)
        return group

    @property
    def active(self) -> bool:
        """Whether anything is waiting or running."""
        return bool(self.waiting or self.running)

    def room(self) -> int:
        """Caches a newly submitted group could take at the next step: free ones not promised to
        groups already waiting."""
        return self.pool.free() - sum(len(g) for g in self.waiting)

    def run(self, on_step: Callable[[StepInfo], None] | None = None) -> None:
        """Steps until nothing waits or runs."""
        while self.active:
            info = self.step()
            if on_step is not None:
                on_step(info)

    def step(self) -> StepInfo:
        info = StepInfo()
        self._leave_cancelled()
        self._admit(info)
        decoding = [s for s in self.running if s.state == "decode"]
        if decoding:
            self._decode(decoding, info)
        leaders = [s for s in self.running if s.state == "prefill"]
        if leaders:
            self._prefill(leaders, info)
        self.steps += 1
        return info

    def abort(self, exc: BaseException) -> None:
        """Every waiting and running sequence fails with `exc` (a fault of the scheduler itself: the
        server stays up)."""
        while self.waiting:
            group = self.waiting.popleft()
            for s in group:
                self._leave(s, "error", exc)
        self._fail(list(self.running), exc)

    # --- the step's parts ---------------------------------------------------------------------------

    def _leave_cancelled(self) -> None:
        for group in list(self.waiting):
            if all(s.is_cancelled() for s in group):
                self.waiting.remove(group)
                for s in group:
                    self._leave(s, "cancelled")
        for s in list(self.running):
            if s.state == "decode" and s.is_cancelled():
                self._leave(s, "cancelled")
            elif s.state == "prefill" and all(m.is_cancelled() for m in s.group if m.state != "done"):
                # Before the first token the group's prefill serves all of it: it stops only when
                # every member has gone.
                for m in list(s.group):
                    if m.state != "done":
                        self._leave(m, "cancelled")

    def _admit(self, info: StepInfo) -> None:
        while self.waiting and self.pool.free() >= len(self.waiting[0]):
            group = self.waiting.popleft()
            now = time.perf_counter()
            leader = group[0]
            for s in group:
                s.slot = self.pool.take(leader.prompt_ids)
                s.admitted, s.state = now, "follow"
            leader.state = "prefill"
            self.running.extend(group)
            info.admitted.extend(group)
            prompt = leader.prompt_ids
            try:
                reused = self.engine.restore_prefix(prompt, leader.slot.kv, leader.slot.tokens)
            except Exception as exc:  # a KV file that fails to load, say: the group fails, not the server
                self._fail(group, exc)
                continue
            del leader.slot.tokens[reused:]  # positions from here are computed now
            leader._reused = reused
            leader._group = self.engine.prefill_group_tokens(leader.slot.kv, len(prompt) - reused)
            for s in group:
                s.decoding.gen.cached_tokens = reused

    def _prefill(self, leaders: list[BatchSequence], info: StepInfo) -> None:
        """The oldest prefilling prompt's next group, joined by the next groups of the prompts after it
        (in admission order) while the total stays within its group (the tokens the plan charged
        one pass for): the prompts of requests that arrived together go through in one pass, each
        expert read once for all of them (Engine.prefill_parts). Each prompt keeps the groups its own
        prefill_into would cut; a one-token prompt goes alone (prefill_into's decode forward).
        While another sequence is decoding, the pass holds at most stall_tokens: each prompt's piece
        is cut there (within the group the plan charged, on the group's sub-chunk boundaries), so
        the decoding streams wait one short pass, not a whole group, between two tokens."""
        limit = leaders[0]._group
        if self.stall_tokens and any(s.state == "decode" for s in self.running):
            limit = min(limit, self.stall_tokens)
        parts, used = [], 0
        for s in leaders:
            start = s._reused + s._done_tokens
            n = min(s._group, len(s.prompt_ids) - start, limit)
            one = len(s.prompt_ids) - s._reused == 1  # a one-token prompt: prefill_into's decode forward
            if parts and (one or parts[0][3] or used + n > limit):
                continue
            parts.append((s, s.prompt_ids[start:start + n], start, one))
            used += n
        try:
            if parts[0][3]:
                s, piece, start, _ = parts[0]
                logits = [self.engine.prefill_into(s.slot.kv, piece, start)]
            else:
                logits = self.engine.prefill_parts([(s.slot.kv, piece, start) for s, piece, start, _ in parts])
        except Exception as exc:  # a read error, say: every sequence of the joined groups fails
            for s, _, start, _ in parts:
                del s.slot.tokens[start:]
                self._fail(s.group, exc)
            return
        info.prefill_tokens += used
        for (leader, piece, start, _), last in zip(parts, logits):
            self._prefilled(leader, piece, start, last)

    def _prefilled(self, leader: BatchSequence, written: list[int], start: int, logits: torch.Tensor) -> None:
        """A leader's group is in its cache: its tokens recorded; after the last group each sequence
        of its group takes its first token."""
        slot, prompt = leader.slot, leader.prompt_ids
        if len(slot.tokens) == start:
            slot.tokens.extend(written)
        leader._done_tokens += len(written)
        if leader._reused + leader._done_tokens < len(prompt):
            return
        now = time.perf_counter()
        for s in leader.group:
            if s.state == "done":
                continue
            if s is not leader:  # the prompt's positions, copied: the same K/V as the leader's
                copy_positions(slot.kv, s.slot.kv, len(prompt))
                s.slot.tokens[:] = prompt
            s.decoding.gen.prefill_seconds = now - s.admitted
            if s.is_cancelled():
                self._leave(s, "cancelled")
                continue
            s.state = "decode"
            # Each its own copy: a processor may change the logits in place.
            self._take(s, logits[-1] if s is leader else logits[-1].clone(), first=True)

    def _decode(self, rows: list[BatchSequence], info: StepInfo) -> None:
        tokens = [s.decoding.token for s in rows]
        positions = [s.decoding.position for s in rows]
        for s, pos in zip(rows, positions):
            del s.slot.tokens[pos:]  # rewritten from here; known again once the step succeeds
        store = self.engine.experts
        fetched = store.fetched if store is not None else 0
        read = _bytes_read(self.engine.store)
        t0 = time.perf_counter()
        try:
            if len(rows) == 1:  # the solo decode (its native whole step, where there is one)
                logits = self.engine.prefill_into(rows[0].slot.kv, tokens, positions[0])
            else:
                logits = self.engine.decode_rows(tokens, positions, [s.slot.kv for s in rows])
        except Exception as exc:
            self._fail(rows, exc)
            return
        if len(rows) > 1 and store is not None and self.moe_layers:
            info.union_experts = (store.fetched - fetched) / self.moe_layers
        if read is not None:
            info.bytes_read = _bytes_read(self.engine.store) - read
        info.rows = len(rows)
        for s, tok, pos in zip(rows, tokens, positions):
            if len(s.slot.tokens) == pos:
                s.slot.tokens.append(tok)
        for b, s in enumerate(rows):
            self._take(s, logits[b])
        info.decode_seconds = time.perf_counter() - t0

    def _take(self, s: BatchSequence, logits: torch.Tensor, first: bool = False) -> None:
        """The sequence's next token from its logits [V], and whether it leaves."""
        try:
            token = s.decoding.step(logits)
            now = time.perf_counter()
            gen = s.decoding.gen
            if first:
                gen.ttft_seconds = now - s.admitted
                s.first_token_at = now
            else:  # what its client waits between tokens: the batch's step and any prefill group between
                gen.token_seconds.append(now - s.last_token_at)
            s.last_token_at = now
            finished = s.decoding.settle(token)
        except Exception as exc:  # its processor or its logits (one sequence's fault): it alone fails
            self._leave(s, "error", exc)
            return
        if finished:
            self._leave(s, "finished")

    def _fail(self, group: list[BatchSequence], exc: BaseException) -> None:
        for s in list(group):
            if s.state != "done":
                if s.slot is not None:
                    del s.slot.tokens[:]  # what the failed call left in the cache is unknown
                self._leave(s, "error", exc)

    def _leave(self, s: BatchSequence, outcome: str, error: BaseException | None = None) -> None:
        s.state, s.outcome, s.error = "done", outcome, error
        if s in self.running:
            self.running.remove(s)
        slot, s.slot = s.slot, None
        if slot is not None:
            if outcome != "error" and slot.tokens:
                try:  # the prompt and the answer so far: a next turn resends both
                    self.engine.remember_prefix(slot.kv, slot.tokens)
                except Exception:  # noqa: BLE001  a full disk for the KV tier must not fail the answer
                    pass
            self.pool.give(slot)
        if s.on_done is not None:
            s.on_done(s)


def copy_positions(src, dst, n: int) -> None:
    """Positions [0, n) of KV cache `src` into `dst` (the sequences of one prompt). A buffer of
    `size` positions along its position axis keeps position p in slot p % size (a sliding layer's
    ring; a full buffer has size ctx_size, so p itself), and only the last min(n, size) positions of
    either side are kept: a window's queries look no further back."""
    pairs = list(zip(_position_buffers(src), _position_buffers(dst), strict=True))
    for (s, axis), (d, _) in pairs:
        keep = min(n, s.shape[axis], d.shape[axis])
        pos = torch.arange(n - keep, n)
        d.index_copy_(axis, pos % d.shape[axis], s.index_select(axis, pos % s.shape[axis]))


def _position_buffers(kv) -> list[tuple[torch.Tensor, int]]:
    """(plain tensor, position axis) of every buffer of a cache, rings included."""
    if isinstance(kv, WindowedKVCache):
        out = []
        for t in [*kv.k, *kv.v]:
            out += [(t.codes, 1), (t.scales, 1)] if isinstance(t, QuantizedRows) else [(t, 1)]
        return out
    return [(t, axis) for _, t, axis in kv_snapshot.slots(kv)]


def _bytes_read(store) -> int | None:
    """The store's bytes read since its window began (a streaming store's), else None."""
    stats = getattr(store, "io_stats", None) if store is not None and store.streams else None
    return stats.snapshot()["bytes_read"] if stats is not None else None
