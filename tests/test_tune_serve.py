"""`colibri tune --objective serve --trace FILE` (issue 39): trials replay a request trace through
serve's scheduler and the study ranks configs by goodput, with max_batch in the space for this
objective only (its choices capped by the memory plan); result.json colibri.tune/6, and a
colibri.tune/5 result read migrated.

Trials are real `colibri bench --trace` subprocesses on the tiny preset; every assertion is on
counts, recorded figures and the ranking rule, never on a timing threshold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from optuna.trial import TrialState

from engine.api import ConfigError, TraceRequest, save_trace
from tuner.costmodel.serve_model import SimRequest, goodput, simulate
from tuner.results.result import RESULT_SCHEMA, TuneResult
from tuner.search.confirm import ranked, serve_order
from tuner.search.model_facts import ModelFacts
from tuner.search.objective import objective_values, worst_values
from tuner.search.space import SearchSpace
from tuner.search.study import TuneOptions, format_outcome, run_tune

from colibri_tune_fixtures import BUDGET, MiB, ROOT, SMALL_CTX

DAY = 86400.0
TRACE = [TraceRequest(0.0, (5, 6, 7, 8), 3), TraceRequest(0.0, (9, 10), 2), TraceRequest(0.0, (11, 12, 13), 3),
         TraceRequest(0.02, (14, 15), 2, n=2)]


def options(model_dir, profile_path, out, trace, **kw) -> TuneOptions:
    base = dict(model=str(model_dir), ram_budget=BUDGET, min_ctx=SMALL_CTX, repeats=1, out=Path(out),
                profile=str(profile_path), seed=0, confirm_top=0, trials=2, objective="serve", trace=None if trace is None else str(trace),
                slo_ttft=DAY, slo_tpot=DAY)
    base.update(kw)
    return TuneOptions(**base)


@pytest.fixture(scope="module")
def served(model_dir, profile_path, tmp_path_factory):
    d = tmp_path_factory.mktemp("tune-serve")
    trace = save_trace(TRACE, d / "burst.jsonl")
    lines: list[str] = []
    outcome = run_tune(options(model_dir, profile_path, d / "run", trace), log=lines.append)
    return outcome, lines


def test_tune_serve_replays_the_trace_and_ranks_by_goodput(served):
    outcome, log = served
    result, out = outcome.result, outcome.out_dir
    assert result["schema"] == RESULT_SCHEMA == "colibri.tune/6"
    assert result["objective"] == "serve" and result["gain_metric"] == "goodput_rps"
    assert TuneResult.from_dict(json.loads((out / "result.json").read_text())).to_dict() == result
    w = result["workload"]
    assert (w["kind"], w["source"], w["requests"], w["sequences"]) == ("trace", "burst.jsonl", 4, 5)
    assert (w["slo_ttft_s"], w["slo_tpot_s"], w["span_s"]) == (DAY, DAY, 0.02)
    assert (out / "trace.jsonl").is_file()  # the tokenized copy every trial replayed
    # max_batch searched, over the choices the plan fits (all of them beside a 256-token context)
    assert result["conditions"]["search_space"]["max_batch"] == [1, 2, 4, 8]
    assert any("no warm start: --objective serve" in line for line in log)  # the cost model abstains, and says so

    trials = sorted(outcome.tune and _study(out).get_trials(states=(TrialState.COMPLETE,)), key=lambda t: t.number)
    assert [t.user_attrs["role"] for t in trials] == ["baseline", "defaults"]
    assert [t.params["max_batch"] for t in trials] == [4, 1]  # the rule of thumb, and the engine's default
    for t in trials:
        a = t.user_attrs
        # max_batch 1 refuses the request of n = 2 (serve's 400): it misses, and the config is still
        # feasible (the tokens compared are those of the n = 1 requests, which every batch runs)
        assert a["status"] == "ok", a.get("error")
        m = a["metrics"]
        met = 4 if t.params["max_batch"] >= 2 else 3
        assert m["trace"]["requests"] == 4 and m["config"]["max_batch"] == t.params["max_batch"]
        assert m["runs"][0]["refused"] == 4 - met
        assert a["slo_met"] == met and t.values == [pytest.approx(a["goodput_rps"])]  # SLOs of a day: all that ran
        assert a["goodput_rps"] == pytest.approx(met / m["makespan_s"])
    # the cost model's goodput beside the measured one, per trial (evidence only), none of its decode figure
    assert all(t.user_attrs.get("predicted_goodput_rps", -1) >= 0 and "predicted_decode_tok_s" not in t.user_attrs
               for t in trials)
    # greedy: the tokens do not depend on the batch (the placement check compares them across trials)
    assert trials[0].user_attrs["output_ids"] == trials[1].user_attrs["output_ids"]
    best = ranked(trials, "serve")[0]
    rec = result["recommended"]
    assert rec["trial_number"] == best.number and rec["config"]["max_batch"] == best.params["max_batch"]
    assert rec["confirmed"]["goodput_rps"] == pytest.approx(max(t.user_attrs["goodput_rps"] for t in trials))
    assert "goodput" in (out / "report.md").read_text() and "goodput" in format_outcome(outcome)
    assert "Goodput (requests of the trace" in (out / "report.html").read_text()
    # the command that measures the headline again replays the run directory's copy against the same SLOs
    assert f"--trace {out / 'trace.jsonl'} --slo-ttft 86400.0 --slo-tpot 86400.0" in result["reproduce"]["command"]
    assert "goodput_rps" in (out / "trials.csv").read_text().splitlines()[0]
    # shared as a profile entry: the goodput, and the trace by hash with the SLOs it was judged against
    from tuner.share import profiles
    from tuner.share.profile_schema import validate_shared
    shared = profiles.export_profile(out)
    entry = validate_shared(shared)[1][-1]
    assert entry["objective"] == "serve" and entry["config"]["max_batch"] == rec["config"]["max_batch"]
    assert entry["figures"]["goodput_rps"] == rec["confirmed"]["goodput_rps"]
    assert entry["workload"] == {"kind": "trace", "requests": 4, "prompt_tokens": w["prompt_tokens"],
                                 "max_new_tokens": w["max_new_tokens"], "sha256": w["sha256"], "slo_ttft_s": DAY,
                                 "slo_tpot_s": DAY, "span_s": 0.02, "sequences": 5}
    assert "serve: goodput" in profiles.entry_line(entry)


def _study(out: Path):
    import optuna
    url = f"sqlite:///{out / 'study.db'}"
    (name,) = optuna.study.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url)


def test_ranking_goodput_then_p95_ttft_then_aggregate():
    class T:
        def __init__(self, n, goodput, p95, agg=None, ok=True):
            self.number, self.values = n, [goodput]
            self.user_attrs = {"status": "ok" if ok else "oom_killed", "constraint": 0.0 if ok else 1.0,
                               "ttft_p95_s": p95, "aggregate_tok_s": agg}
    trials = [T(0, 0.0, 3.0), T(1, 0.0, 1.0), T(2, 0.5, 9.0), T(3, 0.5, 2.0, 10.0), T(4, 0.5, 2.0, 20.0),
              T(5, 9.0, 0.1, ok=False)]
    assert [t.number for t in ranked(trials, "serve")] == [4, 3, 2, 1, 0]
    assert serve_order(None, None, None) > serve_order(0.0, 5.0, None)
    assert objective_values("serve", {"goodput_rps": 0.75, "decode_tok_s": 99.0}, 60) == [0.75]
    assert objective_values("serve", {"goodput_rps": None}, 60) == [0.0] and worst_values("serve", 60) == [0.0]


def test_the_goodput_prediction_simulates_the_scheduler_step_by_step():
    """Decode steps of 0.1 s whatever their rows, 0.01 s per prompt token, two caches: A and B are
    admitted at 0 and prefilled in one pass (their 20 tokens fit one group), C waits for a free cache."""
    reqs = [SimRequest(0.0, 10, 3), SimRequest(0.0, 10, 2), SimRequest(0.0, 10, 2), SimRequest(0.0, 4, 2, n=3)]
    end = simulate(reqs, lambda rows: 0.1, lambda tokens: 0.01 * tokens, max_batch=2, group=256)
    a, b, c, d = reqs
    # step 1: A's and B's prefill together (0.2); step 2: A and B decode together, B finishes (0.3);
    # step 3: C admitted, A decodes and finishes (0.4), C prefilled (0.5); step 4: C decodes (0.6)
    assert (a.admitted, a.firsts, a.lasts) == (0.0, [pytest.approx(0.2)], [pytest.approx(0.4)])
    assert (b.admitted, b.firsts, b.lasts) == (0.0, [pytest.approx(0.2)], [pytest.approx(0.3)])
    assert (c.admitted, c.firsts, c.lasts) == (pytest.approx(0.3), [pytest.approx(0.5)], [pytest.approx(0.6)])
    assert d.refused and end == pytest.approx(0.6)  # n = 3 above max_batch 2: serve's 400
    # TTFT: A 0.2, B 0.2, C 0.5; TPOT: 0.1 each
    assert goodput(reqs, 0.35, 0.12) == pytest.approx(2 / 0.6)  # A and B
    assert goodput(reqs, DAY, DAY) == pytest.approx(3 / 0.6) and goodput(reqs, 0.0, 0.0) == 0.0
    # a group of 15 tokens: A's 10 and B's 10 do not fit one pass, B's prefill follows A's
    reqs = [SimRequest(0.0, 10, 3), SimRequest(0.0, 10, 2)]
    simulate(reqs, lambda rows: 0.1, lambda tokens: 0.01 * tokens, max_batch=2, group=15)
    assert [r.firsts for r in reqs] == [[pytest.approx(0.1)], [pytest.approx(0.3)]]


def test_the_simulated_newcomer_is_prefilled_one_sub_chunk_per_pass_beside_a_running_stream():
    """Groups of 1,024 tokens, decode steps of 0.1 s, 0.01 s per prompt token: A (10 tokens) alone
    takes one pass; B (600 tokens) arrives while A decodes and goes 256, 256, 88 tokens per pass with
    one of A's steps between each (the scheduler's stall_tokens), so A waits at most 2.56 s between
    two tokens and B's first token comes two steps later than from one 600-token pass (stall 0)."""
    for stall, b_first in ((256, 0.2 + 2.56 + 0.1 + 2.56 + 0.1 + 0.88), (0, 0.2 + 6.0)):
        a, b = SimRequest(0.0, 10, 6), SimRequest(0.05, 600, 2)
        simulate([a, b], lambda rows: 0.1, lambda tokens: 0.01 * tokens, max_batch=2, group=1024, stall=stall)
        assert a.firsts == [pytest.approx(0.1)]  # alone: its whole prompt in one pass
        assert b.admitted == pytest.approx(0.1) and b.firsts == [pytest.approx(b_first)]


def test_max_batch_is_searched_for_serve_only_and_capped_by_the_plan(model_dir):
    facts = ModelFacts.read(model_dir)
    kw = dict(budget=BUDGET, physical_cores=2, logical_cores=2, has_gpu=False, model=facts)
    assert "max_batch" not in SearchSpace(min_ctx=SMALL_CTX, **kw).distributions()
    assert SearchSpace(min_ctx=SMALL_CTX, **kw).baseline().max_batch == 1  # the engine's default, unsearched
    small = SearchSpace(min_ctx=SMALL_CTX, serve=True, **kw)
    small.fit_choices()
    assert small.distributions()["max_batch"].choices == (1, 2, 4, 8) and small.baseline().max_batch == 4
    # 64K positions: each sequence's KV cache is 64 MiB on tiny, and 512 MiB beside the trial process
    # holds two of them, not four (the plan's own figures decide it)
    big = SearchSpace(min_ctx=65536, serve=True, **kw)
    lean = big.smallest()
    assert lean.max_batch == 1  # the budget check's leanest config runs one sequence
    fixed = [big.fixed_bytes(lean.replace(max_batch=b)) for b in (1, 2, 4)]
    assert fixed[0] < fixed[1] <= BUDGET < fixed[2]
    big.fit_choices()
    assert big.distributions()["max_batch"].choices == (1, 2)
    assert big.baseline().max_batch == 2  # the rule of thumb (4) capped to what fits
    assert big.params_of(big.baseline())["max_batch"] == 2


def test_serve_options_go_together(model_dir, profile_path, tmp_path):
    trace = save_trace(TRACE, tmp_path / "t.jsonl")
    with pytest.raises(ConfigError, match="--objective serve needs --slo-tpot"):
        options(model_dir, profile_path, tmp_path / "a", trace, slo_tpot=None).validate()
    with pytest.raises(ConfigError, match="--objective serve needs --trace, --slo-ttft, --slo-tpot"):
        options(model_dir, profile_path, tmp_path / "a", None, slo_ttft=None, slo_tpot=None).validate()
    with pytest.raises(ConfigError, match="--trace, --slo-ttft go with --objective serve"):
        options(model_dir, profile_path, tmp_path / "a", trace, objective="decode", slo_tpot=None).validate()
    with pytest.raises(ConfigError, match="--prompts and --trace are two workloads"):
        options(model_dir, profile_path, tmp_path / "a", trace, prompts=str(trace)).validate()
    # a trace the model cannot take is refused before the run directory exists, naming its line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at": 0, "prompt_ids": [1, 300], "max_tokens": 2}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:1: token id 300 is outside the model's vocabulary"):
        run_tune(options(model_dir, profile_path, tmp_path / "b", bad), log=lambda m: None)
    assert not (tmp_path / "b").exists()


def test_a_v5_result_is_read_migrated():
    """tests/fixtures/tune-v5/result.json: a real colibri.tune/5 result, written by main at f57ecc8
    (before the serve objective) for the tiny preset: 2 trials of the fixed workload, one
    confirmation round."""
    from tuner.results.rundir import check_schema_against_content
    stored = json.loads((ROOT / "tests" / "fixtures" / "tune-v5" / "result.json").read_text())
    assert stored["schema"] == "colibri.tune/5" and "goodput_rps" not in stored["recommended"]["confirmed"]
    r = TuneResult.from_dict(stored)
    assert r.schema == "colibri.tune/6" and r.objective == stored["objective"]
    assert r.recommended.confirmed.goodput_rps is None and r.recommended.runs[0].goodput_rps is None
    assert r.workload.slo_ttft_s is None and r.workload.kind == stored["workload"]["kind"]
    migrated = r.to_dict()
    assert migrated["recommended"]["confirmed"] == {**stored["recommended"]["confirmed"], "goodput_rps": None,
                                                    "goodput_min": None, "goodput_max": None, "ttft_p95_s": None,
                                                    "tpot_p95_s": None}
    assert {k: v for k, v in migrated["conditions"].items()} == stored["conditions"]
    assert TuneResult.from_dict(migrated).to_dict() == migrated
    # a /5 file holding a /6 field is mislabelled: refused, naming it
    edited = json.loads(json.dumps(stored))
    edited["recommended"]["confirmed"]["goodput_rps"] = 1.0
    with pytest.raises(Exception, match=r"schema says colibri.tune/5 but it holds candidate.confirmed.goodput_rps "
                                        r"\(added in colibri.tune/6\)"):
        check_schema_against_content(edited, "result.json")
