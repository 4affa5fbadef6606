import compileall
import signal
import sys
from pathlib import Path

import pytest

from colibri_requirements import required_dependency_in
from colibri_tune_fixtures import model_dir, profile_path  # noqa: F401  (session fixtures, see there)

# A suite started in the background by a non-interactive shell (`cmd &`, nohup, some CI runners)
# inherits SIGINT ignored, and exec keeps it ignored, so the Ctrl-C tests' children would never
# raise KeyboardInterrupt and the tests would hang. A handled signal is reset to the default at
# exec, so giving this process a handler makes every child start with Python's own Ctrl-C.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tests run against the working tree even before `pip install -e .`.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_sessionstart(session):
    # The suite starts hundreds of Python processes (every tune trial is a `colibri bench`), and
    # each one imports engine/, tuner/ and colibri/. Where PYTHONDONTWRITEBYTECODE is set (this project's
    # dev and CI boxes), no process writes the bytecode it compiles, so every one of them
    # recompiles the tree (~0.2 s of CPU each). Compiled once here (only what changed since the
    # last session; the source's mtime invalidates it), every child reads it instead.
    for package in ("engine", "tuner", "colibri", "tests"):
        compileall.compile_dir(ROOT / package, quiet=1)


def pytest_addoption(parser):
    # For intermittent failures: `pytest --repeat 30 tests/FILE.py::test_NAME` runs the test 30 times
    # in one session (module fixtures built once) and reports each run.
    parser.addoption("--repeat", type=int, default=1, help="run each selected test N times")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("repeat")
    if n > 1:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(n), ids=lambda i: f"run{i + 1}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # A skip for a dependency that COLIBRI_REQUIRE_<DEP> makes required fails instead
    # (tests/colibri_requirements.py): CI must run what it claims to run.
    outcome = yield
    report = outcome.get_result()
    if report.skipped and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        dep = required_dependency_in(reason)
        if dep is not None:
            report.outcome = "failed"
            report.longrepr = f"COLIBRI_REQUIRE_{dep.upper()} is set but the test skipped: {reason}"
