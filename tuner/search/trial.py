"""Run one engine config as a trial: `colibri bench` in a subprocess, in a memory cgroup.

The subprocess is what makes a trial honest and safe: its peak memory is its own (not the
tuner's), a memory cgroup limited to the budget charges page cache too, and an OOM kill or a
hang ends the trial, not the study. The bench process writes its outcome as a record
(`--outcome FILE`: ok with the bench JSON, over_budget, bad_config, crashed with the exception);
what it cannot write — timeout, oom_killed (the cgroup's own OOM counter), killed by another
signal — comes from here (tuner/search/outcome.py). Nothing is read from its stderr text.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from engine.base.config import EngineConfig
from tuner.search.outcome import Outcome, classify, read_outcome
from tuner.results.result import TrialResult
from tuner.sandbox import run_limited


def bench_argv(model_dir, config_path: str, tokens: int, repeats: int, cold: bool, prompt_tokens: int,
               seed: int, extra: list[str] | None = None, outcome_path: str | None = None) -> list[str]:
    return [sys.executable, "-m", "tuner.cli", "bench", "--model", str(model_dir), "--config", config_path,
            "--tokens", str(tokens), "--repeats", str(repeats), "--cold" if cold else "--warm",
            "--prompt-tokens", str(prompt_tokens), "--seed", str(seed), "--json",
            *(["--outcome", outcome_path] if outcome_path else []), *(extra or [])]


THIS_TREE = Path(__file__).resolve().parents[2]


def cli_tree(cwd: str, pythonpath: str) -> Path | None:
    """The source tree whose `tuner.cli` a `python -m tuner.cli` child imports: `-m` puts the
    cwd first on sys.path, then PYTHONPATH's entries. None: an installed package's."""
    for entry in [cwd, *filter(None, pythonpath.split(os.pathsep))]:
        if (Path(entry) / "tuner" / "cli.py").is_file():
            return Path(entry).resolve()
    return None


@functools.lru_cache(maxsize=None)
def bench_takes_outcome(cwd: str, pythonpath: str) -> bool:
    """Whether the child's `colibri bench` has --outcome. This tree's has (and so has the
    installed package the child falls back to when no tree is on its path); another tree's is
    asked once through its `bench --help` (argparse lists every flag there)."""
    tree = cli_tree(cwd, pythonpath)
    if tree is None or tree == THIS_TREE:
        return True
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run([sys.executable, "-m", "tuner.cli", "bench", "--help"], capture_output=True, text=True,
                         cwd=cwd, env=env, timeout=300)
    return "--outcome" in out.stdout


def legacy_record(run) -> Outcome | None:
    """The outcome of a bench without --outcome: its JSON on stdout when it exited 0; for an
    exit status, its last stderr line (such a tree has nothing else to say why)."""
    if run.returncode == 0:
        try:
            return Outcome("ok", metrics=json.loads(run.stdout))
        except ValueError:
            return Outcome("crashed", error="bench exited 0 but printed no JSON result")
    if run.returncode > 0:
        last = (run.stderr.strip().splitlines() or [f"exit status {run.returncode}"])[-1]
        return Outcome("crashed", error=last[:500])
    return None  # a signal: classify() names it


def run_trial(model_dir, config: EngineConfig, *, tokens: int = 16, repeats: int = 3, cold: bool = True,
              prompt_tokens: int = 16, seed: int = 0, limit_bytes: int | None = None,
              timeout: float | None = 600, extra_args: list[str] | None = None) -> TrialResult:
    """Run `colibri bench` for `config` in a child process limited to `limit_bytes` (cgroup)."""
    with tempfile.TemporaryDirectory(prefix="colibri-trial-") as tmp:
        cfg_path, outcome_path = str(Path(tmp) / "config.toml"), str(Path(tmp) / "outcome.json")
        config.save(cfg_path)
        takes_outcome = bench_takes_outcome(os.getcwd(), os.environ.get("PYTHONPATH", ""))
        argv = bench_argv(model_dir, cfg_path, tokens, repeats, cold, prompt_tokens, seed, extra_args,
                          outcome_path if takes_outcome else None)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        run = run_limited(argv, limit_bytes, timeout=timeout, env=env)
        record = read_outcome(outcome_path) if takes_outcome else legacy_record(run)
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
