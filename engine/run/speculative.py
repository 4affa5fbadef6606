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
land in the cache while this step computes. The store's lookahead_recall counts these hints with
the model's own.

The gate (policy "gate"): per step, the depth k in 0..draft_depth (no more than the drafter gave)
that maximises expected tokens per second,

    E(k) = 1 + a + a^2 + ... + a^k         (a: the measured acceptance of this kind of draft)
    C(n) = compute(1) * (1 + rho * (n - 1)) + stall(1) * union(n) + k * draft_s
    k*   = argmax E(k) / C(k + 1)          (k = 0: a plain step, E = 1, C(1))

where compute(1) and stall(1) are a plain step's measured compute and I/O wait, rho the measured
extra compute of a verify row (per-row decode steps: about 1; rows sharing their weight reads:
less), and union(n) the expert bytes n rows read relative to one: the union of their experts that
the caches do not hold, predicted from the routing (n tokens' top-k over E experts, independent)
and corrected online by the bytes the store really read in verify steps. Where drafting loses
(the verify's extra bytes and rows cost more than the accepted tokens save), k* = 0 and the step
is a plain one; after 16, 32, 64... such steps (and at least enough that the trial costs 5% of
their time) it verifies the drafter's whole offer once, to notice a change.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from engine.arch.args import layer_prefix
from engine.arch.layers import rms_norm, route_layer
from engine.run.drafters import AutoDrafter, PromptLookup
from engine.run.mtp_drafter import MtpDrafter
from engine.run.sampling import Sampler

EXPLORE_FIRST = 16  # gated-off steps before the first trial of a draft (then 32, 64, ...)
EXPLORE_SHARE = 0.05  # at most this share of the gated-off steps' time goes to trials
EMA = 0.2  # weight of a new measurement in the gate's running estimates
ACCEPT_DECAY = 0.98  # acceptance counts fade, so a change of text (copying, then not) shows
ACCEPT_PRIOR = (1.0, 1.0)  # Beta(1, 1): an unseen kind of draft is accepted half the time
REDECIDE = 16  # steps a gate decision is reused before the estimates are read again


class Steps(NamedTuple):
    """What generate hands the speculative loop: its sampler and its per-token bookkeeping."""

    sampler: Sampler
    shape: Callable[[torch.Tensor], torch.Tensor]  # raw logits [V] → the step's shaped logits [V]
    record: Callable[[int, torch.Tensor], None]  # token, its raw logits: log-probs, output, processors
    finished: Callable[[int], bool]  # on_token and processors' done(), after record
    max_new_tokens: int
    stop_ids: set[int] | None


# --- the measurements ---------------------------------------------------------------------------

@dataclass
class SpecStats:
    """Counters since reset (what run/bench/serve report)."""

    steps: int = 0  # decode steps (plain and verify) after the first token
    verify_steps: int = 0
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens the steps produced (accepted drafts + one per step, less any cut by a stop)
    rows: int = 0  # verify rows computed (drafted + 1 per verify step)
    bytes_read: int = 0  # expert / layer bytes the store read during the steps
    decisions: dict = field(default_factory=dict)  # why a step had the depth it had → count
    depths: dict = field(default_factory=dict)  # depth → steps

    def decide(self, depth: int, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        self.depths[depth] = self.depths.get(depth, 0) + 1

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "verify_steps": self.verify_steps, "drafted": self.drafted,
            "accepted": self.accepted, "emitted": self.emitted, "rows": self.rows,
            "acceptance": self.accepted / self.drafted if self.drafted else None,
            "tokens_per_step": self.emitted / self.steps if self.steps else None,
            "bytes_per_token": self.bytes_read / self.emitted if self.emitted else None,
            "decisions": dict(sorted(self.decisions.items())),
            "depths": {str(k): v for k, v in sorted(self.depths.items())},
        }


def draft_figures(stats: dict) -> dict:
    """The run JSON's flat figures of a SpecStats dict (engine/api/results.py prints them)."""
    if not stats:
        return {}
    return {"tokens_per_step": stats["tokens_per_step"], "draft_acceptance": stats["acceptance"],
            "drafted_tokens": stats["drafted"], "draft_bytes_per_token": stats["bytes_per_token"]}


class _Running:
    """An exponential moving average (None until the first value). The first value only stands in
    until the second replaces it: a first call of a kind (a verify of a new row count) pays
    one-time costs (kernel set-up, allocations) that are not its cost."""

    __slots__ = ("value", "count")

    def __init__(self, value: float | None = None):
        self.value = value
        self.count = 0 if value is None else 2

    def add(self, x: float) -> None:
        self.count += 1
        self.value = x if self.count <= 2 else (1 - EMA) * self.value + EMA * x


def expected_tokens(depth: int, acceptance: float) -> float:
    """Tokens a step of `depth` drafts produces on average when each draft is accepted with
    probability `acceptance` given the ones before it were: 1 + a + ... + a^depth."""
    a = min(max(acceptance, 0.0), 1.0)
    return float(depth + 1) if a >= 1.0 else (1.0 - a ** (depth + 1)) / (1.0 - a)


def independent_union(rows: int, experts: int, top_k: int) -> float:
    """Expected distinct experts `rows` tokens route to in one layer, in units of one token's
    top_k, when each token's choice is independent and uniform: E (1 - (1 - K/E)^n) / K."""
    if experts <= 0 or top_k <= 0:
        return 1.0
    share = min(top_k / experts, 1.0)
    return (1.0 - (1.0 - share) ** rows) / share


def draft_speedup(depth: int, acceptance: float, compute_s: float, stall_s: float, union: float,
                  row_cost: float = 1.0, draft_s: float = 0.0) -> float:
    """Tokens per second of steps drafting `depth` tokens over plain steps: E(depth) / C(depth + 1)
    times C(1) (the module doc's model; the cost model's `plan` predicts with it too). union: the
    expert bytes the depth + 1 rows read relative to one row's."""
    plain = compute_s + stall_s
    if plain <= 0:
        return 1.0
    cost = compute_s * (1.0 + row_cost * depth) + stall_s * union + depth * draft_s
    return expected_tokens(depth, acceptance) * plain / cost


class Gate:
    """The per-step depth (the module doc's model) and the measurements behind it."""

    def __init__(self, policy: str, max_depth: int, union_prior: Callable[[int], float], row_cost: float):
        self.policy, self.max_depth = policy, max_depth
        self.union_prior = union_prior
        self.compute = _Running()  # a plain step's seconds not waiting on reads
        self.stall = _Running()  # a plain step's seconds waiting on reads
        self.bytes = _Running()  # a plain step's bytes read
        self.row_cost = row_cost  # prior: a verify row's extra compute, relative to a plain step
        self.verify_compute: dict[int, _Running] = {}  # rows → a verify's measured compute seconds
        self.union_power = _Running(1.0)  # bytes(n) = bytes(1) * union_prior(n) ** power
        self.draft_s: dict[str, _Running] = {}  # seconds to draft one token, per drafter
        self.accept: dict[str, list[float]] = {}  # source → [accepted, rejected] (decayed)
        self._skipped = 0
        self._explore_at = EXPLORE_FIRST
        # (available, source, drafter) → depth: the estimates move slowly, so a decision is reused for
        # REDECIDE steps; a plain step costs well under a millisecond on a small resident model, and
        # the gate must not take a noticeable share of it
        self._decided: dict = {}
        self._hopeless: bool | None = None  # no depth pays even at acceptance 1 (idle_steps)
        self._steps_since = 0

    def acceptance(self, source: str) -> float:
        a, r = self.accept.get(source, (0.0, 0.0))
        return (a + ACCEPT_PRIOR[0]) / (a + r + ACCEPT_PRIOR[0] + ACCEPT_PRIOR[1])

    def union(self, rows: int) -> float:
        return self.union_prior(rows) ** (self.union_power.value or 0.0)

    def compute_of(self, rows: int) -> float:
        """A verify of `rows` rows' compute seconds: measured where a verify of that size ran, else a
        line through the measured sizes (a verify pays a fixed cost over a plain step, then a cost
        per row), else the prior row_cost per row over a plain step."""
        one = self.compute.value or 1.0
        if rows == 1:
            return one
        seen = sorted((n, r.value) for n, r in self.verify_compute.items())
        for n, c in seen:
            if n == rows:
                return c
        if len(seen) >= 2:
            mean_n = sum(n for n, _ in seen) / len(seen)
            mean_c = sum(c for _, c in seen) / len(seen)
            slope = (sum((n - mean_n) * (c - mean_c) for n, c in seen) / sum((n - mean_n) ** 2 for n, _ in seen))
            return max(mean_c + max(slope, 0.0) * (rows - mean_n), one)
        if seen:
            n, c = seen[0]
            return max(c + self.row_cost * one * (rows - n), one)
        return one * (1.0 + self.row_cost * (rows - 1))

    def speedup(self, depth: int, source: str, drafter: str, acceptance: float | None = None) -> float:
        """Expected tokens per second of a step drafting `depth` over a plain step's."""
        one, stall = self.compute.value or 1.0, self.stall.value or 0.0
        ds = self.draft_s.get(drafter)
        cost = (self.compute_of(depth + 1) + stall * self.union(depth + 1)
                + depth * (ds.value if ds is not None and ds.value else 0.0))
        a = self.acceptance(source) if acceptance is None else acceptance
        return expected_tokens(depth, a) * (one + stall) / cost if cost > 0 else 1.0

    def depth(self, available: int, source: str, drafter: str) -> tuple[int, str]:
        """(depth, why) for a step whose drafter offers `available` tokens."""
        if available <= 0:
            return 0, "no draft"
        if self.policy == "fixed":
            return available, "fixed"
        if self.compute.value is None:
            return 0, "measuring"  # no plain step measured yet: nothing to compare a verify with
        self._steps_since += 1
        if self._steps_since > REDECIDE:
            self._decided.clear()
            self._hopeless = None
            self._steps_since = 0
        key = (available, source, drafter)
        best = self._decided.get(key)
        if best is None:
            best, best_rate = 0, 1.0
            for k in range(1, available + 1):
                rate = self.speedup(k, source, drafter)
                if rate > best_rate:
                    best, best_rate = k, rate
            self._decided[key] = best
        if best:
            self._explore_at = EXPLORE_FIRST
            return best, "drafted"
        self._skipped += 1
        if self._skipped >= self._explore_wait(available):  # try once more: the text or the cache may have changed
            self._skipped = 0
            self._explore_at *= 2
            return available, "explored"  # the whole offer: its acceptance and its cost, measured
        return 0, "gated off"

    def idle_steps(self) -> int:
        """Plain steps to take without asking for drafts: none while some kind of draft could pay,
        else the steps left until the next trial (which the gated-off count then reaches).
        'Could pay': some depth beats a plain step even if every draft were accepted; re-read
        every REDECIDE steps, as the decisions are."""
        if self.policy != "gate" or self.compute.value is None:
            return 0
        if self._hopeless is None:
            self._hopeless = all(self.speedup(k, "", "", acceptance=1.0) <= 1.0 for k in range(1, self.max_depth + 1))
        return max(self._explore_wait(self.max_depth) - self._skipped - 1, 0) if self._hopeless else 0

    def _explore_wait(self, depth: int) -> int:
        """Gated-off steps before a trial of `depth`: the doubling interval, and at least enough plain
        steps that the trial's expected cost is EXPLORE_SHARE of their time (where a verify costs
        many plain steps, it is tried that much more rarely)."""
        one = self.compute.value or 1.0
        return max(self._explore_at, math.ceil(self.compute_of(depth + 1) / (one * EXPLORE_SHARE)))

    def skipped(self, steps: int) -> None:
        """`steps` plain steps were taken without asking (idle_steps): they count towards the next trial."""
        self._skipped += steps

    def observe(self, rows: int, seconds: float, stall: float, nbytes: int) -> None:
        """A step of `rows` rows took `seconds`, `stall` of them waiting on reads of `nbytes`."""
        compute = max(seconds - stall, 0.0)
        if rows == 1:
            self.compute.add(compute)
            self.stall.add(stall)
            self.bytes.add(nbytes)
            return
        self.verify_compute.setdefault(rows, _Running()).add(compute)
        self._hopeless = None
        prior = self.union_prior(rows)
        if self.bytes.value and nbytes > 0 and prior > 1.0:
            # the exponent that makes the prior's union match what the store really read
            self.union_power.add(min(max(math.log(max(nbytes / self.bytes.value, 1.0)) / math.log(prior), 0.0), 1.5))

    def observe_draft(self, drafter: str, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_s.setdefault(drafter, _Running()).add(seconds / tokens)

    def observe_accept(self, source: str, accepted: int, tested: int) -> None:
        for key in [k for k in self._decided if k[1] == source]:  # its acceptance moved: decide again
            del self._decided[key]
        counts = self.accept.setdefault(source, [0.0, 0.0])
        counts[0] = counts[0] * ACCEPT_DECAY + accepted
        counts[1] = counts[1] * ACCEPT_DECAY + (tested - accepted)


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
        while True:
            left = steps.max_new_tokens - len(gen.output_ids)
            if left <= 0 or (steps.stop_ids and token in steps.stop_ids):
                return
            idle = gate.idle_steps()
            if idle:  # no draft can pay here now: plain steps, as generate's own loop takes them
                done, token, pos, taken = self._plain(steps, gen, token, pos, min(idle, left), seq)
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
            kind = source.split("-")[0]  # lookup-3 → lookup: whose cost per drafted token
            k, why = gate.depth(available, source, kind)
            stats.decide(k, why)
            drafts = drafter.propose(k).tokens if k else []
            k = len(drafts)
            t_draft = time.perf_counter() - t0
            gate.observe_draft(kind, k, t_draft)
            if self.hints:
                # this step's rows; on a gated-off step also the lookup's guess at the next token
                # (an MTP guess would cost a layer of compute: not for a hint)
                guess = drafter.propose(1).tokens if not k and available and kind == "lookup" else []
                self._hint([token, *drafts, *guess])
            if k:
                logits = engine.verify([token, *drafts], pos)
            else:
                logits = engine.forward([token], pos)
            t_forward = time.perf_counter()
            emitted, accepted, tested, stop = self._accept(steps, gen, logits, drafts, t0)
            io1 = self._io()
            nbytes = max(io1[0] - io0[0], 0) if io1[0] >= io0[0] else io1[0]  # counters reset mid-step
            stall = max(io1[1] - io0[1], 0.0) if io1[1] >= io0[1] else io1[1]
            # The step's cost without the sampling of its rows: the forward's, as the gate models it.
            gate.observe(k + 1, t_forward - t0 - t_draft, stall, nbytes)
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

    def _hint(self, tokens: list[int]) -> None:
        """Before a step: the first MoE layers' experts (the ones the model's own router lookahead, which
        starts from a layer's residual, cannot hint in time) for these tokens, predicted by each layer's
        own norm and router on the tokens' embeddings (the residual entering the first layers is mostly
        the embedding), as one ascending union per layer: the rows of a verify, and on a gated-off step
        the draft of the next token, whose reads land in the cache while this step computes."""
        a, w = self.engine.args, self.engine.model.w
        x = F.embedding(torch.as_tensor(tokens, dtype=torch.long), w["model.embed_tokens.weight"])  # [n, H]
        for layer in self._hinted_layers:
            norm = w[f"{layer_prefix(layer)}.post_attention_layernorm.weight"]
            ids, _ = route_layer(a, w, layer, rms_norm(x, norm, a.rms_norm_eps), self.engine.model.routing_trim)
            self._store.hint_experts(layer, sorted(e for e in set(ids.flatten().tolist()) if e >= 0))

    def _plain(self, steps: Steps, gen, token: int, pos: int, count: int, seq: list[int]):
        """Up to `count` plain decode steps (the gate counts them gated off)
        → (stopped, token, pos, steps taken)."""
        engine, sampler, stats = self.engine, steps.sampler, self.stats
        for taken in range(count):
            if steps.stop_ids and token in steps.stop_ids:
                return True, token, pos, taken
            t = time.perf_counter()
            if self.hints:
                self._hint([token])
            logits = engine.forward([token], pos)
            raw = logits[-1]
            token = sampler.pick(steps.shape(raw))
            steps.record(token, raw)
            gen.token_seconds.append(time.perf_counter() - t)
            pos += 1
            seq.append(token)
            stats.steps += 1
            stats.emitted += 1
            stats.decide(0, "gated off")
            if steps.finished(token) or len(gen.output_ids) >= steps.max_new_tokens:
                return True, token, pos, taken + 1
        return False, token, pos, count

    def _accept(self, steps: Steps, gen, logits: torch.Tensor, drafts: list[int], t0: float):
        """Row by row (module doc): emit tokens through generate's bookkeeping until a draft is
        rejected, the drafts run out (then one more from the last row), or the generation stops.
        → (emitted tokens, drafts accepted, drafts tested, stopped)."""
        sampler = steps.sampler
        emitted: list[int] = []
        accepted = tested = 0
        last = t0
        for i in range(len(drafts) + 1):
            raw = logits[i]
            shaped = steps.shape(raw)
            draft = drafts[i] if i < len(drafts) else None
            if draft is not None:
                tested += 1
            if sampler.temperature == 0:
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
