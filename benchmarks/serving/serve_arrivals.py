"""serve_client.py --arrivals N: time to first token of N requests arriving at once against one
arriving alone (a helper of serve_client.py, not a command; its docstring has the method).

`arrivals(args)` runs the rounds (resident: one warmed server; --cold: a fresh server per
measurement, the model's pages dropped) and writes arrivals.json; `arrival_rows` makes the table's
rows (TTFT percentiles per kind, the per-rank staircase, the server log's wait).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks import benchkit
from benchmarks.io.page_cache import cached_bytes, drop_pages
from benchmarks.serving.serve_load import log_requests, percentile, rounded, simultaneous
from benchmarks.serving.serve_process import TOOL, ServerProcess
from engine.api import atomic_write_text, git_commit, model_args, random_prompt_ids, resolve_model


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
    commit = git_commit()  # the tree the servers run: taken before the first starts
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
                  f", server cgroup: {note}, commit {commit}")
    summary = {"p95_ratio": rounded(ratio), "target": ARRIVALS_TARGET,
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
                     "ttft_p50_s": rounded(percentile(ttfts, 50)), "ttft_p95_s": rounded(percentile(ttfts, 95)),
                     "ttft_max_s": rounded(max(ttfts, default=None)),
                     "by_rank_s": [rounded(statistics.median(x[k] for x in ranked)) for k in range(width)],
                     "engine_wait_p95_s": rounded(percentile([e["wait_s"] for e in engine], 95)),
                     "engine_first_p95_s": rounded(percentile([e["arrival_to_first_s"] for e in engine], 95)),
                     "ms_per_token_p50": rounded(percentile([r["s_per_token"] * 1e3 for r in reqs
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
