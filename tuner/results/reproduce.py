"""The `colibri bench` command that measures a tune's headline figure again, and what it must match.

    reproduce_command(result, run_dir / "recommended.toml")     # recommended.toml, report.md
    entry_command(entry)                                         # a profile's best_configs entry

A figure a user cannot re-measure is a claim. The command carries everything the figure
depended on: the model, the config, the workload (the steady workload from its flags alone:
prompts, lengths, seed, sampler; a user's workload as the run directory's workload.jsonl), the
decode length, repeats, cold or warm, and the memory cgroup the trials ran in. What the re-run
must give (tests/test_tune_workload.py runs it): the same prompts (workload sha256), the same
output tokens and the same bytes read per token; only the timing moves.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from statistics import median

from engine.api import size_label

WORKLOAD_FILE = "workload.jsonl"  # tuner/search/workload.py writes it for tune --prompts
TRACE_FILE = "trace.jsonl"  # ... and this for tune --objective serve --trace


def ids_digest(ids: list[int] | None) -> str | None:
    """'sha256:<16 hex>' of output token ids (what a re-run must generate again)."""
    if ids is None:
        return None
    return "sha256:" + hashlib.sha256(json.dumps(list(ids), separators=(",", ":")).encode()).hexdigest()[:16]


def workload_args(workload: dict | None, run_dir: str | None) -> list[str]:
    """The bench flags of a result's workload (a WorkloadInfo as a dict; None: the fixed prompt)."""
    w = workload or {}
    if w.get("kind") == "steady":
        return ["--steady", str(w["requests"]), "--temperature", f"{w['temperature']:g}", "--top-p", f"{w['top_p']:g}"]
    if w.get("kind") == "prompts":
        return ["--workload", str(Path(run_dir) / WORKLOAD_FILE) if run_dir else WORKLOAD_FILE]
    if w.get("kind") == "trace":  # the trace replayed against the same SLOs (greedy, as the trials)
        return ["--trace", str(Path(run_dir) / TRACE_FILE) if run_dir else TRACE_FILE,
                *(["--slo-ttft", repr(float(w["slo_ttft_s"]))] if w.get("slo_ttft_s") is not None else []),
                *(["--slo-tpot", repr(float(w["slo_tpot_s"]))] if w.get("slo_tpot_s") is not None else [])]
    return []


def bench_argv(model: str, config: str, conditions: dict, workload: dict | None, run_dir: str | None,
               cgroup_limit: int | None) -> list[str]:
    argv = ["colibri", "bench", "--model", model, "--config", config, *workload_args(workload, run_dir),
            "--tokens", str(conditions["tokens"]), "--prompt-tokens", str(conditions["prompt_tokens"]),
            "--seed", str(conditions["seed"]), "--repeats", str(conditions["repeats"]),
            "--cold" if conditions["cold"] else "--warm"]
    if cgroup_limit:
        argv += ["--cgroup-limit", size_label(cgroup_limit)]
    return argv


def reproduce_command(r, config_path: str | Path) -> str:
    """The command for a TuneResult's recommended config saved at config_path."""
    cond = r.conditions
    limit = cond.memory_limit.cgroup_limit_bytes if cond.memory_limit.cgroup else None
    w = r.workload.__dict__ if r.workload is not None else None
    return shlex.join(bench_argv(r.model.dir, str(config_path), cond.__dict__, w, str(Path(config_path).parent),
                                 limit))


def entry_command(entry: dict) -> str:
    """The command for a profile's best_configs entry (no paths: the model by name, and CONFIG.toml
    standing for the entry's `config` object saved as an engine TOML by the reader)."""
    cond = entry.get("conditions") or {}
    if not all(k in cond for k in ("tokens", "prompt_tokens", "repeats", "cold")):
        return ""
    cond = {"seed": 0, **cond}
    limit = entry.get("ram_budget") if cond.get("cgroup_enforced") else None
    return shlex.join(bench_argv(entry["model"], "CONFIG.toml", cond, entry.get("workload"), None, limit))


def measured(runs: list, output_ids: list | None) -> dict:
    """What a headline figure measured (Reproduce's fields), from its confirmation runs (or its
    search trial's figures as one run)."""
    ok = [x for x in runs if getattr(x, "status", "ok") == "ok"]
    per_token = [x.bytes_read_per_token for x in ok if x.bytes_read_per_token is not None]
    return {"output_sha256": ids_digest(output_ids), "generated_tokens": len(output_ids) if output_ids else None,
            "bytes_read_per_token": median(per_token) if per_token else None}
