"""The human report of a tune run: report.md with tables, and PNG plots beside it.

Everything here reads the study's trials and result.json's dict (the same figures the CSV and
JSON carry), so the report cannot disagree with them. matplotlib runs on the Agg backend (no
display needed); every file is written to a temp name and renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import optuna
from optuna.trial import TrialState

from engine.base.config import atomic_write_text, format_size
from tuner.results.columns import CONFIG_COLUMNS
from tuner.results.printers import (PARAM_COLUMNS, fmt, markdown_table, pct, search_line, trials_markdown, weights_line,
                                    workload_text)
from tuner.results.result import is_feasible

MIN_TRIALS_FOR_IMPORTANCE = 6
PLOTS_DIR = "plots"


def write_report(study: optuna.Study, result: dict, out_dir: str | Path) -> dict:
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
    if any(c.get("confirmed") for c in result.get("candidates") or []):
        files["plots/confirmation.png"] = _plot_confirmation(result, out_dir / PLOTS_DIR / "confirmation.png")
    if result.get("objective") == "both" and feasible:
        files["plots/pareto.png"] = _plot_pareto(trials, out_dir / PLOTS_DIR / "pareto.png")
    order = ["plots/history.png", "plots/confirmation.png", "plots/pareto.png", "plots/importance.png",
             "plots/params.png"]
    text = render_markdown(trials, result, importances, [p for p in order if p in files])
    atomic_write_text(out_dir / "report.md", text)
    files["report.md"] = out_dir / "report.md"
    return files


# --- markdown -------------------------------------------------------------------------------

def render_markdown(trials, result: dict, importances: dict, plots: list[str]) -> str:
    rec, base = result.get("recommended"), result.get("baseline") or {}
    cond = result.get("conditions", {})
    study = result.get("study", {})
    model = result.get("model", {})
    quant = f" {result['quant']}" if result.get("quant") else ""
    L = [f"# colibri tune: {model.get('name')}{quant} under {result.get('budget')}", ""]
    L.append(f"{result.get('created_utc')} | objective **{result.get('objective')}** | "
             f"trials: {search_line(study)} | sampler {study.get('sampler')} | {cond.get('wall_seconds', 0):.0f} s"
             + (f", {pct(study.get('measuring_share'), 0)} of it measuring"
                if study.get("measuring_share") is not None else ""))
    L.append("")
    if rec:
        w, b = rec.get("confirmed") or {}, base.get("confirmed") or {}
        d = (result.get("defaults") or {}).get("confirmed") or {}
        L.append(f"**Recommended: {rec['label']}** — decode {fmt(w.get('decode_tok_s'))} tok/s vs the engine's "
                 f"defaults {fmt(d.get('decode_tok_s'))} tok/s and the rules-of-thumb baseline "
                 f"{fmt(b.get('decode_tok_s'))} tok/s; gain on {result.get('gain_metric')} over the defaults "
                 f"**{pct(result.get('gain_over_defaults'), signed=True)}** (over the baseline: "
                 f"{pct(result.get('gain_over_baseline'), signed=True)})"
                 + ("" if result.get("confirmation", {}).get("confirmed") else " (not re-measured: no confirmation round)"))
        L += ["", "Use it: `colibri run --model <dir> --config recommended.toml`", ""]
        L += _config_table(rec, result.get("defaults") or {}, base)
    else:
        L += ["**No configuration ran within the budget.** See the trial table below and trials.csv.", ""]

    L += ["## Confirmation", ""]
    conf = result.get("confirmation", {})
    L.append(f"{conf.get('rounds', 0)} round(s), {conf.get('order', '')}; figure: {conf.get('figure', '')}.")
    rows = []
    for c in result.get("candidates") or []:
        f = c.get("confirmed") or {}
        verdict = c.get("disqualified") or c.get("note") or ("winner" if rec and c["label"] == rec["label"] else "")
        sv = c.get("search_values")
        rows.append([c["label"], fmt(f.get("decode_tok_s")), f"{fmt(f.get('decode_min'))}..{fmt(f.get('decode_max'))}",
                     fmt(f.get("decode_stdev")), fmt(f.get("ttft_s"), 3), fmt(f.get("request_s"), 3),
                     ", ".join(fmt(v) for v in sv) if sv else "-", verdict])
    L += [""] + markdown_table(["candidate", "decode tok/s (median)", "min..max", "stdev", "TTFT s", "request s",
                                "search value", "verdict"], rows) + [""]

    if plots:
        L += ["## Plots", ""]
        for p in plots:
            L += [f"![{Path(p).stem}]({p})", ""]

    if importances:
        L += ["## Parameter importance (PED-ANOVA over feasible trials)", ""]
        L += markdown_table(["parameter", "importance"], [[k, f"{v:.3f}"] for k, v in importances.items()]) + [""]

    L += ["## Trials", ""] + trials_markdown(trials) + [""]

    L += ["## Conditions", ""]
    mem = cond.get("memory_limit", {})
    prof = cond.get("profile", {})
    L += [
        f"- model: `{model.get('dir')}` ({model.get('geometry', {}).get('model_type')}, {model.get('compute_dtype')}, "
        f"{model.get('geometry', {}).get('experts')} experts top-{model.get('geometry', {}).get('top_k')}, "
        f"{format_size(model.get('geometry', {}).get('total_bytes_on_disk'))} on disk)",
        f"- weights: {weights_line(result)}",
        f"- workload: {workload_text(result['workload']) if result.get('workload') else 'not recorded'}",
        f"- runs: {'cold' if cond.get('cold') else 'warm'} ({cond.get('cold_means')}); {cond.get('tokens')} decode "
        f"tokens x {cond.get('repeats')} repeats, prompt {cond.get('prompt_tokens')} tokens, seed {cond.get('seed')}",
        f"- memory: budget {result.get('budget')}, trial cgroup limit {format_size(mem.get('cgroup_limit_bytes'))}"
        + (" (enforced)" if mem.get("cgroup") else f" (NOT enforced: {mem.get('reason') or 'unknown'})"),
        f"- machine: {cond.get('physical_cores')} physical / {cond.get('logical_cores')} logical cores, "
        f"GPU {'yes' if cond.get('gpu') else 'no'}; disk {prof.get('disk_transport')} {prof.get('disk_model') or ''} "
        f"({prof.get('filesystem')}), probe {prof.get('storage_method')} {prof.get('probe_mode')}: sequential "
        f"{fmt(prof.get('sequential_gbps'))} GB/s, 1 MiB QD4 direct {fmt(prof.get('read_gbps_1MiB_qd4_direct'))} GB/s; "
        f"fingerprint {prof.get('fingerprint')}",
        f"- study: `{study.get('name')}` in `{study.get('storage')}`; statuses {study.get('by_status')}",
        f"- versions: {cond.get('versions')}",
        "",
    ]
    return "\n".join(L)


def _config_table(rec: dict, defaults: dict, base: dict) -> list[str]:
    """The recommended settings beside the engine's defaults (marked where they differ) and the baseline."""
    rc, dc, bc = rec.get("config") or {}, defaults.get("config") or {}, base.get("config") or {}
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


def _objective_label(result: dict) -> tuple[str, bool]:
    if result.get("objective") == "ttft":
        return "TTFT (s, lower is better)", True
    return "decode tok/s (median of repeats)", False


def _plot_history(trials, result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt
    label, lower = _objective_label(result)
    key = "ttft_s" if lower else "decode_tok_s"
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
    base = ((result.get("baseline") or {}).get("confirmed") or {}).get(key)
    if base is not None:
        ax.axhline(base, linestyle="--", color="gray", label="baseline (confirmed)")
    ax.set_xlabel("trial")
    ax.set_ylabel(label)
    ax.set_title("Optimization history")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _plot_params(feasible, result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt
    label, lower = _objective_label(result)
    key = "ttft_s" if lower else "decode_tok_s"
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


def _importances(feasible, result: dict) -> dict:
    if len(feasible) < MIN_TRIALS_FOR_IMPORTANCE:
        return {}
    lower = result.get("objective") == "ttft"
    study = optuna.create_study(direction="minimize" if lower else "maximize")
    key = "ttft_s" if lower else "decode_tok_s"
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


def _plot_confirmation(result: dict, path: Path) -> Path:
    import matplotlib.pyplot as plt
    cands = [c for c in result.get("candidates") or [] if c.get("confirmed")]
    labels = [c["label"] for c in cands]
    med = [c["confirmed"].get("decode_tok_s") or 0.0 for c in cands]
    lo = [m - (c["confirmed"].get("decode_min") if c["confirmed"].get("decode_min") is not None else m)
          for m, c in zip(med, cands)]
    hi = [(c["confirmed"].get("decode_max") if c["confirmed"].get("decode_max") is not None else m) - m
          for m, c in zip(med, cands)]
    rec = (result.get("recommended") or {}).get("label")
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
