"""A conversation through serve's worker: TTFT per turn with prefix reuse off, on, and after a restart.

No HTTP; the restart is a new server on the same KV directory, its RAM empty.

Each turn appends --user-tokens of user text (words drawn from a fixed list, seeded, added until
the message alone encodes to at least that many tokens) to the history and asks for
--answer-tokens (greedy); the history is rendered through the model's chat template, as `colibri
serve` does, so every turn resends everything before it (the issue-42 benchmark: 10 turns, ~200
tokens of user text and 64-token answers).

Each pass (one conversation with one setting) runs in its own process, a fresh server: the memory
plan counts the process's RSS as runtime overhead, so engines made one after another in one
process grew each other's overhead until the plan refused the next. Under --budget the pass runs
inside a memory cgroup of that size (page cache counted; tuner/sandbox), the engine's budget the
same. Cold (the default): before each pass the model's pages and the KV directory's are dropped
(benchmarks/io/page_cache.py), so the first turn reads the weights from the disk and the restart
pass reads its KV from the SSD. A round is the three passes, the "on" pass's KV directory fresh
and the restart pass reusing it; rounds alternate the order (off first, then off last) and the
table quotes each figure's median (min-max) over --repeats rounds.

    .venv/bin/python benchmarks/serving/prefix_turns.py --model tiny --turns 4 --user-tokens 32 --answer-tokens 8 --budget 0
    .venv/bin/python benchmarks/serving/prefix_turns.py --model demo --budget 1GiB --repeats 1 \
        --config benchmarks/serving/serve_demo_1GiB.toml

The rows: per turn and pass, the prompt and the tokens reused, TTFT and the turn's wall time (the
client's: submit to the last token), the expert bytes read until the first token and in the whole
turn, and the KV bytes restored (from RAM blocks or the SSD) and read from the SSD. The notes: the
issue's target (the last turn's TTFT within 1.5x of the second's, with reuse; without, growing
with the history), the last turn's TTFT off against on, each pass's load time, cgroup peak and
RSS, and whether every pass produced the same greedy answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TOOL = "prefix_turns"
MiB = 1 << 20
PASSES = ("off", "on", "after restart")
WORDS = ("disk stream expert layer cache token prompt model answer question memory budget read "
         "write block prefix history turn agent tool result reuse restore").split()
TEMPLATE_SLACK = 64  # tokens a turn's chat-template markup may add, for the default --ctx-size
TARGET_RATIO = 1.5  # issue 42: the last turn's TTFT within 1.5x of the second's, with reuse


# --- the conversation ----------------------------------------------------------------------------

def user_messages(encode, turns: int, user_tokens: int, seed: int) -> list[str]:
    """The conversation's user messages: seeded words, each message grown a word at a time until
    `encode(text)` (the model's tokenizer, no special tokens) gives at least user_tokens ids. The
    same seed gives the same messages in every pass, so the passes differ only in reuse."""
    rng = random.Random(seed)
    out = []
    for _ in range(turns):
        words: list[str] = []
        while not words or len(encode(" ".join(words))) < user_tokens:
            words.append(rng.choice(WORDS))
        out.append(" ".join(words))
    return out


def default_ctx(turns: int, user_tokens: int, answer_tokens: int) -> int:
    """A context that holds the whole conversation (its last prompt and answer), rounded up to 256:
    the plan charges the KV cache for ctx_size, so under a budget no larger than needed."""
    need = turns * (user_tokens + answer_tokens + TEMPLATE_SLACK) + answer_tokens
    return -(-need // 256) * 256


def converse(model, messages: list[str], answer_tokens: int) -> list[dict]:
    """Send the conversation through serve's worker, one turn at a time, each resending the history
    (the template's rendering of every message and answer so far). One row per turn: its prompt
    and cached tokens, TTFT, the turn's wall time as a client sees it (submit to the last token),
    and what the turn read: expert bytes from the disk (until the first token, and in all), KV bytes
    restored and read from the SSD."""
    from colibri.serve.protocol import Sampling
    from colibri.serve.worker import Job
    engine = model.engine
    history, rows = [], []
    for turn, text in enumerate(messages, 1):
        history.append({"role": "user", "content": text})
        ids = model.tokenizer.encode(model.template.render(history, add_generation_prompt=True),
                                     add_special_tokens=False).ids
        io0, px0 = engine.io_stats(), engine.prefix_stats()
        done, box, first = threading.Event(), [], []

        def emit(kind, value):
            # on the worker thread, between its steps: the first text is the first token's (no stop
            # strings hold text back), so the reads until then are the prefill's and that token's
            if not first:
                first.append(engine.io_stats())
            if kind == "done":
                box.append(value)
                done.set()

        t0 = time.perf_counter()
        model.worker.submit(Job(ids, Sampling(max_tokens=answer_tokens, temperature=0.0, top_p=1.0, seed=0, stop=[]),
                                emit))
        done.wait()
        wall = time.perf_counter() - t0
        result = box[0]
        if result.generation is None:
            raise SystemExit(f"{TOOL}: turn {turn} ({len(ids)} prompt tokens): {result.finish_reason}: {result.error}")
        gen = result.generation
        io1, px1 = engine.io_stats(), engine.prefix_stats()
        rows.append({"turn": turn, "prompt_tokens": len(ids), "cached_tokens": result.cached_tokens,
                     "answer_tokens": len(result.output_ids), "ttft_s": gen.ttft_seconds, "turn_s": wall,
                     "hit": _delta(px0, px1, "hits"),
                     "expert_bytes_read": _delta(io0, io1, "bytes_read"),
                     "expert_bytes_to_first": _delta(io0, first[0], "bytes_read"),
                     "kv_restored_bytes": _delta(px0, px1, "restored_bytes"),
                     "kv_disk_read_bytes": _delta(px0, px1, "disk_read_bytes"),
                     "answer_sha": hashlib.sha256(result.text.encode()).hexdigest()[:12]})
        history.append({"role": "assistant", "content": result.text})
    return rows


def _delta(before: dict, after: dict, key: str) -> int | None:
    """A counter's growth over one turn; None where the engine has no such counter (resident: no
    expert reads; prefix cache off: no hits)."""
    if key not in after:
        return None
    return (after.get(key) or 0) - (before.get(key) or 0)


# --- the child: one pass, one fresh server ------------------------------------------------------

def one_pass(a) -> dict:
    import torch
    from engine.api import EngineConfig, checkpoint_dtype, container_spec, parse_size
    from colibri.serve.server import LoadedModel
    on = a.pass_name != "off"
    base = EngineConfig.load(a.config) if a.config else EngineConfig()
    config = base.replace(ctx_size=a.ctx_size, ram_budget=parse_size(a.budget), prefix_cache=a.prefix_cache if on else 0,
                          **({"threads": a.threads} if a.threads else {}))
    t0 = time.perf_counter()
    model = LoadedModel(a.model, config, queue_size=1, kv_dir=a.kv_dir if on and a.kv_disk else None,
                        kv_disk_bytes=a.kv_disk if on else 0)
    load_s = time.perf_counter() - t0
    try:
        engine = model.engine
        spec = container_spec(engine.checkpoint)
        dtype = str(checkpoint_dtype(engine.checkpoint)).removeprefix("torch.")
        messages = user_messages(lambda s: model.tokenizer.encode(s, add_special_tokens=False).ids,
                                 a.turns, a.user_tokens, a.seed)
        turns = converse(model, messages, a.answer_tokens)
        stats = engine.prefix_stats()
        out = {"pass": a.pass_name, "load_s": load_s, "turns": turns, "quant": spec.label if spec else dtype,
               "io_mode": engine.config.io_mode, "threads": torch.get_num_threads(),
               "messages_sha": hashlib.sha256("\n".join(messages).encode()).hexdigest()[:12],
               "prefix": {k: v for k, v in stats.items() if isinstance(v, (int, float, bool))}}
    finally:
        model.close()  # the prefix cache writes its RAM blocks to the KV directory here
    out["maxrss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


# --- the parent: the rounds, each pass in its own process ----------------------------------------

def round_order(r: int) -> tuple[str, ...]:
    """Round r's passes: "after restart" always right after "on" (it reuses that pass's KV
    directory); "off" first in even rounds and last in odd ones, so neither setting always runs on
    the box as the other left it."""
    return PASSES if r % 2 == 0 else ("on", "after restart", "off")


def run_pass(a, model_dir: Path, name: str, kv_dir: Path, limit: int | None) -> dict:
    from benchmarks.io.page_cache import cached_bytes, drop_pages
    from tuner.sandbox import run_limited
    cold_left = None
    if not a.warm:
        paths = [model_dir] + ([kv_dir] if name != "off" else [])
        drop_pages(paths)
        cold_left = cached_bytes(paths)
    argv = [sys.executable, str(Path(__file__).resolve()), "--one-pass", name, "--model", str(model_dir),
            "--kv-dir", str(kv_dir), "--turns", str(a.turns), "--user-tokens", str(a.user_tokens),
            "--answer-tokens", str(a.answer_tokens), "--ctx-size", str(a.ctx_size), "--budget", a.budget,
            "--threads", str(a.threads), "--prefix-cache", str(a.prefix_cache), "--kv-disk", str(a.kv_disk),
            "--seed", str(a.seed)] + (["--config", str(a.config)] if a.config else [])
    print(f"{TOOL}: pass {name!r} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    res = run_limited(argv, limit, timeout=a.timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    if res.returncode != 0 or not res.stdout.strip():
        why = "OOM-killed" if res.oom_killed else ("timed out" if res.timed_out else f"exit {res.returncode}")
        tail = res.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise SystemExit(f"{TOOL}: pass {name!r} failed ({why}): {tail[0][-600:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out.update(wall_s=wall, cgroup=res.limited, cgroup_reason=res.reason, peak_bytes=res.peak_bytes,
               cached_at_start=cold_left)
    return out


def _med(values) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: dict[str, list[dict]]) -> tuple[list[dict], dict]:
    """The rows (one per turn and pass: medians and spreads over the rounds) and the notes (the
    target's ratios, each pass's load time and peak, whether the answers agreed)."""
    from benchmarks.benchkit import spread
    rows = []
    turns = len(runs[PASSES[0]][0]["turns"])
    for t in range(turns):
        for name in PASSES:
            per = [r["turns"][t] for r in runs[name]]
            rows.append({"turn": t + 1, "pass": name,
                         "prompt_tokens": _med(p["prompt_tokens"] for p in per),
                         "cached_tokens": _med(p["cached_tokens"] for p in per),
                         "hits": None if all(p["hit"] is None for p in per) else sum(p["hit"] or 0 for p in per),
                         "answer_tokens": _med(p["answer_tokens"] for p in per),
                         "ttft_s": spread(p["ttft_s"] for p in per), "turn_s": spread(p["turn_s"] for p in per),
                         "expert_mib_to_first": _mib(_med(p["expert_bytes_to_first"] for p in per)),
                         "expert_mib_read": _mib(_med(p["expert_bytes_read"] for p in per)),
                         "kv_mib_restored": _mib(_med(p["kv_restored_bytes"] for p in per)),
                         "kv_mib_from_ssd": _mib(_med(p["kv_disk_read_bytes"] for p in per))})
    notes = {}
    ttft = {(r["turn"], r["pass"]): r["ttft_s"]["median"] for r in rows}
    if turns >= 3:  # the target: the last turn against the second (the first reuses nothing)
        for name in PASSES:
            ratio = ttft[(turns, name)] / ttft[(2, name)]
            verdict = (("met" if ratio <= TARGET_RATIO else "missed") + f" (target <= {TARGET_RATIO}x)"
                       if name != "off" else ("grows with the history" if ratio > 1 else "does not grow"))
            notes[f"turn {turns} / turn 2 TTFT, {name}"] = f"{ratio:.2f}x, {verdict}"
        for name in PASSES[1:]:
            notes[f"turn {turns} TTFT, off / {name}"] = f"{ttft[(turns, 'off')] / ttft[(turns, name)]:.2f}x"
    for name in PASSES:
        rs = runs[name]
        peak = _med(r["peak_bytes"] for r in rs)
        talk = _med(sum(t["turn_s"] for t in r["turns"]) for r in rs)
        notes[f"pass {name}"] = (f"load {_med(r['load_s'] for r in rs):.2f} s, conversation {talk:.1f} s, "
                                 f"process {_med(r['wall_s'] for r in rs):.1f} s, "
                                 f"cgroup peak {'-' if peak is None else f'{peak / MiB:.0f} MiB'}, "
                                 f"maxrss {_med(r['maxrss_mib'] for r in rs):.0f} MiB, "
                                 f"KV spilled {_mib(_med(r['prefix'].get('spilled_bytes') for r in rs)) or 0} MiB")
    answers = {tuple(p["answer_sha"] for p in r["turns"]) for rs in runs.values() for r in rs}
    messages = {r["messages_sha"] for rs in runs.values() for r in rs}
    notes["same user messages and greedy answers in every pass"] = (
        "yes" if len(answers) == 1 and len(messages) == 1 else
        f"no ({len(messages)} message sets, {len(answers)} answer sets: reuse changed a greedy token)")
    return rows, notes


def _mib(b) -> float | None:
    return None if b is None else round(b / MiB, 3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="model directory or synth preset (default tiny)")
    p.add_argument("--turns", type=int, default=10, help="turns of the conversation (default 10)")
    p.add_argument("--user-tokens", type=int, default=200, help="tokens of user text per turn (default 200)")
    p.add_argument("--answer-tokens", type=int, default=64, help="greedy tokens per answer (default 64)")
    p.add_argument("--ctx-size", type=int, default=0,
                   help="context size (default: the conversation's length, rounded up to 256)")
    p.add_argument("--budget", default="1GiB",
                   help="engine budget and the pass's cgroup limit (default 1GiB; 0: resident, no cgroup)")
    p.add_argument("--prefix-cache", default=None,
                   help="the prefix cache's RAM in the reuse passes (default serve's: 256MiB or an eighth of the budget)")
    p.add_argument("--kv-disk", default="8GiB", help="the KV directory's bound in the reuse passes (default serve's, 8GiB)")
    p.add_argument("--config", type=Path, default=None,
                   help="an engine config (TOML) under the flags, e.g. benchmarks/serving/serve_demo_1GiB.toml; "
                        "its ram_budget and ctx_size give way to --budget and --ctx-size (default: the engine's "
                        "defaults)")
    p.add_argument("--threads", type=int, default=0,
                   help="compute threads (default 0: --config's, else the physical cores)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the three passes (median and min-max quoted)")
    p.add_argument("--warm", action="store_true", help="keep the page cache (default: cold, pages dropped per pass)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800, help="seconds one pass may take")
    p.add_argument("--lock", default=None, help="hold this benchmark lock per pass (not under `quiet bench`)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--one-pass", dest="pass_name", choices=PASSES, help=argparse.SUPPRESS)
    p.add_argument("--kv-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.pass_name:
        a.prefix_cache, a.kv_disk = int(a.prefix_cache), int(a.kv_disk)
        print(json.dumps(one_pass(a)))
        return 0
    from benchmarks.benchkit import bench_lock, emit, fmt_spread, refuse, run_conditions
    from engine.api import ConfigError, EngineConfig, ModelFormatError, parse_size, resolve_model, size_label
    from colibri.commands.serve import default_prefix_cache
    for flag, value in (("--turns", a.turns), ("--user-tokens", a.user_tokens), ("--answer-tokens", a.answer_tokens),
                        ("--repeats", a.repeats)):
        if value < 1:
            return refuse(TOOL, f"{flag} {value}: must be >= 1")
    if a.ctx_size < 0 or a.threads < 0:
        return refuse(TOOL, "--ctx-size and --threads must be >= 0")
    try:
        budget = parse_size(a.budget)
        a.prefix_cache = default_prefix_cache(budget) if a.prefix_cache is None else parse_size(a.prefix_cache)
        a.kv_disk = parse_size(a.kv_disk)
        model_dir = resolve_model(a.model, progress=False).resolve()
        if a.config:
            a.config = a.config.resolve()
            EngineConfig.load(a.config)  # a bad file is refused here, in one line, before any pass
    except (ConfigError, ModelFormatError, ValueError) as err:
        return refuse(TOOL, str(err))
    if a.prefix_cache <= 0:
        return refuse(TOOL, "--prefix-cache must be above 0: the reuse passes need it")
    a.ctx_size = a.ctx_size or default_ctx(a.turns, a.user_tokens, a.answer_tokens)
    runs: dict[str, list[dict]] = {name: [] for name in PASSES}
    for r in range(a.repeats):
        # a fresh KV directory per round: the "on" pass starts with nothing on the SSD, and the
        # restart pass finds what that pass left; a temporary directory (the benchmark's scratch,
        # removed after) on the same disk as the model where TMPDIR is
        with tempfile.TemporaryDirectory(prefix="colibri-turns-kv-") as kv_dir:
            for name in round_order(r):
                with bench_lock(a.lock):
                    runs[name].append(run_pass(a, model_dir, name, Path(kv_dir), budget or None))
    rows, notes = summarize(runs)
    first = runs["off"][0]
    same_disk = os.stat(tempfile.gettempdir()).st_dev == os.stat(model_dir).st_dev
    limited = all(r["cgroup"] for rs in runs.values() for r in rs)
    cold_left = max((r["cached_at_start"] or 0) for rs in runs.values() for r in rs)
    shown = argparse.Namespace(**{k: v for k, v in vars(a).items() if k not in ("pass_name", "kv_dir")})
    shown.model = model_dir.name
    shown.prefix_cache, shown.kv_disk = size_label(a.prefix_cache), size_label(a.kv_disk)
    cond = run_conditions(shown, quant=first["quant"], io_mode=first["io_mode"],
                          threads_used=first["threads"],
                          cgroup_limit=(a.budget if limited else f"none ({first['cgroup_reason']})") if budget else "none",
                          cold=(f"pages dropped before each pass, {cold_left / MiB:.1f} MiB left cached"
                                if not a.warm else False),
                          kv_dir_on_model_disk=same_disk, pass_order="alternated per round (off first, then last)")
    cols = [("turn", lambda r: r["turn"]), ("pass", lambda r: r["pass"]), ("prompt tok", lambda r: r["prompt_tokens"]),
            ("cached tok", lambda r: r["cached_tokens"]),
            ("hits", lambda r: None if r["hits"] is None else f"{r['hits']}/{a.repeats}"),
            ("TTFT s", lambda r: fmt_spread(r["ttft_s"])),
            ("turn s", lambda r: fmt_spread(r["turn_s"], 2)), ("answer tok", lambda r: r["answer_tokens"]),
            ("expert MiB to 1st token", lambda r: r["expert_mib_to_first"]),
            ("expert MiB, turn", lambda r: r["expert_mib_read"]), ("KV MiB restored", lambda r: r["kv_mib_restored"]),
            ("KV MiB from SSD", lambda r: r["kv_mib_from_ssd"])]
    emit(TOOL, rows, cond, a.json, cols, notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
