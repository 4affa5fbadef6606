"""Drafting with the checkpoint's own multi-token-prediction layer (engine/arch/mtp.py).

Which layer: the first MTP module after the last layer (model.layers.{L}, L = num_hidden_layers) of
a deepseek_v3, glm4_moe or glm_moe_dsa checkpoint whose files hold it whole, when EngineConfig.draft
is on and drafter is mtp (refused without one) or auto. Its resident tensors are charged to the
memory plan (`planned_bytes`); its routed experts are the expert layout's layer L, so they are
resident or streamed with the rest (Engine builds the layout over the model and this layer).

The MTP layer's row j reads (t[j+1], h[j]): the token after position j and the main model's final
hidden state at j. `MtpState` keeps the engine's side of that pairing, as the engine keeps kv_tokens:

    observe(tokens, start, hidden)   tokens fed at positions start.., and their rows' hidden states
                                     (a prefill group, a plain step, a verify's accepted rows):
                                     each completes the pair of the position before it; the last
                                     hidden waits for the next token. Only the last `window` pairs
                                     are kept (WINDOW, or fewer: plan_drafting): nothing is
                                     computed here
    draft(k, token)                  the pair of the current position (the token about to be fed and
                                     the hidden before it) and the queued pairs go through the layer
                                     in one call (its KV written at their positions), its last row's
                                     argmax is draft 1; drafts 2..k chain the layer on its own output
                                     (vLLM's multi-step MTP), at the following positions, which the
                                     true pairs overwrite later

While the gate keeps drafting off, the layer is never run: a decode step only appends its pair to
the window (the main model's hidden state comes with its fast decode path, Transformer.forward's
`hidden`), and in a run of plain steps the gate takes without asking, only the last `window` + 1 do
that (`skip_pairs`): the others are the engine's plain decode steps. A draft after pairs were
dropped computes the window and attends from its first position on (MtpLayer.forward's `base`: the
window's first position is the cache's slot 0): the positions below it hold no true rows of this
sequence. Such drafts are a little worse than drafts over the whole sequence, never wrong output
(verification keeps it lossless); while the gate drafts every step, no pair is dropped and the layer
sees everything since the prompt's last `window` positions.

Lent while idle: where the experts stream, the layer's weights and KV cache are memory the expert
cache could use while the gate keeps drafting off (on the reference under 368 MiB they took the cache
from 11.4 to 8.7 MiB, and a copy read 3.8x the bytes a token with the MTP drafter gated off all
along). After LEND_AFTER decode steps without running the layer, or where the gate is about to take
that many plain steps, the layer is dropped and the store's RAM cache borrows its bytes
(StreamingExperts.borrow); the next draft repays them (the least wanted experts evicted) and loads
the layer again from the files, its cache empty: the draft then computes the window from slot 0, as
after any gap. The pairs stay queued meanwhile (a few hidden states: all an idle MTP engine holds beyond
the engine without it, so where a whole window's would cost the lent cache an entry, the plan keeps
fewer pairs: plan_drafting). A loan that ends within twice
the wait before it doubles that wait (up to LEND_AFTER_MAX steps), so drafts that come every few dozen
steps do not pay a load each; a long loan sets it back to LEND_AFTER. The loan is open from the start
(`open_state`): the layer is first loaded by the first draft, so an engine whose gate never drafts has
the cache and the arena of the engine without the drafter (the same huge pages: engine/movement/slots.py).
"""

from __future__ import annotations

import collections
import time
from typing import Callable, NamedTuple

import torch

from engine.arch.mtp import (EXTRAS, MTP_ARCHITECTURES, OWN_HEAD, MtpLayer, decoder_names, extra_names,
                             with_mtp_layers)
from engine.base import heap
from engine.base.config import EngineConfig
from engine.base.errors import ConfigError, DraftBudgetError
from engine.format.checkpoint import same_bytes
from engine.movement.cache_loan import loan_entries
from engine.movement.plan import MemoryPlan
from engine.run.drafters import Draft

# The recent pairs kept for a draft: beyond this the oldest are dropped, never computed. While the gate
# keeps drafting off, the layer costs nothing per position; a draft after that computes these pairs
# (one call of WINDOW rows: about a decode step of the 4-layer reference) and attends over them only.
WINDOW = 16
# ... or fewer, down to MIN_WINDOW, where WINDOW would cost the lent expert cache an entry (plan_drafting)
MIN_WINDOW = 1
# Decode steps without running the layer before its memory goes to the expert cache (the module doc):
# a gate's trials come every 16, 32, 64... gated-off steps, and a loan costs a load of the layer and
# the experts its bytes held when it ends
LEND_AFTER = 32
# ... doubled (up to LEND_AFTER_MAX) each time a loan ends soon after it began (its load and the experts
# it evicts paid for little time of a bigger cache: drafts that come every few dozen steps, as an auto
# drafter's MTP offers between a copy's runs do), back to LEND_AFTER after a long loan
LEND_AFTER_MAX = 1024
SHORT_LOAN = 2  # a loan shorter than this many times the wait before it is short


def mtp_layer(ckpt, args, config: EngineConfig) -> int | None:
    """The MTP layer the drafter reads (L), or None: not asked, not an MTP architecture, or the files
    do not hold the layer whole (drafter = mtp then refuses, auto drafts with lookup alone)."""
    if config.draft == "off" or config.drafter == "lookup":
        return None
    L = args.num_layers
    needed = [name for name, _ in decoder_names(args, L).values()]
    needed += [n for n in extra_names(args, L) if not n.endswith(OWN_HEAD)]
    if args.model_type in MTP_ARCHITECTURES and all(n in ckpt for n in needed):
        return L
    if config.drafter == "mtp":
        why = (f"{args.model_type} has no MTP layers" if args.model_type not in MTP_ARCHITECTURES else
               f"the files hold no whole MTP layer model.layers.{L} (num_nextn_predict_layers "
               f"{ckpt.config.get('num_nextn_predict_layers') or 0}; converted containers drop them)")
        raise ConfigError(f"drafter mtp: {why}; use drafter lookup or auto")
    return None


def tensor_names(ckpt, args, layer: int) -> dict[str, str]:
    """The MTP layer's resident tensors to load: the name it is used under → its checkpoint name."""
    names = {short: full for short, (full, _) in decoder_names(args, layer).items()}
    p = f"model.layers.{layer}."
    names.update({short: p + short for short in EXTRAS})
    if own_head(ckpt, args, layer):
        names["head"] = p + OWN_HEAD
    return names


def own_head(ckpt, args, layer: int) -> bool:
    """Whether the MTP layer has a head of its own to load: the file holds one, and not the model's
    lm_head byte for byte (DeepSeek-V3's and GLM's MTP modules share the model's output head, and their
    files carry a copy of it: loading it again would take a vocabulary-sized tensor from the budget)."""
    name = f"model.layers.{layer}.{OWN_HEAD}"
    if name not in ckpt:
        return False
    model_head = "model.embed_tokens.weight" if args.tie_word_embeddings else "lm_head.weight"
    return model_head not in ckpt or not same_bytes(ckpt.info(name), ckpt.info(model_head))


def planned_bytes(ckpt, args, layer: int | None, dtype: torch.dtype, kv_dtype, ctx_size: int,
                  window: int = WINDOW) -> int:
    """What the MTP drafter holds: its resident tensors in the compute dtype, its KV cache, and a
    queue of `window` pairs' hidden states (the plan's mtp_bytes; 0 without one)."""
    if layer is None:
        return 0
    return lendable_bytes(ckpt, args, layer, dtype, kv_dtype, ctx_size) + _queue_bytes(args, window)


def _queue_bytes(args, window: int = WINDOW) -> int:
    """The queued hidden states (window + 1 fp32 rows): kept through a loan, the next draft reads them."""
    return (window + 1) * args.hidden_size * 4


def loan_bytes(ckpt, args, layer: int | None, dtype: torch.dtype, kv_dtype, config: EngineConfig, plan,
               window: int = WINDOW) -> int:
    """What the expert cache borrows while the layer is idle: lendable_bytes, and drafting with the MTP layer
    alone (drafter mtp) everything else the plan charged drafting but the queue. No verify runs while the
    layer is lent (a draft loads it, and repays the loan, first), so a verify's rows beyond the prompt
    group's bytes are lent too, and the lent cache holds what a plan without drafting gives."""
    if layer is not None and config.drafter == "mtp":
        return plan.draft_bytes - _queue_bytes(args, window)
    return lendable_bytes(ckpt, args, layer, dtype, kv_dtype, config.ctx_size)


def lendable_bytes(ckpt, args, layer: int | None, dtype: torch.dtype, kv_dtype, ctx_size: int) -> int:
    """What of planned_bytes the expert cache may borrow while the layer is idle (the module doc): its
    resident tensors and its KV cache (the queued pairs stay)."""
    if layer is None:
        return 0
    elem = torch.finfo(dtype).bits // 8
    count = 0
    for full in tensor_names(ckpt, args, layer).values():
        n = 1
        for d in ckpt.info(full).shape:
            n *= d
        count += n
    return count * elem + MtpLayer.cache_bytes(args, ctx_size, kv_dtype)


class DraftingPlan(NamedTuple):
    plan: MemoryPlan
    layer: int | None  # the MTP layer drafting, or None
    window: int  # the pairs its state keeps (MtpState's window)


def plan_drafting(ckpt, args, config: EngineConfig, dtype: torch.dtype, kv_dtype, make) -> DraftingPlan:
    """The memory plan, the MTP layer it drafts with or None, and the pairs that layer's state keeps, for
    Engine and for a planner outside it (the tuner's memory plan, tuner/costmodel/memplan.py):
    make(layout_args, mtp_bytes) is the caller's make_plan over an expert layout of those args. With the
    MTP layer drafting, the layout takes its experts as layer L and the plan its bytes; where they do not
    fit beside the prompt group (DraftBudgetError), drafter auto plans without it (prompt lookup alone),
    drafter mtp refuses. Raises ConfigError for drafter mtp over files without the layer."""
    layer = mtp_layer(ckpt, args, config)
    if layer is not None:
        try:
            return _fitted_window(ckpt, args, config, dtype, kv_dtype, make, layer)
        except DraftBudgetError:
            if config.drafter != "auto":
                raise
    return DraftingPlan(make(args, 0), None, WINDOW)


def _fitted_window(ckpt, args, config: EngineConfig, dtype: torch.dtype, kv_dtype, make, layer: int) -> DraftingPlan:
    """The plan with the MTP layer and a window of WINDOW pairs, or of the most pairs that leave the
    streamed cache (its kept and lent entries) as many entries as a window of MIN_WINDOW would. The queue
    stays through a loan, so its bytes are all that keep an idle MTP engine's cache below the engine's
    without a drafter; a few KiB of hidden states crossing a whole entry cost a copy workload whose working
    set is the cache's size a read on nearly every step (on the reference, 1 budget in 20)."""
    mtp_args = with_mtp_layers(args, 1)

    def planned(window: int) -> tuple[MemoryPlan, int]:
        plan = make(mtp_args, planned_bytes(ckpt, args, layer, dtype, kv_dtype, config.ctx_size, window))
        lent = loan_entries(plan, config, loan_bytes(ckpt, args, layer, dtype, kv_dtype, config, plan, window))
        return plan, plan.cache_slots + lent

    window = WINDOW
    plan, entries = planned(window)
    if plan.streaming:
        most = planned(MIN_WINDOW)[1]
        # (at MIN_WINDOW they are equal, unless the process grew between plans that measure its resident set)
        while entries < most and window > MIN_WINDOW:
            window -= 1
            plan, entries = planned(window)
    return DraftingPlan(plan, layer, window)


def load(engine, layer: int) -> MtpLayer:
    """The MTP layer over the engine's embedding, lm_head (where it has no head of its own) and store."""
    names = tensor_names(engine.checkpoint, engine.args, layer)
    loaded = engine.load_dense_tensors(list(names.values()))
    short = {s: loaded[full] for s, full in names.items()}
    for s, (full, shape) in decoder_names(engine.args, layer).items():
        got = tuple(engine.checkpoint.info(full).shape)
        if got != shape and full not in engine.quantized_names:
            raise ConfigError(f"MTP layer tensor {full!r} has shape {list(got)}, config.json implies {list(shape)}")
    head = short.pop("head", None)
    extras = {s: short.pop(s) for s in EXTRAS}
    extras["head"] = head if head is not None else engine.model.lm_head
    kv = MtpLayer.cache(engine.args, engine.config.ctx_size, engine.kv_dtype, engine.dtype)
    return MtpLayer(engine.args, layer, short, extras, engine.model.w["model.embed_tokens.weight"], engine.experts,
                    engine.dtype, kv)


def open_state(load: Callable[[], MtpLayer], store, window: int = WINDOW) -> MtpState:
    """The drafter's state over the layer `load` gives, keeping `window` pairs (plan_drafting's): lent
    from the start where the store's cache borrowed its bytes when it was built
    (engine/movement/cache_loan.py; the layer is loaded at the first draft), else loaded now."""
    lent = getattr(store, "borrowed", 0) > 0
    return MtpState(None if lent else load(), load, store, window)


class MtpState:
    """The (token after, hidden at) pairs of the recent positions the main model computed, waiting for
    the MTP layer, and the hidden state still waiting for its token (the module doc)."""

    def __init__(self, layer: MtpLayer, load: Callable[[], MtpLayer] | None = None, store=None,
                 window: int = WINDOW):
        self.layer: MtpLayer | None = layer  # None while lent to the expert cache (the module doc), as from the start
        self.window = window  # the recent pairs kept (WINDOW, or fewer where the plan fitted it: plan_drafting)
        self._load = load  # the layer again, from the files
        # The store whose cache borrows the layer's bytes while it is idle; None: never lent
        self._store = store if load is not None and getattr(store, "borrowable", 0) else None
        self.calls = 0  # MTP layer forwards (a test counts them: none while nothing drafts)
        self.idle = 0  # decode steps since the layer last ran
        self.lend_after = LEND_AFTER  # idle steps before a loan (doubled after short loans)
        self._lent_at = 0  # `idle` when the layer was lent
        self.loads = 0  # times the layer was loaded again after a loan ...
        self.load_seconds = 0.0  # ... and the seconds those loads took (repaying the cache's loan included)
        self.reset(0)

    def lend_if_idle(self, ahead: int = 0) -> bool:
        """Drop the layer and let the expert cache borrow its bytes where it has not run for LEND_AFTER
        decode steps, or the gate takes at least that many plain steps now (`ahead`) → whether it did."""
        if self._store is None or self.layer is None or max(self.idle, ahead) < self.lend_after:
            return False
        self.layer = None
        self._lent_at = self.idle
        heap.release_freed()  # its tensors' pages back to the OS before the cache grows into them
        self._store.borrow()
        return True

    def _ensure_loaded(self) -> MtpLayer:
        """The layer, loaded again where it was lent: the cache's loan repaid first (the module doc)."""
        if self.layer is None:
            t0 = time.perf_counter()
            loan = self.idle - self._lent_at  # steps the cache held the layer's bytes
            self.lend_after = (min(2 * self.lend_after, LEND_AFTER_MAX) if loan < SHORT_LOAN * self.lend_after
                               else LEND_AFTER)
            self._store.repay()
            self.layer = self._load()
            self.computed = 0  # its cache is empty: the next call computes the queued window from slot 0
            self.loads += 1
            self.load_seconds += time.perf_counter() - t0
        return self.layer

    def reset(self, start: int) -> None:
        """A new sequence from position `start` (before it: restored or none): nothing pending."""
        self.tokens: collections.deque[int] = collections.deque()  # queued pairs' tokens (t[j+1]) ...
        self.hidden: collections.deque[torch.Tensor] = collections.deque()  # ... and hidden states (h[j]) [1, H]
        self.first = start  # the position of the first queued pair
        self.waiting: tuple[int, torch.Tensor] | None = None  # (j, h[j]) without its t[j+1] yet
        self._unobserved = 0  # plain steps ahead whose pairs no draft will read (skip_pairs)
        self.computed = start  # pairs before this position went through the layer with true inputs ...
        self.since = start  # ... from this one on, in the layer's cache from slot 0 (MtpLayer.forward's base)

    def skip_pairs(self, steps: int) -> None:
        """The next `steps` decode steps are plain ones that no draft follows before `window` + 1 more
        (the gate's idle run is longer than the window: their pairs would be dropped unread), so they
        hand over no hidden state: the Engine takes the plain decode route for them."""
        self._unobserved = max(steps, 0)

    def takes_pair(self) -> bool:
        """Whether this decode step hands over its pair (else it counts as an idle step, and the pairs
        start afresh after it, as after any gap)."""
        if self._unobserved <= 0:
            return True
        self._unobserved -= 1
        self.idle += 1
        self.waiting = None
        return False

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        """tokens fed at positions start.. and their rows' final hidden states [n, H]."""
        self.idle += 1
        w = self.waiting
        if w is not None and len(tokens) == 1 and w[0] == start - 1:  # a plain step: its pair, no more
            self._queue(w[0], tokens[0], w[1])
            self.waiting = (start, hidden)
            return
        if self.waiting is not None and start <= self.waiting[0]:
            self.reset(start)  # back to an earlier position: another sequence
        if self.waiting is not None and self.waiting[0] == start - 1:
            self._queue(start - 1, tokens[0], self.waiting[1])
        n = len(tokens)
        # Only the last `window` pairs can be computed: a prompt's earlier rows are not kept (nor their
        # [n, H] tensor alive through views of it)
        skip = max(1, n - self.window)
        if n > self.window + 1:
            hidden = hidden[skip - 1:].clone()  # rows skip-1.. as rows 0..
            offset = skip - 1
        else:
            offset = 0
        for i in range(skip, n):
            self._queue(start + i - 1, tokens[i], hidden[i - 1 - offset:i - offset])
        self.waiting = (start + n - 1, hidden[-1:])

    def _queue(self, pos: int, token: int, h: torch.Tensor) -> None:
        if pos < self.computed:
            return  # a draft already computed this pair
        if self.tokens and pos != self.first + len(self.tokens):
            self.tokens.clear()  # not the next position: what is queued is dropped (a window, not a log)
            self.hidden.clear()
        if not self.tokens:
            self.first = pos
        self.tokens.append(token)
        self.hidden.append(h)
        if len(self.tokens) > self.window:  # the oldest pair is never computed: drafts read the recent window
            self.tokens.popleft()
            self.hidden.popleft()
            self.first += 1

    def _flush(self):
        """The queued pairs through the layer in one call → (the last row's logits [1, V], out [n, H]),
        or None. After pairs were dropped, the layer attends from the window's first position."""
        if not self.tokens:
            return None
        layer = self._ensure_loaded()
        if self.first > self.computed:  # a gap: the cache between holds no true rows
            self.since = self.first
        self.calls += 1
        self.idle = 0
        out = layer.forward(torch.as_tensor(list(self.tokens), dtype=torch.long), torch.cat(list(self.hidden)),
                                 self.first, base=self.since, last_only=True)
        self.computed = self.first + len(self.tokens)
        self.tokens.clear()
        self.hidden.clear()
        return out

    def draft(self, k: int, token: int) -> list[int]:
        """Up to k tokens to follow `token`, the token about to be fed at the waiting hidden's
        position + 1 (none without that hidden: nothing computed the position before)."""
        if k <= 0 or self.waiting is None:
            return []
        pos, h = self.waiting
        self.computed = min(self.computed, pos)  # this pair's row is needed: computed (again) now
        self._queue(pos, token, h)
        logits, out = self._flush()
        drafts = [int(torch.argmax(logits[-1]))]
        at, g = pos + 1, out[-1:]
        while len(drafts) < k and at < self.layer.kv.ctx_size:
            self.calls += 1
            logits, g = self.layer.forward(torch.as_tensor(drafts[-1:], dtype=torch.long), g, at, base=self.since)
            drafts.append(int(torch.argmax(logits[-1])))
            at += 1
        return drafts


class MtpDrafter:
    """The MTP drafter over one generation: offers as many tokens as asked, computes them on demand."""

    name = "mtp"

    def __init__(self, state: MtpState, seq: list[int]):
        self.state, self.seq = state, seq

    def offer(self, k: int) -> tuple[int, str]:
        return (k if self.state.waiting is not None else 0), "mtp"

    def propose(self, k: int) -> Draft:
        return Draft(self.state.draft(k, self.seq[-1]), "mtp")

    def accepted(self) -> None:
        """The engine's MtpState saw the accepted rows (Engine.rollback / forward)."""
