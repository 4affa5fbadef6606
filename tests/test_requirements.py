"""The require switch: where COLIBRI_REQUIRE_<DEP> is set, a test that skips for want of that
dependency fails instead (CI sets every one); elsewhere it skips as before."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_requirements import DEPENDENCIES, needs, required_dependency_in
from engine import native

TESTS = Path(__file__).resolve().parent

MISSING_FIO = '''
import pytest
from colibri_requirements import needs

@pytest.mark.skipif(True, reason=needs("fio", "fio is not installed"))
def test_marked():
    pass

def test_runtime_skip():
    pytest.skip(needs("fio", "fio is not installed"))

def test_unrelated_skip():
    pytest.skip("not a dependency")
'''


def _run(tmp_path, **env):
    (tmp_path / "test_missing.py").write_text(MISSING_FIO)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("COLIBRI_REQUIRE_")}
    # -p conftest loads the suite's own conftest (and its hook) as a plugin for this directory.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True, text=True,
                          env={**clean, **env, "PYTHONPATH": str(TESTS)}, timeout=120)


def test_a_missing_dependency_skips_where_it_is_not_required(tmp_path):
    out = _run(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 skipped" in out.stdout


def test_a_missing_required_dependency_fails_both_ways_of_skipping(tmp_path):
    out = _run(tmp_path, COLIBRI_REQUIRE_FIO="1")
    assert out.returncode == 1
    # A skipif mark skips in setup, so it is reported as an error there; pytest.skip() in the body fails.
    assert "1 failed, 1 skipped, 1 error" in out.stdout
    assert out.stdout.count("COLIBRI_REQUIRE_FIO is set but the test skipped") >= 2


def test_only_the_named_dependency_is_required(tmp_path):
    out = _run(tmp_path, COLIBRI_REQUIRE_POSTGRES="1", COLIBRI_REQUIRE_FIO="0")
    assert out.returncode == 0
    assert "3 skipped" in out.stdout


@pytest.mark.parametrize("dep", DEPENDENCIES)
def test_each_dependency_has_its_switch(dep, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.REQUIRED_FLAGS + native.INT_FLAGS))
    reason = needs(dep, "absent")
    monkeypatch.delenv(f"COLIBRI_REQUIRE_{dep.upper()}", raising=False)
    assert required_dependency_in(reason) is None
    monkeypatch.setenv(f"COLIBRI_REQUIRE_{dep.upper()}", "1")
    assert required_dependency_in(reason) == dep


@pytest.mark.parametrize("int_kernels", [False, True])
def test_native_kernels_on_a_cpu_without_their_instructions_skip_as_hardware_even_where_required(int_kernels,
                                                                                                monkeypatch):
    """The native kernels need AVX-512 or AVX2 and FMA (the int ones AVX-512 VNNI and VBMI): a CPU without
    them is no missing dependency setup.sh could install, so their tests skip there even under
    COLIBRI_REQUIRE_NATIVE (CI on such a machine; tests/test_native_build.py still compiles the sources);
    with them, a skip fails."""
    monkeypatch.setenv("COLIBRI_REQUIRE_NATIVE", "1")
    monkeypatch.delenv("COLIBRI_NATIVE_ISA", raising=False)
    has = {"avx2", "fma"} if int_kernels else {"sse4_2", "avx"}
    monkeypatch.setattr(native, "cpu_flags", lambda: has)
    reason = needs("native", "native kernels: absent", int_kernels=int_kernels)
    assert required_dependency_in(reason) is None and "instruction set" in reason
    monkeypatch.setattr(native, "cpu_flags", lambda: set(native.REQUIRED_FLAGS + native.INT_FLAGS))
    assert required_dependency_in(needs("native", "native kernels: absent", int_kernels=int_kernels)) == "native"


def test_ci_requires_every_dependency():
    ci = (TESTS.parent / ".ci" / "run").read_text()
    for dep in DEPENDENCIES:
        assert f"COLIBRI_REQUIRE_{dep.upper()}=1" in ci, dep
