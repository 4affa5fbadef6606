"""`tune --max-kl ... --front-rounds N`: the speed-quality front re-measured fairly.

lossy.front_summary gives each lossy setting its fastest search trial. The lossless setting is
searched in many trials and a lossy one is usually measured once (a probe), and on a noisy disk
the best of many noisy samples is biased upward against a single one: on the trained reference
int8 k-1 read 0.69 MB a token against lossless int8's 1.21 and still measured 70.7 tok/s in its
one trial against lossless' best-of-many 128 (issue 20). So after the search and the
confirmation round, every point inside the bound (and the lossless point) is re-measured at its
fastest trial's full config, in N interleaved rounds, and the front is drawn from those medians.

Rounds alternate their order (forward, then backward) so no setting always runs first: a
setting that runs just after another inherits its warm page cache and CPU state, and over each
pair of rounds every entry's average position is the same.

The lossless setting is also re-measured at each lossy point's own placement (its config with
the lossy knobs off), in the same rounds, so `vs_lossless_same_placement_confirmed` compares two
confirmed medians. That is cheap: entries are deduplicated by placement, and the probes share
one placement (the best lossless warm start's, warm_start.py), which is often the lossless
point's own; only lossy points the sampler found elsewhere add an entry (at most doubling the
round in the worst case, one placement per lossy point).

Time: the rounds reuse the study's own `measure` (the same sandbox, timeout and clock) and its
`room_for_round` check, as confirm.confirm does, but before every round, the first included:
the confirmation round's reserve does not plan for these, so a run out of time stops, says so,
and keeps its points with their search figures, marked. Data flow: lossy.front_summary (search
figures) → entries → rounds → apply (confirmed figures, the front redrawn) → lossy.write_summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.api import EngineConfig
from tuner.results.printers import fmt
from tuner.results.result import RunSummary, TrialResult
from tuner.search import lossy
from tuner.search.confirm import figures, run_summary

OUTSIDE_BOUND = "outside the bound: not re-measured"


@dataclass
class FrontEntry:
    """One config re-measured in the front rounds: a point's fastest trial, or lossless at a
    lossy point's placement."""

    label: str
    config: EngineConfig
    runs: list[RunSummary] = field(default_factory=list)


def entries(points: list[dict], trials) -> tuple[list[FrontEntry], dict[str, str]]:
    """The configs to re-measure, and for each lossy point the label of the entry that measures
    lossless at its placement. Points outside the bound are left out (they are never chosen, and
    the budget goes to the ones that can be); the lossless point always goes in."""
    configs = {t.number: (t.user_attrs.get("config") or {}) for t in trials}
    out: list[FrontEntry] = []
    by_placement: dict[tuple, str] = {}  # placement → the lossless entry measured there
    same_place: dict[str, str] = {}
    lossless_point = next((p for p in points if lossy.is_lossless(p["setting"])), None)
    if lossless_point is not None:  # first: a lossy point at its placement reuses it
        config = configs.get(lossless_point["trial"]) or {}
        out.append(FrontEntry(lossless_point["label"], EngineConfig.from_dict(config)))
        by_placement[lossy.placement(config)] = lossless_point["label"]
    for p in points:
        if lossy.is_lossless(p["setting"]) or not p["within_bound"]:
            continue
        config = configs.get(p["trial"]) or {}
        out.append(FrontEntry(p["label"], EngineConfig.from_dict(config)))
        key = lossy.placement(config)
        if key not in by_placement:
            name = f"lossless at {p['label']}'s placement"
            out.append(FrontEntry(name, EngineConfig.from_dict({**config, **lossy.LOSSLESS})))
            by_placement[key] = name
        same_place[p["label"]] = by_placement[key]
    return out, same_place


def round_order(n: int, number: int) -> list[int]:
    """Round `number` (from 1): forward on odd rounds, backward on even ones."""
    order = list(range(n))
    return order if number % 2 else order[::-1]


def run_rounds(front: list[FrontEntry], rounds: int, measure: Callable[[EngineConfig], TrialResult],
               room_for_round: Callable[[int], bool], log) -> tuple[int, str | None]:
    """Up to `rounds` rounds while time allows: (rounds run, why it stopped early or None)."""
    done = 0
    while done < rounds:
        if not room_for_round(len(front)):
            log(f"front rounds: no time for round {done + 1} of {rounds} ({len(front)} runs); the front keeps "
                f"{'these medians' if done else 'its search figures'} (unconfirmed points are marked)")
            return done, f"time budget: {done} of {rounds} rounds run"
        done += 1
        for step, i in enumerate(round_order(len(front), done)):
            e = front[i]
            summary, _ids = run_summary(measure(e.config))
            e.runs.append(summary)
            log(f"front round {done}/{rounds}: {step + 1}/{len(front)} {e.label}: "
                + (f"{fmt(summary.decode_tok_s)} tok/s" if summary.status == "ok" else summary.status))
    return done, None


def confirmed_figure(e: FrontEntry) -> dict | None:
    """An entry's median decode tok/s over its good runs, min-max over every repeat, and runs."""
    fig = figures(e.runs)
    if fig is None or fig.decode_tok_s is None:
        return None
    return {"decode_tok_s": fig.decode_tok_s, "decode_min": fig.decode_min, "decode_max": fig.decode_max,
            "runs": fig.measurements, "failed_runs": len(e.runs) - fig.measurements}


def why_unconfirmed(e: FrontEntry | None, point: dict, stopped: str | None) -> str:
    if e is None:
        return OUTSIDE_BOUND if not point["within_bound"] else "not re-measured"
    if not e.runs:
        return stopped or "not re-measured"
    bad = next((r for r in e.runs if r.status != "ok"), None)
    return f"every re-measurement failed ({bad.status}: {bad.error or ''})"[:300] if bad else "no decode figure"


def apply(summary: dict, front: list[FrontEntry], same_place: dict[str, str], rounds: int, done: int,
          stopped: str | None) -> dict:
    """The summary with each point's confirmed figure beside its search one, the front redrawn
    from the confirmed medians (the search figure, marked, where a point has none)."""
    by_label = {e.label: e for e in front}
    for p in summary["points"]:
        e = by_label.get(p["label"])
        conf = confirmed_figure(e) if e is not None else None
        p["confirmed"] = conf
        p["front_tok_s"] = conf["decode_tok_s"] if conf else p["decode_tok_s"]
        p["front_figure"] = "confirmed" if conf else "search"
        p["unconfirmed"] = None if conf else why_unconfirmed(e, p, stopped)
        base = by_label.get(same_place.get(p["label"], ""))
        base_conf = confirmed_figure(base) if base is not None else None
        p["lossless_same_placement_confirmed"] = base_conf
        p["vs_lossless_same_placement_confirmed"] = (round(conf["decode_tok_s"] / base_conf["decode_tok_s"], 4)
                                                     if conf and base_conf and base_conf["decode_tok_s"] else None)
    lossy.mark_front(summary["points"])
    summary["points"].sort(key=lambda p: (p["kl_mean"], -lossy.front_speed(p)))
    summary["front_confirmation"] = {
        "rounds": rounds, "rounds_run": done, "stopped": stopped,
        "entries": [{"label": e.label, "config": e.config.to_dict(), "confirmed": confirmed_figure(e),
                     "statuses": [r.status for r in e.runs]} for e in front]}
    return summary


def confirm_front(summary: dict, trials, rounds: int, measure: Callable[[EngineConfig], TrialResult],
                  room_for_round: Callable[[int], bool], log) -> dict:
    """lossy.front_summary's summary, re-measured in `rounds` interleaved rounds (0: unchanged)."""
    if rounds <= 0 or not summary["points"]:
        return summary
    front, same_place = entries(summary["points"], trials)
    log(f"front rounds: re-measuring {len(front)} configs ({'; '.join(e.label for e in front)}) in up to "
        f"{rounds} interleaved rounds")
    done, stopped = run_rounds(front, rounds, measure, room_for_round, log)
    return apply(summary, front, same_place, rounds, done, stopped)
