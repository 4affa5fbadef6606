"""Replay a request trace through serve's scheduler, in wall time, and judge it against latency SLOs.

    records, steps = replay(engine, requests, sampler_for=lambda k: Sampler())   # engine/run/batch.py underneath
    figures = replay_figures(records, slo_ttft=1.0, slo_tpot=0.2)            # goodput, p50/p95 TTFT and TPOT

The trace (engine/run/request_trace.py) says when each request arrives; the replay submits it to a
`Scheduler` (the one `serve` runs) once its time has come, steps the scheduler while anything
waits or runs, and sleeps until the next arrival when nothing does. A request due while a step
runs is submitted when the step ends, as serve's worker admits at step boundaries; its clock
starts at its arrival all the same (what its client sees).

Per request (its n sequences share the prompt; each is timed by the scheduler: BatchSequence's
admitted / first_token_at / last_token_at, and `submitted` is the request's arrival, the clock the
scheduler keeps when its caller gives one):

  TTFT   first token - arrival (the slowest of its sequences: every choice has begun)
  TPOT   (last token - first token) / (tokens - 1), the slowest of its sequences; None for a
         request of one token (it has no time between tokens, and meets any TPOT bound)
  wait   admission - arrival (the queue)
  met    it finished, TTFT <= slo_ttft and TPOT <= slo_tpot (a bound of None: not judged)

Over the replay: goodput = requests that met both SLOs per second of the makespan (first arrival
to the last token, or to the last arrival when that is later), p50/p95 of TTFT and TPOT over
the requests that finished, aggregate tok/s (every generated token over the makespan), queue
wait p50/p95, and the decode steps' batch sizes. A request the scheduler refuses (n above
max_batch: serve's 400) or whose sequence fails counts in `requests`, never in goodput.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.base.errors import PromptError
from engine.run.batch import BatchSequence, Scheduler, StepInfo
from engine.run.generate import Decoding, Sampler
from engine.run.request_trace import TraceRequest
from engine.run.run_metrics import percentile

# The per-request figures a replay reports, and the headline keys of its JSON (engine/api/results.py
# BenchResult fields of the same names; bench's summary spreads these over repeats).
TRACE_KEYS = ("goodput_rps", "slo_met", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "queue_wait_p50_s",
              "queue_wait_p95_s", "aggregate_tok_s", "makespan_s", "batch_mean")


@dataclass
class RequestRecord:
    """One request of a replay: its arrival (time.perf_counter()) and its sequences, as they ran."""

    request: TraceRequest
    arrival: float
    sequences: list[BatchSequence] = field(default_factory=list)
    refused: str | None = None  # why the scheduler refused it (n above max_batch)

    @property
    def finished(self) -> bool:
        return self.refused is None and bool(self.sequences) and all(s.outcome == "finished" for s in self.sequences)

    @property
    def output_ids(self) -> list[list[int]]:
        return [list(s.decoding.gen.output_ids) for s in self.sequences]

    @property
    def tokens(self) -> int:
        """Tokens its sequences generated."""
        return sum(len(s.decoding.gen.output_ids) for s in self.sequences)

    @property
    def ttft_s(self) -> float | None:
        firsts = [s.first_token_at for s in self.sequences]
        if not firsts or any(t is None for t in firsts):
            return None
        return max(firsts) - self.arrival

    @property
    def tpot_s(self) -> float | None:
        per = [(s.last_token_at - s.first_token_at) / (n - 1) for s in self.sequences
               if (n := len(s.decoding.gen.output_ids)) > 1 and s.first_token_at is not None
               and s.last_token_at is not None]
        return max(per) if per else None

    @property
    def wait_s(self) -> float | None:
        admitted = [s.admitted for s in self.sequences]
        if not admitted or any(t is None for t in admitted):
            return None
        return max(admitted) - self.arrival

    @property
    def end(self) -> float:
        """When it was last heard of: its last token, else its arrival."""
        return max([s.last_token_at for s in self.sequences if s.last_token_at is not None] + [self.arrival])

    def met(self, slo_ttft: float | None, slo_tpot: float | None) -> bool:
        """Whether it finished within both SLOs (a None bound is not judged)."""
        if not self.finished or self.ttft_s is None:
            return False
        if slo_ttft is not None and self.ttft_s > slo_ttft:
            return False
        tpot = self.tpot_s
        return slo_tpot is None or tpot is None or tpot <= slo_tpot


@dataclass
class StepStats:
    """What the replay's scheduler steps did (StepInfo summed)."""

    steps: int = 0
    decode_steps: int = 0
    rows: int = 0  # sequences decoded, over every decode step
    max_rows: int = 0
    union_steps: int = 0  # decode steps of two rows or more on a MoE model
    union_experts: float = 0.0  # summed over those
    prefill_tokens: int = 0

    def add(self, info: StepInfo) -> None:
        self.steps += 1
        self.prefill_tokens += info.prefill_tokens
        if info.rows:
            self.decode_steps += 1
            self.rows += info.rows
            self.max_rows = max(self.max_rows, info.rows)
        if info.union_experts is not None:
            self.union_steps += 1
            self.union_experts += info.union_experts

    def to_dict(self) -> dict:
        return {"steps": self.steps, "decode_steps": self.decode_steps, "prefill_tokens": self.prefill_tokens,
                "batch_mean": self.rows / self.decode_steps if self.decode_steps else None,
                "batch_max": self.max_rows,
                "union_experts_mean": self.union_experts / self.union_steps if self.union_steps else None}


def replay(engine, requests: list[TraceRequest], *, max_batch: int | None = None,
           sampler_for: Callable[[int], Sampler] | None = None, scheduler: Scheduler | None = None,
           sleep: Callable[[float], None] = time.sleep) -> tuple[list[RequestRecord], StepStats]:
    """Run the trace through a Scheduler on `engine` (module docstring): `scheduler`, idle, when given
    (a bench's repeats reuse one, so its pool's KV caches are made once, as serve's are), else a
    fresh one of max_batch. sampler_for(k): the sampler of the trace's k-th sequence, counted from 0
    in file order (None: greedy); each sequence has its own, so its tokens do not depend on what
    runs beside it."""
    sched = scheduler if scheduler is not None else Scheduler(engine, max_batch)
    if sched.active:
        raise ValueError("replay needs an idle scheduler")
    records: list[RequestRecord] = []
    stats = StepStats()
    k = 0
    t0 = time.perf_counter()
    pending = list(requests)
    i = 0
    while i < len(pending) or sched.active:
        now = time.perf_counter()
        while i < len(pending) and t0 + pending[i].at <= now:
            r = pending[i]
            rec = RequestRecord(r, t0 + r.at)
            group = []
            for _ in range(r.n):
                sampler = sampler_for(k) if sampler_for is not None else Sampler()
                group.append(BatchSequence(Decoding(engine, list(r.prompt_ids), r.max_tokens, sampler),
                                           submitted=rec.arrival))
                k += 1
            try:
                rec.sequences = sched.submit(group)
            except PromptError as exc:  # n above max_batch: serve refuses it (400); it counts as missed
                rec.refused = str(exc)
            records.append(rec)
            i += 1
        if sched.active:
            stats.add(sched.step())
        elif i < len(pending):
            sleep(max(0.0, t0 + pending[i].at - time.perf_counter()))
    return records, stats


def replay_figures(records: list[RequestRecord], slo_ttft: float | None, slo_tpot: float | None) -> dict:
    """The replay's figures from its records' timestamps (module docstring); None where nothing was measured."""
    done = [r for r in records if r.finished]
    met = [r for r in records if r.met(slo_ttft, slo_tpot)]
    start = min((r.arrival for r in records), default=0.0)
    end = max((r.end for r in records), default=start)
    makespan = end - start
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    tpot = [r.tpot_s for r in done if r.tpot_s is not None]
    wait = [r.wait_s for r in records if r.wait_s is not None]
    tokens = sum(r.tokens for r in records)
    steps = [s for r in done for s in r.sequences]
    decode_tokens = sum(len(s.decoding.gen.output_ids) - 1 for s in steps)
    decode_seconds = sum(s.decode_seconds for s in steps)
    return {
        "requests": len(records),
        "finished": len(done),
        "refused": sum(r.refused is not None for r in records),
        "slo_met": len(met),
        "goodput_rps": len(met) / makespan if makespan > 0 else None,
        "makespan_s": makespan,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p95_s": percentile(tpot, 0.95),
        "queue_wait_p50_s": percentile(wait, 0.5),
        "queue_wait_p95_s": percentile(wait, 0.95),
        "aggregate_tok_s": tokens / makespan if makespan > 0 else None,
        "generated_tokens": tokens,
        # As the other benches name them: the mean TTFT, one sequence's decode rate (its tokens after
        # the first over its time between first and last), a request's end-to-end mean.
        "ttft_s": statistics.fmean(ttft) if ttft else None,
        "decode_tok_s": decode_tokens / decode_seconds if decode_seconds > 0 else None,
        "request_s": statistics.fmean(r.end - r.arrival for r in done) if done else None,
    }


def request_rows(records: list[RequestRecord], slo_ttft: float | None, slo_tpot: float | None) -> list[dict]:
    """One small row per request (the JSON's `requests`): its line, arrival, figures, and whether it met the SLOs."""
    rows = []
    for r in records:
        rows.append({"line": r.request.line, "at": r.request.at, "n": r.request.n,
                     "prompt_tokens": len(r.request.prompt_ids), "max_tokens": r.request.max_tokens,
                     "tokens": r.tokens, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "wait_s": r.wait_s,
                     "met": r.met(slo_ttft, slo_tpot),
                     "outcome": "refused" if r.refused else
                     ("finished" if r.finished else next((s.outcome for s in r.sequences
                                                           if s.outcome != "finished"), None)),
                     **({"error": r.refused or _first_error(r)} if not r.finished else {})})
    return rows


def _first_error(r: RequestRecord) -> str | None:
    err = next((s.error for s in r.sequences if s.error is not None), None)
    return None if err is None else f"{type(err).__name__}: {err}"[:300]
