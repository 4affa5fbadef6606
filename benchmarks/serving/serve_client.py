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
script); every file is written by temp + rename. This script is --overhead and the command line;
the server is serve_process.py's, --arrivals serve_arrivals.py's, --soak and --replot
serve_soak.py's, the clients serve_load.py's (helper modules, not commands).

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
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.api import (ColibriError, any_of, atomic_write_text, git_commit, is_kv_root, read_trace,  # noqa: E402
                        run_directory_target, stamped)
from benchmarks import benchkit  # noqa: E402
from benchmarks.serving.serve_arrivals import arrivals  # noqa: E402
from benchmarks.serving.serve_load import PROMPT, streamed  # noqa: E402
from benchmarks.serving.serve_process import TOOL, ServerProcess, engine_side  # noqa: E402
from benchmarks.serving.serve_soak import RSS_MARGIN_MIB, soak, write_soak  # noqa: E402


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
