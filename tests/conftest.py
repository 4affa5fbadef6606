import sys
from pathlib import Path

# Tests run against the working tree even before `pip install -e .`.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def pytest_addoption(parser):
    # For intermittent failures: `pytest --repeat 30 tests/x.py::test_y` runs the test 30 times
    # in one session (module fixtures built once) and reports each run.
    parser.addoption("--repeat", type=int, default=1, help="run each selected test N times")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("repeat")
    if n > 1:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(n), ids=lambda i: f"run{i + 1}")
