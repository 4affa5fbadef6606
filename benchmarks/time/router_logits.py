"""The sigmoid routers' fp32 logits at published sizes: the native kernel against the fp32 copy it replaced.

deepseek_v3, glm4_moe and glm_moe_dsa route in fp32 whatever the compute dtype (engine/arch/router.py,
SigmoidGroupRouter). Their logits were `F.linear(x.float(), weight.float())`: every call converted the
bf16 router weight [E, H] to a fresh fp32 copy before the product. A decode token calls the router once
per MoE layer and once more per layer of lookahead (`prefetch_depth` guesses), so at DeepSeek-V3's size
(256 x 7168) that was ~58 x (1 + depth) copies of 7.3 MB a token. `fp32_logits` now takes the native
kernel (native.linear_f32: the bf16 rows widened in registers, fp32 dots) for up to NATIVE_ROUTER_ROWS rows.

For each shape (E experts x H hidden, the published models') and row count M (1: a decode token; 3: a
verify of two drafts), the two are timed alternately per step (the order flips every step, fresh x each
step), on the same bf16 weight; the median microseconds per call and the ratio are printed, and the
largest difference between the two logits (fp32 summation order only). The per-token column multiplies
by the model's MoE layers and (1 + depth) calls per layer.

    .venv/bin/python benchmarks/time/router_logits.py [--rows 1,3] [--steps 200] [--threads 2] [--depth 1] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions  # noqa: E402

TOOL = "router_logits"
# (name, experts, hidden, MoE layers): the published configs' router shapes
SHAPES = [("DeepSeek-V3 / R1", 256, 7168, 58), ("GLM-4.5", 160, 5120, 89), ("GLM-4.5-Air", 128, 4096, 45)]
COLUMNS = [("model", lambda r: r["model"]), ("E x H", lambda r: r["shape"]), ("rows", lambda r: r["rows"]),
           ("fp32 copy + F.linear (us)", lambda r: r["before_us"]), ("native (us)", lambda r: r["after_us"]),
           ("speed-up", lambda r: r["speedup"]), ("ms per token saved", lambda r: r["token_ms_saved"]),
           ("max |diff|", lambda r: r["max_diff"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,3", help="row counts per call, comma-separated (default 1,3)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per (shape, rows); the median is quoted")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=1, help="lookahead calls per MoE layer besides the layer's own")
    add_output_flags(ap)
    a = ap.parse_args(argv)
    try:
        rows_list = [int(r) for r in a.rows.split(",")]
    except ValueError:
        return refuse(TOOL, f"--rows {a.rows!r}: comma-separated integers expected")
    if a.steps < 1 or any(r < 1 for r in rows_list):
        return refuse(TOOL, "--steps and every --rows value must be at least 1")
    import torch
    import torch.nn.functional as F

    from engine.api.lab import fp32_logits, native
    why = native.load()
    if why is not None:
        return refuse(TOOL, f"the native kernels are not loaded: {why}")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    out = []
    for name, E, H, layers in SHAPES:
        w = (torch.randn(E, H, generator=g) * 0.02).bfloat16()
        for M in rows_list:
            before, after, diff = [], [], 0.0
            with bench_lock(a.lock):
                for step in range(a.steps + 5):
                    x = torch.randn(M, H, generator=g).bfloat16()
                    pair = [("before", lambda: F.linear(x.float(), w.float())), ("after", lambda: fp32_logits(x, w))]
                    if step % 2:
                        pair.reverse()
                    got = {}
                    for side, fn in pair:
                        t = time.perf_counter()
                        got[side] = fn()
                        dt = time.perf_counter() - t
                        if step >= 5:  # warm-up steps are not quoted
                            (before if side == "before" else after).append(dt)
                    diff = max(diff, float((got["before"] - got["after"]).abs().max()))
            b, n = statistics.median(before) * 1e6, statistics.median(after) * 1e6
            out.append({"model": name, "shape": f"{E} x {H}", "rows": M, "before_us": round(b, 1),
                        "after_us": round(n, 1), "speedup": f"{b / n:.2f}x",
                        "token_ms_saved": round((b - n) * layers * (1 + a.depth) / 1e3, 2) if M == 1 else "-",
                        "max_diff": f"{diff:.1e}"})
            print(f"{TOOL}: {name} M={M}: {b:.1f} -> {n:.1f} us", file=sys.stderr, flush=True)
    emit(TOOL, out, run_conditions(a), a.json, COLUMNS,
         notes={"ms per token saved": f"M = 1, x MoE layers x (1 + depth {a.depth}) router calls a token"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
