"""Decode speed per build of the decode kernels on this CPU: torch's ops, the native kernels' AVX2 build
(engine/native/avx2_compat.h) and, where the CPU has AVX512-BF16, their AVX-512 build.

Each build is a `colibri bench` child with its environment (COLIBRI_NATIVE=0: torch's ops;
COLIBRI_NATIVE_ISA=avx2: the AVX2 build even on an AVX-512 CPU), the builds alternated round by round
so the box's drifts load each alike. Resident (--budget 0: warm, one untimed repeat first) and/or under
budgets (each inside a memory cgroup of that size, cold: the model's pages and caches dropped before
each repeat). Columns: decode tok/s (median of the rounds' medians, min-max), x torch (the ratio of
medians to torch's row at the same budget), ms per token, and the kernel the engine reported.

    .venv/bin/python benchmarks/time/native_build.py --model demo [--budget 0,1GiB] [--tokens 64] \
        [--repeats 3] [--rounds 3] [--threads 2] [--json] [--lock FILE]

A build this CPU cannot run is left out and named in the conditions line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import (add_output_flags, bench_lock, emit, fmt_spread, refuse, run_conditions,  # noqa: E402
                                 spread)

TOOL = "native_build"
BUILDS = {"torch": {"COLIBRI_NATIVE": "0"}, "avx2": {"COLIBRI_NATIVE_ISA": "avx2"}, "avx512": {}}


def runnable_builds() -> tuple[list[str], list[str]]:
    """(the builds this CPU runs, the ones it does not)."""
    from engine.api import runnable_native_builds
    native = runnable_native_builds()
    runs = ["torch", *(b for b in ("avx2", "avx512") if b in native)]
    return runs, [b for b in BUILDS if b not in runs]


def bench_once(a, build: str, budget: str) -> dict:
    """One `colibri bench --json` child of this build at this budget → its result."""
    argv = [sys.executable, "-m", "colibri.cli", "bench", "--model", a.model, "--tokens", str(a.tokens),
            "--repeats", str(a.repeats), "--prompt-tokens", str(a.prompt_tokens), "--threads", str(a.threads),
            "--json"]
    if budget == "0":
        argv += ["--warm", "--ram-budget", "0"]
    else:
        argv += ["--cold", "--ram-budget", budget, "--cgroup-limit", budget]
    env = {k: v for k, v in os.environ.items() if k not in ("COLIBRI_NATIVE", "COLIBRI_NATIVE_ISA")}
    env.update(BUILDS[build])
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise SystemExit(f"{TOOL}: {build} under {budget} failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model directory or synth preset (demo)")
    ap.add_argument("--budget", default="0", help="comma-separated budgets; 0: resident (default 0)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="repeats per child (their median is the round's)")
    ap.add_argument("--rounds", type=int, default=3, help="children per build, alternated (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1800)
    add_output_flags(ap)
    a = ap.parse_args(argv)
    if a.rounds < 1 or a.repeats < 1 or a.tokens < 1:
        return refuse(TOOL, "--rounds, --repeats and --tokens must be at least 1")
    builds, absent = runnable_builds()
    budgets = [b.strip() for b in a.budget.split(",") if b.strip()]
    rows = []
    with bench_lock(a.lock):
        for budget in budgets:
            rates: dict[str, list[float]] = {b: [] for b in builds}
            kernel: dict[str, str] = {}
            for r in range(a.rounds):
                order = builds[r % len(builds):] + builds[:r % len(builds)]
                for build in order:
                    res = bench_once(a, build, budget)
                    rates[build].append(res["decode_tok_s"])
                    kernel[build] = res.get("kernel", "?")
                print(f"{TOOL}: budget {budget}, round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
            base = statistics.median(rates["torch"])
            for build in builds:
                med = statistics.median(rates[build])
                rows.append({"budget": budget, "build": build, "tok_s": spread(rates[build]),
                             "x_torch": round(med / base, 2) if base else None,
                             "ms_per_token": round(1000 / med, 3) if med else None, "kernel": kernel[build]})
    cond = run_conditions(a, cold=any(b != "0" for b in budgets), not_run_here=",".join(absent) or "-")
    emit(TOOL, rows, cond, a.json, [
        ("budget", lambda r: r["budget"]), ("build", lambda r: r["build"]),
        ("decode tok/s", lambda r: fmt_spread(r["tok_s"])), ("x torch", lambda r: r["x_torch"]),
        ("ms/token", lambda r: r["ms_per_token"]), ("kernel", lambda r: r["kernel"])])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
