"""serve_client.py --soak MINUTES: one server under load for a while, sampled (a helper of
serve_client.py, not a command; its docstring has the method).

`soak(args)` sends sequential requests (rotating prompts, completions and chat alternated) or, with
--trace, the trace's requests at their arrival times cycle after cycle (serve_load.TraceLoad), and
samples the server every --every seconds (`soak_sample`: memory, expert hit rates per tier, batch,
queue, 503s, decode speed). `write_soak` (also --replot's) adds the summary and the RSS verdict
(`soak_summary`) and writes soak.json, soak.csv and soak.png.
"""

from __future__ import annotations

import csv
import io
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks import benchkit
from benchmarks.serving.serve_load import PROMPT, TraceLoad, percentile, rounded, streamed
from benchmarks.serving.serve_process import TOOL, ServerProcess
from engine.api import atomic_write_text, git_commit, read_trace

SOAK_PROMPTS = (
    PROMPT,
    "Write a short note to a colleague about the disk budget of the new machine.",
    "List three reasons a mixture-of-experts model can run from an SSD.",
    "Once upon a time, in a data centre far away,",
    "Explain the difference between a cache hit and a demand read.",
    "def fibonacci(n):",
    "The weather report for tomorrow says",
    "Summarize: the queue holds eight requests and answers 503 when it is full.",
)
MiB = float(1 << 20)
RSS_MARGIN_MIB = 64.0  # the soak's flatness margin: the serve tests' (tests/test_serve_batch.py)


TIERS_KEY = 'colibri_expert_hits_total{tier="'


def _tiers(m: dict) -> dict[str, float]:
    return {k[len(TIERS_KEY):-2]: v for k, v in m.items() if k.startswith(TIERS_KEY)}


def soak_sample(t_s: float, n: int, server: ServerProcess, m: dict, prev: dict | None, window: list[dict]) -> dict:
    """One row: memory now; hit rates since start and over the interval since the last sample;
    the decode speed of the interval's requests (at the client and in the engine); the batch
    running and the queue now; the interval's generated tokens per second (every sequence) and 503s."""
    lookups = m.get("colibri_expert_lookups_total", 0.0)
    hits = _tiers(m)
    d_lookups = lookups - (prev["lookups"] if prev else 0.0)
    row = {"t_s": round(t_s, 1), "requests": n, "rss_mib": round(m["colibri_process_rss_bytes"] / MiB, 1),
           "cgroup_mib": round(server.cgroup_bytes() / MiB, 1) if server.cgroup_bytes() is not None else None,
           "lookups": lookups}
    for tier, h in hits.items():
        row[f"hit_{tier}_total"] = round(h / lookups, 4) if lookups else None
        d_hits = h - (prev["hits"].get(tier, 0.0) if prev else 0.0)
        row[f"hit_{tier}_interval"] = round(d_hits / d_lookups, 4) if d_lookups else None
    ok = [r for r in window if r.get("status", "ok") == "ok"]
    decode_tokens = sum(r["tokens"] - 1 for r in ok if r["s_per_token"] is not None)
    decode_time = sum(r["s_per_token"] * (r["tokens"] - 1) for r in ok if r["s_per_token"] is not None)
    row["client_decode_tok_s"] = round(decode_tokens / decode_time, 3) if decode_time else None
    steps = m["colibri_decode_token_seconds_count"] - (prev["steps"] if prev else 0.0)
    step_s = m["colibri_decode_token_seconds_sum"] - (prev["step_s"] if prev else 0.0)
    row["engine_decode_tok_s"] = round(steps / step_s, 3) if step_s else None
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    row["ttft_median_s"] = round(statistics.median(ttfts), 3) if ttfts else None
    generated = m["colibri_generated_tokens_total"]
    span = t_s - (prev["t_s"] if prev else 0.0)
    row["aggregate_tok_s"] = round((generated - (prev["generated"] if prev else 0.0)) / span, 3) if span > 0 else None
    row["batch_running"] = m.get("colibri_batch_running")
    row["queue_length"] = m.get("colibri_queue_length")
    row["rejected_503"] = sum(r.get("status") == "503" for r in window)
    row["_state"] = {"lookups": lookups, "hits": hits, "steps": m["colibri_decode_token_seconds_count"],
                     "step_s": m["colibri_decode_token_seconds_sum"], "generated": generated, "t_s": t_s}
    return row


def soak(args) -> dict:
    """Sequential requests (the rotating prompts), or with --trace the trace's requests at their
    arrival times, cycle after cycle (serve_load.TraceLoad), for --soak minutes."""
    lines = read_trace(args.trace) if args.trace else None
    out = Path(args.out)
    # The KV blocks that leave the prefix cache go under --out, not the user's cache directory.
    flags = (*(("--max-batch", str(args.max_batch)) if args.max_batch else ()), "--kv-dir", str(out / "kv"))
    commit = git_commit()  # the tree the server runs: taken at its start (a soak lasts long enough for commits)
    server = ServerProcess(args, args.port, flags)
    samples, requests, window = [], [], []
    errors, prev, n = 0, None, 0
    t0 = time.monotonic()
    next_sample = 0.0

    def take(t_s: float, sent: int, done: list[dict]) -> None:
        nonlocal prev
        row = soak_sample(t_s, sent, server, server.scrape(), prev, done)
        prev = row.pop("_state")
        samples.append(row)
        print(json.dumps(row), flush=True)

    try:
        if lines is not None:
            load = TraceLoad(server.base, lines, gap=args.trace_gap, temperature=args.temperature)
            load.run(args.soak * 60, args.every, lambda t_s, done: take(t_s, load.sent, done))
            requests = load.results
            errors = sum(r["status"] == "error" for r in requests)
            for r in requests:
                if r["status"] == "error":
                    print(f"request {r['request']}: {r['error']}", flush=True)
        else:
            while (elapsed := time.monotonic() - t0) < args.soak * 60:
                try:
                    r = streamed(server.http, args.tokens, SOAK_PROMPTS[n % len(SOAK_PROMPTS)], chat=n % 2 == 1,
                                 seed=n, temperature=args.temperature)
                except httpx.HTTPError as exc:  # counted, not fatal: a soak reports what went wrong
                    errors += 1
                    print(f"request {n}: {type(exc).__name__}: {exc}", flush=True)
                    r = None
                n += 1
                if r is not None:
                    requests.append({"t_s": round(time.monotonic() - t0, 2), **r})
                    window.append(r)
                if elapsed >= next_sample:
                    take(time.monotonic() - t0, n, window)
                    window = []
                    next_sample += args.every
            take(time.monotonic() - t0, n, window)
    finally:
        server.stop()
    doc = {"tool": TOOL, "model": args.model, "config": args.config, "ram_budget": args.ram_budget,
           "max_batch": args.max_batch, "serve_args": args.serve_arg, "trace": args.trace, "trace_gap_s": args.trace_gap if lines else None,
           "tokens_per_request": None if lines else args.tokens, "temperature": args.temperature,
           "minutes": args.soak, "every_s": args.every, "rss_margin_mib": args.rss_margin, "commit": commit,
           "cgroup": server.cgroup_note, "server_up_s": round(server.up_seconds, 1), "errors": errors,
           "samples": samples, "requests": requests}
    return write_soak(doc, out)


def soak_summary(doc: dict) -> dict:
    """First/last/max memory and the drift: over the whole soak, and after its first tenth (the
    expert cache fills to its planned size in the first requests; growth after that is a leak).
    The verdict: RSS is flat when every sample after the first tenth lies within the stated
    margin (rss_margin_mib, default 64 MiB: the serve tests' margin) of every other."""
    samples = doc["samples"]
    rss = [s["rss_mib"] for s in samples]
    cg = [s["cgroup_mib"] for s in samples if s["cgroup_mib"] is not None]
    settled = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 10] or samples
    settled_rss = [s["rss_mib"] for s in settled]
    hits = [s.get("hit_ram_interval") for s in settled if s.get("hit_ram_interval") is not None]
    slope = _slope([s["t_s"] / 3600 for s in settled], settled_rss) if len(settled) > 2 else None
    margin = doc.get("rss_margin_mib", RSS_MARGIN_MIB)
    spread_mib = round(max(settled_rss) - min(settled_rss), 1)
    reqs = doc.get("requests", [])
    ok = [r for r in reqs if r.get("status", "ok") == "ok"]
    ttfts = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    return {"requests": samples[-1]["requests"], "answered": len(ok),
            "rejected_503": sum(r.get("status") == "503" for r in reqs), "errors": doc.get("errors", 0),
            "ttft_p50_s": rounded(percentile(ttfts, 50)), "ttft_p95_s": rounded(percentile(ttfts, 95)),
            "rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_max_mib": max(rss),
            "rss_drift_mib": round(rss[-1] - rss[0], 1),
            "settled_from_s": settled[0]["t_s"], "rss_settled_drift_mib": round(rss[-1] - settled[0]["rss_mib"], 1),
            "rss_settled_range_mib": spread_mib, "rss_margin_mib": margin, "rss_flat": spread_mib <= margin,
            "rss_settled_slope_mib_per_hour": round(slope, 2) if slope is not None else None,
            "cgroup_first_mib": cg[0] if cg else None, "cgroup_last_mib": cg[-1] if cg else None,
            "cgroup_max_mib": max(cg) if cg else None,
            "ram_hit_interval_min_max": [min(hits), max(hits)] if hits else None,
            "ram_hit_since_start_last": samples[-1].get("hit_ram_total")}


SAMPLE_COLUMNS = [("min", lambda s: f"{s['t_s'] / 60:.1f}"), ("requests", lambda s: s["requests"]),
                  ("RSS MiB", lambda s: s["rss_mib"]), ("cgroup MiB", lambda s: s["cgroup_mib"]),
                  ("RAM hit (interval)", lambda s: s.get("hit_ram_interval")),
                  ("RAM hit (since start)", lambda s: s.get("hit_ram_total")),
                  ("batch", lambda s: s.get("batch_running")), ("queue", lambda s: s.get("queue_length")),
                  ("503s", lambda s: s.get("rejected_503")), ("tok/s (all)", lambda s: s.get("aggregate_tok_s")),
                  ("TTFT median s", lambda s: s.get("ttft_median_s"))]


def write_soak(doc: dict, out: Path) -> dict:
    doc["summary"] = soak_summary(doc)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "soak.json", json.dumps(doc, indent=1))
    atomic_write_text(out / "soak.csv", _csv(doc["samples"]))
    plot_soak(doc, out / "soak.png")
    m = doc["summary"]
    what = (f"trace {doc['trace']} replayed, serve --max-batch {doc.get('max_batch') or 'from the config'}"
            if doc.get("trace")
            else "sequential requests")
    print("\n" + benchkit.md_table(doc["samples"], SAMPLE_COLUMNS))
    print(f"\nsoak ({what}): {m['requests']} requests in {doc['minutes']} min, {m.get('answered', '-')} answered, "
          f"{m.get('rejected_503', 0)} refused (503, queue full), {m['errors']} errors; TTFT p50 {m.get('ttft_p50_s')} "
          f"s, p95 {m.get('ttft_p95_s')} s; RSS first {m['rss_first_mib']} "
          f"MiB, last {m['rss_last_mib']}, max {m['rss_max_mib']}, drift {m['rss_drift_mib']:+} MiB; after "
          f"{m['settled_from_s'] / 60:.1f} min (the cache full): drift {m['rss_settled_drift_mib']:+} MiB, slope "
          f"{m['rss_settled_slope_mib_per_hour']} MiB/h; cgroup first {m['cgroup_first_mib']}, last "
          f"{m['cgroup_last_mib']}, max {m['cgroup_max_mib']} MiB ({doc['cgroup']}); RAM hit rate per interval "
          f"{m['ram_hit_interval_min_max']} after the first tenth, {m['ram_hit_since_start_last']} since start")
    if "rss_flat" in m:
        print(f"verdict: RSS {'FLAT' if m['rss_flat'] else 'NOT FLAT'}: after the first tenth its samples span "
              f"{m['rss_settled_range_mib']} MiB ({'<=' if m['rss_flat'] else '>'} the stated margin of "
              f"{m['rss_margin_mib']} MiB)")
    print(f"wrote {out / 'soak.json'}, {out / 'soak.csv'} and {out / 'soak.png'}")
    return doc


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (per unit of x)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def _csv(samples: list[dict]) -> str:
    keys = list(dict.fromkeys(k for s in samples for k in s))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys)
    w.writeheader()
    w.writerows(samples)
    return buf.getvalue()


def plot_soak(doc: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from tuner.results.report_md import save_figure

    samples = doc["samples"]
    ts = [s["t_s"] / 60 for s in samples]
    fig, (mem, hit, speed) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    mem.plot(ts, [s["rss_mib"] for s in samples], marker=".", label="server RSS")
    if any(s["cgroup_mib"] for s in samples):
        mem.plot(ts, [s["cgroup_mib"] for s in samples], marker=".", label="server's cgroup (page cache included)")
    mem.set_ylabel("MiB")
    mem.legend(loc="best")
    tiers = sorted({k[4:-9] for s in samples for k in s if k.startswith("hit_") and k.endswith("_interval")})
    for tier in tiers:
        # .get: a sample before the first lookup (a trace soak's at 0 s) has no tier yet
        line, = hit.plot(ts, [s.get(f"hit_{tier}_interval") for s in samples], marker=".",
                         label=f"{tier}, per interval")
        hit.plot(ts, [s.get(f"hit_{tier}_total") for s in samples], ls="--", color=line.get_color(),
                 label=f"{tier}, since start")
    hit.set_ylabel("expert hit rate")
    hit.set_ylim(0, 1)
    hit.legend(loc="lower right")
    speed.plot(ts, [s["client_decode_tok_s"] for s in samples], marker=".", label="at the client")
    speed.plot(ts, [s["engine_decode_tok_s"] for s in samples], marker=".", label="engine's own")
    if doc.get("trace"):  # several streams at once: every sequence's tokens together as well
        speed.plot(ts, [s.get("aggregate_tok_s") for s in samples], marker=".", label="all streams, per wall second")
    speed.set_ylabel("decode tok/s (interval)")
    speed.set_xlabel("minutes")
    speed.legend(loc="lower right")
    load = (f"trace {Path(doc['trace']).name}, max_batch {doc.get('max_batch') or 'config'}" if doc.get("trace")
            else f"{doc['tokens_per_request']} tokens/request")
    fig.suptitle(f"colibri serve soak: {doc['model']}, {Path(doc['config']).name if doc['config'] else 'defaults'}, "
                 f"{load}, {doc['summary']['requests']} requests")
    return save_figure(fig, path)
