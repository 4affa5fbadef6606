"""`colibri serve` measured from a client: the HTTP overhead per token, and a soak.

--overhead: the same prompt and token count (greedy, streamed, timed at the client: TTFT = the
first text chunk, decode = the chunks after it) through the server, against the engine's own
timings. Cold: a fresh server's first request against a fresh `colibri run --json` (both start
with empty expert caches). Warm: the server's next requests against `colibri bench --warm
--prompts` (the same engine in one process, caches kept). Every served request is also paired
with the engine's own timing of that very request, read from /metrics before and after (the
TTFT and decode-step histograms' sums), so "client minus engine" is the HTTP + SSE + tokenizer
cost alone, with no process-to-process noise in it.

--soak MINUTES: sequential requests (rotating prompts, completions and chat alternated,
sampled with a per-request seed) against one server for that long; every --every seconds the
server's RSS, its own memory cgroup's usage, the expert lookups and hits per cache tier (from
the counters, so the hit rate is per interval as well as since start) and the decode speed of
the interval's requests are sampled. Writes soak.json, soak.csv and soak.png under --out and
prints the first/last/max RSS and the drift.

The server runs as a subprocess in a child memory cgroup of its own (when one can be made; the
limit is a safety ceiling, --cgroup-ceiling, not the budget: the engine's memory plan holds the
budget), so the cgroup figure is the server's alone, page cache it faulted in included.

    .venv/bin/python benchmarks/serving/serve_client.py --overhead --config benchmarks/serving/serve_demo_1GiB.toml
    .venv/bin/python benchmarks/serving/serve_client.py --soak 30 --config benchmarks/serving/serve_demo_1GiB.toml

The product stays the files under --out (overhead.json; soak.json, .csv, .png). --json prints one
colibri.bench/1 document (benchkit.emit) over the same figures on stdout, the text going to
stderr: --overhead a row per path of its table (n, TTFT and s/token as median/min/max) with the
summary as notes; --soak and --replot a row per sample with the summary as notes. --lock FILE holds
benchkit.bench_lock over the measured run (instead of `quiet bench`).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.api import atomic_write_text, git_commit, parse_size  # noqa: E402
from tuner.sandbox.cgroups import Cgroup, detect_memory_cgroup  # noqa: E402
from benchmarks import benchkit  # noqa: E402

TOOL = "serve_client"

PROMPT = "The streaming engine reads the routed experts of each layer from the disk, and"
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


# --- the server and its metrics ---------------------------------------------------------------


class ServerProcess:
    """`colibri serve` as a subprocess, in its own memory cgroup when one can be made."""

    def __init__(self, args, port: int):
        self.base = f"http://127.0.0.1:{port}"
        support = detect_memory_cgroup()
        self.cgroup = Cgroup.create(support, parse_size(args.cgroup_ceiling)) if support.available else None
        self.cgroup_note = ("own child cgroup, ceiling " + args.cgroup_ceiling) if self.cgroup else support.reason
        cmd = [sys.executable, "-m", "colibri.cli", "serve", "--model", args.model, "--port", str(port),
               "--model-name", "bench", *(["--config", args.config] if args.config else []),
               *(["--ram-budget", args.ram_budget] if args.ram_budget else [])]
        # The log goes to a file: a pipe nobody reads would block the server once it filled.
        self.log = tempfile.TemporaryFile(mode="w+")
        procs = str(self.cgroup.procs_file) if self.cgroup else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log,
                                     preexec_fn=(lambda: _join_cgroup(procs)) if procs else None)
        self.started = time.monotonic()
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        self.up_seconds = time.monotonic() - self.started
        # One client with a kept-alive connection, as the openai client keeps one: a new
        # httpx client per request builds an SSL context (25-300 ms here), which is not the server's.
        self.http = httpx.Client(base_url=self.base, timeout=600)

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"serve exited ({self.proc.returncode}): {self.log.read()[-800:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a process that is still loading, with a deadline
        raise SystemExit("serve did not come up in 10 minutes")

    def scrape(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def cgroup_bytes(self) -> int | None:
        return self.cgroup.current() if self.cgroup else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "http", None) is not None:
            self.http.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        self.log.close()


def _join_cgroup(procs_file: str) -> None:
    # Runs in the child between fork and exec: everything the server allocates is charged to it.
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))


def streamed(http: httpx.Client, tokens: int, prompt: str = PROMPT, chat: bool = False, seed: int | None = None,
             temperature: float = 0.0) -> dict:
    """One streamed request, timed at the client: TTFT at the first text chunk, decode from it
    to the last one over the tokens after the first."""
    body = {"model": "bench", "max_tokens": tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}, **({"seed": seed} if seed is not None else {})}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    t0 = time.perf_counter()
    times, usage = [], None
    with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                c = chunk["choices"][0]
                if (c.get("delta") or {}).get("content") or c.get("text"):
                    times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    n = usage["completion_tokens"] if usage else len(times)
    # From the first chunk to the stream's end: text held back (a partial character, a possible
    # stop) arrives later in a bunch, so the last chunk's time would undercount the decode.
    decode = (wall - times[0]) / (n - 1) if times and n > 1 else None
    return {"ttft_s": times[0] if times else None, "s_per_token": decode, "tokens": n, "wall_s": wall}


def engine_side(before: dict, after: dict) -> dict:
    """The engine's own timing of the one request between two scrapes."""
    steps = after["colibri_decode_token_seconds_count"] - before["colibri_decode_token_seconds_count"]
    step_s = after["colibri_decode_token_seconds_sum"] - before["colibri_decode_token_seconds_sum"]
    return {"ttft_s": after["colibri_ttft_seconds_sum"] - before["colibri_ttft_seconds_sum"],
            "s_per_token": step_s / steps if steps else None,
            "wall_s": after["colibri_request_seconds_sum"] - before["colibri_request_seconds_sum"],
            "tokens": int(after["colibri_generated_tokens_total"] - before["colibri_generated_tokens_total"])}


# --- overhead ---------------------------------------------------------------------------------


def _json_of(cmd: list[str]) -> dict:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[2:5])} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return json.loads(done.stdout)


def engine_run(args, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "colibri.cli", "run", "--model", args.model, "--prompt", PROMPT, "--max-new-tokens",
           str(tokens), "--json", *(["--config", args.config] if args.config else []),
           *(["--ram-budget", args.ram_budget] if args.ram_budget else [])]
    out = _json_of(cmd)
    return {"ttft_s": out["ttft_s"], "s_per_token": 1 / out["decode_tok_s"] if out.get("decode_tok_s") else None,
            "tokens": out["generated_tokens"], "output_ids": out.get("output_ids")}


def engine_bench_warm(args, tokens: int, repeats: int, prompts_file: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "colibri.cli", "bench", "--model", args.model, "--warm", "--prompts",
           str(prompts_file), "--tokens", str(tokens), "--repeats", str(repeats), "--json",
           *(["--config", args.config] if args.config else []),
           *(["--ram-budget", args.ram_budget] if args.ram_budget else [])]
    out = _json_of(cmd)
    return [{"ttft_s": r["ttft_s"], "s_per_token": 1 / r["decode_tok_s"] if r.get("decode_tok_s") else None,
             "tokens": r["generated_tokens"]} for r in out["runs"]]


def spread(values) -> tuple[float, float, float] | None:
    vals = [v for v in values if v is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else None


def _cell(s, scale: float, digits: int) -> str:
    return f"{s[0] * scale:.{digits}f} [{s[1] * scale:.{digits}f}, {s[2] * scale:.{digits}f}]" if s else "-"


def overhead(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts_file = out / "prompt.txt"
    atomic_write_text(prompts_file, PROMPT + "\n")
    rows: dict[str, list[dict]] = {k: [] for k in ("served_cold", "engine_cold", "run_cold", "served_warm",
                                                   "engine_warm", "bench_warm")}
    note = None
    for rep in range(args.repeats):
        server = ServerProcess(args, args.port)
        note = server.cgroup_note
        try:
            for i in range(1 + args.warm_requests):
                before = server.scrape()
                client = streamed(server.http, args.tokens)
                eng = engine_side(before, server.scrape())
                kind = "cold" if i == 0 else "warm"
                rows[f"served_{kind}"].append(client)
                rows[f"engine_{kind}"].append(eng)
                print(f"repeat {rep + 1}: served {kind}: client {client}, engine {eng}", flush=True)
        finally:
            server.stop()
        rows["run_cold"].append(engine_run(args, args.tokens))
        rows["bench_warm"] += engine_bench_warm(args, args.tokens, args.warm_requests, prompts_file)
        print(f"repeat {rep + 1}: run cold {rows['run_cold'][-1]['ttft_s']:.3f} s TTFT; "
              f"bench warm {[round(r['ttft_s'], 3) for r in rows['bench_warm'][-args.warm_requests:]]}", flush=True)

    conditions = (f"model {args.model}, config {args.config or 'defaults'}{', ram_budget ' + args.ram_budget if args.ram_budget else ''}, "
                  f"prompt of {len(PROMPT)} chars, {args.tokens} tokens greedy, {args.repeats} repeats (a fresh server "
                  f"each: 1 cold + {args.warm_requests} warm requests; a fresh `colibri run`; a `colibri bench --warm` of "
                  f"{args.warm_requests}), server cgroup: {note}, commit {git_commit()}")
    print("\n" + conditions)
    labels = {"served_cold": "cold  served, at the client", "engine_cold": "cold  served, engine's own timing",
              "run_cold": "cold  colibri run (fresh process)", "served_warm": "warm  served, at the client",
              "engine_warm": "warm  served, engine's own timing", "bench_warm": "warm  colibri bench --warm"}
    print(f"| {'path':36} | {'n':>3} | {'TTFT s: median [min, max]':>28} | {'ms/token: median [min, max]':>30} |")
    print(f"|{'-' * 38}|{'-' * 5}|{'-' * 30}|{'-' * 32}|")
    for key, label in labels.items():
        rs = rows[key]
        print(f"| {label:36} | {len(rs):>3} | {_cell(spread(r['ttft_s'] for r in rs), 1, 3):>28} | "
              f"{_cell(spread(r['s_per_token'] for r in rs), 1e3, 1):>30} |")
    summary = {}
    for kind in ("cold", "warm"):
        pairs = list(zip(rows[f"served_{kind}"], rows[f"engine_{kind}"]))
        per_token = spread(c["s_per_token"] - e["s_per_token"] for c, e in pairs
                           if c["s_per_token"] is not None and e["s_per_token"] is not None)
        ttft = spread(c["ttft_s"] - e["ttft_s"] for c, e in pairs if c["ttft_s"] is not None)
        whole = spread(c["wall_s"] - e["wall_s"] for c, e in pairs)
        ref = "run_cold" if kind == "cold" else "bench_warm"
        served_engine = spread(r["s_per_token"] for r in rows[f"engine_{kind}"])
        direct = spread(r["s_per_token"] for r in rows[ref])
        summary[kind] = {"http_per_token_s": per_token, "http_ttft_s": ttft, "http_request_s": whole,
                         "engine_in_server_vs_direct": served_engine[0] / direct[0] if served_engine and direct else None}
        print(f"{kind}: HTTP + SSE overhead per decode token (client minus engine, same request) "
              f"{_cell(per_token, 1e3, 2)} ms; on TTFT {_cell(ttft, 1e3, 1)} ms; on the whole request "
              f"{_cell(whole, 1e3, 1)} ms; the engine's decode step in the "
              f"server / in `{ref.split('_')[0]}`: {summary[kind]['engine_in_server_vs_direct']:.3f}")
    doc = {"conditions": conditions, "rows": rows, "summary": summary}
    atomic_write_text(out / "overhead.json", json.dumps(doc, indent=1))
    print(f"wrote {out / 'overhead.json'}")
    return doc


# --- soak -------------------------------------------------------------------------------------

TIERS_KEY = 'colibri_expert_hits_total{tier="'


def _tiers(m: dict) -> dict[str, float]:
    return {k[len(TIERS_KEY):-2]: v for k, v in m.items() if k.startswith(TIERS_KEY)}


def soak_sample(t_s: float, n: int, server: ServerProcess, m: dict, prev: dict | None, window: list[dict]) -> dict:
    """One row: memory now; hit rates since start and over the interval since the last sample;
    the decode speed of the interval's requests (at the client and in the engine)."""
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
    decode_tokens = sum(r["tokens"] - 1 for r in window if r["s_per_token"] is not None)
    decode_time = sum(r["s_per_token"] * (r["tokens"] - 1) for r in window if r["s_per_token"] is not None)
    row["client_decode_tok_s"] = round(decode_tokens / decode_time, 3) if decode_time else None
    steps = m["colibri_decode_token_seconds_count"] - (prev["steps"] if prev else 0.0)
    step_s = m["colibri_decode_token_seconds_sum"] - (prev["step_s"] if prev else 0.0)
    row["engine_decode_tok_s"] = round(steps / step_s, 3) if step_s else None
    ttfts = [r["ttft_s"] for r in window if r["ttft_s"] is not None]
    row["ttft_median_s"] = round(statistics.median(ttfts), 3) if ttfts else None
    row["_state"] = {"lookups": lookups, "hits": hits, "steps": m["colibri_decode_token_seconds_count"],
                     "step_s": m["colibri_decode_token_seconds_sum"]}
    return row


def soak(args) -> dict:
    server = ServerProcess(args, args.port)
    samples, requests, window = [], [], []
    errors, prev, n = 0, None, 0
    t0 = time.monotonic()
    next_sample = 0.0
    try:
        while (elapsed := time.monotonic() - t0) < args.soak * 60:
            try:
                r = streamed(server.http, args.tokens, SOAK_PROMPTS[n % len(SOAK_PROMPTS)], chat=n % 2 == 1,
                             seed=n, temperature=0.8)
            except httpx.HTTPError as exc:  # counted, not fatal: a soak reports what went wrong
                errors += 1
                print(f"request {n}: {type(exc).__name__}: {exc}", flush=True)
                r = None
            n += 1
            if r is not None:
                requests.append({"t_s": round(time.monotonic() - t0, 2), **r})
                window.append(r)
            if elapsed >= next_sample:
                row = soak_sample(time.monotonic() - t0, n, server, server.scrape(), prev, window)
                prev = row.pop("_state")
                window = []
                samples.append(row)
                print(json.dumps(row), flush=True)
                next_sample += args.every
        row = soak_sample(time.monotonic() - t0, n, server, server.scrape(), prev, window)
        row.pop("_state")
        samples.append(row)
    finally:
        server.stop()
    doc = {"model": args.model, "config": args.config, "ram_budget": args.ram_budget, "tokens_per_request": args.tokens,
           "minutes": args.soak, "every_s": args.every, "commit": git_commit(), "cgroup": server.cgroup_note,
           "server_up_s": round(server.up_seconds, 1), "errors": errors, "samples": samples, "requests": requests}
    return write_soak(doc, Path(args.out))


def soak_summary(doc: dict) -> dict:
    """First/last/max memory and the drift: over the whole soak, and after its first tenth (the
    expert cache fills to its planned size in the first requests; growth after that is a leak)."""
    samples = doc["samples"]
    rss = [s["rss_mib"] for s in samples]
    cg = [s["cgroup_mib"] for s in samples if s["cgroup_mib"] is not None]
    settled = [s for s in samples if s["t_s"] >= samples[-1]["t_s"] / 10] or samples
    hits = [s.get("hit_ram_interval") for s in settled if s.get("hit_ram_interval") is not None]
    slope = _slope([s["t_s"] / 3600 for s in settled], [s["rss_mib"] for s in settled]) if len(settled) > 2 else None
    return {"requests": samples[-1]["requests"], "errors": doc.get("errors", 0),
            "rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_max_mib": max(rss),
            "rss_drift_mib": round(rss[-1] - rss[0], 1),
            "settled_from_s": settled[0]["t_s"], "rss_settled_drift_mib": round(rss[-1] - settled[0]["rss_mib"], 1),
            "rss_settled_slope_mib_per_hour": round(slope, 2) if slope is not None else None,
            "cgroup_first_mib": cg[0] if cg else None, "cgroup_last_mib": cg[-1] if cg else None,
            "cgroup_max_mib": max(cg) if cg else None,
            "ram_hit_interval_min_max": [min(hits), max(hits)] if hits else None,
            "ram_hit_since_start_last": samples[-1].get("hit_ram_total")}


def write_soak(doc: dict, out: Path) -> dict:
    doc["summary"] = soak_summary(doc)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "soak.json", json.dumps(doc, indent=1))
    atomic_write_text(out / "soak.csv", _csv(doc["samples"]))
    plot_soak(doc, out / "soak.png")
    m = doc["summary"]
    print(f"soak: {m['requests']} requests in {doc['minutes']} min, {m['errors']} errors; RSS first {m['rss_first_mib']} "
          f"MiB, last {m['rss_last_mib']}, max {m['rss_max_mib']}, drift {m['rss_drift_mib']:+} MiB; after "
          f"{m['settled_from_s'] / 60:.1f} min (the cache full): drift {m['rss_settled_drift_mib']:+} MiB, slope "
          f"{m['rss_settled_slope_mib_per_hour']} MiB/h; cgroup first {m['cgroup_first_mib']}, last "
          f"{m['cgroup_last_mib']}, max {m['cgroup_max_mib']} MiB ({doc['cgroup']}); RAM hit rate per interval "
          f"{m['ram_hit_interval_min_max']} after the first tenth, {m['ram_hit_since_start_last']} since start")
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
        line, = hit.plot(ts, [s[f"hit_{tier}_interval"] for s in samples], marker=".", label=f"{tier}, per interval")
        hit.plot(ts, [s[f"hit_{tier}_total"] for s in samples], ls="--", color=line.get_color(),
                 label=f"{tier}, since start")
    hit.set_ylabel("expert hit rate")
    hit.set_ylim(0, 1)
    hit.legend(loc="lower right")
    speed.plot(ts, [s["client_decode_tok_s"] for s in samples], marker=".", label="at the client")
    speed.plot(ts, [s["engine_decode_tok_s"] for s in samples], marker=".", label="engine's own")
    speed.set_ylabel("decode tok/s (interval)")
    speed.set_xlabel("minutes")
    speed.legend(loc="lower right")
    fig.suptitle(f"colibri serve soak: {doc['model']}, {Path(doc['config']).name if doc['config'] else 'defaults'}, "
                 f"{doc['tokens_per_request']} tokens/request, {doc['summary']['requests']} requests")
    return save_figure(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--overhead", action="store_true")
    mode.add_argument("--soak", type=float, metavar="MINUTES")
    mode.add_argument("--replot", metavar="SOAK_JSON", help="summary, CSV and plot again from a soak's soak.json")
    p.add_argument("--model", default="demo")
    p.add_argument("--config", help="engine config TOML (a tune run's recommended.toml)")
    p.add_argument("--ram-budget", help="overrides the config's budget")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-requests", type=int, default=3, help="overhead: warm requests per fresh server")
    p.add_argument("--every", type=float, default=60.0, help="soak: seconds between samples")
    p.add_argument("--port", type=int, default=8781)
    p.add_argument("--cgroup-ceiling", default="6GiB", help="the server cgroup's limit: a guard, not the budget")
    p.add_argument("--out", help="default: reports/serve-overhead or reports/serve-soak")
    benchkit.add_output_flags(p)
    args = p.parse_args()
    args.out = args.out or str(ROOT / "reports" / ("serve-overhead" if args.overhead else "serve-soak"))
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.replot:
            doc = write_soak(json.loads(Path(args.replot).read_text()), Path(args.out))
        else:
            with benchkit.bench_lock(args.lock):
                doc = overhead(args) if args.overhead else soak(args)
    if args.json:
        emit_json(args, doc)


def emit_json(args, doc: dict) -> None:
    """The run's figures as one colibri.bench/1 document: the overhead table's rows (its summary
    as notes) or the soak's samples (its summary and settings as notes)."""
    if "summary" in doc and "samples" in doc:  # a soak (or its replot)
        notes = {k: v for k, v in doc.items() if k not in ("samples", "requests")}
        benchkit.emit(TOOL, doc["samples"], benchkit.run_conditions(args, server_cgroup=doc.get("cgroup")), True, [],
                      notes=notes)
        return
    rows = [{"path": key, "n": len(rs), "ttft_s": benchkit.spread(r["ttft_s"] for r in rs),
             "s_per_token": benchkit.spread(r["s_per_token"] for r in rs)} for key, rs in doc["rows"].items()]
    benchkit.emit(TOOL, rows, benchkit.run_conditions(args, described=doc["conditions"]), True, [],
                  notes={"summary": doc["summary"]})


if __name__ == "__main__":
    main()
