"""Speculative decoding (engine/run/speculative.py): drafting off, gated, and at forced depths, per
drafter, on copy-heavy workloads and on free text, resident and under streaming budgets, in one run.

    .venv/bin/python benchmarks/time/draft_decode.py --model DIR [--budget 0[,1GiB,...]] [--tokens 96] \
        [--depths 2,4,8] [--drafter lookup[,mtp,auto]] [--workloads copy,edit,code,free] [--rounds 2] \
        [--modes gate,fixed,nohint] [--threads 2] [--paired] [--json] [--lock FILE]

Workloads (greedy; prompts tokenized with the model's tokenizer.json, else seeded ids):
  copy   each prompt holds a piece of a Python standard-library file, a line asking for it again, and
         its first lines once more: a model that copies its context continues the file, which prompt
         lookup predicts (agents rewriting and quoting files)
  edit   the same file, a line asking for it again with one identifier (its most frequent) renamed,
         and its first lines so edited: the copy breaks at each renamed identifier (agents editing)
  code   a piece of a held-out standard-library file to continue: nothing asked to be copied, what
         the MTP layer drafts on (a trained reference never saw these files)
  free   a prompt of seeded random ids: nothing to copy
Budgets: each of --budget's comma-separated sizes (0: resident) gives its own rows, with its own
`off` baseline. Modes, each in its own child process (inside a memory cgroup of the budget, page
cache counted, the engine's budget the same; none with budget 0: resident, one warm-up generation
first; under a budget the caches are emptied and their pages dropped before each prompt: cold):
  off        draft = off (the baseline every row of its workload and budget is compared with: `x off`)
  gate       draft = gate, draft_depth = the largest of --depths
  fixed:D    draft = fixed, draft_depth = D (the forced depths)
  gate-nohint  (streamed only) gate without the drafts' prefetch hints: the recall's "without"
  twin       (--modes twin) draft = off again, an engine and process of its own: `x off` of two
             identical engines, the floor under which a row's ratio says nothing (a control)
each but `off` once per drafter of --drafter (lookup: prompt lookup; mtp: the checkpoint's MTP
layer; auto: MTP where the model has one, with lookup's long matches).
--paired: resident, every mode's engine in one child process; under a budget, each mode's engine in its
own child process and cgroup, all kept alive (tuner/sandbox LimitedProcess), each prompt run cold
(--in-process: all of them in one child process without a cgroup, as resident, each prompt cold: a
control for what differs between processes, which the pairs of separate processes still carry). Each
prompt is taken by every mode in turn (the order rotating with the round), --rounds times; `x off` is then the median over prompts and rounds of a
mode's tok/s over off's on the same prompt in the same turn, seconds apart (the box's drifts, which
move whole child processes by 20% and more, cancel in the pair), with their min-max beside it. Those
engines live through every round, so the gate keeps what it measured: a server's steady state, where
the per-process rows show a gate learning from scratch on PROMPTS prompts. With --before-src (paired)
each drafting mode also runs as MODE@before in that tree's own child (a revision checked out, or a
directory): under a budget against this tree's off in the same turns; resident in processes of its own,
started in turn with this tree's, against their own off (two builds' native kernels cannot share a
process): a change measured before and after in one run. With --processes N (paired) under a budget
each mode runs in N processes, every one of them taking each prompt in its turn, and a mode's tok/s in a
turn is their geometric mean; resident, N processes each run every mode and their pairs are pooled: a
process has a pace of its own (a twin `off` read 8% faster than `off` on every prompt of one run,
1.031x), which one process per mode leaves in the row. --layouts random (the default with --paired) starts each process
(resident: each engine) with a random memory layout (memory_layouts.py), so a mode's processes draw layouts as
they draw paces; --runtime-overhead SIZE plans every mode of a run under a budget with that overhead, so
runs plan alike.
Streamed rows also give each round's RAM expert cache in whole entries (`cache entries`: planned, and
+ what an idle MTP layer lends it): the plan sizes it from the process's resident set, which varies a
little between processes, and one entry moves a row whose working set is the cache's size by ~20%; so
--paired under a budget plans every mode with one runtime overhead, measured by a first `off` child that
then goes; every mode, `off` included, starts after it, together.
Columns: decode tok/s (median of --rounds, min-max), x off (the medians' ratio), x off by round (the
median of each round's ratio to that round's off, min-max; per-process rows), acceptance (drafts accepted / drafted),
tokens per step (tokens emitted / decode steps), drafted tokens, expert bytes read per emitted token
(streamed: every emitted token is an accepted one, the draft's or the verify's own), the read stall per
token (--paired streamed: what decode waited on reads, median of the prompts), the store's
lookahead recall (streamed), the gate's decisions, the MTP layer's loads after lending its memory to the
expert cache (streamed; engine/run/mtp_drafter.py), and whether the tokens equal the off run's (they
must: lossless).

DIR: any model directory; `colibri synth demo -o DIR` for the streaming rows (a random model does
not copy its context: the gate then turns itself off, which the `gate` row shows), a trained
reference for acceptance that means something: `benchmarks/quant/train_reference.py --mtp` trains a
glm4_moe with an MTP module (DeepSeek-V3's objective) for --drafter lookup,mtp.

This script holds the flags, `main` (the modes of each budget, the per-process rows) and the tables;
its helper modules beside it (benchmarks.time.*, not commands): draft_workloads.py (the prompts),
draft_child.py (what a child runs: this script started again with --child or --stream-child) and
draft_runs.py (the children started, their answers made rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# The helpers beside this script (the docstring's last paragraph): after REPO is on sys.path
from benchmarks.time.draft_child import child, paired_child, stream_child  # noqa: E402
from benchmarks.time.draft_runs import (BEFORE, MiB, TOOL, entries_cell, paired_rows, run_child,  # noqa: E402
                                        run_paired, run_paired_processes, run_paired_streamed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.benchkit import add_output_flags, add_run_flags
    ap.add_argument("--model", required=True, help="a model directory")
    add_run_flags(ap, budget="0", tokens=96, threads=2)  # budget 0: resident, warm
    ap.add_argument("--depths", default="2,4,8",
                    help="forced depths (default 2,4,8); the gate's maximum is the largest")
    ap.add_argument("--drafter", default="lookup",
                    help="drafters, comma-separated: lookup, mtp, auto (default lookup); each gets its own rows")
    ap.add_argument("--workloads", default="copy,edit,code,free", help="copy, edit, code, free (default all four)")
    ap.add_argument("--modes", default="gate,fixed,nohint",
                    help="rows besides off, comma-separated: gate, fixed (the forced depths), nohint (streamed: "
                         "gate without the drafts' prefetch hints), twin (off again: the pairs' control); "
                         "default gate,fixed,nohint")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating the order (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    add_output_flags(ap)
    ap.add_argument("--paired", action="store_true",
                    help="each prompt taken by every mode in turn (resident: every mode in one process; under a "
                         "budget: each in its own cgroup, all kept alive), x off = the median of the per-prompt ratios "
                         "to off (the box's drifts cancel), with its 90%% bootstrap interval (the noise band: a "
                         "twin mode's says what noise is here); the engines keep their gate's measurements through the "
                         "rounds (a server's steady state)")
    ap.add_argument("--in-process", action="store_true",
                    help="with --paired under a budget: every mode's engine in one process and no cgroup (each plans "
                         "the budget with off's runtime overhead; the process holds them all), each prompt cold: the "
                         "pairs without what differs between processes")
    ap.add_argument("--before-src",
                    help="with --paired: every drafting mode also as MODE@before, run by this source tree (a git "
                         "revision or a directory: benchmarks/trees.py); under a budget against this tree's off, in "
                         "the same rounds; resident in processes of its own started in turn with this tree's (two "
                         "builds' kernels cannot share one), against their own off: a change's before and after in "
                         "one run")
    ap.add_argument("--processes", type=int, default=1,
                    help="with --paired: under a budget each mode in this many processes, a turn's tok/s the "
                         "geometric mean of theirs; resident this many processes of every mode, their pairs pooled "
                         "(a process has a pace of its own: N of them average it out; default 1)")
    ap.add_argument("--layouts", choices=("random", "fixed"), default="random",
                    help="with --paired: random (default) gives each process (resident: each engine) a random "
                         "memory layout, so a mode's processes draw layouts as they draw paces (one build's "
                         "layout moves its every process alike: benchmarks/time/memory_layouts.py); fixed: none")
    ap.add_argument("--runtime-overhead", default="0",
                    help="with --paired under a budget: plan every mode with this runtime overhead (e.g. 336MiB) "
                         "instead of the one a first `off` child measures, which moves by MiBs between runs (a "
                         "few cache entries here): runs that plan alike")
    ap.add_argument("--paired-modes", help=argparse.SUPPRESS)
    ap.add_argument("--stream-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=1024, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    from engine.api import ConfigError, parse_size
    from benchmarks.benchkit import refuse
    try:
        a.runtime_overhead = parse_size(a.runtime_overhead)  # (bytes from here on; a child is given bytes)
    except ConfigError as exc:
        return refuse(TOOL, f"--runtime-overhead {a.runtime_overhead!r}: {exc}")
    if a.stream_child:
        stream_child(a)
        return 0
    if a.child:
        print(json.dumps(paired_child(a) if a.paired_modes else child(a)))
        return 0
    from benchmarks.trees import source_tree
    if not Path(a.model, "config.json").is_file():
        return refuse(TOOL, f"{a.model}: not a model directory (python -m colibri.cli synth demo -o DIR)")
    try:
        depths = [int(x) for x in a.depths.split(",") if x]
    except ValueError:
        return refuse(TOOL, f"--depths {a.depths!r}: expected comma-separated integers")
    workloads = [w for w in a.workloads.split(",") if w]
    drafters = [d for d in a.drafter.split(",") if d]
    budgets = [b.strip() for b in a.budget.split(",") if b.strip()]
    if not depths or min(depths) < 1 or max(depths) > 16 or a.tokens < 1 or a.rounds < 1:
        return refuse(TOOL, "--depths in 1..16, --tokens and --rounds positive")
    if not workloads or any(w not in ("copy", "edit", "code", "free") for w in workloads):
        return refuse(TOOL, f"--workloads {a.workloads!r}: copy, edit, code and/or free")
    kinds = [m for m in a.modes.split(",") if m]
    if not kinds or any(m not in ("gate", "fixed", "nohint", "twin") for m in kinds):
        return refuse(TOOL, f"--modes {a.modes!r}: gate, fixed, nohint and/or twin")
    if not drafters or any(d not in ("lookup", "mtp", "auto") for d in drafters):
        return refuse(TOOL, f"--drafter {a.drafter!r}: lookup, mtp and/or auto")
    try:
        sizes = [parse_size(b) for b in budgets]
    except ConfigError as exc:
        return refuse(TOOL, f"--budget {a.budget!r}: {exc}")
    if not budgets:
        return refuse(TOOL, "--budget: one or more sizes (0: resident)")
    if "mtp" in drafters and not json.loads(Path(a.model, "config.json").read_text()).get("num_nextn_predict_layers"):
        return refuse(TOOL, f"--drafter mtp: {a.model} has no MTP layer (num_nextn_predict_layers; train one with "
                            f"benchmarks/quant/train_reference.py --mtp)")
    if a.processes != 1 and (not a.paired or a.in_process or not 1 <= a.processes <= 8):
        return refuse(TOOL, f"--processes {a.processes}: 1 to 8, with --paired (not --in-process)")
    if a.runtime_overhead and (not a.paired or a.in_process or not all(sizes)):
        return refuse(TOOL, "--runtime-overhead: with --paired under a budget (not --in-process, no budget 0)")
    if a.before_src and (not a.paired or a.in_process):
        return refuse(TOOL, "--before-src: with --paired (not --in-process)")
    with contextlib.ExitStack() as stack:
        before = stack.enter_context(source_tree(a.before_src)) if a.before_src else None
        rows = _measure(a, budgets, sizes, kinds, drafters, depths, workloads, before)
    _print_rows(a, rows, sizes)
    return 0


def _measure(a, budgets, sizes, kinds, drafters, depths, workloads, before) -> list[dict]:
    from benchmarks.benchkit import bench_lock, spread
    rows = []
    for budget, size in zip(budgets, sizes):
        streamed = bool(size)
        modes = [("auto", "off")] + ([("auto", "twin")] if "twin" in kinds else [])
        for d in drafters:
            ours = [(d, "gate")] if "gate" in kinds else []
            ours += [(d, f"fixed:{k}") for k in depths] if "fixed" in kinds else []
            ours += [(d, "gate-nohint")] if streamed and "nohint" in kinds else []
            modes += ours + ([(d, m + BEFORE) for d, m in ours] if before else [])
        for workload in workloads:
            if a.paired:
                with bench_lock(a.lock):
                    if streamed and not a.in_process:
                        rows += run_paired_streamed(a, budget, workload, modes, before)
                    elif streamed:
                        rows += paired_rows(run_paired(a, workload, modes, budget), budget, workload)
                    else:  # resident: --processes children of every mode, --before-src's tree's in turn
                        rows += run_paired_processes(a, workload, [m for m in modes if not m[1].endswith(BEFORE)],
                                                     budget, before)
                continue
            runs: dict[tuple, list] = {m: [] for m in modes}
            for r in range(a.rounds):
                for m in (modes if r % 2 == 0 else modes[::-1]):
                    with bench_lock(a.lock):
                        runs[m].append(run_child(a, budget, workload, *m, r))
            base = statistics.median(x["tok_s"] for x in runs[("auto", "off")])
            for m in modes:
                xs = runs[m]
                if any("refused" in x for x in xs):  # the engine refused this drafting at this budget
                    rows.append({"budget": budget, "workload": workload, "drafter": m[0], "mode": m[1],
                                 "tok_s": None, "x_off": None, "acceptance": None, "tokens_per_step": None,
                                 "drafted": None, "streamed": None, "read_mib_per_token": None, "recall": None,
                                 "decisions": "refused: " + next(x["refused"] for x in xs if "refused" in x),
                                 "mtp_loads": None, "cache_entries": None, "lossless": None, "cgroup": None})
                    continue
                d = xs[-1]["draft"]
                tok_s = [x["tok_s"] for x in xs]
                # Each round's ratio to that round's `off` (the two ran minutes apart, not a round apart)
                ratios = [x["tok_s"] / o["tok_s"] for x, o in zip(xs, runs[("auto", "off")]) if o["tok_s"]]
                rows.append({"budget": budget, "workload": workload, "drafter": None if m[1] in ("off", "twin") else m[0],
                             "mode": m[1], "tok_s": spread(tok_s),
                             "x_off": round(statistics.median(tok_s) / base, 3) if base else None,
                             "ratios": spread(ratios) if ratios and m[1] != "off" else None,
                             "acceptance": d.get("acceptance"), "tokens_per_step": d.get("tokens_per_step"),
                             "drafted": d.get("drafted"), "streamed": xs[0]["streamed"],
                             "read_mib_per_token": (round(statistics.median(x["bytes_per_token"] for x in xs) / MiB, 3)
                                                    if xs[0]["streamed"] else None),
                             "recall": xs[-1]["recall"], "decisions": d.get("decisions"),
                             "cache_entries": _entries(xs),
                             "mtp_loads": d.get("mtp_loads") if m[0] in ("mtp", "auto") and m[1] != "off" else None,
                             "lossless": all(x["outputs"] == runs[("auto", "off")][0]["outputs"] for x in xs),
                             "cgroup": xs[0]["cgroup"]})
    return rows


def _print_rows(a, rows: list[dict], sizes: list[int]) -> None:
    from benchmarks.benchkit import emit, fmt_interval, fmt_spread, run_conditions
    if a.paired:
        cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
            ("workload", "workload"), ("drafter", "drafter"), ("mode", "mode"), ("x off", "x_off"),
            ("acceptance", "acceptance"), ("tok/step", "tokens_per_step"), ("drafted", "drafted"),
            ("decisions", "decisions"), ("lossless", "lossless"))]
        cols[3:3] = [("decode tok/s", lambda r: fmt_spread(r["tok_s"]))]
        cols[5:5] = [("x off per prompt", lambda r: fmt_spread(r["ratios"]) if r["ratios"] else "-"),
                     ("x off 90% interval", lambda r: fmt_interval(r.get("x_off_interval")))]
        if any(sizes):  # streamed rows: their budget, bytes, recall, loads and cache
            cols[:0] = [("budget", lambda r: r["budget"])]
            cols[-1:-1] = [(h, (lambda k: lambda r: r.get(k))(k)) for h, k in (
                ("read MiB/accepted tok", "read_mib_per_token"), ("stall ms/tok", "stall_ms_per_token"),
                ("CPU steal", "steal_share"),
                ("demand reads/tok", "demand_per_token"), ("lookahead reads/tok", "prefetch_per_token"),
                ("lookahead used/tok", "prefetch_used_per_token"), ("read ms", "read_ms"), ("lent share", "lent_share"),
                ("major faults", "major_faults"), ("minor faults", "minor_faults"),
                ("arena huge MiB", "arena_huge_mib"), ("recall", "recall"), ("MTP loads", "mtp_loads"), ("cache entries", "cache_entries"), ("cgroup", "cgroup"))]
        emit(TOOL, rows, run_conditions(a, cold=any(sizes), greedy=True), a.json, cols)
        return
    cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
        ("budget", "budget"), ("workload", "workload"), ("drafter", "drafter"), ("mode", "mode"), ("x off", "x_off"),
        ("acceptance", "acceptance"), ("tok/step", "tokens_per_step"), ("drafted", "drafted"),
        ("read MiB/accepted tok", "read_mib_per_token"), ("recall", "recall"), ("decisions", "decisions"),
        ("MTP loads", "mtp_loads"), ("cache entries", "cache_entries"), ("lossless", "lossless"),
        ("cgroup", "cgroup"))]
    cols[4:4] = [("decode tok/s", lambda r: fmt_spread(r["tok_s"]))]
    cols[6:6] = [("x off by round", lambda r: fmt_spread(r["ratios"]) if r.get("ratios") else "-")]
    emit(TOOL, rows, run_conditions(a, cold=any(sizes), greedy=True), a.json, cols)


def _entries(runs: list[dict]) -> str | None:
    """The RAM cache's entries over a mode's rounds: "27" where each round planned 27, "26,27,27"
    where they differed, "23+4" where an idle MTP layer lent it 4 (planned + lent)."""
    plans = [x.get("cache_entries") for x in runs]
    if not plans or any(p is None for p in plans):
        return None
    cells = [entries_cell(p) for p in plans]
    return cells[0] if len(set(cells)) == 1 else ",".join(cells)


if __name__ == "__main__":
    sys.exit(main())
