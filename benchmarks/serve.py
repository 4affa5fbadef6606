"""`colibri serve` measured from a client: the HTTP overhead per token, and a soak.

--overhead: the same prompt and token count through the server (streamed, timed at the client:
TTFT = first text chunk, decode = the chunks after it) and through `colibri run --json` (the
engine's own timings), alternated, --repeats each; prints medians and the spread, and the
overhead per decode token (client-seen s/token minus the engine's).

--soak MINUTES: sequential requests for that long; every --every seconds the server's RSS, its
cgroup memory (when it runs in one), the RAM hit rate and the tokens served are sampled from
/metrics; writes JSON and a PNG plot under --out.

Both start the server as a subprocess on demo (or --model) with --config / --ram-budget, and say
whether it ran in a memory cgroup (it does not, unless started inside one: the engine's own
memory plan holds the budget).

    .venv/bin/python benchmarks/serve.py --overhead [--model demo --ram-budget 1GiB --tokens 32 --repeats 3]
    .venv/bin/python benchmarks/serve.py --soak 30 [--out reports/serve-soak]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.run.metrics import git_commit  # noqa: E402
from engine.serve.metrics import cgroup_memory_bytes  # noqa: E402

PROMPT = "The streaming engine reads the routed experts of each layer from the disk, and"


def start_server(args, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tuner.cli", "serve", "--model", args.model, "--port", str(port),
           "--ram-budget", args.ram_budget, "--model-name", "bench", *(["--config", args.config] if args.config else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serve exited: {proc.stderr.read()[-500:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("serve did not come up")


def streamed(base: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    times = []
    with httpx.stream("POST", base + "/v1/completions", timeout=600, json={
            "model": "bench", "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        usage = None
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter() - t0)
    n = usage["completion_tokens"] if usage else len(times)
    decode = (times[-1] - times[0]) / max(n - 1, 1) if len(times) > 1 else None
    return {"ttft_s": times[0] if times else None, "s_per_token": decode, "tokens": n}


def engine_run(args, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "tuner.cli", "run", "--model", args.model, "--prompt", PROMPT, "--max-new-tokens",
           str(tokens), "--ram-budget", args.ram_budget, "--json", *(["--config", args.config] if args.config else [])]
    out = json.loads(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout)
    return {"ttft_s": out["ttft_s"], "s_per_token": 1 / out["decode_tok_s"] if out.get("decode_tok_s") else None,
            "tokens": out["generated_tokens"]}


def _med(rows, key):
    vals = [r[key] for r in rows if r[key] is not None]
    return (statistics.median(vals), min(vals), max(vals)) if vals else (None, None, None)


def overhead(args) -> dict:
    proc = start_server(args, args.port)
    base = f"http://127.0.0.1:{args.port}"
    try:
        streamed(base, 4)  # warm-up: the first request pays the kernels' first call
        served, direct = [], []
        for _ in range(args.repeats):
            served.append(streamed(base, args.tokens))
            direct.append(engine_run(args, args.tokens))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    rows = {"served": served, "run": direct}
    print(f"serve vs run: {args.model}, ram_budget {args.ram_budget}, {args.tokens} tokens, greedy, "
          f"{args.repeats} alternated repeats (server warm after its first request; each run a fresh process), "
          f"no cgroup, commit {git_commit()}")
    print(f"{'path':8} {'TTFT s (median [min, max])':>30} {'ms/token (median [min, max])':>32}")
    for name, rs in rows.items():
        t, s = _med(rs, "ttft_s"), _med(rs, "s_per_token")
        print(f"{name:8} {t[0]:>12.3f} [{t[1]:.3f}, {t[2]:.3f}]   {s[0] * 1e3:>12.2f} [{s[1] * 1e3:.2f}, {s[2] * 1e3:.2f}]")
    diff = _med(served, "s_per_token")[0] - _med(direct, "s_per_token")[0]
    print(f"HTTP + streaming overhead per decode token: {diff * 1e3:+.2f} ms (client-seen minus the engine's)")
    return rows


def _metric(text: str, name: str, label: str = "") -> float | None:
    m = re.search(rf"^{re.escape(name)}{re.escape(label)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def soak(args) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    proc = start_server(args, args.port)
    base = f"http://127.0.0.1:{args.port}"
    samples, t0, next_sample, n = [], time.monotonic(), 0.0, 0
    try:
        while (elapsed := time.monotonic() - t0) < args.soak * 60:
            streamed(base, args.tokens)
            n += 1
            if elapsed >= next_sample:
                text = httpx.get(base + "/metrics", timeout=30).text
                samples.append({"t_s": round(elapsed, 1), "requests": n,
                                "rss_bytes": _metric(text, "colibri_process_rss_bytes"),
                                "cgroup_bytes": _metric(text, "colibri_cgroup_memory_bytes"),
                                "ram_hit_rate": _metric(text, "colibri_expert_hit_rate", '{tier="ram"}'),
                                "tokens": _metric(text, "colibri_generated_tokens_total")})
                print(json.dumps(samples[-1]), flush=True)
                next_sample += args.every
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"model": args.model, "ram_budget": args.ram_budget, "tokens_per_request": args.tokens,
           "minutes": args.soak, "commit": git_commit(), "cgroup": cgroup_memory_bytes() is not None, "samples": samples}
    (out / "soak.json").write_text(json.dumps(doc, indent=1))
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ts = [s["t_s"] / 60 for s in samples]
    a.plot(ts, [s["rss_bytes"] / 2**20 for s in samples], label="server RSS")
    if any(s["cgroup_bytes"] for s in samples):
        a.plot(ts, [(s["cgroup_bytes"] or 0) / 2**20 for s in samples], label="cgroup memory")
    a.set_ylabel("MiB")
    a.legend()
    b.plot(ts, [s["ram_hit_rate"] or 0 for s in samples])
    b.set_ylabel("RAM hit rate (since start)")
    b.set_xlabel("minutes")
    fig.suptitle(f"colibri serve soak: {args.model}, {args.ram_budget}, {args.tokens} tokens/request")
    fig.savefig(out / "soak.png", dpi=100)
    print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
    return doc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--overhead", action="store_true")
    mode.add_argument("--soak", type=float, metavar="MINUTES")
    p.add_argument("--model", default="demo")
    p.add_argument("--config")
    p.add_argument("--ram-budget", default="1GiB")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every", type=float, default=60.0, help="soak: seconds between samples")
    p.add_argument("--port", type=int, default=8781)
    p.add_argument("--out", default=str(ROOT / "reports" / "serve-soak"))
    args = p.parse_args()
    overhead(args) if args.overhead else soak(args)


if __name__ == "__main__":
    main()
