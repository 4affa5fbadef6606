"""`colibri serve` measured from a client: the HTTP overhead per token, simultaneous arrivals, and a soak.

--overhead: the same prompt and token count (greedy, streamed, timed at the client: TTFT = the
first text chunk, decode = the chunks after it) through the server, against the engine's own
timings. Cold: a fresh server's first request against a fresh `colibri run --json` (both start
with empty expert caches). Warm: the server's next requests against `colibri bench --warm
--prompts` (the same engine in one process, caches kept). Every served request is also paired
with the engine's own timing of that very request, read from /metrics before and after (the
TTFT and decode-step histograms' sums), so "client minus engine" is the HTTP + SSE + tokenizer
cost alone, with no process-to-process noise in it.

--arrivals N: time to first token of N requests arriving at once against one arriving alone
(issue 39's target: p95 of 4 together <= 1.5x the lone one's). The server runs with --max-batch N
(or --max-batch) and --prefix-cache 0; N prompts of --prompt-tokens seeded token ids, the same every
round, one per arrival slot (a lone round sends slot round % N's); --rounds rounds of one lone and
one simultaneous measurement, alternating which goes first. Each request comes from its own
thread on its own connection (opened before the release), greedy and streamed through
/v1/completions; TTFT is its first text chunk at the client. Resident: one server, warmed by one
unmeasured simultaneous and one lone request. --cold: a fresh server for every measurement, the
model's page cache dropped before it starts (with --config ...1GiB.toml --cgroup-ceiling 1GiB: under
a 1 GiB cgroup, cold). The table: TTFT p50/p95/max over the requests of each kind, the TTFT of the
1st, 2nd, ... simultaneous request to get its first chunk (median over rounds: a staircase means
the prompts were prefilled one after another), and the server log's own wait and arrival-to-first-
token of the same requests. Writes arrivals.json under --out.

--soak MINUTES: sequential requests (rotating prompts, completions and chat alternated,
sampled with a per-request seed) against one server for that long, or with --trace FILE the
trace's requests at their arrival times from worker threads, cycle after cycle (the next cycle
--trace-gap seconds after the last request of one has ended; serve_load.TraceLoad), several
streams at once up to --max-batch; 503s (queue full) are counted apart from errors. Every --every
seconds the server's RSS, its own memory cgroup's usage, the expert lookups and hits per cache
tier (from the counters, so the hit rate is per interval as well as since start), the running
batch, the queue, the interval's 503s, its generated tokens per second and the decode speed of
the interval's requests are sampled. Prints the samples as a table and the first/last/max RSS,
the drift and the verdict: flat when the samples after the first tenth span at most --rss-margin
MiB (default 64, the serve tests' margin). Writes soak.json, soak.csv and soak.png under --out
(the server's KV blocks that leave its prefix cache go to --out/kv).

The server runs as a subprocess in a child memory cgroup of its own (when one can be made; the
limit is a safety ceiling, --cgroup-ceiling, not the budget: the engine's memory plan holds the
budget), so the cgroup figure is the server's alone, page cache it faulted in included. --out is
checked by the output guard before anything runs (fresh, empty, or a previous output of this
script); every file is written by temp + rename.

    .venv/bin/python benchmarks/serving/serve_client.py --overhead --config benchmarks/serving/serve_demo_1GiB.toml
    .venv/bin/python benchmarks/serving/serve_client.py --arrivals 4 --model demo
    .venv/bin/python benchmarks/serving/serve_client.py --arrivals 4 --model demo --cold \
        --config benchmarks/serving/serve_demo_1GiB.toml --cgroup-ceiling 1GiB
    .venv/bin/python benchmarks/serving/serve_client.py --soak 30 --config benchmarks/serving/serve_demo_1GiB.toml
    .venv/bin/python benchmarks/serving/serve_client.py --soak 30 --config benchmarks/serving/serve_demo_1GiB.toml \
        --trace benchmarks/serving/traces/chat_burst.jsonl --max-batch 4

The product stays the files under --out (overhead.json; arrivals.json; soak.json, .csv, .png).
--json prints one colibri.bench/1 document (benchkit.emit) over the same figures on stdout, the
text going to stderr: --overhead a row per path of its table (n, TTFT and s/token as
median/min/max) with the summary as notes; --arrivals a row per kind with the ratio as notes;
--soak and --replot a row per sample with the summary as notes. --lock FILE holds
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

from engine.api import (ColibriError, any_of, atomic_write_text, git_commit, model_args, parse_size,  # noqa: E402
                        is_kv_root, random_prompt_ids, read_trace, resolve_model, run_directory_target,
                        stamped)
from tuner.sandbox.cgroups import Cgroup, detect_memory_cgroup  # noqa: E402
from benchmarks import benchkit  # noqa: E402
from benchmarks.io.page_cache import cached_bytes, drop_pages  # noqa: E402
from benchmarks.serving.serve_load import (PROMPT, TraceLoad, log_requests, percentile, simultaneous,  # noqa: E402
                                           streamed)

TOOL = "serve_client"

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


# --- the server and its metrics ---------------------------------------------------------------


class ServerProcess:
    """`colibri serve` as a subprocess, in its own memory cgroup when one can be made."""

    def __init__(self, args, port: int, flags: tuple[str, ...] = ()):
        self.base = f"http://127.0.0.1:{port}"
        support = detect_memory_cgroup()
        self.cgroup = Cgroup.create(support, parse_size(args.cgroup_ceiling)) if support.available else None
        self.cgroup_note = ("own child cgroup, ceiling " + args.cgroup_ceiling) if self.cgroup else support.reason
        cmd = [sys.executable, "-m", "colibri.cli", "serve", "--model", args.model, "--port", str(port),
               "--model-name", "bench", *(["--config", args.config] if args.config else []),
               *(["--ram-budget", args.ram_budget] if args.ram_budget else []), *flags, *args.serve_arg]
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

    def log_since(self, offset: int) -> tuple[str, int]:
        """The server's log written since `offset` (a byte offset of its log file), and the new offset."""
        fd = self.log.fileno()  # read by offset: the server appends to the file through its own descriptor
        size = os.fstat(fd).st_size
        return os.pread(fd, max(0, size - offset), offset).decode("utf-8", "replace"), size

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


# --- simultaneous arrivals -------------------------------------------------------------------


def arrival_prompts(model_dir: Path, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids (seeded, one seed each): the same prompts every round, so
    lone and simultaneous arrivals prefill the same tokens and take their first text chunk at the
    same token (the server runs with --prefix-cache 0: nothing is reused across rounds)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    vocab = model_args(cfg).vocab_size
    return [random_prompt_ids(length, vocab, seed=1000 + i) for i in range(count)]


def arrivals(args) -> dict:
    """Rounds of a lone arrival and of --arrivals N simultaneous ones, alternating which goes first;
    resident (one server, warmed) or --cold (a fresh server per measurement, the model's pages dropped)."""
    n = args.arrivals
    model_dir = resolve_model(args.model, progress=False)
    prompts = arrival_prompts(model_dir, n, args.prompt_tokens)
    flags = ("--max-batch", str(args.max_batch or n), "--prefix-cache", "0")
    measured: list[dict] = []
    server, note, dropped = None, None, []

    def start() -> ServerProcess:
        if args.cold:
            drop_pages([model_dir])
            dropped.append(cached_bytes([model_dir]))  # the proof of coldness: what is still cached
        return ServerProcess(args, args.port, flags)

    def measure(srv: ServerProcess, kind: str, rnd: int) -> None:
        batch = [prompts[rnd % n]] if kind == "lone" else prompts
        _, mark = srv.log_since(0)
        results = simultaneous(srv.base, batch, args.tokens)
        engine = log_requests(srv.log_since(mark)[0])
        measured.append({"round": rnd + 1, "kind": kind, "requests": results, "engine": engine})
        ttfts = ", ".join(f"{r['ttft_s']:.3f}" for r in results if r["ttft_s"] is not None)
        firsts = ", ".join(f"{e['arrival_to_first_s']:.2f}" for e in engine)
        print(f"round {rnd + 1}: {kind}: TTFT {ttfts} s; engine wait + TTFT {firsts} s", flush=True)

    try:
        if not args.cold:
            server = start()
            note = server.cgroup_note
            # Warm-up (not measured): the pool's caches, the batched kernels, the expert cache.
            simultaneous(server.base, prompts, args.tokens)
            simultaneous(server.base, prompts[:1], args.tokens)
        for rnd in range(args.rounds):
            for kind in (("lone", "together") if rnd % 2 == 0 else ("together", "lone")):
                if args.cold:
                    server = start()
                    note = server.cgroup_note
                    try:
                        measure(server, kind, rnd)
                    finally:
                        server.stop()
                        server = None
                else:
                    measure(server, kind, rnd)
    finally:
        if server is not None:
            server.stop()
    rows = arrival_rows(measured, n)
    lone, together = (next(r for r in rows if r["arrival"] == k) for k in ("lone", f"{n} together"))
    ratio = (together["ttft_p95_s"] / lone["ttft_p95_s"]
             if together["ttft_p95_s"] is not None and lone["ttft_p95_s"] else None)
    conditions = (f"model {args.model}, config {args.config or 'defaults'}"
                  f"{', ram_budget ' + args.ram_budget if args.ram_budget else ''}, serve --max-batch "
                  f"{args.max_batch or n} --prefix-cache 0{''.join(' ' + a for a in args.serve_arg)}, prompts of {args.prompt_tokens} token ids (one per "
                  f"arrival slot, the same every round), {args.tokens} tokens greedy, streamed through /v1/completions, "
                  f"{args.rounds} rounds of lone + {n} simultaneous (alternating which first), "
                  f"{'cold: a fresh server per measurement, the model pages dropped' if args.cold else 'resident: one warmed server'}"
                  f", server cgroup: {note}, commit {git_commit()}")
    summary = {"p95_ratio": _round(ratio), "target": ARRIVALS_TARGET,
               "met": ratio is not None and ratio <= ARRIVALS_TARGET,
               "model_bytes_cached_after_drop": dropped or None}
    doc = {"tool": TOOL, "conditions": conditions, "rows": rows, "summary": summary, "measurements": measured}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "arrivals.json", json.dumps(doc, indent=1))
    print("\n" + conditions)
    print(benchkit.md_table(rows, ARRIVAL_COLUMNS))
    print(f"p95 TTFT of {n} simultaneous arrivals / a lone arrival's: {_fmt(ratio, 2)} (target <= "
          f"{ARRIVALS_TARGET}: {'met' if summary['met'] else 'missed'})")
    print(f"wrote {out / 'arrivals.json'}")
    return doc


ARRIVALS_TARGET = 1.5  # issue 39: p95 TTFT of 4 simultaneous arrivals <= 1.5x a lone arrival's


def arrival_rows(measured: list[dict], n: int) -> list[dict]:
    """One row per kind: TTFT percentiles over every request of its rounds; for the simultaneous
    rounds also the TTFT of the 1st, 2nd, ... to get its first chunk (each rank's median over rounds):
    a staircase says the prompts were prefilled one after another."""
    rows = []
    for kind, label in (("lone", "lone"), ("together", f"{n} together")):
        ms = [m for m in measured if m["kind"] == kind]
        reqs = [r for m in ms for r in m["requests"]]
        ttfts = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
        engine = [e for m in ms for e in m["engine"]]
        ranked = [sorted(r["ttft_s"] for r in m["requests"] if r["ttft_s"] is not None) for m in ms]
        width = min((len(x) for x in ranked), default=0)
        rows.append({"arrival": label, "rounds": len(ms), "requests": len(reqs),
                     "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p95_s": _round(percentile(ttfts, 95)),
                     "ttft_max_s": _round(max(ttfts, default=None)),
                     "by_rank_s": [_round(statistics.median(x[k] for x in ranked)) for k in range(width)],
                     "engine_wait_p95_s": _round(percentile([e["wait_s"] for e in engine], 95)),
                     "engine_first_p95_s": _round(percentile([e["arrival_to_first_s"] for e in engine], 95)),
                     "ms_per_token_p50": _round(percentile([r["s_per_token"] * 1e3 for r in reqs
                                                            if r["s_per_token"] is not None], 50), 1)})
    return rows


def _fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


ARRIVAL_COLUMNS = [("arrival", lambda r: r["arrival"]), ("rounds", lambda r: r["rounds"]),
                   ("requests", lambda r: r["requests"]), ("TTFT p50 s", lambda r: _fmt(r["ttft_p50_s"])),
                   ("TTFT p95 s", lambda r: _fmt(r["ttft_p95_s"])), ("TTFT max s", lambda r: _fmt(r["ttft_max_s"])),
                   ("TTFT by arrival rank s (median)", lambda r: ", ".join(_fmt(v) for v in r["by_rank_s"])),
                   ("engine wait p95 s", lambda r: _fmt(r["engine_wait_p95_s"])),
                   ("engine arrival→first p95 s", lambda r: _fmt(r["engine_first_p95_s"])),
                   ("ms/token p50", lambda r: _fmt(r["ms_per_token_p50"], 1))]


# --- soak -------------------------------------------------------------------------------------

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
           "minutes": args.soak, "every_s": args.every, "rss_margin_mib": args.rss_margin, "commit": git_commit(),
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
            "ttft_p50_s": _round(percentile(ttfts, 50)), "ttft_p95_s": _round(percentile(ttfts, 95)),
            "rss_first_mib": rss[0], "rss_last_mib": rss[-1], "rss_max_mib": max(rss),
            "rss_drift_mib": round(rss[-1] - rss[0], 1),
            "settled_from_s": settled[0]["t_s"], "rss_settled_drift_mib": round(rss[-1] - settled[0]["rss_mib"], 1),
            "rss_settled_range_mib": spread_mib, "rss_margin_mib": margin, "rss_flat": spread_mib <= margin,
            "rss_settled_slope_mib_per_hour": round(slope, 2) if slope is not None else None,
            "cgroup_first_mib": cg[0] if cg else None, "cgroup_last_mib": cg[-1] if cg else None,
            "cgroup_max_mib": max(cg) if cg else None,
            "ram_hit_interval_min_max": [min(hits), max(hits)] if hits else None,
            "ram_hit_since_start_last": samples[-1].get("hit_ram_total")}


def _round(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


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


# A previous output of this script: its JSON, or a soak's server KV directory alone (a soak stopped
# before it wrote soak.json).
OUTPUT = any_of(stamped("soak.json", "samples"), stamped("overhead.json", "summary"),
                stamped("arrivals.json", "measurements"),
                lambda d: {p.name for p in Path(d).iterdir()} == {"kv"} and is_kv_root(Path(d) / "kv"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--overhead", action="store_true")
    mode.add_argument("--soak", type=float, metavar="MINUTES")
    mode.add_argument("--arrivals", type=int, metavar="N",
                      help="TTFT of N simultaneous arrivals against a lone arrival's, in alternating rounds")
    mode.add_argument("--replot", metavar="SOAK_JSON", help="summary, CSV and plot again from a soak's soak.json")
    p.add_argument("--model", default="demo")
    p.add_argument("--config", help="engine config TOML (a tune run's recommended.toml)")
    p.add_argument("--ram-budget", help="overrides the config's budget")
    p.add_argument("--max-batch", type=int, help="serve --max-batch (default: the config's; --arrivals: N)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warm-requests", type=int, default=3, help="overhead: warm requests per fresh server")
    p.add_argument("--rounds", type=int, default=5, help="arrivals: rounds of one lone and one simultaneous measurement")
    p.add_argument("--prompt-tokens", type=int, default=64, help="arrivals: prompt length in token ids")
    p.add_argument("--cold", action="store_true",
                   help="arrivals: a fresh server per measurement, the model's page cache dropped before it starts")
    p.add_argument("--every", type=float, default=60.0, help="soak: seconds between samples")
    p.add_argument("--trace", help="soak: replay this request trace (JSON Lines, e.g. "
                                   "benchmarks/serving/traces/chat_burst.jsonl) instead of sequential requests")
    p.add_argument("--trace-gap", type=float, default=1.0,
                   help="soak --trace: seconds between the end of a cycle's last request and the next cycle")
    p.add_argument("--temperature", type=float, default=0.8, help="soak: sampling temperature (0: greedy)")
    p.add_argument("--rss-margin", type=float, default=RSS_MARGIN_MIB,
                   help=f"soak: MiB the settled RSS may span and still be flat (default {RSS_MARGIN_MIB:g})")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `colibri serve` (repeatable), e.g. --serve-arg=--prefix-cache=0")
    p.add_argument("--port", type=int, default=8781)
    p.add_argument("--cgroup-ceiling", default="6GiB", help="the server cgroup's limit: a guard, not the budget "
                                                            "(give the budget itself to measure under it)")
    p.add_argument("--out", help="default: reports/serve-overhead, reports/serve-soak or reports/serve-arrivals")
    benchkit.add_output_flags(p)
    args = p.parse_args()
    if args.arrivals is not None and args.arrivals < 2:
        return benchkit.refuse(TOOL, f"--arrivals {args.arrivals}: at least 2 simultaneous arrivals")
    if args.rounds < 1 or args.tokens < 2 or args.prompt_tokens < 1 or args.every <= 0 or args.trace_gap < 0:
        return benchkit.refuse(TOOL, "--rounds, --prompt-tokens and --every must be positive, --tokens at least 2, "
                                     "--trace-gap at least 0")
    if args.trace and not args.soak:
        return benchkit.refuse(TOOL, "--trace goes with --soak")
    default = "serve-overhead" if args.overhead else "serve-arrivals" if args.arrivals else "serve-soak"
    try:
        # Every write lands in --out, checked first: fresh, empty, or a previous output of this script.
        args.out = str(run_directory_target(args.out or ROOT / "reports" / default, command="serve benchmark",
                                            recognise=OUTPUT,
                                            sources=[x for x in (args.model, args.config, args.trace) if x]))
        if args.trace:
            read_trace(args.trace)  # a bad trace is one line now, not after the server has loaded
    except ColibriError as exc:
        return benchkit.refuse(TOOL, str(exc))
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        if args.replot:
            doc = write_soak(json.loads(Path(args.replot).read_text()), Path(args.out))
        else:
            with benchkit.bench_lock(args.lock):
                doc = overhead(args) if args.overhead else arrivals(args) if args.arrivals else soak(args)
    if args.json:
        emit_json(args, doc)
    return 0


def emit_json(args, doc: dict) -> None:
    """The run's figures as one colibri.bench/1 document: the overhead table's rows (its summary
    as notes) or the soak's samples (its summary and settings as notes)."""
    if "measurements" in doc:  # arrivals: the table's rows, the ratio and the conditions as notes
        benchkit.emit(TOOL, doc["rows"], benchkit.run_conditions(args, described=doc["conditions"]), True, [],
                      notes={"summary": doc["summary"]})
        return
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
    sys.exit(main())
