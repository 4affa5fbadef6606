"""The human report of a tune run: report.md with tables, and PNG plots beside it.

Everything here reads the study's trials and the typed TuneResult (the same figures the CSV and
JSON carry), so the report cannot disagree with them. matplotlib runs on the Agg backend (no
display needed); every file is written to a temp name and renamed.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import optuna
from optuna.trial import TrialState

from engine.api import atomic_write_text, format_size
from tuner.results.columns import CONFIG_COLUMNS
from tuner.results.printers import (NOT_MEASURED, PARAM_COLUMNS, fmt, markdown_table, pct, search_line, trials_markdown,
                                    weights_line, workload_text)
from tuner.results.result import Candidate, TuneResult, is_feasible

MIN_TRIALS_FOR_IMPORTANCE = 6
PLOTS_DIR = "plots"


def write_report(study: optuna.Study, result: TuneResult, out_dir: str | Path) -> dict:
    """Write report.md and plots/*.png; returns {name: path}."""
    import matplotlib
    matplotlib.use("Agg", force=True)

    out_dir = Path(out_dir)
    (out_dir / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    trials = sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number)
    feasible = [t for t in trials if is_feasible(t.user_attrs)]
    files: dict[str, Path] = {}
    files["plots/history.png"] = _plot_history(trials, result, out_dir / PLOTS_DIR / "history.png")
    if feasible:
        files["plots/params.png"] = _plot_params(feasible, result, out_dir / PLOTS_DIR / "params.png")
    importances = _importances(feasible, result)
    if importances:
        files["plots/importance.png"] = _plot_importance(importances, out_dir / PLOTS_DIR / "importance.png")
    if any(c.confirmed for c in result.candidates):
        files["plots/confirmation.png"] = _plot_confirmation(result, out_dir / PLOTS_DIR / "confirmation.png")
    if result.objective == "both" and feasible:
        files["plots/pareto.png"] = _plot_pareto(trials, out_dir / PLOTS_DIR / "pareto.png")
    order = ["plots/history.png", "plots/confirmation.png", "plots/pareto.png", "plots/importance.png",
             "plots/params.png"]
    text = render_markdown(trials, result, importances, [p for p in order if p in files])
    atomic_write_text(out_dir / "report.md", text)
    files["report.md"] = out_dir / "report.md"
    return files


# --- markdown -------------------------------------------------------------------------------

def render_markdown(trials, result: TuneResult, importances: dict, plots: list[str]) -> str:
    r, rec, cond, study, model = result, result.recommended, result.conditions, result.study, result.model
    geo = model.geometry
    quant = f" {r.quant}" if r.quant else ""
    L = [f"# colibri tune: {model.name}{quant} under {r.budget}", ""]
    L.append(f"{r.created_utc} | objective **{r.objective}** | "
             f"trials: {search_line(study)} | sampler {study.sampler} | {cond.wall_seconds:.0f} s"
             + (f", {pct(study.measuring_share, 0)} of it measuring" if study.measuring_share is not None else ""))
    L.append("")
    if rec:
        L.append(f"**Recommended: {rec.label}** — decode {fmt(_decode(rec))} tok/s vs the engine's "
                 f"defaults {fmt(_decode(r.defaults))} tok/s and the rules-of-thumb baseline "
                 f"{fmt(_decode(r.baseline))} tok/s; gain on {r.gain_metric} over the defaults "
                 f"**{pct(r.gain_over_defaults, signed=True)}** (over the baseline: "
                 f"{pct(r.gain_over_baseline, signed=True)})"
                 + ("" if r.confirmation.confirmed else " (not re-measured: no confirmation round)"))
        if r.objective == "serve":
            L += ["", serve_headline(r)]
        L += ["", "Use it: `colibri run --model <dir> --config recommended.toml`", ""]
        if r.reproduce is not None and r.reproduce.command:
            L += ["Measure the headline figure again (same workload, config, tokens and cgroup; it must "
                  f"generate the same tokens, {_bytes(r.reproduce.bytes_read_per_token)} read per token):", "",
                  f"    {r.reproduce.command}", ""]
        L += _config_table(rec, r.defaults, r.baseline)
    else:
        L += ["**No configuration ran within the budget.** See the trial table below and trials.csv.", ""]

    L += ["## Confirmation", ""]
    conf = r.confirmation
    L.append(f"{conf.rounds} round(s), {conf.order}; figure: {conf.figure}.")
    rows = []
    for c in r.candidates:
        f = c.confirmed or NOT_MEASURED
        verdict = c.disqualified or c.note or ("winner" if rec and c.label == rec.label else "")
        sv = c.search_values
        rows.append([c.label, fmt(f.decode_tok_s), f"{fmt(f.decode_min)}..{fmt(f.decode_max)}",
                     fmt(f.decode_stdev), fmt(f.ttft_s, 3), fmt(f.request_s, 3),
                     ", ".join(fmt(v) for v in sv) if sv else "-", verdict])
    L += [""] + markdown_table(["candidate", "decode tok/s (median)", "min..max", "stdev", "TTFT s", "request s",
                                "search value", "verdict"], rows) + [""]
    if r.objective == "serve":
        L += serve_table(r)

    if plots:
        L += ["## Plots", ""]
        for p in plots:
            L += [f"![{Path(p).stem}]({p})", ""]

    if importances:
        L += ["## Parameter importance (PED-ANOVA over feasible trials)", ""]
        L += markdown_table(["parameter", "importance"], [[k, f"{v:.3f}"] for k, v in importances.items()]) + [""]

    L += ["## Trials", ""] + trials_markdown(trials) + [""]
    L += cost_model_lines(r)

    L += ["## Conditions", ""]
    mem, prof = cond.memory_limit, cond.profile
    L += [
        f"- model: `{model.dir}` ({geo.get('model_type')}, {model.compute_dtype}, "
        f"{geo.get('experts')} experts top-{geo.get('top_k')}, "
        f"{format_size(geo.get('total_bytes_on_disk'))} on disk)",
        f"- weights: {weights_line(r)}",
        f"- workload: {workload_text(r.workload) if r.workload else 'not recorded'}",
        f"- runs: {'cold' if cond.cold else 'warm'} ({cond.cold_means}); {cond.tokens} decode "
        f"tokens x {cond.repeats} repeats, prompt {cond.prompt_tokens} tokens, seed {cond.seed}",
        f"- memory: budget {r.budget}, trial cgroup limit {format_size(mem.cgroup_limit_bytes)}"
        + (" (enforced)" if mem.cgroup else f" (NOT enforced: {mem.reason or 'unknown'})"),
        f"- machine: {cond.physical_cores} physical / {cond.logical_cores} logical cores, "
        f"GPU {'yes' if cond.gpu else 'no'}; disk {prof.disk_transport} {prof.disk_model or ''} "
        f"({prof.filesystem}), probe {prof.storage_method} {prof.probe_mode}: sequential "
        f"{fmt(prof.sequential_gbps)} GB/s, 1 MiB QD4 direct {fmt(prof.read_gbps_1MiB_qd4_direct)} GB/s; "
        f"fingerprint {prof.fingerprint}",
        f"- study: `{study.name}` in `{study.storage}`; statuses {study.by_status}",
        f"- versions: {dataclasses.asdict(cond.versions)}",
        "",
    ]
    return "\n".join(L)


def _bytes(v) -> str:
    return format_size(v) if v is not None else "-"


def cost_model_lines(r: TuneResult) -> list[str]:
    """The cost model against this run: its median error over every measured trial (the trial
    table's `pred` column beside `decode`), per io mode and per cache policy, and its warm starts."""
    cm = r.cost_model
    if cm is None:
        return []
    L = ["## Cost model vs measured", "",
         f"{'Calibrated' if cm.calibrated else 'Uncalibrated (the probe curves as they are)'} cost model: "
         f"median error {pct(cm.median_abs_pct_error / 100 if cm.median_abs_pct_error is not None else None, 0)} "
         f"over {cm.trials} measured trial(s) (predicted before each ran: column `pred` of the trial table). "
         f"Warm starts enqueued: {cm.warm_starts}" + (f" ({cm.warm_start_note})" if cm.warm_start_note else "") + ".",
         ""]
    rows = [[kind, value, str(e.trials), pct(e.median_abs_pct_error / 100 if e.median_abs_pct_error is not None
                                             else None, 0)]
            for kind, by in (("io mode", cm.by_io_mode), ("cache policy", cm.by_cache_policy))
            for value, e in by.items()]
    return L + markdown_table(["kind", "value", "trials", "median error"], rows) + [""]


def serve_headline(r: TuneResult) -> str:
    """tune --objective serve: the winner's goodput against the defaults' and the baseline's, under the SLOs."""
    w = r.workload
    g = lambda c: fmt(c.confirmed.goodput_rps, 3) if c and c.confirmed else "-"  # noqa: E731
    return (f"Goodput (requests of {w.source if w else 'the trace'} within TTFT <= {fmt(w.slo_ttft_s if w else None, 3)} s "
            f"and TPOT <= {fmt(w.slo_tpot_s if w else None, 3)} s, per second): **{g(r.recommended)} req/s** at "
            f"max_batch {r.recommended.config.get('max_batch')}, against the defaults' {g(r.defaults)} and the "
            f"baseline's {g(r.baseline)}; ties in goodput go to the lower p95 TTFT.")


def serve_table(r: TuneResult) -> list[str]:
    """The candidates' replay figures (tune --objective serve)."""
    rows = []
    for c in r.candidates:
        f = c.confirmed or NOT_MEASURED
        rows.append([c.label, str(c.config.get("max_batch")), fmt(f.goodput_rps, 3),
                     f"{fmt(f.goodput_min, 3)}..{fmt(f.goodput_max, 3)}", fmt(f.ttft_p95_s, 3), fmt(f.tpot_p95_s, 3)])
    return markdown_table(["candidate", "max_batch", "goodput req/s (median)", "min..max", "TTFT p95 s",
                           "TPOT p95 s"], rows) + [""]


def _decode(c: Candidate | None):
    """A candidate's confirmed median decode speed (None: not measured)."""
    return c.confirmed.decode_tok_s if c and c.confirmed else None


def _config_table(rec: Candidate, defaults: Candidate | None, base: Candidate | None) -> list[str]:
    """The recommended settings beside the engine's defaults (marked where they differ) and the baseline."""
    rc, dc, bc = rec.config, defaults.config if defaults else {}, base.config if base else {}
    rows = []
    for c in CONFIG_COLUMNS:
        rv, dv, bv = rc.get(c.name), dc.get(c.name), bc.get(c.name)
        changed = dc and rv != dv
        rows.append([c.name, f"{c.text(rv)}{' (changed)' if changed else ''}", "-" if not dc else c.text(dv),
                     c.text(bv)])
    return markdown_table(["setting", "recommended", "engine defaults", "baseline"], rows) + [""]


# --- plots ----------------------------------------------------------------------------------

def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)
    return path


def _objective_label(result: TuneResult) -> tuple[str, bool]:
    if result.objective == "ttft":
        return "TTFT (s, lower is better)", True
    if result.objective == "serve":
        return "goodput (requests within the SLOs per second)", False
    return "decode tok/s (median of repeats)", False


def _objective_key(result: TuneResult) -> str:
    """The trial attribute the plots and importances show: the objective's figure."""
    return {"ttft": "ttft_s", "serve": "goodput_rps"}.get(result.objective, "decode_tok_s")


def _plot_history(trials, result: TuneResult, path: Path) -> Path:
    import matplotlib.pyplot as plt
    label, lower = _objective_label(result)
    key = _objective_key(result)
    fig, ax = plt.subplots(figsize=(7, 4))
    feas = [(t.number, t.user_attrs.get(key)) for t in trials
            if is_feasible(t.user_attrs) and t.user_attrs.get(key) is not None]
    infeas = [t.number for t in trials if not is_feasible(t.user_attrs)]
    if feas:
        xs, ys = zip(*feas)
        ax.scatter(xs, ys, s=22, color="tab:blue", label="feasible trial", zorder=3)
        best, bx, by = None, [], []
        for x, y in feas:
            best = y if best is None else (min(best, y) if lower else max(best, y))
            bx.append(x)
            by.append(best)
        ax.step(bx, by, where="post", color="tab:green", label="best so far")
    if infeas:
        floor = 0.0 if not lower else (max(y for _, y in feas) if feas else 1.0)
        ax.scatter(infeas, [floor] * len(infeas), marker="x", color="tab:red", label="infeasible (OOM, timeout, ...)")
    base = getattr(result.baseline.confirmed, key) if result.baseline and result.baseline.confirmed else None
    if base is not None:
        ax.axhline(base, linestyle="--", color="gray", label="baseline (confirmed)")
    ax.set_xlabel("trial")
    ax.set_ylabel(label)
    ax.set_title("Optimization history")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _plot_params(feasible, result: TuneResult, path: Path) -> Path:
    import matplotlib.pyplot as plt
    label, lower = _objective_label(result)
    key = _objective_key(result)
    names = [n for n in PARAM_COLUMNS if any(n in t.params for t in feasible)]
    cols = 3
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(10, 2.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        pts = [(t.params[name], t.user_attrs.get(key)) for t in feasible
               if name in t.params and t.user_attrs.get(key) is not None]
        if not pts:
            ax.set_visible(False)
            continue
        xs, ys = zip(*pts)
        if isinstance(xs[0], str):
            dist = feasible[0].distributions.get(name)
            cats = list(getattr(dist, "choices", None) or sorted(set(xs)))
            ax.scatter([cats.index(x) for x in xs], ys, s=16)
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels(cats)
        else:
            ax.scatter(xs, ys, s=16)
            if name == "chunk_size":
                ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(f"{label} against each setting (feasible trials)", fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def _importances(feasible, result: TuneResult) -> dict:
    if len(feasible) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}
    lower = result.objective == "ttft"
    study = optuna.create_study(direction="minimize" if lower else "maximize")
    key = _objective_key(result)
    for t in feasible:
        value = t.user_attrs.get(key)
        if value is None:
            continue
        study.add_trial(optuna.trial.create_trial(params=t.params, distributions=t.distributions, value=value))
    try:
        return optuna.importance.get_param_importances(study)
    except Exception:  # too few distinct values for the evaluator: the report simply omits it
        return {}


def _plot_importance(importances: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt
    names = list(importances)[::-1]
    fig, ax = plt.subplots(figsize=(6, 0.4 * len(names) + 1))
    ax.barh(names, [importances[n] for n in names], color="tab:blue")
    ax.set_xlabel("importance (PED-ANOVA, normalised)")
    ax.set_title("Which settings mattered")
    return save_figure(fig, path)


def _plot_confirmation(result: TuneResult, path: Path) -> Path:
    import matplotlib.pyplot as plt
    figs = [(c.label, c.confirmed) for c in result.candidates if c.confirmed]
    labels = [label for label, _ in figs]
    med = [f.decode_tok_s or 0.0 for _, f in figs]
    lo = [m - (f.decode_min if f.decode_min is not None else m) for m, (_, f) in zip(med, figs)]
    hi = [(f.decode_max if f.decode_max is not None else m) - m for m, (_, f) in zip(med, figs)]
    rec = result.recommended.label if result.recommended else None
    colors = ["tab:green" if lab == rec else ("gray" if lab == "baseline" else "tab:blue") for lab in labels]
    fig, ax = plt.subplots(figsize=(max(4, 1.3 * len(labels)), 3.5))
    ax.bar(labels, med, yerr=[lo, hi], capsize=4, color=colors)
    ax.set_ylabel("decode tok/s (median, min..max)")
    ax.set_title("Confirmation round")
    ax.grid(axis="y", alpha=0.3)
    return save_figure(fig, path)


def _plot_pareto(trials, path: Path) -> Path:
    import matplotlib.pyplot as plt
    pts = [(t.user_attrs.get("ttft_s"), t.user_attrs.get("decode_tok_s")) for t in trials
           if is_feasible(t.user_attrs) and t.user_attrs.get("ttft_s") is not None]
    fig, ax = plt.subplots(figsize=(5, 4))
    if pts:
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=18)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("Decode speed against time to first token")
    ax.grid(alpha=0.3)
    return save_figure(fig, path)
