"""`colibri compare`: tune runs and shared profiles side by side.

Each input becomes one or more items of the same shape: a run directory gives its recommended
config as the entry a profile export would carry (tuner.profiles.entry_from_run), a profile
gives each of its best_configs. What may vary is the point of a comparison (the machine, the
disk, the quant level); what must not is checked before anything is ranked: the model
geometry, the budget, cold or warm, the decode and prompt token counts, the workload (steady or
fixed, its prompts' hash and sampler), and the tool version.
If any of those differ the comparison is refused, naming them, unless forced; a forced one says
on every output that it is not like for like.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from engine.api import (ColibriError, atomic_write_text, directory_target, format_size, printable, replace_directory,
                        stamped)
from tuner.results import report_plots
from tuner.results.html_page import e, img, page, table
from tuner.results.columns import column
from tuner.results.printers import fmt, markdown_table, pct
from tuner.probe.summary import hardware_facts
from tuner.share.profile_schema import SharedFigures
from tuner.share.profiles import entry_from_run, resolve
from tuner.results.rundir import is_run_dir, open_run

# Conditions that make figures comparable: (name, how to read it from an item).
BLOCKING = (("model geometry", lambda i: f"{i.entry['model']} [{i.entry['geometry_hash'][7:15]}]"),
            ("budget", lambda i: format_size(i.entry["ram_budget"])),
            ("cold/warm", lambda i: "cold" if i.entry["conditions"]["cold"] else "warm"),
            ("decode tokens", lambda i: i.entry["conditions"]["tokens"]),
            ("prompt tokens", lambda i: i.entry["conditions"]["prompt_tokens"]),
            # A steady-state figure and one prompt's loop measure different things (issue 43): the
            # workload (its kind, prompts, sampler and hash) must be the same one.
            ("workload", lambda i: workload_key(i.entry.get("workload"))),
            ("tool version", lambda i: i.entry["tool"]["version"]))


def workload_key(w: dict | None) -> str:
    """A workload as compare names it: its kind and hash (the fixed prompt: its lengths), its sampler."""
    if not w:
        return "fixed (not recorded)"
    if w.get("kind") == "fixed":
        return f"fixed {w['prompt_tokens']['max']}+{w['max_new_tokens']['max']} tokens"
    sampler = f", temperature {w['temperature']:g} top-p {w['top_p']:g}" if w.get("temperature") is not None else ""
    return f"{w['kind']} {w.get('requests')} prompt(s) {w.get('sha256')}{sampler}"


# Shown when they differ, never blocking: these are what people compare.
VARYING = (("machine", lambda i: i.machine["fingerprint"]), ("CPU", lambda i: i.machine["cpu"]),
           ("disk", lambda i: i.machine["disk"]), ("quant", lambda i: i.entry["quant"]),
           ("repeats", lambda i: i.entry["conditions"]["repeats"]),
           ("objective", lambda i: i.entry["objective"]), ("git commit", lambda i: i.entry["tool"].get("git_commit")))
# The figures compared, one bar plot each, of a shared entry's figures (profile_schema.SharedFigures).
COMPARED = ("decode_tok_s", "ttft_s", "bytes_read_per_token", "hit_rate_ram")
SHARED_FIGURES = {f.name for f in dataclasses.fields(SharedFigures)}


def _metric(name: str) -> tuple:
    """(figure, plot title, spread's low and high figures or None, scale): the title from the
    column registry's label (tuner/results/columns.py); the spread where the entry carries one
    (decode_min/decode_max); bytes shown in MiB."""
    if name not in SHARED_FIGURES:
        raise KeyError(f"{name} is not a figure of a shared profile entry")
    c = column(name)
    stem = name.split("_")[0]
    lo, hi = f"{stem}_min", f"{stem}_max"
    if c.kind == "bytes":
        return name, f"MiB {c.label}", None, None, 1.0 / (1 << 20)
    if lo in SHARED_FIGURES and hi in SHARED_FIGURES:
        return name, f"{c.label} (median)", lo, hi, 1.0
    return name, c.label, None, None, 1.0


METRICS = tuple(_metric(name) for name in COMPARED)


class CompareError(ColibriError):
    pass


@dataclass
class Item:
    label: str
    source: str
    machine: dict
    entry: dict

    def figure(self, key):
        if key == "kl_mean":
            return (self.entry.get("quality") or {}).get("kl_mean")
        return self.entry["figures"].get(key)


def load_items(refs: list[str], model: str | None = None) -> list[Item]:
    """Each input's items; `model` (a name or geometry hash prefix) picks a profile's entries."""
    items: list[Item] = []
    for ref in refs:
        if is_run_dir(ref):
            run = open_run(ref)
            if run.tune.recommended is None or run.profile is None:
                raise CompareError(f"{ref}: the run has no recommended config or no profile.json to compare")
            facts = hardware_facts(run.profile.to_dict())
            items.append(Item(Path(ref).name, str(ref), facts, entry_from_run(run)))
            continue
        label, data = resolve(ref)
        if not data["best_configs"]:
            raise CompareError(f"{ref}: the profile records no tune result (best_configs is empty)")
        facts = hardware_facts(data)
        entries = [e for e in data["best_configs"] if model is None or e["model"] == model
                   or e["geometry_hash"].removeprefix("sha256:").startswith(model.removeprefix("sha256:"))]
        if not entries:
            raise CompareError(f"{ref}: no best config for model {model!r}")
        for entry in entries:
            suffix = f":{entry['model']}/{entry['quant']}/{format_size(entry['ram_budget'])}" \
                if len(entries) > 1 else ""
            items.append(Item(Path(label).stem + suffix, str(ref), facts, entry))
    seen: dict[str, int] = {}
    for it in items:  # two inputs of the same name (run dirs on two disks): number them
        seen[it.label] = seen.get(it.label, 0) + 1
        if seen[it.label] > 1:
            it.label = f"{it.label}#{seen[it.label]}"
    if len(items) < 2:
        raise CompareError("compare needs at least two runs or profile entries")
    return items


def differences(items: list[Item], which) -> dict[str, list]:
    out = {}
    for name, get in which:
        values = [get(i) for i in items]
        if len(set(map(str, values))) > 1:
            out[name] = values
    return out


# A previous compare output is replaced (compare's --force is about the conditions, not files).
COMPARE_OUTPUT = stamped("compare.json", "schema", "colibri.compare/1")


def compare(refs: list[str], out_dir: str | Path | None = None, force: bool = False,
            model: str | None = None, in_place: bool = False) -> dict:
    """Compare, and write compare.md/.html/.json + plots/ into out_dir, a new directory built in a
    temp sibling and renamed into place (engine/base/output_target.py's rules: never an input,
    inside or above one, and a non-empty directory only when it is a previous comparison).
    in_place: out_dir is the caller's own run directory (tune --quant), whose files are replaced
    one by one (each atomically), the rest of it kept."""
    raw_out = out_dir if out_dir is not None else Path("reports") / f"compare-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    target = None if in_place else directory_target(raw_out, command="compare", recognise=COMPARE_OUTPUT,
                                                    sources=refs_paths(refs), force=True, flag="--out")
    items = load_items(refs, model)
    blocking = differences(items, BLOCKING)
    if blocking and not force:
        detail = "; ".join(f"{k}: {' vs '.join(printable(x) for x in v)}" for k, v in blocking.items())
        raise CompareError(f"not comparable ({detail}); --force compares them anyway, marked as not like for like")
    ranked = sorted(items, key=lambda i: -(i.figure("decode_tok_s") or 0.0))
    best = ranked[0].figure("decode_tok_s") or 0.0
    rows = [_row(rank, it, best) for rank, it in enumerate(ranked, 1)]
    summary = {"schema": "colibri.compare/1", "inputs": [str(r) for r in refs], "forced": bool(blocking),
               "not_comparable": {k: [str(x) for x in v] for k, v in blocking.items()},
               "varying": {k: [str(x) for x in v] for k, v in differences(items, VARYING).items()},
               "common": _common(items), "ranked": rows,
               "pareto_front": report_plots.pareto_front([(i.label, i.figure("kl_mean"), i.figure("decode_tok_s"))
                                                          for i in ranked if i.figure("kl_mean") is not None
                                                          and i.figure("decode_tok_s") is not None]) or None}
    if target is None:
        out = Path(raw_out)
        _write(out, summary, ranked)
    else:
        out = target.path
        tmp = target.sibling(f"partial-{os.getpid()}")
        tmp.mkdir(parents=True)
        try:
            _write(tmp, summary, ranked)
            replace_directory(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    summary["files"] = {n: str(out / n) for n in ("compare.md", "compare.html", "compare.json")}
    return summary


def refs_paths(refs: list[str]) -> list[str]:
    """The inputs that are paths (a profile may also be a name in the local store)."""
    return [r for r in refs if os.path.lexists(r)]


def _write(out: Path, summary: dict, ranked: list) -> None:
    (out / "plots").mkdir(parents=True, exist_ok=True)
    plots = _plots(ranked, out / "plots")
    atomic_write_text(out / "compare.json", json.dumps(summary, indent=2) + "\n")
    atomic_write_text(out / "compare.md", render_markdown(summary, plots))
    atomic_write_text(out / "compare.html", render_html(summary, plots))


def _row(rank: int, it: Item, best: float) -> dict:
    f, c = it.entry["figures"], it.entry["config"]
    q = it.entry.get("quality") or {}
    return {"rank": rank, "label": it.label, "source": it.source, "machine": it.machine["fingerprint"],
            "cpu": it.machine["cpu"], "disk": it.machine["disk"], "quant": it.entry["quant"],
            "decode_tok_s": f.get("decode_tok_s"), "decode_min": f.get("decode_min"), "decode_max": f.get("decode_max"),
            "of_best": (f.get("decode_tok_s") or 0.0) / best if best else None,
            "ttft_s": f.get("ttft_s"), "ttft_min": f.get("ttft_min"), "ttft_max": f.get("ttft_max"),
            "mib_read_per_token": _scaled(f.get("bytes_read_per_token"), 1.0 / (1 << 20)),
            "hit_rate_ram": f.get("hit_rate_ram"), "kl_mean": q.get("kl_mean"),
            "top1_agreement": q.get("top1_agreement"),
            "unconfirmed": f.get("unconfirmed"),
            "config": f"chunk {format_size(c.get('chunk_size'))}, prefetch {c.get('prefetch_depth')}, "
                      f"{c.get('cache_policy')} x{c.get('cpu_cache_ratio')}, threads {c.get('threads')}, "
                      f"io {c.get('io_mode')} x{c.get('io_threads')}, ctx {c.get('ctx_size')}"}


def _common(items: list[Item]) -> dict:
    first = items[0]
    return {name: str(get(first)) for name, get in BLOCKING + VARYING
            if len({str(get(i)) for i in items}) == 1}


def _plots(items: list[Item], plots: Path) -> list[tuple[str, Path]]:
    out = []
    for key, title, lo, hi, scale in METRICS:
        path = report_plots.plot_bars(
            [i.label for i in items], [_scaled(i.figure(key), scale) for i in items],
            [_scaled(i.figure(lo), scale) for i in items] if lo else None,
            [_scaled(i.figure(hi), scale) for i in items] if hi else None, title, plots / f"{key}.png")
        if path:
            out.append((title, path))
    if any(i.figure("kl_mean") is not None for i in items):
        path = report_plots.plot_bars([i.label for i in items], [i.figure("kl_mean") for i in items], None, None,
                                      "KL divergence to the reference (lower is better)", plots / "kl.png")
        if path:
            out.append(("quality: KL", path))
        path = report_plots.plot_speed_quality([(i.label, i.figure("kl_mean"), i.figure("decode_tok_s"),
                                                 i.figure("decode_min"), i.figure("decode_max")) for i in items],
                                               plots / "speed_quality.png")
        if path:
            out.append(("speed/quality Pareto plot", path))
    return out


def _scaled(v, scale):
    return None if v is None else v * scale


# --- printers -------------------------------------------------------------------------------

# The ranked table: (key of a ranked row, header). Figures take their headers from the column
# registry (tuner/results/columns.py); the rest are compare's own.
COLUMNS = (("rank", "rank"), ("label", "input"), ("quant", "quant"), ("decode_tok_s", column("decode_tok_s").label),
           ("decode_range", "min..max"), ("of_best", "of best"), ("ttft_s", column("ttft_s").label),
           ("mib_read_per_token", "MiB read/token"), ("hit_rate_ram", column("hit_rate_ram").label),
           ("kl_mean", column("kl_mean").label), ("machine", "machine"), ("disk", "disk"), ("config", "config"))


def _cells(r: dict) -> list[str]:
    v = {**r, "decode_tok_s": fmt(r["decode_tok_s"]) + (" (unconfirmed)" if r.get("unconfirmed") else ""),
         "decode_range": f"{fmt(r['decode_min'])}..{fmt(r['decode_max'])}",
         "of_best": pct(r["of_best"], 0), "ttft_s": fmt(r["ttft_s"], 4),
         "mib_read_per_token": fmt(r["mib_read_per_token"], 3),
         "hit_rate_ram": column("hit_rate_ram").text(r["hit_rate_ram"]),
         "kl_mean": column("kl_mean").text(r["kl_mean"]), "machine": r["machine"][7:15]}
    return [str(v[k]) for k, _ in COLUMNS]


def ranked_frame(s: dict) -> pd.DataFrame:
    """The ranked inputs as one pandas frame of printed cells, headers as columns: the markdown,
    html and text tables are all written from it."""
    return pd.DataFrame([_cells(r) for r in s["ranked"]], columns=[h for _, h in COLUMNS], dtype=object)


def _notes(s: dict) -> list[str]:
    lines = []
    if s["forced"]:
        lines.append("NOT LIKE FOR LIKE (--force): " + "; ".join(
            f"{k} differs: {' vs '.join(v)}" for k, v in s["not_comparable"].items()))
    if s["varying"]:
        lines.append("Compared: " + "; ".join(f"{k}: {' vs '.join(v)}" for k, v in s["varying"].items()))
    lines.append("Same for all: " + "; ".join(f"{k} {v}" for k, v in s["common"].items()))
    if s.get("pareto_front"):
        lines.append("Speed/quality Pareto front (no other input is both faster and closer to the reference): "
                     + ", ".join(s["pareto_front"]))
    lines.append("Figures: each input's confirmed medians (min..max over repeats); MiB read per token and hit "
                 "rate are from the recommended config's search trial.")
    return lines


def render_markdown(s: dict, plots: list[tuple[str, Path]]) -> str:
    L = ["# colibri compare", ""]
    L += [f"- {n}" for n in _notes(s)] + [""]
    frame = ranked_frame(s)
    L += markdown_table(list(frame.columns), [[c.replace("|", "\\|") for c in row] for row in frame.values.tolist()])
    L.append("")
    L += [f"![{t}](plots/{p.name})" for t, p in plots]
    return "\n".join(L) + "\n"


def render_html(s: dict, plots: list[tuple[str, Path]]) -> str:
    body = ["<h1>colibri compare</h1>"]
    body += [f"<p class='{'warn' if i == 0 and s['forced'] else 'note'}'>{e(n)}</p>"
             for i, n in enumerate(_notes(s))]
    frame = ranked_frame(s)
    body.append(table(list(frame.columns), frame.values.tolist()))
    body.append("<div class='plots'>" + "".join(img(p, t) for t, p in plots) + "</div>")
    return page("colibri compare", body)


def format_text(s: dict) -> str:
    frame = ranked_frame(s)
    rows = frame.values.tolist()
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(frame.columns)]
    lines = _notes(s) + [""]
    lines.append("  ".join(h.ljust(w) for h, w in zip(frame.columns, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [""] + [f"{k}: {v}" for k, v in s.get("files", {}).items()]
    return "\n".join(lines)
