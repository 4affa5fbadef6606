"""`colibri tune --quant bf16,int8,int4`: one study per quant level, on one machine and budget.

    outcome = run_quant_tune(QuantTuneOptions(TuneOptions(model="demo", trials=6), parse_levels("bf16,int8,int4")))
    outcome.summary["levels"]        # also <out>/quant-result.json; <out>/compare.html

Flow: the source model (a plain checkpoint) → each quantized level's container, converted on
first use into the model cache (quant_cache.py) → each quantized level's quality against the
source (engine/run/quality.py, cached in <out>/quality/) → one `colibri tune` study per level in
<out>/<level>/ (tuner/search/study.py; the same probe, budget and trial settings for every level) →
<out>/profile.json with every level's best config → `colibri compare` over the levels into
<out>/ (tables, plots, and the speed/quality Pareto plot).

Resume (--resume): a level whose directory holds result.json is finished and skipped; one that
holds a study.db continues its study; containers and quality figures already made are reused.
The level list may grow between runs (`--quant bf16` now, `--quant bf16,int8 --resume` later),
so each level can run in its own short session.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import optuna

from engine.api import (BudgetError, ConfigError, Converter, GROUP_SIZES, QuantSpec, atomic_write_text, format_size,
                        loads_limited, resolve_model)
from tuner.probe import load_profile
from tuner.results.outputs import best_config_entry, record_best_configs
from tuner.results.printers import kl_text, quant_tune_text, utc_now
from tuner.results.quant_rundir import (  # noqa: F401  (is_quant_run_dir, level_run_dirs: callers import them from here)
    LEVEL_RE, PROBE_FILE, RECORD_FILE, UNQUANTIZED, is_quant_run_dir, level_run_dirs, recorded_levels)
from tuner.results.result import TuneResult, plain
from tuner.results.rundir import is_run_dir, open_run
from tuner.share.compare import compare
from tuner.search import lossy, quant_cache, run_guard
from tuner.search.preflight import probe_profile
from tuner.search.run_record import read_run_record
from tuner.search.study import Log, TuneOptions, stderr_line, default_budget, run_tune

RECORD_SCHEMA = "colibri.tune-quant/1"
SUMMARY_FILE = "quant-result.json"
SUMMARY_SCHEMA = "colibri.tune-quant-result/1"
SCOPE_ALL_SUFFIX = "-all"  # int8-all, int4-g64-all: the dense projections quantized too (convert's scope "all")
DEFAULT_GROUP = 64


@dataclass(frozen=True)
class Level:
    """One quant level: the source as stored (quant None), or a container of it."""

    quant: str | None  # None, "int8" or "int4"
    group_size: int = 0  # int4 only
    dtype: str = ""  # the unquantized level's name (bf16, fp16, fp32)
    # "experts": the routed experts only (the part that streams); "all": the attention, dense-MLP
    # and shared-expert projections too (embeddings, norms and routers never), a smaller resident
    # part that leaves the expert cache more of the budget, at a quality cost measured like any level's.
    scope: str = quant_cache.SCOPE

    @property
    def label(self) -> str:
        if self.quant is None:
            return self.dtype
        base = "int8" if self.quant == "int8" else f"int4-g{self.group_size}"
        return base + (SCOPE_ALL_SUFFIX if self.scope == "all" else "")


def parse_levels(text: str) -> list[Level]:
    """'bf16,int8,int4' → levels; an unknown or repeated level is a ConfigError naming it."""
    names = [t.strip() for t in str(text).split(",")]
    if not any(names):
        raise ConfigError("--quant: no levels given (e.g. --quant bf16,int8,int4)")
    levels: list[Level] = []
    for name in names:
        m = LEVEL_RE.match(name)
        if not m or (m.group(2) and m.group(1) != "int4") or (m.group(3) and m.group(1) in UNQUANTIZED):
            raise ConfigError(f"--quant: unknown level {name!r} (known: bf16, fp16, fp32 for the source as "
                              f"stored; int8; int4 or int4-g{'/'.join(map(str, GROUP_SIZES))}; a quantized level "
                              f"with -all, e.g. int8-all, quantizes the dense part too)")
        kind, group = m.group(1), int(m.group(2) or DEFAULT_GROUP)
        if kind == "int4" and group not in GROUP_SIZES:
            raise ConfigError(f"--quant {name}: group size {group} is not one of {', '.join(map(str, GROUP_SIZES))}")
        scope = "all" if m.group(3) else quant_cache.SCOPE
        level = (Level(None, dtype=kind) if kind in UNQUANTIZED
                 else Level(kind, group if kind == "int4" else 0, scope=scope))
        if any(other.label == level.label for other in levels):
            raise ConfigError(f"--quant: level {level.label!r} is given twice")
        if level.quant is None and any(other.quant is None for other in levels):
            raise ConfigError(f"--quant: {name} and {next(o.label for o in levels if o.quant is None)} both name "
                              f"the unquantized source; give it once")
        levels.append(level)
    return levels


@dataclass
class QuantTuneOptions:
    tune: TuneOptions  # the settings every level's study shares (model: the source)
    levels: list[Level]
    quality_tokens: int = 2048  # tokens of text each quantized level is scored on against the source
    quality_ctx: int = 512
    quality_text: str | None = None  # None: held-out Python standard library sources (engine/run/quality.py)
    prepare_only: bool = False  # convert and score quality, tune nothing

    def validate(self) -> "QuantTuneOptions":
        self.tune.validate()
        if self.quality_ctx < 4 or self.quality_tokens < self.quality_ctx:
            raise ConfigError(f"--quality-tokens {self.quality_tokens} must be at least --quality-ctx "
                              f"{self.quality_ctx} (and that at least 4)")
        if self.tune.model_name or self.tune.quality:
            raise ConfigError("tune --quant sets each level's model name and quality itself")
        return self


@dataclass
class QuantTuneOutcome:
    out_dir: Path
    summary: dict
    files: dict = field(default_factory=dict)


def run_quant_tune(qopts: QuantTuneOptions, log: Log = stderr_line) -> QuantTuneOutcome:
    qopts.validate()
    opts = qopts.tune
    source = resolve_model(opts.model, progress=True).resolve()
    name = opts.model if not Path(opts.model).exists() else source.name
    stored = quant_cache.check_source(source, qopts.levels)
    if opts.lossy is not None:  # every level's lossy settings are scored against the unquantized source
        opts = qopts.tune = dataclasses.replace(opts, lossy=dataclasses.replace(opts.lossy, reference=str(source)))
    out = run_guard.tune_out(opts.out if opts.out is not None else default_quant_out(name, opts.resume),
                             sources=[source, opts.profile, opts.from_profile, qopts.quality_text],
                             recognise=run_guard.QUANT_RUN)
    record = _open_record(out, opts, qopts.levels, source, name)
    budget = opts.ram_budget or record.get("budget") or default_budget(opts.model)
    _check_before_start(qopts, source)
    with run_guard.hold(out, f"tuning {name} at {','.join(l.label for l in qopts.levels)}"):
        out.mkdir(parents=True, exist_ok=True)
        _write_record(out, record, budget, qopts.levels)
        log(f"tune --quant {','.join(l.label for l in qopts.levels)} of {name} ({stored} as stored), budget "
            f"{format_size(budget)}: runs in {out}/<level>/")
        probe_profile(out, opts.profile, source, log)  # once, for every level: <out>/profile.json → probe.json
        _keep_probe(out)
        return _run_levels(qopts, source, name, stored, out, budget, log)


def _check_before_start(qopts: QuantTuneOptions, source: Path) -> None:
    """What would fail later refused now, before the run directory exists: the saved probe, and
    every quantized level's conversion of this source (e.g. an int4 group that does not divide
    the model's sizes)."""
    if qopts.tune.profile:
        load_profile(qopts.tune.profile)
    for level in qopts.levels:
        if level.quant is not None:
            Converter(source, QuantSpec(level.quant, level.group_size, level.scope))


def _run_levels(qopts: QuantTuneOptions, source: Path, name: str, stored: str, out: Path, budget: int,
                log: Log) -> QuantTuneOutcome:
    opts = qopts.tune

    models, conversions = {}, {}
    for level in qopts.levels:
        if level.quant is None:
            models[level.label] = source
            continue
        models[level.label], conversions[level.label] = quant_cache.ensure_container(source, level, log)
    qualities = _qualities(qopts, source, name, stored, models, out, log)

    rows = {level.label: {"level": level.label, "model_dir": str(models[level.label]), "run_dir": str(out / level.label),
                          "conversion": conversions.get(level.label), "quality": qualities.get(level.label)}
            for level in qopts.levels}
    if not qopts.prepare_only:
        for level in qopts.levels:
            rows[level.label].update(_tune_level(opts, out, level.label, models[level.label], name, budget,
                                                 qualities.get(level.label), log))
    return _finish(out, name, source, budget, qopts, rows, log)


# --- the run directory ----------------------------------------------------------------------

def default_quant_out(model_name: str, resume: bool, root: Path = Path("reports")) -> Path:
    if resume:
        runs = sorted(p for p in root.glob(f"tune-{model_name}-quant-*") if (p / RECORD_FILE).is_file())
        if not runs:
            raise ConfigError(f"nothing to resume: no earlier tune --quant run for {model_name!r} under {root}/ "
                              f"(pass --out DIR)")
        return runs[-1]
    return root / f"tune-{model_name}-quant-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def _open_record(out: Path, opts: TuneOptions, levels: list[Level], source: Path, name: str) -> dict:
    """The parent's record: what every level shares. A resume must be about the same source."""
    path = out / RECORD_FILE
    if not opts.resume:
        if path.exists():
            raise ConfigError(f"{out} already holds a tune --quant run; pass --resume to continue it, or "
                              f"choose another --out")
        return {"schema": RECORD_SCHEMA, "model": name, "source_dir": str(source), "created_utc": utc_now()}
    if not path.is_file():
        raise ConfigError(f"nothing to resume: {out} holds no {RECORD_FILE}")
    record = loads_limited(path.read_bytes(), str(path), error=ConfigError)
    if not isinstance(record, dict) or record.get("schema") != RECORD_SCHEMA or not isinstance(record.get("budget"), int):
        raise ConfigError(f"{path}: not a tune --quant record (schema {RECORD_SCHEMA!r} with a budget)")
    if record.get("source_dir") != str(source):
        raise ConfigError(f"{out} is a tune --quant run of {record.get('source_dir')}, not of {source}")
    if opts.ram_budget is not None and opts.ram_budget != record["budget"]:
        raise ConfigError(f"{out} was tuned with budget {format_size(record['budget'])}; every level shares it "
                          f"(drop --ram-budget, or choose another --out)")
    return record


def _write_record(out: Path, record: dict, budget: int, levels: list[Level]) -> None:
    known = list(record.get("levels") or [])
    record.update(budget=budget, levels=known + [l.label for l in levels if l.label not in known])
    atomic_write_text(out / RECORD_FILE, json.dumps(record, indent=2) + "\n")


def _keep_probe(out: Path) -> None:
    """probe_profile caches the probe as <out>/profile.json; the levels read it from probe.json,
    which stays the bare probe while profile.json gains the levels' best configs."""
    if not (out / PROBE_FILE).exists():
        atomic_write_text(out / PROBE_FILE, (out / "profile.json").read_text(encoding="utf-8"))


# --- quality --------------------------------------------------------------------------------

def _qualities(qopts: QuantTuneOptions, source: Path, name: str, stored: str, models: dict, out: Path,
               log: Log) -> dict[str, dict]:
    """QualityInfo dicts by level: measured (or cached) for each container against the source;
    the source's own level is the reference (KL 0, same top-1 1, its perplexity)."""
    measured = {}
    for label, model_dir in models.items():
        if model_dir == source:
            continue
        r = quant_cache.quality(model_dir, source, out / "quality" / f"{label}.json", tokens=qopts.quality_tokens,
                                ctx=qopts.quality_ctx, text=qopts.quality_text, log=log)
        measured[label] = quality_info(r, name, stored)
        log(f"quality {label}: KL mean {kl_text(r['kl_mean'])} (p99 {kl_text(r['kl_p99'])}), same top-1 "
            f"{100 * r['top1_agreement']:.2f}%, perplexity {r['ppl_model']:.3f} (source {r['ppl_reference']:.3f})")
    reference = next((l for l, d in models.items() if d == source), None)
    # The source's perplexity comes with every measurement against it: this run's, or one an
    # earlier session of this run directory made (a resume may name the source level alone).
    scored = next(iter(measured.values()), None) or next(
        (quality_info(r, name, stored) for r in quant_cache.cached_qualities(out / "quality", source,
                                                                              qopts.quality_tokens, qopts.quality_ctx,
                                                                              qopts.quality_text)), None)
    if reference and scored:
        measured[reference] = {**scored, "kl_mean": 0.0, "kl_median": 0.0, "kl_p99": 0.0, "kl_max": 0.0,
                               "top1_agreement": 1.0, "perplexity": scored["perplexity_reference"]}
    return measured


def quality_info(r: dict, reference_name: str, reference_quant: str) -> dict:
    """tuner.result.QualityInfo's fields from a measure_quality result (no paths but the text's)."""
    return {"reference": reference_name, "reference_quant": reference_quant, "compute_dtype": r["model"]["compute_dtype"],
            "text": r["text"], "tokens": r["tokens"], "ctx": r["ctx"], "scored_tokens": r["scored_tokens"],
            "kl_mean": r["kl_mean"], "kl_median": r["kl_median"], "kl_p99": r["kl_p99"], "kl_max": r["kl_max"],
            "top1_agreement": r["top1_agreement"], "perplexity": r["ppl_model"],
            "perplexity_reference": r["ppl_reference"]}


# --- one level's study ----------------------------------------------------------------------

def _tune_level(opts: TuneOptions, out: Path, label: str, model_dir: Path, name: str, budget: int,
                quality: dict | None, log: Log) -> dict:
    run_dir = out / label
    if (run_dir / "result.json").is_file():
        log(f"[{label}] finished earlier ({run_dir / 'result.json'}): skipped")
        return {"status": "finished earlier"}
    resume = _has_study(run_dir, opts.storage)
    level_opts = dataclasses.replace(
        opts, model=str(model_dir), out=run_dir, resume=resume, ram_budget=budget, profile=str(out / PROBE_FILE),
        model_name=name, quality=quality, study_name=f"{opts.study_name}-{label}" if opts.study_name else None)
    log(f"[{label}] {'resuming' if resume else 'tuning'} {model_dir} in {run_dir}")
    try:
        run_tune(level_opts, log=lambda m: log(f"[{label}] {m}"))
    except BudgetError as exc:  # nothing fit at this level: the others still say something
        log(f"[{label}] {exc}")
        return {"status": "no config fit"}
    except KeyboardInterrupt:
        log(f"interrupted in level {label}; finished levels are kept. Continue with: colibri tune --quant "
            f"... --resume --out {out}")
        raise
    return {"status": "tuned"}


def _has_study(run_dir: Path, storage: str | None) -> bool:
    """Whether a level's study was created (an interrupt during its calibration leaves study.db
    without one: that level starts afresh)."""
    url = storage or f"sqlite:///{run_dir / 'study.db'}"
    if storage is None and not (run_dir / "study.db").is_file():
        return False
    record = read_run_record(run_dir)
    if record is None:
        return False
    try:
        return record["study_name"] in optuna.study.get_all_study_names(url)
    except Exception:  # an unreadable storage: resume and let tune say what is wrong in one line
        return True


# --- the comparison -------------------------------------------------------------------------

def _finish(out: Path, name: str, source: Path, budget: int, qopts: QuantTuneOptions, rows: dict,
            log: Log) -> QuantTuneOutcome:
    # The run directory's profile and comparison cover every level it holds, also those an
    # earlier session tuned and this one did not name.
    for run_dir in level_run_dirs(out):
        rows.setdefault(run_dir.name, {"level": run_dir.name, "run_dir": str(run_dir), "status": "earlier session"})
    order = {label: i for i, label in enumerate(recorded_levels(out))}
    rows = dict(sorted(rows.items(), key=lambda kv: order.get(kv[0], len(order))))
    files: dict[str, str] = {}
    entries, tuned = [], []
    for label, row in rows.items():
        if not is_run_dir(row["run_dir"]):
            continue
        result = open_run(row["run_dir"]).tune
        row["result"] = _figures(result)
        row.setdefault("quality", plain(result.quality))
        if result.recommended:
            entries.append(best_config_entry(result))
            tuned.append(row["run_dir"])
    if entries:
        files["profile.json"] = str(record_best_configs(load_profile(out / PROBE_FILE), entries, out / "profile.json"))
    compare_summary = None
    if len(tuned) >= 2:
        compare_summary = compare(tuned, out_dir=out, in_place=True)
        files.update(compare_summary["files"])
        plots = out / "plots" / "speed_quality.png"
        if plots.is_file():
            files["pareto"] = str(plots)
    elif not qopts.prepare_only:
        log("compare: fewer than two levels have a recommended config; nothing to compare yet")
    if qopts.tune.lossy is not None:  # --max-kl with --quant: one front over every level's settings
        merged = lossy.merge_level_fronts(level_run_dirs(out), out)
        if merged:
            files[lossy.SUMMARY_FILE] = str(out / lossy.SUMMARY_FILE)
            for line in lossy.markdown(merged).splitlines()[4:]:
                log(line)
    summary = {"schema": SUMMARY_SCHEMA, "created_utc": utc_now(), "out": str(out), "model": name,
               "source_dir": str(source), "budget_bytes": budget, "budget": format_size(budget),
               "prepared_only": qopts.prepare_only, "levels": list(rows.values()),
               "compare": {k: compare_summary[k] for k in ("ranked", "varying", "common")} if compare_summary else None}
    atomic_write_text(out / SUMMARY_FILE, json.dumps(summary, indent=2, default=str) + "\n")
    files[SUMMARY_FILE] = str(out / SUMMARY_FILE)
    summary["files"] = files
    return QuantTuneOutcome(out_dir=out, summary=summary, files=files)


def _figures(result: TuneResult) -> dict:
    """A level's row of the summary: its recommended config's confirmed figures (None: none)."""
    fig = result.recommended.confirmed if result.recommended else None
    shown = {k: getattr(fig, k) if fig else None
             for k in ("decode_tok_s", "decode_min", "decode_max", "ttft_s", "unconfirmed")}
    return {"quant": result.quant, **shown, "gain_over_baseline": result.gain_over_baseline,
            "trials": result.study.trials}


def format_quant_outcome(outcome: QuantTuneOutcome) -> str:
    return quant_tune_text(outcome.summary)
