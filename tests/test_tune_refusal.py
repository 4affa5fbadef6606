"""Refuse before you start (issue 23, item 5): `colibri tune` checks every option and input before
it creates its run directory, so a refused run leaves nothing behind; a run directory in use by a
live tune is refused with one line; one deleted under a live tune stops it with one line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from colibri import cli

from colibri_sync import completed_trials, wait_until
from colibri_tune_fixtures import ROOT, SMALL_CTX


def tune_argv(model_dir, profile_path, out, *extra) -> list[str]:
    return ["tune", "--model", str(model_dir), "--ram-budget", "512MiB", "--min-ctx", str(SMALL_CTX),
            "--trials", "3", "--tokens", "2", "--repeats", "1", "--prompt-tokens", "8", "--confirm-top", "0",
            "--out", str(out), "--profile", str(profile_path), *extra]


def refused(argv: list[str], capsys, *words: str) -> str:
    capsys.readouterr()
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "error:" in line]
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# --- a refused run leaves nothing behind -------------------------------------------------------------

def test_bad_profile_leaves_nothing(model_dir, tmp_path, capsys):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"schema_version": 1, "not": "a profile"}))
    refused(tune_argv(model_dir, bad, tmp_path / "run"), capsys, "profile")
    assert listing(tmp_path) == ["profile.json"]


def test_missing_profile_leaves_nothing(model_dir, tmp_path, capsys):
    refused(tune_argv(model_dir, tmp_path / "nope.json", tmp_path / "run"), capsys, "nope.json")
    assert listing(tmp_path) == []


@pytest.mark.parametrize("flag,value", [("--trial-timeout", "nan"), ("--trial-timeout", "inf"),
                                        ("--trial-timeout", "-1"), ("--trials", "0")])
def test_bad_numbers_leave_nothing(model_dir, profile_path, tmp_path, capsys, flag, value):
    refused(tune_argv(model_dir, profile_path, tmp_path / "run", f"{flag}={value}"), capsys, flag)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("url,words", [("nonsense", "not a database URL"), ("http://example.org/x", "'http'")])
def test_bad_storage_url_leaves_nothing(model_dir, profile_path, tmp_path, capsys, url, words):
    refused(tune_argv(model_dir, profile_path, tmp_path / "run", "--storage", url), capsys, "cannot open study storage", words)
    assert listing(tmp_path) == []


def test_budget_below_the_dense_part_leaves_nothing(model_dir, profile_path, tmp_path, capsys):
    argv = tune_argv(model_dir, profile_path, tmp_path / "run")
    argv[argv.index("512MiB")] = "1MiB"
    refused(argv, capsys)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("levels,words", [("int3", "unknown level"), ("bf16,bf16", "twice"),
                                          ("int4-g48", "group size"), ("bf16", "stored as")])
def test_bad_quant_level_leaves_nothing(model_dir, profile_path, tmp_path, capsys, levels, words):
    refused(tune_argv(model_dir, profile_path, tmp_path / "run", "--quant", levels), capsys, words)
    assert listing(tmp_path) == []


def test_quant_level_that_cannot_convert_this_model_leaves_nothing(model_dir, profile_path, tmp_path, capsys):
    # tiny (stored as fp32) has moe_intermediate_size 32, not a multiple of 64: int4-g64 cannot hold it.
    refused(tune_argv(model_dir, profile_path, tmp_path / "run", "--quant", "fp32,int4-g64"), capsys, "64")
    assert listing(tmp_path) == []


def test_quant_run_with_a_bad_profile_leaves_nothing(model_dir, tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    refused(tune_argv(model_dir, bad, tmp_path / "run", "--quant", "fp32"), capsys)
    assert listing(tmp_path) == ["p.json"]


# --- where the run directory may be ------------------------------------------------------------------

def test_out_into_a_foreign_directory_is_refused(model_dir, profile_path, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "sentinel.txt").write_text("not colibri's")
    refused(tune_argv(model_dir, profile_path, out), capsys, "not a previous `colibri tune` run directory")
    assert listing(out) == ["sentinel.txt"] and (out / "sentinel.txt").read_text() == "not colibri's"


def test_out_empty_or_the_model_is_refused(model_dir, profile_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(tune_argv(model_dir, profile_path, ""), capsys, "empty path")
    refused(tune_argv(model_dir, profile_path, model_dir), capsys, "is the source")
    before = listing(model_dir)
    refused(tune_argv(model_dir, profile_path, model_dir / "run"), capsys, "inside the source")
    assert listing(model_dir) == before and listing(tmp_path) == []


# --- a run directory in use ----------------------------------------------------------------------------

HOLDER = """
import sys
from pathlib import Path
from tuner.search.run_guard import hold
with hold(Path(sys.argv[1]), "tuning tiny-512MiB-decode"):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_run_directory_held_by_a_live_tune_is_refused(model_dir, profile_path, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], cwd=ROOT, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        line = refused(tune_argv(model_dir, profile_path, out), capsys, "another `colibri tune`",
                       f"pid {holder.pid}")
        assert "tiny-512MiB-decode" in line
        assert listing(out) == []  # no study.db, no run.json: the holder's directory is untouched
    finally:
        holder.communicate(input="", timeout=60)
    assert holder.returncode == 0


def test_a_run_directory_deleted_under_a_live_tune_stops_it_with_one_line(model_dir, profile_path, tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "colibri.cli", *tune_argv(model_dir, profile_path, out)]
    argv[argv.index("--trials") + 1] = "50"
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: completed_trials(out / "study.db") >= 1, "1 completed trial", proc)
        # Gone from its path in one step, then emptied: an rmtree of the live directory itself raced
        # the tune's next write (a file created between rmtree's listing and its rmdir: ENOTEMPTY).
        gone = tmp_path / "deleted-run"
        os.rename(out, gone)
        shutil.rmtree(gone, ignore_errors=True)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert proc.returncode == 2, err
    assert "Traceback" not in err and len(errors) == 1, err
    assert "deleted" in errors[0] and str(out) in errors[0]
    assert not out.exists(), listing(out)  # not re-created by a late write


def test_a_run_directory_deleted_between_a_write_and_its_rename_is_reported_as_gone(tmp_path, monkeypatch):
    """The race the test above hit in CI: the run directory renamed away and emptied after write_text
    created its temp file and before the rename. The rename then finds no temp file; the user is told
    the directory is gone (RunDirGone), not shown a rename's FileNotFoundError."""
    from tuner.search import run_guard
    out = tmp_path / "run"
    out.mkdir()
    watch = run_guard.RunDirWatch(out)
    real_replace = os.replace

    def replace_after_the_directory_went(*args, **kwargs):
        gone = tmp_path / "deleted-run"
        os.rename(out, gone)
        shutil.rmtree(gone)
        return real_replace(*args, **kwargs)

    try:
        watch.write_text("trials.csv", "a,b\n")  # the directory is there: written
        assert (out / "trials.csv").read_text() == "a,b\n"
        monkeypatch.setattr(run_guard.os, "replace", replace_after_the_directory_went)
        with pytest.raises(run_guard.RunDirGone, match="deleted or replaced"):
            watch.write_text("trials.csv", "a,b\n1,2\n")
    finally:
        watch.close()
    assert not out.exists()  # nothing re-created it
