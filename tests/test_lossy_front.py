"""The lossy front compares each lossy setting with lossless at the same placement (tuner/search/lossy.py)."""

import optuna

from tuner.search.lossy import QualityBound, front_summary, markdown

PLACE_SLOW = {"io_mode": "buffered", "chunk_size": 1 << 20, "threads": 2}
PLACE_FAST = {"io_mode": "direct", "chunk_size": 4 << 20, "threads": 0}
LOSSLESS_Q = {"kl_mean": 0.0, "top1_agreement": 1.0}


def trial(number, speed, place, quality=LOSSLESS_Q, status="ok", **lossy):
    config = {**place, "kv_dtype": "auto", "top_k_reduction": 0, "expert_threshold": 0.0, **lossy}
    t = optuna.trial.create_trial(value=speed, distributions={}, params={},
                                  user_attrs={"config": config, "decode_tok_s": speed, "quality": quality,
                                              "status": status})
    t.number = number
    return t


def test_a_probe_at_the_slow_placement_is_priced_against_lossless_there():
    # demo at 1 GiB: the baseline (buffered) 4.69, the defaults (direct) 14.8, k-1 probed at the baseline's placement
    trials = [trial(0, 4.69, PLACE_SLOW), trial(1, 14.8, PLACE_FAST),
              trial(2, 6.41, PLACE_SLOW, {"kl_mean": 1e-5, "top1_agreement": 0.99}, top_k_reduction=1),
              trial(3, 13.5, {**PLACE_FAST, "chunk_size": 64 << 10}, {"kl_mean": 5e-4, "top1_agreement": 0.9},
                    kv_dtype="fp8")]
    s = front_summary(trials, QualityBound(max_kl=0.05), None, None)
    by = {p["label"]: p for p in s["points"]}
    assert by["lossless"]["decode_tok_s"] == 14.8 and by["lossless"]["vs_lossless_same_placement"] is None
    assert abs(by["k-1"]["vs_lossless_same_placement"] - 6.41 / 4.69) < 1e-3  # +37%, though off the front
    assert not by["k-1"]["on_front"]
    assert by["fp8 KV"]["vs_lossless_same_placement"] is None  # no lossless trial at its placement
    table = markdown(s)
    assert "| k-1 | 6.41 | +37% |" in table and "| fp8 KV | 13.5 | - |" in table


def test_a_failed_lossless_trial_is_no_comparison():
    failed = trial(0, 0.0, PLACE_SLOW, status="timeout")
    trials = [failed, trial(1, 2.0, PLACE_SLOW, {"kl_mean": 1e-5, "top1_agreement": 0.99}, expert_threshold=0.1)]
    (point,) = front_summary(trials, QualityBound(max_kl=0.05), None, None)["points"]
    assert point["vs_lossless_same_placement"] is None


# --- the front rounds (tuner/search/front_confirm.py): confirmed medians redraw the front ------------

import copy  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from tuner.results.result import RunSummary  # noqa: E402
from tuner.search import front_confirm, lossy  # noqa: E402
from tuner.search.options import TuneOptions  # noqa: E402
from engine.base.errors import ConfigError  # noqa: E402

K1_Q = {"kl_mean": 1e-4, "top1_agreement": 0.99}
KV_Q = {"kl_mean": 2e-4, "top1_agreement": 0.98}
FAR_Q = {"kl_mean": 0.5, "top1_agreement": 0.5}


def issue_trials():
    """Issue 20's shape: lossless searched at many placements (best of many: 128), k-1 and int8 KV
    measured once each at the best one's placement, and a trim far outside the bound."""
    return [trial(0, 90.0, PLACE_SLOW), trial(1, 128.0, PLACE_FAST), trial(2, 101.0, PLACE_FAST),
            trial(3, 70.7, PLACE_FAST, K1_Q, top_k_reduction=1),
            trial(4, 135.0, PLACE_FAST, KV_Q, kv_dtype="int8"),
            trial(5, 300.0, PLACE_FAST, FAR_Q, status="quality_bound", top_k_reduction=2)]


def ran(*speeds, status="ok"):
    return [RunSummary(status=status, wall_seconds=1.0, decode_tok_s=s, decode_samples=[s * 0.95, s * 1.05])
            for s in speeds]


def confirmed_summary(runs_by_label, stopped=None, rounds=2):
    trials = issue_trials()
    summary = front_summary(trials, QualityBound(max_kl=0.01), None, None)
    front, same_place = front_confirm.entries(summary["points"], trials)
    for e in front:
        e.runs = runs_by_label.get(e.label, [])
    done = max((len(e.runs) for e in front), default=0)
    return front_confirm.apply(summary, front, same_place, rounds, done, stopped), front


def test_the_entries_are_the_points_inside_the_bound_and_lossless_at_their_placements():
    trials = issue_trials() + [trial(6, 50.0, PLACE_SLOW, {"kl_mean": 3e-4, "top1_agreement": 0.97},
                                     expert_threshold=0.1)]
    summary = front_summary(trials, QualityBound(max_kl=0.01), None, None)
    front, same_place = front_confirm.entries(summary["points"], trials)
    labels = [e.label for e in front]
    # k-2 (outside the bound) is left out; k-1 and int8 KV share the lossless point's placement
    # (no extra run); the threshold's placement gets lossless measured there, right after it.
    assert labels == ["lossless", "k-1", "int8 KV", "threshold 0.1", "lossless at threshold 0.1's placement"]
    assert same_place == {"k-1": "lossless", "int8 KV": "lossless",
                          "threshold 0.1": "lossless at threshold 0.1's placement"}
    at = front[-1].config
    assert at.lossless and (at.io_mode, at.chunk_size, at.threads) == ("buffered", 1 << 20, 2)
    assert front[1].config.top_k_reduction == 1 and front[1].config.io_mode == "direct"  # its trial's full config


def test_a_point_faster_in_confirmation_moves_onto_the_front_and_a_slower_one_drops_off():
    before = {p["label"]: p for p in front_summary(issue_trials(), QualityBound(max_kl=0.01), None, None)["points"]}
    assert not before["k-1"]["on_front"] and before["int8 KV"]["on_front"]  # the search's picture
    s, _ = confirmed_summary({"lossless": ran(96.0, 100.0), "k-1": ran(130.0, 126.0), "int8 KV": ran(90.0, 94.0)})
    by = {p["label"]: p for p in s["points"]}
    assert by["k-1"]["on_front"] and by["k-1"]["front_figure"] == "confirmed"
    assert by["k-1"]["confirmed"]["decode_tok_s"] == pytest.approx(128.0) and by["k-1"]["confirmed"]["runs"] == 2
    assert by["k-1"]["confirmed"]["decode_min"] == pytest.approx(126.0 * 0.95)
    assert by["k-1"]["decode_tok_s"] == 70.7  # the search figure stays beside it
    assert not by["int8 KV"]["on_front"]  # slower than k-1 and farther from the reference
    assert by["k-1"]["vs_lossless_same_placement_confirmed"] == pytest.approx(128.0 / 98.0, abs=1e-4)
    assert by["k-2"]["front_figure"] == "search" and by["k-2"]["unconfirmed"] == front_confirm.OUTSIDE_BOUND
    assert by["k-2"]["on_front"]  # outside the bound, yet nothing faster: it stays, on its search figure
    table = markdown(s)
    assert "| k-1 | 128 | 120-136 | 2 | 70.7 | +31% |" in table
    assert "| k-2 | 300 (search) | - | - | 300 |" in table


def test_out_of_time_keeps_every_point_on_its_search_figure_marked():
    trials = issue_trials()
    summary = front_summary(trials, QualityBound(max_kl=0.01), None, None)
    expected = copy.deepcopy(summary)
    logged = []

    def measure(config):
        raise AssertionError("no round fits: nothing may be measured")

    s = front_confirm.confirm_front(summary, trials, 2, measure, lambda runs: False, logged.append)
    assert s["front_confirmation"]["rounds_run"] == 0 and s["front_confirmation"]["stopped"].startswith("time budget")
    assert [p["label"] for p in s["points"]] == [p["label"] for p in expected["points"]]
    for p, old in zip(s["points"], expected["points"]):
        assert p["front_figure"] == "search" and p["confirmed"] is None and p["on_front"] == old["on_front"]
        assert p["unconfirmed"] in ("time budget: 0 of 2 rounds run", front_confirm.OUTSIDE_BOUND)
    assert any("no time for round 1 of 2" in line for line in logged)
    assert "time budget: 0 of 2 rounds run" in markdown(s) and "| k-1 | 70.7 (search) |" in markdown(s)


def test_a_point_whose_reruns_all_failed_stands_on_its_search_figure():
    s, _ = confirmed_summary({"lossless": ran(96.0), "k-1": ran(0.0, status="timeout"), "int8 KV": ran(90.0)})
    k1 = next(p for p in s["points"] if p["label"] == "k-1")
    assert k1["front_figure"] == "search" and k1["front_tok_s"] == 70.7 and "timeout" in k1["unconfirmed"]


def test_zero_rounds_leave_the_front_as_it_was():
    trials = issue_trials()
    summary = front_summary(trials, QualityBound(max_kl=0.01), None, None)
    expected = copy.deepcopy(summary)
    s = front_confirm.confirm_front(summary, trials, 0, None, None, None)
    assert s == expected and "front_confirmation" not in s
    assert markdown(s) == markdown(expected) and "| k-1 | 70.7 | +0% |" not in markdown(s)


def test_rounds_alternate_their_order():
    assert front_confirm.round_order(3, 1) == [0, 1, 2]
    assert front_confirm.round_order(3, 2) == [2, 1, 0]
    assert front_confirm.round_order(3, 3) == [0, 1, 2]
    firsts = {front_confirm.round_order(4, r)[0] for r in (1, 2)}
    assert firsts == {0, 3}  # no entry always runs first
    # over a pair of rounds every entry's mean position is the same
    pos = [front_confirm.round_order(4, 1).index(i) + front_confirm.round_order(4, 2).index(i) for i in range(4)]
    assert len(set(pos)) == 1


def test_the_level_merge_uses_each_levels_confirmed_medians(tmp_path):
    """tune --quant: int8 k-1 measured 70.7 in its one search trial against bf16 lossless' 80, but
    confirmed faster (128 vs 78): the merged front and its chosen point follow the confirmed medians."""
    def level(quant, points):
        d = tmp_path / quant
        d.mkdir()
        (d / lossy.SUMMARY_FILE).write_text(json.dumps({
            "bound": {"tokens": 64, "ctx": 32}, "bound_text": "KL mean <= 0.01", "quant": quant, "points": points,
            "chosen": points[0]["label"], "front_confirmation": {"rounds": 2, "rounds_run": 2, "stopped": None}}))
        return d

    def point(label, kl, search, confirmed):
        return {"label": label, "kl_mean": kl, "top1_agreement": 0.99, "within_bound": True, "decode_tok_s": search,
                "front_tok_s": confirmed, "front_figure": "confirmed",
                "confirmed": {"decode_tok_s": confirmed, "decode_min": confirmed, "decode_max": confirmed, "runs": 2}}

    dirs = [level("bf16", [point("bf16, lossless", 0.0, 80.0, 78.0)]),
            level("int8", [point("int8, lossless", 1e-4, 75.0, 110.0), point("int8, k-1", 2e-4, 70.7, 128.0)])]
    merged = lossy.merge_level_fronts(dirs, tmp_path)
    by = {p["label"]: p for p in merged["points"]}
    assert merged["chosen"] == "int8, k-1" and by["int8, k-1"]["on_front"] and by["int8, lossless"]["on_front"]
    assert by["bf16, lossless"]["on_front"]  # closest to the reference
    assert merged["front_confirmation"]["levels"] == ["bf16", "int8"]
    assert json.loads((tmp_path / lossy.SUMMARY_FILE).read_text())["chosen"] == "int8, k-1"
    assert "| int8, k-1 | 128 | 128-128 | 2 | 70.7 |" in markdown(merged)


def test_negative_rounds_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="--front-rounds must be a non-negative integer, got -1"):
        TuneOptions(front_rounds=-1).validate()
