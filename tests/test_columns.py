"""The column registry and the flags generated from the dataclasses (issue 24 item 3): a knob is
one field, and its flag, validation, trials.csv column and report column follow from it; a lossy
trial's settings and quality are trials.csv columns (issue 20 item 4)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from engine.base.config import EngineConfig, knob
from engine.base.errors import ConfigError
from colibri.cli import build_parser
from colibri.commands.knob_flags import add_knob_flags, knob_values
from tuner.results.columns import BY_NAME, CONFIG_COLUMNS, QUALITY_COLUMNS, config_from_row
from tuner.results.result import SettingQuality, TuneResult
from tuner.results.frames import trials_csv
from tuner.results.printers import TRIAL_COLUMNS, trial_rows, trials_markdown
from tuner.results.trial_record import RunFigures, TrialRecord
from tuner.search.assemble import setting_quality, with_quality
from tuner.search.options import TuneOptions


def _trial(number, params, config, quality=None, metrics=None, cgroup_peak_bytes=None, **figures):
    dists = {k: CategoricalDistribution((v,)) for k, v in params.items()}
    attrs = TrialRecord(role="search", worker="w", config=config, status="ok", constraint=0.0, wall_seconds=1.5,
                        cgroup_peak_bytes=cgroup_peak_bytes, figures=RunFigures(**figures), metrics=metrics).to_attrs()
    if quality is not None:
        attrs["quality"] = quality
    trial = create_trial(state=TrialState.COMPLETE, params=params, distributions=dists,
                         values=[figures.get("decode_tok_s", 1.0)], user_attrs=attrs)
    trial.number = number
    return trial


LOSSY = EngineConfig(chunk_size=1 << 20, kv_dtype="int8", top_k_reduction=1, expert_threshold=0.05,
                     cache_policy="lfu", cpu_cache_ratio=0.85)
TRIALS = [
    _trial(0, {"chunk_size": 4 << 20}, EngineConfig().to_dict(), decode_tok_s=2.0, ttft_s=0.5,
           metrics={"quant": "none", "quant_scope": None}),
    _trial(1, {"chunk_size": 1 << 20, "kv_dtype": "int8", "top_k_reduction": 1}, LOSSY.to_dict(),
           quality={"kl_mean": 0.004, "kl_p99": 0.05, "top1_agreement": 0.97, "ppl_ratio": 1.01, "measured": True},
           metrics={"quant": "int4-g64", "quant_scope": "experts"}, decode_tok_s=3.0, ttft_s=0.4,
           hit_rate_ram=0.5, cgroup_peak_bytes=300 << 20),
]


def test_every_engine_setting_and_figure_is_a_trials_csv_column():
    assert [c.name for c in CONFIG_COLUMNS] == EngineConfig.field_names()
    assert set(EngineConfig.field_names()) <= set(TRIAL_COLUMNS)
    figures = {f.name for f in dataclasses.fields(RunFigures) if "label" in f.metadata} | {"cgroup_peak_bytes"}
    assert figures <= set(TRIAL_COLUMNS)
    assert {"kl_mean", "top1_agreement", "quant", "quant_scope"} <= set(TRIAL_COLUMNS)


def test_trials_csv_carries_each_trials_lossy_settings_and_quality():
    rows = list(csv.DictReader(io.StringIO(trials_csv(TRIALS))))
    lossless, lossy = rows
    assert (lossy["kv_dtype"], lossy["top_k_reduction"], lossy["expert_threshold"]) == ("int8", "1", "0.05")
    assert (lossy["kl_mean"], lossy["top1_agreement"]) == ("0.004", "0.97")
    assert (lossy["quant"], lossy["quant_scope"]) == ("int4-g64", "experts")
    assert (lossless["kv_dtype"], lossless["kl_mean"], lossless["quant_scope"]) == ("auto", "", "")
    # every setting the row records comes back as the config the trial ran
    assert config_from_row(lossy) == LOSSY
    assert config_from_row(lossless, ram_budget=1 << 30) == EngineConfig(ram_budget=1 << 30)


def test_an_older_trials_csv_without_the_new_columns_still_gives_its_config():
    old = {"chunk_size": "1048576", "prefetch_depth": "2", "cache_policy": "lfu", "io_mode": "buffered"}
    assert config_from_row(old) == EngineConfig(chunk_size=1 << 20, prefetch_depth=2, cache_policy="lfu",
                                                io_mode="buffered")


def test_markdown_trials_table_names_and_formats_from_the_registry():
    header, _, *rows = trials_markdown(TRIALS)
    assert f"| {BY_NAME['chunk_size'].short} |" in header and "KL mean" in header and "same top-1" in header
    assert "k-" in header  # a searched lossy setting gets its column
    assert "| 1MiB |" in rows[1] and "| 50% |" in rows[1] and "97%" in rows[1]


def test_engine_flags_are_generated_from_the_fields():
    run = next(a for a in build_parser()._subparsers._group_actions[0].choices["bench"]._actions
               if a.dest == "top_k_reduction")
    meta = {f.name: f for f in dataclasses.fields(EngineConfig)}["top_k_reduction"].metadata
    assert (run.type.lo, run.type.hi) == (meta["lo"], meta["hi"]) and meta["doc"] in run.help
    args = build_parser().parse_args(["bench", "--model", "m", "--kv-dtype", "int8", "--chunk-size", "1MiB"])
    assert (args.kv_dtype, args.chunk_size, args.prefetch_depth) == ("int8", 1 << 20, None)  # None: not given


def test_validation_follows_the_knob_metadata():
    with pytest.raises(ConfigError, match=r"chunk_size must be in \[4KiB, 1GiB\], got 1"):
        EngineConfig(chunk_size=1)
    with pytest.raises(ConfigError, match=r"expert_threshold must be a number in \[0, 1\), got nan"):
        EngineConfig(expert_threshold=float("nan"))
    with pytest.raises(ConfigError, match="ram_budget must be >= 0, got -1"):
        EngineConfig(ram_budget=-1)


def test_a_new_knob_is_one_field():
    """A throwaway config class with one more knob: its flag (with its range), its validation and
    its column follow from the field alone."""

    @dataclasses.dataclass
    class Extra:
        warmup_tokens: int = knob(0, "tokens decoded before timing", kind="int", lo=0, hi=64, label="warm-up",
                                  short="warmup")

    p = argparse.ArgumentParser()
    add_knob_flags(p, Extra)
    assert knob_values(p.parse_args(["--warmup-tokens", "3"]), Extra) == {"warmup_tokens": 3}
    with pytest.raises(SystemExit):
        p.parse_args(["--warmup-tokens", "65"])


def test_tune_flags_are_generated_from_tune_options():
    args = build_parser().parse_args(["tune"])
    generated = {f.name for f in dataclasses.fields(TuneOptions) if "kind" in f.metadata}
    assert knob_values(args, TuneOptions) == {n: getattr(TuneOptions(), n) for n in generated}
    args = build_parser().parse_args(["tune", "--warm", "--no-cost-model", "--confirm-top", "0", "--time-budget", "5m"])
    opts = TuneOptions(**knob_values(args, TuneOptions))
    assert (opts.cold, opts.cost_model, opts.confirm_top, opts.time_budget) == (False, False, 0, 300.0)


def test_quality_columns_come_from_quality_info():
    assert [c.name for c in QUALITY_COLUMNS] == ["kl_mean", "top1_agreement"]
    assert trial_rows(TRIALS)[1]["kl_mean"] == 0.004


def test_result_json_carries_each_candidates_lossy_quality():
    """colibri.tune/4: a candidate's lossy setting's quality, from its search trial; a /1-/3 file
    reads with none (a lossless search, or not recorded)."""
    stored = json.loads((Path(__file__).parent / "fixtures" / "tune-v1" / "result.json").read_text())
    result = TuneResult.from_dict(stored)
    assert result.schema == "colibri.tune/6" and result.recommended.quality is None
    number = result.recommended.trial_number
    trial = _trial(number, {"kv_dtype": "int8"}, LOSSY.to_dict(), decode_tok_s=3.0,
                   quality={"kl_mean": 0.004, "kl_p99": 0.05, "top1_agreement": 0.97, "ppl_ratio": 1.0})
    with_quality(result.recommended, setting_quality([trial, TRIALS[0]]))
    data = result.to_dict()
    assert data["recommended"]["quality"] == {"kl_mean": 0.004, "kl_p99": 0.05, "top1_agreement": 0.97}
    assert TuneResult.from_dict(data).recommended.quality == SettingQuality(0.004, 0.05, 0.97)
