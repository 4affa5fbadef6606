"""The tuner's parts on their own, without subprocesses: judging, ranking, confirmation, the time
budget, the result schema and its printers, progress output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from engine.base.config import EngineConfig
from engine.base.progress import Progress
from tuner.search import confirm, objective
from tuner.search.budget import TimeBudget
from tuner.results.frames import csv_text
from tuner.results.printers import fmt, markdown_table, pct, text_table
from tuner.results.result import ResultError, RunSummary, TrialRecord, TrialResult, TuneResult, is_feasible
from tuner.results.schema import render, schema_documents

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BUDGET = 512 * MiB


def ok_run(ids=(1, 2, 3), threads=2, consistent=True, peak=100 * MiB, limited=True, decode=5.0) -> TrialResult:
    metrics = {"decode_tok_s": decode, "ttft_s": 0.5, "output_ids": list(ids), "threads": threads,
               "tokens_consistent": consistent, "peak_rss_bytes": peak, "hit_rate": {"ram": 0.25},
               "plan": {"cache_bytes": 7}, "runs": [{"decode_tok_s": decode - 1, "ttft_s": 0.4},
                                                    {"decode_tok_s": decode + 1, "ttft_s": 0.6}]}
    return TrialResult("ok", metrics=metrics, cgroup_limited=limited, wall_seconds=1.5)


# --- judging ----------------------------------------------------------------------------------

def test_judge_grades_every_failure_and_accepts_a_clean_run():
    oom = TrialResult("oom_killed", error="killed", cgroup_peak_bytes=BUDGET + BUDGET // 2)
    assert objective.judge(oom, BUDGET, BUDGET, None) == ("oom_killed", 0.55, "killed")
    # Without a measured peak the limit stands in: just over the line, the smallest grade.
    assert objective.judge(TrialResult("oom_killed"), BUDGET, BUDGET, None)[:2] == ("oom_killed", 0.05)
    assert objective.judge(TrialResult("timeout", error="t"), BUDGET, BUDGET, None) == ("timeout", 0.05, "t")
    # The kind is the record's, whatever the message says (no matching of error text).
    assert objective.judge(TrialResult("over_budget", error="x"), BUDGET, BUDGET, None)[:2] == ("over_budget", 0.05)
    assert objective.judge(TrialResult("crashed", error="does not fit the memory budget"), BUDGET, BUDGET,
                           None)[:2] == ("crashed", 0.5)
    assert objective.judge(TrialResult("killed", error="SIGTERM"), BUDGET, BUDGET, None)[:2] == ("killed", 0.5)
    assert objective.judge(ok_run(consistent=False), BUDGET, BUDGET, None)[:2] == ("tokens_inconsistent", 1.0)
    assert objective.judge(ok_run(ids=(9, 9)), BUDGET, BUDGET, [1, 2, 3])[:2] == ("tokens_changed", 1.0)
    # No cgroup: the process's own peak is the only budget check there is.
    status, constraint, error = objective.judge(ok_run(peak=BUDGET * 2, limited=False), BUDGET, BUDGET, None)
    assert (status, constraint) == ("over_budget", 1.0) and "peak RSS" in error
    assert objective.judge(ok_run(peak=BUDGET * 2, limited=True), BUDGET, BUDGET, [1, 2, 3]) == ("ok", 0.0, "")


def test_objective_values_and_the_record_of_a_trial():
    m = ok_run().metrics
    assert objective.objective_values("decode", m, 60) == [5.0]
    assert objective.objective_values("both", m, 60) == [5.0, 0.5]
    assert objective.objective_values("ttft", {"ttft_s": None}, 60) == [60.0]
    assert objective.worst_values("both", 30) == [0.0, 30.0]
    rec = objective.record(ok_run(), role="search", worker="w", config={"threads": 2}, status="ok", constraint=0.0,
                           error="")
    attrs = rec.to_attrs()
    assert attrs["decode_tok_s"] == 5.0 and attrs["hit_rate_ram"] == 0.25 and attrs["plan_cache_bytes"] == 7
    assert attrs["metrics"]["threads"] == 2 and "error" not in attrs and is_feasible(attrs)
    assert TrialRecord.from_attrs(attrs).figures.decode_tok_s == 5.0
    plan = objective.not_launched(role="search", worker="w", config={}, overshoot=BUDGET // 4, budget=BUDGET,
                                  message="too small").to_attrs()
    assert plan["constraint"] == 0.25 and plan["status"] == "over_budget_plan" and "metrics" not in plan
    assert not is_feasible(plan)


# --- ranking and confirmation -------------------------------------------------------------------

DIST = {"x": CategoricalDistribution(["a", "b", "c", "d", "e"])}


def trial(number, x, values, status="ok", constraint=0.0):
    t = create_trial(params={"x": x}, distributions=DIST, values=values,
                     user_attrs={"status": status, "constraint": constraint})
    t.number = number
    return t


def test_ranking_both_objectives_puts_the_pareto_front_first():
    trials = [trial(0, "a", [5.0, 1.0]), trial(1, "b", [4.0, 0.5]), trial(2, "c", [3.0, 2.0]),
              trial(3, "d", [9.0, 9.0], status="oom_killed", constraint=0.1), trial(4, "e", [6.0, 3.0])]
    ttft = [trial(0, "a", [1.0]), trial(1, "b", [0.5]), trial(2, "c", [2.0], status="timeout", constraint=0.05)]
    assert [t.number for t in confirm.ranked(ttft, "ttft")] == [1, 0]
    assert [t.number for t in confirm.ranked([trial(0, "a", [1.0]), trial(1, "b", [3.0])], "decode")] == [1, 0]
    # 2 is dominated by 0 (slower and later); the infeasible 3 is never ranked.
    assert [t.number for t in confirm.ranked(trials, "both")] == [4, 0, 1, 2]
    assert confirm.dominates(trials[0], trials[2]) and not confirm.dominates(trials[0], trials[1])


def contender(label, runs_ids, decode, threads=2):
    c = confirm.Contender(label, None, "search", EngineConfig(), None)
    for ids, d in zip(runs_ids, decode):
        summary, out = confirm.run_summary(ok_run(ids=ids, threads=threads, decode=d))
        c.runs.append(summary)
        c.output_ids.append(out)
    return c


def test_decide_disqualifies_changed_tokens_and_picks_the_fastest_median():
    fast_wrong = contender("trial 1", [(7, 7)], [50.0])
    fast_other_threads = contender("trial 2", [(8, 8)], [20.0], threads=4)
    good = contender("trial 3", [(1, 2, 3), (1, 2, 3)], [10.0, 12.0])
    base = contender("baseline", [(1, 2, 3)], [8.0])
    d = confirm.decide([fast_wrong, fast_other_threads, good, base], rounds=2, objective="decode")
    assert "differ from the baseline" in fast_wrong.disqualified
    assert fast_other_threads.disqualified is None and "thread count differs" in fast_other_threads.note
    assert d.winner is fast_other_threads
    assert good.confirmed.decode_tok_s == 11.0 and good.confirmed.measurements == 2
    # the spread is over every repeat of every run: 9..13 from runs of 10 and 12 (repeats at -1/+1)
    assert (good.confirmed.decode_min, good.confirmed.decode_max, good.confirmed.samples) == (9.0, 13.0, 4)
    failed = confirm.Contender("trial 4", None, "search", EngineConfig(), None)
    summary, ids = confirm.run_summary(TrialResult("crashed", error="boom"))
    failed.runs.append(summary)
    failed.output_ids.append(ids)
    confirm.decide([failed, contender("baseline", [(1,)], [1.0])], 1, "decode")
    assert failed.disqualified == "crashed in confirmation: boom" and failed.confirmed is None


def test_confirm_runs_a_second_round_only_when_time_allows():
    entries = [contender("trial 1", [], []), contender("baseline", [], [])]
    measured = []

    def measure(config):
        measured.append(config)
        return ok_run()

    assert confirm.confirm(entries, 3, measure, room_for_round=lambda runs: False, log=lambda m: None) == 1
    assert len(measured) == 2 and all(len(e.runs) == 1 for e in entries)
    assert confirm.confirm(entries, 2, measure, room_for_round=lambda runs: runs == 2, log=lambda m: None) == 2
    assert len(measured) == 6


def test_time_budget_keeps_room_for_the_confirmation_round():
    clock = TimeBudget(seconds=100.0, confirm_top=5)
    assert clock.room_for_trial() and clock.trial_timeout() == 600.0
    clock.record(10.0)
    clock.record(30.0)
    assert clock.est_trial_s() == 20.0 and clock.trial_timeout() == 100.0
    # reserve: at most 3 candidates plus the engine's defaults and the baseline, 20 s each; one
    # more trial needs 20 s on top.
    assert clock.confirm_reserve() == 100.0
    clock.t0 -= 5.0
    assert clock.room_for_trial() is False and clock.trials_left() == 0
    assert TimeBudget(seconds=None, confirm_top=0).room_for_trial()
    assert TimeBudget.for_run(None, None, 3, None).seconds == 15 * 60
    assert TimeBudget(None, 3, fixed_trial_timeout=2.5).trial_timeout() == 2.5


def test_time_budget_keeps_room_for_the_fronts_first_round_too():
    clock = TimeBudget(seconds=300.0, confirm_top=3, front_runs=5)  # tune --max-kl with --front-rounds
    clock.record(20.0)
    assert clock.confirm_reserve() == 20.0 * (3 + 2 + 5)
    clock.t0 -= 90.0  # 210 s left: room for the reserve (200 s), not for one more trial on top
    assert clock.room_for_trial() is False and clock.room_for_round(5)


# --- schema and printers ------------------------------------------------------------------------

def test_published_json_schemas_are_current():
    for name, doc in schema_documents().items():
        path = ROOT / "docs" / "schema" / name
        assert path.read_text() == render(doc), f"{path} is stale: run python -m tuner.results.schema"


def test_tune_result_loader_is_strict():
    with pytest.raises(ResultError, match=r"not a colibri.tune/6 \(or colibri.tune/5, colibri.tune/4, colibri.tune/3, colibri.tune/2, "
                                          r"colibri.tune/1\) result"):
        TuneResult.from_dict({"schema": "colibri.tune/0"})
    doc = schema_documents()["tune-result.schema.json"]
    assert doc["properties"]["schema"] == {"enum": ["colibri.tune/6"]}
    assert set(doc["required"]) == set(doc["properties"])
    # Migration fills what was added, not what is missing.
    for schema in ("colibri.tune/6", "colibri.tune/5", "colibri.tune/4", "colibri.tune/3", "colibri.tune/2", "colibri.tune/1"):
        with pytest.raises(ResultError, match="missing key"):
            TuneResult.from_dict({"schema": schema})


def test_a_stored_v1_result_is_read_migrated(tmp_path):
    """tests/fixtures/tune-v1/result.json is a real colibri.tune/1 file of a demo run, written
    before Figures.unconfirmed and RunFigures.prefill_tok_s (and others) existed."""
    from tuner.results.rundir import open_run
    stored = json.loads((ROOT / "tests" / "fixtures" / "tune-v1" / "result.json").read_text())
    assert stored["schema"] == "colibri.tune/1" and "unconfirmed" not in stored["recommended"]["confirmed"]
    assert "prefill_tok_s" not in stored["recommended"]["runs"][0] and "quant" not in stored
    # what the strict /6 reader says of it: the first field /1 lacks (a candidate's /4 quality)
    with pytest.raises(ResultError, match="result.recommended: missing key 'quality'"):
        TuneResult.from_dict({**stored, "schema": "colibri.tune/6", "reproduce": None, "cost_model": None, "quant": None, "quality": None,
                              "defaults": None, "gain_over_defaults": None, "workload": None})

    r = TuneResult.from_dict(stored)
    assert r.schema == "colibri.tune/6" and r.quant is None and r.quality is None
    assert r.defaults is None and r.gain_over_defaults is None and r.study.re_proposals is None
    assert r.recommended.confirmed.unconfirmed is False and r.recommended.runs[0].prefill_tok_s is None
    # Nothing recorded is lost or changed: the migrated dict holds the old one.
    migrated = r.to_dict()
    assert migrated["recommended"]["confirmed"] == {**stored["recommended"]["confirmed"], "unconfirmed": False,
                                                    "request_s": None, "goodput_rps": None, "goodput_min": None,
                                                    "goodput_max": None, "ttft_p95_s": None, "tpot_p95_s": None}
    assert migrated["conditions"] == stored["conditions"]
    assert {k: v for k, v in migrated["study"].items() if k in stored["study"]} == stored["study"]
    assert migrated["study"]["measured_trials"] is None  # not recorded before colibri.tune/3
    assert TuneResult.from_dict(migrated).to_dict() == migrated
    assert stored == json.loads((ROOT / "tests" / "fixtures" / "tune-v1" / "result.json").read_text())

    # Run-directory readers (report, profile export, compare) see the migrated form.
    (tmp_path / "result.json").write_text(json.dumps(stored))
    run = open_run(tmp_path)
    assert run.tune.to_dict() == migrated and run.tune.recommended.confirmed.decode_tok_s == pytest.approx(
        stored["recommended"]["confirmed"]["decode_tok_s"])


def test_run_summary_schema_matches_what_confirm_records():
    summary, ids = confirm.run_summary(ok_run())
    assert isinstance(summary, RunSummary) and ids == [1, 2, 3]
    assert summary.decode_samples == [4.0, 6.0] and summary.hit_rate_ram == 0.25


def test_printers_format_one_way():
    assert fmt(None) == "-" and fmt(1.23456) == "1.23" and fmt(1.23456, 3) == "1.235"
    assert pct(0.1234) == "12.3%" and pct(0.1234, signed=True) == "+12.3%" and pct(None) == "-"
    assert pct(0.5, 0) == "50%"
    assert markdown_table(["a", "b"], [[1, "x"]]) == ["| a | b |", "|---|---|", "| 1 | x |"]
    assert text_table(["name", "GB/s"], [["seq", "1.50"], ["random", "0.25"]], left=1) == [
        "  name    GB/s", "  ------  ----", "  seq     1.50", "  random  0.25"]
    rows = [{"n": 1, "v": 0.5, "s": "", "b": True}, {"n": 2, "v": "", "s": "a,b", "b": ""}]
    text = csv_text(rows, ["n", "v", "s", "b"])
    assert text.splitlines()[0] == "n,v,s,b" and '"a,b"' in text
    back = pd.read_csv(io.StringIO(text), keep_default_na=False)
    assert list(back["n"]) == [1, 2] and list(back["s"]) == ["", "a,b"]


# --- progress -----------------------------------------------------------------------------------

class _Pipe(io.StringIO):
    def isatty(self):
        return False


def test_progress_into_a_pipe_is_a_few_whole_lines():
    stream = _Pipe()
    with Progress(total=1000, desc="synth tiny", unit="B", unit_scale=True, stream=stream) as bar:
        for _ in range(1000):
            bar.update(1)
    lines = stream.getvalue().splitlines()
    assert 1 <= len(lines) <= 3 and "\r" not in stream.getvalue()
    assert "synth tiny" in lines[-1] and "100%" in lines[-1]
    steps = _Pipe()
    with Progress(desc="probe", unit="step", stream=steps) as bar:
        for i in range(1, 6):
            bar.step(i, 5, f"job {i}")
    assert "5/5" in steps.getvalue().splitlines()[-1]
    quiet = _Pipe()
    with Progress(total=10, enabled=False, stream=quiet) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


def test_study_settings_refuse_another_setup(tmp_path):
    from engine.base.errors import ConfigError
    from tuner.search import study_storage as storage
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s")
    storage.check_settings(study, {"budget": 1, "seed": 0})
    storage.check_settings(study, {"budget": 1, "seed": 5})  # another seed joins the same study
    with pytest.raises(ConfigError, match="budget: study has 1, this run 2"):
        storage.check_settings(study, {"budget": 2, "seed": 0})
    assert json.loads(json.dumps(study.user_attrs)) == {"colibri": {"budget": 1, "seed": 0}}
