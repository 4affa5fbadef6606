"""Full-scale checkpoints without the disk space: DeepSeek-V3 671B and GLM-5 744B as sparse files.

A test-side builder (not shipped behaviour): it writes a Hugging Face directory with the tensor
names, shapes, dtypes and shard layout of the published checkpoint — real safetensors headers
and a real model.safetensors.index.json — where every tensor's bytes are a hole (the file is
truncated to its size), so ~700 GB-1.5 TB of apparent size costs a few MB of disk. The engine's
metadata path (header parsing and validation, the tensor index, the expert layout, the memory
plan) then meets real scale: 61-78 layers x 256 experts, ~160-300 shards, ~90-120k tensors.

What is written, and how, is fullscale_build.py's (the builder, a helper module of this script).

Measurements (`measure`; each step in a fresh interpreter so its RSS is its own):
  open    Checkpoint(dir): wall time, RSS growth; and in a run of its own the Python heap
          (tracemalloc) of the index
  layout  + ExpertLayout (every routed expert's spans): time, RSS growth
  plan    + make_plan under --budget: time, and what the plan says (or its one-line refusal)
  cli     `colibri plan --model DIR --budget B --json`: wall time of the whole command
  decode  Engine(dir, ram_budget) and one token after a one-token prompt, in a fresh memory cgroup
          of --budget: load and step time, RSS after each, VmHWM, the cgroup's peak and its split
          (anon, shmem = the expert arena, page cache) beside the plan; one decode step on holes
          (needs a `--decodable` build: zero scales are refused as corrupt; the written router
          biases route every layer to experts 0..K-1, whose scales are the ones written)

    quiet test .venv/bin/python benchmarks/formats/fullscale.py build deepseek-v3 --dtype bf16 --out /tmp/fs-dsv3
        [--decodable]   # also the scales and router biases a decode step reads (int4: ~1 GiB on disk)
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py measure /tmp/fs-dsv3 [--budget 16GiB]
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py decode /tmp/fs-dsv3 --budget 16GiB [--cgroup 16GiB]
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py all [--dtype bf16] [--decode]   # build each, measure, delete

measure, decode and all take --json: one colibri.bench/1 document (benchkit.emit) whose rows are
the same table's rows (keyed by its header; `all` tags each with the model and its build), and
--lock FILE: benchkit.bench_lock around each measured checkpoint (instead of `quiet bench`).
build prints its own one-line JSON (what it wrote) and _step its child's (the wire format).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = "fullscale"
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from engine.api import EngineConfig, format_size, parse_size  # noqa: E402
from benchmarks.benchkit import Tables, add_output_flags, bench_lock, run_conditions, table_rows  # noqa: E402
from benchmarks.formats.fullscale_build import MODELS, build  # noqa: E402

DEFAULT_PROFILE = str(ROOT / "profiles" / "amd-epyc-virtio-2a91f032.json")  # this machine class, bundled


# --- measuring ---------------------------------------------------------------------------------

def _rss() -> int:
    return psutil.Process().memory_info().rss


def measure_step(model: Path, step: str, budget: int) -> dict:
    """One step in this (fresh) interpreter: what it costs beyond the imports."""
    import torch
    from engine.api import ColibriError
    from engine.api import model_args
    from engine.api import Checkpoint
    from engine.api import ExpertLayout
    from engine.api import make_plan
    base = _rss()
    if step == "heap":  # tracing slows the open several-fold and costs memory itself: its own run
        tracemalloc.start()
        ckpt = Checkpoint(model)
        return {"index_heap_bytes": tracemalloc.get_traced_memory()[0], "tensors": len(ckpt.tensors)}
    t0 = time.perf_counter()
    ckpt = Checkpoint(model)
    result = {"open_s": time.perf_counter() - t0, "tensors": len(ckpt.tensors), "open_rss_bytes": _rss() - base}
    if step in ("layout", "plan"):
        t0 = time.perf_counter()
        args = model_args(ckpt.config)
        layout = ExpertLayout(ckpt, args)
        result.update(layout_s=time.perf_counter() - t0, routed_experts=layout.num_routed,
                      expert_disk_bytes=layout.expert_nbytes, layout_rss_bytes=_rss() - base)
    if step == "plan":
        t0 = time.perf_counter()
        try:
            plan = make_plan(ckpt, args, layout, EngineConfig(ram_budget=budget), torch.bfloat16, torch.bfloat16)
            result["plan"] = plan.describe()
        except ColibriError as exc:
            result["plan"] = f"refused: {exc}"
        result.update(plan_s=time.perf_counter() - t0, plan_rss_bytes=_rss() - base)
    return result


def _cgroup_memory() -> dict:
    """This process's memory cgroup (v1) as the kernel counts it: usage, peak, and its split into
    anonymous memory, shmem (the expert arena), page cache and mapped file pages."""
    own = [line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line]
    d = Path("/sys/fs/cgroup/memory" + own[0]) if own and own[0] != "/" else None
    if d is None or not (d / "memory.stat").exists():
        return {}
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return {"usage": int((d / "memory.usage_in_bytes").read_text()),
            "peak": int((d / "memory.max_usage_in_bytes").read_text()),
            **{k: int(stat.get(k, 0)) for k in ("rss", "shmem", "cache", "mapped_file")}}


def decode_step(model: Path, budget: int) -> dict:
    """Open the engine under `budget` and decode one token after a one-token prompt, in this
    interpreter (run inside a memory cgroup by `measure --decode`): what the plan counts beside
    what the process and its cgroup hold after load and after the step."""
    import torch
    from engine.api import Sampler, generate
    from engine.api import peak_rss_bytes
    from engine.api import Engine
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(ram_budget=budget))
    loaded = {"load_s": time.perf_counter() - t0, "rss": _rss(), "cgroup": _cgroup_memory()}
    print(json.dumps({"loaded": loaded, "describe": engine.plan.describe()}), file=sys.stderr, flush=True)  # kept if the step is killed
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = generate(engine, [1], 1, Sampler())
    stepped = {"step_s": time.perf_counter() - t0, "rss": _rss(), "peak_rss": peak_rss_bytes(),
               "cgroup": _cgroup_memory()}
    return {"plan": engine.plan.to_dict(), "describe": engine.plan.describe(), "kernel": engine.kernel_name,
            "loaded": loaded, "stepped": stepped, "tokens": out.output_ids}


def _child(model: Path, step: str, budget: int) -> dict:
    argv = [sys.executable, __file__, "_step", str(model), step, "--budget", str(budget)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"{step}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _cli(argv: list[str], timeout: float) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "colibri.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)
    tail = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return time.perf_counter() - t0, done.returncode, (tail[-1] if tail else "")[:300]


def decode_row(model: Path, budget: int, limit: int) -> str:
    """One decode step (`_step decode`) inside a fresh memory cgroup of `limit`, as a table row:
    the plan's parts, then what the process and the cgroup held after load and after the step."""
    from tuner.sandbox.limited import run_limited
    argv = [sys.executable, __file__, "_step", str(model), "decode", "--budget", str(budget)]
    run = run_limited(argv, limit, timeout=1500, env=_env(), require=True)
    head = f"| decode step, budget {format_size(budget)}, cgroup {format_size(limit)} | {run.wall_seconds:.1f} |"
    if run.returncode != 0:
        why = "OOM-killed" if run.oom_killed else f"exit {run.returncode}"
        return f"{head} - | {why}; cgroup peak {format_size(run.peak_bytes or 0)}; {run.stderr.strip()[-1500:]} |"
    r = json.loads(run.stdout.strip().splitlines()[-1])
    plan, after = r["plan"], r["stepped"]
    held = plan["budget"] - plan["prefill_bytes"]  # a one-token prompt fills no prefill chunk
    cg = after["cgroup"]
    split = (f"anon {format_size(cg['rss'])}, shmem {format_size(cg['shmem'])}, page cache "
             f"{format_size(cg['cache'] - cg['shmem'])}" if cg else "no cgroup stat")
    return (f"{head} {format_size(after['peak_rss'])} peak | load {r['loaded']['load_s']:.1f} s, step "
            f"{after['step_s']:.2f} s; RSS after load {format_size(r['loaded']['rss'])}, after the step "
            f"{format_size(after['rss'])}; plan without prefill {format_size(held)}, peak RSS over it "
            f"{(after['peak_rss'] - held) / 2**20:+.0f} MiB ({r['describe']}); cgroup "
            f"peak {format_size(run.peak_bytes or 0)} ({split}); kernel {r['kernel']} |")


MEASURE_HEADER = ["| step | wall s | RSS growth | notes |", "|---|---|---|---|"]


def measure(model: Path, budget: int, decode: bool, profile: str = DEFAULT_PROFILE) -> list[str]:
    rows = list(MEASURE_HEADER)
    opened, heap = _child(model, "open", budget), _child(model, "heap", budget)
    rows.append(f"| open (Checkpoint index, {opened['tensors']:,} tensors) | {opened['open_s']:.2f} | "
                f"{format_size(opened['open_rss_bytes'])} | Python heap of the index "
                f"{format_size(heap['index_heap_bytes'])} (tracemalloc, a run of its own) |")
    laid = _child(model, "layout", budget)
    rows.append(f"| + expert layout ({laid['routed_experts']:,} experts) | {laid['layout_s']:.2f} | "
                f"{format_size(laid['layout_rss_bytes'])} (with the index) | one expert "
                f"{format_size(laid['expert_disk_bytes'])} on disk |")
    planned = _child(model, "plan", budget)
    rows.append(f"| + make_plan at {format_size(budget)} | {planned['plan_s']:.2f} | "
                f"{format_size(planned['plan_rss_bytes'])} (with index, layout) | {planned['plan']} |")
    size = format_size(budget).replace(" ", "")
    wall, rc, line = _cli(["plan", "--model", str(model), "--profile", profile, "--budget", size], 1800)
    rows.append(f"| `colibri plan` (whole command: open, geometry, cost-model search) | {wall:.2f} | - | "
                f"exit {rc}: {line} |")
    if decode:
        rows.append(decode_row(model, budget, budget))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write one sparse checkpoint")
    b.add_argument("model", choices=sorted(MODELS))
    b.add_argument("--dtype", choices=("fp8", "bf16", "int4"))
    b.add_argument("--shards", type=int)
    b.add_argument("--layers", type=int, help="the first N decoder layers only (same widths; a reduced-layer "
                   "variant for memory questions)")
    b.add_argument("--out", required=True)
    b.add_argument("--decodable", action="store_true", help="write the scales and router biases a decode step "
                   "reads, so `measure --decode` runs (int4: ~1 GiB on disk)")
    m = sub.add_parser("measure", help="open, layout, plan (and decode) figures of a checkpoint")
    m.add_argument("dir")
    m.add_argument("--budget", default="16GiB")
    m.add_argument("--decode", action="store_true", help="also one decode step under a cgroup of --budget")
    m.add_argument("--profile", default=DEFAULT_PROFILE, help="hardware profile for `colibri plan`")
    add_output_flags(m)
    dc = sub.add_parser("decode", help="only the decode step of `measure --decode` (one cgroup run)")
    dc.add_argument("dir")
    dc.add_argument("--budget", default="16GiB")
    dc.add_argument("--cgroup", help="the cgroup's limit (default: the budget)")
    add_output_flags(dc)
    al = sub.add_parser("all", help="build each model in a temp dir, measure it, delete it")
    al.add_argument("--dtype", choices=("fp8", "bf16", "int4"), help="default: each model's published dtype")
    al.add_argument("--budget", default="16GiB")
    al.add_argument("--decode", action="store_true")
    al.add_argument("--scratch", default="/tmp")
    add_output_flags(al)
    s = sub.add_parser("_step")
    s.add_argument("dir")
    s.add_argument("step", choices=("open", "heap", "layout", "plan", "decode"))
    s.add_argument("--budget", type=int, required=True)
    a = ap.parse_args()
    if a.cmd == "build":
        t0 = time.perf_counter()
        info = build(a.model, Path(a.out), a.dtype or MODELS[a.model]["dtype"], a.shards, a.decodable, a.layers)
        info["build_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(info))
        return 0
    if a.cmd == "_step":
        step = decode_step if a.step == "decode" else lambda d, b: measure_step(d, a.step, b)
        print(json.dumps(step(Path(a.dir), a.budget)))
        return 0
    out = Tables(a.json)
    if a.cmd == "decode":
        budget = parse_size(a.budget)
        with bench_lock(a.lock):
            row = decode_row(Path(a.dir), budget, parse_size(a.cgroup) if a.cgroup else budget)
        out.rows += table_rows(MEASURE_HEADER + [row], table="measure")
        out.line(row)
        out.done(TOOL, run_conditions(a, model=a.dir))
        return 0
    if a.cmd == "all":
        from engine.api import git_commit
        out.line(f"# full-scale metadata {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit {git_commit()}")
        for name in MODELS:
            tmp = Path(tempfile.mkdtemp(prefix=f"colibri-fullscale-{name}-", dir=a.scratch))
            try:
                t0 = time.perf_counter()
                info = build(name, tmp / "model", a.dtype or MODELS[name]["dtype"], decodable=a.decode)
                out.line(f"\n## {name} {info['dtype']}: {info['shards']} shards, {info['tensors']:,} tensors, "
                         f"{format_size(info['apparent_bytes'])} apparent, {format_size(info['disk_bytes'])} on disk "
                         f"(built in {time.perf_counter() - t0:.1f} s)\n")
                with bench_lock(a.lock):
                    out.table("measure", measure(tmp / "model", parse_size(a.budget), a.decode), model=name,
                              dtype=info["dtype"], shards=info["shards"], tensors=info["tensors"],
                              apparent_bytes=info["apparent_bytes"], disk_bytes=info["disk_bytes"])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out.done(TOOL, run_conditions(a, model=", ".join(MODELS)))
        return 0
    with bench_lock(a.lock):
        out.table("measure", measure(Path(a.dir), parse_size(a.budget), a.decode, a.profile))
    out.done(TOOL, run_conditions(a, model=a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
