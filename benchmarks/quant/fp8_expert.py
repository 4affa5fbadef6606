"""Compute cost of one routed expert at decode (one token) in FP8: the native e4m3 kernel vs
dequantize-then-F.linear (the fallback), with bf16 beside them.

    python benchmarks/quant/fp8_expert.py [--hidden 1024] [--inter 512] [--threads 2] [--repeats 200]
        [--json] [--lock FILE]

One demo expert by default (gate/up [512x1024], down [1024x512]), FP8 e4m3 with 128x128 block
scales as published, bf16 activations [1, H]; each row: median (min-max) microseconds of the
expert's SwiGLU over --repeats calls after a warm-up, and the bytes its weights occupy.
--json prints the same rows as one colibri.bench/1 document (benchkit.emit), µs as a spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.api import git_commit, linear  # noqa: E402
from engine.api.lab import fp8, native  # noqa: E402
from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions, spread  # noqa: E402

TOOL = "fp8_expert"


def _time(fn, repeats: int) -> list[float]:
    for _ in range(5):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=200)
    add_output_flags(ap)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    why_fp8 = why_bf16 = native.load()  # one library: the FP8 kernel loads with the bf16 ones
    H, I = a.hidden, a.inter
    torch.manual_seed(0)
    mats = [torch.randn(I, H) * 0.02, torch.randn(I, H) * 0.02, torch.randn(H, I) * 0.02]
    block = (128, 128)
    q = [fp8.Fp8Weight.from_stored(*fp8.quantize(m, block), block, "bench") for m in mats]
    b = [m.to(torch.bfloat16) for m in mats]
    x = torch.randn(1, H).to(torch.bfloat16)

    def swiglu(ws, lin):
        return lin(F.silu(lin(x, ws[0])) * lin(x, ws[1]), ws[2])

    def dequant_linear(xx, w):
        return F.linear(xx, w.dequantize().to(xx.dtype))

    rows = []
    with torch.inference_mode(), bench_lock(a.lock):
        if why_fp8 is None:
            rows.append(("FP8 e4m3 b128", fp8.KERNEL_NATIVE, sum(w.nbytes for w in q), _time(lambda: swiglu(q, linear), a.repeats)))
        rows.append(("FP8 e4m3 b128", fp8.KERNEL_TORCH, sum(w.nbytes for w in q),
                     _time(lambda: swiglu(q, dequant_linear), a.repeats)))
        rows.append(("bf16", "F.linear", sum(w.nbytes for w in b), _time(lambda: swiglu(b, F.linear), a.repeats)))
        if why_bf16 is None:
            rows.append(("bf16", "native bf16 (colibri.linear_bf16)", sum(w.nbytes for w in b),
                         _time(lambda: swiglu(b, linear), a.repeats)))
    if a.json:
        emit(TOOL, [{"weights": label, "kernel": kernel, "bytes_per_expert": nbytes, "us_per_expert": spread(t)}
                    for label, kernel, nbytes, t in rows],
             run_conditions(a, batch=1, activations="bf16", warmup=5, native_fp8=why_fp8 or "loaded",
                            native_bf16=why_bf16 or "loaded"), True, [])
        return 0
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {git_commit()}, torch {torch.__version__}, "
          f"{a.threads} threads; one expert gate/up [{I}x{H}], down [{H}x{I}], batch 1, bf16 activations, "
          f"{a.repeats} calls after 5 warm-up; native fp8: {why_fp8 or 'loaded'}, native bf16: {why_bf16 or 'loaded'}")
    print("| weights | kernel | KiB/expert | µs/expert, median (min-max) |")
    print("|---|---|---|---|")
    for label, kernel, nbytes, t in rows:
        print(f"| {label} | {kernel} | {nbytes / 1024:.0f} | {statistics.median(t):.0f} ({min(t):.0f}-{max(t):.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
