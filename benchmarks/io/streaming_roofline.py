"""Streaming decode speed against its roofline bound, before and after, in one run.

For a handful of configs on `demo` under a 1 GiB budget, cold, each run as a real trial
(`colibri bench` in a subprocess inside a memory cgroup limited to the budget):

    bound s/token = bytes read per decode token / fio bandwidth at (request, QD, mode)
                    + compute s/token of the fully resident run (same source tree, measured at
                      the start and at the end of the run; the faster one is used)

and the ratio measured tok/s / bound tok/s. The disk term is measured by fio at exactly the
engine's read pattern (benchmarks/io/io_bound.py fio) — request = what one read request of the
engine is (this tree: one request per expert span, split across the workers only past
chunk_size; the old tree: chunk size pieces), QD = io_threads synchronous readers,
direct/buffered/mmap as the config, inside a cgroup of the budget (so buffered/mmap fio cannot
read from a page cache larger than the engine's) — right before and right after the streaming
run (fio, stream, fio; with --before-src: fio, after, fio, before, fio, the middle job shared
when both trees issue the same request; the second run of --runs puts before first, and so on), and the bound uses their mean. A row whose two fio
figures differ by more than 20% is marked: the disk changed under it.

Each fio job runs --fio-seconds (default 10 s). Why 10: this virtual disk's per-second rate
at the engine's pattern wanders by +-5-10% (benchmarks/io/io_bound.py fio's trace); two 2-5 s jobs
differed by up to 21%, two 10 s jobs by 1-4%, and 20 s bought nothing more
(docs/BENCHMARKS.md, "fio job length"). 10 s is also about the length of one streaming run
here, so fio and the engine see the disk over comparable stretches.

--trace-bound measures the disk term under the engine's own load instead (this tree only; see
benchmarks/io/io_bound.py replay): each streaming run records its read trace, and fio replays that
trace paced by the resident compute per token, right before (the previous run's trace) and
right after (this run's) the streaming run; the bound is the mean of the two replays' s/token.
The continuous fio figures and their bound are printed next to it.

--before-src DIR runs every config a second time with the engine and CLI of DIR (for example
the read-only checkout of the previous commit), right after this tree's run of the same config,
so before/after are measured in the same run and minutes apart.

Every measurement holds the shared benchmark lock (benchkit.bench_lock on --lock) only for its own
config. --json prints every run's rows as one colibri.bench/1 document (benchkit.emit) instead of
the tables.

    .venv/bin/python benchmarks/io/streaming_roofline.py [--before-src /work/wt/base] [--only NAME ...]
        [--tokens 8] [--repeats 2] [--runs 1] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TOOL = "streaming_roofline"
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.api import (EngineConfig, PREFILL_CHUNK, format_size, git_commit, parse_size,  # noqa: E402
                        physical_cores, resolve_model)
from tuner.search.trial import run_trial  # noqa: E402
from benchmarks.benchkit import bench_lock, emit, run_conditions  # noqa: E402
from benchmarks.io import io_bound as trace_bound  # noqa: E402
from benchmarks.io.io_jobs import fio_run, request_bytes  # noqa: E402


def configs(budget: int) -> dict[str, EngineConfig]:
    cores = physical_cores()
    # chunk_size is spelt out where a config once used the old 1 MiB default, so the table stays
    # the table the issue compares (the default is 4 MiB now); prefill_chunk too, as a --before-src
    # tree older than its 0 (= by the budget) reads the config this tree writes.
    base = EngineConfig(ram_budget=budget, ctx_size=512, chunk_size=1 << 20, prefill_chunk=PREFILL_CHUNK)
    return {
        "rule of thumb": base.replace(prefetch_depth=2, threads=cores, cpu_cache_ratio=1.0, io_mode="buffered"),
        "direct 1MiB pf1 io4": base.replace(io_mode="direct", chunk_size=1 << 20, prefetch_depth=1, io_threads=4),
        "direct 4MiB pf1 io8": base.replace(io_mode="direct", chunk_size=4 << 20, prefetch_depth=1, io_threads=8),
        "direct 1MiB pf0 io4": base.replace(io_mode="direct", chunk_size=1 << 20, prefetch_depth=0, io_threads=4),
        "direct 1MiB pf2 cache0.6": base.replace(io_mode="direct", prefetch_depth=2, cpu_cache_ratio=0.6),
        "buffered pf1 cache0.6": base.replace(io_mode="buffered", prefetch_depth=1, cpu_cache_ratio=0.6),
        "mmap pf1 cache0.6": base.replace(io_mode="mmap", prefetch_depth=1, cpu_cache_ratio=0.6),
    }


def selected_configs(budget: int, only, vary: str | None) -> list[tuple[str, EngineConfig]]:
    """The configs to run (--only), each in every variant of --vary KEY=V1,V2 (say
    chunk_size=1MiB,4MiB: one read per span against spans split across the readers)."""
    chosen = [(n, c) for n, c in configs(budget).items() if not only or n in only]
    if not vary:
        return chosen
    key, _, values = vary.partition("=")
    if key not in EngineConfig.field_names() or not values:
        raise SystemExit(f"streaming: error: --vary wants KEY=V1,V2 with an engine config key, got {vary!r}")
    out = []
    for name, cfg in chosen:
        for v in values.split(","):
            current = getattr(cfg, key)
            # Sizes go through the config's own parser ("4MiB"); other keys keep their type.
            value = v if key in ("chunk_size", "ram_budget") or isinstance(current, str) else type(current)(v)
            changed = EngineConfig.from_dict({**cfg.to_dict(), key: value})
            out.append((f"{name} [{key}={v}]", changed))
    return out


_HELD = {"whole_run": False}
_BEST_RESIDENT: dict = {}  # side -> fastest resident tok/s so far
_TRACES: dict = {}  # (config, run index) -> the read trace its streaming run recorded


def _config_lock(path: str):
    """The shared lock for one config, unless --one-lock already holds it for the whole run."""
    return bench_lock(None if _HELD["whole_run"] else path)


@contextlib.contextmanager
def source_tree(src: str | None):
    """Run trials with one tree's engine and CLI: `python -m` puts the cwd first on sys.path,
    so the subprocess needs both the cwd and PYTHONPATH of that tree (None: this one)."""
    tree = str(Path(src).resolve()) if src else str(ROOT)
    old_path, old_cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    os.environ["PYTHONPATH"] = tree
    os.chdir(tree)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path


def resident_row(model_dir, a, src) -> dict:
    with source_tree(src), _config_lock(a.lock):
        t = run_trial(model_dir, EngineConfig(ctx_size=512, prefill_chunk=PREFILL_CHUNK), tokens=a.tokens,
                      repeats=a.repeats, cold=False, prompt_tokens=a.prompt_tokens, timeout=1800)
    if not t.ok:
        raise SystemExit(f"resident run failed ({src or 'this tree'}): {t.error}")
    m = t.metrics
    return dict(name="resident (no budget)", side=_side(src), tok_s=m["decode_tok_s"],
                spread=m["summary"]["decode_tok_s"], bytes_per_token=0, bound_tok_s=m["decode_tok_s"], ratio=1.0,
                hit=None, stall=None, recall=None, peak=m["peak_rss_bytes"], cgroup_peak=None, io="resident",
                commit=m.get("git_commit"), output_ids=m.get("output_ids"))


def _side(src) -> str:
    return "before" if src else "after"


def stream_row(name, cfg, model_dir, a, src, extra=None) -> dict:
    with source_tree(src):
        t = run_trial(model_dir, cfg, tokens=a.tokens, repeats=a.repeats, cold=True, prompt_tokens=a.prompt_tokens,
                      limit_bytes=parse_size(a.budget), timeout=1800, extra_args=extra)
    if not t.ok:
        return dict(name=name, side=_side(src), error=f"{t.status}: {t.error}")
    m = t.metrics
    return dict(name=name, side=_side(src), tok_s=m["decode_tok_s"], spread=m["summary"]["decode_tok_s"],
                bytes_per_token=m["bytes_read_per_token"], hit=(m.get("hit_rate") or {}).get("ram"),
                stall=m.get("io_stall_fraction"), recall=m.get("lookahead_recall"), peak=m["peak_rss_bytes"],
                cgroup_peak=t.cgroup_peak_bytes, read_gbps=m.get("read_gbps"), io=m["io_mode_effective"], commit=m.get("git_commit"),
                output_ids=m.get("output_ids"), cold_method=m.get("cold_method"),
                backend=m.get("io_backend_effective"), cpu_s_per_token=m.get("cpu_s_per_token"))


def run_table(model_dir, a, fio: str, files: list[Path], run: int = 0) -> list[dict]:
    sides = [None] + ([a.before_src] if a.before_src else [])
    # The side that streams first in a run was the slower one in all 7 pairs of 2026-12-02 (0.52-0.70x
    # first, 1.02-1.08x second, whichever tree it was): the disk's state after the first fio job, not
    # the engine. So the order alternates from run to run; read a ratio over an even --runs.
    if run % 2:
        sides.reverse()
    # The compute term: this run's resident decode of the same tree, measured at the start and
    # again at the end of the run; the faster of the two is the compute (the work is the same,
    # a slower one only met interference), and both are printed.
    resident = {src: resident_row(model_dir, a, src) for src in sides}
    rows = [resident[src] for src in sides]
    # The paced replay's compute gap: the fastest resident run of this tree so far in this script run
    # (before the first run's replays, two: one slow resident run would stretch every gap of that run).
    if a.trace_bound and None not in _BEST_RESIDENT:
        _BEST_RESIDENT[None] = resident_row(model_dir, a, None)["tok_s"]
    _BEST_RESIDENT[None] = max(_BEST_RESIDENT.get(None, 0.0), resident[None]["tok_s"])
    streamed = []
    span = None
    limit = parse_size(a.budget)
    for name, cfg in selected_configs(limit, a.only, a.vary):
        print(f"running {name} ...", file=sys.stderr)
        if span is None:
            from engine.api import Checkpoint
            from engine.api import ExpertLayout
            from engine.api import model_args
            ckpt = Checkpoint(model_dir)
            span = ExpertLayout(ckpt, model_args(ckpt.config)).expert_nbytes
        with _config_lock(a.lock):
            if a.trace_bound:
                streamed.append(trace_bound.measure_row(
                    name, cfg, stream=lambda extra: stream_row(name, cfg, model_dir, a, None, extra), fio=fio,
                    files=files, limit=limit, request=request_bytes(cfg.chunk_size, cfg.io_threads, span, False),
                    fio_seconds=a.fio_seconds, compute_s=1 / _BEST_RESIDENT[None], passes=a.replay_passes,
                    traces=_TRACES, trace_dir=a.trace_dir))
                streamed[-1]["load_avg_1m"] = os.getloadavg()[0]
                continue
            # fio, stream, fio[, stream, fio]: each streaming run sits between two fio jobs at its
            # own pattern; sides with the same request share the fio job between them.
            last = None  # (request, bytes/s) of the fio job just run
            for src in sides:
                request = request_bytes(cfg.chunk_size, cfg.io_threads, span, old_tree=src is not None)

                def fio_now():
                    return fio_run(fio, files, request, cfg.io_threads, cfg.io_mode, a.fio_seconds, limit)["bw"]

                before_fio = last[1] if last and last[0] == request else fio_now()
                row = stream_row(name, cfg, model_dir, a, src)
                after_fio = fio_now()
                last = (request, after_fio)
                row.update(bw=(before_fio + after_fio) / 2, fio=(before_fio, after_fio), request=request)
                row["load_avg_1m"] = os.getloadavg()[0]  # the box is shared: say how busy it was
                streamed.append(row)
    for src in sides:
        again = resident_row(model_dir, a, src)
        first = resident[src]
        first["resident_tok_s"] = (first["tok_s"], again["tok_s"])
        first["tok_s"] = first["bound_tok_s"] = max(first["tok_s"], again["tok_s"])
    for row in streamed:
        if "error" not in row:
            compute_s = 1.0 / resident[None if row["side"] == "after" else a.before_src]["tok_s"]
            bound_s = row["bytes_per_token"] / row["bw"] + compute_s
            row.update(compute_s=compute_s, bound_tok_s=1 / bound_s, ratio=row["tok_s"] * bound_s)
            if "replay" in row:
                trace_bound.finish_row(row, compute_s)
    return rows + streamed


def print_table(rows: list[dict]) -> None:
    pct = (lambda v: "-" if v is None else f"{v:.0%}")
    print("| config | side | io | decode tok/s (median, min-max) | MiB read/token | engine read GB/s "
          "| request: fio GB/s before / after (mean) | bound tok/s | measured/bound | RAM hit | I/O stall "
          "| peak RSS | cgroup peak | tokens = after | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    after_ids = {r["name"]: r.get("output_ids") for r in rows if r.get("side") == "after"}
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r['side']} | | {r['error']} | | | | | | | | | | | |")
            continue
        s = r["spread"]
        fio = r.get("fio")
        fio_cell = (f"{format_size(r['request'])}: {fio[0] / 1e9:.2f} / {fio[1] / 1e9:.2f} ({r['bw'] / 1e9:.2f})"
                    + (" unstable" if abs(fio[0] - fio[1]) > 0.2 * r["bw"] else "") if fio else "-")
        gbps = r.get("read_gbps")
        if r["io"] == "resident":  # both resident runs of this run (start, end); the faster is used
            runs = " ".join(f"{v:.3f}" for v in r.get("resident_tok_s", [r["tok_s"]]))
            print(f"| {r['name']} | {r['side']} | resident | {r['tok_s']:.3f} (runs: {runs}) "
                  f"| 0 | - | - | - | - | - | - | {format_size(r['peak'])} | - | - | - |")
            continue
        same = ("ref" if r["side"] == "after" else
                "yes" if r.get("output_ids") == after_ids.get(r["name"]) else "no")
        print(f"| {r['name']} | {r['side']} | {r['io']} | {r['tok_s']:.3f} ({s['min']:.3f}-{s['max']:.3f}) | "
              f"{r['bytes_per_token'] / 2**20:.0f} | {'-' if not gbps else f'{gbps:.2f}'} | {fio_cell} | "
              f"{r['bound_tok_s']:.3f} | {r['ratio']:.2f} | {pct(r['hit'])} | {pct(r['stall'])} | "
              f"{format_size(r['peak'])} | {format_size(r['cgroup_peak'])} | {same} | "
              f"{r.get('load_avg_1m', float('nan')):.1f} |")
    best = {side: max((r for r in rows if r.get("side") == side and "error" not in r and r["io"] != "resident"),
                      key=lambda r: r["tok_s"], default=None) for side in ("after", "before")}
    if best["after"] and best["before"]:
        print(f"\nbest after: {best['after']['name']} {best['after']['tok_s']:.3f} tok/s; best before: "
              f"{best['before']['name']} {best['before']['tok_s']:.3f} tok/s; "
              f"ratio {best['after']['tok_s'] / best['before']['tok_s']:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--before-src", help="also run every config with this source tree (the old engine)")
    ap.add_argument("--fio-seconds", type=float, default=10.0)
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole table (bound ratio over runs)")
    ap.add_argument("--lock", default="/tmp/colibri-bench.lock")
    ap.add_argument("--one-lock", action="store_true",
                    help="hold the lock for the whole run (fewer waits on a busy box; keep the run short)")
    ap.add_argument("--only", nargs="*", help="config names to run")
    ap.add_argument("--vary", metavar="KEY=V1,V2", help="run each config once per value of one engine setting")
    ap.add_argument("--trace-bound", action="store_true",
                    help="the bound's disk term from fio replays of each run's own read trace (io_bound.py replay)")
    ap.add_argument("--replay-passes", type=int, default=4, help="--trace-bound: passes of the trace per replay")
    ap.add_argument("--trace-dir", help="--trace-bound: keep the read traces here (default: a temp directory)")
    ap.add_argument("--json", action="store_true", help="print one colibri.bench/1 JSON document")
    a = ap.parse_args()
    if a.trace_bound and a.before_src:
        print("streaming: error: --trace-bound replays this tree's traces; run --before-src without it",
              file=sys.stderr)
        return 2
    if a.trace_bound and not a.trace_dir:
        a.trace_dir = tempfile.mkdtemp(prefix="colibri-traces-")
    elif a.trace_dir:
        Path(a.trace_dir).mkdir(parents=True, exist_ok=True)
    fio = shutil.which("fio")
    if fio is None:
        print("streaming: error: fio not found (apt-get install fio)", file=sys.stderr)
        return 2
    model_dir = resolve_model(a.model)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    all_rows = []
    with contextlib.ExitStack() as stack:
        if a.one_lock:
            stack.enter_context(bench_lock(a.lock))
            _HELD["whole_run"] = True
        for run in range(a.runs):
            all_rows += one_run(model_dir, a, fio, files, run)
    if a.json:
        emit(TOOL, all_rows, run_conditions(a, model_dir=str(model_dir), cold=True), True, [])
    return 0


def one_run(model_dir, a, fio, files, run) -> list[dict]:
    print(f"# streaming benchmark run {run + 1}/{a.runs} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
          f"commit {git_commit()} model {Path(model_dir).name} budget {a.budget} cold, {a.tokens} tokens x "
          f"{a.repeats} repeats, prompt {a.prompt_tokens}, fio {a.fio_seconds:g} s x 2 per row", file=sys.stderr)
    rows = run_table(model_dir, a, fio, files, run)
    for r in rows:
        r["run"] = run + 1
    if not a.json:
        print(f"\nRun {run + 1}:\n", flush=True)
        (trace_bound.print_rows if a.trace_bound else print_table)(rows)
    return rows


if __name__ == "__main__":
    sys.exit(main())
