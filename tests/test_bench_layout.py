"""benchmarks/ by question: every script starts from a clean clone by its documented command
(`python benchmarks/<question>/<script>.py`), with no PYTHONPATH, from any working directory."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Modules of other scripts, not commands of their own.
HELPERS = {"benchkit.py", "trees.py", "io/io_jobs.py", "io/page_cache.py", "peers/peers_quality.py", "serving/serve_load.py",
           "peers/peers_report.py"}
SCRIPTS = sorted(p.relative_to(ROOT / "benchmarks").as_posix() for p in (ROOT / "benchmarks").rglob("*.py")
                 if "__pycache__" not in p.parts)


def test_scripts_live_in_their_questions_folder_and_no_name_repeats_a_product_module():
    assert all("/" in s for s in SCRIPTS if s not in HELPERS), "a script outside its question's folder"
    product = {p.name for top in ("engine", "tuner", "colibri") for p in (ROOT / top).rglob("*.py")}
    clashes = {s for s in SCRIPTS if Path(s).name in product and Path(s).name != "__init__.py"}
    assert not clashes, sorted(clashes)


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s not in HELPERS and s != "peers/peers_convert.py"])
def test_every_script_answers_help_from_a_clean_start(script, tmp_path):
    # No PYTHONPATH and another working directory: what the script needs beyond the installed
    # packages (the repository root for benchmarks.*) it must find itself. peers_convert.py hands
    # its arguments to llama.cpp's converter, which needs --llama-src: tests/test_peers_convert.py.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower()
