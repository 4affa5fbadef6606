"""Per-expert CPU cost of each quantized kernel, and of preparing a stored expert for it.

    python benchmarks/quant/quant_kernels.py [--hidden 1024] [--inter 512] [--threads 2] [--json]

One routed expert of the demo geometry (gate/up [I, H], down [H, I]) at batch 1, bf16
activations. Rows: bf16 F.linear (the baseline), `_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`
per group size, the dequantize-then-matmul fallback (torch's kernels: engine/native's int ops
held off), then the native decode kernels (engine/native: bf16 experts_bf16, int8/int4
quant_experts) for one expert per call and for 8 experts in one call (per expert: what a
resident MoE layer's one call costs, divided by 8). The "prepare" column is the one-off
work to turn the bytes read from disk into the kernel's operands (what a cache miss pays on top
of the read): it decides whether containers store raw nibbles or the kernel's packed layout
(docs/FORMAT.md). Medians of --repeats timings of --inner calls each; min/max alongside.

--working-set MiB (default 0: one expert, in cache) gives every kernel that many MiB of distinct
experts (quantized copies of the same matrices) and walks through them, a different expert
each call, so the weights come from DRAM as in a resident decode (16 layers x 8 experts a
token) rather than from the last-level cache a single repeated expert sits in. A kernel that is
faster in cache but not from DRAM is limited by how it streams memory, not by its arithmetic.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: engine, benchmarks

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.api import QuantWeight, quantize  # noqa: E402
from engine.api.lab import native, native_quant_operands  # noqa: E402
from benchmarks.benchkit import emit, run_conditions  # noqa: E402


def _time(fn, repeats: int, inner: int) -> dict:
    """fn(i) for i = 0, 1, 2, ...: the call index picks the expert copy when there are several."""
    fn(0)  # warm-up: first calls page in kernels and size buffers
    samples, i = [], 1
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn(i)
            i += 1
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    return {"median_us": statistics.median(samples), "min_us": min(samples), "max_us": max(samples)}


def _copies(bytes_per_expert: int, working_set: int) -> int:
    """Distinct experts a kernel walks through: enough to fill the working set (1: in cache)."""
    return max(1, working_set // bytes_per_expert)


def measure(hidden: int, inter: int, repeats: int, inner: int, working_set: int = 0) -> list[dict]:
    torch.manual_seed(0)
    dtype = torch.bfloat16
    mats = [torch.randn(inter, hidden) * 0.02, torch.randn(inter, hidden) * 0.02, torch.randn(hidden, inter) * 0.02]
    x_h, x_i = torch.randn(1, hidden).to(dtype), torch.randn(1, inter).to(dtype)
    bf_bytes = sum(m.numel() * 2 for m in mats)
    bfs = [[m.to(dtype).clone() for m in mats] for _ in range(_copies(bf_bytes, working_set))]

    def expert_bf16(i):
        bf = bfs[i % len(bfs)]
        h = F.silu(F.linear(x_h, bf[0])) * F.linear(x_h, bf[1])
        return F.linear(x_i, bf[2]) if h is not None else None

    native_why = native.load()
    int_native, native.int_ready = native.int_ready, False  # torch's kernels first
    rows = [{"kernel": "bf16 F.linear", "quant": "bf16", "group": None, "experts": len(bfs),
             "bytes": bf_bytes, "compute": _time(expert_bf16, repeats, inner), "prepare": None}]
    cases = [("int8", 0, True)] + [("int4", g, True) for g in (32, 64, 128)] + [("int4", 64, False), ("int8", 0, False)]
    for quant, group, packed in cases:
        stored = [quantize(m, quant, group) for m in mats]
        nbytes = sum(q.nbytes + s.nbytes for q, s in stored)
        prep = lambda i=0: [QuantWeight.prepare(q, s, quant, group, dtype, packed_kernel=packed) for q, s in stored]
        # distinct codes per copy (the scales are small); never more copies than the calls visit
        wss = [[QuantWeight.prepare(q.clone(), s.clone(), quant, group, dtype, packed_kernel=packed)
                for q, s in stored] for _ in range(min(_copies(nbytes, working_set), inner * repeats + 1))]

        def expert_q(i):
            ws = wss[i % len(wss)]
            h = F.silu(ws[0].linear(x_h)) * ws[1].linear(x_h)
            return ws[2].linear(x_i) if h is not None else None

        rows.append({"kernel": wss[0][0].kernel, "quant": quant, "group": group or None, "experts": len(wss),
                     "bytes": nbytes, "compute": _time(expert_q, repeats, inner),
                     "prepare": _time(prep, repeats, max(inner // 4, 1))})
        del wss
    native.int_ready = int_native
    native.int8_decode = True  # measured here even where the engine keeps it off
    if native_why is not None:
        print(f"native kernels: {native_why}")
        return rows
    fused = [[torch.cat([bf[0], bf[1]]), bf[2]] for bf in bfs]
    for n in (1, 8):
        rows.append({"kernel": f"native experts_bf16 x{n}", "quant": "bf16", "group": None, "experts": len(fused),
                     "bytes": bf_bytes, "prepare": None,
                     "compute": _per(_time(lambda i: native.experts(
                         x_h, [t for j in range(n) for t in fused[(i * n + j) % len(fused)]], 2), repeats, inner), n)})
    del bfs, fused
    if not native.int_ready:
        print("native int8/int4 kernels: this CPU lacks VNNI or VBMI")
        return rows
    for quant, group in [("int8", 0)] + [("int4", g) for g in (32, 64, 128)]:
        stored = [quantize(m, quant, group) for m in mats]
        nbytes = sum(q.nbytes + s.nbytes for q, s in stored)
        experts = [[QuantWeight.prepare(q.clone(), s.clone(), quant, group, dtype) for q, s in stored]
                   for _ in range(_copies(nbytes, working_set))]
        # int4: what a read pays to repack the stored pair into the strips (int_kernels.h), here into
        # new memory (a slot read repacks in place: the same work)
        prepare = (_time(lambda i: [QuantWeight.prepare(q, s, quant, group, dtype) for q, s in stored],
                         repeats, max(inner // 4, 1)) if quant == "int4" else None)
        for n in (1, 8):
            # one operand list per call, prepared beforehand: call i takes experts i*n .. i*n+n-1
            calls = [native_quant_operands(x_h, [experts[(c * n + j) % len(experts)] for j in range(n)])
                     for c in range(max(1, len(experts) // n))]
            rows.append({"kernel": f"native {quant} quant_experts x{n}", "quant": quant, "group": group or None,
                         "experts": len(experts), "bytes": nbytes, "prepare": prepare,
                         "compute": _per(_time(lambda i: native.quant_experts(x_h, *calls[i % len(calls)]),
                                               repeats, inner), n)})
        del experts
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
    p.add_argument("--working-set", type=int, default=0, metavar="MiB",
                   help="MiB of distinct experts each kernel walks through (0: one expert, in cache)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = measure(a.hidden, a.inter, a.repeats, a.inner, a.working_set << 20)
    if a.json:
        emit("quant_kernels", rows, run_conditions(a, working_set_bytes=a.working_set << 20,
                                                   cpu_capability=torch.backends.cpu.get_cpu_capability()), True, [])
        return
    print(f"one expert: gate/up [{a.inter}x{a.hidden}], down [{a.hidden}x{a.inter}], batch 1, bf16 activations, "
          f"{a.threads} threads, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}); "
          f"median of {a.repeats} x {a.inner} calls (min-max); "
          + (f"each kernel walks {a.working_set} MiB of distinct experts (from DRAM)" if a.working_set
             else "one expert, in cache"))
    print("| kernel | quant | group | KiB/expert | experts walked | compute µs/expert | GB/s | prepare µs/expert |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        c, pr = r["compute"], r["prepare"]
        prep = f"{pr['median_us']:.0f} ({pr['min_us']:.0f}-{pr['max_us']:.0f})" if pr else "0 (zero-copy view)"
        print(f"| {r['kernel']} | {r['quant']} | {r['group'] or '-'} | {r['bytes'] / 1024:.0f} | {r['experts']} | "
              f"{c['median_us']:.0f} ({c['min_us']:.0f}-{c['max_us']:.0f}) | {r['bytes'] / c['median_us'] / 1e3:.1f} | "
              f"{prep} |")


if __name__ == "__main__":
    main()
