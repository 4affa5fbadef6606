"""report.html: one self-contained page per tune run, for people with a browser.

Read from the run directory's files (tuner.rundir): result.json, as the typed TuneResult, for the
decision and its conditions, profile.json for the machine and the disk curve, the study for every trial. Plots
are PNGs embedded as data: URIs and the page's Content-Security-Policy allows nothing else, so
it opens offline, from an e-mail attachment or a CI artefact, and never fetches anything.
Every string from the files is HTML-escaped (a model name is data, not markup).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from engine.api import atomic_write_text, format_size
from tuner.probe.summary import hardware_facts
from tuner.results import report_plots
from tuner.results.columns import BY_NAME, CONFIG_COLUMNS
from tuner.results.html_page import e as _e, img as _img, page, table as _table
from tuner.results.frames import trials_frame
from tuner.results.printers import (NOT_MEASURED, QUALITY_COLUMN_NAMES, fmt, pct, search_line, weights_line,
                                    workload_text)
from tuner.results.report_md import write_report
from tuner.results.result import Candidate, Figures, TuneResult, is_feasible
from tuner.results.rundir import RunDir, open_run

PLOTS = "plots"
# report.html's trial table: who, then the headline figures, the settings the study searched, the
# figures that explain them and a lossy trial's quality (names, headers and formats: the column
# registry, tuner/results/columns.py).
LEAD_COLUMNS = ("number", "role", "status", "feasible")
HEADLINE_FIGURES = ("decode_tok_s", "ttft_s")
EXPLAINING_FIGURES = ("bytes_read_per_token", "hit_rate_ram", "io_stall_fraction", "cgroup_peak_bytes")



def write_html_report(run_dir: str | Path, study=None, storage: str | None = None) -> Path:
    """Write <run_dir>/report.html (and its new plots under plots/); returns its path."""
    run = open_run(run_dir, study=study, storage=storage)
    page = render(run)
    path = run.path / "report.html"
    atomic_write_text(path, page)
    return path


def write_reports(run_dir: str | Path, storage: str | None = None) -> dict:
    """`colibri report`: report.md with its plots (tuner.report), then report.html."""
    run = open_run(run_dir, storage=storage)
    files = write_report(run.study, run.tune, run.path)
    files["report.html"] = write_html_report(run.path, study=run.study)
    return files


# --- the page -------------------------------------------------------------------------------

def render(run: RunDir) -> str:
    r = run.tune
    model, study, cond = r.model, r.study, r.conditions
    plots = run.path / PLOTS
    plots.mkdir(exist_ok=True)
    trials = _complete_trials(run)
    data = _trial_points(run, trials)

    quant = f" {r.quant}" if r.quant else ""
    body = [f"<h1>colibri tune: {_e(model.name)}{_e(quant)} under {_e(r.budget)}</h1>",
            f"<p class='sub'>{_e(r.created_utc)} · objective <b>{_e(r.objective)}</b> · "
            f"trials: {_e(search_line(study))} · sampler "
            f"{_e(study.sampler)} · {'cold' if cond.cold else 'warm'} runs · "
            f"{fmt(cond.wall_seconds, 0)} s"
            + (f" ({pct(study.measuring_share, 0)} of it measuring)"
               if study.measuring_share is not None else "") + "</p>"]
    body += _headline(r)
    body += ["<h2>Hardware</h2>", _hardware_table(run)]
    body += ["<h2>Recommended against the engine's defaults and the baseline</h2>", _config_table(r),
             _figures_table(r),
             _img(plots / "confirmation.png", "confirmation round: median decode tok/s, min..max")]

    rec_attrs = run.trial_attrs(r.recommended.trial_number if r.recommended else None)
    base_attrs = run.trial_attrs(r.baseline.trial_number if r.baseline else None)
    plans = {"recommended": (rec_attrs.get("metrics") or {}).get("plan"),
             "baseline": (base_attrs.get("metrics") or {}).get("plan")}
    body += ["<h2>Memory plan</h2>",
             _img(report_plots.plot_memory_plan(plans, plots / "memory_plan.png"), "memory plan"),
             _plan_table(plans)]

    body += ["<h2>Optimization history</h2>", _img(plots / "history.png", "optimization history")]
    body += ["<h2>Parameter importance</h2>",
             _img(plots / "importance.png", "parameter importance",
                  missing=f"Not computed: it needs at least 6 feasible trials with varied settings.")]
    body += ["<h2>Decode speed against each setting</h2>", _img(plots / "params.png", "decode tok/s per setting")]
    body += ["<h2>TTFT against decode speed</h2>",
             _img(report_plots.plot_ttft_decode(data, plots / "ttft_decode.png"), "TTFT against decode tok/s")]
    if (plots / "pareto.png").is_file() and r.objective == "both":
        body.append(_img(plots / "pareto.png", "Pareto front"))

    curve, chosen = _disk_curve(run)
    body += ["<h2>Disk curve (probe)</h2>",
             _img(report_plots.plot_disk_curve(curve, chosen, plots / "disk_curve.png"), "disk curve",
                  missing="The profile holds no direct random-read curve.")]
    body += ["<h2>Measured speed against the bound</h2>",
             "<p class='note'>Bound per trial: disk time = bytes read per token ÷ the probe's bandwidth at the "
             "trial's read size and io_threads (buffered figure for buffered/mmap); memory time = bytes touched "
             "per token (dense part + top-k experts of every MoE layer) ÷ the probe's best memory read "
             "bandwidth; bound = 1 ÷ the larger of the two (perfect overlap, no compute cost).</p>",
             _img(report_plots.plot_bound(data, plots / "bound.png"), "measured against bound",
                  missing="No trial carries both a byte count and a profile to bound it with."),
             _bound_table(data)]
    body += ["<h2>Trials</h2>", _trials_table(run)]
    body += ["<h2>Conditions</h2>", _conditions(r)]
    return page(f"colibri tune: {model.name}", body)


def _headline(r: TuneResult) -> list[str]:
    rec = r.recommended
    if not rec:
        return ["<p class='headline'><b>No configuration ran within the budget.</b> See the trials below.</p>"]
    w, d, b = (_confirmed(c) for c in (rec, r.defaults, r.baseline))
    return [f"<p class='headline'><b>Recommended: {_e(rec.label)}</b> — decode "
            f"<b>{fmt(w.decode_tok_s)} tok/s</b> [{fmt(w.decode_min)}..{fmt(w.decode_max)}] "
            f"against the engine's defaults' {fmt(d.decode_tok_s)} tok/s "
            f"[{fmt(d.decode_min)}..{fmt(d.decode_max)}]: gain on {_e(r.gain_metric)} "
            f"<b>{pct(r.gain_over_defaults, signed=True)}</b>; against the rules-of-thumb baseline's "
            f"{fmt(b.decode_tok_s)} tok/s [{fmt(b.decode_min)}..{fmt(b.decode_max)}]: "
            f"{pct(r.gain_over_baseline, signed=True)}"
            + ("" if r.confirmation.confirmed else " (not re-measured: no confirmation round)")
            + (f"<br>Goodput (requests of the trace within TTFT &le; {fmt(r.workload.slo_ttft_s, 3)} s and TPOT "
               f"&le; {fmt(r.workload.slo_tpot_s, 3)} s per second): <b>{fmt(w.goodput_rps, 3)} req/s</b> at "
               f"max_batch {_e(rec.config.get('max_batch'))}, against the defaults' {fmt(d.goodput_rps, 3)} and the "
               f"baseline's {fmt(b.goodput_rps, 3)}" if r.objective == "serve" and r.workload is not None else "")
            + "<br>Use it: <code>colibri run --model &lt;dir&gt; --config recommended.toml</code></p>"]


def _hardware_table(run: RunDir) -> str:
    if run.profile is None:
        return "<p class='note'>No profile.json in the run directory.</p>"
    return _table(["", ""], list(hardware_facts(run.profile.to_dict()).items()), header=False)


def _confirmed(c: Candidate | None) -> Figures:
    return c.confirmed if c and c.confirmed else NOT_MEASURED


def _config_table(r: TuneResult) -> str:
    rc, dc, bc = (c.config if c else {} for c in (r.recommended, r.defaults, r.baseline))
    out = ["<table><tr><th>setting</th><th>recommended</th><th>engine defaults</th><th>baseline</th></tr>"]
    for c in CONFIG_COLUMNS:
        rv, dv, bv = rc.get(c.name), dc.get(c.name), bc.get(c.name)
        cls = " class='changed'" if dc and rv != dv else ""
        out.append(f"<tr{cls}><td>{c.name}</td><td>{_e(c.text(rv))}</td><td>{_e(c.text(dv)) if dc else '-'}</td>"
                   f"<td>{_e(c.text(bv))}</td></tr>")
    return "".join(out) + "</table><p class='note'>Highlighted: settings that differ from the engine's defaults.</p>"


def _figures_table(r: TuneResult) -> str:
    rows = []
    for c in r.candidates:
        f = _confirmed(c)
        verdict = c.disqualified or c.note or ("recommended" if r.recommended and c.label == r.recommended.label else "")
        rows.append((c.label, fmt(f.decode_tok_s), f"{fmt(f.decode_min)}..{fmt(f.decode_max)}",
                     fmt(f.decode_stdev), f.samples, fmt(f.ttft_s, 4),
                     f"{fmt(f.ttft_min, 4)}..{fmt(f.ttft_max, 4)}", fmt(f.request_s, 4), verdict))
    conf = r.confirmation
    return (_table(["candidate", "decode tok/s (median)", "min..max", "stdev", "samples", "TTFT s", "TTFT min..max",
                    "request s", "verdict"], rows)
            + f"<p class='note'>{_e(conf.rounds)} confirmation round(s), {_e(conf.order)}; "
              f"figure: {_e(conf.figure)}.</p>")


def _plan_table(plans: dict) -> str:
    rows = []
    for label, plan in plans.items():
        if plan:
            parts = [format_size(plan.get(k)) for k, _, _ in report_plots.PLAN_PARTS]
            used = sum(plan.get(k) or 0 for k, _, _ in report_plots.PLAN_PARTS)
            rows.append((label, *parts, format_size(plan.get("budget")), format_size(max(plan["budget"] - used, 0))))
    if not rows:
        return "<p class='note'>The trials' plans are not in the study.</p>"
    return _table(["config", *(name for _, name, _ in report_plots.PLAN_PARTS), "budget", "left unused"], rows)


def _bound_table(points: list[dict]) -> str:
    rec = next((p for p in points if p.get("recommended")), None)
    if not rec or not rec.get("bound_tok_s"):
        return ""
    rows = [("recommended (trial %s)" % rec["number"], format_size(rec["bytes_read_per_token"]),
             fmt(rec["disk_gbps"], 3), fmt(rec["disk_ms"], 3), fmt(rec["memory_ms"], 3), rec["limit"],
             fmt(rec["bound_tok_s"]), fmt(rec["decode_tok_s"]),
             pct(rec["decode_tok_s"] / rec["bound_tok_s"], 0))]
    return _table(["config", "read per token", "disk GB/s at its read size", "disk ms/token", "memory ms/token",
                   "limit", "bound tok/s", "measured tok/s", "of bound"], rows)


def _trials_table(run: RunDir) -> str:
    if not run.has_study:
        return "<p class='note'>No study in the run directory.</p>"
    trials = run.study.get_trials(deepcopy=False)
    df = trials_frame(trials)  # the frame trials.csv is written from
    searched = [c.name for c in CONFIG_COLUMNS if any(c.name in t.params for t in trials)]
    quality = [n for n in QUALITY_COLUMN_NAMES if (df[n] != "").any()]
    shown = df[[*LEAD_COLUMNS, *HEADLINE_FIGURES, *searched, *EXPLAINING_FIGURES, *quality, "wall_seconds", "error"]]
    shown = shown.replace("", None)
    for name in shown.columns:
        if name in BY_NAME:  # the registry's format; a blank cell for an absent figure, not "None" or "-"
            shown[name] = shown[name].map(lambda v, c=BY_NAME[name]: "" if v is None else c.text(v))
    shown = shown.rename(columns={n: BY_NAME[n].short for n in shown.columns if n in BY_NAME}).fillna("")
    return ("<div class='scroll'>" + shown.to_html(index=False, escape=True, na_rep="", classes="trials",
                                                   border=0, float_format=lambda v: f"{v:.4g}")
            + "</div><p class='note'>Sizes in binary units; every column at full precision is in trials.csv.</p>")


def _conditions(r: TuneResult) -> str:
    cond, model = r.conditions, r.model
    geo, mem = model.geometry, cond.memory_limit
    rows = [
        ("model", f"{model.name} ({geo.get('model_type')}, {model.compute_dtype}, {geo.get('layers')} "
                  f"layers, {geo.get('experts')} experts top-{geo.get('top_k')}, "
                  f"{format_size(geo.get('total_bytes_on_disk'))} on disk)"),
        ("weights", weights_line(r)),
        ("workload", workload_text(r.workload) if r.workload else "not recorded"),
        ("runs", f"{'cold' if cond.cold else 'warm'}: {cond.cold_means}; {cond.tokens} decode "
                 f"tokens x {cond.repeats} repeats, prompt {cond.prompt_tokens} tokens, seed {cond.seed}"),
        ("memory", f"budget {r.budget}, trial cgroup limit {format_size(mem.cgroup_limit_bytes)} "
                   + ("(enforced)" if mem.cgroup else f"(NOT enforced: {mem.reason or 'unknown'})")),
        ("time", f"budget {cond.time_budget_s} s, used {cond.wall_seconds} s"),
        ("versions", ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(cond.versions).items())),
    ]
    return _table(["", ""], rows, header=False)


# --- data from the run ----------------------------------------------------------------------

def _complete_trials(run: RunDir) -> list:
    if not run.has_study:
        return []
    from optuna.trial import TrialState
    return sorted(run.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number)


def _trial_points(run: RunDir, trials) -> list[dict]:
    """Feasible trials as flat points with their bound (see the page's note for the formula)."""
    rec_number = run.tune.recommended.trial_number if run.tune.recommended else None
    geo = run.tune.model.geometry
    mem_bw = max((m.bandwidth.value for m in run.profile.memory_bandwidth if m.op == "read"), default=0.0) \
        if run.profile else 0.0
    out = []
    for t in trials:
        a = t.user_attrs
        if not is_feasible(a):
            continue
        p = {"number": t.number, "decode_tok_s": a.get("decode_tok_s"), "ttft_s": a.get("ttft_s"),
             "ctx_size": t.params.get("ctx_size"), "recommended": t.number == rec_number,
             "bytes_read_per_token": a.get("bytes_read_per_token")}
        p.update(_bound(run.profile, t.params, (a.get("metrics") or {}).get("plan") or {}, geo,
                        a.get("bytes_read_per_token"), mem_bw))
        out.append(p)
    return out


def _bound(profile, params: dict, plan: dict, geo: dict, read_per_token, mem_bw: float) -> dict:
    if profile is None or read_per_token is None or not params.get("chunk_size") or not mem_bw:
        return {}
    try:
        disk_bw = profile.read_bandwidth(int(params["chunk_size"]), int(params.get("io_threads") or 1),
                                         direct=params.get("io_mode") == "direct")
    except Exception:  # no curve or no buffered point in this profile: no bound to draw
        return {}
    touched = (plan.get("dense_bytes") or 0) + (geo.get("moe_layers") or 0) * (geo.get("top_k") or 0) * (
        plan.get("expert_bytes") or 0)
    disk_s = read_per_token / disk_bw if disk_bw > 0 else math.inf
    mem_s = touched / mem_bw
    worst = max(disk_s, mem_s)
    return {"disk_gbps": disk_bw / 1e9, "disk_ms": disk_s * 1e3, "memory_ms": mem_s * 1e3,
            "limit": "disk" if disk_s >= mem_s else "memory",
            "bound_tok_s": (1.0 / worst) if worst > 0 else None}


def _disk_curve(run: RunDir) -> tuple[list[dict], dict | None]:
    if run.profile is None:
        return [], None
    pts = [{"request_bytes": p.request_bytes, "queue_depth": p.queue_depth, "bandwidth": p.bandwidth.value}
           for p in run.profile.storage.points if p.role == "curve" and p.direct]
    cfg = run.tune.recommended.config if run.tune.recommended else None
    if not pts or not cfg:
        return pts, None
    chosen = {"chunk_size": cfg.get("chunk_size"), "io_threads": cfg.get("io_threads")}
    try:
        chosen["bandwidth"] = run.profile.read_bandwidth(int(cfg["chunk_size"]), int(cfg.get("io_threads") or 1))
    except Exception:
        chosen["bandwidth"] = None
    return pts, chosen
