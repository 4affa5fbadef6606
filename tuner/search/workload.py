"""What a tune's trials run: the steady-decoding workload (the default), the fixed random prompt
(`tune --workload fixed`), the user's prompts (`tune --prompts`), or a request trace replayed
through serve's scheduler (`tune --objective serve --trace`: trace_workload).

The steady workload (engine/run/steady.py: several prompts, sampled, loops left out, the median
over prompts) is what `bench --steady N` runs from flags alone, so the command that reproduces a
figure needs no file from the run directory. Its decode length is sized from the memory plan
(steady_tokens): a few times the tokens it takes the routed experts to cycle the RAM cache.

    work = prepare_workload(opts.prompts, model_dir, ...); ...; work.save(out)
    run_trial(..., extra_args=work.bench_args)      # every trial and the calibration run
    work.info                                         # result.json's `workload` (lengths + hash)

The user's file is parsed and tokenized once, up front (a bad file is one error line before
anything slow), and saved tokenized in the run directory (workload.jsonl), so every trial, the
calibration run that records the routing histogram for `pinned` and the cost model, and a
resumed run all read the same requests even if the user's file changes meanwhile. What leaves
the run directory (result.json, the profile entry) describes the workload by its lengths and a
hash, never its text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import math
import statistics

from engine.api import (STEADY_TEMPERATURE, STEADY_TOP_P, STEADY_WARM_SHARE, BudgetError, ConfigError, EngineConfig,
                        Request, TraceRequest, conversation_reuse, describe, load_tokenizer, load_trace,
                        load_workload, save_requests, save_trace, steady_requests, trace_digest)
from tuner.results.result import Lengths, WorkloadInfo
from tuner.search.trial import steady_args, trace_args

# The steady workload's size. Prompts: three is the fewest with a median that one odd prompt
# cannot move, and each costs a prefill (on demo at 1 GiB a cold prefill reads about a GB).
STEADY_PROMPTS = 3
# Decode tokens per prompt: CYCLES times the tokens the routed experts take to cycle the cache
# (the first quarter, STEADY_WARM_SHARE, refills it and is not counted: three cycles are),
# within [MIN, MAX] so a demo trial stays a few seconds and a tiny model is not judged on 4 tokens.
CYCLES = 4
MIN_STEADY_TOKENS = 16
MAX_STEADY_TOKENS = 96
FIXED_TOKENS, FIXED_REPEATS = 8, 2  # the fixed prompt's sizes (tune --workload fixed), as before

WORKLOAD_FILE = "workload.jsonl"
TRACE_FILE = "trace.jsonl"  # tune --trace's requests, tokenized: what every trial replays


@dataclass
class TuneWorkload:
    info: WorkloadInfo
    requests: list[Request] = field(default_factory=list)  # empty: the fixed prompt
    bench_args: list[str] = field(default_factory=list)  # what `colibri bench` is given for it
    steady: list[Request] = field(default_factory=list)  # the steady workload's requests (made by the bench)
    trace: list[TraceRequest] = field(default_factory=list)  # tune --trace's requests, tokenized
    slo: tuple[float | None, float | None] = (None, None)  # tune --slo-ttft, --slo-tpot (seconds)

    @property
    def ctx_needed(self) -> int:
        """The context the longest request needs (prompt + its output); 0 for the fixed prompt."""
        return max((r.tokens for r in [*self.requests, *self.steady, *self.trace]), default=0)

    @property
    def reuse(self) -> dict | None:
        """A conversation workload's reuse figures (prompts_file.conversation_reuse), else None."""
        return conversation_reuse(self.requests) if self.info.kind == "conversations" else None

    @property
    def digest(self) -> str | None:
        return self.info.sha256

    def save(self, out: Path) -> None:
        """Write the tokenized requests into the run directory; trials read that copy."""
        if self.requests:
            path = save_requests(self.requests, Path(out) / WORKLOAD_FILE).resolve()
            self.bench_args = ["--workload", str(path)]
        if self.trace:
            path = save_trace(self.trace, Path(out) / TRACE_FILE).resolve()
            self.bench_args = trace_args(str(path), *self.slo)


def cycle_tokens(plan, top_k: int, experts: int) -> float | None:
    """Decode tokens it takes to touch as many routed experts as the RAM cache holds (the cache's
    capacity in experts over the experts a token touches: top_k in every MoE layer); None for a
    model with nothing to stream."""
    if plan is None or not plan.routed_experts or not experts:
        return None
    touched = plan.routed_experts / experts * top_k
    return min(plan.cache_slots, plan.routed_experts) / touched


def steady_tokens(facts, budget: int, overhead: int) -> tuple[int, float | None]:
    """(decode tokens per prompt, the cache cycle it was sized from) at the engine defaults' plan."""
    plan = None
    if facts.has_experts:
        try:
            plan = facts.plan(EngineConfig(ram_budget=budget), overhead)
        except BudgetError:  # the budget check refuses it with its own message later
            plan = None
    cycle = cycle_tokens(plan, int(facts.geometry.get("top_k") or 0), int(facts.geometry.get("experts") or 0))
    if cycle is None:
        return MIN_STEADY_TOKENS, None
    return min(MAX_STEADY_TOKENS, max(MIN_STEADY_TOKENS, math.ceil(CYCLES * cycle))), round(cycle, 2)


def steady_workload(model_dir: Path, vocab: int, n: int, prompt_tokens: int, tokens: int, seed: int,
                    cycle: float | None) -> TuneWorkload:
    """The steady workload's record: its token ids are made here as the bench makes them (the
    same function), so result.json's hash names exactly what every trial ran."""
    requests = steady_requests(vocab, n, prompt_tokens, tokens, seed, load_tokenizer(model_dir))
    d = describe(requests)
    info = WorkloadInfo(kind="steady", requests=n, prompt_tokens=Lengths(**d["prompt_tokens"]),
                        max_new_tokens=Lengths(**d["max_new_tokens"]), sha256=d["sha256"],
                        temperature=STEADY_TEMPERATURE, top_p=STEADY_TOP_P, seed=seed, cycle_tokens=cycle)
    work = TuneWorkload(info, bench_args=steady_args(n, STEADY_TEMPERATURE, STEADY_TOP_P))
    work.steady = requests
    return work


def trace_workload(path: str, model_dir: Path, vocab: int, max_position_embeddings: int, slo_ttft: float | None,
                   slo_tpot: float | None) -> TuneWorkload:
    """tune --trace: the trace read, checked and tokenized now (a bad file is one error line naming its
    line), replayed by every trial from the run directory's copy (`save`), each judged by its goodput
    against the SLOs."""
    requests = load_trace(path, load_tokenizer(model_dir), vocab)
    longest = max(requests, key=lambda r: r.tokens)
    if longest.tokens > max_position_embeddings:
        raise ConfigError(f"--trace {path}:{longest.line}: a request of {longest.tokens} tokens (prompt + max_tokens) "
                          f"is longer than the model's {max_position_embeddings} positions")
    lengths = lambda v: Lengths(min=min(v), median=statistics.median(v), max=max(v), total=sum(v))  # noqa: E731
    info = WorkloadInfo(kind="trace", requests=len(requests),
                        prompt_tokens=lengths([len(r.prompt_ids) for r in requests]),
                        max_new_tokens=lengths([r.max_tokens for r in requests]), sha256=trace_digest(requests),
                        source=Path(path).name, slo_ttft_s=slo_ttft, slo_tpot_s=slo_tpot,
                        span_s=requests[-1].at - requests[0].at, sequences=sum(r.n for r in requests))
    return TuneWorkload(info, trace=requests, slo=(slo_ttft, slo_tpot))


def fixed_info(prompt_tokens: int, tokens: int) -> WorkloadInfo:
    one = lambda n: Lengths(min=n, median=n, max=n, total=n)  # noqa: E731
    return WorkloadInfo(kind="fixed", requests=1, prompt_tokens=one(prompt_tokens), max_new_tokens=one(tokens),
                        sha256=None)


def resolve_sizes(opts, facts, budget: int, overhead: int):
    """(the options with --tokens and --repeats filled in where the user left them to the workload,
    the cache cycle in tokens the steady length was sized from or None, a line for the log or "")."""
    steady = opts.workload == "steady" and opts.prompts is None and opts.trace is None
    tokens, repeats, cycle, note = opts.tokens, opts.repeats, None, ""
    if opts.trace is not None and repeats is None:  # a replay is many requests; its trials are long already
        repeats = 1
    if steady:
        sized, cycle = steady_tokens(facts, budget, overhead)
        if tokens is None:
            tokens = sized
            note = (f"workload: steady, {opts.steady_prompts} prompts x {tokens} decode tokens (sampled, seed "
                    f"{opts.seed}; " + (f"the RAM cache cycles in {cycle:g} tokens at the defaults' plan"
                                        if cycle is not None else "no cache cycle to size from")
                    + f"; the first {int(tokens * STEADY_WARM_SHARE)} of each not counted)")
    tokens = FIXED_TOKENS if tokens is None else tokens
    repeats = (1 if steady else FIXED_REPEATS) if repeats is None else repeats
    return dataclasses.replace(opts, tokens=tokens, repeats=repeats), cycle, note


def prepare_workload(prompts: str | None, model_dir: Path, prompt_tokens: int, tokens: int,
                     max_position_embeddings: int, steady: int = 0, seed: int = 0, vocab: int = 0,
                     cycle: float | None = None, trace: str | None = None,
                     slo: tuple[float | None, float | None] = (None, None)) -> TuneWorkload:
    """A request trace (trace given), the steady workload (steady > 0 and no prompts), the fixed
    prompt (prompts None), or the user's file tokenized (`save` it once the run directory exists)."""
    if trace is not None:
        return trace_workload(trace, model_dir, vocab, max_position_embeddings, *slo)
    if prompts is None and steady:
        return steady_workload(model_dir, vocab, steady, prompt_tokens, tokens, seed, cycle)
    if prompts is None:
        return TuneWorkload(fixed_info(prompt_tokens, tokens))
    requests = load_workload(prompts, load_tokenizer(model_dir), tokens)
    longest = max(r.tokens for r in requests)
    if longest > max_position_embeddings:
        raise ConfigError(f"--prompts {prompts}: a request of {longest} tokens (prompt + max_new_tokens) is longer "
                          f"than the model's {max_position_embeddings} positions")
    d = describe(requests)
    kind = "conversations" if any(r.conversation for r in requests) else "prompts"
    info = WorkloadInfo(kind=kind, requests=d["requests"], prompt_tokens=Lengths(**d["prompt_tokens"]),
                        max_new_tokens=Lengths(**d["max_new_tokens"]), sha256=d["sha256"],
                        source=Path(prompts).name)
    return TuneWorkload(info, requests)
