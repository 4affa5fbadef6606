"""`colibri tune` on the tiny preset with a few short trials: the whole flow, resume after an
interrupt, infeasible trials (plan, OOM, timeout), warm start, outputs, bad arguments.

Trials are real `colibri bench` subprocesses (2 decode tokens, 1 repeat). min_ctx 32768 makes the
ctx_size choices 32K/64K/128K positions, whose KV cache (1 KiB per position on tiny) and prefill
charge decide whether a config fits 512 MiB next to the ~310-375 MiB trial process: the pre-check
then has real work to do.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState

from engine.base.config import EngineConfig
from engine.base.errors import BudgetError, ConfigError, ModelFormatError
from engine.base.heap import NATIVE_CACHE_BYTES
from colibri import cli
from tuner.base import interrupts
from tuner.results.result import TuneResult
from tuner.sandbox import detect_memory_cgroup
from tuner.search.space import CHUNK_SIZES, IO_THREADS, SearchSpace
from tuner.search.study import TuneOptions, parse_duration, redact_url, run_tune

from colibri_sync import completed_trials, wait_until
from colibri_tune_fixtures import BUDGET, MIN_CTX, MiB, ROOT, SMALL_CTX
from colibri_requirements import needs


def options(model_dir, profile_path, out, **kw) -> TuneOptions:
    base = dict(model=str(model_dir), ram_budget=BUDGET, min_ctx=MIN_CTX, tokens=2, repeats=1, prompt_tokens=8,
                out=Path(out), profile=str(profile_path), seed=0, confirm_top=0, trials=3)
    base.update(kw)
    return TuneOptions(**base)


def reuse_calibration(src: Path, dst: Path) -> None:
    """The calibration run (baseline once + routing histogram) is a per-run-directory cache keyed
    by model and budget; copying it spares each test one subprocess."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "calibration.json", dst / "calibration.json")


def load(out: Path) -> optuna.Study:
    names = optuna.study.get_all_study_names(f"sqlite:///{out / 'study.db'}")
    assert len(names) == 1
    return optuna.load_study(study_name=names[0], storage=f"sqlite:///{out / 'study.db'}")


@pytest.fixture(scope="module")
def tuned(model_dir, profile_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("tune-e2e") / "run"
    outcome = run_tune(options(model_dir, profile_path, out, trials=5, confirm_top=2, confirm_rounds=1),
                       log=lambda m: None)
    return outcome


# --- end to end ---------------------------------------------------------------------------------

def test_end_to_end_outputs(tuned, model_dir):
    out, result = tuned.out_dir, tuned.result
    for name in ("recommended.toml", "result.json", "trials.csv", "study.db", "report.md", "report.html",
                 "profile.json", "calibration.json", "routing.json"):
        assert (out / name).is_file(), name
    assert result["schema"] == "colibri.tune/6" and result["quant"] == "fp32" and result["quality"] is None
    assert json.loads((out / "result.json").read_text())["recommended"] == result["recommended"]
    # result.json is exactly the typed schema (docs/schema/tune-result.schema.json): it loads
    # strictly (no unknown, missing or mistyped key) and says the same when written back.
    assert TuneResult.from_dict(json.loads((out / "result.json").read_text())).to_dict() == result
    assert result["conditions"]["cold"] is True
    assert result["conditions"]["tokens"] == 2 and result["conditions"]["repeats"] == 1

    study = load(out)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    # --trials counts measured trials; a re-proposal of a measured point is not one.
    assert len([t for t in trials if t.user_attrs.get("duplicate_of") is None]) == 5
    # Warm start: the rules-of-thumb baseline is trial 0.
    t0 = min(trials, key=lambda t: t.number)
    assert t0.user_attrs["role"] == "baseline"
    assert t0.params["prefetch_depth"] == 2 and t0.params["io_mode"] == "buffered"
    assert t0.params["threads"] == (psutil.cpu_count(logical=False) or 1)
    # Every trial carries its constraint and, when it ran, every metric of the bench JSON.
    for t in trials:
        a = t.user_attrs
        assert t.constraints == {"violation": a["constraint"]}
        if a["status"] == "ok":
            assert a["constraint"] <= 0
            assert t.values[0] == pytest.approx(a["decode_tok_s"])
            assert a["metrics"]["schema"] == "colibri.metrics/1"
            assert a["metrics"]["config"]["ctx_size"] == t.params["ctx_size"]
        elif a["status"] == "over_budget_plan":
            # Pre-checked against the memory plan: recorded infeasible without launching.
            assert a["constraint"] > 0 and t.values == [0.0] and "metrics" not in a
            assert t.params["ctx_size"] > MIN_CTX and "too small" in a["error"]

    rows = (out / "trials.csv").read_text().splitlines()
    assert len(rows) == 1 + len(trials) and rows[0].startswith("number,state,status,role")

    # Confirmation: candidates first, the baseline last; the winner is chosen on the re-measured medians.
    cands = result["candidates"]
    assert cands[-1]["label"] == "baseline" and cands[-1]["runs"]
    assert all(len(c["runs"]) == 1 for c in cands)
    rec = result["recommended"]
    qualified = [c for c in cands if not c["disqualified"]]
    assert rec["confirmed"]["decode_tok_s"] == max(c["confirmed"]["decode_tok_s"] for c in qualified)
    base = result["baseline"]["confirmed"]["decode_tok_s"]
    assert result["gain_over_baseline"] == pytest.approx(rec["confirmed"]["decode_tok_s"] / base - 1.0)

    # The shareable profile now records this geometry's best config.
    prof = json.loads((out / "profile.json").read_text())
    assert prof["best_configs"][-1]["config"] == rec["config"]


def test_recommended_toml_loads_and_runs(tuned, model_dir):
    path = tuned.out_dir / "recommended.toml"
    config = EngineConfig.load(path)
    assert config.to_dict() == tuned.result["recommended"]["config"]
    assert config.ram_budget == BUDGET
    assert path.read_text().startswith("# colibri tune recommendation")
    # As a user would: `colibri run --config recommended.toml`, in a fresh process (the budget
    # counts the process's own memory, so the test process is not the place to run it).
    run = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(model_dir), "--config", str(path),
                          "--prompt-tokens", "4", "--max-new-tokens", "2", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert len(result["output_ids"]) == 2
    assert result["plan"]["streaming"] is True
    assert result["config"] == config.to_dict()


def test_report_and_plots(tuned):
    out = tuned.out_dir
    text = (out / "report.md").read_text()
    assert "Recommended:" in text and "## Confirmation" in text and "## Trials" in text
    for png in ("history.png", "params.png", "confirmation.png"):
        path = out / "plots" / png
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"plots/{png}" in text
    assert not [p for p in out.rglob(".*.tmp")], "atomic writes left temp files"


# --- interrupts and resume ----------------------------------------------------------------------

# Session 1 is interrupted after its first completed trial and session 2 killed after one more
# (each may finish one more before the signal lands); the third resumes to RESUME_TRIALS.
RESUME_TRIALS = 4


def _start(model_dir, profile_path, out, *extra) -> subprocess.Popen:
    argv = [sys.executable, "-m", "colibri.cli", "tune", "--model", str(model_dir), "--ram-budget", "512MiB",
            "--min-ctx", str(SMALL_CTX), "--trials", str(RESUME_TRIALS), "--tokens", "2", "--repeats", "1",
            "--prompt-tokens", "8", "--confirm-top", "0", "--out", str(out), "--profile", str(profile_path),
            "--seed", "3", *extra]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_completed(proc, out: Path, n: int) -> None:
    wait_until(lambda: completed_trials(out / "study.db") >= n, f"{n} completed trial(s)", proc)


def _snapshot(out: Path) -> dict:
    return {t.number: (t.params, t.values, t.user_attrs.get("status"))
            for t in load(out).get_trials(states=(TrialState.COMPLETE,))}


def test_interrupt_then_kill_then_resume_keeps_every_completed_trial(tuned, model_dir, profile_path, tmp_path):
    out = tmp_path / "run"
    reuse_calibration(tuned.out_dir, out)

    # Ctrl-C: the running trial's subprocess is killed, the study is kept, the hint says how to resume.
    proc = _start(model_dir, profile_path, out)
    _wait_for_completed(proc, out, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "--resume" in err and str(out) in err
    after_int = _snapshot(out)
    assert len(after_int) >= 1
    assert not load(out).get_trials(states=(TrialState.RUNNING,))

    # Without --resume the existing study is not silently extended.
    with pytest.raises(ConfigError, match="--resume"):
        run_tune(options(model_dir, profile_path, out, trials=RESUME_TRIALS, seed=3, min_ctx=SMALL_CTX),
                 log=lambda m: None)

    # kill -9 in the middle of a trial: SQLite has committed every finished one.
    proc = _start(model_dir, profile_path, out, "--resume")
    _wait_for_completed(proc, out, len(after_int) + 1)
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    proc.communicate(timeout=60)
    _reap(children, proc.pid)
    after_kill = _snapshot(out)
    assert set(after_int) <= set(after_kill) and len(after_kill) > len(after_int)

    outcome = run_tune(options(model_dir, profile_path, out, trials=RESUME_TRIALS, seed=3, resume=True,
                               min_ctx=SMALL_CTX), log=lambda m: None)
    final = _snapshot(out)
    assert len(final) == RESUME_TRIALS  # completed trials from every session count toward --trials
    for number, record in after_kill.items():
        assert final[number] == record
    # A trial cut short by kill -9 is FAIL (unmeasured), not a fake measurement.
    states = {t.number: t.state for t in load(out).get_trials()}
    assert TrialState.RUNNING not in states.values()
    assert outcome.result["study"]["trials"] == len(states)


def test_a_ctrl_c_swallowed_before_the_search_still_stops_the_tune(tuned, model_dir, profile_path, tmp_path):
    """Python drops a KeyboardInterrupt raised inside a garbage-collector callback (SQLAlchemy's pool has
    one; tuner/base/interrupts.py): here one is swallowed while tune prints its first line, and the
    search must still stop before its first trial instead of running all of them."""
    out = tmp_path / "run"
    reuse_calibration(tuned.out_dir, out)
    lines, handler = [], signal.getsignal(signal.SIGINT)

    def log(line: str) -> None:
        lines.append(line)
        if "completed trial(s) so far" in line:
            try:
                signal.raise_signal(signal.SIGINT)
            except KeyboardInterrupt:
                pass

    with pytest.raises(KeyboardInterrupt):
        run_tune(options(model_dir, profile_path, out, trials=3, seed=5, min_ctx=SMALL_CTX), log=log)
    assert any("interrupted: 0 completed trial(s)" in line and "--resume" in line for line in lines), lines
    assert not load(out).get_trials(states=(TrialState.COMPLETE, TrialState.RUNNING))
    assert signal.getsignal(signal.SIGINT) is handler and not interrupts.interrupted()  # as before the tune


def _reap(pids: list[int], tuner_pid: int) -> None:
    """The killed tuner could not clean up after its trial: end that trial's processes (by pid)
    and remove the empty memory cgroup it was in."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    psutil.wait_procs([p for p in (_proc(pid) for pid in pids) if p], timeout=10)
    support = detect_memory_cgroup()
    if support.available:
        for d in Path(support.path).glob(f"colibri-{tuner_pid}-*"):
            wait_until(lambda: _removed(d), f"removal of the emptied cgroup {d}")


def _removed(directory: Path) -> bool:
    """rmdir; the kernel lets an emptied cgroup go once its last task has exited."""
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


def _proc(pid):
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


# --- infeasible trials --------------------------------------------------------------------------

def test_oom_trials_are_infeasible_and_the_study_goes_on(tuned, model_dir, profile_path, tmp_path):
    # Checked here, not at collection: detecting a cgroup makes (and removes) a child cgroup.
    support = detect_memory_cgroup()
    if not support.available:
        pytest.skip(needs("cgroup", f"an OOM kill needs the trials in a memory cgroup; here: {support.reason}"))
    out = tmp_path / "run"
    reuse_calibration(tuned.out_dir, out)
    # 64 MiB cannot hold python + torch: every trial is OOM-killed inside its cgroup.
    with pytest.raises(BudgetError, match="no configuration ran within the budget"):
        run_tune(options(model_dir, profile_path, out, trials=2, cgroup_limit=64 * MiB, min_ctx=SMALL_CTX),
                 log=lambda m: None)
    trials = load(out).get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.COMPLETE for t in trials)
    for t in trials:
        assert t.user_attrs["status"] == "oom_killed"
        assert t.values == [0.0]
        assert t.constraints["violation"] >= 0.05  # graded, so TPE ranks it among infeasible ones
    assert "oom_killed" in (out / "trials.csv").read_text()
    result = json.loads((out / "result.json").read_text())
    assert result["recommended"] is None and result["study"]["by_status"] == {"oom_killed": 2}


def test_timeouts_are_infeasible_and_warm_start_from_profile(tuned, model_dir, profile_path, tmp_path):
    out = tmp_path / "run"
    reuse_calibration(tuned.out_dir, out)
    recorded = json.loads((tuned.out_dir / "profile.json").read_text())["best_configs"][-1]["config"]
    with pytest.raises(BudgetError):
        run_tune(options(model_dir, profile_path, out, trials=2, trial_timeout=0.5, min_ctx=SMALL_CTX,
                         from_profile=str(tuned.out_dir / "profile.json")), log=lambda m: None)
    trials = sorted(load(out).get_trials(), key=lambda t: t.number)
    assert [t.user_attrs["role"] for t in trials] == ["baseline", "from_profile"]
    for t in trials:
        assert t.state == TrialState.COMPLETE and t.user_attrs["status"] == "timeout"
        assert t.constraints["violation"] > 0 and t.values == [0.0]
    space = SearchSpace(budget=BUDGET, physical_cores=1, logical_cores=psutil.cpu_count() or 1, has_gpu=False,
                        min_ctx=SMALL_CTX, with_pinned=True)
    expected = space.params_of(EngineConfig.from_dict(recorded))
    assert {k: trials[1].params[k] for k in expected if k != "threads"} == \
        {k: v for k, v in expected.items() if k != "threads"}


# --- bad arguments ------------------------------------------------------------------------------

def _cli(capsys, *argv) -> tuple[int, str]:
    rc = cli.main(["tune", *argv])
    return rc, capsys.readouterr().err


def test_budget_too_small_for_the_dense_part(model_dir, tmp_path, capsys):
    rc, err = _cli(capsys, "--model", str(model_dir), "--ram-budget", "64MiB", "--trials", "1",
                   "--out", str(tmp_path / "r"))
    assert rc != 0
    assert err.startswith("colibri tune: error: memory budget 64.0 MiB is too small") and "dense" in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_preset(tmp_path, capsys):
    rc, err = _cli(capsys, "--model", "no-such-preset", "--trials", "1", "--out", str(tmp_path / "r"))
    assert rc != 0 and "no-such-preset" in err and "presets:" in err


@pytest.mark.parametrize("url", ["notadb://x/y", "postgresql://user:s3cret@/db?host=/nonexistent-socket-dir"])
def test_unreadable_storage_url(model_dir, tmp_path, capsys, url):
    rc, err = _cli(capsys, "--model", str(model_dir), "--ram-budget", "512MiB", "--trials", "1",
                   "--out", str(tmp_path / "r"), "--storage", url)
    assert rc != 0 and "cannot open study storage" in err
    assert "s3cret" not in err
    assert len(err.strip().splitlines()) == 1


def test_other_bad_arguments(model_dir, tmp_path, capsys):
    rc, err = _cli(capsys, "--model", str(model_dir), "--time-budget", "ten minutes")
    assert rc != 0 and "cannot parse duration" in err
    rc, err = _cli(capsys, "--model", str(model_dir), "--ram-budget", "512MiB", "--trials", "1", "--resume",
                   "--out", str(tmp_path / "r"))
    assert rc != 0 and "nothing to resume" in err
    rc, err = _cli(capsys, "--model", str(model_dir), "--trials", "0")
    assert rc != 0 and "--trials" in err


# --- the space, without running anything --------------------------------------------------------

def test_space_suggests_within_fixed_ranges_and_baseline_is_a_point_of_it():
    space = SearchSpace(budget=BUDGET, physical_cores=2, logical_cores=4, has_gpu=False, min_ctx=1024)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(30):
        trial = study.ask()
        config = space.suggest(trial)
        assert config.chunk_size in CHUNK_SIZES and config.io_threads in IO_THREADS
        assert 0 <= config.prefetch_depth <= 4 and 0.25 <= config.cpu_cache_ratio <= 1.0
        assert 1 <= config.threads <= 4 and config.ctx_size in (1024, 2048, 4096)
        assert config.cache_policy in ("lru", "lfu") and config.gpu_cache_ratio == 0.0
        assert config.ram_budget == BUDGET
        assert space.params_of(config) == _rounded(trial.params)  # the config maps back onto its point
        study.tell(trial, 1.0)
    base = space.baseline()
    assert (base.prefetch_depth, base.threads, base.io_mode, base.cpu_cache_ratio) == (2, 2, "buffered", 1.0)
    assert "gpu_cache_ratio" in SearchSpace(budget=BUDGET, physical_cores=2, logical_cores=2, has_gpu=True,
                                            min_ctx=1).distributions()


def _rounded(params: dict) -> dict:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in params.items()}


def test_precheck_uses_the_engine_memory_plan(model_dir):
    from tuner.search.space import ModelFacts
    space = SearchSpace(budget=BUDGET, physical_cores=1, logical_cores=1, has_gpu=False, min_ctx=MIN_CTX,
                        model=ModelFacts.read(model_dir), overhead_bytes=300 * MiB)
    fits, overshoot, _ = space.precheck(space.baseline())
    assert fits and overshoot == 0
    fits, overshoot, message = space.precheck(space.baseline().replace(ctx_size=8 * MIN_CTX))
    # KV at 256K positions is 256 MiB on tiny: 300 + 256 + the native matmul caches' bound (charged with
    # a prefill, engine/base/heap.py) + a little > 512 MiB.
    assert not fits and 40 * MiB + NATIVE_CACHE_BYTES < overshoot < 60 * MiB + NATIVE_CACHE_BYTES
    assert "KV cache" in message


def test_helpers():
    assert parse_duration("10m") == 600 and parse_duration("1h30m") == 5400 and parse_duration("45") == 45
    assert parse_duration("90s") == 90
    with pytest.raises(ConfigError):
        parse_duration("soon")
    assert redact_url("postgresql://bob:pw@host:5432/db") == "postgresql://bob:***@host:5432/db"
    with pytest.raises(ModelFormatError):
        from engine.run.resolve import resolve_model
        resolve_model("no-such-preset")
