"""draft_decode.py's child halves (a helper of draft_decode.py, not a command; its docstring has the
method): what runs inside the child process draft_decode.py starts as itself with --child or
--stream-child, so each mode's engine lives in a process (and, under a budget, a memory cgroup) of its own.

`child` measures one mode of one workload (per-process rows); `paired_child` every mode's engine in
one process, the prompts taken in turn (--paired, resident); `stream_child` one mode's engine kept
alive and answering prompt by prompt on stdin (--paired under a budget; draft_runs.py drives it).
Each answers JSON on stdout: the wire format between the halves.
"""

from __future__ import annotations

import json
import random
import resource
import sys

from benchmarks.time.draft_runs import turn_order
from benchmarks.time.draft_workloads import workload_prompts
from benchmarks.time.memory_layouts import shift_layout


# --- the child: one mode of one workload in this process ----------------------------------------

def _config(a, mode: str):
    from engine.api import EngineConfig, parse_size
    depths = [int(x) for x in a.depths.split(",")]
    draft, depth = "off", max(depths)
    if mode.startswith("gate"):
        draft = "gate"
    elif mode.startswith("fixed:"):
        draft, depth = "fixed", int(mode.split(":")[1])
    return EngineConfig(ram_budget=parse_size(a.budget), ctx_size=a.ctx, threads=a.threads, draft=draft,
                        draft_depth=depth, drafter=a.drafter if draft != "off" else "auto")


def child(a) -> dict:
    from engine.api import DraftBudgetError, Engine, Sampler, generate
    mode = a.mode
    try:
        engine = Engine(a.model, _config(a, mode))
    except DraftBudgetError as exc:  # drafting does not fit beside off's prompt group: refused, not lossy
        return {"refused": str(exc)}
    with engine:
        prompts = workload_prompts(a, engine)
        streamed = engine.store is not None and engine.store.streams
        if engine.speculator is not None and mode.endswith("nohint"):
            engine.speculator.hints = False
        if not streamed:
            generate(engine, prompts[0], 4, Sampler())  # warm: kernels, pages
        seconds, tokens, outputs, bytes_read, recall_hits, recall_total = 0.0, 0, [], 0, 0, 0
        if engine.speculator is not None:  # its counters over every prompt's decode (the gate keeps learning)
            engine.speculator.reset_stats()
        for prompt in prompts:
            if streamed:
                engine.forget_prefixes()
                engine.store.make_cold()
            gen = generate(engine, prompt, a.tokens + 1, Sampler(), on_token=_decode_counters(engine.store))
            seconds += sum(gen.token_seconds)
            tokens += len(gen.token_seconds)
            outputs.append(gen.output_ids)
            io = engine.io_stats()
            bytes_read += io.get("bytes_read", 0)
            if streamed:
                recall_hits += engine.store.recall_hits
                recall_total += engine.store.recall_total
        draft = engine.draft_stats()
        # The RAM cache's whole entries: the plan's, and what a drafter's idle memory lends it. One entry
        # moves a streamed row by ~20% here where the working set is the cache's size, and the plan's
        # runtime overhead (the process's resident set, which varies by ~0.4 MiB between processes)
        # sets it: the column says which plan each row ran
        plan = engine.plan
        entries = [plan.cache_slots, getattr(engine.store, "borrowable", 0)] if streamed else None
        return {"streamed": streamed, "tok_s": tokens / seconds if seconds else None, "tokens": tokens,
                "cache_entries": entries,
                "bytes_per_token": bytes_read / tokens if tokens else None, "outputs": outputs,
                "recall": recall_hits / recall_total if recall_total else None, "draft": draft or {}}


def _decode_counters(store, each=None):
    """An on_token that restarts the store's counters (None: no store) after the prefill's token, so they
    count the decode only, and then calls each() on every decode token."""
    seen = []

    def on_token(_token):
        if seen:
            if each is not None:
                each()
        else:
            seen.append(True)
            if store is not None:
                store.reset_stats()

    return on_token


def paired_child(a) -> dict:
    """--paired: every mode's engine in this one process (resident; or --in-process under a budget, each
    planned with off's runtime overhead, each prompt cold), the prompts taken in turn by each mode, the
    order rotating with the round, --rounds times: each mode's tok/s per prompt and the ratio to `off` on the same prompt
    within the same turn (a pair measured seconds apart, so the box's slow drifts cancel). The engines
    live through every round: the gate keeps what it measured (a server's steady state)."""
    from engine.api import DraftBudgetError, Engine, Sampler, generate, parse_size
    modes = json.loads(a.paired_modes)  # [[drafter, mode], ...], ["auto", "off"] first
    streamed = bool(parse_size(a.budget))
    engines, overhead = {}, None
    rng = random.Random()
    for drafter, mode in modes:
        a.drafter = drafter
        if a.layouts == "random":  # each engine's buffers placed after a random gap (benchmarks/time/memory_layouts.py)
            shift_layout(rng.randrange(1 << 31))
        try:
            engines[(drafter, mode)] = e = Engine(a.model, _config(a, mode), runtime_overhead_bytes=overhead)
            if streamed and overhead is None:  # off's figure for every other mode: one plan, as run_paired_streamed
                overhead = e.plan.overhead_bytes
        except DraftBudgetError as exc:
            engines[(drafter, mode)] = str(exc)
    live = {m: e for m, e in engines.items() if not isinstance(e, str)}
    prompts = workload_prompts(a, next(iter(live.values())))
    for e in live.values():
        if not streamed:
            generate(e, prompts[0], 4, Sampler())  # warm: kernels, pages
        if e.speculator is not None:
            e.speculator.reset_stats()
    out = {m: {"tok_s": [], "ratio": [], "outputs": [], **({"stall": [], "bytes": []} if streamed else {})}
           for m in live}
    order = list(live)
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            turn = turn_order(order, r, i)
            rate = {}
            for m in turn:
                e = live[m]
                if streamed:
                    e.forget_prefixes()
                    e.store.make_cold()
                gen = generate(e, prompt, a.tokens + 1, Sampler(), on_token=_decode_counters(e.store) if streamed else None)
                rate[m] = (len(gen.token_seconds) - 1) / sum(gen.token_seconds[1:])
                out[m]["tok_s"].append(rate[m])
                if streamed:  # (the store's counters restarted after the prefill's token)
                    out[m]["stall"].append(e.store.stall_seconds / len(gen.token_seconds))
                    out[m]["bytes"].append(e.io_stats().get("bytes_read", 0) / len(gen.token_seconds))
                if r == 0:
                    out[m]["outputs"].append(gen.output_ids)
            for m in live:
                out[m]["ratio"].append(rate[m] / rate[("auto", "off")])
    result = []
    for m, e in engines.items():
        if isinstance(e, str):
            result.append({"mode": list(m), "refused": e})
            continue
        result.append({"mode": list(m), **out[m], "draft": e.draft_stats() or {},
                       "cache_entries": [e.plan.cache_slots, getattr(e.store, "borrowable", 0)] if streamed else None})
        e.close()
    return {"modes": result}


def stream_child(a) -> None:
    """--paired under a budget: one mode's engine in this process (inside its cgroup), kept alive while
    the parent takes the modes in turn, prompt by prompt: a line {"prompt": i} runs prompt i cold (the
    caches emptied, their pages dropped) and answers its decode tok/s, expert bytes and read stall per
    token, lookahead recall and tokens; {"stats": 1} answers the drafting counters; EOF ends it. The first line says
    whether the engine stands (its cache entries and the runtime overhead its plan counted) or refused this
    drafting at this budget. --runtime-overhead: the figure to plan with (the parent gives every mode `off`'s)."""
    from engine.api import DraftBudgetError, Engine, Sampler, generate
    shift_layout()  # the random layout the parent gave this process, if any (benchmarks/time/memory_layouts.py)
    try:
        engine = Engine(a.model, _config(a, a.mode), runtime_overhead_bytes=a.runtime_overhead or None)
    except DraftBudgetError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    with engine:
        prompts = workload_prompts(a, engine)
        plan, store = engine.plan, engine.store
        print(json.dumps({"cache_entries": [plan.cache_slots, getattr(store, "borrowable", 0)],
                          "overhead_bytes": plan.overhead_bytes}), flush=True)
        if engine.speculator is not None:
            engine.speculator.reset_stats()
        for line in sys.stdin:
            ask = json.loads(line)
            if "stats" in ask:
                print(json.dumps(engine.draft_stats() or {}), flush=True)
                continue
            engine.forget_prefixes()
            store.make_cold()
            faults = resource.getrusage(resource.RUSAGE_SELF)
            lent = [0]  # decode tokens emitted while the RAM cache held an idle MTP layer's loan

            def count_lent(lent=lent):
                lent[0] += bool(getattr(store, "borrowed", 0))

            gen = generate(engine, prompts[ask["prompt"]], a.tokens + 1, Sampler(),
                           on_token=_decode_counters(store, count_lent))
            tokens = len(gen.token_seconds)
            now = resource.getrusage(resource.RUSAGE_SELF)
            # Where the stall comes from: reads asked on demand (the step waits for all of each) against
            # the lookahead's reads used, and how much of the decode ran with the lent cache
            print(json.dumps({"tok_s": tokens / sum(gen.token_seconds),
                              "bytes_per_token": engine.io_stats().get("bytes_read", 0) / tokens,
                              "stall_per_token": store.stall_seconds / tokens,
                              "demand_per_token": store.demand_reads / tokens,
                              "prefetch_per_token": store.prefetch_reads / tokens,
                              "prefetch_used_per_token": store.prefetched_used / tokens,
                              "lent_share": lent[0] / max(tokens - 1, 1),
                              # a read's own time in its worker (the preadv, the GIL taken back after it),
                              # against the stall: a slower read, or one asked later
                              "read_ms": store.io_stats.read_seconds / max(store.io_stats.requests, 1) * 1000,
                              # page faults over the prompt (its prefill too): a process at its cgroup's
                              # limit faults its own pages back in (major) or reclaims to allocate
                              "major_faults": now.ru_majflt - faults.ru_majflt,
                              "minor_faults": now.ru_minflt - faults.ru_minflt,
                              # the slot arena's huge pages after the prompt: a read into 4 KiB pages is
                              # slower (benchmarks/io/slot_pages.py), so a layout a loan changed shows here
                              "arena_huge_mib": (store.arena.huge_bytes() or 0) / (1 << 20) if store.arena is not None else 0,
                              "recall": [store.recall_hits, store.recall_total], "outputs": gen.output_ids}),
                  flush=True)

