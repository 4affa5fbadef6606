"""Shareable hardware profiles: export, import into a local store, list, show, diff.

A shared profile is the probe's HardwareProfile JSON (so `tune --profile/--from-profile` read
it) whose best_configs hold one strict entry per (model geometry, quant, budget, objective):
the recommended config, its confirmed figures, the conditions they were measured under and the
tool version and commit (docs/PROFILE.md). Export leaves out what identifies a person or a box
(hostname, user, serial numbers, MAC/IP, absolute paths: a model path becomes the model's name
and a geometry hash) unless asked with include_identity. Import validates strictly
(tuner.profile_schema) and copies into $XDG_CONFIG_HOME/colibri/profiles.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import re
import socket
from pathlib import Path

from engine.api import atomic_write_text, file_target, format_size, json_file_with, read_input, read_small_json
from tuner import __version__
from tuner.probe import load_profile
from tuner.probe.probe_errors import ProfileError
from tuner.probe.hardware_profile import HardwareProfile
from tuner.probe.summary import hardware_facts
from tuner.probe.summary import format_summary
from tuner.results.printers import fmt, pct
from tuner.results.quant_rundir import PROBE_FILE, is_quant_run_dir, level_run_dirs
from tuner.results.reproduce import entry_command
from tuner.results.result import BEST_CONFIG_SCHEMA, GEOMETRY_KEYS, plain
from tuner.results.rundir import is_run_dir, open_run
from tuner.results.columns import column
from tuner.share.profile_schema import SharedFigures, check_document, geometry_hash, parse_text, validate_shared

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
# A shared entry's figures (profile_schema.SharedFigures, the format on disk): those copied from
# the confirmed figures, and those copied from the trial's trials.csv column its `trial` metadata
# names (a column of the registry, tuner/results/columns.py: `column` refuses any other).
FIGURE_KEYS = tuple(f.name for f in dataclasses.fields(SharedFigures)  # the numbers (not `unconfirmed`)
                    if "bounds" in f.metadata and "trial" not in f.metadata and not f.metadata.get("optional"))
# Written only where measured (a serve entry's goodput), so every other entry keeps the format it had.
OPTIONAL_FIGURES = tuple(f.name for f in dataclasses.fields(SharedFigures) if f.metadata.get("optional"))
TRIAL_FIGURES = tuple((f.name, column(f.metadata["trial"]).name) for f in dataclasses.fields(SharedFigures)
                      if "trial" in f.metadata)
DTYPE_QUANT = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "float32": "fp32", "fp32": "fp32"}


# --- export ---------------------------------------------------------------------------------

def export_profile(source: str | Path, include_identity: bool = False) -> dict:
    """A run directory (its profile.json + result.json) or a profile/probe JSON → a shared profile."""
    source = Path(source)
    identity_dirs: list[str] = []
    runs = [open_run(source)] if is_run_dir(source) else \
        [open_run(d) for d in level_run_dirs(source)] if is_quant_run_dir(source) else None
    if runs is not None:  # a tune run, or a tune --quant run (each level's best goes in)
        probe = runs[0].profile if is_run_dir(source) else _load_probe(source / PROBE_FILE)
        if probe is None or not runs:
            raise ProfileError(f"{source}: no profile.json in the run directory" if probe is None else
                               f"{source}: no level of the tune --quant run has finished yet")
        data = probe.to_dict()
        old = [_normalize_entry(e) for e in data["best_configs"] if isinstance(e, dict)]
        entries = [e for e in old if e is not None]
        for run in runs:
            if run.tune.recommended is not None:
                entries = _replace_entry(entries, entry_from_run(run))
            identity_dirs.append(run.tune.model.dir)
    else:
        data = _read_probe_json(source)
        entries = [e for e in (_normalize_entry(e) for e in data["best_configs"]) if e is not None]
    data["best_configs"] = entries
    data["tool"] = {"name": "colibri-tune", "version": __version__}
    if include_identity:
        data["identity"] = {"hostname": socket.gethostname(), "user": _user(),
                            "model_dirs": [d for d in identity_dirs if d]}
    validate_shared(json.loads(json.dumps(data)))  # what we write must be what import accepts
    return data


def _load_probe(path: Path):
    return load_profile(path) if os.path.lexists(path) else None


def entry_from_run(run) -> dict:
    """A run directory's (rundir.RunDir) winner as a shared entry, read from its typed TuneResult."""
    r = run.tune
    rec, base, model = r.recommended, r.baseline, r.model
    figures = _figures(plain(rec.confirmed))
    trial = run.trial_row(rec.trial_number)
    for out_key, csv_key in TRIAL_FIGURES:
        figures[out_key] = _number(trial.get(csv_key))
    return {
        "schema": BEST_CONFIG_SCHEMA, "model": model_name(model.name, model.dir),
        "geometry": {k: model.geometry.get(k) for k in GEOMETRY_KEYS},
        "geometry_hash": geometry_hash(model.geometry),
        "quant": r.quant or DTYPE_QUANT.get(model.compute_dtype, "bf16"),
        "compute_dtype": model.compute_dtype or "", "ram_budget": r.budget_bytes,
        "objective": r.objective, "config": _shareable_config(rec.config),
        "figures": figures, "baseline_figures": _figures(plain(base.confirmed)) if base and base.confirmed else None,
        "gain_over_baseline": r.gain_over_baseline, "quality": _quality(plain(r.quality)),
        "conditions": _conditions(plain(r.conditions), r.confirmation.rounds, plain(r.study)),
        "tool": _tool(plain(r.conditions)),
        "created_utc": r.created_utc,
        **_honest_gain(plain(r.defaults), r.gain_over_defaults, plain(r.workload)),
    }


def model_name(name, directory) -> str:
    """A model's name without any path (a preset name stays; a directory becomes its basename)."""
    text = str(name or directory or "model")
    return re.split(r"[\\/]", text.rstrip("/\\"))[-1][:128] or "model"


def _normalize_entry(e: dict) -> dict | None:
    """An entry already in the shared form passes; the tuner's own run-local form is converted;
    anything else is dropped (export never forwards what it cannot vouch for)."""
    if not isinstance(e, dict) or e.get("schema") != BEST_CONFIG_SCHEMA:
        return None
    if "geometry_hash" in e:
        return e
    cond = e.get("conditions") or {}
    geometry = e.get("geometry") or {}
    return {
        "schema": BEST_CONFIG_SCHEMA, "model": model_name(e.get("model"), None),
        "geometry": {k: geometry.get(k) for k in GEOMETRY_KEYS}, "geometry_hash": geometry_hash(geometry),
        "quant": e.get("quant") or DTYPE_QUANT.get(e.get("compute_dtype"), "bf16"),
        "compute_dtype": e.get("compute_dtype") or "", "ram_budget": e.get("ram_budget"),
        "objective": e.get("objective"), "config": _shareable_config(e.get("config") or {}),
        "figures": _figures(e.get("figures")),
        "baseline_figures": _figures(e.get("baseline_figures")) if e.get("baseline_figures") else None,
        "gain_over_baseline": e.get("gain_over_baseline"), "quality": _quality(e.get("quality")),
        "conditions": _conditions(cond, None, {}), "tool": _tool(cond),
        "created_utc": e.get("created_utc"),
        **_honest_gain({"confirmed": e.get("defaults_figures")} if e.get("defaults_figures") else None,
                       e.get("gain_over_defaults"), e.get("workload")),
    }


def _honest_gain(defaults: dict | None, gain, workload: dict | None) -> dict:
    """The engine defaults' figures and the gain over them, and the workload tuned for (its
    lengths and hash: the prompts' text and file name stay on the tuning machine)."""
    return {"defaults_figures": _figures(defaults.get("confirmed")) if defaults and defaults.get("confirmed") else None,
            "gain_over_defaults": gain,
            "workload": {k: workload.get(k) for k in ("kind", "requests", "prompt_tokens", "max_new_tokens", "sha256",
                                                      *(STEADY_KEYS if workload.get("kind") == "steady" else ()),
                                                      *(TRACE_KEYS if workload.get("kind") == "trace" else ()))}
            if workload else None}


STEADY_KEYS = ("temperature", "top_p", "seed", "cycle_tokens")  # what `bench --steady` needs beside the lengths
TRACE_KEYS = ("slo_ttft_s", "slo_tpot_s", "span_s", "sequences")  # what a trace's goodput was judged against


def _conditions(cond: dict, rounds, study: dict) -> dict:
    """The measurement conditions a shared entry keeps (result.json's `conditions`, less the
    paths and the machine details the profile holds anyway)."""
    return {"cold": bool(cond.get("cold")), "tokens": cond.get("tokens"), "repeats": cond.get("repeats"),
            "prompt_tokens": cond.get("prompt_tokens"), "seed": cond.get("seed"), "min_ctx": cond.get("min_ctx"),
            "cgroup_enforced": (cond.get("memory_limit") or {}).get("cgroup"), "confirmation_rounds": rounds,
            "trials": study.get("trials"), "feasible": study.get("feasible"), "sampler": study.get("sampler"),
            "wall_seconds": cond.get("wall_seconds")}


def _tool(cond: dict) -> dict:
    """The tool that measured the figures (not the one exporting them): result.json records the
    package version as the engine's (one pyproject) and the commit."""
    versions = cond.get("versions") or {}
    return {"name": "colibri-tune", "version": versions.get("engine") or __version__,
            "engine_version": versions.get("engine"), "git_commit": versions.get("git_commit")}


def entry_key(e: dict) -> tuple:
    return (e.get("geometry_hash"), e.get("quant"), e.get("ram_budget"), e.get("objective"))


def _replace_entry(entries: list[dict], new: dict) -> list[dict]:
    return [e for e in entries if entry_key(e) != entry_key(new)] + [new]


def _shareable_config(config: dict) -> dict:
    # The routing histogram is a file on the tuning machine: its path means nothing elsewhere
    # and names a directory there. `pinned` without it falls back to recording one.
    return {**config, "routing_histogram": ""}


def _figures(f: dict | None) -> dict:
    f = f or {}
    out = {k: f.get(k) for k in FIGURE_KEYS}
    out["unconfirmed"] = bool(f.get("unconfirmed", False))
    return {**out, **{k: f.get(k) for k, _ in TRIAL_FIGURES},
            **{k: f[k] for k in OPTIONAL_FIGURES if f.get(k) is not None}}


def _quality(q) -> dict | None:
    if not isinstance(q, dict):
        return None
    return {"kl_mean": q.get("kl_mean"), "top1_agreement": q.get("top1_agreement"),
            "perplexity": q.get("perplexity"), "reference": model_name(q.get("reference"), None)
            if q.get("reference") else None}


def _number(text):
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _user() -> str | None:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None


# --- files and the store --------------------------------------------------------------------

def read_profile_file(path: str | Path) -> dict:
    """A profile file, strictly validated; returns the JSON dict."""
    path = Path(path)
    data = parse_text(_read_limited(path), str(path))
    try:
        validate_shared(data)
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return data


def _read_probe_json(path: Path) -> dict:
    """A probe's JSON (best_configs in any form) or a shared profile (identity dropped)."""
    data = parse_text(_read_limited(path), str(path))
    if isinstance(data, dict):
        data.pop("identity", None)
    try:
        check_document(data, "profile", 0)
        return HardwareProfile.from_dict(data).to_dict()
    except ProfileError as exc:
        raise ProfileError(f"{path}: {exc}") from None


def _read_limited(path: Path) -> bytes:
    return read_input(path, "profile", ProfileError)


def write_profile_file(data: dict, path: str | Path) -> Path:
    path = Path(path)
    if not path.parent.is_dir():
        raise ProfileError(f"cannot write {path}: directory {path.parent} does not exist")
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")
    return path


PROFILE_FILE = json_file_with("schema_version", "fingerprint")  # a probe's JSON or a shared profile


def store_dir() -> Path:
    """$XDG_CONFIG_HOME/colibri/profiles (XDG: ~/.config when unset or not absolute)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".config"
    return root / "colibri" / "profiles"


def default_name(data: dict) -> str:
    cpu = data["system"]["cpu"]["model"]
    slug = re.sub(r"[^a-z0-9]+", "-", cpu.lower()).strip("-")[:32].strip("-") or "cpu"
    # The transport as the probe or another tool spelt it ("NVMe", "virtio:blk"): lower-cased and
    # slugged like the CPU, since the user gave no name and must not be told theirs is bad.
    transport = re.sub(r"[^a-z0-9]+", "-", data["system"]["disk"]["transport"].lower()).strip("-")[:16] or "disk"
    return f"{slug}-{transport}-{data['fingerprint'][7:15]}"


def import_profile(path: str | Path, name: str | None = None, force: bool = False) -> tuple[str, Path, bool]:
    """Validate and copy into the store → (name, stored path, changed)."""
    data = read_profile_file(path)
    name = default_name(data) if name is None else name  # --name "" is refused below, not defaulted
    if not NAME_RE.match(name):
        raise ProfileError(f"profile name {name!r}: use lower-case letters, digits, '.', '_', '-' (at most 64)")
    store = store_dir()
    store.mkdir(parents=True, exist_ok=True)
    dest = store / f"{name}.json"
    text = json.dumps(data, indent=2) + "\n"
    if os.path.lexists(dest):
        if dest.is_file() and read_small_json(dest) == data:
            return name, dest, False
        if not force:
            raise ProfileError(f"a different profile named {name!r} is already in {store} "
                               f"(--name NEW to keep both, --force to replace it)")
    # --force replaces only a profile: not a directory, a FIFO or a stranger's file of that name.
    dest = file_target(dest, command="profile import", recognise=PROFILE_FILE, sources=[path], flag="--name")
    atomic_write_text(dest, text)
    return name, dest, True


def list_profiles() -> list[dict]:
    rows = []
    for p in sorted(store_dir().glob("*.json")) if store_dir().is_dir() else []:
        try:
            d = read_profile_file(p)
        except ProfileError as exc:
            rows.append({"name": p.stem, "path": str(p), "error": str(exc)})
            continue
        s = d["system"]
        rows.append({"name": p.stem, "path": str(p), "fingerprint": d["fingerprint"], "cpu": s["cpu"]["model"],
                     "cores": s["cpu"]["physical_cores"], "ram_bytes": s["memory"]["total"]["value"],
                     "disk": f"{s['disk']['transport']} {s['disk']['model'] or ''}".strip(),
                     "configs": len(d["best_configs"]), "created_utc": d["created_utc"]})
    return rows


def resolve(ref: str) -> tuple[str, dict]:
    """NAME in the store, or a FILE path, → (label, validated profile dict)."""
    path = Path(ref)
    if path.is_dir():
        raise ProfileError(f"{ref}: a directory, but not a tune run directory (no result.json) nor a profile file")
    if os.path.lexists(path):  # a file, or a FIFO/device/dangling link the reader names as such
        return path.name, read_profile_file(path)
    stored = store_dir() / f"{ref}.json"
    if NAME_RE.match(ref) and stored.is_file():
        return ref, read_profile_file(stored)
    raise ProfileError(f"{ref!r}: no such file, and no profile of that name in {store_dir()}")


# --- show and diff --------------------------------------------------------------------------

def format_show(label: str, data: dict) -> str:
    profile = HardwareProfile.from_dict({k: v for k, v in data.items() if k != "identity"})
    lines = [f"{label}", format_summary(profile), ""]
    if data.get("identity"):
        lines.append(f"identity: {data['identity']}")
    lines.append(f"best configs ({len(data['best_configs'])}):")
    for e in data["best_configs"]:
        lines.append("  " + entry_line(e))
        command = entry_command(e)
        if command:  # the entry's config as CONFIG.toml (its `config` object), then this measures it again
            lines.append(f"    reproduce: {command}")
    return "\n".join(lines)


def entry_line(e: dict) -> str:
    f, c = e["figures"], e["config"]
    return (f"{e['model']} [{e['geometry_hash'][7:15]}] {e['quant']} budget {format_size(e['ram_budget'])} "
            f"{'cold' if e['conditions']['cold'] else 'warm'}: decode {fmt(f.get('decode_tok_s'))} tok/s "
            f"[{fmt(f.get('decode_min'))}..{fmt(f.get('decode_max'))}], TTFT {fmt(f.get('ttft_s'), 3)} s"
            + (f", {pct(e['gain_over_defaults'], signed=True)} over the engine's defaults"
               if e.get("gain_over_defaults") is not None else "")
            + (f" (tuned for {e['workload']['requests']} prompt(s), {e['workload']['sha256']})"
               if (e.get("workload") or {}).get("kind") == "prompts" else "")
            + (f" (steady workload: {e['workload']['requests']} prompts, {e['workload']['sha256']})"
               if (e.get("workload") or {}).get("kind") == "steady" else "")
            + (f" (serve: goodput {fmt(f.get('goodput_rps'), 3)} req/s of a {e['workload']['requests']}-request trace "
               f"{e['workload']['sha256']} within TTFT <= {fmt(e['workload'].get('slo_ttft_s'), 3)} s, TPOT <= "
               f"{fmt(e['workload'].get('slo_tpot_s'), 3)} s, max_batch {c.get('max_batch')})"
               if (e.get("workload") or {}).get("kind") == "trace" else "") + " | chunk "
            f"{format_size(c.get('chunk_size'))}, prefetch {c.get('prefetch_depth')}, {c.get('cache_policy')} "
            f"x{c.get('cpu_cache_ratio')}, threads {c.get('threads')}, io {c.get('io_mode')} x{c.get('io_threads')} "
            f"| tool {e['tool']['version']} ({e['tool'].get('git_commit')})")


def diff(a: tuple[str, dict], b: tuple[str, dict]) -> dict:
    (la, da), (lb, db) = a, b
    fa, fb = hardware_facts(da), hardware_facts(db)
    hardware = [{"item": k, "a": fa[k], "b": fb[k], "differs": fa[k] != fb[k]} for k in fa]
    pairs = []
    for ea in da["best_configs"]:
        for eb in db["best_configs"]:
            if (ea["geometry_hash"], ea["quant"]) == (eb["geometry_hash"], eb["quant"]):
                pairs.append({"model": ea["model"], "geometry_hash": ea["geometry_hash"], "quant": ea["quant"],
                              "a": ea, "b": eb,
                              "same_conditions": ea["ram_budget"] == eb["ram_budget"]
                              and ea["conditions"]["cold"] == eb["conditions"]["cold"]})
    return {"a": la, "b": lb, "hardware": hardware, "configs": pairs}


def format_diff(d: dict) -> str:
    lines = [f"hardware: {d['a']}  vs  {d['b']}"]
    w = max(len(h["item"]) for h in d["hardware"])
    for h in d["hardware"]:
        mark = "*" if h["differs"] else " "
        lines.append(f" {mark} {h['item']:<{w}}  {h['a']}  |  {h['b']}")
    if not d["configs"]:
        lines.append("best configs: none for the same model geometry and quant in both")
    for p in d["configs"]:
        lines.append(f"best configs for {p['model']} [{p['geometry_hash'][7:15]}] {p['quant']}"
                     + ("" if p["same_conditions"] else " (budget or cold/warm differ: not like for like)") + ":")
        lines.append(f"   a: {entry_line(p['a'])}")
        lines.append(f"   b: {entry_line(p['b'])}")
    lines.append("(* = differs)")
    return "\n".join(lines)
