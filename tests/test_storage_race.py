"""Several processes opening one new study file at once all succeed (the table-creation race)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each opener imports everything, says so, then waits on its stdin: released together, they all
# start creating the tables at the same moment.
OPENER = ("import sys; from tuner.search.study_storage import open_storage; url = sys.argv[1]; print('ready', flush=True); "
          "sys.stdin.read(2); open_storage(url, shared=False); print('ok', flush=True)")


def test_processes_opening_a_new_sqlite_study_together_all_succeed(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(6)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go")
        p.stdin.close()
    results = [(p.wait(timeout=300), p.stdout.read().strip(), p.stderr.read()) for p in procs]
    assert all(code == 0 and out == "ok" for code, out, _ in results), results
