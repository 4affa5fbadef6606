"""Speculative decoding's gate: when drafting pays and how deep, from what this machine measures.

Per step (policy "gate"), the depth k in 0..draft_depth (no more than the drafter offers) that
maximises the expected tokens per second over a plain step's:

    E(k)    = 1 + a1 + a1 a2 + ... + a1 a2 ... ak
                                           aj: the measured acceptance of the j-th draft of this kind
                                           (its bucket: lookup-n by match length, mtp) given that the
                                           ones before it were accepted, with the kind's acceptance a
                                           over all positions (Beta(1, 1) prior) as its prior, worth
                                           POSITION_PRIOR drafts; counts fading by ACCEPT_DECAY per step.
                                           Unmeasured, aj = a and E(k) = 1 + a + ... + a^k; measured, a
                                           copy's drafts (accepted in runs: once the first is, nearly
                                           all) earn the deep drafts they pay for
    C(n)    = compute(n) + stall(1) * union(n) + k * draft_s
    rate(k) = E(k) * C(1) / C(k + 1)       k* = the best k, or 0 (a plain step) if none beats 1

compute(n): a verify of n rows' compute seconds as measured (per row count; the first of a count
only stands in, it pays one-time costs): the line through the measured counts, each weighing the
measurements its estimate holds (through the one and a plain step where one count is measured),
before any the prior `row_cost` of a plain step per extra row (0.5 where rows share their weight
reads). On a small resident model a verify's rows cost about as much as their steps, and no depth
pays.
stall(1): a plain step's wait for reads; union(n): the expert bytes n rows read over one row's,
from the routing (n tokens' top-k over E experts, independent: independent_union) raised to a
power fitted online from the bytes the store really read in verify steps (consecutive tokens share
experts; the caches hold some). Under streaming this is the trade: the union's extra bytes against
the tokens the accepted drafts save.

A depth is drafted only where its modelled rate beats a plain step's by DRAFT_GAIN (the estimates
are measured on a busy machine: a depth that barely pays on paper loses as often as it wins).
Gated-off steps count towards a trial of EXPLORE_DEPTH drafts after 16, 32, 64... of them, and no
sooner than its modelled cost (the verify and the drafting) is EXPLORE_SHARE of their time, then
half that share, a quarter... (both bounds double with every trial, and start again once a draft
pays), to notice that the text or the cache changed at a cost that fades while trials keep losing.
A trial whose drafts were all accepted is followed at once by one twice as deep (up to the maximum
depth, where the drafter offers that many): a verify's cost per row is then measured at two sizes,
not extrapolated from one through a plain step, which charges a verify's fixed cost to every row
and so rules out exactly the deep drafts that a copy (long runs, all accepted) pays for; unless the
deeper depth could not pay even with every draft accepted and its extra rows free (its drafting
alone too dear: a small model's MTP layer costs 0.4 of a plain step a token).
Where no depth pays even at acceptance 1 (at the cheapest drafting measured), or after OFF_RUN
gated-off decisions in a row where no longer offer of that kind would pay either (idle_steps: a
copy's offers run short where its source ends, and the next long one must be asked for), the steps
until the next trial are plain ones without asking the drafter: the speculative loop then costs what
generate's own does, and the MTP layer is not run at all (engine/run/mtp_drafter.py).
The model prices a step alone. What it cannot see (the experts a streamed verify or an MTP layer's
reads evict, which later steps read again) shows in the steps' realized time per emitted token:
where the steps drafted took VETO_MARGIN times as long per token as plain ones, drafting is vetoed a while
(_vetoed), whatever the model says.
Decisions are reused for REDECIDE steps (a plain step of a small
model is a fraction of a millisecond; the gate must not be a noticeable share of it).

The counters every run reports and the closed forms the cost model's `plan` shares (expected_tokens,
independent_union, draft_speedup): engine/run/spec_stats.py.
"""

from __future__ import annotations

import math
from typing import Callable

from engine.run.spec_stats import expected_tokens

EXPLORE_FIRST = 16  # gated-off steps before the first trial of a draft (then 32, 64, ...)
EXPLORE_SHARE = 0.03  # at most this share of the gated-off steps' time goes to the first trial, then half, ...
EXPLORE_DEPTH = 2  # a trial's depth (at most): its acceptance is what a trial learns, and deeper costs more
EMA = 0.2  # weight of a new measurement in the gate's running estimates
FIT_WEIGHT = 5  # measurements a verify size's estimate weighs in the line through the sizes (~1 / EMA: what it holds)
FIT_STALE = 64  # verifies after its last measurement that a size's estimate leaves the line (compute_of)
ACCEPT_DECAY = 0.98  # acceptance counts fade, so a change of text (copying, then not) shows
ACCEPT_PRIOR = (1.0, 1.0)  # Beta(1, 1): an unseen kind of draft is accepted half the time
POSITION_PRIOR = 2.0  # drafts the kind's overall acceptance is worth in a draft position's own estimate
REDECIDE = 16  # steps a gate decision is reused before the estimates are read again
OFF_RUN = 8  # gated-off decisions in a row (no-draft steps aside), then plain steps until the next trial
DRAFT_GAIN = 1.05  # the modelled speed-up a depth must reach to be drafted: a margin over the estimates' noise
VETO_MIN = 16  # drafted steps measured before their realized time per token can stop drafting
VETO_MARGIN = 1.2  # ... and how much slower than plain steps' it must be (a copy's brief runs of rejected
                   # drafts cost a little more a token than plain steps, and the model turns those off itself)
VETO_FIRST = 64  # decisions drafting stays off once it measured slower than plain steps (then 128, 256, ...)
RATE_DECAY = 0.97  # weight of the older steps in the realized times per token (~30 steps' memory)


# --- the measurements ---------------------------------------------------------------------------

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


def drafter_of(source: str) -> str:
    """The drafter kind of a draft's source (lookup-3 → lookup, mtp → mtp): whose cost per token."""
    return source.split("-")[0]


class _PerToken:
    """Seconds per emitted token over recent steps: decayed sums of seconds and of tokens (a ratio of
    sums: a step that emits 9 tokens weighs 9 times one that emits 1)."""

    __slots__ = ("seconds", "tokens", "steps")

    def __init__(self):
        self.seconds = self.tokens = 0.0
        self.steps = 0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.seconds * RATE_DECAY + seconds
        self.tokens = self.tokens * RATE_DECAY + tokens
        self.steps += 1

    @property
    def value(self) -> float | None:
        return self.seconds / self.tokens if self.tokens > 0 else None


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
        self._verifies = 0  # verifies measured
        self._measured_at: dict[int, int] = {}  # rows → self._verifies when that size was last measured
        self.union_power = _Running(1.0)  # bytes(n) = bytes(1) * union_prior(n) ** power
        self.draft_s: dict[str, _Running] = {}  # seconds to draft one token, per drafter
        self.accept: dict[str, list[float]] = {}  # source → [accepted, rejected] (decayed)
        # source → per draft position j (index j - 1): [accepted, rejected] of the drafts that reached it
        # (the ones before it accepted), decayed as `accept`
        self.reach: dict[str, list[list[float]]] = {}
        self._skipped = 0
        self._explore_at = EXPLORE_FIRST
        # (available, source, drafter) → depth: the estimates move slowly, so a decision is reused for
        # REDECIDE steps; a plain step costs well under a millisecond on a small resident model, and
        # the gate must not take a noticeable share of it
        self._decided: dict = {}
        self._hopeless: bool | None = None  # no depth pays even at acceptance 1 (idle_steps)
        self._steps_since = 0
        self._off_run = 0  # gated-off decisions in a row (idle_steps after OFF_RUN)
        self._trial_depth = EXPLORE_DEPTH  # the next trial's depth (deeper after a trial accepted whole)
        self._trial: tuple[str, int] | None = None  # (source, depth) of the step decided as a trial, until observed
        # What the steps really took per emitted token, plain and drafted (the veto: _vetoed)
        self.plain_rate, self.drafted_rate = _PerToken(), _PerToken()
        self._veto_left = 0  # decisions drafting stays off for
        self._veto_len = VETO_FIRST

    def acceptance(self, source: str) -> float:
        a, r = self.accept.get(source, (0.0, 0.0))
        return (a + ACCEPT_PRIOR[0]) / (a + r + ACCEPT_PRIOR[0] + ACCEPT_PRIOR[1])

    def expected(self, depth: int, source: str) -> float:
        """Tokens a step drafting `depth` of this kind emits on average: 1 + the sum over j of the chance
        that the first j drafts are all accepted, each position's acceptance given the ones before it
        (the module doc's aj). Why not 1 + a + ... + a^k: drafts are not accepted independently. A
        copy's are accepted in runs: in one copy workload 401 of 479 drafts six to eight deep (84%) were
        accepted to their sixth token or further, where the overall acceptance, 0.93, says 0.93^6 = 65%;
        the geometric model drafted six where eight paid more."""
        pooled = self.acceptance(source)
        positions = self.reach.get(source, ())
        total = run = 1.0
        for j in range(depth):
            a, r = positions[j] if j < len(positions) else (0.0, 0.0)
            run *= (a + POSITION_PRIOR * pooled) / (a + r + POSITION_PRIOR)
            total += run
        return total

    def tested(self, source: str) -> float:
        """Drafts of this kind verified (counts fading as acceptance's do)."""
        return sum(self.accept.get(source, (0.0, 0.0)))

    def union(self, rows: int) -> float:
        return self.union_prior(rows) ** (self.union_power.value or 0.0)

    def compute_of(self, rows: int) -> float:
        """A verify of `rows` rows' compute seconds: where verifies of two sizes or more ran, the line
        through them (a verify pays a fixed cost over a plain step, then a cost per row), each size
        weighing as many of its measurements as its estimate holds (FIT_WEIGHT at most); where one
        size ran, that size's, or the line through it and a plain step; else the prior row_cost per row
        over a plain step. Why a line and not each size's own estimate: the sizes a gate rarely
        drafts are measured a few times each on a busy machine, and one copy's estimates read 4.5 plain
        steps for 8 rows and 3.4 for 9, which made 7 drafts look dearer than 8. Why a size leaves the
        line once FIT_STALE verifies passed without it: the gate drafts only the depths the line says pay,
        so a size measured slow once (a first call's one-time costs, a stall on a busy box) was never
        measured again and held the line steep for good: in one streamed copy run a process drafted 3.2
        tokens a step where the others drafted 6, and a gate fed one 7-row verify at 4x its cost drafted
        2 deep ever after (tests/test_speculative.py)."""
        one = self.compute.value or 1.0
        if rows == 1:
            return one
        seen = sorted((n, r.value, min(r.count, FIT_WEIGHT)) for n, r in self.verify_compute.items()
                      if self._verifies - self._measured_at[n] < FIT_STALE)
        if len(seen) >= 2:
            total = sum(w for _, _, w in seen)
            mean_n = sum(w * n for n, _, w in seen) / total
            mean_c = sum(w * c for _, c, w in seen) / total
            slope = (sum(w * (n - mean_n) * (c - mean_c) for n, c, w in seen)
                     / sum(w * (n - mean_n) ** 2 for n, _, w in seen))
            return max(mean_c + max(slope, 0.0) * (rows - mean_n), one)
        if seen:  # one measured size: its own, or the line through it and a plain step
            n, c, _ = seen[0]
            return c if n == rows else max(c + max(c - one, 0.0) / (n - 1) * (rows - n), one)
        return one * (1.0 + self.row_cost * (rows - 1))

    def speedup(self, depth: int, source: str, drafter: str, acceptance: float | None = None,
                compute_rows: int | None = None) -> float:
        """Expected tokens per second of a step drafting `depth` over a plain step's. compute_rows: the
        verify's compute as that many rows' (fewer than depth + 1: the extra rows' compute left out)."""
        one, stall = self.compute.value or 1.0, self.stall.value or 0.0
        ds = self.draft_s.get(drafter)
        cost = (self.compute_of(compute_rows or depth + 1) + stall * self.union(depth + 1)
                + depth * (ds.value if ds is not None and ds.value else 0.0))
        tokens = self.expected(depth, source) if acceptance is None else expected_tokens(depth, acceptance)
        return tokens * (one + stall) / cost if cost > 0 else 1.0

    def depth(self, available: int, source: str, drafter: str) -> tuple[int, str]:
        """(depth, why) for a step whose drafter offers `available` tokens."""
        if self.policy == "fixed":
            return (available, "fixed") if available > 0 else (0, "no draft")
        if available <= 0:
            return 0, "no draft"  # the drafter found nothing (a lookup without a match): no decision
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
            best, best_rate = 0, DRAFT_GAIN
            for k in range(1, available + 1):
                rate = self.speedup(k, source, drafter)
                if rate > best_rate:
                    best, best_rate = k, rate
            self._decided[key] = best
        if self._veto_left > 0:
            self._veto_left -= 1
        vetoed = bool(best) and self._vetoed()
        if best and not vetoed:
            self._explore_at = EXPLORE_FIRST  # a draft pays: trials are counted afresh once it stops
            self._skipped = self._off_run = 0
            return best, "drafted"
        self._skipped += 1
        # try once more: the text or the cache may have changed
        depth = min(available, self._trial_depth)
        if self._skipped >= self._explore_wait(depth, drafter):
            self._skipped = 0
            self._explore_at *= 2
            self._off_run = 0  # what the trial measured is decided on before the steps go plain again
            self._trial = (source, depth)
            return depth, "explored"  # its acceptance and its cost, measured
        if vetoed:
            return 0, "vetoed"  # (the veto's own count ends it: no reason to idle)
        if not self._deeper_pays(available, source, drafter):
            self._off_run += 1  # (a short offer where a longer one would be drafted is no reason to idle)
        return 0, "gated off"

    def _deeper_pays(self, available: int, source: str, drafter: str) -> bool:
        """Whether a longer offer of this kind than `available` would be drafted (a copy's offer runs
        short where its source ends, then long again): decided once per REDECIDE steps as depths are."""
        key = (None, source, drafter)
        pays = self._decided.get(key)
        if pays is None:
            pays = any(self.speedup(k, source, drafter) > DRAFT_GAIN for k in range(available + 1, self.max_depth + 1))
            self._decided[key] = pays
        return bool(pays)

    def idle_steps(self) -> int:
        """Plain steps to take without asking for drafts: the steps left until the next trial (which
        the gated-off count then reaches) where no kind of draft could pay, or after OFF_RUN
        gated-off decisions in a row; else none. 'Could pay': some depth beats a plain step even if
        every draft were accepted; re-read every REDECIDE steps, as the decisions are."""
        if self.policy != "gate" or self.compute.value is None:
            return 0
        if self._hopeless is None:  # (at the cheapest drafting measured: an AutoDrafter's lookup may pay)
            cheapest = min(self.draft_s, key=lambda d: self.draft_s[d].value or 0.0, default="")
            self._hopeless = all(self.speedup(k, "", cheapest, acceptance=1.0) <= DRAFT_GAIN
                                 for k in range(1, self.max_depth + 1))
        if not self._hopeless and self._off_run < OFF_RUN:
            return 0
        return max(self._explore_wait(min(self.max_depth, self._trial_depth)) - self._skipped - 1, 0)

    def _explore_wait(self, depth: int, drafter: str | None = None) -> int:
        """Gated-off steps before a trial of `depth`: the doubling interval, and at least enough plain
        steps that the trial's expected cost (its verify, and drafting `depth` tokens as measured:
        `drafter`'s, or the costliest drafter's) is EXPLORE_SHARE of their time (where a trial costs
        many plain steps, it is tried that much more rarely)."""
        one = self.compute.value or 1.0
        if drafter is not None:
            ds = self.draft_s.get(drafter)
            per_token = ds.value if ds is not None and ds.value else 0.0
        else:
            per_token = max((r.value or 0.0 for r in self.draft_s.values()), default=0.0)
        cost = self.compute_of(depth + 1) + depth * per_token
        # both bounds double with each trial that found nothing to draft: the share falls 3%, 1.5%, ...
        return max(self._explore_at, math.ceil(cost / (one * EXPLORE_SHARE) - 1e-9) * self._explore_at // EXPLORE_FIRST)

    def skipped(self, steps: int) -> None:
        """`steps` plain steps were taken without asking (idle_steps): they count towards the next trial."""
        self._skipped += steps
        self._veto_left = max(0, self._veto_left - steps)

    def observe_rate(self, drafted: bool, seconds: float, emitted: int) -> None:
        """A step the gate decided to draft (drafted) or a plain one took `seconds`, drafting, sampling
        and bookkeeping included, and emitted `emitted` tokens (trials are neither: their depth is not
        the gate's choice)."""
        if emitted > 0:
            (self.drafted_rate if drafted else self.plain_rate).add(seconds, emitted)

    def _vetoed(self) -> bool:
        """Whether drafting stays off although the model says it pays: the steps it drafted took
        VETO_MARGIN times the time per emitted token that plain steps did, or more (over VETO_MIN of
        them at least). The model prices a
        step alone; what it cannot see shows here: the experts a streamed verify or an MTP layer's
        reads evict from the cache, which later steps read again (the MTP drafter on copy under 368 MiB
        ran 0.27x plain decoding while the model called it a gain). Drafting then stays off for
        VETO_FIRST decisions, twice that after each veto in a row (trials go on, so acceptance is still
        measured), and its rate is measured afresh."""
        if self._veto_left > 0:
            return True
        drafted, plain = self.drafted_rate.value, self.plain_rate.value
        if self.drafted_rate.steps < VETO_MIN or drafted is None or plain is None:
            return False
        if drafted <= plain:
            self._veto_len = VETO_FIRST  # drafting pays as measured: a later veto starts short again
        if drafted <= plain * VETO_MARGIN:
            return False
        self._veto_left, self._veto_len = self._veto_len, 2 * self._veto_len
        self.drafted_rate = _PerToken()
        return True

    def observe(self, rows: int, seconds: float, stall: float, nbytes: int) -> None:
        """A step of `rows` rows took `seconds`, `stall` of them waiting on reads of `nbytes`."""
        compute = max(seconds - stall, 0.0)
        if rows == 1:
            self.compute.add(compute)
            self.stall.add(stall)
            self.bytes.add(nbytes)
            return
        self.verify_compute.setdefault(rows, _Running()).add(compute)
        self._verifies += 1
        self._measured_at[rows] = self._verifies
        self._hopeless = None
        prior = self.union_prior(rows)
        if self.bytes.value and nbytes > 0 and prior > 1.0:
            # the exponent that makes the prior's union match what the store really read
            self.union_power.add(min(max(math.log(max(nbytes / self.bytes.value, 1.0)) / math.log(prior), 0.0), 1.5))

    def _deeper_could_pay(self, depth: int, rows: int, source: str) -> bool:
        """Whether drafting `depth` tokens of this kind could pay even if every draft were accepted
        and the verify's rows beyond the `rows` just measured cost no compute (only their drafting
        and reads): where not (a drafter whose every token costs a good part of a plain step, as a
        small model's MTP layer does), a deeper trial is not worth its verify."""
        return self.speedup(depth, source, drafter_of(source), acceptance=1.0, compute_rows=rows) > DRAFT_GAIN

    def observe_draft(self, drafter: str, tokens: int, seconds: float) -> None:
        if tokens:
            self.draft_s.setdefault(drafter, _Running()).add(seconds / tokens)

    def observe_accept(self, source: str, accepted: int, tested: int) -> None:
        trial, self._trial = self._trial, None
        if trial is not None and trial[0] == source:
            deeper = min(2 * trial[1], self.max_depth)
            if accepted == trial[1] and self._deeper_could_pay(deeper, trial[1] + 1, source):
                # all accepted: the next trial deeper, and at once if it can be
                self._trial_depth = deeper
                if trial[1] < deeper:
                    self._skipped = self._explore_wait(deeper)  # (the back-off doubled it already)
            else:
                self._trial_depth = EXPLORE_DEPTH
        for key in [k for k in self._decided if k[1] == source]:  # its acceptance moved: decide again
            del self._decided[key]
        counts = self.accept.setdefault(source, [0.0, 0.0])
        counts[0] = counts[0] * ACCEPT_DECAY + accepted
        counts[1] = counts[1] * ACCEPT_DECAY + (tested - accepted)
        positions = self.reach.setdefault(source, [])
        for position in positions:
            position[0] *= ACCEPT_DECAY
            position[1] *= ACCEPT_DECAY
        positions.extend([0.0, 0.0] for _ in range(tested - len(positions)))
        for j in range(tested):  # the first `accepted` positions passed; the next one, where tested, failed
            positions[j][0 if j < accepted else 1] += 1.0


