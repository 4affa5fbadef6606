"""A tune on a non-demo model without --ram-budget, killed with -9, resumed after the machine's
free memory changed: the resume finds its study through run.json (budget and study recorded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil

from engine.base.config import size_label
from tuner.search.run_record import read_run_record
from tuner.search.study import TuneOptions, default_budget, run_tune

from colibri_sync import completed_trials, wait_until
from colibri_tune_fixtures import ROOT, SMALL_CTX
from test_tune import _reap

COMMON = ["--min-ctx", str(SMALL_CTX), "--tokens", "2", "--repeats", "1", "--prompt-tokens", "8",
          "--confirm-top", "0", "--seed", "3"]


def wait_for_completed(proc, reports: Path, n: int) -> Path:
    """The run directory (reports/tune-*) once its study has n COMPLETE trials."""
    def found():
        return next((db.parent for db in reports.glob("tune-*/study.db") if completed_trials(db) >= n), None)
    return wait_until(found, f"{n} completed trial(s)", proc)


def test_resume_after_kill_9_with_less_free_memory_finds_the_study(model_dir, profile_path, tmp_path,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)  # reports/ lands here, and --resume without --out looks here
    argv = [sys.executable, "-m", "colibri.cli", "tune", "--model", str(model_dir), "--trials", "3",
            "--profile", str(profile_path), *COMMON]
    proc = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = wait_for_completed(proc, tmp_path / "reports", 1)
    children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    proc.communicate(timeout=60)
    _reap(children, proc.pid)
    recorded = read_run_record(out)
    before = completed_trials(out / "study.db")
    assert recorded["study_name"].startswith(f"{model_dir.name}-") and before >= 1

    # Less free memory now: hold (and touch) 1.5 GiB while resuming. The default budget, and with
    # it the default study name, is no longer what the killed run used.
    hog = b"\x01" * (1536 << 20)
    assert size_label(default_budget(str(model_dir)), smallest="MiB") != \
        size_label(recorded["budget"], smallest="MiB")
    lines: list[str] = []
    outcome = run_tune(TuneOptions(model=str(model_dir), trials=3, resume=True, profile=str(profile_path),
                                   min_ctx=SMALL_CTX, tokens=2, repeats=1, prompt_tokens=8, confirm_top=0, seed=3),
                       log=lines.append)
    del hog
    assert outcome.out_dir.resolve() == out.resolve()
    assert outcome.result["study"]["name"] == recorded["study_name"]
    assert any("as recorded in" in ln and "budget" in ln for ln in lines), lines
    assert any(f"study {recorded['study_name']!r} as recorded" in ln for ln in lines), lines
    assert completed_trials(out / "study.db") == 3  # the killed run's trials count toward --trials
