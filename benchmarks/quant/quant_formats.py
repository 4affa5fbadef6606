"""The quant tool: what a weight format costs in speed and in quality, one command each.

    speed    bf16 vs int8 vs int4 containers of one model, side by side, in one run:
             python benchmarks/quant/quant_formats.py speed --model bf16=DIR --model int8=DIR --model int4-g64=DIR
                 [--budget 1GiB] [--tokens 8] [--repeats 2] [--rounds 1] [--skip-resident] [--json]
             For each container: on-disk MiB per expert, and two trials (`colibri bench` in a
             subprocess): cold decode under a memory cgroup limited to the budget (page cache
             counts; pages dropped and caches emptied before each repeat; O_DIRECT 1 MiB reads,
             prefetch 1, 4 reader threads), and resident decode (no budget, warm). Reported: MiB
             read per decode token, RAM hit rate, tok/s median (min-max), and the ratio to the
             first model (the bf16 baseline). With --rounds R the containers are measured in R
             interleaved rounds (the figures are the medians over all repeats of all rounds).
    quality  int8 and int4 g32/g64/g128 against bf16 on the trained reference:
             python benchmarks/quant/quant_formats.py quality --reference DIR --work DIR [--tokens 8192] [--ctx 512] [--json]
             Converts the reference (benchmarks/quant/train_reference.py) into each container under
             --work, then `colibri quality` for each (teacher-forced on the held-out Python stdlib
             text, chunks of --ctx with the second half of each scored, as llama-perplexity does),
             both models computed in fp32 so the figures are the weights' error alone. Printed
             next to llama.cpp's published figures for Llama-3-8B (/work/shared/notes/ANCHORS.md
             quotes them) — a different model and size, the same definitions.

The per-expert kernel timings are benchmarks/quant/quant_kernels.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.api import EngineConfig, convert, format_size, measure_quality, parse_size  # noqa: E402
from tuner.search.trial import run_trial  # noqa: E402
from benchmarks.benchkit import add_run_flags, conditions, emit, fmt_spread, refuse, spread  # noqa: E402

TOOL = "quant"
CASES = [("int8", "int8", 0), ("int4-g32", "int4", 32), ("int4-g64", "int4", 64), ("int4-g128", "int4", 128)]
# llama.cpp, Llama-3-8B vs FP16 (llama-perplexity --kl-divergence), as ANCHORS.md quotes them.
ANCHORS = {"int8": "Q8_0: KL 0.0014, same top-1 97.7%, ΔPPL +0.003",
           "int4-g32": "Q4_0 (g32): KL 0.072",
           "int4-g64": "Q4_K_M: KL 0.031, same top-1 91.9%, ΔPPL +0.18; torchao int4 g64 PPL 7.44 → 8.32",
           "int4-g128": "-"}


def _decode(trial) -> list[float]:
    return [r["decode_tok_s"] for r in trial.metrics.get("runs", []) if r.get("decode_tok_s")]


def speed(a) -> int:
    try:
        models = dict(m.split("=", 1) for m in a.model)
    except ValueError:
        return refuse(TOOL, f"--model wants LABEL=DIR, got {a.model}")
    budget = parse_size(a.budget)
    cold_cfg = EngineConfig(ram_budget=budget, ctx_size=512, io_mode="direct", chunk_size=1 << 20, prefetch_depth=1,
                            io_threads=4, threads=a.threads)
    warm_cfg = EngineConfig(ram_budget=0, ctx_size=512, threads=a.threads)
    cond = conditions(io_mode="direct 1MiB, prefetch 1, io_threads 4 (cold)", budget=format_size(budget),
                      cold="cgroup of the budget, pages dropped and caches emptied per repeat",
                      resident="no budget, warm", threads=a.threads, prompt_tokens=a.prompt_tokens,
                      tokens=a.tokens, repeats=a.repeats, rounds=a.rounds)
    got = {label: {"cold": [], "resident": [], "cold_trials": [], "resident_trials": []} for label in models}
    for rnd in range(a.rounds):  # rounds interleave the containers, so a drift of the disk hits each alike
        for mode, cfg, cold, limit in (("cold", cold_cfg, True, budget), ("resident", warm_cfg, False, None)):
            if mode == "resident" and a.skip_resident:
                continue
            for label, d in models.items():
                trial = run_trial(d, cfg, tokens=a.tokens, repeats=a.repeats, cold=cold, prompt_tokens=a.prompt_tokens,
                                  limit_bytes=limit, timeout=900)
                if not trial.ok:
                    print(f"{label} {mode}: {trial.status}: {trial.error}", file=sys.stderr)
                    continue
                got[label][mode] += _decode(trial)
                got[label][mode + "_trials"].append(trial.metrics | {"cgroup_peak": trial.cgroup_peak_bytes})
                print(f"round {rnd + 1} {label} {mode}: {spread(_decode(trial))['median']:.3f} tok/s", file=sys.stderr)
    rows, base = [], {}
    for label, r in got.items():
        ct = r["cold_trials"][-1] if r["cold_trials"] else {}
        rt = r["resident_trials"][-1] if r["resident_trials"] else {}
        geo = (ct or rt).get("geometry", {})
        read = spread(t["bytes_read_per_token"] / 2**20 for t in r["cold_trials"])
        hit = spread(t["hit_rate"].get("ram") or 0 for t in r["cold_trials"])
        row = {"label": label, "path": models[label], "quant": (ct or rt).get("quant"), "kernel": (ct or rt).get("kernel"),
               "mib_per_expert": geo.get("expert_bytes_on_disk", 0) / 2**20,
               "cache_slots": (ct.get("plan") or {}).get("cache_slots"),
               "mib_read_per_token": read["median"] if read else None, "ram_hit": hit["median"] if hit else None,
               "cgroup_peak": max((t["cgroup_peak"] or 0 for t in r["cold_trials"]), default=None)}
        for mode in ("cold", "resident"):
            row[mode] = spread(r[mode])
            if row[mode] and not base.get(mode):
                base[mode] = row[mode]["median"]
            row[mode + "_x"] = row[mode]["median"] / base[mode] if row[mode] and base.get(mode) else None
        rows.append(row)
    x = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
    emit(TOOL, rows, cond, a.json, [
        ("container", lambda r: r["label"]), ("kernel", lambda r: r["kernel"]),
        ("MiB/expert", lambda r: f"{r['mib_per_expert']:.3f}"), ("cache slots", lambda r: r["cache_slots"]),
        ("MiB read/token", lambda r: None if r["mib_read_per_token"] is None else f"{r['mib_read_per_token']:.1f}"),
        ("RAM hit", lambda r: None if r["ram_hit"] is None else f"{r['ram_hit']:.0%}"),
        ("cold tok/s", lambda r: fmt_spread(r["cold"])), ("cold vs first", lambda r: x(r["cold_x"])),
        ("resident tok/s", lambda r: fmt_spread(r["resident"])), ("resident vs first", lambda r: x(r["resident_x"])),
        ("cgroup peak", lambda r: format_size(r["cgroup_peak"]) if r["cgroup_peak"] else None)])
    return 0


def quality(a) -> int:
    if not Path(a.reference, "config.json").is_file():
        return refuse(TOOL, f"--reference {a.reference}: no config.json (train one with benchmarks/quant/train_reference.py)")
    torch.set_num_threads(a.threads)
    rows = []
    for label, quant, group in CASES:
        dst = Path(a.work) / label
        convert(a.reference, dst, quant, group, force=True)
        r = measure_quality(dst, a.reference, tokens=a.tokens, ctx=a.ctx, dtype="fp32", threads=a.threads)
        rows.append({"label": label, **r})
        print(f"{label}: KL {r['kl_mean']:.5f}", file=sys.stderr)
    r0 = rows[0]
    cond = conditions(reference=a.reference, compute="fp32", threads=a.threads,
                      scored=f"{r0['scored_tokens']} tokens ({r0['chunks']} chunks of {r0['ctx']}, second halves) "
                             f"of {r0['text']}", reference_ppl=round(r0["ppl_reference"], 3))
    emit(TOOL, rows, cond, a.json, [
        ("container", lambda r: r["label"]), ("mean KL", lambda r: f"{r['kl_mean']:.6f}"),
        ("p99 KL", lambda r: f"{r['kl_p99']:.6f}"), ("same top-1", lambda r: f"{100 * r['top1_agreement']:.2f}%"),
        ("PPL", lambda r: f"{r['ppl_model']:.3f}"), ("ΔPPL", lambda r: f"{r['ppl_delta']:+.3f}"),
        ("PPL change", lambda r: f"{100 * r['ppl_change']:+.2f}%"),
        ("llama.cpp on Llama-3-8B", lambda r: ANCHORS[r["label"]])])
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="quant_formats.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("speed", help="cold and resident decode of several containers of one model")
    s.add_argument("--model", action="append", required=True, metavar="LABEL=DIR")
    add_run_flags(s, budget="1GiB", tokens=8, repeats=2, prompt_tokens=4, threads=2)
    s.add_argument("--rounds", type=int, default=1)
    s.add_argument("--skip-resident", action="store_true")
    q = sub.add_parser("quality", help="KL, top-1 and perplexity of each container against bf16")
    q.add_argument("--reference", required=True)
    q.add_argument("--work", required=True, help="where the containers are written")
    q.add_argument("--tokens", type=int, default=8192, help="held-out tokens (the second half of each chunk is scored)")
    add_run_flags(q, threads=1)
    q.add_argument("--ctx", type=int, default=512)
    for p in (s, q):
        p.add_argument("--json", action="store_true")
    return ap


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    return speed(a) if a.command == "speed" else quality(a)


if __name__ == "__main__":
    sys.exit(main())
