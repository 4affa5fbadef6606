"""Resident prefill against llama.cpp: one prompt length, our engine at each prefill pass, llama-bench -p.

    .venv/bin/python benchmarks/time/prefill_race.py --gguf ../peers-work/demo-bf16.gguf \
        --llama-dir ../llama.cpp [--model demo] [--prompt-tokens 512,1024] [--chunks 0,256] [--runs 3]

For each prompt length and run: `colibri bench --ram-budget 0 --warm --tokens 1 --prompt-tokens N`
(this tree's CLI; ctx 2N) at every --chunks value (0: the engine's default pass, `EngineConfig.prefill_pass`;
a number: `--prefill-chunk`), then `llama-bench -p N -n 0 -r 1` (its default 512-token ubatch), all
interleaved within a run so the box's drift falls on every side. The table gives each side's prefill
tok/s, median (min-max) over --runs, and its ratio to llama-bench's median. The GGUF is the same model,
converted by benchmarks/peers/peers.py (WORK/<preset>-bf16.gguf); llama.cpp by scripts/build_llama_cpp.sh.
Resident: weights in memory, so the disk does not enter (warm: the figure is the second prefill).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.benchkit import conditions, emit, fmt_spread, refuse, spread  # noqa: E402

TOOL = "prefill_race"


def ours(model: str, prompt_tokens: int, chunk: int, threads: int) -> float:
    argv = [sys.executable, "-m", "colibri.cli", "bench", "--model", model, "--ram-budget", "0", "--warm",
            "--tokens", "1", "--prompt-tokens", str(prompt_tokens), "--ctx-size", str(2 * prompt_tokens),
            "--threads", str(threads), "--json"] + (["--prefill-chunk", str(chunk)] if chunk else [])
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{TOOL}: error: colibri bench failed: {out.stderr.strip()[-400:]}")
    return float(json.loads(out.stdout)["prefill_tok_s"])


def llama(llama_dir: Path, gguf: Path, prompt_tokens: int, threads: int) -> float:
    argv = [str(llama_dir / "build/bin/llama-bench"), "-m", str(gguf), "-p", str(prompt_tokens), "-n", "0",
            "-r", "1", "-t", str(threads), "-o", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    rows = json.loads(out.stdout) if out.returncode == 0 else []
    if not rows:
        raise SystemExit(f"{TOOL}: error: llama-bench failed: {out.stderr.strip()[-400:]}")
    return float(rows[0]["avg_ts"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", help="our model: a directory or a synth preset (default demo)")
    ap.add_argument("--gguf", required=True, help="the same model as a bf16 GGUF (benchmarks/peers/peers.py makes it)")
    ap.add_argument("--llama-dir", required=True, help="a llama.cpp built by scripts/build_llama_cpp.sh")
    ap.add_argument("--prompt-tokens", default="512", help="comma list of prompt lengths (default 512)")
    ap.add_argument("--chunks", default="0,256", help="our prefill passes, comma list; 0 = the default (default 0,256)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        lengths = [int(v) for v in a.prompt_tokens.split(",")]
        chunks = [int(v) for v in a.chunks.split(",")]
    except ValueError:
        return refuse(TOOL, "--prompt-tokens and --chunks take comma lists of integers")
    llama_dir, gguf = Path(a.llama_dir), Path(a.gguf)
    if not (llama_dir / "build/bin/llama-bench").exists():
        return refuse(TOOL, f"no llama-bench under {llama_dir}/build/bin (scripts/build_llama_cpp.sh builds it)")
    if not gguf.is_file():
        return refuse(TOOL, f"no GGUF at {gguf}")
    cond = conditions(model=a.model, resident=True, threads=a.threads, runs=a.runs)
    samples: dict[tuple[int, str], list[float]] = {}
    for r in range(a.runs):
        for n in lengths:
            for chunk in chunks:
                print(f"run {r + 1}/{a.runs}: ours, {n}-token prompt, pass {chunk or 'default'} ...", file=sys.stderr)
                samples.setdefault((n, f"ours, pass {chunk or 'default'}"), []).append(ours(a.model, n, chunk, a.threads))
            print(f"run {r + 1}/{a.runs}: llama-bench pp{n} ...", file=sys.stderr)
            samples.setdefault((n, "llama-bench"), []).append(llama(llama_dir, gguf, n, a.threads))
    rows = []
    for (n, side), values in samples.items():
        s = spread(values)
        theirs = spread(samples[(n, "llama-bench")])["median"]
        rows.append({"prompt_tokens": n, "side": side, "prefill_tok_s": s, "samples": values,
                     "vs_llama_bench": s["median"] / theirs})
    emit(TOOL, rows, cond, a.json, [("prompt tokens", lambda r: r["prompt_tokens"]), ("side", lambda r: r["side"]),
                                    ("prefill tok/s", lambda r: fmt_spread(r["prefill_tok_s"], 1)),
                                    ("/ llama-bench", lambda r: f"{r['vs_llama_bench']:.2f}x")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
