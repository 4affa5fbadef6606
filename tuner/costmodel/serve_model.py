"""A trace's goodput, predicted: serve's scheduler simulated over the trace with the cost model's step times.

    goodput = predict_goodput(geometry, quant, config, hw, routing, trace, slo_ttft, slo_tpot, factors)

Rough by construction, and used as evidence only (a tune --objective serve trial records it beside
the measured goodput; no warm start is seeded from it, tuner/search/warm_start.py): the step times
are predict_batch's (tuner/costmodel/batch_model.py: a decode step of b rows reads the union of their
experts once, expected_union, on a warm steady cache) and a prompt's prefill is its share of the
predicted TTFT of the trace's median prompt (tokens x that TTFT / its tokens).

The simulation follows engine/run/batch.py's order within a step: requests that have arrived join
the FIFO line; the head is admitted while the pool has a KV cache free for each of its n sequences
(max_batch caches); one decode step over every sequence past its first token; one prefill pass:
the oldest prefilling prompt's next group joined by the next groups of the prompts after it while
their total fits one group, at most stall tokens (the scheduler's stall_tokens, one sub-chunk) while
any sequence is decoding (a prompt's last group gives each of its sequences its first token); a
sequence leaves after max_tokens. A request of n above max_batch is refused (serve's 400).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.api import PREFILL_CHUNK, EngineConfig

from tuner.costmodel.batch_model import predict_batch
from tuner.costmodel.predict import Factors, RunConditions, predict


@dataclass
class SimRequest:
    """One request of the trace: arrival (s), prompt tokens, output tokens, sequences."""

    at: float
    prompt: int
    max_tokens: int
    n: int = 1
    admitted: float | None = None
    firsts: list[float] = field(default_factory=list)
    lasts: list[float] = field(default_factory=list)
    refused: bool = False


def simulate(requests: list[SimRequest], step_seconds, prefill_seconds, max_batch: int, group: int,
             stall: int = PREFILL_CHUNK) -> float:
    """Run the scheduler's steps over the requests (module docstring), filling each request's
    admitted / firsts / lasts; step_seconds(b): a decode step of b rows; prefill_seconds(tokens): a
    prefill pass; stall: a pass's most tokens while sequences decode (0: the group). Returns the time
    the last sequence finished."""
    pending = deque(sorted(requests, key=lambda r: r.at))
    waiting: deque[SimRequest] = deque()
    prefilling: deque[list] = deque()  # [request, prompt tokens left]
    decoding: list[list] = []  # [request, tokens so far]
    free, t = max_batch, 0.0
    while pending or waiting or prefilling or decoding:
        if not (waiting or prefilling or decoding):
            t = max(t, pending[0].at)
        while pending and pending[0].at <= t:
            r = pending.popleft()
            if r.n > max_batch:
                r.refused = True
            else:
                waiting.append(r)
        while waiting and free >= waiting[0].n:
            r = waiting.popleft()
            free -= r.n
            r.admitted = t
            prefilling.append([r, r.prompt])
        if decoding:
            t += step_seconds(len(decoding))
            running = []
            for seq in decoding:
                seq[1] += 1
                if seq[1] >= seq[0].max_tokens:
                    seq[0].lasts.append(t)
                    free += 1
                else:
                    running.append(seq)
            decoding = running
        if prefilling:
            limit = min(group, stall) if stall and decoding else group  # a newcomer's pass beside running streams
            joined, used = [], 0  # the oldest's next group, and the next groups after it that fit beside it
            for item in prefilling:
                g = min(limit, item[1])
                if not joined or used + g <= limit:
                    joined.append((item, g))
                    used += g
            t += prefill_seconds(used)
            for item, g in joined:
                item[1] -= g
                if item[1] > 0:
                    continue
                r = item[0]
                for _ in range(r.n):
                    r.firsts.append(t)
                    if r.max_tokens <= 1:
                        r.lasts.append(t)
                        free += 1
                    else:
                        decoding.append([r, 1])
            prefilling = deque(item for item in prefilling if item[1] > 0)
    return t


def goodput(requests: list[SimRequest], slo_ttft: float | None, slo_tpot: float | None) -> float | None:
    """Requests within both SLOs per second from the first arrival to the last token (trace_replay's rule)."""
    met, end = 0, max((r.at for r in requests), default=0.0)
    for r in requests:
        if r.refused or len(r.lasts) < r.n:
            continue
        end = max(end, *r.lasts)
        ttft = max(r.firsts) - r.at
        tpot = (max(r.lasts[i] - r.firsts[i] for i in range(r.n)) / (r.max_tokens - 1)) if r.max_tokens > 1 else None
        if (slo_ttft is None or ttft <= slo_ttft) and (slo_tpot is None or tpot is None or tpot <= slo_tpot):
            met += 1
    span = end - min((r.at for r in requests), default=0.0)
    return met / span if span > 0 else None


def predict_goodput(geometry, quant: str, config: EngineConfig, hw, routing, trace: list, slo_ttft: float | None,
                    slo_tpot: float | None, factors: Factors | None = None, overhead_bytes: int = 0) -> float | None:
    """The config's predicted goodput on `trace` (TraceRequest-like: at, prompt_ids, max_tokens, n), or
    None when the plan does not fit it or a step time is unknown."""
    if not trace:
        return None
    b = config.max_batch
    points = {p.batch: p for p in predict_batch(geometry, quant, config, hw, routing, factors, None, overhead_bytes,
                                               batches=tuple(range(1, b + 1)))}
    if not all(p.fits and p.step_s for p in points.values()):
        return None
    prompts = sorted(len(r.prompt_ids) for r in trace)
    median = max(1, prompts[len(prompts) // 2])
    first = predict(geometry, quant, config, hw, routing, factors,
                    RunConditions(prompt_tokens=median, tokens=1, repeats=1, cold=False, replay=False), overhead_bytes)
    if not first.fits or first.ttft_s is None:
        return None
    per_token = first.ttft_s / median
    # Where prefill_chunk is unset the engine prefills in the plan's group, the largest that fits
    # (engine/movement/plan.py prefill_group_for), which this simulation does not size: the context
    # stands for it. The group only decides a pass where nothing decodes (a prompt's time here is
    # linear in its tokens, so one pass or several cost the same); beside running streams a pass
    # takes at most one sub-chunk whatever the group (engine/run/batch.py, stall_tokens).
    group = config.prefill_chunk or config.ctx_size
    requests = [SimRequest(r.at, len(r.prompt_ids), r.max_tokens, r.n) for r in trace]
    simulate(requests, lambda rows: points[rows].step_s, lambda tokens: tokens * per_token, b, group)
    value = goodput(requests, slo_ttft, slo_tpot)
    return None if value is None else round(value, 4)
