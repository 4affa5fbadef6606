"""benchmarks/tuning/lossy_tune.py: its flags become the tune a user would run (the long-context front
needs tune's --min-ctx and --prompts passed through, not dropped)."""

from __future__ import annotations

import pytest

from benchmarks.tuning import lossy_tune
from engine.base.errors import ConfigError
from tuner.search.study import TuneOptions


def test_min_ctx_and_prompts_reach_the_tune(tmp_path):
    prompts = tmp_path / "long.jsonl"
    args = lossy_tune.parse_args(["--model", "demo", "--min-ctx", "16384", "--prompts", str(prompts),
                                  "--ram-budget", "1GiB", "--max-kl", "0.01", "--out", str(tmp_path / "run")])
    opts = lossy_tune.tune_options(args)
    assert opts.min_ctx == 16384 and opts.prompts == str(prompts)
    assert opts.ram_budget == 1 << 30 and opts.lossy.max_kl == 0.01 and opts.out == tmp_path / "run"


def test_without_them_the_tune_keeps_its_own_defaults():
    opts = lossy_tune.tune_options(lossy_tune.parse_args(["--model", "demo"]))
    assert opts.min_ctx == TuneOptions().min_ctx and opts.prompts is None


def test_a_bad_bound_is_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="--quality-tokens 8 must be at least --quality-ctx 16"):
        lossy_tune.tune_options(lossy_tune.parse_args(["--model", "demo", "--quality-tokens", "8",
                                                       "--quality-ctx", "16"]))


def test_prepare_only_needs_levels(capsys):
    with pytest.raises(SystemExit) as exc:
        lossy_tune.parse_args(["--model", "demo", "--prepare-only"])
    assert exc.value.code == 2 and "--prepare-only needs --quant" in capsys.readouterr().err


def test_a_run_that_measured_nothing_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Every level refused (a budget below the plan): tune wrote no lossy.json; the script says so in
    one line and exits 1 instead of a traceback. (The tune itself is replaced by the run directory it
    leaves in that case: one that holds no lossy.json.)"""
    monkeypatch.setattr(lossy_tune, "run_tune", lambda opts: type("Run", (), {"out_dir": tmp_path})())
    assert lossy_tune.main(["--model", "demo", "--max-kl", "0.01", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lossy_tune: error: no lossy.json in {tmp_path}: no level measured a trial"]


def test_front_rounds_reach_the_tune_and_a_negative_count_is_one_line(capsys):
    opts = lossy_tune.tune_options(lossy_tune.parse_args(["--model", "demo", "--front-rounds", "3"]))
    assert opts.front_rounds == 3
    assert lossy_tune.tune_options(lossy_tune.parse_args(["--model", "demo"])).front_rounds == TuneOptions().front_rounds
    with pytest.raises(SystemExit) as exc:
        lossy_tune.parse_args(["--model", "demo", "--front-rounds", "-1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and err[-1].endswith("--front-rounds must be a non-negative integer, got -1")
