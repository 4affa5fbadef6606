"""What `GET /metrics` shows, in Prometheus' text exposition format (version 0.0.4).

Counters and histograms live here and are updated by the worker thread and the request
handlers under one lock; the store's own counters (bytes read, hit rate per tier) and the
process's memory are read when scraped, so they are never stale.
"""

from __future__ import annotations

import bisect
import math
import threading
from pathlib import Path

import psutil

# Seconds. TTFT on a streamed 700B model is seconds to minutes; a resident token is milliseconds.
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
REQUEST_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


# (prefix_stats key, metric, kind, help)
PREFIX_METRICS = (
    ("lookups", "colibri_prefix_lookups_total", "counter", "Prompts looked up in the prefix cache."),
    ("hits", "colibri_prefix_hits_total", "counter", "Prompts that reused a cached prefix."),
    ("cached_tokens", "colibri_prefix_cached_tokens_total", "counter", "Prompt tokens reused, not computed."),
    ("restored_bytes", "colibri_kv_restored_bytes_total", "counter",
     "KV bytes copied back into the cache from RAM blocks or the SSD."),
    ("disk_read_bytes", "colibri_kv_disk_read_bytes_total", "counter", "KV file bytes read from the SSD."),
    ("spilled_bytes", "colibri_kv_spilled_bytes_total", "counter", "KV bytes written to the SSD."),
    ("ram_bytes", "colibri_prefix_cache_bytes", "gauge", "KV bytes the RAM prefix cache holds."),
    ("disk_bytes", "colibri_kv_disk_bytes", "gauge", "KV bytes the SSD directory holds."),
)


# (draft_stats key, metric, kind, help): speculative decoding (engine/run/speculative.py), when on
DRAFT_METRICS = (
    ("steps", "colibri_draft_steps_total", "counter", "Decode steps taken with drafting on (plain and verify)."),
    ("verify_steps", "colibri_draft_verify_steps_total", "counter", "Decode steps that verified drafted tokens."),
    ("drafted", "colibri_drafted_tokens_total", "counter", "Drafted tokens verified."),
    ("accepted", "colibri_draft_accepted_tokens_total", "counter", "Drafted tokens accepted."),
    ("emitted", "colibri_draft_step_tokens_total", "counter", "Tokens the decode steps produced."),
    ("bytes_read", "colibri_draft_bytes_read_total", "counter", "Bytes the store read during those steps."),
    ("tokens_per_step", "colibri_draft_tokens_per_step", "gauge", "Tokens per decode step since start."),
    ("bytes_per_token", "colibri_draft_bytes_per_token", "gauge", "Bytes read per token produced since start."),
)


class Histogram:
    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f'{name}_bucket{{le="{bound:g}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


def cgroup_memory_bytes() -> int | None:
    """This process's memory cgroup usage (v2 memory.current or v1 memory.usage_in_bytes), if any."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        candidates = []
        if controllers == "":
            candidates.append(Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.current")
        elif "memory" in controllers.split(","):
            candidates.append(Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.usage_in_bytes")
        for c in candidates:
            try:
                return int(c.read_text())
            except (OSError, ValueError):
                continue
    return None


class ServerMetrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cancelled = 0
        self.rejected_full = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.token_latency = Histogram(TOKEN_BUCKETS)
        self.request_seconds = Histogram(REQUEST_BUCKETS)

    def count_request(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def record_generation(self, prompt_tokens: int, generated: int, ttft: float, token_seconds, seconds: float,
                          cancelled: bool) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.generated_tokens += generated
            self.cancelled += int(cancelled)
            if generated:
                self.ttft.observe(ttft)
            for s in token_seconds:
                self.token_latency.observe(s)
            self.request_seconds.observe(seconds)

    def render(self, queue_length: int, busy: bool, store_stats: dict, prefix_stats: dict | None = None,
               draft_stats: dict | None = None) -> str:
        out: list[str] = []

        def metric(name, kind, help_, lines):
            out.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines])

        with self.lock:
            metric("colibri_requests_total", "counter", "HTTP requests by route and status.",
                   [f'colibri_requests_total{{route="{r}",status="{s}"}} {n}'
                    for (r, s), n in sorted(self.requests.items())] or ["colibri_requests_total 0"])
            metric("colibri_prompt_tokens_total", "counter", "Prompt tokens prefilled.",
                   [f"colibri_prompt_tokens_total {self.prompt_tokens}"])
            metric("colibri_generated_tokens_total", "counter", "Tokens generated.",
                   [f"colibri_generated_tokens_total {self.generated_tokens}"])
            metric("colibri_cancelled_total", "counter", "Generations stopped because the client went away.",
                   [f"colibri_cancelled_total {self.cancelled}"])
            metric("colibri_rejected_queue_full_total", "counter", "Requests answered 503 (queue full).",
                   [f"colibri_rejected_queue_full_total {self.rejected_full}"])
            metric("colibri_ttft_seconds", "histogram", "Time to first token (prefill + first sample).",
                   self.ttft.lines("colibri_ttft_seconds"))
            metric("colibri_decode_token_seconds", "histogram", "Time of each decode step after the first token.",
                   self.token_latency.lines("colibri_decode_token_seconds"))
            metric("colibri_request_seconds", "histogram", "Time a generation ran, end to end.",
                   self.request_seconds.lines("colibri_request_seconds"))
        metric("colibri_queue_length", "gauge", "Requests waiting for the engine.", [f"colibri_queue_length {queue_length}"])
        metric("colibri_busy", "gauge", "1 while a generation runs.", [f"colibri_busy {int(busy)}"])
        hit = store_stats.get("hit_rate") or {}
        metric("colibri_expert_hit_rate", "gauge", "Share of expert lookups served by each cache tier since start.",
               [f'colibri_expert_hit_rate{{tier="{t}"}} {v:.6f}' for t, v in sorted(hit.items()) if v is not None]
               or ["colibri_expert_hit_rate 0"])
        # Counts beside the rates, so a scraper gets the hit rate over any window (rate() of the
        # two counters), not only since start; the store keeps hits as rates of its lookups.
        lookups = store_stats.get("expert_lookups")
        if isinstance(lookups, int):
            metric("colibri_expert_lookups_total", "counter", "Expert lookups since start.",
                   [f"colibri_expert_lookups_total {lookups}"])
            metric("colibri_expert_hits_total", "counter", "Expert lookups served by each cache tier since start.",
                   [f'colibri_expert_hits_total{{tier="{t}"}} {round(v * lookups)}'
                    for t, v in sorted(hit.items()) if v is not None] or ["colibri_expert_hits_total 0"])
        for key, help_ in (("bytes_read", "Bytes read from disk by the expert store since start."),
                           ("read_requests", "Read requests issued since start."),
                           ("demand_reads", "Expert reads the compute had to wait for."),
                           ("prefetch_reads", "Expert reads started by router lookahead.")):
            value = store_stats.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                metric(f"colibri_store_{key}", "counter", help_, [f"colibri_store_{key} {value}"])
        # Prefix reuse (engine/run/prefix_cache.py), when on: what it saved and what it moved.
        for key, name, kind, help_ in PREFIX_METRICS:
            value = (prefix_stats or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metric(name, kind, help_, [f"{name} {value}"])
        # Speculative decoding, when on: its counters and the gate's decisions by reason.
        for key, name, kind, help_ in DRAFT_METRICS:
            value = (draft_stats or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metric(name, kind, help_, [f"{name} {value}"])
        decisions = (draft_stats or {}).get("decisions")
        if decisions:
            metric("colibri_draft_decisions_total", "counter", "Decode steps by the gate's decision (why this depth).",
                   [f'colibri_draft_decisions_total{{reason="{r}"}} {n}' for r, n in sorted(decisions.items())])
        proc = psutil.Process()
        metric("colibri_process_rss_bytes", "gauge", "Resident set size of the server process.",
               [f"colibri_process_rss_bytes {proc.memory_info().rss}"])
        cg = cgroup_memory_bytes()
        if cg is not None:
            metric("colibri_cgroup_memory_bytes", "gauge", "Memory charged to the server's cgroup (page cache included).",
                   [f"colibri_cgroup_memory_bytes {cg}"])
        return "\n".join(out) + "\n"
