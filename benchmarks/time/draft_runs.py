"""draft_decode.py's parent side (a helper of draft_decode.py, not a command; its docstring has the
method): the child processes it starts, each the entry script itself (SCRIPT) with --child or
--stream-child (draft_child.py holds what they run), and their answers made into rows.

`run_child`: one mode of one workload in a child of its own (per-process rows; the rows are main's).
`run_paired`: --paired resident, every mode in one child; `paired_rows` its rows. `run_paired_streamed`:
--paired under a budget, each mode in its own children (--processes of them) and cgroups, all kept alive
(with --before-src, each drafting mode also from that tree); it returns its rows.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
from pathlib import Path

from benchmarks.time.draft_workloads import PROMPTS
from benchmarks.time.memory_layouts import child_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().with_name("draft_decode.py")  # the entry point each child re-invokes

TOOL = "draft_decode"
# What a streamed child answers per prompt beside its stall, medians in the rows: reads asked on demand,
# the lookahead's reads started and used, per token, and the share of the decode run with an idle MTP
# layer's loan in the RAM cache, page faults, and the slot arena's MiB on huge pages (where equal bytes
# still wait longer, these say why)
READ_COUNTS = ("demand_per_token", "prefetch_per_token", "prefetch_used_per_token", "read_ms", "lent_share",
               "major_faults", "minor_faults", "arena_huge_mib")
MiB = 1 << 20


def entries_cell(entries: list[int]) -> str:
    """A streamed engine's RAM cache in whole entries: "22", or "18+4" where an idle MTP layer lends it 4."""
    return f"{entries[0]}+{entries[1]}" if entries[1] else str(entries[0])


def turn_order(modes: list, round_: int, prompt: int) -> list:
    """The order the modes take a prompt in: rotated by round and prompt, so that over len(modes) rounds
    every prompt sees each mode in each place (rotating by round * PROMPTS + prompt left one order per
    prompt wherever there were as many modes as prompts: a mode always in the same place on a prompt)."""
    k = (round_ + prompt) % len(modes)
    return modes[k:] + modes[:k]


BEFORE = "@before"  # a mode run by --before-src's tree: "gate@before"


def run_paired_streamed(a, budget: str, workload: str, modes: list[tuple], before: Path | None = None) -> list[dict]:
    """--paired under a budget: each mode's engine in its own process and cgroup (stream_child), all
    alive at once; each prompt taken by every mode in turn, --rounds times, the order rotating with the
    round (every prompt sees every order). x off is the median over prompts and rounds of a mode's tok/s
    over off's on the same prompt in the same turn. A mode named MODE@before runs in `before`
    (--before-src's tree: its own engine and child), against this tree's off: the before and after of a
    change in one run, pair by pair.

    --processes N: each mode in N processes (copies), each of them taking every prompt in its turn; a
    mode's tok/s in a turn is the geometric mean of its copies'. A process has a pace of its own: in one
    run a twin of `off` read 8% faster than `off` on every prompt and ran 1.031x (interval 1.017-1.043,
    which the pairs' noise cannot explain), and twins ranged 0.960x to 1.043x over six runs; N copies
    draw N of those paces per mode, where one process per mode compares two draws. They start copy by copy
    (off, twin, gate, off, twin, gate, ...), so no mode holds all the first or all the last starts.

    Every mode plans with one runtime overhead (Engine(runtime_overhead_bytes=)), the one a first `off`
    child's plan counted: each process's own resident set at planning time differs from the next's by a
    few tenths of a MiB, one of the MTP reference's 0.38 MiB cache entries, and a row would then compare
    two caches, not decoding with and without drafts (aff2eab: copy's MTP gate 16+4 entries against off's
    21, 0.91x). What drafting itself takes still comes out of each mode's cache. That first child only
    measures: it goes, and every mode, `off` included, starts after it, together (when `off` was that
    child, it was the one process started alone, and in one run a twin of it ran 4% behind it). With
    --runtime-overhead given there is no such child: every run plans alike (the measured figure moved by
    8 MiB between two runs on one box, 27 cache entries against 48, which is another workload).

    --layouts random (the default): each process starts with a random memory layout of its own
    (benchmarks/time/memory_layouts.py: where its buffers lie moves its pace, the same way in every process of
    one build), so a mode's processes draw layouts as they draw paces."""
    from benchmarks.benchkit import median_interval, spread
    from benchmarks.trees import tree_env
    from engine.api import parse_size
    from tuner.sandbox import LimitedProcess
    procs, first = {}, {}
    off = ("auto", "off")
    copies = range(a.processes)  # (main checked 1 to 8)
    rng = random.Random()  # the children's layouts: fresh each run, as their paces are

    def start(key, m, overhead: int) -> None:
        tree = before if m[1].endswith(BEFORE) else None
        script = tree / SCRIPT.relative_to(REPO) if tree else SCRIPT
        argv = [sys.executable, str(script), "--stream-child", "--model", str(Path(a.model).resolve()), "--workload",
                workload, "--mode", m[1].removesuffix(BEFORE), "--ctx", str(a.ctx), "--budget", budget,
                "--threads", str(a.threads), "--tokens", str(a.tokens), "--depths", a.depths, "--drafter", m[0],
                "--seed", str(a.seed), "--runtime-overhead", str(overhead)]
        env = child_env(tree_env(tree) if tree else os.environ, a.layouts, rng)  # (each process a layout of its own)
        procs[key] = LimitedProcess(argv, parse_size(budget), cwd=tree or REPO, env=env)

    def ready(key) -> dict:  # the first line a child prints by itself: ready, or refused
        try:
            return json.loads(procs[key].answer(a.timeout))
        except RuntimeError as exc:
            raise SystemExit(f"{TOOL}: {workload} {' '.join(key[0])} under {budget} did not start: {exc}") from None

    try:
        overhead = a.runtime_overhead  # (given: every run plans alike)
        if not overhead:
            start("overhead", off, 0)  # (the overhead's measure: it goes before the modes start)
            overhead = ready("overhead")["overhead_bytes"]
            procs.pop("overhead").close()
        for j in copies:  # copy by copy: each mode's processes spread over the starts (not one mode's all first)
            for m in modes:
                start((m, j), m, overhead)
        for m in modes:
            answers = [ready((m, j)) for j in copies]
            first[m] = next((x for x in answers if "refused" in x), answers[0])
            first[m]["all_entries"] = sorted({entries_cell(x["cache_entries"]) for x in answers if "refused" not in x})
        live = [m for m in modes if "refused" not in first[m]]
        out = {m: {"tok_s": [], "ratio": [], "bytes": [], "stall": [], "recall": [0, 0], "outputs": [],
                  "steal": [], "pairs": [], **{k: [] for k in READ_COUNTS}} for m in live}
        print(f"{TOOL}: {workload} paired under {budget}, {len(live)} modes x {len(copies)} processes x {a.rounds} "
              f"rounds x {PROMPTS} prompts ...", file=sys.stderr, flush=True)
        for r in range(a.rounds):
            for i in range(PROMPTS):
                got, steal = {}, {}
                for j in copies:
                    for m in turn_order(live, r, i):
                        ticks = cpu_ticks()
                        got[m, j] = json.loads(procs[m, j].ask(json.dumps({"prompt": i}), a.timeout))
                        steal[m, j] = steal_share(ticks, cpu_ticks())
                pace = {m: statistics.geometric_mean(got[m, j]["tok_s"] for j in copies) for m in live}
                for m in live:
                    o = out[m]
                    o["tok_s"].append(pace[m])
                    o["ratio"].append(pace[m] / pace[off])
                    o["pairs"].append([round(pace[m] / pace[off], 4), _mean([steal[m, j] for j in copies]),
                                       _mean([steal[off, j] for j in copies])])
                    for j in copies:  # the per-token figures: over prompts, rounds and copies
                        g = got[m, j]
                        o["bytes"].append(g["bytes_per_token"])
                        o["stall"].append(g["stall_per_token"])
                        o["steal"].append(steal[m, j])
                        for key in READ_COUNTS:  # (an older tree's child may not answer them all)
                            o[key].append(g.get(key))
                        o["recall"] = [x + y for x, y in zip(o["recall"], g["recall"])]
                        if r == 0:
                            o["outputs"].append(g["outputs"])
        stats = {m: merge_draft_stats([json.loads(procs[m, j].ask(json.dumps({"stats": 1}), a.timeout))
                                       for j in copies]) for m in live}
        limited = all(p.limited for p in procs.values())
    finally:
        for p in procs.values():
            p.close()
    rows = []
    for m in modes:
        drafter, mode = m
        if m not in live:
            rows.append({"budget": budget, "workload": workload, "drafter": drafter, "mode": mode, "tok_s": None,
                         "ratios": None, "x_off": None, "acceptance": None, "tokens_per_step": None, "drafted": None,
                         "streamed": True, "read_mib_per_token": None, "stall_ms_per_token": None, "recall": None,
                         "decisions": "refused: " + first[m]["refused"], "lossless": None, "cgroup": limited})
            continue
        d, o = stats[m], out[m]
        rows.append({"budget": budget, "workload": workload, "drafter": None if mode in ("off", "twin") else drafter,
                     "mode": mode, "processes": len(copies), "tok_s": spread(o["tok_s"]),
                     "ratios": spread(o["ratio"]) if mode != "off" else None,
                     "x_off": round(statistics.median(o["ratio"]), 3), "acceptance": d.get("acceptance"),
                     "x_off_interval": median_interval(o["ratio"]) if mode != "off" else None,
                     "tokens_per_step": d.get("tokens_per_step"), "drafted": d.get("drafted"), "streamed": True,
                     "read_mib_per_token": round(statistics.median(o["bytes"]) / MiB, 3),
                     # what the step waited on reads: equal bytes can still wait longer (when they are asked for)
                     "stall_ms_per_token": round(statistics.median(o["stall"]) * 1000, 3),
                     "recall": round(o["recall"][0] / o["recall"][1], 3) if o["recall"][1] else None,
                     **{k: _median(o[k]) for k in READ_COUNTS},
                     "steal_share": _median(o["steal"]), "pairs": o["pairs"],
                     "decisions": d.get("decisions"),
                     "mtp_loads": d.get("mtp_loads") if drafter in ("mtp", "auto") and mode != "off" else None,
                     "cache_entries": ",".join(first[m]["all_entries"]),
                     "lossless": o["outputs"] == out[off]["outputs"], "cgroup": limited})
    return rows


def merge_draft_stats(parts: list[dict]) -> dict:
    """One mode's drafting counters over its processes (SpecStats.to_dict's, each): counts summed, the
    rates recomputed from the sums ({} where drafting is off)."""
    parts = [p for p in parts if p]
    if not parts:
        return {}
    total = {k: sum(p.get(k) or 0 for p in parts) for k in ("steps", "drafted", "accepted", "emitted", "mtp_loads")}
    decisions: dict = {}
    for p in parts:
        for why, n in p.get("decisions", {}).items():
            decisions[why] = decisions.get(why, 0) + n
    return {**total, "decisions": dict(sorted(decisions.items())),
            "acceptance": total["accepted"] / total["drafted"] if total["drafted"] else None,
            "tokens_per_step": total["emitted"] / total["steps"] if total["steps"] else None}


def _mean(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 4) if known else None


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) jiffies of the box's CPUs so far: /proc/stat's first line ((0, 0) where unreadable)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
        return int(fields[7]), sum(int(f) for f in fields)
    except (OSError, ValueError, IndexError):
        return 0, 0


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of the CPUs' time the hypervisor gave another guest between two cpu_ticks (a timed run
    on a virtual box loses that much of its CPU, in bursts: the pair's noise)."""
    total = after[1] - before[1]
    return round((after[0] - before[0]) / total, 4) if total > 0 else None


def _median(values: list) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def run_paired(a, workload: str, modes: list[tuple], budget: str = "0", tree: Path | None = None) -> dict:
    """--paired resident, or --in-process under a budget: every mode's engine in one child (no cgroup),
    run by this tree or by `tree` (--before-src's: its own engine and child)."""
    from benchmarks.benchkit import child_json
    from benchmarks.trees import tree_env
    script = tree / SCRIPT.relative_to(REPO) if tree else SCRIPT
    argv = [sys.executable, str(script), "--child", "--paired-modes", json.dumps(modes), "--model",
            str(Path(a.model).resolve()), "--workload", workload, "--ctx", str(a.ctx), "--budget", budget,
            "--threads", str(a.threads), "--tokens", str(a.tokens), "--depths", a.depths, "--seed", str(a.seed),
            "--rounds", str(a.rounds), "--layouts", a.layouts]
    print(f"{TOOL}: {workload} paired in one process{' (before)' if tree else ''}, budget {budget}, {len(modes)} "
          f"modes x {a.rounds} rounds x {PROMPTS} prompts ...", file=sys.stderr, flush=True)
    return child_json(TOOL, argv, "0", a.timeout, f"{workload} paired", tree or REPO,  # ("0": no cgroup)
                      env=tree_env(tree) if tree else None)


def run_paired_processes(a, workload: str, modes: list[tuple], budget: str = "0",
                         before: Path | None = None) -> list[dict]:
    """--paired resident in --processes processes, each every mode's engines (run_paired), their per-prompt
    tok/s and ratios pooled per mode (a process has a pace of its own; several average it out). With
    `before` (--before-src), as many processes of that tree's code, started in turn with this tree's
    (after, before, before, after, after, ...): its modes' rows come out as MODE@before, each ratio to
    its own process's `off` (two builds' kernels cannot share a process), and lossless where its tokens
    are this tree's `off`'s."""
    trees = [None, before] if before else [None]
    runs: dict = {tree: [] for tree in trees}
    for p in range(a.processes):
        for tree in (trees if p % 2 == 0 else trees[::-1]):
            runs[tree].append(run_paired(a, workload, modes, budget, tree))
    after = _pooled(runs[None])
    rows = paired_rows(after, budget, workload)
    if before:
        off = next(m for m in after["modes"] if m["mode"] == ["auto", "off"])
        theirs = _pooled(runs[before])
        for m, row in zip(theirs["modes"], paired_rows(theirs, budget, workload)):
            if row["mode"] in ("off", "twin"):
                continue  # (the before tree's own control: its pairs' ratios are to it)
            rows.append({**row, "mode": row["mode"] + BEFORE,
                         "lossless": bool(row["lossless"]) and m["outputs"] == off["outputs"]})
    return rows


def _pooled(results: list[dict]) -> dict:
    """Several paired children's results as one: per mode its lists concatenated, the outputs of the
    first, the drafting counters summed (merge_draft_stats); a mode one child refused, refused."""
    pooled = []
    for i, first in enumerate(results[0]["modes"]):
        same = [r["modes"][i] for r in results]
        refused = next((m for m in same if "refused" in m), None)
        if refused is not None:
            pooled.append(refused)
            continue
        pooled.append({"mode": first["mode"], "outputs": first["outputs"],
                       "same_outputs": all(m["outputs"] == first["outputs"] for m in same),
                       "draft": merge_draft_stats([m["draft"] for m in same]),
                       **{k: [x for m in same for x in m[k]] for k in ("tok_s", "ratio", "stall", "bytes")
                          if k in first}})
    return {"modes": pooled}


def run_child(a, budget: str, workload: str, drafter: str, mode: str, round_: int) -> dict:
    from benchmarks.benchkit import child_json
    argv = [sys.executable, str(SCRIPT), "--child", "--model", a.model, "--workload", workload,
            "--mode", mode, "--ctx", str(a.ctx), "--budget", budget, "--threads", str(a.threads),
            "--tokens", str(a.tokens), "--depths", a.depths, "--drafter", drafter, "--seed", str(a.seed)]
    name = mode if mode == "off" else f"{drafter} {mode}"
    print(f"{TOOL}: {workload} {name} round {round_ + 1} budget={budget} ...", file=sys.stderr, flush=True)
    return child_json(TOOL, argv, budget, a.timeout, f"{workload} {name}, budget {budget}", REPO)


def paired_rows(result: dict, budget: str, workload: str) -> list[dict]:
    """Rows of one --paired child: x off the median of the per-prompt ratios (their min-max and the
    median's bootstrap interval beside it)."""
    from benchmarks.benchkit import median_interval, spread
    modes = result["modes"]
    off = next(m for m in modes if m["mode"] == ["auto", "off"])
    rows = []
    for m in modes:
        drafter, mode = m["mode"]
        if "refused" in m:
            rows.append({"budget": budget, "workload": workload, "drafter": drafter, "mode": mode, "tok_s": None,
                         "ratios": None, "x_off": None, "acceptance": None, "tokens_per_step": None, "drafted": None,
                         "decisions": "refused: " + m["refused"], "lossless": None})
            continue
        d = m["draft"]
        rows.append({"budget": budget, "workload": workload, "drafter": None if mode in ("off", "twin") else drafter,
                     "mode": mode, "tok_s": spread(m["tok_s"]), "ratios": spread(m["ratio"]),
                     "x_off": round(statistics.median(m["ratio"]), 3), "acceptance": d.get("acceptance"),
                     "x_off_interval": median_interval(m["ratio"]) if mode != "off" else None,
                     "tokens_per_step": d.get("tokens_per_step"), "drafted": d.get("drafted"),
                     "decisions": d.get("decisions"),
                     "lossless": m["outputs"] == off["outputs"] and m.get("same_outputs", True)
                     and off.get("same_outputs", True),
                     **({"stall_ms_per_token": round(statistics.median(m["stall"]) * 1000, 3),
                         "read_mib_per_token": round(statistics.median(m["bytes"]) / MiB, 3),
                         "cache_entries": entries_cell(m["cache_entries"]), "cgroup": False} if m.get("stall") else {})})
    return rows

