"""Issue 20 items 1, 2, 3, 5: a tune that measures instead of re-proposing, states its gain over
the engine's defaults, keeps per-model facts per model, and runs the user's own prompts.

The stall tests drive a real tune of the tiny model with a stub *sampler* (the input under test:
a sampler that proposes one point forever); every trial is a real `colibri bench` subprocess.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState, create_trial

from colibri_tune_fixtures import BUDGET, MIN_CTX
from engine.base.config import EngineConfig
from engine.base.errors import PromptError
from engine.run.prompts_file import Request, load_workload, read_prompts, workload_digest
from tuner.search import confirm, explore, objective
from tuner.results.result import TuneResult
from tuner.search.study import TuneOptions, run_tune


class ReProposer(optuna.samplers.BaseSampler):
    """Proposes the study's first trial's point, forever: the stalled sampler of issue 20."""

    def infer_relative_search_space(self, study, trial):
        return {}

    def sample_relative(self, study, trial, search_space):
        return {}

    def sample_independent(self, study, trial, name, distribution):
        first = min(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number)
        return first.params[name]


def options(model_dir, profile_path, out, **kw) -> TuneOptions:
    base = dict(model=str(model_dir), ram_budget=BUDGET, min_ctx=MIN_CTX, tokens=2, repeats=1, prompt_tokens=8,
                out=Path(out), profile=str(profile_path), seed=0, confirm_top=1, confirm_rounds=1, trials=4,
                cost_model=False)
    base.update(kw)
    return TuneOptions(**base)


@pytest.fixture(scope="module")
def stalled(model_dir, profile_path, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("tune-stall") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr("tuner.search.study.make_sampler", lambda opts, shared: ReProposer())
    log: list[str] = []
    try:
        outcome = run_tune(options(model_dir, profile_path, out), log=log.append)
    finally:
        mp.undo()
    return outcome, log


# --- 1. no stalled search -----------------------------------------------------------------------

def test_re_proposals_are_not_trials_and_the_search_explores_instead(stalled):
    outcome, log = stalled
    study = outcome.result["study"]
    # Trials 0, 1: the enqueued baseline and defaults. Then the stub re-proposes the baseline:
    # 3 in a row switch to exploration (an unmeasured neighbour, measured: trial 3); from then
    # on each re-proposal is answered with one at once (trial 4 = the 4th measured).
    assert study["measured_trials"] == 4 and study["distinct_points"] == 4
    assert study["re_proposals"] == 4 and study["explored"] == 2
    assert study["trials"] == 8 and study["stop_reason"] == "trials"
    assert 0 < study["measuring_share"] <= 1 and study["measuring_seconds"] > 0
    assert sum("re-proposal" in line and "not measured, not counted" in line for line in log) == 4
    assert any(line.startswith("exploring:") for line in log)
    # The progress line says how the trials split.
    assert any("4 measured (4 distinct points), 4 re-proposal(s) not measured, 2 by exploration" in line
               for line in log if line.startswith("trial 4/4"))

    trials = optuna.load_study(study_name=study["name"], storage=study["storage"]).get_trials()
    re = [t for t in trials if t.user_attrs.get("duplicate_of") is not None]
    assert len(re) == 4 and all(t.user_attrs["duplicate_of"] == 0 and t.params == trials[0].params for t in re)
    assert all(t.values == trials[0].values for t in re)  # the sampler is told the earlier figures
    explored = [t for t in trials if t.user_attrs.get("role") == "explore"]
    assert len(explored) == 2 and all(t.user_attrs.get("duplicate_of") is None for t in explored)
    assert len({objective.point_key(t.params) for t in explored} | {objective.point_key(trials[0].params)}) == 3

    with (outcome.out_dir / "trials.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and sum(r["measured"] == "False" for r in rows) == 4
    assert sorted({r["point"] for r in rows}) == ["0", "1", "2", "3"]
    assert all(r["duplicate_of"] == "0" for r in rows if r["measured"] == "False")


def test_exploration_picks_unmeasured_neighbours_then_converges():
    dists = {"chunk": CategoricalDistribution((1, 2, 4)), "mode": CategoricalDistribution(("a", "b")),
             "depth": IntDistribution(0, 2), "ratio": FloatDistribution(0.5, 1.0, step=0.25)}

    def trial(number, params, value):
        attrs = {"constraint": 0.0, "status": "ok", "decode_tok_s": value}
        return _numbered(create_trial(params=params, distributions=dists, values=[value], user_attrs=attrs), number)

    best = {"chunk": 2, "mode": "a", "depth": 1, "ratio": 0.75}
    done = [trial(0, best, 10.0)]
    seen = set()
    for n in range(1, 8):  # the best point has 7 one-step neighbours
        point, why = explore.exploration_point(done, dists, "decode", seed=0, number=100 + n)
        assert point is not None and "neighbour of the best point (trial #0)" in why
        key = objective.point_key(point)
        assert key not in seen and key != objective.point_key(best)
        assert sum(point[k] != best[k] for k in best) == 1
        seen.add(key)
        done.append(trial(n, point, 1.0))
    point, why = explore.exploration_point(done, dists, "decode", seed=0, number=200)
    assert point is None and "every one-step neighbour of the best point (trial #0) is measured" in why
    # Same study, seed and trial number: the same choice on every worker.
    a = explore.exploration_point(done[:3], dists, "decode", seed=1, number=7)
    b = explore.exploration_point(done[:3], dists, "decode", seed=1, number=7)
    assert a == b

    stall = explore.Stall(threshold=3)
    assert [stall.re_proposed() for _ in range(3)] == [False, False, True]
    stall.measured()
    assert stall.re_proposed() is True  # once exploring, a single re-proposal is enough


def _numbered(frozen, number: int):
    frozen.number = number
    return frozen


# --- 2. honest gains ------------------------------------------------------------------------------

def test_the_confirmation_measures_the_engine_defaults_and_the_headline_gain_is_over_them(stalled):
    outcome, _ = stalled
    r = outcome.result
    TuneResult.from_dict(json.loads((outcome.out_dir / "result.json").read_text()))  # the typed schema
    labels = [c["label"] for c in r["candidates"]]
    assert labels[-2:] == ["defaults", "baseline"]
    assert all(len(c["runs"]) == 1 for c in r["candidates"])  # each re-measured in the round
    want = EngineConfig(ram_budget=BUDGET, ctx_size=max(2048, MIN_CTX)).to_dict()
    assert r["defaults"]["config"] == want and r["defaults"]["trial_number"] == 1  # the enqueued defaults point
    rec, d, b = (r[k]["confirmed"]["decode_tok_s"] for k in ("recommended", "defaults", "baseline"))
    assert r["gain_over_defaults"] == pytest.approx(rec / d - 1.0)
    assert r["gain_over_baseline"] == pytest.approx(rec / b - 1.0)

    from tuner.results.printers import tune_text
    text = tune_text(outcome.tune, {})
    assert "engine defaults: decode" in text and "gain over the engine's defaults (decode_tok_s): " in text
    assert "(over the rules-of-thumb baseline: " in text
    md = (outcome.out_dir / "report.md").read_text()
    assert "vs the engine's defaults" in md and "| engine defaults |" in md
    html = (outcome.out_dir / "report.html").read_text()
    assert "against the engine&#x27;s defaults" in html or "against the engine's defaults" in html
    toml = (outcome.out_dir / "recommended.toml").read_text()
    assert "gain over the engine's defaults" in toml

    from tuner.share.profiles import export_profile
    shared = export_profile(outcome.out_dir)  # validated exactly as `profile import` validates
    entry = shared["best_configs"][-1]
    assert entry["gain_over_defaults"] == pytest.approx(r["gain_over_defaults"])
    assert entry["defaults_figures"]["decode_tok_s"] == pytest.approx(d)
    # the steady workload (the default, issue 43): what `bench --steady` needs travels with the entry
    assert entry["workload"]["kind"] == "steady" and entry["workload"]["sha256"].startswith("sha256:")
    assert entry["workload"]["temperature"] == 1.0 and entry["workload"]["requests"] == 3


def test_decide_ranks_request_latency_lower_first():
    def cont(label, role, request_s):
        c = confirm.Contender(label, None, role, EngineConfig(), None)
        from tuner.results.result import RunSummary
        c.runs = [RunSummary(status="ok", wall_seconds=1.0, decode_tok_s=5.0, ttft_s=0.1, request_s=request_s,
                             tokens_consistent=True, threads=1)]
        c.output_ids = [[1, 2]]
        return c

    entries = [cont("trial 3", "search", 0.9), cont("defaults", "defaults", 0.5), cont("baseline", "baseline", 2.0)]
    d = confirm.decide(entries, 1, "request")
    assert d.winner.label == "defaults" and d.defaults is entries[1]
    assert objective.objective_values("request", {"request_s": 1.5}, 60.0) == [1.5]
    assert objective.worst_values("request", 60.0) == [60.0] and objective.DIRECTIONS["request"] == ["minimize"]


# --- 3. per-model facts stay per model -----------------------------------------------------------

def test_plan_uses_a_profiles_recall_only_for_its_own_geometry(model_dir, tmp_path, capsys):  # noqa: F811
    from tests.test_probe_profile import make_profile
    from colibri.cli import main
    from tuner.costmodel.model_geometry import from_model_dir
    from tuner.costmodel.calibrated_facts import measured_on, recall_for
    from tuner.costmodel.predict import DEFAULT_LOOKAHEAD_RECALL
    from tuner.probe.hardware_profile import save_profile

    tiny = from_model_dir(model_dir).to_dict()
    section = {"schema": "colibri.costmodel/1", "factors": {"eta_io": 1.0, "lookahead_recall": 0.95},
               "measured_on": measured_on(tiny, "tiny", 0.95, "recorded histogram")}
    profile = make_profile()
    profile.cost_model = section
    save_profile(profile, tmp_path / "p.json")

    def plan(model, budget):
        assert main(["plan", "--model", model, "--profile", str(tmp_path / "p.json"), "--budget", budget,
                     "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    here, other = plan(str(model_dir), "400MiB"), plan("glm-5", "24GiB")
    assert here["factors"]["lookahead_recall"] == 0.95 and "measured on this geometry (tiny)" in \
        here["lookahead_recall_source"] and here["profile_routing"] == "recorded histogram"
    assert other["factors"]["lookahead_recall"] == DEFAULT_LOOKAHEAD_RECALL and other["profile_routing"] is None
    assert "published default 0.716" in other["lookahead_recall_source"] and "another geometry" in \
        other["lookahead_recall_source"]
    # A profile calibrated before recall was keyed: its recall is not applied to any model.
    recall, why = recall_for({"factors": {"lookahead_recall": 0.97}}, tiny)
    assert recall == DEFAULT_LOOKAHEAD_RECALL and "names no model geometry" in why
    assert recall_for(None, tiny)[0] == DEFAULT_LOOKAHEAD_RECALL


def test_the_shipped_profile_keys_its_demo_recall_to_the_demo_geometry():
    from tuner.costmodel.model_geometry import resolve
    from tuner.costmodel.calibrated_facts import recall_for
    path = Path(__file__).resolve().parent.parent / "profiles" / "amd-epyc-virtio-2a91f032.json"
    section = json.loads(path.read_text())["cost_model"]
    demo = {"model_type": "qwen3_moe", "layers": 16, "hidden_size": 1024, "experts": 64, "top_k": 8,
            "moe_intermediate_size": 512, "vocab_size": 32000}
    assert recall_for(section, demo)[0] == pytest.approx(0.971875)
    assert recall_for(section, resolve("glm-5").to_dict())[0] == 0.716


# --- 5. the user's workload ----------------------------------------------------------------------

def test_prompts_files_parse_as_lines_or_json_lines(model_dir, tmp_path):  # noqa: F811
    from engine.run.generate import load_tokenizer
    lines = tmp_path / "p.txt"
    lines.write_text("def add(a, b):\n\n   return a + b\n")
    assert read_prompts(lines, 5) == [("def add(a, b):", 5), ("   return a + b", 5)]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "import os", "max_new_tokens": 3}\n{"prompt": "x = 1"}\n')
    assert read_prompts(jsonl, 7) == [("import os", 3), ("x = 1", 7)]
    tok = load_tokenizer(model_dir)
    reqs = load_workload(jsonl, tok, 7)
    assert [r.max_new_tokens for r in reqs] == [3, 7] and all(r.prompt_ids for r in reqs)
    assert reqs[0].prompt_ids == tuple(tok.encode("import os").ids)
    # The digest names the requests, not their text; the same prompts give the same digest.
    assert workload_digest(reqs) == workload_digest(load_workload(jsonl, tok, 7))
    assert workload_digest(reqs) != workload_digest([Request(reqs[0].prompt_ids, 4), reqs[1]])


@pytest.mark.parametrize("content,message", [
    (None, "no such file"),
    ("", "no prompt in the file"),
    ("\n  \n", "no prompt in the file"),
    (b"\xff\xfe abc", "not UTF-8"),
    ('{"prompt": "a"}\nnot json\n', "line 2: not valid JSON"),
    ('{"prompt": "a", "temperature": 1}\n', "line 1: unknown key 'temperature'"),
    ('{"prompt": ""}\n', "\"prompt\" must be a non-empty string"),
    ('{"prompt": "a", "max_new_tokens": 0}\n', "\"max_new_tokens\" must be an integer"),
    ('{"prompt": "a", "max_new_tokens": true}\n', "\"max_new_tokens\" must be an integer"),
    ('{"prompt": "a"}\n["a"]\n', "line 2: expected an object"),
])
def test_bad_prompts_files_are_one_error_line(content, message, tmp_path):
    path = tmp_path / "prompts"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(PromptError, match=message):
        read_prompts(path, 8)


def test_tune_refuses_a_bad_prompts_file_in_one_line(model_dir, tmp_path, capsys):  # noqa: F811
    from colibri.cli import main
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a", "max_new_tokens": -1}\n')
    rc = main(["tune", "--model", str(model_dir), "--ram-budget", "512MiB", "--trials", "1", "--prompts", str(bad),
               "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "line 1" in err and "max_new_tokens" in err
    long = tmp_path / "long.txt"
    long.write_text(" ".join(str(i) for i in range(1500)) + "\n")  # thousands of tokens; tiny has 512 positions
    rc = main(["tune", "--model", str(model_dir), "--ram-budget", "512MiB", "--trials", "1", "--prompts", str(long),
               "--out", str(tmp_path / "run2")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "longer than the model's 512 positions" in err


def test_bench_runs_a_prompts_file(model_dir, tmp_path, capsys):  # noqa: F811
    from colibri.cli import main
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "import os", "max_new_tokens": 3}\n{"prompt": "def f(x):", "max_new_tokens": 2}\n')
    assert main(["bench", "--model", str(model_dir), "--prompts", str(prompts), "--repeats", "2", "--warm",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["requests"] == 2 and r["tokens"] == 5 and r["tokens_consistent"]
    assert len(r["output_ids"]) == 5 and all(run["requests"] == 2 for run in r["runs"])
    run = r["runs"][0]
    assert run["request_s"] > run["ttft_s"] > 0 and r["request_s"] is not None


def test_tune_for_the_users_prompts_and_the_request_objective(model_dir, profile_path, tmp_path):  # noqa: F811
    secret = "the quick brown fox jumps over the lazy dog"
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": secret, "max_new_tokens": 2}) + "\n"
                       + json.dumps({"prompt": "import os\nimport sys", "max_new_tokens": 3}) + "\n")
    out = tmp_path / "run"
    outcome = run_tune(options(model_dir, profile_path, out, trials=2, confirm_top=0, objective="request",
                               prompts=str(prompts)), log=lambda m: None)
    r = outcome.result
    assert r["objective"] == "request" and r["gain_metric"] == "request_s"
    w = r["workload"]
    assert w["kind"] == "prompts" and w["requests"] == 2 and w["max_new_tokens"]["total"] == 5
    assert w["sha256"].startswith("sha256:") and w["source"] == "mine.jsonl"
    # Every trial ran the user's requests (the bench JSON says so), ranked by request latency.
    study = optuna.load_study(study_name=r["study"]["name"], storage=r["study"]["storage"])
    ok = [t for t in study.get_trials() if t.user_attrs.get("status") == "ok"]
    assert ok and all(t.user_attrs["metrics"]["workload"]["sha256"] == w["sha256"] for t in ok)
    assert all(t.values[0] == pytest.approx(t.user_attrs["request_s"]) for t in ok)
    # The routing histogram pinned would pin from was recorded from those prompts.
    cal = json.loads((out / "calibration.json").read_text())
    assert cal["workload"] == w["sha256"] and Path(cal["routing_histogram"]).is_file()
    # The profile entry records which workload, never the prompts' text.
    profile = (out / "profile.json").read_text()
    assert secret not in profile and "quick brown" not in profile
    entry = json.loads(profile)["best_configs"][-1]
    assert entry["workload"]["sha256"] == w["sha256"] and entry["objective"] == "request"
