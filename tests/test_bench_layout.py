"""benchmarks/ by question: every script starts from a clean clone by its documented command
(`python benchmarks/<question>/<script>.py`), with no PYTHONPATH, from any working directory; the
structured-output benchmark (serving/grammar_overhead.py decode) runs end to end and prints its table."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Modules of other scripts, not commands of their own.
HELPERS = {"benchkit.py", "trees.py", "io/io_jobs.py", "io/page_cache.py", "peers/peers_quality.py", "serving/serve_load.py",
           "peers/peers_report.py", "serving/serve_process.py", "serving/serve_arrivals.py", "serving/serve_soak.py",
           "formats/fullscale_build.py", "peers/peers_engines.py", "time/draft_workloads.py", "time/draft_child.py",
           "time/draft_runs.py", "time/memory_layouts.py"}
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


@pytest.mark.slow
def test_grammar_overhead_decode_prints_its_table_under_its_conditions(tmp_path):
    """The structured-output benchmark end to end on the tiny preset (synthesized on first use, as demo
    is), from another directory without PYTHONPATH: each budget in its own process, one row each, the
    compile figures above and the conditions line first. Figures are not checked: the box is shared."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving" / "grammar_overhead.py"), "decode",
                          "--model", "tiny", "--budget", "0", "--tokens", "3", "--repeats", "1"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert "commit" in lines[0] and "io_mode direct" in lines[0] and "tokens 3" in lines[0]
    assert any(line.startswith("schema compile ms") for line in lines)
    assert any(line.startswith("tool-call grammar compile ms") and "hermes" in line for line in lines)
    header = next(line for line in lines if line.startswith("| setting"))
    assert "decode tok/s, free" in header and "decode tok/s, JSON schema" in header
    assert [line.split("|")[1].strip() for line in lines if line.startswith("| resident")] == ["resident"]
