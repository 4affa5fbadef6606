"""`colibri bench`: a warm-up, then N decode tokens K times; medians and spread.

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

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run import steady
from engine.run.generate import Sampler, generate, load_tokenizer, random_prompt_ids
from engine.movement.io import trace
from engine.run.run_metrics import SUMMARY_KEYS, envelope, peak_rss_bytes, percentile, rss_file_bytes, run_metrics, spread
from engine.run.runtime import Engine
from engine.run.spec_gate import draft_figures
from engine.run.prompts_file import Request, workload_digest


def run_bench(model_dir, config: EngineConfig, tokens: int = 16, repeats: int = 3, cold: bool = True,
              prompt_tokens: int = 16, seed: int = 0, warmup_tokens: int = 2, progress=None,
              record_routing: str | None = None, read_trace: str | None = None,
              workload: list[Request] | None = None, steady: int = 0, temperature: float = 0.0,
              top_p: float = 1.0) -> dict:
    """workload: the user's requests (engine/run/prompts_file.py), each repeat running all of them in
    order, instead of `tokens` tokens after a random prompt of `prompt_tokens`. steady: that many
    prompts of the steady-decoding workload (engine/run/steady.py), sampled at temperature/top_p."""
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
        result = envelope(engine, str(model_dir))
        result.update({
            "kind": "bench",
            "cold": cold,
            "cold_method": cold_how,
            "tokens": tokens,
            "repeats": repeats,
            "prompt_tokens": prompt_tokens,
            "seed": seed,
            "load_seconds": engine.load_seconds,
            "summary": {k: spread([r.get(k) for r in runs]) for k in SUMMARY_KEYS},
            "runs": runs,
            "output_ids": runs[0]["output_ids"] if runs else [],
            "tokens_consistent": all(r["output_ids"] == runs[0]["output_ids"] for r in runs),
            "peak_rss_bytes": peak_rss_bytes(),
            "rss_file_bytes": rss_file_bytes(),
            "wall_seconds": time.perf_counter() - t_start,
        })
        # Headline figures at top level (medians), so every printer finds them in one place.
        for k in SUMMARY_KEYS:
            result[k] = result["summary"][k]["median"]
        result["bytes_read_per_token"] = spread([r.get("bytes_read", 0) / max(len(r["output_ids"]) - 1, 1)
                                                 for r in runs])["median"]
        result["cpu_s_per_token"] = spread([r.get("cpu_s_per_token") for r in runs])["median"]
        result["hit_rate"] = runs[-1].get("hit_rate") if runs else None
        result.update(_draft_medians(runs))
        if record_routing:
            engine.save_routing(record_routing)
            result["routing_histogram"] = record_routing
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
            m = _workload_metrics(engine, gens)
            runs.append(m)
            if progress:
                progress(rep + 1, repeats, m)
        result = envelope(engine, str(model_dir))
        result.update({
            "kind": "bench", "cold": cold, "cold_method": cold_how, "repeats": repeats, "seed": seed,
            "tokens": sum(r.max_new_tokens for r in workload),
            "prompt_tokens": sum(len(r.prompt_ids) for r in workload),
            "workload": {"requests": len(workload), "sha256": workload_digest(workload)},
            "load_seconds": engine.load_seconds,
            "summary": {k: spread([r.get(k) for r in runs]) for k in SUMMARY_KEYS}, "runs": runs,
            "output_ids": runs[0]["output_ids"] if runs else [],
            "tokens_consistent": all(r["output_ids"] == runs[0]["output_ids"] for r in runs),
            "peak_rss_bytes": peak_rss_bytes(), "rss_file_bytes": rss_file_bytes(),
            "wall_seconds": time.perf_counter() - t_start,
        })
        for k in SUMMARY_KEYS:
            result[k] = result["summary"][k]["median"]
        result["bytes_read_per_token"] = spread([r.get("bytes_read", 0) / max(r["generated_tokens"], 1)
                                                 for r in runs])["median"]
        result["hit_rate"] = runs[-1].get("hit_rate") if runs else None
        result.update(_draft_medians(runs))
        if record_routing:
            engine.save_routing(record_routing)
            result["routing_histogram"] = record_routing
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


def _workload_metrics(engine: Engine, gens: list) -> dict:
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


def _draft_medians(runs: list[dict]) -> dict:
    """Speculative decoding's figures over the repeats (medians) and the last repeat's counters."""
    out = {}
    for key in draft_figures(runs[-1].get("draft") if runs else {}):
        values = [r.get(key) for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    if out:
        out["draft"] = runs[-1]["draft"]
    return out


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
