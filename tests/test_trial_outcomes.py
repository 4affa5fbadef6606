"""Each way a trial can end, provoked for real through `run_trial` (a `colibri bench` subprocess),
and classified from the outcome record and the cgroup, never from stderr text."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from engine.base.config import EngineConfig
from tuner.sandbox import detect_memory_cgroup
from tuner.search.outcome import outcome_of_exception
from tuner.search.trial import run_trial

from colibri_tune_fixtures import MiB
from colibri_requirements import needs

QUICK = dict(tokens=2, repeats=1, prompt_tokens=4, cold=False)
SMALL = EngineConfig(ctx_size=64)


def test_ok_carries_the_bench_results(model_dir):
    res = run_trial(model_dir, SMALL, timeout=300, **QUICK)
    assert res.status == "ok", res
    assert res.metrics["output_ids"] and res.metrics["summary"]["decode_tok_s"]["n"] == 1


def test_over_budget_is_the_memory_plan_refusing(model_dir):
    res = run_trial(model_dir, SMALL.replace(ram_budget=64 * MiB), timeout=300, **QUICK)
    assert res.status == "over_budget", res
    assert "memory budget 64.0 MiB is too small" in res.error


def test_bad_config_is_an_input_error_of_the_trial(model_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
    res = run_trial(bad, SMALL, timeout=300, **QUICK)
    assert res.status == "bad_config", res
    assert "num_attention_heads = 0" in res.error


def test_an_unwritable_output_is_refused_before_the_run(model_dir):
    # Writing the routing histogram where nobody may write (/sys) used to fail after the whole
    # run, as a crash; the path is now checked before anything runs: an input error.
    res = run_trial(model_dir, SMALL, timeout=300, extra_args=["--record-routing", "/sys/colibri-routing.json"],
                    **QUICK)
    assert res.status == "bad_config", res
    assert "--record-routing" in res.error and "/sys" in res.error


def test_an_unexpected_exception_is_a_crash_named_by_its_type():
    outcome = outcome_of_exception(PermissionError(13, "Permission denied"))
    assert outcome.kind == "crashed" and outcome.exception == "PermissionError"
    assert outcome.error.startswith("PermissionError: ")


def test_timeout(model_dir):
    res = run_trial(model_dir, SMALL, timeout=0.5, **QUICK)  # python + torch alone take longer to start
    assert res.status == "timeout" and res.error.startswith("timed out after")


def test_oom_killed_comes_from_the_cgroups_own_counter(model_dir):
    support = detect_memory_cgroup()
    if not support.available:
        pytest.skip(needs("cgroup", f"an OOM kill needs a memory cgroup; here: {support.reason}"))
    res = run_trial(model_dir, SMALL, limit_bytes=64 * MiB, timeout=300, **QUICK)  # python + torch need more
    assert res.status == "oom_killed", res
    assert res.signal == "SIGKILL" and res.cgroup_limited


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killed_by_another_signal_is_not_called_an_oom(model_dir, sig):
    """A SIGKILL from someone else (not the OOM killer) is `killed`, with the signal named."""
    limit = 4096 * MiB if detect_memory_cgroup().available else None  # in a cgroup whose counter stays 0
    results = []
    runner = threading.Thread(target=lambda: results.append(run_trial(model_dir, SMALL, limit_bytes=limit,
                                                                      timeout=300, **QUICK)))
    runner.start()
    victim, deadline = None, time.monotonic() + 120
    while victim is None and time.monotonic() < deadline:  # wait until the bench process exists
        for child in psutil.Process().children(recursive=True):
            try:
                if "bench" in child.cmdline() and "colibri.cli" in child.cmdline():
                    victim = child
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    assert victim is not None, "the trial's bench process never appeared"
    os.kill(victim.pid, sig)
    runner.join(timeout=300)
    (res,) = results
    assert res.status == "killed", res
    assert res.signal == sig.name and "no OOM kill" in res.error


def test_peak_rss_is_the_trial_process_own_not_its_parents():
    """ru_maxrss survives fork + exec: a bench started by a big tuner reported the tuner's size."""
    import subprocess
    import sys
    from colibri_tune_fixtures import ROOT
    hog = b"\x01" * (1024 * MiB)  # this process: over 1 GiB resident
    child = subprocess.run([sys.executable, "-c", "from engine.run.run_metrics import peak_rss_bytes; print(peak_rss_bytes())"],
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    del hog
    assert child.returncode == 0, child.stderr
    assert int(child.stdout) < 256 * MiB
