"""The trials of a study as one pandas table: trials.csv and the report's trial table.

Built from Optuna's own `Study.trials_dataframe()` (its params_* and user_attrs_* columns),
renamed to the documented trials.csv columns, so the CSV, the HTML table and the dashboard
show the same numbers. The nested bench JSON (`metrics`) and the token ids stay in the study.
"""

from __future__ import annotations

PARAM_COLUMNS = ("chunk_size", "prefetch_depth", "cpu_cache_ratio", "gpu_cache_ratio", "threads", "ctx_size",
                 "io_mode", "io_threads", "cache_policy")
# Trial figures copied into their own columns.
METRIC_COLUMNS = ("decode_tok_s", "ttft_s", "prefill_tok_s", "token_latency_p50_ms", "token_latency_p99_ms",
                  "read_gbps", "io_stall_fraction", "lookahead_recall", "bytes_read_per_token", "hit_rate_ram",
                  "peak_rss_bytes", "cgroup_peak_bytes", "plan_cache_bytes")
# Integer columns: pandas turns an integer column with a gap into floats (2 -> 2.0); undo that.
INT_COLUMNS = frozenset({"chunk_size", "prefetch_depth", "threads", "ctx_size", "io_threads", "peak_rss_bytes",
                         "cgroup_peak_bytes", "plan_cache_bytes", "duplicate_of"})
COLUMNS = ("number", "state", "status", "role", "feasible", "constraint", "value", "value2", *PARAM_COLUMNS,
           *METRIC_COLUMNS, "wall_seconds", "duplicate_of", "worker", "error")


def trials_frame(study):
    """One row per trial in trial-number order, with exactly COLUMNS (blank where absent)."""
    import pandas as pd

    raw = study.trials_dataframe(attrs=("number", "state", "value", "params", "user_attrs"), multi_index=False)
    if raw.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    raw = raw.sort_values("number").reset_index(drop=True)

    def col(name):
        return raw[name] if name in raw.columns else pd.Series([None] * len(raw), index=raw.index, dtype=object)

    out = pd.DataFrame(index=raw.index)
    out["number"] = raw["number"]
    out["state"] = raw["state"]
    out["status"] = col("user_attrs_status")
    out["role"] = col("user_attrs_role")
    constraint = col("user_attrs_constraint")
    # A trial without a constraint (killed before it was judged) is neither feasible nor not.
    out["feasible"] = [None if _missing(c) else bool(c <= 0) for c in constraint]
    out["constraint"] = constraint
    if "value" in raw.columns:  # one objective
        out["value"], out["value2"] = raw["value"], None
    else:  # several: Optuna names them values_0, values_1
        out["value"], out["value2"] = col("values_0"), col("values_1")
    for p in PARAM_COLUMNS:
        v = col(f"params_{p}")
        out[p] = v.map(lambda x: round(x, 6) if isinstance(x, float) and not _missing(x) else x)  # step artefacts
    for m in METRIC_COLUMNS:
        out[m] = col(f"user_attrs_{m}")
    out["wall_seconds"] = col("user_attrs_wall_seconds").map(
        lambda x: round(x, 3) if isinstance(x, (int, float)) and not _missing(x) else x)
    for c in ("duplicate_of", "worker", "error"):
        out[c] = col(f"user_attrs_{c}")
    out = out.astype(object).where(out.notna(), None)
    for c in INT_COLUMNS:
        out[c] = pd.Series([int(x) if isinstance(x, float) and x.is_integer() else x for x in out[c]],
                           index=out.index, dtype=object)
    return out[list(COLUMNS)]


def write_trials_csv(study, path) -> None:
    """trials.csv from the frame, atomically (blank cells where a figure is absent)."""
    from engine.config import atomic_write_text
    atomic_write_text(path, trials_frame(study).to_csv(index=False, lineterminator="\n"))


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and x != x)
