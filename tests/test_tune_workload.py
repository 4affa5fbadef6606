"""Issue 43: the steady-decoding workload, the command that reproduces a tune's figure, and the
cost model's warm starts gated by its known error.

Behaviour only: token ids, hashes, counts and bytes, never a timing threshold.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from engine.api import EngineConfig, counted_prompts, degenerate, prompt_lengths, steady_requests
from colibri_tiny import make_tiny, read_header, write_header
from colibri_tune_fixtures import BUDGET, ROOT, SMALL_CTX

PY = sys.executable


def bench_json(*args: str) -> dict:
    out = subprocess.run([PY, "-m", "colibri.cli", "bench", *args, "--json"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --- the degenerate-loop detector -------------------------------------------------------------

def test_detector_on_crafted_sequences():
    assert degenerate([5] * 16) == {"period": 1, "from": 0}
    assert degenerate([1, 2, 3, 4] + [7, 8, 9] * 6)["period"] == 3
    assert degenerate(list(range(20))) is None
    assert degenerate([3] * 6) is None  # too short to call a loop
    # a loop that starts late is still found once it holds the second half
    assert degenerate(list(range(10)) + [4, 2] * 8)["period"] == 2


def test_looping_prompts_are_left_out_of_the_figure():
    prompts = [{"decode_tok_s": 10.0, "degenerate": None}, {"decode_tok_s": 90.0, "degenerate": {"period": 1}},
               {"decode_tok_s": 12.0, "degenerate": None}]
    assert [p["decode_tok_s"] for p in counted_prompts(prompts)] == [10.0, 12.0]
    everything_loops = [dict(p, degenerate={"period": 1}) for p in prompts]
    assert counted_prompts(everything_loops) == everything_loops


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory) -> Path:
    """A tiny model whose final norm is zero: every logit is 0, so greedy decoding repeats token 0
    forever (the same experts every step, as in issue 43) while sampling draws uniformly."""
    d = make_tiny(tmp_path_factory.mktemp("looping") / "m")
    path = d / "model.safetensors"
    header, data = read_header(path)
    lo, hi = header["model.norm.weight"]["data_offsets"]
    write_header(path, header, data[:lo] + bytes(hi - lo) + data[hi:])
    return d


def test_greedy_loop_detected_reported_and_sampling_avoids_it(looping_model):
    common = ("--model", str(looping_model), "--steady", "3", "--tokens", "16", "--prompt-tokens", "6",
              "--repeats", "1", "--ctx-size", "64")
    greedy = bench_json(*common, "--temperature", "0")
    assert greedy["workload"]["degenerate"] == 3 and greedy["workload"]["all_degenerate"] is True
    assert all(p["degenerate"] == {"period": 1, "from": 0} for p in greedy["prompts"])
    assert set(greedy["output_ids"]) == {0}
    sampled = bench_json(*common)
    assert sampled["workload"]["degenerate"] == 0 and len(sampled["runs"]) == 3
    # the same prompts either way: only the sampler differs
    assert sampled["workload"]["sha256"] == greedy["workload"]["sha256"]


# --- the steady workload ----------------------------------------------------------------------

def test_steady_prompts_differ_in_length_and_seed():
    assert prompt_lengths(3, 8) == [4, 8, 12]
    a = steady_requests(300, 3, 8, 16, seed=0)
    b = steady_requests(300, 3, 8, 16, seed=1)
    assert [len(r.prompt_ids) for r in a] == [4, 8, 12] and a != b
    assert len({r.prompt_ids for r in a + b}) == 6  # seed 1's prompts are not seed 0's shifted
    assert steady_requests(300, 3, 8, 16, seed=0) == a


def test_steady_figure_does_not_depend_on_the_prompt_seed(model_dir):
    """Seeds 0-2 draw different prompts; each figure measures the same thing (the same tokens
    counted per prompt) and each seed's bytes read per token lies within the other seeds' spread
    over prompts: the figure is the workload's, not one prompt's."""
    runs = [bench_json("--model", str(model_dir), "--steady", "3", "--tokens", "24", "--prompt-tokens", "8",
                       "--seed", str(seed), "--repeats", "1", "--ctx-size", str(SMALL_CTX)) for seed in (0, 1, 2)]
    assert len({r["workload"]["sha256"] for r in runs}) == 3
    assert {r["measured_tokens"] for r in runs} == {24 - 6 - 1}  # decode steps after the warm quarter
    assert all(r["tokens_consistent"] and r["workload"]["degenerate"] == 0 for r in runs)
    per_prompt = [p["bytes_read_per_token"] for r in runs for p in r["prompts"]]
    lo, hi = min(per_prompt), max(per_prompt)
    for r in runs:
        assert lo <= r["bytes_read_per_token"] <= hi
        assert r["summary"]["decode_tok_s"]["n"] == 3  # the spread is over the prompts


def test_steady_tokens_sized_from_the_cache_cycle():
    from tuner.search.workload import MAX_STEADY_TOKENS, MIN_STEADY_TOKENS, cycle_tokens
    plan = SimpleNamespace(routed_experts=16 * 64, cache_slots=400)  # demo-like: 16 MoE layers, 64 experts
    assert cycle_tokens(plan, top_k=8, experts=64) == pytest.approx(400 / 128)
    assert cycle_tokens(SimpleNamespace(routed_experts=0, cache_slots=0), 8, 64) is None
    from tuner.search.workload import steady_tokens

    def facts(slots, top_k=8):
        plan = SimpleNamespace(routed_experts=16 * 64, cache_slots=slots)
        return SimpleNamespace(has_experts=True, geometry={"top_k": top_k, "experts": 64}, plan=lambda c, o: plan)
    assert steady_tokens(facts(400), 1 << 30, 0) == (MIN_STEADY_TOKENS, 3.12)  # 4 cycles = 13: the floor
    assert steady_tokens(facts(640), 1 << 30, 0) == (20, 5.0)  # 4 cycles of 5 tokens
    assert steady_tokens(facts(10_000), 1 << 30, 0)[0] == 32  # the whole model fits: one pass over it is a cycle
    assert steady_tokens(facts(1_000, top_k=1), 1 << 30, 0)[0] == MAX_STEADY_TOKENS  # 62 tokens a cycle: the ceiling


# --- the command that reproduces the report ---------------------------------------------------

@pytest.fixture(scope="module")
def tuned(model_dir, profile_path, tmp_path_factory):
    from tuner.search.study import TuneOptions, run_tune
    out = tmp_path_factory.mktemp("tune-reproduce") / "run"
    opts = TuneOptions(model=str(model_dir), ram_budget=BUDGET, min_ctx=SMALL_CTX, out=out,
                       profile=str(profile_path), seed=0, trials=3, confirm_top=1, confirm_rounds=1)
    return run_tune(opts, log=lambda m: None)


def test_printed_command_measures_what_the_report_measured(tuned):
    r, out = tuned.tune, tuned.out_dir
    rep = r.reproduce
    assert r.workload.kind == "steady" and r.conditions.repeats == 1
    assert rep.command and rep.workload_sha256 == r.workload.sha256
    # printed where a user reads the figure
    assert rep.command in (out / "report.md").read_text()
    assert rep.command in (out / "recommended.toml").read_text()
    argv = shlex.split(rep.command)
    assert argv[:2] == ["colibri", "bench"] and str((out / "recommended.toml").resolve()) in argv
    got = bench_json(*argv[2:])
    from tuner.results.reproduce import ids_digest
    assert got["workload"]["sha256"] == rep.workload_sha256  # the same prompts' token ids
    assert ids_digest(got["output_ids"]) == rep.output_sha256  # the same tokens generated
    assert len(got["output_ids"]) == rep.generated_tokens
    assert got["bytes_read_per_token"] == pytest.approx(rep.bytes_read_per_token)
    assert got["config"] == {**got["config"], **r.recommended.config}
    assert got["tokens"] == r.workload.max_new_tokens.total and got["repeats"] == r.conditions.repeats


def test_profile_and_compare_know_the_workload(tuned):
    from tuner.results.reproduce import entry_command
    from tuner.share.compare import BLOCKING, Item, differences
    from tuner.share.profiles import entry_from_run
    from tuner.results.rundir import open_run
    entry = entry_from_run(open_run(tuned.out_dir))
    command = entry_command(entry)
    assert "--steady 3" in command and "--config CONFIG.toml" in command
    other = json.loads(json.dumps(entry))
    other["workload"] = {"kind": "fixed", "requests": 1, "prompt_tokens": {"min": 8, "median": 8, "max": 8, "total": 8},
                         "max_new_tokens": {"min": 8, "median": 8, "max": 8, "total": 8}, "sha256": None}
    items = [Item("a", "a", {}, entry), Item("b", "b", {}, other)]
    assert "workload" in differences(items, BLOCKING)
    assert "workload" not in differences([items[0], Item("c", "c", {}, entry)], BLOCKING)


def test_every_trial_carries_a_prediction_and_the_run_its_error(tuned):
    cm = tuned.tune.cost_model
    assert cm is not None and cm.calibrated is False and cm.warm_starts == 0
    assert "not calibrated" in cm.warm_start_note
    assert cm.trials >= 1 and cm.median_abs_pct_error is not None
    assert set(cm.by_io_mode) <= {"direct", "buffered", "mmap"}
    assert "Cost model vs measured" in (tuned.out_dir / "report.md").read_text()


# --- warm starts only where the cost model's error is known -----------------------------------

SECTION = {"factors": {"eta_io": 1.0},
           "held_out_by_kind": {"io_mode": {"direct": {"trials": 6, "decode_median_abs_pct_error": 9.0},
                                            "buffered": {"trials": 4, "decode_median_abs_pct_error": 60.0}},
                                "cache_policy": {"lru": {"trials": 10, "decode_median_abs_pct_error": 12.0}}}}


def test_trust_needs_a_known_small_error_per_io_mode_and_policy():
    from tuner.costmodel.calibrated_facts import calibrated_modes, calibration_text, trusted
    assert trusted(SECTION, EngineConfig(io_mode="direct")) == (True, "")
    ok, why = trusted(SECTION, EngineConfig(io_mode="mmap"))
    assert not ok and "io_mode mmap: 0 calibration trial(s)" in why
    assert not trusted(SECTION, EngineConfig(io_mode="buffered"))[0]  # known, but 60% off
    assert not trusted(SECTION, EngineConfig(io_mode="direct", cache_policy="lfu"))[0]
    assert not trusted({}, EngineConfig())[0]
    assert calibrated_modes(SECTION) == ["buffered", "direct"]
    text = calibration_text(SECTION)
    assert "direct (6 trials" in text and "not mmap" in text
    assert "never calibrated" in calibration_text({})


def test_warm_start_skipped_for_an_io_mode_without_calibration(monkeypatch):
    from tuner.search import warm_start
    predicted = [SimpleNamespace(config=EngineConfig(io_mode=m, ram_budget=BUDGET),
                                 prediction=SimpleNamespace(decode_tok_s=10.0)) for m in ("mmap", "direct", "mmap")]
    monkeypatch.setattr(warm_start, "study_warm_starts", lambda *a, **k: predicted)
    monkeypatch.setattr(warm_start, "run_conditions", lambda run: None)
    queued, lines = [], []
    study = SimpleNamespace(enqueue_trial=lambda params, **kw: queued.append(params))
    space = SimpleNamespace(params_of=lambda c: {"io_mode": c.io_mode}, baseline=lambda: EngineConfig())
    session = SimpleNamespace(opts=SimpleNamespace(trials=None), profile=SimpleNamespace(cost_model=SECTION),
                              space=space, model_dir=None, log=lines.append)
    state = {}
    warm_start.enqueue_predicted(session, study, queued=2, state=state)
    assert queued == [{"io_mode": "direct"}]
    assert state["warm_starts"] == 1 and "io_mode mmap" in state["note"]
    assert any("skipped: io_mode mmap" in line for line in lines)
    # an uncalibrated profile: nothing enqueued at all
    queued.clear()
    session.profile = SimpleNamespace(cost_model={})
    warm_start.enqueue_predicted(session, study, queued=2, state=state)
    assert queued == [] and "not calibrated" in state["note"]


def test_calibration_keeps_errors_per_kind():
    from tuner.costmodel.fit import errors_by_kind
    rows = [{"config": EngineConfig(io_mode=m), "predicted_decode": p, "measured_decode": 10.0}
            for m, p in (("direct", 11.0), ("direct", 9.0), ("mmap", 20.0))]
    by = errors_by_kind(rows)
    assert by["io_mode"]["direct"] == {"trials": 2, "decode_median_abs_pct_error": 10.0}
    assert by["io_mode"]["mmap"]["decode_median_abs_pct_error"] == 100.0
    assert by["cache_policy"]["lru"]["trials"] == 3
