"""When the sampler proposes a point already measured: count it apart, and explore instead.

A GP or TPE sampler on the tuner's small, mostly categorical space settles on its best point and
then proposes it again and again (a 15-minute `make tune` once spent 360 of its 460 "trials",
from minute 5 on, re-proposing measured points, each costing a GP fit and measuring nothing).
So a re-proposal is recorded (the sampler is told the earlier figures) but is not a trial: it
does not count against --trials and is reported apart. After RE_PROPOSALS_BEFORE_EXPLORE of them
in a row the search switches to exploration: each further re-proposal is answered with an
unmeasured one-step neighbour of the best point (a local search around it, enqueued as a fixed
trial, so it costs no sampler fit). When every neighbour of the best point is measured and the
sampler still has nothing new, the best point is a verified local optimum and the search stops
early: "converged after N measured trials", then the confirmation round, and the rest of the
time budget is returned.

The rule depends only on the study's trials, the space and the seed (the shuffle is seeded by the
study seed and the trial number), so every worker of a shared study follows the same rule and,
with their different trial numbers, tends to pick different neighbours.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from tuner.search.confirm import ranked
from tuner.results.result import point_key

# Re-proposals in a row before the search switches to exploration: one or two happen while the
# sampler still learns; a third in a row means it has settled.
RE_PROPOSALS_BEFORE_EXPLORE = 3
RANDOM_DRAWS = 200  # with no feasible point yet, random draws tried for an unmeasured one
# Categorical knobs whose choices are ordered sizes: a neighbour is the next size up or down.
# The others (io_mode, cache_policy) are unordered: every other choice is a neighbour.


def is_re_proposal(attrs: dict) -> bool:
    return attrs.get("duplicate_of") is not None


def measured(trials) -> list:
    """Trials that evaluated their point (a bench run, or the memory plan's refusal), re-proposals left out."""
    return [t for t in trials if not is_re_proposal(t.user_attrs)]


@dataclass
class SearchCounts:
    """How a study's trials split: measured points, re-proposals, distinct points."""

    measured: int  # trials that evaluated a point: bench runs and memory-plan refusals
    re_proposals: int  # the sampler proposed a measured point: told its figures, not measured
    distinct_points: int  # distinct points among the measured (workers may measure one point twice)
    explored: int  # measured points proposed by the exploration rule, not the sampler

    def line(self) -> str:
        return (f"{self.measured} measured ({self.distinct_points} distinct points), "
                f"{self.re_proposals} re-proposal(s) not measured"
                + (f", {self.explored} by exploration" if self.explored else ""))


def search_counts(trials) -> SearchCounts:
    """Counts over COMPLETE trials (FrozenTrial)."""
    done = [t for t in trials if "constraint" in t.user_attrs]
    evaluated = measured(done)
    return SearchCounts(measured=len(evaluated), re_proposals=len(done) - len(evaluated),
                        distinct_points=len({point_key(t.params) for t in evaluated}),
                        explored=sum(t.user_attrs.get("role") == "explore" for t in evaluated))


class Stall:
    """Re-proposals in a row, and whether the search has switched to exploration (for good)."""

    def __init__(self, threshold: int = RE_PROPOSALS_BEFORE_EXPLORE):
        self.threshold = threshold
        self.in_a_row = 0
        self.exploring = False

    def re_proposed(self) -> bool:
        """Count one; True when the search should now propose an exploration point."""
        self.in_a_row += 1
        if self.in_a_row >= self.threshold:
            self.exploring = True
        return self.exploring

    def measured(self) -> None:
        self.in_a_row = 0


def neighbours(params: dict, distributions: dict) -> list[dict]:
    """Every point one step away from `params`: the next value up or down of an ordered knob,
    any other choice of an unordered one."""
    out = []
    for name, dist in distributions.items():
        if name not in params:
            continue
        for value in _steps(params[name], dist):
            out.append({**params, name: value})
    return out


def _steps(value, dist) -> list:
    if isinstance(dist, CategoricalDistribution):
        choices = list(dist.choices)
        if value not in choices:
            return []
        if all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in choices):
            order = sorted(choices)
            i = order.index(value)
            return [order[j] for j in (i - 1, i + 1) if 0 <= j < len(order)]
        return [c for c in choices if c != value]
    if isinstance(dist, IntDistribution):
        return [v for v in (value - dist.step, value + dist.step) if dist.low <= v <= dist.high]
    if isinstance(dist, FloatDistribution) and dist.step:
        return [round(v, 6) for v in (value - dist.step, value + dist.step)
                if dist.low - 1e-9 <= v <= dist.high + 1e-9]
    return []


def random_point(distributions: dict, rng: random.Random) -> dict:
    point = {}
    for name, dist in distributions.items():
        if isinstance(dist, CategoricalDistribution):
            point[name] = rng.choice(list(dist.choices))
        elif isinstance(dist, IntDistribution):
            point[name] = rng.randrange(dist.low, dist.high + 1, dist.step)
        else:
            steps = round((dist.high - dist.low) / dist.step) if dist.step else 0
            point[name] = round(dist.low + rng.randint(0, steps) * dist.step, 6) if dist.step \
                else rng.uniform(dist.low, dist.high)
    return point


def exploration_point(trials, distributions: dict, objective: str, seed: int, number: int) -> tuple[dict | None, str]:
    """(an unmeasured point to measure next, why), or (None, why) when the search has converged.

    trials: the study's COMPLETE trials. The point is a one-step neighbour of the best feasible
    point, in an order shuffled by (seed, number); without a feasible point yet, a random one.
    """
    done = measured([t for t in trials if "constraint" in t.user_attrs])
    seen = {point_key(t.params) for t in done}
    rng = random.Random(seed * 1_000_003 + number)
    best = ranked(done, objective)
    if best:
        around = neighbours(best[0].params, distributions)
        rng.shuffle(around)
        fresh = [p for p in around if point_key(p) not in seen]
        if not fresh:
            return None, f"every one-step neighbour of the best point (trial #{best[0].number}) is measured"
        return fresh[0], f"an unmeasured neighbour of the best point (trial #{best[0].number})"
    for _ in range(RANDOM_DRAWS):
        point = random_point(distributions, rng)
        if point_key(point) not in seen:
            return point, "a random unmeasured point (no feasible point yet)"
    return None, f"{RANDOM_DRAWS} random draws found no unmeasured point"
