"""`tune --max-kl X / --min-top1 Y`: settings that change the output, searched under a quality bound.

Without a bound the search is lossless (placement never changes tokens). With one, the study
also searches
    kv_dtype          auto (the compute dtype) / fp8 / int8 (engine/arch/kvquant.py)
    top_k_reduction   0, 1, 2: route k-1 or k-2 experts per token
    expert_threshold  0, 0.05, 0.1, 0.2: skip experts below that share of the routing weight
and, with `--quant LEVELS`, the quant level (one study per level, tuner/search/quant_tune.py;
every level is scored against the unquantized source), the dense part's too with an `-all` level
(int8-all, int4-all: convert's scope "all").

Every lossy setting's quality is measured once with engine/run/quality.py's figures (KL of the
next-token distributions and top-1 agreement against the lossless reference, teacher-forced on
a fixed text) and cached in <out>/lossy-quality.json; a setting that breaks the bound gets a
positive Optuna constraint (graded by how far it is off), so the sampler learns where the bound
is, and it never becomes the recommendation. Quality depends on the setting only, not on
placement: trials that differ only in I/O or cache knobs share one measurement.

After the search, <out>/lossy.json and report.md's "Speed against quality" section list every
measured setting's best speed and quality, and the Pareto front (faster, or closer to the
reference) with the recommended point marked. With `--front-rounds N` (front_confirm.py) the
points inside the bound are re-measured in N interleaved rounds first and the front is drawn from
those medians, since a setting measured once competes badly with the best of many lossless trials.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from optuna.distributions import CategoricalDistribution

from engine.api import (Checkpoint, ConfigError, EngineConfig, KV_QUANT_NAMES, Reference, atomic_write_text,
                        fingerprint, loads_limited, model_args, supports_quantized_kv)
from tuner.results.printers import quality_progress

KV_CHOICES = ("auto", *KV_QUANT_NAMES)
TOP_K_REDUCTIONS = (0, 1, 2)
THRESHOLDS = (0.0, 0.05, 0.1, 0.2)
LOSSY_PARAMS = ("kv_dtype", "top_k_reduction", "expert_threshold")
CACHE_FILE = "lossy-quality.json"
SUMMARY_FILE = "lossy.json"
LOSSLESS = {"kv_dtype": "auto", "top_k_reduction": 0, "expert_threshold": 0.0}


@dataclass(frozen=True)
class QualityBound:
    """What the user accepts, and how quality is measured (the fixed text)."""

    max_kl: float | None = None  # mean KL(reference || candidate) per scored token, nats
    min_top1: float | None = None  # share of positions whose argmax agrees with the reference's
    tokens: int = 1024
    ctx: int = 256
    text: str | None = None  # None: held-out Python standard library sources
    reference: str | None = None  # the lossless model to compare with; None: the tuned model itself

    def validate(self) -> "QualityBound":
        if self.max_kl is None and self.min_top1 is None:
            raise ConfigError("a quality bound needs --max-kl or --min-top1")
        if self.max_kl is not None and not self.max_kl > 0:
            raise ConfigError(f"--max-kl must be positive, got {self.max_kl}")
        if self.min_top1 is not None and not 0 < self.min_top1 <= 1:
            raise ConfigError(f"--min-top1 must be in (0, 1], got {self.min_top1}")
        if self.ctx < 4 or self.tokens < self.ctx:
            raise ConfigError(f"--quality-tokens {self.tokens} must be at least --quality-ctx {self.ctx} "
                              f"(and that at least 4)")
        return self

    def violation(self, quality: dict) -> float:
        """0 within the bound; else how far off, relative to the bound (the sampler's gradient)."""
        off = 0.0
        if self.max_kl is not None:
            off = max(off, (quality["kl_mean"] - self.max_kl) / self.max_kl)
        if self.min_top1 is not None:
            off = max(off, (self.min_top1 - quality["top1_agreement"]) / self.min_top1)
        return round(off, 6) if off > 0 else 0.0

    def describe(self) -> str:
        parts = ([f"KL mean <= {self.max_kl:g}"] if self.max_kl is not None else []) + \
                ([f"same top-1 >= {100 * self.min_top1:g}%"] if self.min_top1 is not None else [])
        return " and ".join(parts)


# --- the dimensions -------------------------------------------------------------------------

def distributions(model_dir) -> dict:
    """The lossy dimensions this model has: KV quantization where its attention supports it,
    routing trims on MoE models (never below one expert)."""
    args = model_args(Checkpoint(model_dir).config)
    d = {}
    if supports_quantized_kv(args):
        d["kv_dtype"] = CategoricalDistribution(KV_CHOICES)
    if args.is_moe:
        d["top_k_reduction"] = CategoricalDistribution(tuple(r for r in TOP_K_REDUCTIONS if r < args.top_k))
        d["expert_threshold"] = CategoricalDistribution(THRESHOLDS)
    return d


def probes(dists: dict) -> list[dict]:
    """One step along each lossy dimension the space has (int8 KV, fp8 KV, k-1, the middle
    threshold): measured early, at the best lossless warm start's placement (warm_start.py)."""
    out = [{"kv_dtype": kind} for kind in ("int8", "fp8") if kind in getattr(dists.get("kv_dtype"), "choices", ())]
    if 1 in getattr(dists.get("top_k_reduction"), "choices", ()):
        out.append({"top_k_reduction": 1})
    if 0.1 in getattr(dists.get("expert_threshold"), "choices", ()):
        out.append({"expert_threshold": 0.1})
    return out


def setting_of(config: EngineConfig) -> dict:
    return {"kv_dtype": config.kv_dtype, "top_k_reduction": config.top_k_reduction,
            "expert_threshold": float(config.expert_threshold)}


def is_lossless(setting: dict) -> bool:
    return EngineConfig(**setting).lossless


def label(setting: dict, quant: str | None = None) -> str:
    """'int8 KV, k-1, threshold 0.05' (with the weights' quant first where given), 'lossless'."""
    parts = [quant] if quant else []
    if setting["kv_dtype"] in KV_QUANT_NAMES:
        parts.append(f"{setting['kv_dtype']} KV")
    if setting["top_k_reduction"]:
        parts.append(f"k-{setting['top_k_reduction']}")
    if setting["expert_threshold"]:
        parts.append(f"threshold {setting['expert_threshold']:g}")
    return ", ".join(parts) if len(parts) > (1 if quant else 0) else (f"{quant}, lossless" if quant else "lossless")


# --- measuring and caching quality ----------------------------------------------------------

class QualityMeter:
    """Each setting's quality against the reference, measured once, cached in the run directory.

    The reference's log-probabilities are computed on first use and kept for the session, so
    each further setting costs one pass of the candidate over the text.
    """

    def __init__(self, model_dir: Path, bound: QualityBound, out: Path, log):
        self.model_dir = Path(model_dir)
        self.bound = bound
        self.reference_dir = Path(bound.reference) if bound.reference else self.model_dir
        self.path = Path(out) / CACHE_FILE
        self.log = log
        self._reference = None
        self._key_base = None

    def key_base(self) -> dict:
        if self._key_base is None:
            self._key_base = {
                "model_fingerprint": fingerprint(Checkpoint(self.model_dir)),
                "reference_fingerprint": fingerprint(Checkpoint(self.reference_dir)),
                "tokens": self.bound.tokens, "ctx": self.bound.ctx,
                "text": str(Path(self.bound.text).resolve()) if self.bound.text else None}
        return self._key_base

    def quality(self, setting: dict) -> dict:
        """{kl_mean, kl_p99, top1_agreement, ppl_ratio, measured}: cached, or measured now."""
        if is_lossless(setting) and self.model_dir.resolve() == self.reference_dir.resolve():
            return {"kl_mean": 0.0, "kl_p99": 0.0, "top1_agreement": 1.0, "ppl_ratio": 1.0,
                    "measured": "the reference itself"}
        key = {**self.key_base(), "setting": setting}
        entries = self._entries()
        for entry in entries:
            if entry.get("key") == key:
                return entry["result"]
        result = self._measure(setting)
        entries.append({"key": key, "result": result})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({"entries": entries}, indent=2) + "\n")
        return result

    def _measure(self, setting: dict) -> dict:
        if self._reference is None:
            self._reference = Reference(self.reference_dir, self.bound.tokens, self.bound.ctx, self.bound.text,
                                        progress=quality_progress())
        self.log(f"quality: scoring {label(setting)} against {self.reference_dir.name} "
                 f"({self.bound.tokens} tokens, ctx {self.bound.ctx}) ...")
        changes = {k: v for k, v in setting.items() if v != LOSSLESS[k]}
        r = self._reference.score(self.model_dir, changes)
        result = {"kl_mean": r["kl_mean"], "kl_p99": r["kl_p99"], "top1_agreement": r["top1_agreement"],
                  "ppl_ratio": r["ppl_ratio"], "measured": r["text"]}
        self.log(f"quality {label(setting)}: KL mean {r['kl_mean']:.5f}, same top-1 {100 * r['top1_agreement']:.2f}%")
        return result

    def _entries(self) -> list:
        try:
            data = loads_limited(self.path.read_bytes(), str(self.path), error=ConfigError)
        except (OSError, ConfigError):
            return []
        entries = data.get("entries") if isinstance(data, dict) else None
        return [e for e in entries if isinstance(e, dict) and isinstance(e.get("result"), dict)] \
            if isinstance(entries, list) else []


def judge_quality(attrs: dict, quality: dict, bound: QualityBound) -> dict:
    """A measured trial's attrs with its setting's quality, and the bound enforced: a breach is
    a positive constraint (status quality_bound) even where the run itself was fine."""
    attrs = dict(attrs, quality=quality)
    violation = bound.violation(quality)
    if violation > 0:
        attrs["constraint"] = max(float(attrs.get("constraint") or 0.0), violation)
        if attrs.get("status") == "ok":
            attrs["status"] = "quality_bound"
            attrs["error"] = f"quality outside the bound ({bound.describe()}): KL mean {quality['kl_mean']:.5f}, " \
                             f"same top-1 {100 * quality['top1_agreement']:.2f}%"
    return attrs


# --- the speed-quality front ----------------------------------------------------------------

def front_summary(trials, bound: QualityBound, recommended: dict | None, quant: str | None) -> dict:
    """Per measured lossy setting: its fastest run and its quality; the Pareto front; the chosen point."""
    best: dict[str, dict] = {}
    for t in trials:
        a = t.user_attrs
        q, speed = a.get("quality"), a.get("decode_tok_s")
        config = a.get("config") or {}
        if not q or speed is None or a.get("status") not in ("ok", "quality_bound"):
            continue
        setting = {k: config.get(k, LOSSLESS[k]) for k in LOSSY_PARAMS}
        name = label(setting, quant)
        if name not in best or speed > best[name]["decode_tok_s"]:
            best[name] = {"setting": setting, "label": name, "decode_tok_s": speed, "trial": t.number,
                          "kl_mean": q["kl_mean"], "top1_agreement": q["top1_agreement"],
                          "within_bound": bound.violation(q) == 0}
    points = sorted(best.values(), key=lambda p: (p["kl_mean"], -p["decode_tok_s"]))
    same_placement_ratios(points, trials)
    mark_front(points)
    chosen = None
    if recommended:
        chosen = label({k: recommended["config"].get(k, LOSSLESS[k]) for k in LOSSY_PARAMS}, quant)
    return {"bound": asdict(bound), "bound_text": bound.describe(), "quant": quant, "points": points,
            "chosen": chosen}


def front_speed(point: dict) -> float:
    """The speed a point stands on the front with: its confirmed median where the front rounds
    measured one (front_confirm.py), else its fastest search trial."""
    return point.get("front_tok_s", point["decode_tok_s"])


def mark_front(points: list[dict]) -> None:
    """Each point's `on_front` (no other point both at most as far from the reference and at
    least as fast, and better in one), by front_speed."""
    for p in points:
        kl, speed = p["kl_mean"], front_speed(p)
        p["on_front"] = not any(o["kl_mean"] <= kl and front_speed(o) >= speed
                                and (o["kl_mean"] < kl or front_speed(o) > speed) for o in points)


def placement(config: dict) -> tuple:
    """A config without its lossy settings: what the lossless comparison must share."""
    return tuple(sorted((k, v) for k, v in config.items() if k not in LOSSY_PARAMS))


def same_placement_ratios(points: list[dict], trials) -> None:
    """Each lossy point's speed over the fastest lossless trial at the same placement (None when
    the study ran none there). The front compares each setting's fastest trial, and a probe runs
    at one placement while lossless settings get searched: when probes ran at the baseline's, on
    demo at 1 GiB k-1 was +37% over lossless at the same placement yet off the front
    (docs/benchmarks-history.md, tunebench, 2026-12-02)."""
    lossless: dict[tuple, float] = {}
    by_number = {}
    for t in trials:
        a = t.user_attrs
        config, speed = a.get("config") or {}, a.get("decode_tok_s")
        by_number[t.number] = config
        if speed is None or a.get("status") != "ok":
            continue
        if all(config.get(k, LOSSLESS[k]) == LOSSLESS[k] for k in LOSSY_PARAMS):
            key = placement(config)
            lossless[key] = max(speed, lossless.get(key, 0.0))
    for p in points:
        base = None if is_lossless(p["setting"]) else lossless.get(placement(by_number.get(p["trial"]) or {}))
        p["vs_lossless_same_placement"] = round(p["decode_tok_s"] / base, 4) if base else None


def _heading(summary: dict, speed: str) -> list[str]:
    """Both tables' title and bound line; `speed` says what the speed column is."""
    return ["## Speed against quality (lossy settings)", "",
            f"Bound: {summary['bound_text']}, measured on {summary['bound']['tokens']} tokens (ctx "
            f"{summary['bound']['ctx']}) against the lossless reference. Speed: {speed}", ""]


def markdown(summary: dict) -> str:
    if "front_confirmation" in summary:
        return confirmed_markdown(summary)
    rows = _heading(summary, "the setting's fastest search trial (decode tok/s); the recommended config's "
                             "confirmed figure is above.") + [
            "| setting | decode tok/s | vs lossless, same placement | KL mean | same top-1 | within bound | "
            "Pareto front | chosen |",
            "|---|---|---|---|---|---|---|---|"]
    for p in summary["points"]:
        ratio = p.get("vs_lossless_same_placement")
        rows.append(f"| {p['label']} | {p['decode_tok_s']:.3g} | {f'{ratio - 1:+.0%}' if ratio else '-'} | "
                    f"{p['kl_mean']:.5f} | "
                    f"{100 * p['top1_agreement']:.2f}% | {'yes' if p['within_bound'] else 'no'} | "
                    f"{'yes' if p['on_front'] else ''} | {'**chosen**' if p['label'] == summary['chosen'] else ''} |")
    return "\n".join(rows) + "\n"


def confirmed_markdown(summary: dict) -> str:
    """The table of a front the front rounds re-measured (front_confirm.py): the confirmed median
    and its spread first, the search figure beside it; '(search)' marks a point standing on its
    search figure (not re-measured: outside the bound, out of time, or every run failed)."""
    fc = summary["front_confirmation"]
    rounds = (f"{fc['rounds_run']} of {fc['rounds']} interleaved rounds" + (f" ({fc['stopped']})" if fc.get("stopped")
                                                                           else "")) if "rounds" in fc else \
        "each level's own interleaved rounds"
    rows = _heading(summary, f"the median of {rounds} re-measuring each setting's fastest search trial (min-max "
                             f"over every repeat); '(search)': not re-measured, the fastest search trial stands. "
                             f"The front is drawn from these figures.") + [
            "| setting | decode tok/s | min-max | runs | search trial | vs lossless, same placement | KL mean | "
            "same top-1 | within bound | Pareto front | chosen |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in summary["points"]:
        conf = p.get("confirmed")
        speed = f"{conf['decode_tok_s']:.3g}" if conf else f"{p['decode_tok_s']:.3g} (search)"
        spread = f"{conf['decode_min']:.3g}-{conf['decode_max']:.3g}" \
            if conf and conf.get("decode_min") is not None and conf.get("decode_max") is not None else "-"
        ratio, marked = p.get("vs_lossless_same_placement_confirmed"), ""
        if ratio is None and p.get("vs_lossless_same_placement"):
            ratio, marked = p["vs_lossless_same_placement"], " (search)"
        rows.append(f"| {p['label']} | {speed} | {spread} | {conf['runs'] if conf else '-'} | "
                    f"{p['decode_tok_s']:.3g} | {f'{ratio - 1:+.0%}{marked}' if ratio else '-'} | {p['kl_mean']:.5f} | "
                    f"{100 * p['top1_agreement']:.2f}% | {'yes' if p['within_bound'] else 'no'} | "
                    f"{'yes' if p['on_front'] else ''} | {'**chosen**' if p['label'] == summary['chosen'] else ''} |")
    return "\n".join(rows) + "\n"


def write_summary(out: Path, summary: dict) -> dict:
    """lossy.json, and the section appended to report.md (written just before)."""
    files = {SUMMARY_FILE: str(Path(out) / SUMMARY_FILE)}
    atomic_write_text(Path(out) / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
    report = Path(out) / "report.md"
    if report.is_file():
        atomic_write_text(report, report.read_text(encoding="utf-8").rstrip("\n") + "\n\n" + markdown(summary))
    return files


def merge_level_fronts(level_dirs: list[Path], out: Path) -> dict | None:
    """tune --quant with a bound: every level's measured settings on one speed-quality front
    (<out>/lossy.json), each level's own recommendation marked; None when no level has one."""
    summaries = []
    for d in level_dirs:
        try:
            summaries.append(loads_limited((Path(d) / SUMMARY_FILE).read_bytes(), str(d), error=ConfigError))
        except (OSError, ConfigError):
            continue
    if not summaries:
        return None
    # Each level's points stand with their own confirmed medians (front_speed): the levels'
    # front rounds ran in their own studies, each against its own lossless setting.
    points = [dict(p) for s in summaries for p in s.get("points", [])]
    mark_front(points)
    points.sort(key=lambda p: (p["kl_mean"], -front_speed(p)))
    inside = [p for p in points if p["within_bound"]]
    best = max(inside, key=front_speed) if inside else None
    merged = {**summaries[0], "quant": None, "points": points, "chosen": best["label"] if best else None,
              "levels_chosen": [s.get("chosen") for s in summaries]}
    merged.pop("front_confirmation", None)  # level 0's alone would misdescribe the merge
    if any("front_confirmation" in s for s in summaries):
        merged["front_confirmation"] = {"levels": [s.get("quant") for s in summaries],
                                        "per_level": [s.get("front_confirmation") for s in summaries]}
    atomic_write_text(Path(out) / SUMMARY_FILE, json.dumps(merged, indent=2) + "\n")
    return merged
