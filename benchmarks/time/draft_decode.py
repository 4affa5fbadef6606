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
each but `off` once per drafter of --drafter (lookup: prompt lookup; mtp: the checkpoint's MTP
layer; auto: MTP where the model has one, with lookup's long matches).
--paired: resident, every mode's engine in one child process; under a budget, each mode's engine in its
own child process and cgroup, all kept alive (tuner/sandbox LimitedProcess), each prompt run cold. Each
prompt is taken by every mode in turn (the order rotating), --rounds times; `x off` is then the median over prompts and rounds of a
mode's tok/s over off's on the same prompt in the same turn, seconds apart (the box's drifts, which
move whole child processes by 20% and more, cancel in the pair), with their min-max beside it. Those
engines live through every round, so the gate keeps what it measured: a server's steady state, where
the per-process rows show a gate learning from scratch on PROMPTS prompts.
Streamed rows also give each round's RAM expert cache in whole entries (`cache entries`: planned, and
+ what an idle MTP layer lends it): the plan sizes it from the process's resident set, which varies a
little between processes, and one entry moves a row whose working set is the cache's size by ~20%.
Columns: decode tok/s (median of --rounds, min-max), x off (the medians' ratio), x off by round (the
median of each round's ratio to that round's off, min-max; per-process rows), acceptance (drafts accepted / drafted),
tokens per step (tokens emitted / decode steps), drafted tokens, expert bytes read per emitted token
(streamed: every emitted token is an accepted one, the draft's or the verify's own), the store's
lookahead recall (streamed), the gate's decisions, the MTP layer's loads after lending its memory to the
expert cache (streamed; engine/run/mtp_drafter.py), and whether the tokens equal the off run's (they
must: lossless).

DIR: any model directory; `colibri synth demo -o DIR` for the streaming rows (a random model does
not copy its context: the gate then turns itself off, which the `gate` row shows), a trained
reference for acceptance that means something: `benchmarks/quant/train_reference.py --mtp` trains a
glm4_moe with an MTP module (DeepSeek-V3's objective) for --drafter lookup,mtp.
"""

from __future__ import annotations

import argparse
import collections
import json
import keyword
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOOL = "draft_decode"
PROMPTS = 3  # prompts per workload and mode
MiB = 1 << 20


# --- the child: one mode of one workload in this process ----------------------------------------

def _copy_prompts(tokenizer, vocab: int, n: int, seed: int, edit: bool = False) -> list[list[int]]:
    """copy (the file again, unchanged) or edit (again with its most frequent identifier renamed)."""
    from engine.api import stdlib_corpus
    train, _held, _ = stdlib_corpus()
    files = [f for f in train.split("\n\n\n") if 400 < len(f) < 4000]
    out = []
    for i in range(n):
        text = files[(seed * 7919 + i * 104729) % len(files)][:1200]
        ask, again = "unchanged", text
        if edit:
            old = _most_frequent_identifier(text)
            new = f"{old}_v2"
            ask, again = f"with `{old}` renamed to `{new}`", re.sub(rf"\b{re.escape(old)}\b", new, text)
        head = "\n".join(again.splitlines()[:3])
        prompt = f"{text}\n# The same code again, {ask}:\n{head}\n"
        ids = tokenizer.encode(prompt).ids if tokenizer is not None else [b % vocab for b in prompt.encode()]
        out.append(ids)
    return out


def _most_frequent_identifier(text: str) -> str:
    """The identifier used most as code in text (followed by one of ( . = [ , : ) outside comment
    lines, so not a word of prose; not a keyword, self or cls; 3 characters or more); ties: first seen."""
    skip = set(keyword.kwlist) | {"self", "cls"}
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    names = [w for w in re.findall(r"\b([A-Za-z_][A-Za-z0-9_]{2,})\s*[(.=\[,:)]", code) if w not in skip]
    counts = collections.Counter(names)
    return max(counts, key=lambda w: (counts[w], -names.index(w))) if names else "x"


def _code_prompts(tokenizer, vocab: int, n: int, seed: int) -> list[list[int]]:
    """A piece of a held-out standard-library file to continue (a trained reference never saw it)."""
    from engine.api import stdlib_corpus
    _train, held, _ = stdlib_corpus()
    files = [f for f in held.split("\n\n\n") if 400 < len(f) < 4000]
    texts = [files[(seed * 7919 + i * 104729) % len(files)][:1200] for i in range(n)]
    return [tokenizer.encode(t).ids if tokenizer is not None else [b % vocab for b in t.encode()] for t in texts]


def _free_prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    from engine.api import random_prompt_ids
    return [random_prompt_ids(64, vocab, seed * 100 + i) for i in range(n)]


def _config(a, mode: str):
    from engine.api import EngineConfig, parse_size
    depths = [int(x) for x in a.depths.split(",")]
    draft, depth = "off", max(depths)
    if mode.startswith("gate"):
        draft = "gate"
    elif mode.startswith("fixed:"):
        draft, depth = "fixed", int(mode.split(":")[1])
    return EngineConfig(ram_budget=parse_size(a.budget), ctx_size=a.ctx, threads=a.threads, draft=draft,
                        draft_depth=depth, drafter=a.drafter if draft != "off" else "auto")


def child(a) -> dict:
    from engine.api import DraftBudgetError, Engine, Sampler, generate
    mode = a.mode
    try:
        engine = Engine(a.model, _config(a, mode))
    except DraftBudgetError as exc:  # drafting does not fit beside off's prompt group: refused, not lossy
        return {"refused": str(exc)}
    with engine:
        prompts = _prompts(a, engine)
        streamed = engine.store is not None and engine.store.streams
        if engine.speculator is not None and mode.endswith("nohint"):
            engine.speculator.hints = False
        if not streamed:
            generate(engine, prompts[0], 4, Sampler())  # warm: kernels, pages
        seconds, tokens, outputs, bytes_read, recall_hits, recall_total = 0.0, 0, [], 0, 0, 0
        if engine.speculator is not None:  # its counters over every prompt's decode (the gate keeps learning)
            engine.speculator.reset_stats()
        for prompt in prompts:
            if streamed:
                engine.forget_prefixes()
                engine.store.make_cold()
            first: list = []

            def after_first(_token, first=first):
                if not first:  # decode only: the counters restart after the prefill's token
                    first.append(time.perf_counter())
                    if engine.store is not None:
                        engine.store.reset_stats()

            gen = generate(engine, prompt, a.tokens + 1, Sampler(), on_token=after_first)
            seconds += sum(gen.token_seconds)
            tokens += len(gen.token_seconds)
            outputs.append(gen.output_ids)
            io = engine.io_stats()
            bytes_read += io.get("bytes_read", 0)
            if streamed:
                recall_hits += engine.store.recall_hits
                recall_total += engine.store.recall_total
        draft = engine.draft_stats()
        # The RAM cache's whole entries: the plan's, and what a drafter's idle memory lends it. One entry
        # moves a streamed row by ~20% here where the working set is the cache's size, and the plan's
        # runtime overhead (the process's resident set, which varies by ~0.4 MiB between processes)
        # sets it: the column says which plan each row ran
        plan = engine.plan
        entries = [plan.cache_slots, getattr(engine.store, "borrowable", 0)] if streamed else None
        return {"streamed": streamed, "tok_s": tokens / seconds if seconds else None, "tokens": tokens,
                "cache_entries": entries,
                "bytes_per_token": bytes_read / tokens if tokens else None, "outputs": outputs,
                "recall": recall_hits / recall_total if recall_total else None, "draft": draft or {}}


def paired_child(a) -> dict:
    """--paired: every mode's engine in this one process (resident), the prompts taken in turn by each
    mode, the order rotating, --rounds times: each mode's tok/s per prompt and the ratio to `off` on the
    same prompt within the same turn (a pair measured seconds apart, so the box's slow drifts cancel).
    The engines live through every round: the gate keeps what it measured (a server's steady state)."""
    from engine.api import DraftBudgetError, Engine, Sampler, generate
    modes = json.loads(a.paired_modes)  # [[drafter, mode], ...], ["auto", "off"] first
    engines = {}
    for drafter, mode in modes:
        a.drafter = drafter
        try:
            engines[(drafter, mode)] = Engine(a.model, _config(a, mode))
        except DraftBudgetError as exc:
            engines[(drafter, mode)] = str(exc)
    live = {m: e for m, e in engines.items() if not isinstance(e, str)}
    prompts = _prompts(a, next(iter(live.values())))
    for e in live.values():
        generate(e, prompts[0], 4, Sampler())  # warm: kernels, pages
        if e.speculator is not None:
            e.speculator.reset_stats()
    out = {m: {"tok_s": [], "ratio": [], "outputs": []} for m in live}
    order = list(live)
    for r in range(a.rounds):
        for i, prompt in enumerate(prompts):
            turn = order[(r * len(prompts) + i) % len(order):] + order[:(r * len(prompts) + i) % len(order)]
            rate = {}
            for m in turn:
                gen = generate(live[m], prompt, a.tokens + 1, Sampler())
                rate[m] = (len(gen.token_seconds) - 1) / sum(gen.token_seconds[1:])
                out[m]["tok_s"].append(rate[m])
                if r == 0:
                    out[m]["outputs"].append(gen.output_ids)
            for m in live:
                out[m]["ratio"].append(rate[m] / rate[("auto", "off")])
    result = []
    for m, e in engines.items():
        if isinstance(e, str):
            result.append({"mode": list(m), "refused": e})
            continue
        result.append({"mode": list(m), **out[m], "draft": e.draft_stats() or {}})
        e.close()
    return {"modes": result}


def stream_child(a) -> None:
    """--paired under a budget: one mode's engine in this process (inside its cgroup), kept alive while
    the parent takes the modes in turn, prompt by prompt: a line {"prompt": i} runs prompt i cold (the
    caches emptied, their pages dropped) and answers its decode tok/s, expert bytes per token, lookahead
    recall and tokens; {"stats": 1} answers the drafting counters; EOF ends it. The first line says
    whether the engine stands (its cache entries) or refused this drafting at this budget."""
    from engine.api import DraftBudgetError, Engine, Sampler, generate
    try:
        engine = Engine(a.model, _config(a, a.mode))
    except DraftBudgetError as exc:
        print(json.dumps({"refused": str(exc)}), flush=True)
        return
    with engine:
        prompts = _prompts(a, engine)
        plan, store = engine.plan, engine.store
        print(json.dumps({"cache_entries": [plan.cache_slots, getattr(store, "borrowable", 0)]}), flush=True)
        if engine.speculator is not None:
            engine.speculator.reset_stats()
        for line in sys.stdin:
            ask = json.loads(line)
            if "stats" in ask:
                print(json.dumps(engine.draft_stats() or {}), flush=True)
                continue
            engine.forget_prefixes()
            store.make_cold()
            first: list = []

            def after_first(_token, first=first):
                if not first:  # decode only: the counters restart after the prefill's token
                    first.append(time.perf_counter())
                    store.reset_stats()

            gen = generate(engine, prompts[ask["prompt"]], a.tokens + 1, Sampler(), on_token=after_first)
            tokens = len(gen.token_seconds)
            print(json.dumps({"tok_s": tokens / sum(gen.token_seconds),
                              "bytes_per_token": engine.io_stats().get("bytes_read", 0) / tokens,
                              "recall": [store.recall_hits, store.recall_total], "outputs": gen.output_ids}),
                  flush=True)


def run_paired_streamed(a, budget: str, workload: str, modes: list[tuple]) -> list[dict]:
    """--paired under a budget: each mode's engine in its own process and cgroup (stream_child), all
    alive at once; each prompt taken by every mode in turn (the order rotating), --rounds times. x off is
    the median over prompts and rounds of a mode's tok/s over off's on the same prompt in the same turn."""
    from benchmarks.benchkit import spread
    from engine.api import parse_size
    from tuner.sandbox import LimitedProcess
    procs, first = {}, {}
    try:
        for m in modes:
            argv = [sys.executable, str(Path(__file__).resolve()), "--stream-child", "--model", a.model, "--workload",
                    workload, "--mode", m[1], "--ctx", str(a.ctx), "--budget", budget, "--threads", str(a.threads),
                    "--tokens", str(a.tokens), "--depths", a.depths, "--drafter", m[0], "--seed", str(a.seed)]
            procs[m] = LimitedProcess(argv, parse_size(budget), cwd=REPO)
        for m, p in procs.items():  # the first line each prints by itself: ready, or refused
            try:
                first[m] = json.loads(p.answer(a.timeout))
            except RuntimeError as exc:
                raise SystemExit(f"{TOOL}: {workload} {' '.join(m)} under {budget} did not start: {exc}") from None
        live = [m for m in modes if "refused" not in first[m]]
        off = ("auto", "off")
        out = {m: {"tok_s": [], "ratio": [], "bytes": [], "recall": [0, 0], "outputs": []} for m in live}
        print(f"{TOOL}: {workload} paired under {budget}, {len(live)} modes x {a.rounds} rounds x {PROMPTS} prompts ...",
              file=sys.stderr, flush=True)
        for r in range(a.rounds):
            for i in range(PROMPTS):
                k = (r * PROMPTS + i) % len(live)
                got = {m: json.loads(procs[m].ask(json.dumps({"prompt": i}), a.timeout)) for m in live[k:] + live[:k]}
                for m in live:
                    g = got[m]
                    out[m]["tok_s"].append(g["tok_s"])
                    out[m]["ratio"].append(g["tok_s"] / got[off]["tok_s"])
                    out[m]["bytes"].append(g["bytes_per_token"])
                    out[m]["recall"] = [x + y for x, y in zip(out[m]["recall"], g["recall"])]
                    if r == 0:
                        out[m]["outputs"].append(g["outputs"])
        stats = {m: json.loads(procs[m].ask(json.dumps({"stats": 1}), a.timeout)) for m in live}
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
                         "streamed": True, "read_mib_per_token": None, "recall": None,
                         "decisions": "refused: " + first[m]["refused"], "lossless": None, "cgroup": limited})
            continue
        d, o = stats[m], out[m]
        entries = first[m]["cache_entries"]
        rows.append({"budget": budget, "workload": workload, "drafter": None if mode == "off" else drafter,
                     "mode": mode, "tok_s": spread(o["tok_s"]), "ratios": spread(o["ratio"]) if mode != "off" else None,
                     "x_off": round(statistics.median(o["ratio"]), 3), "acceptance": d.get("acceptance"),
                     "tokens_per_step": d.get("tokens_per_step"), "drafted": d.get("drafted"), "streamed": True,
                     "read_mib_per_token": round(statistics.median(o["bytes"]) / MiB, 3),
                     "recall": round(o["recall"][0] / o["recall"][1], 3) if o["recall"][1] else None,
                     "decisions": d.get("decisions"),
                     "mtp_loads": d.get("mtp_loads") if drafter in ("mtp", "auto") and mode != "off" else None,
                     "cache_entries": f"{entries[0]}+{entries[1]}" if entries[1] else str(entries[0]),
                     "lossless": o["outputs"] == out[off]["outputs"], "cgroup": limited})
    return rows


def _prompts(a, engine) -> list[list[int]]:
    from engine.api import load_tokenizer
    vocab = engine.args.vocab_size
    if a.workload in ("copy", "edit"):
        prompts = _copy_prompts(load_tokenizer(a.model), vocab, PROMPTS, a.seed, edit=a.workload == "edit")
    elif a.workload == "code":
        prompts = _code_prompts(load_tokenizer(a.model), vocab, PROMPTS, a.seed)
    else:
        prompts = _free_prompts(vocab, PROMPTS, a.seed)
    return [p[-(a.ctx - a.tokens - 8):] for p in prompts]


def run_paired(a, workload: str, modes: list[tuple]) -> dict:
    from benchmarks.benchkit import child_json
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--paired-modes", json.dumps(modes), "--model",
            a.model, "--workload", workload, "--ctx", str(a.ctx), "--budget", "0", "--threads", str(a.threads),
            "--tokens", str(a.tokens), "--depths", a.depths, "--seed", str(a.seed), "--rounds", str(a.rounds)]
    print(f"{TOOL}: {workload} paired, {len(modes)} modes x {a.rounds} rounds x {PROMPTS} prompts ...", file=sys.stderr,
          flush=True)
    return child_json(TOOL, argv, "0", a.timeout, f"{workload} paired", REPO)


def run_child(a, budget: str, workload: str, drafter: str, mode: str, round_: int) -> dict:
    from benchmarks.benchkit import child_json
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", a.model, "--workload", workload,
            "--mode", mode, "--ctx", str(a.ctx), "--budget", budget, "--threads", str(a.threads),
            "--tokens", str(a.tokens), "--depths", a.depths, "--drafter", drafter, "--seed", str(a.seed)]
    name = mode if mode == "off" else f"{drafter} {mode}"
    print(f"{TOOL}: {workload} {name} round {round_ + 1} budget={budget} ...", file=sys.stderr, flush=True)
    return child_json(TOOL, argv, budget, a.timeout, f"{workload} {name}, budget {budget}", REPO)


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
                         "gate without the drafts' prefetch hints); default all three")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating the order (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600)
    add_output_flags(ap)
    ap.add_argument("--paired", action="store_true",
                    help="each prompt taken by every mode in turn (resident: every mode in one process; under a "
                         "budget: each in its own cgroup, all kept alive), x off = the median of the per-prompt ratios "
                         "to off (the box's drifts cancel); the engines keep their gate's measurements through the "
                         "rounds (a server's steady state)")
    ap.add_argument("--paired-modes", help=argparse.SUPPRESS)
    ap.add_argument("--stream-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=1024, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.stream_child:
        stream_child(a)
        return 0
    if a.child:
        print(json.dumps(paired_child(a) if a.paired_modes else child(a)))
        return 0
    from engine.api import ConfigError, parse_size
    from benchmarks.benchkit import bench_lock, emit, fmt_spread, refuse, run_conditions, spread
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
    if not kinds or any(m not in ("gate", "fixed", "nohint") for m in kinds):
        return refuse(TOOL, f"--modes {a.modes!r}: gate, fixed and/or nohint")
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
    rows = []
    for budget, size in zip(budgets, sizes):
        streamed = bool(size)
        modes = [("auto", "off")]
        for d in drafters:
            modes += [(d, "gate")] if "gate" in kinds else []
            modes += [(d, f"fixed:{k}") for k in depths] if "fixed" in kinds else []
            modes += [(d, "gate-nohint")] if streamed and "nohint" in kinds else []
        for workload in workloads:
            if a.paired:
                with bench_lock(a.lock):
                    rows += (run_paired_streamed(a, budget, workload, modes) if streamed
                             else _paired_rows(run_paired(a, workload, modes), budget, workload))
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
                                 "lossless": None, "cgroup": None})
                    continue
                d = xs[-1]["draft"]
                tok_s = [x["tok_s"] for x in xs]
                # Each round's ratio to that round's `off` (the two ran minutes apart, not a round apart)
                ratios = [x["tok_s"] / o["tok_s"] for x, o in zip(xs, runs[("auto", "off")]) if o["tok_s"]]
                rows.append({"budget": budget, "workload": workload, "drafter": None if m[1] == "off" else m[0],
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
    if a.paired:
        cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
            ("workload", "workload"), ("drafter", "drafter"), ("mode", "mode"), ("x off", "x_off"),
            ("acceptance", "acceptance"), ("tok/step", "tokens_per_step"), ("drafted", "drafted"),
            ("decisions", "decisions"), ("lossless", "lossless"))]
        cols[3:3] = [("decode tok/s", lambda r: fmt_spread(r["tok_s"]))]
        cols[5:5] = [("x off per prompt", lambda r: fmt_spread(r["ratios"]) if r["ratios"] else "-")]
        if any(sizes):  # streamed rows: their budget, bytes, recall, loads and cache
            cols[:0] = [("budget", lambda r: r["budget"])]
            cols[-1:-1] = [(h, (lambda k: lambda r: r.get(k))(k)) for h, k in (
                ("read MiB/accepted tok", "read_mib_per_token"), ("recall", "recall"), ("MTP loads", "mtp_loads"),
                ("cache entries", "cache_entries"), ("cgroup", "cgroup"))]
        emit(TOOL, rows, run_conditions(a, cold=any(sizes), greedy=True), a.json, cols)
        return 0
    cols = [(h, (lambda k: lambda r: r[k])(k)) for h, k in (
        ("budget", "budget"), ("workload", "workload"), ("drafter", "drafter"), ("mode", "mode"), ("x off", "x_off"),
        ("acceptance", "acceptance"), ("tok/step", "tokens_per_step"), ("drafted", "drafted"),
        ("read MiB/accepted tok", "read_mib_per_token"), ("recall", "recall"), ("decisions", "decisions"),
        ("MTP loads", "mtp_loads"), ("cache entries", "cache_entries"), ("lossless", "lossless"),
        ("cgroup", "cgroup"))]
    cols[4:4] = [("decode tok/s", lambda r: fmt_spread(r["tok_s"]))]
    cols[6:6] = [("x off by round", lambda r: fmt_spread(r["ratios"]) if r.get("ratios") else "-")]
    emit(TOOL, rows, run_conditions(a, cold=any(sizes), greedy=True), a.json, cols)
    return 0

def _entries(runs: list[dict]) -> str | None:
    """The RAM cache's entries over a mode's rounds: "27" where each round planned 27, "26,27,27"
    where they differed, "23+4" where an idle MTP layer lent it 4 (planned + lent)."""
    plans = [x.get("cache_entries") for x in runs]
    if not plans or any(p is None for p in plans):
        return None
    cells = [f"{p[0]}+{p[1]}" if p[1] else str(p[0]) for p in plans]
    return cells[0] if len(set(cells)) == 1 else ",".join(cells)


def _paired_rows(result: dict, budget: str, workload: str) -> list[dict]:
    """Rows of one --paired child: x off the median of the per-prompt ratios (their min-max beside it)."""
    from benchmarks.benchkit import spread
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
        rows.append({"budget": budget, "workload": workload, "drafter": None if mode == "off" else drafter,
                     "mode": mode, "tok_s": spread(m["tok_s"]), "ratios": spread(m["ratio"]),
                     "x_off": round(statistics.median(m["ratio"]), 3), "acceptance": d.get("acceptance"),
                     "tokens_per_step": d.get("tokens_per_step"), "drafted": d.get("drafted"),
                     "decisions": d.get("decisions"), "lossless": m["outputs"] == off["outputs"]})
    return rows


if __name__ == "__main__":
    sys.exit(main())
