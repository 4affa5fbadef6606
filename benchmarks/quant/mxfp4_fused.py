"""MXFP4 experts computed as stored (the native fused kernel) against dequantize-then-matmul.

Two tables (run under `quiet bench` on the shared box):

1. One expert's decode compute (one token, one thread, median of --repeats with min-max): the
   fused kernel (engine/native/mxfp4_decode.cpp, gate_up then down straight from blocks +
   scales) against what the engine did before, dequantize both matrices to bf16
   (engine.weights.mxfp4.mxfp4_dequantize) and then F.linear, at the gpt-oss-small and the published
   gpt-oss-120b expert geometry (hidden 2880, intermediate 2880). Weight bytes touched per
   expert and the fused kernel's GB/s of stored weights beside them.
2. Decode tok/s of gpt-oss-small (`colibri synth gpt-oss-small`, MXFP4 experts) fused and with
   COLIBRI_MXFP4_FUSED=0 (the same engine dequantizing on read, caching bf16; every other
   native kernel unchanged), resident and streamed (cold, io direct, in a memory cgroup at
   --budget), one `colibri bench` child process each: decode tok/s, MiB read per token, RAM
   hit rate, the cgroup's peak, and the kernel the run reports.

    quiet bench .venv/bin/python benchmarks/quant/mxfp4_fused.py [--budget 560MiB] [--tokens 16]
        [--repeats 3] [--scratch DIR] [--json] [--lock FILE]

--json prints one colibri.bench/1 document (benchkit.emit): the same two tables' rows, keyed by
each table's header and tagged with its name.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.api import format_size, git_commit, parse_size, synth  # noqa: E402
from engine.api.lab import mxfp4_dequantize, mxfp4_quantize, native  # noqa: E402
from tuner.search.trial import run_trial  # noqa: E402
from benchmarks.formats.arch_figures import decode_arguments, placements, trial_cells  # noqa: E402
from benchmarks.benchkit import Tables, add_output_flags, bench_lock, run_conditions  # noqa: E402

TOOL = "mxfp4_fused"
GEOMETRIES = (("gpt-oss-small 512 x 512", 512, 512), ("gpt-oss-120b 2880 x 2880", 2880, 2880))


def _times_ms(fn, repeats: int) -> list[float]:
    fn()  # warm-up: first-touch page faults, kernel loading
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _cell(ms: list[float]) -> str:
    return f"{statistics.median(ms):.2f} ({min(ms):.2f}-{max(ms):.2f})"


def expert_table(repeats: int) -> list[str]:
    torch.set_num_threads(1)
    rows = ["| expert geometry (H x I) | MXFP4 bytes | bf16 bytes | dequantize + F.linear ms | fused ms "
            "| speed-up | fused GB/s of stored weights |", "|---|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for label, H, I in GEOMETRIES:
        gate_up = mxfp4_quantize(torch.randn(2 * I, H, generator=gen) * 0.02)  # [2I, H/32, 16], [2I, H/32]
        down = mxfp4_quantize(torch.randn(H, I, generator=gen) * 0.02)  # [H, I/32, 16], [H, I/32]
        gu_bias, d_bias = torch.zeros(2 * I, dtype=torch.bfloat16), torch.zeros(H, dtype=torch.bfloat16)
        x = torch.randn(1, H, generator=gen).bfloat16()
        h = torch.randn(1, I, generator=gen).bfloat16()
        stored = sum(b.nbytes + s.nbytes for b, s in (gate_up, down))

        def dequantize_then_matmul():
            F.linear(x, mxfp4_dequantize(*gate_up, torch.bfloat16), gu_bias)
            F.linear(h, mxfp4_dequantize(*down, torch.bfloat16), d_bias)

        def fused():
            native.mxfp4_linear(x, *gate_up, gu_bias)
            native.mxfp4_linear(h, *down, d_bias)

        before, after = _times_ms(dequantize_then_matmul, repeats), _times_ms(fused, repeats)
        rows.append(f"| {label} | {format_size(stored)} | {format_size(3 * H * I * 2)} | {_cell(before)} | "
                    f"{_cell(after)} | {statistics.median(before) / statistics.median(after):.0f}x | "
                    f"{stored / statistics.median(after) / 1e6:.1f} |")
    return rows


def decode_table(model: Path, budget: int, tokens: int, repeats: int) -> list[str]:
    rows = ["| experts computed | placement | decode tok/s (median, min-max) | MiB read/token | RAM hit "
            "| cgroup peak | kernel |", "|---|---|---|---|---|---|---|"]
    for arm, env in (("fused (native)", "1"), ("dequantized on read", "0")):
        os.environ["COLIBRI_MXFP4_FUSED"] = env  # the bench child inherits it
        for label, cfg, limit, cold in placements(budget):
            t = run_trial(model, cfg, tokens=tokens, repeats=repeats, cold=cold, limit_bytes=limit, timeout=1200)
            rows.append(f"| {arm} | {label} | {trial_cells(t)} | {t.metrics.get('kernel', '?') if t.ok else ''} |")
    os.environ.pop("COLIBRI_MXFP4_FUSED", None)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_arguments(ap, "/tmp/colibri-mxfp4-bench")
    add_output_flags(ap)
    a = ap.parse_args()
    why = native.load()
    if why is not None:
        print(f"the fused kernel needs the native kernels: {why}", file=sys.stderr)
        return 2
    out = Tables(a.json)
    out.line(f"# MXFP4 fused benchmark {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit {git_commit()}")
    out.line(f"\n## One expert, one token, one thread (median of {a.repeats}, min-max)\n")
    with bench_lock(a.lock):
        out.table("expert", expert_table(a.repeats))
    if not a.skip_decode:
        model = Path(a.scratch) / "gpt-oss-small"
        if not (model / "config.json").exists():
            synth.synthesize(synth.load_preset("gpt-oss-small"), model, seed=0, progress=False)
        out.line(f"\n## gpt-oss-small decode, {a.tokens} tokens x {a.repeats} repeats\n")
        with bench_lock(a.lock):
            out.table("decode", decode_table(model, parse_size(a.budget), a.tokens, a.repeats))
    out.done(TOOL, run_conditions(a, model="gpt-oss-small (synthesized)", threads_expert=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
