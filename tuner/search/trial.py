"""Run one engine config as a trial: `colibri bench` in a subprocess, in a memory cgroup.

The subprocess is what makes a trial honest and safe: its peak memory is its own (not the
tuner's), a memory cgroup limited to the budget charges page cache too, and an OOM kill or a
hang ends the trial, not the study. The bench process writes its outcome as a record
(`--outcome FILE`: ok with the bench JSON, over_budget, bad_config, crashed with the exception);
what it cannot write — timeout, oom_killed (the cgroup's own OOM counter), killed by another
signal — comes from here (tuner/search/outcome.py). Nothing is read from its stderr text.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from engine.api import EngineConfig
from tuner.search.outcome import classify, read_outcome
from tuner.results.result import TrialResult
from tuner.sandbox import run_limited


def bench_argv(model_dir, config_path: str, tokens: int, repeats: int, cold: bool, prompt_tokens: int,
               seed: int, extra: list[str] | None = None, outcome_path: str | None = None) -> list[str]:
    return [sys.executable, "-m", "colibri.cli", "bench", "--model", str(model_dir), "--config", config_path,
            "--tokens", str(tokens), "--repeats", str(repeats), "--cold" if cold else "--warm",
            "--prompt-tokens", str(prompt_tokens), "--seed", str(seed), "--json",
            *(["--outcome", outcome_path] if outcome_path else []), *(extra or [])]


def steady_args(n: int, temperature: float, top_p: float) -> list[str]:
    """`bench`'s arguments for the steady-decoding workload of n prompts (engine/run/steady.py)."""
    return ["--steady", str(n), "--temperature", repr(float(temperature)), "--top-p", repr(float(top_p))]


def trace_args(path: str, slo_ttft: float | None, slo_tpot: float | None, temperature: float = 0.0,
               top_p: float = 1.0) -> list[str]:
    """`bench`'s arguments for replaying a request trace (engine/run/trace_replay.py) against the SLOs."""
    out = ["--trace", str(path)]
    out += ["--slo-ttft", repr(float(slo_ttft))] if slo_ttft is not None else []
    out += ["--slo-tpot", repr(float(slo_tpot))] if slo_tpot is not None else []
    if temperature > 0:
        out += ["--temperature", repr(float(temperature)), "--top-p", repr(float(top_p))]
    return out


def run_trial(model_dir, config: EngineConfig, *, tokens: int = 16, repeats: int = 3, cold: bool = True,
              prompt_tokens: int = 16, seed: int = 0, limit_bytes: int | None = None,
              timeout: float | None = 600, extra_args: list[str] | None = None) -> TrialResult:
    """Run `colibri bench` for `config` in a child process limited to `limit_bytes` (cgroup)."""
    with tempfile.TemporaryDirectory(prefix="colibri-trial-") as tmp:
        cfg_path, outcome_path = str(Path(tmp) / "config.toml"), str(Path(tmp) / "outcome.json")
        config.save(cfg_path)
        argv = bench_argv(model_dir, cfg_path, tokens, repeats, cold, prompt_tokens, seed, extra_args, outcome_path)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        run = run_limited(argv, limit_bytes, timeout=timeout, env=env)
        record = read_outcome(outcome_path)
        outcome = classify(run.returncode, timed_out=run.timed_out, oom_killed=run.oom_killed,
                           record=record, timeout=timeout, limit_bytes=run.limit_bytes)
    metrics = outcome.metrics
    if outcome.kind == "ok":
        metrics["cgroup"] = {"limited": run.limited, "limit_bytes": run.limit_bytes, "peak_bytes": run.peak_bytes,
                             "reason": run.reason}
    return TrialResult(outcome.kind, metrics=metrics if outcome.kind == "ok" else {}, error=outcome.error,
                       exception=outcome.exception, signal=outcome.signal, cgroup_limited=run.limited,
                       cgroup_limit_bytes=run.limit_bytes, cgroup_peak_bytes=run.peak_bytes,
                       cgroup_reason=run.reason, wall_seconds=run.wall_seconds)
