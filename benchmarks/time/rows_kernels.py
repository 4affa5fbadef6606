"""The batched-decode kernels in isolation: M rows through a layer's routed experts in one call
(native.experts_rows / quant_experts_rows, each expert of the rows' union read once) against M calls of
the one-row op (native.experts / quant_experts: each row reads its own K experts), and linear_bf16 on
M rows against M one-row calls.

Why: a batched step (issue 39: several sequences at once, or a verify's positions) is worth what the
kernels save in bytes: a row's K experts overlap the other rows' (the union of M draws of K from E is
less than M K), and the weights of the union are read once. This prints, per weight kind and M, the
microseconds of the median step, the weight bytes each way read per step, and those bytes over the
time (effective GB/s: the solo figure is the kernel's bandwidth; the batched one counts the union's
bytes once, so where compute does not yet bound it, it stays near the solo figure while the step
costs fewer bytes).

Shapes (--shapes): `dram` (the default), E = 64 experts of gate, up [512, 1024] and down [1024, 512]
(3 MiB each in bf16: 192 MiB, several times the L3, so a step streams from DRAM as resident decode
does), K = 8 per row; linear: x [M, 1024] against an lm_head-sized W [32000, 1024] (65.5 MB), 4
copies in turn. `small`, the shapes of the drafting reference (benchmarks/quant/train_reference.py):
E = 16 experts of [256, 256] matrices (128 KiB each), K = 4, linear W [4096, 256] (2 MiB): weights
that stay in the caches between calls, a verify's regime on a small model. Each step draws its rows'
K experts uniformly (fresh draws and rows every step), M in --rows. Kinds: bf16, and int8 / int4-g64
(the same experts quantized) where the CPU has the native int kernels. The batched and the solo step
alternate within each step (the order flips every step), so drift of a loaded box falls on both.

Each measurement runs in a child process importing the tree's engine; --before-src REV (a revision or a
directory: benchmarks/trees.py) measures that tree's kernels too, the trees alternating --rounds times
(after, before, before, after, ...), each row then the median over its tree's rounds.

    python benchmarks/time/rows_kernels.py [--rows 1,2,4,8] [--kinds bf16,int8,int4-g64] [--threads 2]
        [--steps 30] [--shapes dram|small] [--before-src REV] [--rounds 1] [--json] [--lock FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if "--child" not in sys.argv:  # (a child imports its tree's engine: benchmarks/trees.py run_in_tree's PYTHONPATH)
    sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions  # noqa: E402

# name → (H, I, E, K, the linear's N): the module doc's shapes
SHAPES = {"dram": (1024, 512, 64, 8, 32000), "small": (256, 256, 16, 4, 4096)}
H, I, E, K, N_LINEAR = SHAPES["dram"]  # (set from --shapes in the child before anything is built)
KINDS = ("bf16", "int8", "int4-g64")
WARM = 3  # steps dropped: the thread pool and the first touches


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _experts(kind: str, torch, quant_tools):
    """Per expert its flat tensor list as the op takes it, and the op's last argument (per_expert /
    group) with the one-row and the rows op."""
    from engine.api.lab import native

    g = torch.Generator().manual_seed(0)
    mats = [[torch.randn(*s, generator=g) * 0.05 for s in ((I, H), (I, H), (H, I))] for _ in range(E)]
    if kind == "bf16":
        return [[m.bfloat16() for m in ex] for ex in mats], 3, native.experts, native.experts_rows
    QuantWeight, quantize = quant_tools
    quant, group = ("int8", 0) if kind == "int8" else ("int4", int(kind.split("-g")[1]))
    flat = []
    for ex in mats:
        ws = [QuantWeight.prepare(*quantize(m, quant, group or 64), quant, group or 64, torch.bfloat16,
                                  packed_kernel=quant == "int4") for m in ex]
        flat.append([t for w in ws for t in (w.qweight, w.qscale)])
    return flat, group, native.quant_experts, native.quant_experts_rows


def _steps(torch, M: int, n: int, seed: int) -> list[dict]:
    """n steps of M rows: each row's K experts (ascending), the union and its slots sorted by expert."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        routes = [sorted(torch.randperm(E, generator=g)[:K].tolist()) for _ in range(M)]
        union = sorted({e for r in routes for e in r})
        index = {e: j for j, e in enumerate(union)}
        slots = sorted((index[e], r) for r, route in enumerate(routes) for e in route)
        out.append({"x": (torch.randn(M, H, generator=g) * 0.5).bfloat16(), "routes": routes, "union": union,
                    "slot_row": torch.tensor([r for _, r in slots], dtype=torch.int64),
                    "slot_expert": torch.tensor([j for j, _ in slots], dtype=torch.int64)})
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _measure(a, torch, kind: str, flat, arg, one, rows_op) -> list[dict]:
    sizes = [_nbytes(ex) for ex in flat]
    result = []
    for M in a.rows:
        steps = _steps(torch, M, a.steps + WARM, seed=M)
        batched, solo = [], []
        with bench_lock(a.lock):
            for i, st in enumerate(steps):
                x, routes = st["x"], st["routes"]
                weights = [t for e in st["union"] for t in flat[e]]

                def run_batched():
                    rows_op(x, weights, arg, st["slot_row"], st["slot_expert"])

                def run_solo():
                    for r, route in enumerate(routes):
                        one(x[r:r + 1], [t for e in route for t in flat[e]], arg)

                pair = (run_batched, run_solo) if i % 2 == 0 else (run_solo, run_batched)
                t = [_timed(f) for f in pair]
                if i >= WARM:
                    batched.append(t[0] if i % 2 == 0 else t[1])
                    solo.append(t[1] if i % 2 == 0 else t[0])
        union_bytes = statistics.mean(sum(sizes[e] for e in st["union"]) for st in steps[WARM:])
        solo_bytes = statistics.mean(sum(sizes[e] for r in st["routes"] for e in r) for st in steps[WARM:])
        tb, ts = statistics.median(batched), statistics.median(solo)
        result.append({"op": f"experts {kind}", "rows": M,
                       "union": statistics.mean(len(st["union"]) for st in steps[WARM:]),
                       "us_batched": tb * 1e6, "us_solo": ts * 1e6, "speedup": ts / tb,
                       "mb_batched": union_bytes / 1e6, "mb_solo": solo_bytes / 1e6,
                       "gbs_batched": union_bytes / tb / 1e9, "gbs_solo": solo_bytes / ts / 1e9})
    return result


def _measure_linear(a, torch) -> list[dict]:
    from engine.api.lab import native

    g = torch.Generator().manual_seed(1)
    heads = [(torch.randn(N_LINEAR, H, generator=g) * 0.05).bfloat16() for _ in range(4)]
    nbytes = _nbytes(heads[:1])
    result = []
    for M in a.rows:
        xs = [(torch.randn(M, H, generator=g) * 0.5).bfloat16() for _ in range(a.steps + WARM)]
        batched, solo = [], []
        with bench_lock(a.lock):
            for i, x in enumerate(xs):
                w = heads[i % len(heads)]
                pair = ((lambda: native.linear(x, w)), (lambda: [native.linear(x[r:r + 1], w) for r in range(M)]))
                t = [_timed(f) for f in (pair if i % 2 == 0 else pair[::-1])]
                if i >= WARM:
                    batched.append(t[0] if i % 2 == 0 else t[1])
                    solo.append(t[1] if i % 2 == 0 else t[0])
        tb, ts = statistics.median(batched), statistics.median(solo)
        result.append({"op": "linear bf16", "rows": M, "union": None, "us_batched": tb * 1e6, "us_solo": ts * 1e6,
                       "speedup": ts / tb, "mb_batched": nbytes / 1e6, "mb_solo": M * nbytes / 1e6,
                       "gbs_batched": nbytes / tb / 1e9, "gbs_solo": M * nbytes / ts / 1e9})
    return result


COLUMNS = [("op", lambda r: r["op"]), ("rows M", lambda r: r["rows"]),
           ("union experts", lambda r: None if r["union"] is None else round(r["union"], 1)),
           ("µs batched", lambda r: round(r["us_batched"])), ("µs M × 1-row", lambda r: round(r["us_solo"])),
           ("speedup", lambda r: round(r["speedup"], 2)),
           ("MB read batched", lambda r: round(r["mb_batched"], 1)), ("MB read M × 1-row", lambda r: round(r["mb_solo"], 1)),
           ("GB/s batched", lambda r: round(r["gbs_batched"], 1)), ("GB/s M × 1-row", lambda r: round(r["gbs_solo"], 1))]


def child(a) -> dict:
    """This process's rows (the child half: its tree's engine), as JSON."""
    global H, I, E, K, N_LINEAR
    H, I, E, K, N_LINEAR = SHAPES[a.shapes]
    import torch

    from engine.api import QuantWeight, quantize
    from engine.api.lab import native

    why = native.load()
    if why is not None:
        return {"refused": why}
    torch.set_num_threads(a.threads)
    rows, skipped = [], []
    for kind in a.kinds.split(","):
        if kind != "bf16" and not native.int_ready:
            skipped.append(kind)
            continue
        flat, arg, one, rows_op = _experts(kind, torch, (QuantWeight, quantize))
        rows += _measure(a, torch, kind, flat, arg, one, rows_op)
        del flat
    rows += _measure_linear(a, torch)
    return {"rows": rows, "skipped": skipped, "threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8", help="the row counts M, comma-separated (default 1,2,4,8)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"weight kinds among {', '.join(KINDS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per (kind, M); the median is quoted")
    ap.add_argument("--shapes", choices=tuple(SHAPES), default="dram",
                    help="dram (default): experts and lm_head streamed from memory; small: the drafting reference's, "
                         "which stay in the caches")
    ap.add_argument("--before-src", help="a second tree (a revision or a directory), its kernels alternated with these")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of the trees alternating (default 1)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_output_flags(ap)
    a = ap.parse_args()
    try:
        rows_m = [int(m) for m in a.rows.split(",")]
    except ValueError:
        return refuse("rows_kernels", f"--rows {a.rows!r}: comma-separated integers")
    if not rows_m or min(rows_m) < 1 or a.steps < 1 or a.rounds < 1:
        return refuse("rows_kernels", "--rows must be positive integers, --steps and --rounds at least 1")
    if any(k not in KINDS for k in a.kinds.split(",")):
        return refuse("rows_kernels", f"--kinds {a.kinds!r}: choose among {', '.join(KINDS)}")
    if a.child:
        import json
        a.rows = rows_m
        print(json.dumps(child(a)))
        return 0
    return _parent(a)


def _parent(a) -> int:
    """Each tree's rows from its children, alternating; per (tree, op, M) the medians over its rounds."""
    import contextlib

    from benchmarks.trees import run_in_tree, source_tree
    args = ["--rows", a.rows, "--kinds", a.kinds, "--threads", str(a.threads), "--steps", str(a.steps),
            "--shapes", a.shapes] + (["--lock", a.lock] if a.lock else [])
    by_key: dict = {}
    skipped, threads = [], None
    with contextlib.ExitStack() as stack:
        trees = [("after", ROOT)]
        if a.before_src:
            trees.append(("before", stack.enter_context(source_tree(a.before_src))))
        for r in range(a.rounds):
            for side, tree in (trees if r % 2 == 0 else trees[::-1]):
                print(f"rows_kernels: round {r + 1}/{a.rounds}, {side} ...", file=sys.stderr, flush=True)
                got = run_in_tree(__file__, tree, args)
                if "refused" in got:
                    return refuse("rows_kernels", got["refused"])
                skipped, threads = got["skipped"], got["threads"]
                for row in got["rows"]:
                    by_key.setdefault((side, row["op"], row["rows"]), []).append(row)
    rows = []
    for (side, op, m), runs in by_key.items():
        med = {k: statistics.median(run[k] for run in runs)
               for k in ("us_batched", "us_solo", "mb_batched", "mb_solo")}
        rows.append({"tree": side, "op": op, "rows": m, "union": runs[0]["union"], **med,
                     "speedup": med["us_solo"] / med["us_batched"],
                     "gbs_batched": med["mb_batched"] / med["us_batched"] * 1e3,
                     "gbs_solo": med["mb_solo"] / med["us_solo"] * 1e3})
    notes = {"skipped": f"{', '.join(skipped)}: no native int kernels (VNNI/VBMI)"} if skipped else None
    columns = ([("tree", lambda r: r["tree"])] if a.before_src else []) + COLUMNS
    emit("rows_kernels", rows, run_conditions(a, threads_used=threads), a.json, columns, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
