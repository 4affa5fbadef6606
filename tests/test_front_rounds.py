"""`tune --max-kl ... --front-rounds N` on the tiny model: the front's points re-measured by the
engine in interleaved rounds, their medians in lossy.json and report.md (tuner/search/front_confirm.py).
Nothing is stubbed but the sampler (random) and, for the out-of-time case, the clock's answer."""

from __future__ import annotations

import json
import re

import optuna
import pytest
from optuna.trial import TrialState

from colibri import cli
from tuner.search import front_confirm, lossy
from tuner.search.trial import run_trial

from colibri_tune_fixtures import BUDGET, SMALL_CTX

TEXT = " ".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200))


@pytest.fixture(scope="module")
def front_run(model_dir, profile_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("front-rounds")
    (root / "text.txt").write_text(TEXT)
    out = root / "run"
    code = cli.main(["tune", "--model", str(model_dir), "--ram-budget", str(BUDGET), "--min-ctx", str(SMALL_CTX),
                     "--tokens", "2", "--repeats", "1", "--prompt-tokens", "8", "--out", str(out),
                     "--profile", str(profile_path), "--seed", "0", "--confirm-top", "1", "--confirm-rounds", "1",
                     "--trials", "5", "--sampler", "random", "--no-cost-model", "--max-kl", "50",
                     "--quality-tokens", "64", "--quality-ctx", "32", "--quality-text", str(root / "text.txt"),
                     "--front-rounds", "1"])
    assert code == 0
    return out


def test_lossy_json_holds_each_points_confirmed_figure_beside_its_search_one(front_run):
    summary = json.loads((front_run / lossy.SUMMARY_FILE).read_text())
    fc = summary["front_confirmation"]
    assert (fc["rounds"], fc["rounds_run"], fc["stopped"]) == (1, 1, None)
    inside = [p for p in summary["points"] if p["within_bound"]]
    assert len(inside) >= 3 and any(not lossy.is_lossless(p["setting"]) for p in inside)
    for p in inside:  # every point inside the bound re-measured once, the search figure kept beside it
        assert p["front_figure"] == "confirmed" and p["confirmed"]["runs"] == 1 and p["unconfirmed"] is None
        assert p["front_tok_s"] == p["confirmed"]["decode_tok_s"] > 0 and p["decode_tok_s"] > 0
        if not lossy.is_lossless(p["setting"]):
            assert p["vs_lossless_same_placement_confirmed"] > 0  # lossless re-measured at its placement
    assert [e["statuses"] for e in fc["entries"]] == [["ok"]] * len(fc["entries"])
    lossy.mark_front(summary["points"])  # the front as written is the one the confirmed medians draw
    assert [p["on_front"] for p in json.loads((front_run / lossy.SUMMARY_FILE).read_text())["points"]] == \
        [p["on_front"] for p in summary["points"]]
    report = (front_run / "report.md").read_text()
    assert "| setting | decode tok/s | min-max | runs | search trial |" in report
    assert "the median of 1 of 1 interleaved rounds" in report


def test_out_of_time_after_one_round_stops_cleanly_and_keeps_the_medians(front_run, model_dir):
    """The same run's trials, re-measured by the engine for 2 rounds where the clock has room for
    one: the first round's figures stand, the stop is said and recorded, and the order alternates
    only once a second round runs (here it never does)."""
    url = f"sqlite:///{front_run / 'study.db'}"
    study = optuna.load_study(study_name=optuna.study.get_all_study_names(url)[0], storage=url)
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    bound = lossy.QualityBound(max_kl=50, tokens=64, ctx=32)
    summary = lossy.front_summary(trials, bound, None, None)
    asked, logged = [], []

    def room(runs):
        asked.append(runs)
        return len(asked) == 1

    def measure(config):
        return run_trial(model_dir, config, tokens=2, repeats=1, prompt_tokens=8, seed=0, timeout=300)

    s = front_confirm.confirm_front(summary, trials, 2, measure, room, logged.append)
    fc = s["front_confirmation"]
    assert fc["rounds_run"] == 1 and fc["stopped"] == "time budget: 1 of 2 rounds run"
    assert asked == [len(fc["entries"])] * 2
    assert any("no time for round 2 of 2" in line for line in logged)
    measured = [m.group(1) for line in logged if (m := re.match(r"front round 1/2: \d+/\d+ (.+): ", line))]
    assert measured == [e["label"] for e in fc["entries"]]  # round 1 runs forward
    assert all(p["confirmed"]["runs"] == 1 for p in s["points"] if p["within_bound"])


def test_a_negative_round_count_is_one_line_on_the_cli(capsys):
    assert cli.main(["tune", "--front-rounds", "-1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--front-rounds" in err[0]
