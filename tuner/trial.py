"""Run one engine config as a trial: `colibri bench` in a subprocess, in a memory cgroup.

The subprocess is what makes a trial honest and safe: its peak memory is its own (not the
tuner's), a memory cgroup limited to the budget charges page cache too, and an OOM kill or a
hang ends the trial, not the study. Every outcome becomes a TrialResult: completed ones carry
the bench JSON; failed ones say why (oom, timeout, crash) with a graded violation the sampler
can learn from.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from engine.config import EngineConfig
from tuner.result import TrialResult
from tuner.sandbox import run_limited


def bench_argv(model_dir, config_path: str, tokens: int, repeats: int, cold: bool, prompt_tokens: int,
               seed: int, extra: list[str] | None = None) -> list[str]:
    return [sys.executable, "-m", "tuner.cli", "bench", "--model", str(model_dir), "--config", config_path,
            "--tokens", str(tokens), "--repeats", str(repeats), "--cold" if cold else "--warm",
            "--prompt-tokens", str(prompt_tokens), "--seed", str(seed), "--json", *(extra or [])]


def run_trial(model_dir, config: EngineConfig, *, tokens: int = 16, repeats: int = 3, cold: bool = True,
              prompt_tokens: int = 16, seed: int = 0, limit_bytes: int | None = None,
              timeout: float | None = 600, extra_args: list[str] | None = None) -> TrialResult:
    """Run `colibri bench` for `config` in a child process limited to `limit_bytes` (cgroup)."""
    fd, cfg_path = tempfile.mkstemp(prefix="colibri-trial-", suffix=".toml")
    os.close(fd)
    try:
        config.save(cfg_path)
        argv = bench_argv(model_dir, cfg_path, tokens, repeats, cold, prompt_tokens, seed, extra_args)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        run = run_limited(argv, limit_bytes, timeout=timeout, env=env)
    finally:
        os.unlink(cfg_path)
    base = dict(cgroup_limited=run.limited, cgroup_limit_bytes=run.limit_bytes, cgroup_peak_bytes=run.peak_bytes,
                cgroup_reason=run.reason, wall_seconds=run.wall_seconds)
    if run.timed_out:
        return TrialResult("timeout", error=f"timed out after {timeout:.0f} s", **base)
    if run.oom_killed or run.returncode in (-9, 137):
        return TrialResult("oom", error="killed by the out-of-memory killer (memory budget exceeded)", **base)
    if run.returncode != 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return TrialResult("crash", error=last[:500], **base)
    try:
        metrics = json.loads(run.stdout)
    except json.JSONDecodeError:
        return TrialResult("crash", error="bench printed no JSON result", **base)
    metrics["cgroup"] = {"limited": run.limited, "limit_bytes": run.limit_bytes, "peak_bytes": run.peak_bytes,
                         "reason": run.reason}
    return TrialResult("ok", metrics=metrics, **base)
