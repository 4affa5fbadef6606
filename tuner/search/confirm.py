"""Ranking the search's trials and the confirmation round that picks the winner.

The round re-measures the top candidates, the engine's defaults (EngineConfig(): what a user
who skips `tune` gets, so the headline gain is over them) and the rules-of-thumb baseline,
interleaved, winner first and baseline last (leftover warm state then favours the references,
not the winner), and chooses on medians with their spread. A candidate whose tokens change, or
that fails when re-measured, is disqualified: placement must never change tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Callable

from engine.api import EngineConfig
from tuner.results.printers import fmt
from tuner.results.result import Candidate, Figures, RunFigures, RunSummary, TrialResult, is_feasible
from tuner.search.objective import OBJECTIVE_KEY, point_key, ranks_lower


@dataclass
class Contender:
    """A candidate while it is being re-measured (its output tokens are compared, not kept)."""

    label: str
    trial_number: int | None
    role: str | None
    config: EngineConfig
    search_values: list[float] | None
    runs: list[RunSummary] = field(default_factory=list)
    output_ids: list = field(default_factory=list)  # one per run
    confirmed: Figures | None = None
    disqualified: str | None = None
    note: str | None = None

    def candidate(self) -> Candidate:
        return Candidate(label=self.label, trial_number=self.trial_number, role=self.role,
                         config=self.config.to_dict(), confirmed=self.confirmed, search_values=self.search_values,
                         runs=self.runs, disqualified=self.disqualified, note=self.note)


@dataclass
class Decision:
    contenders: list[Contender]
    rounds: int
    winner: Contender | None
    baseline: Contender
    confirmed: bool
    defaults: Contender | None = None  # the engine's defaults (None: not measured, e.g. no confirmation round)


# --- ranking --------------------------------------------------------------------------------

def dominates(a, b) -> bool:
    (ad, at), (bd, bt) = a.values, b.values
    return ad >= bd and at <= bt and (ad > bd or at < bt)


def feasible(trials) -> list:
    return [t for t in trials if is_feasible(t.user_attrs)]


def serve_order(goodput: float | None, ttft_p95: float | None, aggregate: float | None) -> tuple:
    """The serve objective's sort key (smaller first): goodput, highest first; equal goodput (most
    often 0, when no config meets tight SLOs) by p95 TTFT, lowest first (the nearest to meeting
    the TTFT bound, and the tail a user waits on), then by aggregate tok/s, highest first."""
    inf = float("inf")
    return (-(goodput or 0.0), ttft_p95 if ttft_p95 is not None else inf, -(aggregate or 0.0))


def ranked(trials, objective: str) -> list:
    """Feasible trials best first. Both objectives: the Pareto front first (by decode), then
    the rest by decode. serve: by goodput, ties as serve_order breaks them."""
    feas = feasible(trials)
    if objective == "decode":
        return sorted(feas, key=lambda t: -t.values[0])
    if objective == "serve":
        return sorted(feas, key=lambda t: serve_order(t.values[0], t.user_attrs.get("ttft_p95_s"),
                                                      t.user_attrs.get("aggregate_tok_s")))
    if ranks_lower(objective):
        return sorted(feas, key=lambda t: t.values[0])
    front = [t for t in feas if not any(dominates(o, t) for o in feas)]
    rest = [t for t in feas if t not in front]
    return sorted(front, key=lambda t: (-t.values[0], t.values[1])) + sorted(rest, key=lambda t: -t.values[0])


def contenders(ranked_trials, top: int, baseline: EngineConfig, baseline_params: dict, baseline_trial,
               config_of: Callable[[dict], EngineConfig], defaults: Reference | None = None) -> list[Contender]:
    """The best `top` distinct points (the references' own points excluded), then the engine's
    defaults (when given), then the baseline."""
    references = {point_key(baseline_params)} | ({point_key(defaults.params)} if defaults else set())
    seen, out = set(), []
    for t in ranked_trials:
        key = point_key(t.params)
        if key in seen or key in references:
            continue
        seen.add(key)
        out.append(Contender(f"trial {t.number}", t.number, t.user_attrs.get("role", "search"),
                             config_of(t.params), list(t.values)))
        if len(out) >= top:
            break
    if defaults is not None:
        out.append(Contender("defaults", defaults.trial.number if defaults.trial else None, "defaults",
                             defaults.config, list(defaults.trial.values) if defaults.trial else None))
    out.append(Contender("baseline", baseline_trial.number if baseline_trial else None, "baseline", baseline,
                         list(baseline_trial.values) if baseline_trial else None))
    return out


@dataclass
class Reference:
    """A config the winner is compared with: as it runs, its point in the space, its search trial."""

    config: EngineConfig
    params: dict
    trial: object | None = None  # the FrozenTrial that measured the point in the search, if any


# --- the round ------------------------------------------------------------------------------

def run_summary(res: TrialResult) -> tuple[RunSummary, list | None]:
    """One re-measurement, and its output tokens."""
    if not res.ok:
        return RunSummary(status=res.status, wall_seconds=round(res.wall_seconds, 3),
                          cgroup_peak_bytes=res.cgroup_peak_bytes, error=res.error), None
    m = res.metrics
    figures = dataclasses.asdict(RunFigures.from_metrics(m))
    return RunSummary(
        status="ok", wall_seconds=round(res.wall_seconds, 3), cgroup_peak_bytes=res.cgroup_peak_bytes,
        decode_samples=[r.get("decode_tok_s") for r in m.get("runs", [])],
        ttft_samples=[r.get("ttft_s") for r in m.get("runs", [])], **figures), m.get("output_ids")


def confirm(entries: list[Contender], rounds: int, measure: Callable[[EngineConfig], TrialResult],
            room_for_round: Callable[[int], bool], log) -> int:
    """Up to `rounds` rounds (the first always, later ones while time allows); rounds run."""
    done = 0
    while done < rounds:
        if done >= 1 and not room_for_round(len(entries)):
            break
        done += 1
        for i, e in enumerate(entries):
            log(f"confirm round {done}: {i + 1}/{len(entries)} {e.label} ...")
            summary, ids = run_summary(measure(e.config))
            e.runs.append(summary)
            e.output_ids.append(ids)
            log(f"confirm round {done}: {e.label}: " + (
                (f"goodput {fmt(summary.goodput_rps, 3)} req/s ({summary.slo_met} within the SLOs), "
                 if summary.goodput_rps is not None else "")
                + f"{fmt(summary.decode_tok_s)} tok/s, TTFT {fmt(summary.ttft_s, 3)} s, "
                f"request {fmt(summary.request_s, 3)} s"
                if summary.status == "ok" else summary.status))
    return done


def figures(runs: list[RunSummary]) -> Figures | None:
    ok = [r for r in runs if r.status == "ok"]
    if not ok:
        return None

    def med(key):
        vals = [getattr(r, key) for r in ok if getattr(r, key) is not None]
        return statistics.median(vals) if vals else None

    dec = [v for r in ok for v in r.decode_samples if v is not None]
    ttft = [v for r in ok for v in r.ttft_samples if v is not None]
    good = [r.goodput_rps for r in ok if r.goodput_rps is not None]  # a trace replay's (serve); its runs' medians
    return Figures(
        decode_tok_s=med("decode_tok_s"), ttft_s=med("ttft_s"), request_s=med("request_s"), measurements=len(ok),
        decode_min=min(dec) if dec else None, decode_max=max(dec) if dec else None,
        decode_stdev=statistics.stdev(dec) if len(dec) > 1 else 0.0,
        ttft_min=min(ttft) if ttft else None, ttft_max=max(ttft) if ttft else None, samples=len(dec),
        goodput_rps=med("goodput_rps"), goodput_min=min(good) if good else None,
        goodput_max=max(good) if good else None, ttft_p95_s=med("ttft_p95_s"), tpot_p95_s=med("tpot_p95_s"))


def figures_of_trial(a: dict) -> Figures:
    """A search trial's own figures, for a run without a confirmation round."""
    summary = (a.get("metrics") or {}).get("summary") or {}
    s, t, g = summary.get("decode_tok_s") or {}, summary.get("ttft_s") or {}, summary.get("goodput_rps") or {}
    return Figures(decode_tok_s=a.get("decode_tok_s"), ttft_s=a.get("ttft_s"), request_s=a.get("request_s"),
                   measurements=1,
                   decode_min=s.get("min"), decode_max=s.get("max"), decode_stdev=s.get("stdev"),
                   ttft_min=t.get("min"), ttft_max=t.get("max"), samples=s.get("n"), unconfirmed=True,
                   goodput_rps=a.get("goodput_rps"), goodput_min=g.get("min"), goodput_max=g.get("max"),
                   ttft_p95_s=a.get("ttft_p95_s"), tpot_p95_s=a.get("tpot_p95_s"))


def decide(entries: list[Contender], rounds: int, objective: str) -> Decision:
    base = entries[-1]
    defaults = next((e for e in entries if e.role == "defaults"), None)
    base_ok = bool(figures(base.runs)) and base.runs[0].status == "ok"
    for e in entries:
        e.confirmed = figures(e.runs)
        bad = [r for r in e.runs if r.status != "ok"]
        if bad:
            e.disqualified = f"{bad[0].status} in confirmation: {bad[0].error or ''}"[:300]
        elif not all(r.tokens_consistent is not False for r in e.runs):
            e.disqualified = "output tokens differ between repeats"
        elif e is not base and base_ok and e.output_ids[0] != base.output_ids[0] and e.config.lossless:
            # (a lossy candidate, tune --max-kl, changes tokens by design: its quality was measured)
            if e.runs[0].threads == base.runs[0].threads:
                e.disqualified = "output tokens differ from the baseline's (placement must not change them)"
            else:
                e.note = ("output tokens differ from the baseline's, whose thread count differs "
                          "(float reduction order); not disqualified")
    ok = [e for e in entries if not e.disqualified and e.confirmed]
    winner = None
    if ok:
        if ranks_lower(objective):
            key = OBJECTIVE_KEY[objective]
            winner = min(ok, key=lambda e: v if (v := getattr(e.confirmed, key)) is not None else float("inf"))
        elif objective == "serve":
            winner = min(ok, key=lambda e: serve_order(e.confirmed.goodput_rps, e.confirmed.ttft_p95_s,
                                                       _median_of(e.runs, "aggregate_tok_s")))
        else:
            winner = max(ok, key=lambda e: (e.confirmed.decode_tok_s or 0.0, -(e.confirmed.ttft_s or 0.0)))
    return Decision(entries, rounds, winner, base, confirmed=True, defaults=defaults)


def _median_of(runs: list[RunSummary], key: str) -> float | None:
    vals = [getattr(r, key) for r in runs if r.status == "ok" and getattr(r, key) is not None]
    return statistics.median(vals) if vals else None


def unconfirmed(ranked_trials, base: Contender, baseline_trial, config_of, defaults: Reference | None = None) -> Decision:
    """No confirmation round: the best search trial as it was measured, against the baseline's
    trial (and the defaults' trial, when the search measured that point)."""
    entries = [Contender(f"trial {t.number}", t.number, t.user_attrs.get("role"), config_of(t.params),
                         list(t.values), confirmed=figures_of_trial(t.user_attrs)) for t in ranked_trials[:1]]
    base.confirmed = figures_of_trial(baseline_trial.user_attrs) \
        if baseline_trial is not None and baseline_trial.user_attrs.get("status") == "ok" else None
    ref = None
    if defaults is not None and defaults.trial is not None and defaults.trial.user_attrs.get("status") == "ok":
        ref = Contender("defaults", defaults.trial.number, "defaults", defaults.config, list(defaults.trial.values),
                        confirmed=figures_of_trial(defaults.trial.user_attrs))
    return Decision(entries + ([ref] if ref else []) + [base], 0, entries[0] if entries else None, base,
                    confirmed=False, defaults=ref)
