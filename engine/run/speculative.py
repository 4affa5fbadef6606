"""Speculative decoding: drafted tokens verified in one pass, lossless, gated by what they cost.

One step of generate's decode (engine/run/generate.py hands its loop here when EngineConfig.draft
is on), at position p with the last token t chosen but not yet fed to the model:

    draft     the drafter proposes up to k tokens d1..dk (engine/run/drafters.py); the gate picks k
    verify    Engine.verify([t, d1..dk], p): fp32 logits of k+1 rows, each what a decode step of
              that token alone gives, bit for bit (so greedy output cannot change)
    accept    row by row, each row's logits shaped exactly as plain decoding shapes them (the
              sampler's penalties and bias, then the processors such as a grammar's mask, with the
              state the tokens accepted before it left):
                greedy   row i's argmax; d(i+1) is accepted while it equals it, and the first
                         row that disagrees gives its own argmax (the correction)
                sampled  d accepted with probability min(1, p(d) / q(d)) (p: what Sampler.pick
                         would draw from, after temperature, min_p, top_p; q: the drafter's
                         distribution, one-hot for the deterministic drafters here), else a token
                         drawn from norm(max(p - q, 0)); after k accepted, one drawn from row k.
                         Leviathan et al. 2023 / Chen et al. 2023: the output distribution is p's.
              A drafted token the grammar disallows has p(d) = 0: rejected, as it must be.
    rollback  Engine.rollback(p + 1 + accepted): the rejected rows' K/V undone
              (engine/arch/kv_rollback.py), the engine's kv_tokens cut to what the cache holds

Each emitted token goes through generate's own bookkeeping (log-probs, processors' accept,
on_token, stop ids, max_new_tokens) in order, so a stop in the middle of a step ends the
generation exactly where plain decoding would. Per-token times: the first token of a step carries
the step's time, the rest the little time after it (what a client streaming the text sees).

Drafts as prefetch hints (when the store streams): before each step, the first MoE layers' experts
(those the model's own router lookahead, which reads a layer's residual, cannot hint before they
run) are hinted for the step's rows, drafts included, by each layer's router on the rows'
embeddings; on a gated-off step also for the lookup's guess at the next token, whose reads then
land in the cache while this step computes, where that kind of guess has been the next token at
least GUESS_HINT_ACCEPTANCE of the time over GUESS_HINT_EVIDENCE guesses or more (decayed counts).
Every gated-off step with a guess tells whether it was right, hinted or not (GuessRecord), so this is
the guesses' own accuracy, not the trials' acceptance: a wrong guess's reads are bytes the step did
not need (on code the gated-off lookup engine read 4% more bytes a token than plain decoding and ran
8% slower; judged by the trials' acceptance, three trials' 2 of 2 accepted had it hinting every step
of code under 368 MiB, 25% more bytes a token, and on free text under 362 MiB, with 8 tested drafts
behind it, 23% more at 0.88x).
The store's lookahead_recall counts these hints with the model's own.

The gate (when drafting pays, and how deep): engine/run/spec_gate.py.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from engine.arch.args import layer_prefix
from engine.arch.layers import rms_norm, route_layer
from engine.run.drafters import AutoDrafter, PromptLookup
from engine.run.mtp_drafter import MtpDrafter
from engine.run.sampling import Sampler, all_finite
from engine.run.spec_gate import Gate, drafter_of
from engine.run.spec_stats import SpecStats, independent_union

# A gated-off step hints the lookup's guess at the next token only where that kind of guess was the
# next token at least this often: a hint reads top_k experts per hinted layer, all of them waste when
# the guess is wrong, where a right one only reads them a step early (code's 4-gram guesses, right
# 81% of the time, read 10% more bytes a token under 362 MiB for no gain in recall; copy's are right
# 99% of the time) ...
GUESS_HINT_ACCEPTANCE = 0.9
GUESS_HINT_EVIDENCE = 8  # ... over at least this many guesses of that kind (decayed counts)
GUESS_DECAY = 1 - 1 / 32  # each guess's weight in the record falls by this per later guess of its kind
GUESS_SAMPLE = 32  # where no kind of guess is trusted, an idle step asks for one in this many (_asks_guess)


class GuessRecord:
    """How often a kind of lookup guess was the next token, recent guesses weighing most."""

    def __init__(self):
        self.right = self.seen = 0.0

    def observe(self, right: bool) -> None:
        self.right = self.right * GUESS_DECAY + right
        self.seen = self.seen * GUESS_DECAY + 1

    def trusted(self) -> bool:
        return self.seen >= GUESS_HINT_EVIDENCE and self.right >= GUESS_HINT_ACCEPTANCE * self.seen


class Steps(NamedTuple):
    """What generate hands the speculative loop: its sampler and its per-token bookkeeping."""

    sampler: Sampler
    shape: Callable[[torch.Tensor], torch.Tensor]  # raw logits [V] → the step's shaped logits [V]
    record: Callable[[int, torch.Tensor], None]  # token, its raw logits: log-probs, output, processors
    finished: Callable[[int], bool]  # on_token and processors' done(), after record
    max_new_tokens: int
    stop_ids: set[int] | None
    unshaped: bool = False  # no processor or penalty: `shape` only checks the logits are finite


# --- the engine's speculator --------------------------------------------------------------------

class Speculator:
    """Speculative decoding on one Engine: its drafter kind, gate and counters (one per engine:
    the gate's measurements are of this machine and model, and persist across generations)."""

    def __init__(self, engine):
        config = engine.config
        self.engine = engine
        self.policy, self.max_depth, self.drafter = config.draft, config.draft_depth, config.drafter
        a = engine.args
        store = engine.store
        if a.num_experts:
            prior = lambda n: independent_union(n, a.num_experts, a.top_k)  # noqa: E731
        else:  # a dense model's streamed layers: read once per step, however many rows
            prior = lambda n: 1.0  # noqa: E731
        # Rows computed as separate decode steps cost a plain step each; rows that share their
        # weight reads (forward_rows) are assumed half, until measured.
        row_cost = 0.5 if hasattr(engine.model, "forward_rows") else 1.0
        self.gate = Gate(self.policy, self.max_depth, prior, row_cost)
        self.stats = SpecStats()
        # lookup guesses on gated-off steps, by kind
        self._guesses: dict[str, GuessRecord] = collections.defaultdict(GuessRecord)
        self._idle_steps = 0  # idle steps taken (_plain): which of them sample a guess (_asks_guess)
        self._store = store if store is not None and store.streams else None
        # Drafts as prefetch hints (the module doc): the MoE layers nothing else hints before they run
        self.hints = self._store is not None and a.num_experts > 0 and hasattr(self._store, "hint_experts")
        self._hinted_layers = ([i for i in range(a.num_layers) if a.is_moe_layer(i)][:max(1, config.prefetch_depth)]
                               if self.hints else [])
        # Dynamic NTK RoPE rescales once a sequence passes the trained length, by the furthest
        # position seen: a verify row beyond it would change later tokens' keys, so no draft reaches it.
        self._last_position = (a.max_position_embeddings - 1 if (a.rope or {}).get("rope_type") == "dynamic"
                               else None)

    def reset_stats(self) -> None:
        self.stats = SpecStats()

    def drafter_for(self, seq: list[int]):
        """A drafter over one generation's growing sequence (prompt + accepted tokens)."""
        mtp = MtpDrafter(self.engine.mtp, seq) if getattr(self.engine, "mtp", None) is not None else None
        if self.drafter == "mtp":
            return mtp
        return AutoDrafter(PromptLookup(seq), mtp) if self.drafter == "auto" else PromptLookup(seq)

    def _io(self) -> tuple[int, float]:
        s = self._store
        return (s.io_stats.bytes_read, s.stall_seconds) if s is not None else (0, 0.0)

    def decode(self, steps: Steps, gen, token: int, pos: int) -> None:
        """generate's decode loop from `token` (chosen, not yet fed) at position `pos`, until a stop."""
        engine, stats, gate = self.engine, self.stats, self.gate
        seq = list(gen.prompt_ids) + list(gen.output_ids)
        drafter = self.drafter_for(seq)
        ctx = engine.kv.ctx_size
        ring = engine.max_verify_rows
        mtp = getattr(engine, "mtp", None)
        if mtp is not None:
            mtp.skip_pairs(0)  # (a run of plain steps a stop cut short is not this generation's)
        while True:
            left = steps.max_new_tokens - len(gen.output_ids)
            if left <= 0 or (steps.stop_ids and token in steps.stop_ids):
                return
            idle = gate.idle_steps()
            if mtp is not None:
                mtp.lend_if_idle(idle)  # its memory to the expert cache while the gate leaves it idle
            if idle:  # no draft can pay here now: plain steps, as generate's own loop takes them
                if mtp is not None:  # only the last window + 1 hand their pairs to the MTP layer's state
                    mtp.skip_pairs(min(idle, left) - mtp.window - 1)
                done, token, pos, taken = self._plain(steps, gen, token, pos, min(idle, left), seq, drafter)
                gate.skipped(taken)
                if done:
                    return
                continue
            t0 = time.perf_counter()
            io0 = self._io()
            # At most: the tokens still wanted less the one every step gives, the context, the ring.
            room = min(self.max_depth, left - 1, ctx - 1 - pos, (ring - 1) if ring else self.max_depth,
                       self._last_position - pos if self._last_position is not None else self.max_depth)
            available, source = drafter.offer(room) if room > 0 else (0, "")
            kind = drafter_of(source)  # lookup-3 → lookup: whose cost per drafted token
            k, why = gate.depth(available, source, kind)
            stats.decide(k, why)
            loads = mtp.load_seconds if mtp is not None else 0.0
            drafts = drafter.propose(k).tokens if k else []
            k = len(drafts)
            t_draft = time.perf_counter() - t0
            if mtp is not None and mtp.load_seconds != loads:  # the layer loaded again after a loan: a
                t_draft -= mtp.load_seconds - loads            # cost per loan, not per drafted token
                stats.mtp_loads += 1
            gate.observe_draft(kind, k, t_draft)
            guess = []
            if self.hints:
                # a verify's rows; on a gated-off step only the lookup's guess at the next token (an MTP
                # guess would cost a layer of compute: not for a hint), not the step's own token (_hint)
                guess = drafter.propose(1).tokens if not k and available and kind == "lookup" else []
                if k or (guess and self._guess_hinted(source)):
                    self._hint([token, *drafts] if k else guess)
            if k:
                logits = engine.verify([token, *drafts], pos)
            else:
                logits = engine.forward([token], pos)
            t_forward = time.perf_counter()
            emitted, accepted, tested, stop = accept_rows(steps, gen, logits, drafts, t0)
            if guess and emitted:
                self._guesses[source].observe(emitted[0] == guess[0])
            io1 = self._io()
            nbytes = max(io1[0] - io0[0], 0) if io1[0] >= io0[0] else io1[0]  # counters reset mid-step
            stall = max(io1[1] - io0[1], 0.0) if io1[1] >= io0[1] else io1[1]
            # The step's cost without the sampling of its rows: the forward's, as the gate models it.
            gate.observe(k + 1, t_forward - t0 - t_draft, stall, nbytes)
            if why != "explored":  # (a trial's depth is not the gate's choice: its time is not drafting's)
                gate.observe_rate(k > 0, time.perf_counter() - t0, len(emitted))
            if k:
                gate.observe_accept(source, accepted, tested)
                engine.rollback(pos + 1 + accepted)
                stats.verify_steps += 1
                stats.drafted += k
                stats.accepted += accepted
            stats.steps += 1
            stats.rows += k + 1 if k else 0
            stats.emitted += len(emitted)
            stats.bytes_read += nbytes
            seq.extend(emitted)
            drafter.accepted()
            if stop:
                return
            pos += 1 + accepted
            token = emitted[-1]

    def _asks_guess(self) -> bool:
        """Whether an idle step asks prompt lookup for its guess at the next token (hinted where its kind
        is trusted): every step while some kind of guess is trusted or none has GUESS_HINT_EVIDENCE
        guesses yet; else one in GUESS_SAMPLE, which keeps the records current (the text may turn to a
        copy; the gate's trials notice that too, and draft). Why not every step: a lookup over a code
        sequence of 1k tokens took 8-19 us alone but ~0.1 ms between two forwards (whose weights leave
        the CPU's caches cold); idle under 400 MiB on code, where no guess was trusted, the lookup's gate
        ran 0.94x of no drafting asking every step, 0.12 ms a token more outside the forward than `off`,
        and 0.96x asking one step in 8, 0.99x in 32 (benchmarks/time/draft_decode.py, in one run)."""
        records = self._guesses.values()
        if any(r.trusted() for r in records) or max((r.seen for r in records), default=0.0) < GUESS_HINT_EVIDENCE:
            return True
        return self._idle_steps % GUESS_SAMPLE == 0

    def _guess_hinted(self, source: str) -> bool:
        """Whether a gated-off step hints the lookup's guess of this kind (the module doc)."""
        record = self._guesses.get(source)  # (not [source]: asking adds no record)
        return record is not None and record.trusted()

    def _hint(self, tokens: list[int]) -> None:
        """Before a step: the first MoE layers' experts (the ones the model's own router lookahead, which
        starts from a layer's residual, cannot hint in time) for these tokens, predicted by each layer's
        own norm and router on the tokens' embeddings (the residual entering the first layers is mostly
        the embedding), as one ascending union per layer: the rows of a verify, and on a gated-off step
        the draft of the next token, whose reads land in the cache while this step computes. Not a
        plain step's own token: the model's own lookahead hints its layers from the residual, which
        predicts better than the embedding; hinted from the embedding too, a code workload under 368 MiB
        read 8% more bytes a token with no gain in recall (0.78 either way)."""
        a, w = self.engine.args, self.engine.model.w
        x = F.embedding(torch.as_tensor(tokens, dtype=torch.long), w["model.embed_tokens.weight"])  # [n, H]
        for layer in self._hinted_layers:
            norm = w[f"{layer_prefix(layer)}.post_attention_layernorm.weight"]
            ids, _ = route_layer(a, w, layer, rms_norm(x, norm, a.rms_norm_eps), self.engine.model.routing_trim)
            self._store.hint_experts(layer, sorted(e for e in set(ids.flatten().tolist()) if e >= 0))

    def _plain(self, steps: Steps, gen, token: int, pos: int, count: int, seq: list[int], drafter=None):
        """Up to `count` plain decode steps (the gate counts them gated off)
        → (stopped, token, pos, steps taken). The drafter is not asked, except where the store
        streams: prompt lookup's guess at the next token is still a prefetch hint (a scan of the
        sequence against a step that waits on reads; the MTP layer is never run for a hint). The
        counters and the gate's plain time per token are told once for the run of steps: a plain step
        of a small resident model is half a millisecond, and this loop must cost what generate's does."""
        engine, sampler = self.engine, steps.sampler
        lookup = (drafter if isinstance(drafter, PromptLookup) else getattr(drafter, "lookup", None)) \
            if self.hints else None
        taken, seconds, stopped = 0, 0.0, False
        while taken < count:
            if steps.stop_ids and token in steps.stop_ids:
                stopped = True
                break
            t = time.perf_counter()
            guess = []
            self._idle_steps += 1
            if lookup is not None and self._asks_guess():
                found, source = lookup.offer(1)
                guess = lookup.propose(1).tokens if found else []
                if guess and self._guess_hinted(source):
                    self._hint(guess)
            logits = engine.forward([token], pos)
            raw = logits[-1]
            token = sampler.pick(steps.shape(raw))
            if guess:
                self._guesses[source].observe(token == guess[0])
            steps.record(token, raw)
            took = time.perf_counter() - t
            gen.token_seconds.append(took)
            seconds += took
            taken += 1
            pos += 1
            seq.append(token)
            if steps.finished(token) or len(gen.output_ids) >= steps.max_new_tokens:
                stopped = True
                break
        stats = self.stats
        stats.steps += taken
        stats.emitted += taken
        stats.decide(0, "gated off", taken)
        self.gate.observe_rate(False, seconds, taken)
        return stopped, token, pos, taken


# --- accepting a verify's rows (the Speculator's step; benchmarks/time/accept_loop.py times it alone) ---

def accept_rows(steps: Steps, gen, logits: torch.Tensor, drafts: list[int], t0: float):
    """A verify's rows [n, V] against its drafts, row by row (module doc): emit tokens through
    generate's bookkeeping until a draft is rejected, the drafts run out (then one more from the last
    row), or the generation stops.
    → (emitted tokens, drafts accepted, drafts tested, stopped)."""
    sampler = steps.sampler
    emitted: list[int] = []
    accepted = tested = 0
    last = t0
    # Greedy with nothing shaping the logits: every row's argmax in one call, and one finiteness check
    # for all rows (a row's argmax is the one-row call's: the first of equal maxima either way). Where
    # the check fails, row by row as below, so the error names the row plain decoding would reach.
    picks = (logits.argmax(dim=-1).tolist() if steps.unshaped and sampler.temperature == 0 and all_finite(logits)
             else None)
    for i in range(len(drafts) + 1):
        raw = logits[i]
        shaped = raw if picks is not None else steps.shape(raw)
        draft = drafts[i] if i < len(drafts) else None
        if draft is not None:
            tested += 1
        if picks is not None:
            token = picks[i]
        elif sampler.temperature == 0:
            token = int(torch.argmax(shaped))
        else:
            p = sampler.probs(shaped)
            p = p / p.sum()  # top_p leaves the kept mass unnormalised
            if draft is not None and sampler.uniform() < float(p[draft]):  # min(1, p(d)/q(d)), q one-hot
                token = draft
            elif draft is not None:
                residual = p.clone()
                residual[draft] = 0.0  # max(p - q, 0) for a one-hot q
                token = sampler.draw(residual) if float(residual.sum()) > 0 else draft
            else:
                token = sampler.draw(p)
        steps.record(token, raw)
        now = time.perf_counter()
        gen.token_seconds.append(now - last)
        last = now
        emitted.append(token)
        hit = draft is not None and token == draft
        accepted += hit
        if (steps.finished(token) or len(gen.output_ids) >= steps.max_new_tokens
                or (steps.stop_ids and token in steps.stop_ids)):
            return emitted, accepted, tested, True
        if not hit:
            break
    return emitted, accepted, tested, False
