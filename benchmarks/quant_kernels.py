"""Per-expert CPU cost of each quantized kernel, and of preparing a stored expert for it.

    python benchmarks/quant_kernels.py [--hidden 1024] [--inter 512] [--threads 2] [--json]

One routed expert of the demo geometry (gate/up [I, H], down [H, I]) at batch 1, bf16
activations. Rows: bf16 F.linear (the baseline), `_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`
per group size, the dequantize-then-matmul fallback (torch's kernels: engine/native's int ops
held off), then the native decode kernels (engine/native: bf16 experts_bf16, int8/int4
quant_experts) for one expert per call and for 8 experts in one call (per expert: what a
resident MoE layer's one call costs, divided by 8). The "prepare" column is the one-off
work to turn the bytes read from disk into the kernel's operands (what a cache miss pays on top
of the read): it decides whether containers store raw nibbles or the kernel's packed layout
(docs/FORMAT.md). Medians of --repeats timings of --inner calls each; min/max alongside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from engine import native
from engine.arch.layers import native_quant_operands
from engine.format.quant import QuantWeight, quantize


def _time(fn, repeats: int, inner: int) -> dict:
    fn()  # warm-up: first calls page in kernels and size buffers
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def measure(hidden: int, inter: int, repeats: int, inner: int) -> list[dict]:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    mats = [torch.randn(inter, hidden) * 0.02, torch.randn(inter, hidden) * 0.02, torch.randn(hidden, inter) * 0.02]
    x_h, x_i = torch.randn(1, hidden).to(dtype), torch.randn(1, inter).to(dtype)
    bf = [m.to(dtype) for m in mats]

    def expert_bf16():
        h = F.silu(F.linear(x_h, bf[0])) * F.linear(x_h, bf[1])
        return F.linear(x_i, bf[2]) if h is not None else None

    native_why = native.load()
    int_native, native.int_ready = native.int_ready, False  # torch's kernels first
    rows = [{"kernel": "bf16 F.linear", "quant": "bf16", "group": None,
             "bytes": sum(m.nbytes for m in bf), "compute": _time(expert_bf16, repeats, inner), "prepare": None}]
    cases = [("int8", 0, True)] + [("int4", g, True) for g in (32, 64, 128)] + [("int4", 64, False), ("int8", 0, False)]
    for quant, group, packed in cases:
        stored = [quantize(m, quant, group) for m in mats]
        prep = lambda: [QuantWeight.prepare(q, s, quant, group, dtype, packed_kernel=packed) for q, s in stored]
        ws = prep()

        def expert_q(ws=ws):
            h = F.silu(ws[0].linear(x_h)) * ws[1].linear(x_h)
            return ws[2].linear(x_i) if h is not None else None

        rows.append({"kernel": ws[0].kernel, "quant": quant, "group": group or None,
                     "bytes": sum(q.nbytes + s.nbytes for q, s in stored),
                     "compute": _time(expert_q, repeats, inner), "prepare": _time(prep, repeats, max(inner // 4, 1))})
    native.int_ready = int_native
    native.int8_decode = True  # measured here even where the engine keeps it off
    if native_why is not None:
        print(f"native kernels: {native_why}")
        return rows
    fused = [torch.cat([bf[0], bf[1]]), bf[2]]
    for n in (1, 8):
        rows.append({"kernel": f"native experts_bf16 x{n}", "quant": "bf16", "group": None,
                     "bytes": sum(m.nbytes for m in bf), "prepare": None,
                     "compute": _per(_time(lambda: native.experts(x_h, fused * n, 2), repeats, inner), n)})
    if not native.int_ready:
        print("native int8/int4 kernels: this CPU lacks VNNI or VBMI")
        return rows
    for quant, group in [("int8", 0)] + [("int4", g) for g in (32, 64, 128)]:
        stored = [quantize(m, quant, group) for m in mats]
        ws = [QuantWeight.prepare(q, s, quant, group, dtype) for q, s in stored]
        for n in (1, 8):
            operands, g = native_quant_operands(x_h, [ws] * n)
            rows.append({"kernel": f"native {quant} quant_experts x{n}", "quant": quant, "group": group or None,
                         "bytes": sum(q.nbytes + s.nbytes for q, s in stored), "prepare": None,
                         "compute": _per(_time(lambda: native.quant_experts(x_h, operands, g), repeats, inner), n)})
    return rows


def _per(t: dict, n: int) -> dict:
    return {k: v / n for k, v in t.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=200)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = measure(a.hidden, a.inter, a.repeats, a.inner)
    if a.json:
        print(json.dumps({"hidden": a.hidden, "inter": a.inter, "threads": a.threads, "torch": torch.__version__,
                          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rows": rows}, indent=2))
        return
    print(f"one expert: gate/up [{a.inter}x{a.hidden}], down [{a.hidden}x{a.inter}], batch 1, bf16 activations, "
          f"{a.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
          f"median of {a.repeats} x {a.inner} calls (min-max)")
    print(f"| kernel | quant | group | KiB/expert | compute µs/expert | prepare µs/expert |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        c, pr = r["compute"], r["prepare"]
        prep = f"{pr['median_us']:.0f} ({pr['min_us']:.0f}-{pr['max_us']:.0f})" if pr else "0 (zero-copy view)"
        print(f"| {r['kernel']} | {r['quant']} | {r['group'] or '-'} | {r['bytes'] / 1024:.0f} | "
              f"{c['median_us']:.0f} ({c['min_us']:.0f}-{c['max_us']:.0f}) | {prep} |")


if __name__ == "__main__":
    main()
