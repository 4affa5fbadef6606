"""bf16 vs FP8 (as published: e4m3 + 128x128 block scales) vs int8 vs int4-g64 of one model, in one run.

    python benchmarks/quant/fp8_demo.py --work DIR [--layers 8] [--prepare-only]      # build the models
    python benchmarks/quant/fp8_demo.py --work DIR --measure [--budget 1GiB] [--tokens 8] [--repeats 2]
           [--part speed|quality]   # one part only (speed under `quiet bench`, quality needs no lock
                                    # of its own); each part saves DIR/<part>.json, the table joins them

Prepare (CPU-heavy, no timing; run it under `quiet test`): synthesizes the demo geometry (qwen3_moe,
hidden 1024, 64 experts top-8, expert intermediate 512) with `--layers` layers (16 = the demo
preset; 8 halves the time and still streams under 1 GiB), writes its FP8 twin in the published
layout (engine/synth/fp8_writer.py), and converts int8 and int4-g64 containers of the bf16 model.

Measure (run it under `quiet bench`): `benchmarks/quant/quant_formats.py speed`'s trials over the four models
(cold: `colibri bench` in a memory cgroup of --budget, O_DIRECT 1 MiB, prefetch 1, caches and page
cache emptied before each repeat; resident: no budget, warm) — decode tok/s median (min-max),
MiB read per token — and `colibri quality` of each against bf16 (KL divergence, top-1 agreement
on held-out text). Prints one markdown table; --json prints its rows (quant_formats' speed rows,
each with its quality vs bf16) as one colibri.bench/1 document (benchkit.emit). --lock FILE holds
benchkit.bench_lock around the speed part (the timed one) instead of `quiet bench`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.api import git_commit  # noqa: E402
from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions  # noqa: E402

TOOL = "fp8_demo"

HERE = Path(__file__).resolve().parent
LABELS = ("bf16", "fp8", "int8", "int4-g64")


def prepare(work: Path, layers: int) -> None:
    from engine.api import synth
    from engine.api import convert
    from engine.api.lab import write_fp8_checkpoint
    work.mkdir(parents=True, exist_ok=True)
    bf16 = work / "bf16"
    if not bf16.exists():
        geometry = json.loads((Path(synth.__file__).resolve().parent.parent / "presets" / "demo.json").read_text())
        geometry.update(name=f"demo-{layers}l", num_hidden_layers=layers)
        spec = work / "geometry.json"
        spec.write_text(json.dumps(geometry))
        subprocess.run([sys.executable, "-m", "colibri.cli", "synth", "--geometry", str(spec), "-o", str(bf16)],
                       check=True)
    if not (work / "fp8").exists():
        t0 = time.perf_counter()
        write_fp8_checkpoint(bf16, work / "fp8.partial", block=(128, 128),
                             progress=lambda i, n: print(f"fp8 shard {i}/{n}", file=sys.stderr))
        (work / "fp8.partial").rename(work / "fp8")
        print(f"fp8 written in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for label, quant in (("int8", "int8"), ("int4-g64", "int4")):
        if not (work / label).exists():
            convert(bf16, work / label, quant, 64, "experts")


def speed(work: Path, a) -> dict:
    models = [f"{label}={work / label}" for label in a.labels]
    argv = [sys.executable, str(HERE / "quant_formats.py"), "speed", "--budget", a.budget, "--tokens", str(a.tokens),
            "--repeats", str(a.repeats), "--threads", str(a.threads), "--json"]
    for m in models:
        argv += ["--model", m]
    # stderr passes through: a failed trial says so there (it used to be captured and lost)
    return json.loads(subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True).stdout)


def quality(work: Path, a) -> dict:
    from engine.api import measure_quality
    quality = {}
    for label in a.labels[1:]:
        r = measure_quality(work / label, work / "bf16", tokens=a.quality_tokens, ctx=a.ctx, threads=a.threads)
        quality[label] = {"kl_mean": r["kl_mean"], "kl_p99": r["kl_p99"], "top1": r["top1_agreement"],
                          "scored": r["scored_tokens"]}
    return quality


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prepare-only", action="store_true")
    ap.add_argument("--measure", action="store_true", help="measure only (the models must be prepared)")
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quality-tokens", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--part", choices=("speed", "quality"), help="measure one part only (saved in --work)")
    ap.add_argument("--labels", default=",".join(LABELS), help="which of the models, bf16 first (default: all)")
    add_output_flags(ap)
    a = ap.parse_args()
    a.labels = a.labels.split(",")
    if a.labels[0] != "bf16" or not set(a.labels) <= set(LABELS):
        ap.error(f"--labels: bf16 first, then any of {', '.join(LABELS[1:])}")
    if not a.measure:
        prepare(a.work, a.layers)
        if a.prepare_only:
            return 0
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for part, fn in (("speed", speed), ("quality", quality)):
        if a.part in (None, part):
            with bench_lock(a.lock if part == "speed" else None):
                result = fn(a.work, a) | {"started": started, "commit": git_commit()}
            (a.work / f"{part}.json").write_text(json.dumps(result, indent=2, default=str))
    saved = {part: json.loads((a.work / f"{part}.json").read_text()) for part in ("speed", "quality")
             if (a.work / f"{part}.json").exists()}
    if "speed" not in saved:
        if a.json:
            emit(TOOL, [], run_conditions(a), True, [], notes=saved)
            return 0
        print(json.dumps(saved, indent=2))
        return 0
    out = {"speed": saved["speed"], "quality": {k: v for k, v in saved.get("quality", {}).items()
                                                if k in LABELS}, "started": saved["speed"]["started"],
           "commit": saved["speed"]["commit"]}
    if a.json:
        rows = [{**r, "quality": out["quality"].get(r["label"])} for r in out["speed"]["rows"]]
        emit(TOOL, rows, run_conditions(a, measured=out["started"], measured_commit=out["commit"],
                                        speed_conditions=out["speed"].get("conditions")), True, [])
        return 0
    f = lambda s: "-" if not s else f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"  # noqa: E731
    print(f"{started}, commit {out['commit']}: {a.work / 'bf16'} and its FP8 / int8 / int4-g64 twins; cold = "
          f"{a.budget} cgroup, direct 1MiB, prefetch 1, io_threads 4, caches and page cache emptied per repeat; "
          f"resident = no budget, warm; {a.threads} threads, {a.tokens} tokens x {a.repeats} repeats, median (min-max); "
          f"quality vs bf16 on {a.quality_tokens} held-out tokens (ctx {a.ctx}, second halves scored)")
    print("| model | kernel | MiB/expert | cache slots | MiB read/token (cold) | cold tok/s | cold vs bf16 "
          "| resident tok/s | resident vs bf16 | KL vs bf16 (mean / p99) | top-1 vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    for r in out["speed"]["rows"]:
        q = out["quality"].get(r["label"])
        read = "-" if r["mib_read_per_token"] is None else f"{r['mib_read_per_token']:.1f}"
        kl = "-" if q is None else f"{q['kl_mean']:.5f} / {q['kl_p99']:.5f}"
        top1 = "-" if q is None else f"{q['top1']:.1%}"
        print(f"| {r['label']} | {r['kernel']} | {r['mib_per_expert']:.3f} | {r['cache_slots']} | {read} | "
              f"{f(r['cold'])} | {x(r['cold_x'])} | {f(r['resident'])} | {x(r['resident_x'])} | {kl} | {top1} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
