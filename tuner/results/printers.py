"""Every printer of a result: text tables, markdown and JSON (formatters: tuner/base/text.py; CSV: frames.py).

One schema (tuner/results/result.py), many printers, as llama-bench does it: `colibri run`, `bench`,
`tune`, the probe summary, trials.csv and report.md all format through this module, so a figure
reads the same wherever it is shown and a formatter is defined once. A tune run's printers read
the typed TuneResult (its attributes, not result.json's keys).
"""

from __future__ import annotations

import sys

from engine.api import BenchResult, RunResult, SynthResult, figures, format_size, rewrite_line
from tuner.base.text import (  # noqa: F401  (re-exported: the printers' callers format with them too)
    fmt, json_text, kl_text, markdown_table, pct, print_json, text_table, utc_now)
from tuner.results.columns import CONFIG_COLUMNS, FIGURE_COLUMNS, QUALITY_COLUMNS, column
from tuner.results.result import Candidate, Figures, StudyInfo, TuneResult, WorkloadInfo
from tuner.results.trial_record import is_feasible, point_key

# --- one run (colibri run / bench) ----------------------------------------------------------
# The figures come from the result's fields (engine/api/results.py: label, kind, unit, line), as
# llama-bench's printers iterate get_fields(): a new figure is one field there, printed here.

def figure_value(kind: str, v) -> str:
    """One figure's value as the run and bench lines print it, by its field's kind."""
    if kind == "seconds":
        return fmt(v, 3)
    if kind == "ms":
        return fmt(v, 1)
    if kind == "share":
        return pct(v)
    if kind == "shares":  # {tier: share}
        return ", ".join(f"{k} {x:.1%}" for k, x in v.items() if x is not None) or "-"
    if kind == "bytes":
        return format_size(v)
    if kind == "float":
        return fmt(v)
    return str(v)


def figure_lines(r) -> dict[str, list[str]]:
    """Each printed line's figures, in field order ("speed", "io" ...): 'label value unit' for
    every figure the result has (None: not measured, not shown)."""
    lines: dict[str, list[str]] = {}
    for f in figures(r):
        v, m = getattr(r, f.name), f.metadata
        if v is None:
            continue
        unit = f" {m['unit']}" if m.get("unit") else ""
        lines.setdefault(m["line"], []).append(f"{m['label']} {figure_value(m['kind'], v)}{unit}")
    return lines


def run_text(m: RunResult | dict) -> str:
    """The figures of one run or bench: latency, speed, memory, and I/O when it streamed."""
    r = m if isinstance(m, RunResult) else RunResult.from_dict(m)
    return "\n".join(" | ".join(cells) for cells in figure_lines(r).values())


def run_header(r: RunResult | dict) -> str:
    r = r if isinstance(r, RunResult) else RunResult.from_dict(r)
    mode = f"streaming ({r['config']['io_mode']})" if r["plan"]["streaming"] else "resident"
    return (f"[{mode}, {r.compute_dtype}, {_quant(r)}, {r.threads} threads, prompt {r.prompt_tokens} "
            f"tokens, {r.generated_tokens} generated]")


def _quant(r: RunResult) -> str:
    """Which weights and which matmul: 'int4-g64 via aten._weight_int4pack_mm_for_cpu'."""
    return f"{r.quant or 'none'} via {r.kernel or '?'}"


def bench_text(r: BenchResult | dict) -> str:
    r = r if isinstance(r, BenchResult) else BenchResult.from_dict(r)
    s = r.spread("decode_tok_s")
    cg = r.get("cgroup") or {}
    cgroup = (f"cgroup limit {format_size(cg.get('limit_bytes'))}, peak {format_size(cg.get('peak_bytes'))}"
              if cg.get("limited") else f"no cgroup ({cg.get('reason') or 'not requested'})")
    io = f"{r.io_mode_effective}" + (f" via {r.io_backend_effective}"
                                     if r.io_backend_effective not in (None, "resident") else "")
    c = r["config"]
    return "\n".join([
        f"model {r['model']} ({r['geometry']['model_type']}, {r.compute_dtype}, {_quant(r)}) | "
        f"{'cold' if r.cold else 'warm'} | {r.tokens} tokens x {r.repeats} repeats | {cgroup}",
        f"config: budget {format_size(c['ram_budget']) if c['ram_budget'] else 'none'}, "
        f"{config_line({**c, 'threads': r.threads})}; I/O ran {io}",
        *([trace_line(r.get("trace"))] if r.get("trace") else []),
        f"decode tok/s: median {s['median'] or 0:.3f} (min {s['min'] or 0:.3f}, max {s['max'] or 0:.3f}, "
        f"n={s['n']})" + ("" if r.tokens_consistent in (None, True) else "  WARNING: tokens differ across repeats"),
        run_text(r),
    ])


def trace_line(t: dict) -> str:
    """`bench --trace`'s conditions: the trace, its SLOs, the batch it ran with."""
    slo = lambda v: "none" if v is None else f"<= {fmt(v, 3)} s"  # noqa: E731
    return (f"trace {t['source']}: {t['requests']} requests ({t['sequences']} sequences) over {fmt(t['span_s'], 3)} s "
            f"({t['sha256']}) | SLO TTFT {slo(t['slo_ttft_s'])}, TPOT {slo(t['slo_tpot_s'])} | "
            f"max_batch {t['max_batch']} | " + ("greedy" if not t.get("temperature") else
                                              f"temperature {t['temperature']:g}, top-p {t['top_p']:g}"))


def config_line(c: dict) -> str:
    """The settings a study searches (EngineConfig's knobs with a search range), in field order,
    with the column registry's short names and formats."""
    return ", ".join(f"{col.short} {col.text(c[col.name])}" for col in CONFIG_COLUMNS
                     if col.searched and col.name in c)


def synth_text(s: SynthResult | dict) -> str:
    r = s if isinstance(s, SynthResult) else SynthResult.from_dict(s)
    return f"wrote {r.path}: " + ", ".join(", ".join(cells) for cells in figure_lines(r).values())


def presets_text(rows: list[dict]) -> str:
    return "\n".join(f"{r['name']:<16} {'synth' if r['materializable'] else 'geometry only':<13} "
                     f"{r['total_params'] / 1e9:8.2f}B params ({r['active_params'] / 1e9:.2f}B active)  "
                     f"{r['description']}" for r in rows)


# --- a tune run ------------------------------------------------------------------------------

def tune_text(r: TuneResult, files: dict) -> str:
    """The summary `colibri tune` prints: the winner against the engine's defaults (the headline)
    and the rules-of-thumb baseline, how the search spent its trials, and where the files are."""
    rec, st, cond = r.recommended, r.study, r.conditions
    lines = [
        f"recommended ({rec.label}, {'confirmed' if r.confirmation.confirmed else 'unconfirmed'} over "
        f"{r.confirmation.rounds} round(s)): {_figures_text(rec.confirmed)}",
        reference_line("engine defaults", r.defaults),
        reference_line("baseline (rules of thumb)", r.baseline),
        f"gain over the engine's defaults ({r.gain_metric}): {pct(r.gain_over_defaults, signed=True)} "
        f"(over the rules-of-thumb baseline: {pct(r.gain_over_baseline, signed=True)})",
        f"config: {config_line(rec.config)}",
        f"trials: {search_line(st)} | {r.budget} budget | {'cold' if cond.cold else 'warm'} | "
        f"{cond.wall_seconds:.0f} s" + (f", {pct(st.measuring_share, 0)} of it measuring"
                                         if st.measuring_share is not None else ""),
    ]
    if r.workload:
        lines.append(f"workload: {workload_text(r.workload)}")
    for name in ("recommended.toml", "result.json", "trials.csv", "report.md", "report.html"):
        if name in files:
            lines.append(f"  {name}: {files[name]}")
    lines.append(f"  study: {st.storage} (optuna-dashboard can open it)")
    return "\n".join(lines)


def workload_text(w: WorkloadInfo) -> str:
    """result.json's `workload` in words (lengths and hash; the prompts' text is never recorded)."""
    p, n = w.prompt_tokens, w.max_new_tokens
    if w.kind == "trace":
        return (f"request trace {w.source} ({w.sha256}): {w.requests} requests ({w.sequences} sequences) arriving over "
                f"{fmt(w.span_s, 3)} s, prompts {p.min}..{p.max} tokens, outputs {n.min}..{n.max} tokens, replayed "
                f"through serve's scheduler; goodput counts the requests within TTFT <= {fmt(w.slo_ttft_s, 3)} s and "
                f"TPOT <= {fmt(w.slo_tpot_s, 3)} s per second")
    if w.kind == "fixed":
        return (f"fixed random prompt of {p.max} tokens, {n.max} decoded (tune --prompts FILE: your own)")
    if w.kind == "steady":
        cycle = f"; the RAM cache cycles in {w.cycle_tokens:g} tokens" if w.cycle_tokens is not None else ""
        return (f"steady decoding: {w.requests} prompts of {p.min}..{p.max} tokens (seed {w.seed}), {n.max} tokens "
                f"each sampled at temperature {w.temperature:g}, top-p {w.top_p:g} ({w.sha256}){cycle}; the first "
                f"quarter of each decode not counted, looping outputs left out, the figure the median over prompts")
    return (f"{w.requests} prompt(s) from {w.source} ({w.sha256}): prompts {p.min}..{p.max} "
            f"tokens (median {p.median:g}), outputs {n.min}..{n.max} tokens")


NOT_MEASURED = Figures(decode_tok_s=None, ttft_s=None, measurements=0)  # a candidate without confirmed figures


def _figures_text(f: Figures | None) -> str:
    f = f or NOT_MEASURED
    serve = (f"goodput {fmt(f.goodput_rps, 3)} req/s [{fmt(f.goodput_min, 3)}..{fmt(f.goodput_max, 3)}], "
             f"TTFT p95 {fmt(f.ttft_p95_s, 3)} s, TPOT p95 {fmt(f.tpot_p95_s, 3)} s; "
             if f.goodput_rps is not None else "")  # a trace replay's (tune --objective serve)
    return (serve + f"decode {fmt(f.decode_tok_s)} tok/s [{fmt(f.decode_min)}..{fmt(f.decode_max)}], "
            f"TTFT {fmt(f.ttft_s, 3)} s, request {fmt(f.request_s, 3)} s")


def reference_line(name: str, c: Candidate | None) -> str:
    if not c:
        return f"{name}: not measured"
    return f"{name}: {_figures_text(c.confirmed)}" + (f" ({c.disqualified})" if c.disqualified else "")


def search_line(st: StudyInfo) -> str:
    """How a study's trials split (result.json `study`); older results only know the total."""
    if st.measured_trials is None:
        return f"{st.trials} ({st.feasible} feasible)"
    return (f"{st.measured_trials} measured ({st.distinct_points} distinct points, {st.feasible} feasible), "
            f"{st.re_proposals} re-proposal(s) not measured"
            + (f", {st.explored} explored" if st.explored else "")
            + (f"; stopped: {st.stop_reason}" if st.stop_reason else ""))


def trial_line(done: int, total: str, number: int, attrs: dict, objective: str, best, clock: str,
               counts: str = "") -> str:
    """One progress line of the search: this trial's figure, the best so far, the clock, and how
    the study's trials split (measured, distinct, re-proposals)."""
    key = {"ttft": "ttft_s", "request": "request_s", "serve": "goodput_rps"}.get(objective, "decode_tok_s")
    if attrs.get("constraint", 1) > 0:
        figure = f"{attrs.get('status')} (infeasible)"
    elif key == "goodput_rps":
        figure = (f"goodput {fmt(attrs.get('goodput_rps'), 3)} req/s ({attrs.get('slo_met')} within the SLOs, "
                  f"TTFT p95 {fmt(attrs.get('ttft_p95_s'), 3)} s) at max_batch {(attrs.get('config') or {}).get('max_batch')}")
    elif key == "ttft_s":
        figure = f"TTFT {fmt(attrs.get('ttft_s'), 3)} s"
    elif key == "request_s":
        figure = f"request {fmt(attrs.get('request_s'), 3)} s"
    else:
        figure = f"{fmt(attrs.get('decode_tok_s'))} tok/s"
    best_txt = ""
    if best is not None:
        digits = 2 if key == "decode_tok_s" else 3
        best_txt = f" (best {fmt(best.user_attrs.get(key), digits)}, trial {best.number})"
    return (f"trial {done}/{total} [#{number} {attrs.get('role')}] | {figure}{best_txt} | "
            + (f"{counts} | " if counts else "") + clock)


# --- the trials of a study (trials.csv, report.md) ---------------------------------------------

# The columns come from the column registry (tuner/results/columns.py): every engine setting the
# trial ran (its lossy settings included), the weights it ran with, every figure, and a lossy
# trial's quality. measured: the trial evaluated its point (False: a re-proposal of
# `duplicate_of`, not run); point: the distinct point's number, in the order the study first
# measured it.
PARAM_COLUMNS = tuple(c.name for c in CONFIG_COLUMNS)
WEIGHTS_COLUMNS = ("quant", "quant_scope")  # from the trial's bench JSON: int8, int4-g64, none; experts / all
METRIC_COLUMNS = tuple(c.name for c in FIGURE_COLUMNS)
QUALITY_COLUMN_NAMES = tuple(c.name for c in QUALITY_COLUMNS)
TRIAL_COLUMNS = ("number", "state", "status", "role", "measured", "point", "feasible", "constraint", "value", "value2",
                 *PARAM_COLUMNS, *WEIGHTS_COLUMNS, *METRIC_COLUMNS, *QUALITY_COLUMN_NAMES,
                 "wall_seconds", "duplicate_of", "worker", "error")


def _cell(v):
    if v is None:
        return ""
    return round(v, 6) if isinstance(v, float) else v  # 0.8500000000000001 is a step artefact


def trial_rows(trials) -> list[dict]:
    """One flat row per Optuna trial (FrozenTrial), in trial-number order."""
    rows, points = [], {}
    for t in sorted(trials, key=lambda t: t.number):
        a = t.user_attrs
        ran = "constraint" in a
        key = point_key(t.params)
        if ran and a.get("duplicate_of") is None:
            points.setdefault(key, len(points))
        row = {"number": t.number, "state": t.state.name, "status": a.get("status", ""), "role": a.get("role", ""),
               "measured": (a.get("duplicate_of") is None) if ran else "", "point": points.get(key, ""),
               "feasible": is_feasible(a) if ran else "",
               "constraint": a.get("constraint", "")}
        values = t.values or []
        row["value"] = values[0] if len(values) > 0 else ""
        row["value2"] = values[1] if len(values) > 1 else ""
        # What the trial ran (user_attrs config: every setting); a trial that never ran: its params.
        config = a.get("config") if isinstance(a.get("config"), dict) else {}
        for p in PARAM_COLUMNS:
            row[p] = _cell(config.get(p, t.params.get(p)))
        bench = a.get("metrics") if isinstance(a.get("metrics"), dict) else {}
        for w in WEIGHTS_COLUMNS:
            row[w] = _cell(bench.get(w))
        for m in METRIC_COLUMNS:
            row[m] = _cell(a.get(m))
        quality = a.get("quality") if isinstance(a.get("quality"), dict) else {}
        for q in QUALITY_COLUMN_NAMES:
            row[q] = _cell(quality.get(q))
        row["wall_seconds"] = round(a["wall_seconds"], 3) if isinstance(a.get("wall_seconds"), (int, float)) else ""
        row["duplicate_of"] = a.get("duplicate_of", "")
        row["worker"] = a.get("worker", "")
        row["error"] = a.get("error", "")
        rows.append(row)
    return rows


def trials_markdown(trials) -> list[str]:
    """report.md's trial table: the searched settings and the headline figures, with the
    registry's short names and formats."""
    figures = [column(n) for n in ("decode_tok_s", "ttft_s", "hit_rate_ram")]
    # the settings the study searched (knob(search=...) ones, then lossy ones), in field order
    settings = [c for c in CONFIG_COLUMNS if c.searched and any(c.name in t.params for t in trials)]
    lossy = [c for c in CONFIG_COLUMNS if c.lossy and any(c.name in t.params for t in trials)]
    quality = [c for c in QUALITY_COLUMNS if any((t.user_attrs.get("quality") or {}).get(c.name) is not None
                                                 for t in trials)]
    header = ["#", "role", "status"] + [c.label for c in figures[:2]] + [c.short for c in settings + lossy] \
        + [c.short for c in figures[2:]] + ["peak"] + [c.label for c in quality]
    rows = []
    for t in trials:
        a, p = t.user_attrs, t.params
        q = a.get("quality") or {}
        rows.append([t.number, a.get("role", ""), a.get("status", "")] + [c.text(a.get(c.name)) for c in figures[:2]]
                    + [c.text(p.get(c.name)) for c in settings + lossy] + [c.text(a.get(c.name)) for c in figures[2:]]
                    + [format_size(a.get("cgroup_peak_bytes") or a.get("peak_rss_bytes"))]
                    + [c.text(q.get(c.name)) for c in quality])
    return markdown_table(header, rows)


# --- quant levels ---------------------------------------------------------------------------

def convert_progress(enabled: bool = True, stream=None):
    """engine.convert's progress(event, **fields) as lines on stderr (None when not enabled)."""
    if not enabled:
        return None

    def progress(event, **f):
        out = stream or sys.stderr
        if event == "shard":
            rewrite_line(out, f"  shard {f['index']}/{f['shards']} {f['name']}: {f['done']}/{f['total']} "
                              "tensors/experts", last=f["done"] == f["total"])
        elif event == "check":
            print(f"  kept {f['name']} (checksum {'ok' if f['ok'] else 'MISMATCH: rewriting'})", file=out)
        elif event == "discard":
            print(f"  discarding {f['path']}: {f['reason']}", file=out)
    return progress


def quality_progress(enabled: bool = True, stream=None):
    """tuner.quality's progress(label, i, n) as one updating line per model on stderr."""
    if not enabled:
        return None

    def progress(label, i, n):
        rewrite_line(stream or sys.stderr, f"  {label}: chunk {i}/{n}", last=i == n)
    return progress


def weights_line(r: TuneResult) -> str:
    """A result's weights and, from tune --quant, their quality against the reference."""
    q = r.quality
    text = r.quant or "-"
    if q:
        text += (f" (against {q.reference} {q.reference_quant}: KL mean {kl_text(q.kl_mean)}, p99 "
                 f"{kl_text(q.kl_p99)}, same top-1 {pct(q.top1_agreement, 2)}, perplexity {q.perplexity:.4g}; "
                 f"{q.scored_tokens} scored tokens)")
    return text


def quant_tune_text(s: dict) -> str:
    """`tune --quant`'s summary: one row per level, then where the comparison is."""
    header = ["level", "status", "decode tok/s", "min..max", "TTFT s", "KL mean", "same top-1", "run"]
    rows = []
    for lv in s["levels"]:
        r, q = lv.get("result") or {}, lv.get("quality") or {}
        rows.append([lv["level"], lv.get("status", "prepared"),
                     fmt(r.get("decode_tok_s")) + (" (unconfirmed)" if r.get("unconfirmed") else ""),
                     f"{fmt(r.get('decode_min'))}..{fmt(r.get('decode_max'))}", fmt(r.get("ttft_s"), 3),
                     kl_text(q.get("kl_mean")), pct(q.get("top1_agreement"), 2),
                     lv["run_dir"]])
    lines = [f"tune --quant of {s['model']}, budget {s['budget']}" + (" (prepared only: containers and quality)"
                                                                     if s.get("prepared_only") else "")]
    lines += text_table(header, rows)
    lines += [f"  {k}: {v}" for k, v in s.get("files", {}).items()]
    return "\n".join(lines)
