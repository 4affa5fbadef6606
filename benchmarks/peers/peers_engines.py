"""The engines benchmarks/peers/peers.py races, each run once in a memory cgroup of its limit
(a helper of peers.py, not a command): `run_ours` (`colibri run`, io_mode direct, or resident),
`run_llama_simple` and `run_llama_bench` (llama.cpp's programs), `run_accelerate` (transformers +
accelerate disk offload, benchmarks/peers/peers_hf.py). Each returns one row of the race: the
engine, the mode, its status (ok, timeout, oom, or the exit), its cgroup peak and its figures.
peers.py's docstring says how each is invoked and capped.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from tuner.sandbox import run_limited

REPO = Path(__file__).resolve().parents[2]


def _result(engine, mode, run, **fields) -> dict:
    status = "ok"
    if run.timed_out:
        status = "timeout"
    elif run.oom_killed:
        status = "oom"
    elif run.returncode != 0:
        status = f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1][:120] if run.stderr.strip() else ''}"
    return {"engine": engine, "mode": mode, "status": status, "wall_s": run.wall_seconds,
            "peak_bytes": run.peak_bytes, "limit_bytes": run.limit_bytes, "limited": run.limited,
            "cgroup_reason": run.reason, **fields}


def run_ours(args, model: Path, mode: str, limit: int) -> dict:
    argv = [sys.executable, "-m", "colibri.cli", "run", "--model", str(model), "--prompt", args.prompt,
            "--max-new-tokens", str(args.tokens), "--threads", str(args.threads), "--ctx-size", "256", "--json"]
    if args.ours_config:
        argv += ["--config", args.ours_config]
    argv += ["--ram-budget", "0"] if mode == "resident" else ["--ram-budget", str(args.ours_budget or limit),
                                                              "--io-mode", "direct"]
    src = str(Path(args.ours_src).resolve())  # cwd too: `-m` puts it first on sys.path, ahead of PYTHONPATH
    run = run_limited(argv, limit, timeout=args.cap_seconds + 120, cwd=src, env={**os.environ, "PYTHONPATH": src})
    fields = {}
    if run.returncode == 0 and not run.timed_out:
        out = json.loads(run.stdout)
        fields = {"load_s": out.get("load_seconds"), "ttft_s": out["ttft_s"], "decode_tok_s": out["decode_tok_s"],
                  "tokens": out["generated_tokens"], "prompt_ids": out["prompt_ids"],
                  "output_ids": out["output_ids"], "bytes_read": out.get("bytes_read")}
    return _result("ours", mode, run, **fields)


_PERF = re.compile(r"(load|prompt eval|eval) time =\s*([\d.]+) ms(?: /\s*(\d+) (?:tokens|runs))?")


def run_llama_simple(args, gguf: Path, mode: str, limit: int, bench_rate: float | None) -> dict:
    # llama-simple cannot stop itself at a time limit and prints its timings only at the end, so
    # when llama-bench (run first) says the cap would not hold --tokens, ask for fewer.
    n = args.tokens
    if bench_rate:
        n = max(4, min(n, int(0.6 * args.cap_seconds * bench_rate)))
    argv = [str(Path(args.llama_dir) / "build/bin/llama-simple"), "-m", str(gguf), "-n", str(n), args.prompt]
    run = run_limited(argv, limit, timeout=args.cap_seconds)
    fields: dict = {"threads": 4}
    perf = {m.group(1): (float(m.group(2)) / 1e3, int(m.group(3) or 0)) for m in _PERF.finditer(run.stderr)}
    if "eval" in perf:
        eval_s, runs = perf["eval"]
        fields.update(load_s=perf["load"][0], ttft_s=perf["prompt eval"][0], tokens=runs + 1,
                      decode_tok_s=runs / eval_s if eval_s else None)
    text = run.stdout
    fields["text"] = text[len(args.prompt):].rstrip("\n") if text.startswith(args.prompt) else None
    fields["prompt_echo_ok"] = text.startswith(args.prompt)
    return _result("llama-simple", mode, run, **fields)


def run_llama_bench(args, gguf: Path, mode: str, limit: int, prompt_len: int) -> dict:
    argv = [str(Path(args.llama_dir) / "build/bin/llama-bench"), "-m", str(gguf), "-t", str(args.threads),
            "-n", str(args.tokens), "-o", "json"]
    resident_p = prompt_len if args.bench_prompt_tokens is None else args.bench_prompt_tokens
    argv += ["-p", "0", "-r", "1", "--no-warmup"] if mode == "cold" else ["-p", str(resident_p), "-r",
                                                                            str(args.repeats)]
    run = run_limited(argv, limit, timeout=args.cap_seconds)
    fields: dict = {"threads": args.threads}
    try:
        rows = json.loads(run.stdout)
    except ValueError:
        rows = []
    for row in rows:
        if row.get("n_gen"):
            fields.update(decode_tok_s=row["avg_ts"], decode_sd=row.get("stddev_ts"), tokens=row["n_gen"],
                          repeats=len(row.get("samples_ts", [])), build_commit=row.get("build_commit"),
                          cpu=row.get("cpu_info"), model_type=row.get("model_type"))
        elif row.get("n_prompt"):
            fields.update(prefill_tok_s=row["avg_ts"])
    return _result("llama-bench", mode, run, **fields)


def run_accelerate(args, model: Path, mode: str, limit: int, offload: Path) -> dict:
    argv = [sys.executable, str(REPO / "benchmarks" / "peers" / "peers_hf.py"), "--model", str(model), "--prompt",
            args.prompt, "--tokens", str(args.tokens), "--threads", str(args.threads),
            "--cap-seconds", str(args.cap_seconds)]
    argv += ["--resident"] if mode == "resident" else ["--offload-dir", str(offload)]
    # The cap stops generation; loading (which writes the fused experts to the offload folder) is extra.
    run = run_limited(argv, limit, timeout=args.cap_seconds + args.load_cap_seconds)
    fields = {"threads": args.threads}
    if run.returncode == 0 and not run.timed_out:
        out = json.loads(run.stdout.strip().splitlines()[-1])
        fields.update(load_s=out["load_s"], ttft_s=out["ttft_s"], decode_tok_s=out["decode_tok_s"],
                      tokens=len(out["output_ids"]), output_ids=out["output_ids"], prompt_ids=out["prompt_ids"],
                      capped=out["stopped_at_cap"])
    return _result("transformers+accelerate" if mode == "cold" else "transformers", mode, run, **fields)
