"""Atomic UTF-8 writes with fsync, and the directory lock between real processes."""

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine.base import durable
from engine.base.durable import DirectoryLock, atomic_write_text, lock_path_for
from engine.base.errors import BusyError

ROOT = Path(__file__).resolve().parent.parent
RUN = ["-m", "colibri.cli", "run", "--model", "tiny", "--prompt-tokens", "3", "--max-new-tokens", "2",
       "--ctx-size", "16", "--json"]


def env(**extra):
    e = {**os.environ, "PYTHONPATH": str(ROOT), **extra}
    e.pop(durable.LOCK_TIMEOUT_ENV, None)
    e.update(extra)
    return e


def test_atomic_write_is_utf8_whatever_the_locale(tmp_path):
    target = tmp_path / "report.md"
    code = f"from engine.base.config import atomic_write_text; atomic_write_text({str(target)!r}, 'caf\\u00e9 \\u2713 \\u4e2d')"
    # An ASCII locale with Python's UTF-8 coercion off: open(..., "w") alone would raise here.
    proc = subprocess.run([sys.executable, "-c", code], env=env(LC_ALL="C", LANG="C", PYTHONCOERCECLOCALE="0",
                                                                  PYTHONUTF8="0"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert target.read_bytes() == "café ✓ 中".encode("utf-8")


def test_atomic_write_fsyncs_the_file_and_then_its_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):  # observe, then do the real thing
        mode = os.fstat(fd).st_mode
        synced.append("dir" if stat.S_ISDIR(mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    atomic_write_text(tmp_path / "a.toml", "x = 1\n")
    assert synced == ["file", "dir"]
    assert (tmp_path / "a.toml").read_text() == "x = 1\n"


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    target = tmp_path / "recommended.toml"
    atomic_write_text(target, "old\n")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(target, "bad \ud800 surrogate")

    def no_rename(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_rename)
    with pytest.raises(OSError):
        atomic_write_text(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recommended.toml"]


def test_atomic_write_honours_the_umask_not_mkstemps_0600(tmp_path):
    atomic_write_text(tmp_path / "r.json", "{}")
    assert stat.S_IMODE(os.stat(tmp_path / "r.json").st_mode) == 0o666 & ~durable._umask()


# --- the directory lock, between processes ------------------------------------------------------

def cache_target(cache: Path) -> Path:
    return cache / "models" / "tiny-seed0"


def files_of(d: Path) -> dict:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in d.iterdir()}


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_second_process_fails_clearly_when_told_not_to_wait(tmp_path):
    out = tmp_path / "model"
    with DirectoryLock(out, "converting a test model"):
        proc = subprocess.run([sys.executable, "-m", "colibri.cli", "synth", "tiny", "-o", str(out)],
                              env=env(**{durable.LOCK_TIMEOUT_ENV: "0"}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert f"locked by pid {os.getpid()} (converting a test model" in line and str(out) in line
    assert not out.exists()


def test_second_process_gives_up_after_the_timeout(tmp_path):
    out = tmp_path / "model"
    with DirectoryLock(out, "synthesizing"):
        proc = subprocess.run([sys.executable, "-m", "colibri.cli", "synth", "tiny", "-o", str(out)],
                              env=env(**{durable.LOCK_TIMEOUT_ENV: "0.5"}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "still locked by pid" in proc.stderr and "after 0.5 s" in proc.stderr and "Traceback" not in proc.stderr


def test_second_process_waits_then_reuses_the_model_the_first_wrote(tmp_path):
    from engine import synth
    cache = tmp_path / "cache"
    target = cache_target(cache)
    with DirectoryLock(target, "synthesizing preset tiny"):
        waiter = subprocess.Popen([sys.executable, *RUN], env=env(COLIBRI_CACHE=str(cache)),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = waiter.stderr.readline()  # blocks until the waiter reports that it waits: no sleep
        assert f"waiting for pid {os.getpid()}" in first, first
        synth.synthesize(synth.load_preset("tiny"), target, progress=False)
        written = files_of(target)
        assert waiter.poll() is None  # still waiting while we hold the lock
    out, err = waiter.communicate(timeout=300)
    assert waiter.returncode == 0, err
    assert json.loads(out)["output_ids"]
    assert files_of(target) == written  # reused: not one file rewritten
    assert sorted(p.name for p in target.parent.iterdir()) == ["tiny-seed0"]  # no partial dir, no lock file


def test_two_processes_racing_for_one_preset_both_succeed_on_one_copy(tmp_path):
    cache = tmp_path / "cache"
    procs = [subprocess.Popen([sys.executable, *RUN], env=env(COLIBRI_CACHE=str(cache)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
    assert json.loads(results[0][0])["output_ids"] == json.loads(results[1][0])["output_ids"]
    assert sorted(p.name for p in cache_target(cache).parent.iterdir()) == ["tiny-seed0"]


def test_kill_9_of_the_holder_releases_the_lock(tmp_path):
    out = tmp_path / "model"
    code = ("import sys; from engine.base.durable import DirectoryLock\n"
            f"with DirectoryLock({str(out)!r}, 'holding'):\n"
            "    print('locked', flush=True); sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(BusyError, match=f"locked by pid {holder.pid} \\(holding"):
        with DirectoryLock(out, timeout=0):
            pass
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    with DirectoryLock(out, timeout=0):  # the kernel dropped the dead holder's lock
        assert lock_path_for(out).exists()
    assert not lock_path_for(out).exists()


def test_lock_is_reentrant_within_one_process(tmp_path):
    with DirectoryLock(tmp_path / "m", timeout=0):
        with DirectoryLock(tmp_path / "m", timeout=0):
            pass
        assert lock_path_for(tmp_path / "m").exists()  # the outer hold continues
    assert not lock_path_for(tmp_path / "m").exists()
