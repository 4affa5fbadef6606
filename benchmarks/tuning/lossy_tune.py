"""A `tune --max-kl` run and its speed-quality front: every lossy setting it measured, with speed and quality.

    python benchmarks/tuning/lossy_tune.py --model DIR [--quant bf16,int8] [--max-kl 0.05] [--trials 12]
        [--ram-budget 512MiB] [--min-ctx 2048] [--prompts FILE] [--profile FILE] [--quality-tokens 1024]
        [--quality-ctx 256] [--front-rounds 2] [--out DIR] [--json] [--lock FILE] [--prepare-only | --resume]

Runs `colibri tune --max-kl ...` (with --quant: one study per level, tuner/search/quant_tune.py)
as a user would, then prints the run's lossy.json as a table: per measured setting (quant level,
KV precision, top-k reduction, expert threshold) its fastest search trial's decode tok/s, its
mean KL and same-top-1 against the lossless (unquantized) model on the fixed text, whether it is
inside the bound and on the Pareto front, and the chosen point. With --front-rounds N (tune's; default
2, 0: off) every setting inside the bound and lossless are re-measured in N interleaved rounds after
the search (tuner/search/front_confirm.py) and the front is drawn from those medians: the table's
first speed column is the confirmed median (min-max over every repeat, runs), the search trial's
figure beside it, '(search)' where a point was not re-measured. `--front-rounds 0` reproduces the
fronts docs/BENCHMARKS.md quoted before 2026-12-03 (search figures only).

With --quant, `--prepare-only` converts the levels and scores their quality (untimed: run it under
`quiet test`), and `--resume --out DIR` then runs the studies alone (timed: `quiet bench`), so the
bench time goes to trials; the lossy settings' own quality is scored inside the studies. The search is Optuna's (GP by
default), so which settings get measured depends on the seed and the trial count: the table
says what was measured, not every combination.

--min-ctx and --prompts are tune's own (the context every candidate must hold, and the user's
requests instead of the fixed prompt): a long context is where KV precision matters, because the
memory plan charges the KV cache for the whole ctx_size and what int8 / fp8 KV saves goes to the
expert cache (docs/TUNING.md, "Lossy settings").
--json prints the run's lossy.json as one colibri.bench/1 document (benchkit.emit): its points are
the rows, everything else in it (bound, chosen, front confirmation) the notes. --lock FILE holds
benchkit.bench_lock over the tune (not over --prepare-only, which times nothing).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, run_conditions  # noqa: E402
from engine.api import parse_size  # noqa: E402
from tuner.search.lossy import QualityBound  # noqa: E402
from tuner.search.quant_tune import QuantTuneOptions, parse_levels, run_quant_tune  # noqa: E402
from tuner.search.study import TuneOptions, run_tune  # noqa: E402

TOOL = "lossy_tune"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="model directory or synth preset")
    ap.add_argument("--quant", help="levels, e.g. bf16,int8 (one study each)")
    ap.add_argument("--max-kl", type=float, default=0.05)
    ap.add_argument("--min-top1", type=float)
    ap.add_argument("--trials", type=int, default=12, help="per level")
    ap.add_argument("--ram-budget", default="512MiB")
    ap.add_argument("--quality-tokens", type=int, default=1024)
    ap.add_argument("--quality-ctx", type=int, default=256)
    ap.add_argument("--min-ctx", type=int, default=TuneOptions.min_ctx,
                    help="smallest context every candidate holds (tune's --min-ctx; the KV cache is planned for it)")
    ap.add_argument("--prompts", help="tune's --prompts: your requests (one per line, or JSONL) instead of the fixed prompt")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--front-rounds", type=int, default=TuneOptions.front_rounds,
                    help="tune's --front-rounds: interleaved rounds re-measuring the front's points inside the bound "
                         f"(default {TuneOptions.front_rounds}; 0: the front from search trials)")
    ap.add_argument("--out", help="run directory (default: reports/...)")
    ap.add_argument("--profile", help="a saved probe (e.g. profiles/<machine>.json) instead of probing")
    ap.add_argument("--prepare-only", action="store_true", help="with --quant: convert and score, tune nothing")
    ap.add_argument("--resume", action="store_true", help="continue the run in --out (e.g. after --prepare-only)")
    add_output_flags(ap)
    a = ap.parse_args(argv)
    if a.front_rounds < 0:
        ap.error(f"--front-rounds must be a non-negative integer, got {a.front_rounds}")
    if a.prepare_only and not a.quant:
        ap.error("--prepare-only needs --quant (the levels to convert and score)")
    return a


def tune_options(a: argparse.Namespace) -> TuneOptions:
    """The tune a user would run with these flags (the bound checked here: one error line)."""
    bound = QualityBound(max_kl=a.max_kl, min_top1=a.min_top1, tokens=a.quality_tokens, ctx=a.quality_ctx).validate()
    return TuneOptions(model=a.model, ram_budget=parse_size(a.ram_budget), trials=a.trials, tokens=a.tokens,
                       repeats=a.repeats, seed=a.seed, out=Path(a.out) if a.out else None, confirm_top=2,
                       confirm_rounds=1, profile=a.profile, lossy=bound, resume=a.resume, min_ctx=a.min_ctx,
                       prompts=a.prompts, front_rounds=a.front_rounds)


def main(argv=None) -> int:
    a = parse_args(argv)
    opts = tune_options(a)
    if a.quant:
        with bench_lock(None if a.prepare_only else a.lock):
            out = run_quant_tune(QuantTuneOptions(opts, parse_levels(a.quant), quality_tokens=a.quality_tokens,
                                                  quality_ctx=a.quality_ctx, prepare_only=a.prepare_only)).out_dir
        if a.prepare_only:
            print(f"prepared {a.quant} in {out}: run again with --resume --out {out}")
            return 0
    else:
        with bench_lock(a.lock):
            out = run_tune(opts).out_dir
    lossy = Path(out) / "lossy.json"
    if not lossy.is_file():  # every level refused (e.g. a budget below the plan): tune said why above
        print(f"lossy_tune: error: no lossy.json in {out}: no level measured a trial", file=sys.stderr)
        return 1
    summary = json.loads(lossy.read_text(encoding="utf-8"))
    if a.json:
        emit(TOOL, summary["points"], run_conditions(a, run=str(out), bound=summary.get("bound_text"), cold=True),
             True, [], notes={k: v for k, v in summary.items() if k != "points"})
        return 0
    workload = f"prompts {a.prompts}" if a.prompts else f"{a.tokens} decode tokens x {a.repeats} repeats"
    print(f"model {a.model}, budget {a.ram_budget}, min ctx {a.min_ctx}, {a.trials} trials per level, "
          f"bound {summary['bound_text']}, quality on {a.quality_tokens} tokens (ctx {a.quality_ctx}), {workload}, "
          f"cold, front rounds {a.front_rounds}; {platform.machine()} {platform.python_version()}; run {out}")
    print(f"{'setting':<34} {'decode tok/s':>14} {'min-max':>13} {'runs':>4} {'search':>8} {'vs same place':>13} "
          f"{'KL mean':>9} {'top-1':>7}  bound  front  chosen")
    for p in summary["points"]:
        conf = p.get("confirmed")  # the front rounds' median (None: not re-measured, or --front-rounds 0)
        ratio = p.get("vs_lossless_same_placement_confirmed") or p.get("vs_lossless_same_placement")
        speed = f"{conf['decode_tok_s']:.3g}" if conf else f"{p['decode_tok_s']:.3g}" + (
            " (search)" if "front_figure" in p else "")
        spread = f"{conf['decode_min']:.3g}-{conf['decode_max']:.3g}" if conf and conf.get("decode_min") is not None \
            else "-"
        print(f"{p['label']:<34} {speed:>14} {spread:>13} {conf['runs'] if conf else '-':>4} {p['decode_tok_s']:>8.3g} "
              f"{f'{ratio - 1:+.0%}' if ratio else '-':>13} "
              f"{p['kl_mean']:>9.5f} {100 * p['top1_agreement']:>6.2f}%"
              f"  {'in ' if p['within_bound'] else 'OUT'}    {'yes' if p['on_front'] else '   '}    "
              f"{'<-' if p['label'] == summary['chosen'] else ''}")
    fc = summary.get("front_confirmation") or {}
    for stopped in [fc.get("stopped")] + [level.get("stopped") for level in fc.get("per_level") or [] if level]:
        if stopped:  # out of time: the table's '(search)' points were not re-measured
            print(f"front rounds stopped early: {stopped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
