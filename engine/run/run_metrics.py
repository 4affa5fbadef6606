"""The result every run and bench produces (JSON, schema id "colibri.metrics/1"), and the
helpers that fill it: a run's figures (run_metrics), and a bench's over its repeats (bench_result,
with workload_metrics and draft_medians; engine/run/bench.py runs the repeats).

The tuner reads it into its typed schema (tuner/results/trial_record.py: RunFigures) and prints it through
tuner/results/printers.py, so a figure means the same thing wherever it is shown.
"""

from __future__ import annotations

import platform
import resource
import statistics
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from engine import __version__
from engine.run.spec_stats import draft_figures

SCHEMA = "colibri.metrics/1"
# The headline figures of a run, each a top-level key of the result; a bench also gives each one's
# spread over its repeats under "summary" (and the median at top level).
SUMMARY_KEYS = ("decode_tok_s", "ttft_s", "request_s", "prefill_tok_s", "token_latency_p50_ms",
                "token_latency_p99_ms", "read_gbps", "io_stall_fraction", "lookahead_recall")


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (VmHWM) since it exec'd.

    Not ru_maxrss: that one survives fork + exec, so a trial started by a 2 GiB parent (a tuner,
    a test runner) reported a peak of at least 2 GiB whatever it used itself.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rss_file_bytes() -> int | None:
    """Resident pages backed by files (torch's shared libraries, mmap'd weights): shared,
    clean and reclaimable, so a memory budget does not own them the way it owns anonymous
    memory. Peak RSS minus this is the process's own high-water mark, near enough."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@lru_cache(maxsize=1)
def git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        if out.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def geometry_of(engine) -> dict:
    a = engine.args
    return {
        "model_type": a.model_type, "layers": a.num_layers, "hidden_size": a.hidden_size,
        "experts": a.num_experts, "top_k": a.top_k, "moe_intermediate_size": a.moe_intermediate_size,
        "moe_layers": sum(a.moe_layer_flags), "vocab_size": a.vocab_size,
        "total_bytes_on_disk": engine.checkpoint.nbytes(),
        "expert_bytes_on_disk": engine.layout.expert_nbytes if engine.layout is not None else 0,
    }


def run_metrics(engine, gen, io_before: dict | None = None) -> dict:
    """Metrics of one generation: timings from the generation, I/O from the expert store."""
    decode_s = sum(gen.token_seconds)
    io = engine.io_stats()
    n_decode = len(gen.token_seconds)
    m = {
        "schema": SCHEMA,
        "prompt_tokens": len(gen.prompt_ids),
        "generated_tokens": len(gen.output_ids),
        "ttft_s": gen.ttft_seconds,
        # End to end: the prompt's prefill and first token, then every decode step (what a
        # request of this prompt and output length costs its user).
        "request_s": gen.ttft_seconds + decode_s if gen.output_ids else None,
        # The tokens computed: a reused prefix (engine/run/prefix_cache.py) is not prefilled.
        "prefill_tok_s": ((len(gen.prompt_ids) - gen.cached_tokens) / gen.prefill_seconds
                          if gen.prefill_seconds else None),
        "cached_tokens": gen.cached_tokens,
        "decode_tok_s": n_decode / decode_s if decode_s else None,
        "token_latency_p50_ms": _ms(percentile(gen.token_seconds, 0.5)),
        "token_latency_p99_ms": _ms(percentile(gen.token_seconds, 0.99)),
        "peak_rss_bytes": peak_rss_bytes(),
        "rss_file_bytes": rss_file_bytes(),
        **io,
    }
    draft = engine.draft_stats() if hasattr(engine, "draft_stats") else {}
    if draft:  # speculative decoding (engine/run/speculative.py): its counters and their figures
        m["draft"] = draft
        m.update(draft_figures(draft))
    return m


def _ms(seconds):
    return None if seconds is None else seconds * 1000.0


def envelope(engine, model_dir: str) -> dict:
    """Conditions every result carries: config, plan, geometry, versions, machine."""
    import torch
    return {
        "schema": SCHEMA,
        "engine_version": __version__,
        "git_commit": git_commit(),
        "model": str(model_dir),
        "geometry": geometry_of(engine),
        "config": engine.config.to_dict(),
        "plan": engine.plan.to_dict(),
        "compute_dtype": str(engine.dtype).replace("torch.", ""),
        "quant": engine.quant.label if engine.quant is not None else "none",
        "quant_scope": engine.quant.scope if engine.quant is not None else None,
        "kernel": engine.kernel,
        # The route a decode token takes (engine/arch/decode_plan.py): native_step, native_layers, reference.
        "decode_route": engine.decode_plan.route,
        # Tensors in the files the engine does not load (MTP layers, engine/format/mtp.py).
        "skipped": getattr(engine, "skipped", None),
        "threads": engine.threads,
        "io_mode_effective": engine.io_stats().get("io_mode_effective", "resident"),
        # Which reader really ran: io_backend "auto" (and mmap mode) may not be what was asked.
        "io_backend_effective": engine.io_stats().get("io_backend_effective", "resident"),
        "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                    "torch": torch.__version__},
    }


def spread(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "stdev": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals),
            "stdev": statistics.stdev(vals) if len(vals) > 1 else 0.0, "n": len(vals)}


# --- a bench's result over its repeats (engine/run/bench.py) ---------------------------------


def bench_result(engine, model_dir, runs: list[dict], keys, t_start: float, record_routing: str | None,
                 bytes_per_token, consistent: str = "output_ids", **conditions) -> dict:
    """The bench result every mode of engine/run/bench.py builds: the engine's envelope, the mode's
    conditions, the runs and the median of each of `keys` at top level (every printer finds the headline figures there),
    whether the repeats gave the same tokens (`consistent`: the runs' field compared), bytes read per
    generated token (bytes_per_token(run), median), the process's peaks, and the routing histogram
    when one was recorded."""
    result = envelope(engine, str(model_dir))
    result.update({"kind": "bench", **conditions, "load_seconds": engine.load_seconds,
                   "summary": {k: spread([r.get(k) for r in runs]) for k in keys}, "runs": runs,
                   "output_ids": runs[0]["output_ids"] if runs else [],
                   "tokens_consistent": all(r[consistent] == runs[0][consistent] for r in runs),
                   "peak_rss_bytes": peak_rss_bytes(), "rss_file_bytes": rss_file_bytes(),
                   "wall_seconds": time.perf_counter() - t_start})
    for k in keys:
        result[k] = result["summary"][k]["median"]
    result["bytes_read_per_token"] = spread([bytes_per_token(r) for r in runs])["median"]
    result["hit_rate"] = runs[-1].get("hit_rate") if runs else None
    if record_routing:
        engine.save_routing(record_routing)
        result["routing_histogram"] = record_routing
    return result


def workload_metrics(engine, gens: list) -> dict:
    """A workload repeat's figures (bench --prompts / --workload): over every request, in order."""
    # R requests; per request: prefill + first token (ttft), then its decode steps
    per = [run_metrics(engine, g) for g in gens]  # I/O figures: the engine's counters, whole repeat
    steps = [s for g in gens for s in g.token_seconds]
    decode_s = sum(steps)
    m = dict(per[-1])  # the I/O counters and memory figures as they stand after the last request
    m.update({
        "requests": len(gens),
        "prompt_tokens": sum(len(g.prompt_ids) for g in gens),
        "generated_tokens": sum(len(g.output_ids) for g in gens),
        "ttft_s": statistics.fmean(g.ttft_seconds for g in gens),
        "request_s": statistics.fmean(x["request_s"] for x in per if x["request_s"] is not None),
        # Computed prompt tokens per prefill second: a reused prefix (a conversation's history) is not computed.
        "prefill_tok_s": (sum(len(g.prompt_ids) - g.cached_tokens for g in gens)
                          / max(sum(g.prefill_seconds for g in gens), 1e-12)),
        "cached_tokens": sum(g.cached_tokens for g in gens),  # the prefix cache's reuse over the workload
        "decode_tok_s": len(steps) / decode_s if decode_s else None,
        "token_latency_p50_ms": percentile(steps, 0.5) * 1000.0 if steps else None,
        "token_latency_p99_ms": percentile(steps, 0.99) * 1000.0 if steps else None,
        "output_ids": [t for g in gens for t in g.output_ids],
    })
    return m


def draft_medians(runs: list[dict]) -> dict:
    """Speculative decoding's figures over the repeats (medians) and the last repeat's counters."""
    out = {}
    for key in draft_figures(runs[-1].get("draft") if runs else {}):
        values = [r.get(key) for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    if out:
        out["draft"] = runs[-1]["draft"]
    return out
