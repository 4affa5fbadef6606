"""What a tune run measures before its search: the probe, and the calibration run.

The calibration run is the baseline once, on a different prompt (seed + 1), before the search;
with `tune --prompts`, on the user's own prompts (routing, and so what `pinned` should pin,
depends on the text).

Its routing histogram feeds the `pinned` policy without being an oracle of the measured prompt,
and its memory plan gives the trial process's real overhead for the pre-check. The record is
cached in the run directory (calibration.json), keyed by model and budget, so a resumed run
does not repeat it.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.api import Progress, atomic_write_text, format_size
from tuner.probe import load_profile, run_probe, save_profile
from tuner.results.printers import fmt
from tuner.search.budget import FIRST_TRIAL_TIMEOUT_S, longer_decode
from tuner.search.trial import run_trial


def calibrate(*, out: Path, model_dir: Path, budget: int, limit_bytes: int, space, has_experts: bool,
              tokens: int, prompt_tokens: int, cold: bool, seed: int, trial_timeout: float | None,
              record_wall, log, workload_args: list[str] | None = None, workload: str | None = None,
              workload_label: str | None = None) -> dict:
    """The calibration record: status, overhead_bytes, routing_histogram path, cgroup facts.

    workload_args / workload: the user's prompts (tune --prompts) as bench arguments and their
    digest: the routing histogram is then recorded from those prompts."""
    path = out / "calibration.json"
    if path.exists():
        try:
            record = json.loads(path.read_text())
            if (record.get("model_dir") == str(model_dir) and record.get("budget") == budget
                    and record.get("workload") == workload):
                if record.get("wall_seconds"):
                    record_wall(record["wall_seconds"])
                return record
        except (OSError, json.JSONDecodeError):
            pass
    config = space.baseline()
    if not space.precheck(config)[0]:
        config = space.smallest()
    routing = (out / "routing.json").resolve() if has_experts else None
    extra = (["--record-routing", str(routing)] if routing else []) + list(workload_args or [])
    log(f"calibration: baseline config once on {workload_label or ('your prompts' if workload else 'another prompt')} "
        f"({'recording routing, ' if routing else ''}"
        f"budget {format_size(budget)}) ...")
    res = run_trial(model_dir, config, tokens=tokens, repeats=1, cold=cold, prompt_tokens=prompt_tokens,
                    seed=seed + 1, limit_bytes=limit_bytes, timeout=trial_timeout or FIRST_TRIAL_TIMEOUT_S,
                    extra_args=extra)
    record_wall(res.wall_seconds)
    record = {"model_dir": str(model_dir), "budget": budget, "workload": workload, "status": res.status,
              "error": res.error,
              "wall_seconds": res.wall_seconds, "config": config.to_dict(),
              "cgroup_limited": res.cgroup_limited, "cgroup_reason": res.cgroup_reason}
    if res.ok:
        record["overhead_bytes"] = (res.metrics.get("plan") or {}).get("overhead_bytes")
        record["decode_tok_s"] = res.metrics.get("decode_tok_s")
        if routing and routing.exists():
            record["routing_histogram"] = str(routing)
        log(f"calibration: {fmt(res.metrics.get('decode_tok_s'))} tok/s in {res.wall_seconds:.0f} s; "
            f"trial process overhead {format_size(record['overhead_bytes'])}"
            + ("" if res.cgroup_limited else f"; no memory cgroup ({res.cgroup_reason})"))
        suggest = None if workload else longer_decode(tokens, record["decode_tok_s"])
        if suggest:
            record["short_decode"] = {"tokens": tokens, "suggested_tokens": suggest}
            log(f"calibration: warning: {tokens} decode tokens take {1000 * tokens / record['decode_tok_s']:.0f} ms "
                f"per repeat here, too short for a stable figure (one stall moves it by tens of percent); "
                f"consider --tokens {suggest}")
    else:
        log(f"calibration: the baseline config did not run ({res.status}: {res.error}); "
            f"searching without the pinned policy")
    atomic_write_text(path, json.dumps(record, indent=2) + "\n")
    return record


def probe_profile(out: Path, saved: str | None, model_dir: Path, log):
    """(profile, source): the saved probe if given, else the run's cached one, else a quick probe."""
    cached = out / "profile.json"
    if saved:
        profile = load_profile(saved)
        if not cached.exists():
            save_profile(profile, cached)
        return profile, str(saved)
    if cached.exists():
        return load_profile(cached), str(cached)
    log(f"probing the disk under {model_dir} and this machine (quick probe) ...")
    with Progress(desc="probe", unit="step") as bar:
        profile = run_probe(model_dir, quick=True, progress=bar.step)
    log(f"probe done in {profile.probe.duration.value:.0f} s ({profile.storage.method})")
    save_profile(profile, cached)
    return profile, str(cached)
