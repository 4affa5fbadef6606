"""benchmarks/time/router_logits.py: bad flags are one error line; a run reports both implementations
for every published shape, agreeing to fp32 summation order (a wrong kernel would show here first)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native
from colibri_requirements import needs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "time" / "router_logits.py"


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_bad_rows_are_one_error_line():
    r = _run("--rows", "1,x")
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.strip().count("\n") == 0 and "--rows" in r.stderr


@pytest.mark.skipif(native.load() is not None, reason=needs("native", "native kernels"))
def test_a_run_reports_each_shape_with_logits_that_agree():
    r = _run("--rows", "1", "--steps", "2", "--threads", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == "colibri.bench/1" and doc["tool"] == "router_logits"
    assert {row["shape"] for row in doc["rows"]} == {"256 x 7168", "160 x 5120", "128 x 4096"}
    for row in doc["rows"]:
        assert row["before_us"] > 0 and row["after_us"] > 0
        assert float(row["max_diff"]) < 1e-4, row
