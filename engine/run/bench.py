"""`colibri bench`: a warm-up, then N decode tokens K times; medians and spread. `--batch B`: B
sequences at once through the batch scheduler (engine/run/batch.py), aggregate and per-sequence.

This is the trial the tuner runs in a subprocess, so its JSON is the tuner's input. The same
prompt is used in every repeat, so the output tokens must match across repeats (and across
configs): a changed token means a placement bug, and the result says so.

cold: before every repeat the engine's caches are emptied and its in-flight reads settled, and
the model's pages are dropped from the page cache (posix_fadvise DONTNEED; in mmap mode after
madvise DONTNEED unmaps them, since mapped pages stay resident), so every expert the repeat
needs comes from the disk. The result's `cold_method` says what was done. warm: caches persist across repeats (steady state).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from pathlib import Path

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run import steady
from engine.run.batch import BatchSequence, Scheduler, StepInfo
from engine.run.generate import Decoding, Sampler, generate, load_tokenizer, random_prompt_ids
from engine.movement.io import trace
from engine.run.run_metrics import (SCHEMA, SUMMARY_KEYS, bench_result, draft_medians, envelope, peak_rss_bytes,
                                    percentile, rss_file_bytes, run_metrics, spread, workload_metrics)
from engine.run.runtime import Engine
from engine.run.prompts_file import Request, workload_digest
from engine.run import request_trace, trace_replay


def run_bench(model_dir, config: EngineConfig, tokens: int = 16, repeats: int = 3, cold: bool = True,
              prompt_tokens: int = 16, seed: int = 0, warmup_tokens: int = 2, progress=None,
              record_routing: str | None = None, read_trace: str | None = None,
              workload: list[Request] | None = None, steady: int = 0, temperature: float = 0.0,
              top_p: float = 1.0, batch: int = 0, trace_file: str | None = None, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    """workload: the user's requests (engine/run/prompts_file.py), each repeat running all of them in
    order, instead of `tokens` tokens after a random prompt of `prompt_tokens`. steady: that many
    prompts of the steady-decoding workload (engine/run/steady.py), sampled at temperature/top_p.
    batch: that many greedy sequences at once through the batch scheduler (engine/run/batch.py).
    trace_file: a request trace (engine/run/request_trace.py) replayed through serve's scheduler in
    each repeat (engine/run/trace_replay.py), judged against slo_ttft / slo_tpot (seconds; None: no
    bound), greedy or sampled at temperature/top_p."""
    if trace_file is not None:
        if steady or workload or read_trace or batch:
            raise ConfigError("--trace is its own workload: it goes with none of --steady, --prompts/--workload, "
                              "--batch and --read-trace")
        return _run_trace_bench(model_dir, config, trace_file, repeats, cold, seed, warmup_tokens, temperature, top_p,
                                slo_ttft, slo_tpot, progress, record_routing)
    if slo_ttft is not None or slo_tpot is not None:
        raise ConfigError("--slo-ttft and --slo-tpot go with --trace")
    if batch:
        if workload or read_trace or steady:
            raise ConfigError("--batch is its own workload: it goes with none of --prompts/--workload, --steady, "
                              "--read-trace")
        return _run_batch_bench(model_dir, config, batch, tokens, prompt_tokens, repeats, cold, seed, warmup_tokens,
                                progress, record_routing)
    if steady:
        if workload or read_trace:
            raise ConfigError("--steady is its own workload: it goes with neither --prompts/--workload nor --read-trace")
        return _run_steady(model_dir, config, steady, tokens, prompt_tokens, repeats, cold, seed, warmup_tokens,
                           temperature, top_p, progress, record_routing)
    if workload:
        if read_trace:
            raise ConfigError("--read-trace measures the fixed prompt; it does not go with a workload")
        return _run_workload_bench(model_dir, config, workload, repeats, cold, seed, warmup_tokens, progress,
                                   record_routing)
    t_start = time.perf_counter()
    engine = Engine(model_dir, config)
    try:
        tracer = trace.attach(engine.store) if read_trace else None
        traced: list[dict] = []  # every repeat's reads, each tagged with its repeat
        windows: list[float] = []
        prompt = random_prompt_ids(prompt_tokens, engine.args.vocab_size, seed)
        if record_routing:
            engine.record_routing()
        if warmup_tokens:
            generate(engine, prompt, warmup_tokens, Sampler())
        runs = []
        cold_how = None
        for rep in range(repeats):
            if cold:
                cold_how = make_cold(engine)
            _reset_stats(engine)
            # I/O counters restart after the first token, so bytes, hit rates and stalls
            # describe decode alone (prefill touches nearly every expert and would swamp them).
            first = []

            def after_prefill(_token, first=first):
                if not first:
                    first.append(_cpu_seconds())
                    _reset_stats(engine)
                elif tracer is not None:
                    tracer.next_token()

            gen = generate(engine, prompt, tokens + 1, Sampler(), on_token=after_prefill)  # +1: TTFT token
            m = run_metrics(engine, gen)
            m["output_ids"] = gen.output_ids
            # CPU of the whole process (compute, readers, the kernel's io_uring workers) per
            # decode token: on a 2-core box what the readers burn is taken from the matmuls.
            m["cpu_s_per_token"] = (_cpu_seconds() - first[0]) / max(len(gen.token_seconds), 1) if first else None
            runs.append(m)
            if tracer is not None:
                windows.append(tracer.elapsed())
                traced += [dict(r, repeat=rep) for r in tracer.records()]
            if progress:
                progress(rep + 1, repeats, m)
        result = bench_result(engine, model_dir, runs, SUMMARY_KEYS, t_start, record_routing,
                         lambda r: r.get("bytes_read", 0) / max(len(r["output_ids"]) - 1, 1),
                         cold=cold, cold_method=cold_how, tokens=tokens, repeats=repeats, prompt_tokens=prompt_tokens,
                         seed=seed)
        result["cpu_s_per_token"] = spread([r.get("cpu_s_per_token") for r in runs])["median"]
        result.update(draft_medians(runs))
        if read_trace:
            result["read_trace"] = _write_read_trace(read_trace, engine, config, result, traced, windows)
        return result
    finally:
        engine.close()


def _run_workload_bench(model_dir, config: EngineConfig, workload: list[Request], repeats: int, cold: bool,
                        seed: int, warmup_tokens: int, progress, record_routing: str | None) -> dict:
    """Each repeat runs every request in order, as one user's session would (cold: from an empty
    cache at the repeat's start). Its figures are over the whole workload: TTFT and request
    latency are means per request, decode tok/s is all decode tokens over all decode time, and
    the I/O counters cover prefill and decode of every request."""
    t_start = time.perf_counter()
    engine = Engine(model_dir, config)
    try:
        if record_routing:
            engine.record_routing()  # the routing of the user's own prompts: what pinned pins
        if warmup_tokens:  # at most the request's own length: a request that fits ctx_size warms up too
            generate(engine, list(workload[0].prompt_ids), min(warmup_tokens, workload[0].max_new_tokens), Sampler())
        runs, cold_how = [], None
        for rep in range(repeats):
            if cold:
                cold_how = make_cold(engine)
            _reset_stats(engine)
            gens = [generate(engine, list(r.prompt_ids), r.max_new_tokens, Sampler()) for r in workload]
            m = workload_metrics(engine, gens)
            runs.append(m)
            if progress:
                progress(rep + 1, repeats, m)
        result = bench_result(engine, model_dir, runs, SUMMARY_KEYS, t_start, record_routing,
                         lambda r: r.get("bytes_read", 0) / max(r["generated_tokens"], 1),
                         cold=cold, cold_method=cold_how, repeats=repeats, seed=seed,
                         tokens=sum(r.max_new_tokens for r in workload),
                         prompt_tokens=sum(len(r.prompt_ids) for r in workload),
                         workload={"requests": len(workload), "sha256": workload_digest(workload)})
        result.update(draft_medians(runs))
        return result
    finally:
        engine.close()


def _run_steady(model_dir, config: EngineConfig, n: int, tokens: int, prompt_tokens: int, repeats: int, cold: bool,
                seed: int, warmup_tokens: int, temperature: float, top_p: float, progress,
                record_routing: str | None) -> dict:
    """`bench --steady N`: the steady-decoding workload (engine/run/steady.py), its figure the median
    over the prompts that did not degenerate."""
    t_start = time.perf_counter()
    engine = Engine(model_dir, config)
    try:
        requests = steady.steady_requests(engine.args.vocab_size, n, prompt_tokens, tokens, seed,
                                          load_tokenizer(model_dir))
        if record_routing:
            engine.record_routing()
        if warmup_tokens:  # loads the kernels and touches the dense weights; make_cold then empties the caches
            generate(engine, list(requests[0].prompt_ids), warmup_tokens, Sampler())
        result = envelope(engine, str(model_dir))
        result.update(steady.run_steady_bench(engine, requests, repeats=repeats, cold=cold, seed=seed,
                                              temperature=temperature, top_p=top_p, make_cold=make_cold,
                                              reset_stats=_reset_stats, progress=progress))
        result.update({"kind": "bench", "load_seconds": engine.load_seconds, "peak_rss_bytes": peak_rss_bytes(),
                       "rss_file_bytes": rss_file_bytes(), "wall_seconds": time.perf_counter() - t_start})
        if record_routing:
            engine.save_routing(record_routing)
            result["routing_histogram"] = record_routing
        return result
    finally:
        engine.close()


def _run_batch_bench(model_dir, config: EngineConfig, batch: int, tokens: int, prompt_tokens: int, repeats: int,
                     cold: bool, seed: int, warmup_tokens: int, progress, record_routing: str | None) -> dict:
    """`bench --batch B`: B greedy sequences arriving together (prompts of `prompt_tokens` drawn from
    seed, seed + 1, ...), each `tokens` decode tokens after its first, through the batch scheduler
    (one prefill pass per step, the prompts' groups together while they fit one group; the decoding
    ones in one step). max_batch is raised to B if below.

    Figures per repeat: decode_tok_s is the aggregate (every sequence's decode tokens over the time
    of the decode steps), sequence_tok_s the median sequence's own (its decode tokens over the time
    from its first token to its last, prefill groups of the others included); bytes read and the
    union of experts per MoE layer, per decode step of all B (the steps where the batch is whole)."""
    t_start = time.perf_counter()
    if config.max_batch < batch:
        config = config.replace(max_batch=batch)
    engine = Engine(model_dir, config)
    try:
        prompts = [random_prompt_ids(prompt_tokens, engine.args.vocab_size, seed + i) for i in range(batch)]
        sched = Scheduler(engine, batch)  # its caches are made once and reused by every repeat

        def run_all(n_tokens: int) -> tuple[list[BatchSequence], list[StepInfo]]:
            seqs = [BatchSequence(Decoding(engine, p, n_tokens, Sampler())) for p in prompts]
            for s in seqs:
                sched.submit(s)
            infos: list[StepInfo] = []
            sched.run(infos.append)
            return seqs, infos

        if record_routing:
            engine.record_routing()
        if warmup_tokens:  # kernels, the dense weights and every cache of the pool touched once
            run_all(warmup_tokens)
        runs, cold_how = [], None
        for rep in range(repeats):
            if cold:
                cold_how = make_cold(engine)
            _reset_stats(engine)
            seqs, infos = run_all(tokens + 1)  # +1: the first token (TTFT)
            failed = next((s for s in seqs if s.outcome == "error"), None)
            if failed is not None:
                raise failed.error
            m = _batch_metrics(engine, seqs, infos, batch)
            runs.append(m)
            if progress:
                progress(rep + 1, repeats, m)
        result = bench_result(engine, model_dir, runs, (*SUMMARY_KEYS, *BATCH_KEYS), t_start, record_routing,
                         lambda r: r.get("bytes_read_per_token"), cold=cold, cold_method=cold_how, tokens=tokens,
                         repeats=repeats, prompt_tokens=prompt_tokens, seed=seed, batch=batch)
        return result
    finally:
        engine.close()


# A batch bench's own headline figures (beside SUMMARY_KEYS), each a BenchResult field.
BATCH_KEYS = ("aggregate_tok_s", "sequence_tok_s", "ttft_p95_s", "bytes_read_per_step", "union_experts_per_step")


def _batch_metrics(engine: Engine, seqs: list, infos: list, batch: int) -> dict:
    gens = [s.decoding.gen for s in seqs]
    decode = [i for i in infos if i.rows]
    whole = [i for i in decode if i.rows == batch]
    rows = sum(i.rows for i in decode)
    decode_s = sum(i.decode_seconds for i in decode)
    steps = [t for g in gens for t in g.token_seconds]
    own = [(len(g.output_ids) - 1) / s.decode_seconds for s, g in zip(seqs, gens) if s.decode_seconds > 0]
    read = [i.bytes_read for i in whole if i.bytes_read is not None]
    union = [i.union_experts for i in whole if i.union_experts is not None]
    m = {
        "schema": SCHEMA, "prompt_tokens": sum(len(g.prompt_ids) for g in gens),
        "generated_tokens": sum(len(g.output_ids) for g in gens),
        "ttft_s": statistics.median(g.ttft_seconds for g in gens),
        "ttft_p95_s": percentile([g.ttft_seconds for g in gens], 0.95),
        "request_s": statistics.fmean(g.ttft_seconds + s.decode_seconds for s, g in zip(seqs, gens)),
        "decode_tok_s": rows / decode_s if decode_s else None,
        "aggregate_tok_s": rows / decode_s if decode_s else None,
        "sequence_tok_s": statistics.median(own) if own else None,
        "token_latency_p50_ms": percentile(steps, 0.5) * 1000.0 if steps else None,
        "token_latency_p99_ms": percentile(steps, 0.99) * 1000.0 if steps else None,
        "decode_steps": len(decode), "whole_steps": len(whole),
        "bytes_read_per_step": statistics.fmean(read) if read else None,
        "bytes_read_per_token": statistics.fmean(read) / batch if read else None,
        "union_experts_per_step": statistics.fmean(union) if union else None,
        "output_ids": [t for g in gens for t in g.output_ids],
        "peak_rss_bytes": peak_rss_bytes(), "rss_file_bytes": rss_file_bytes(),
        **engine.io_stats(),
    }
    return m


def _run_trace_bench(model_dir, config: EngineConfig, path: str, repeats: int, cold: bool, seed: int,
                     warmup_tokens: int, temperature: float, top_p: float, slo_ttft: float | None,
                     slo_tpot: float | None, progress, record_routing: str | None) -> dict:
    """`bench --trace FILE`: each repeat replays the whole trace through the scheduler (cold: from
    empty expert caches), in wall time; its figures are the replay's (trace_replay.replay_figures), the
    headline the median over repeats. Sequence k of the trace (file order) samples with seed + k."""
    t_start = time.perf_counter()
    engine = Engine(model_dir, config)
    try:
        requests = request_trace.load_trace(path, load_tokenizer(model_dir), engine.args.vocab_size)
        request_trace.check_context(requests, engine.kv.ctx_size, path)
        if record_routing:
            engine.record_routing()
        sched = Scheduler(engine)  # one for every repeat: its pool's KV caches are made once, as serve's
        if warmup_tokens:
            # Through the scheduler, as many sequences at once as it runs: the prefill groups and the
            # batched decode's kernels are loaded and the pool's caches made before anything is timed;
            # make_cold then empties the expert caches.
            warm = [request_trace.TraceRequest(0.0, r.prompt_ids, min(warmup_tokens, r.max_tokens))
                    for r in requests[:engine.config.max_batch]]
            trace_replay.replay(engine, warm, scheduler=sched)

        def sampler_for(k: int) -> Sampler:
            return Sampler(temperature, top_p, seed + k) if temperature > 0 else Sampler()

        runs, cold_how = [], None
        for rep in range(repeats):
            if cold:
                cold_how = make_cold(engine)
            _reset_stats(engine)
            records, steps = trace_replay.replay(engine, requests, sampler_for=sampler_for, scheduler=sched)
            m = trace_replay.replay_figures(records, slo_ttft, slo_tpot)
            m.update(steps.to_dict())
            m.update(engine.io_stats())
            m.update({"peak_rss_bytes": peak_rss_bytes(), "rss_file_bytes": rss_file_bytes(),
                      "per_request": trace_replay.request_rows(records, slo_ttft, slo_tpot),
                      # What a tune compares across configs (placement must not change tokens): the
                      # requests of n = 1, which every max_batch runs; one of n > 1 is refused where n
                      # is above max_batch, so its tokens are in request_output_ids only (null: refused).
                      "output_ids": [t for r in records if r.request.n == 1 for ids in r.output_ids for t in ids],
                      "request_output_ids": [None if r.refused else r.output_ids for r in records]})
            runs.append(m)
            if progress:
                progress(rep + 1, repeats, m)
        keys = tuple(dict.fromkeys((*SUMMARY_KEYS, *trace_replay.TRACE_KEYS)))
        result = bench_result(engine, model_dir, runs, keys, t_start, record_routing,
                         lambda r: r.get("bytes_read", 0) / max(r["generated_tokens"], 1),
                         consistent="request_output_ids", cold=cold, cold_method=cold_how, repeats=repeats,
                         seed=seed, tokens=sum(r.max_tokens * r.n for r in requests),
                         prompt_tokens=sum(len(r.prompt_ids) for r in requests),
                         trace={"source": Path(path).name, "requests": len(requests),
                               "sequences": sum(r.n for r in requests), "sha256": request_trace.trace_digest(requests),
                               "span_s": requests[-1].at - requests[0].at, "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
                               "max_batch": engine.config.max_batch, "temperature": temperature,
                               "top_p": top_p if temperature > 0 else None})
        return result
    finally:
        engine.close()


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def make_cold(engine: Engine) -> str:
    """Make the next repeat read from the disk; the answer says how (it goes in the result).
    Nothing an earlier repeat computed is reused either (the prefix cache, when on)."""
    engine.forget_prefixes()
    store = engine.store
    if store is None or not store.streams:
        return "resident: no disk in the loop"
    how = store.make_cold()
    gc.collect()
    return how


def _reset_stats(engine: Engine) -> None:
    if engine.speculator is not None:
        engine.speculator.reset_stats()
    if engine.store is not None:
        engine.store.reset_stats()
        tracer = getattr(engine.store, "tracer", None)
        if tracer is not None:  # the trace covers the same window as the I/O counters
            tracer.restart()


def _write_read_trace(path: str, engine: Engine, config: EngineConfig, result: dict, records: list[dict],
                      windows: list[float]) -> dict:
    """Write every repeat's decode reads (engine/movement/io/trace.py); what the result says about the file."""
    header = {"model": result.get("model"), "commit": result.get("git_commit"), "io_mode": config.io_mode,
              "io_mode_effective": engine.io_stats().get("io_mode_effective"), "io_threads": config.io_threads,
              "chunk_size": config.chunk_size, "tokens": result["tokens"], "repeats": result["repeats"],
              "cold": result["cold"], "window_s": windows,
              "bytes_read": [r.get("bytes_read", 0) for r in result["runs"]]}
    trace.write_trace(path, header, records)
    return {"path": str(path), "reads": len(records), "bytes": sum(r["nbytes"] for r in records)}
