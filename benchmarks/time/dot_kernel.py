"""The bf16 decode kernels in isolation: weight bandwidth (GB/s) of one token's matrix-vector work.

What decode_profile.py times inside a whole token, here without the rest of the engine, so a
kernel change is read as bandwidth against the probe's figure (the bound of a token is its bytes
over that bandwidth). Three shapes, each over weights several times the L3 cache, rotated so every
call streams from DRAM as decode does:

    linear      colibri::linear_bf16 of x [1, 1024] against an lm_head-sized W [32000, 1024]
                (65.5 MB), 4 copies in turn
    experts     colibri::experts_bf16 of 8 experts (gate, up [512, 1024], down [1024, 512]:
                3 MiB each) drawn from 64, a fresh draw per call (24 MiB per call)
    moe_layer   colibri::moe_layer_bf16, the fused layer (norm, router over 64 experts, the 8
                chosen, combine, residual) on a fresh random token per call, 64 experts per layer,
                2 layers in turn

Each (tree, round) runs in its own subprocess importing that tree's engine (benchmarks/trees.py);
with --before-src the two trees alternate for --rounds rounds, and the table gives per tree the
median GB/s over rounds with the min-max.

    python benchmarks/time/dot_kernel.py [--before-src REV] [--rounds 3] [--threads 2] [--calls 40] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("linear", "experts", "moe_layer")


def _best_rate(fn, calls: int, nbytes: int) -> float:
    """GB/s of the median call (the first few warm the thread pool and are dropped)."""
    times = []
    for i in range(calls + 3):
        t0 = time.perf_counter()
        fn(i)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def child(a) -> dict:
    import torch

    from engine.api.lab import native

    why = native.load()
    if why is not None:
        raise SystemExit(f"dot_kernel: {why}")
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    out = {}
    H, I, E, K = 1024, 512, 64, 8
    heads = [rand(32000, H) for _ in range(4)]
    x = rand(1, H)
    out["linear"] = _best_rate(lambda i: native.linear(x, heads[i % len(heads)]), a.calls, heads[0].numel() * 2)
    del heads
    experts = [(rand(I, H), rand(I, H), rand(H, I)) for _ in range(E)]
    draws = [torch.randperm(E, generator=g)[:K].sort().values.tolist() for _ in range(a.calls + 3)]
    per_call = K * 3 * I * H * 2
    out["experts"] = _best_rate(lambda i: native.experts(x, [t for e in draws[i] for t in experts[e]], 3),
                                a.calls, per_call)
    layers = []
    for _ in range(2):
        own = [(rand(I, H), rand(I, H), rand(H, I)) for _ in range(E)]
        table = torch.tensor([[t.data_ptr() for t in e] for e in own], dtype=torch.int64)
        layers.append((own, rand(H) + 1, rand(E, H), table))
    tokens = [rand(1, H) for _ in range(a.calls + 3)]

    def layer(i):
        _own, norm_w, router_w, table = layers[i % len(layers)]
        native.moe_layer(tokens[i], norm_w, 1e-6, router_w, K, True, table, I)

    out["moe_layer"] = _best_rate(layer, a.calls, per_call + E * H * 2)
    out["threads"] = torch.get_num_threads()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-src", help="a second tree (the old code), alternated with this one")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.child:
        json.dump(child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    from benchmarks.trees import alternate_sides, run_in_tree

    args = ["--threads", str(a.threads), "--calls", str(a.calls)]
    rows = alternate_sides(ROOT, a.before_src, a.rounds, lambda tree: run_in_tree(__file__, tree, args))
    if a.json:
        from benchmarks.benchkit import emit, run_conditions  # the parent only: the child prints its wire JSON
        emit('dot_kernel', rows, run_conditions(a), True, [])
        return 0
    print(f"bf16 decode kernels, GB/s of weights streamed (median call of {a.calls}; per tree the median over"
          f" {a.rounds} rounds, min-max), {a.threads} threads\n")
    print("| tree | " + " | ".join(SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for side in dict.fromkeys(r["side"] for r in rows):
        mine = [r for r in rows if r["side"] == side]
        cells = []
        for shape in SHAPES:
            v = [r[shape] for r in mine]
            cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})")
        print(f"| {side} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
