"""`colibri plan`'s printers: the prediction (PlanResult) and the calibration (CalibrationResult).

The plan's conditions are the result's `fact` fields (engine/api/results.py), printed by iterating
them: a new condition is one field there.
"""

from __future__ import annotations

from engine.api import CalibrationResult, PlanResult, figures, format_size


def plan_text(r: PlanResult | CalibrationResult) -> str:
    if isinstance(r, CalibrationResult):
        return calibration_text(r)
    m, p = r.model, r.prediction
    lines = [f"model {m['name']} ({m['model_type']}): {m['total_params'] / 1e9:.1f}B parameters, "
             f"{m['active_params'] / 1e9:.1f}B active, {m['experts']} experts top-{m['top_k']} in "
             f"{m['moe_layers']} of {m['layers']} layers; quant {r.quant}"]
    lines += fact_lines(r)
    lines.append(f"factors: {'calibrated' if r.calibrated else 'uncalibrated (the measured curves as they are)'}"
                 + "".join(f"; {k} {v:.3g}" for k, v in r.factors.items()))
    lines.append(_format_one("this config", r.config, p))
    for i, b in enumerate(r.best, 1):
        lines.append(_format_one(f"best predicted #{i}", b["config"], b["prediction"]))
    if not r.best:
        lines.append("no config of the grid fits this budget")
    if r.batch:
        lines += batch_lines(r.batch)
    if r.draft:
        lines += draft_lines(r.draft)
    if r.prefill is not None:
        lines.append(prefill_text(r.prefill))
    return "\n".join(lines)


def prefill_text(p: dict) -> str:
    """`plan --prompt-tokens N --cached-tokens M`: the time to first token and its parts."""
    head = f"first token after {p['new_tokens']} new tokens" + (
        f" and {p['cached_tokens']} cached" if p["cached_tokens"] else "") + " (cold)"
    if not p["fits"]:
        return f"{head}: does not fit: {p['reason']}"
    restore = {"none": "", "ram": "from the RAM prefix cache", "ssd": "from the SSD (the prefix cache's share "
               "cannot hold them)"}[p["restore_from"]]
    line = (f"{head}: TTFT {p['ttft_s']:.3g} s = reads {p['read_s']:.3g} s ({format_size(p['read_bytes'])} in "
            f"{p['groups']} group{'s' if p['groups'] != 1 else ''} of {p['prefill_group']}) + compute "
            f"{p['compute_s']:.3g} s (attention {p['attention_s']:.3g} s) + overhead {p['overhead_s']:.3g} s")
    if p["cached_tokens"]:
        line += (f" + restore {p['restore_s']:.3g} s ({format_size(p['restore_bytes'])} of KV {restore}; from RAM "
                 f"{p['restore_ram_s']:.3g} s, from the SSD {p['restore_ssd_s']:.3g} s)")
        if p.get("ttft_without_reuse_s") is not None:
            line += f"\n  without reuse (all {p['new_tokens'] + p['cached_tokens']} computed): TTFT {p['ttft_without_reuse_s']:.3g} s"
    return line


def draft_lines(d: dict) -> list[str]:
    """Speculative decoding's prediction (tuner/costmodel/speculative.py): per depth, then the gate."""
    per = ", ".join(f"{x['depth']}: {x['speedup']:.2f}x ({x['tokens_per_step']:.2f} tok/step, "
                    f"{format_size(x['bytes_per_token'])}/tok)" for x in d["depths"] if x["speedup"] is not None)
    return [f"drafting ({d['drafter']}, acceptance {d['acceptance']:.0%}) by depth: {per}",
            f"  the gate: {d['gate']}"]


def batch_lines(points: list[dict]) -> list[str]:
    """The --batch table: one row per batch size (sequences decoding together, one token each per step)."""
    lines = ["batched decode (this config, max_batch = B):",
             f"  {'B':>3}  {'union/layer':>11}  {'read/step':>9}  {'per seq tok/s':>13}  {'aggregate':>9}  bound"]
    for p in points:
        if not p["fits"]:
            lines.append(f"  {p['batch']:>3}  does not fit: {p['reason']}")
            continue
        lines.append(f"  {p['batch']:>3}  {p['union_experts']:>11.2f}  {format_size(p['bytes_per_step']):>9}  "
                     f"{p['per_sequence_tok_s']:>13.3g}  {p['aggregate_tok_s']:>9.3g}  {p['bottleneck']}")
    return lines


def fact_lines(r) -> list[str]:
    """'label: value (note)' for each fact field of the result that has a value."""
    lines = []
    for f in figures(r):
        v, m = getattr(r, f.name), f.metadata
        if m.get("line") != "facts" or not v:
            continue
        text = ", ".join(map(str, v)) if m["kind"] == "list" else str(v)
        note = (m.get("notes") or {}).get(v) if isinstance(v, str) else None
        lines.append(f"{m['label']}: {text}" + (f" ({note})" if note else ""))
    return lines


def _format_one(title: str, cfg: dict, p: dict) -> str:
    knobs = (f"chunk {format_size(cfg['chunk_size'])}, prefetch {cfg['prefetch_depth']}, cache ratio "
             f"{cfg['cpu_cache_ratio']}, {cfg['io_mode']}, io_threads {cfg['io_threads']}, {cfg['cache_policy']}, "
             f"threads {cfg['threads'] or 'auto'}, ctx {cfg['ctx_size']}, budget {format_size(cfg['ram_budget'])}")
    if not p["fits"]:
        return f"{title}: {knobs}\n  does not fit: {p['reason']}"
    plan = p["plan"]
    split = (f"dense {format_size(plan['dense_bytes'])} + KV {format_size(plan['kv_bytes'])} + read buffers "
             f"{format_size(plan['buffer_bytes'])} + runtime {format_size(plan['overhead_bytes'])}"
             f"{' + prefix cache ' + format_size(plan['prefix_cache_bytes']) if plan.get('prefix_cache_bytes') else ''}"
             f"{' + drafting ' + format_size(plan['draft_bytes']) if plan.get('draft_bytes') else ''}"
             f" + RAM cache "
             f"{format_size(plan['cache_bytes'])} ({int(plan['cache_slots'])} of {plan['routed_experts']} experts)"
             f"{' + VRAM cache ' + format_size(plan['gpu_cache_bytes']) if plan['gpu_cache_bytes'] else ''}"
             if plan["streaming"] else "everything resident")
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in p["seconds"].items() if v)
    return (f"{title}: {knobs}\n  plan: {split}\n"
            f"  predicted: decode {p['decode_tok_s']:.3g} tok/s, TTFT {p['ttft_s']:.3g} s, RAM hit rate "
            f"{p['hit_rate']:.1%}, {format_size(p['bytes_per_token'])} read per token in "
            f"{format_size(p['read_request_bytes'])} requests at QD {p['queue_depth']}; bottleneck: {p['bottleneck']}"
            f"\n  per token: {terms}")


def _rho(v) -> str:
    return "undefined" if v is None else f"{v:.2f}"


def _pts(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def calibration_text(r: CalibrationResult) -> str:
    c = r.calibration
    h = c["held_out"]
    lines = [f"calibrated on {h['trials']} trials of {c['fitted_on']['model']} ({c['fitted_on']['quant']}, budget "
             f"{format_size(c['fitted_on']['budget_bytes'])}); routing: {c['routing']}",
             "held-out (each trial predicted by factors fitted without it):",
             "| trial | io | chunk | prefetch | ratio | policy | measured tok/s | predicted | error | measured TTFT | predicted | hit meas/pred |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r.held_out:
        cfg = row["config"]
        err = (row["predicted_decode"] - row["measured_decode"]) / row["measured_decode"] * 100
        hm = "-" if row["measured_hit_rate"] is None else f"{row['measured_hit_rate']:.0%}"
        lines.append(f"| {row['number']} | {cfg['io_mode']} | {format_size(cfg['chunk_size'])} | {cfg['prefetch_depth']} | "
                     f"{cfg['cpu_cache_ratio']} | {cfg['cache_policy']} | {row['measured_decode']:.3f} | "
                     f"{row['predicted_decode']:.3f} | {err:+.0f}% | {row['measured_ttft']:.2f} | "
                     f"{row['predicted_ttft']:.2f} | {hm}/{row['predicted_hit_rate']:.0%} |")
    lines.append(f"decode: median abs error {h['decode_median_abs_pct_error']:.1f}%, Spearman {_rho(h['decode_spearman'])}; "
                 f"TTFT: median abs error {h['ttft_median_abs_pct_error']:.1f}%, Spearman {_rho(h['ttft_spearman'])}")
    lines.append(f"RAM hit rate: median abs error {_pts(h['hit_rate_median_abs_error_points'])} points; bytes per "
                 f"token: median abs error {_pts(h['bytes_per_token_median_abs_pct_error'])}%")
    by = c.get("held_out_by_kind") or {}
    if by:  # what the tune's warm-start gate reads (tuner/costmodel/calibrated_facts.py)
        lines.append("decode median abs error per kind: " + "; ".join(
            f"{kind} {value} {e['decode_median_abs_pct_error']:.1f}% ({e['trials']} trials)"
            for kind, values in by.items() for value, e in values.items()
            if e.get("decode_median_abs_pct_error") is not None))
    if r.test is not None:
        t = r.test["summary"]
        lines.append(f"separate test set {r.test['source']} ({t['trials']} trials, factors fitted on the runs above): "
                     f"decode median abs error {t['decode_median_abs_pct_error']:.1f}%, Spearman "
                     f"{_rho(t['decode_spearman'])}; TTFT {t['ttft_median_abs_pct_error']:.1f}%; hit rate "
                     f"{_pts(t['hit_rate_median_abs_error_points'])} points")
    lines.append("factors (fitted on all trials): " + ", ".join(f"{k} {v:.3g}" for k, v in c["factors"].items()))
    lines.append(f"stored in {r.profile} under \"cost_model\"")
    return "\n".join(lines)
