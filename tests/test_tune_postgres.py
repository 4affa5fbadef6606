"""Two `colibri tune` workers share one study through a PostgreSQL server the test starts.

The server is a throwaway cluster in a temp directory (Debian's postgresql package: initdb and
pg_ctl under /usr/lib/postgresql/*/bin), listening on a unix socket only. As root, it runs as the
`postgres` user (PostgreSQL refuses root). Skipped, with the reason, where it cannot start.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from colibri_tune_fixtures import MIN_CTX, ROOT
from colibri_requirements import needs

pytestmark = pytest.mark.postgres
PORT = "5439"
TRIALS = 6


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_db_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    runuser = shutil.which("runuser")
    return [runuser, "-u", "postgres", "--", *argv] if runuser else ["su", "postgres", "-s", "/bin/sh", "-c",
                                                                     " ".join(argv)]


@pytest.fixture(scope="module")
def postgres_url():
    try:
        import psycopg2
    except ImportError:
        pytest.skip(needs("postgres", "psycopg2 is not installed (pip install 'colibri-tune[postgres]')"))
    bindir = _pg_bin()
    if bindir is None:
        pytest.skip(needs("postgres", "PostgreSQL server binaries not found (apt-get install postgresql)"))
    if os.geteuid() == 0:
        import pwd
        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip(needs("postgres", "running as root and there is no 'postgres' user to run the server as"))
    base = Path(tempfile.mkdtemp(prefix="colibri-pg-"))
    data, log = base / "data", base / "server.log"
    if os.geteuid() == 0:
        os.chown(base, pw.pw_uid, pw.pw_gid)
    started = False
    try:
        init = subprocess.run(_as_db_user([str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                                           "--no-sync"]), capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            pytest.skip(needs("postgres", f"initdb failed: {(init.stderr or init.stdout).strip().splitlines()[-1:]}"))
        opts = f"-k {base} -c listen_addresses='' -p {PORT} -c fsync=off"
        start = subprocess.run(_as_db_user([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts,
                                            "-w", "-t", "60", "start"]), capture_output=True, text=True, timeout=90)
        if start.returncode != 0:
            tail = log.read_text()[-300:] if log.exists() else start.stderr
            pytest.skip(needs("postgres", f"PostgreSQL did not start: {tail.strip()}"))
        started = True
        conn = psycopg2.connect(dbname="postgres", user="postgres", host=str(base), port=PORT)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE colibri")
        conn.close()
        yield f"postgresql+psycopg2://postgres@/colibri?host={base}&port={PORT}"
    finally:
        if started:
            subprocess.run(_as_db_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                           capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def test_two_workers_share_one_study(postgres_url, model_dir, profile_path, tmp_path):  # noqa: F811
    def worker(name: str) -> subprocess.Popen:
        argv = [sys.executable, "-m", "colibri.cli", "tune", "--model", str(model_dir), "--ram-budget", "512MiB",
                "--min-ctx", str(MIN_CTX), "--trials", str(TRIALS), "--tokens", "2", "--repeats", "1",
                "--prompt-tokens", "8", "--confirm-top", "0", "--storage", postgres_url, "--study-name", "shared",
                "--out", str(tmp_path / name), "--profile", str(profile_path), "--json"]
        return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    procs = [worker("a"), worker("b")]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert json.loads(out)["study"]["name"] == "shared"

    study = optuna.load_study(study_name="shared", storage=postgres_url)
    done = study.get_trials(states=(TrialState.COMPLETE,))
    # Each worker checks the shared count before asking, so at most one extra trial slips in.
    assert TRIALS <= len(done) <= TRIALS + 1
    workers = {t.user_attrs["worker"] for t in done}
    assert len(workers) == 2, workers
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert any(t.user_attrs["role"] == "baseline" for t in done)
    # Both workers wrote their own outputs from the one study.
    for name in ("a", "b"):
        result = json.loads((tmp_path / name / "result.json").read_text())
        assert result["study"]["storage"].startswith("postgresql+psycopg2://postgres@/colibri")
        assert result["study"]["trials"] >= TRIALS
