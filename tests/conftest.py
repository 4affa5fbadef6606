import signal
import sys
from pathlib import Path

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


def pytest_addoption(parser):
    # For intermittent failures: `pytest --repeat 30 tests/x.py::test_y` runs the test 30 times
    # in one session (module fixtures built once) and reports each run.
    parser.addoption("--repeat", type=int, default=1, help="run each selected test N times")


def pytest_generate_tests(metafunc):
    n = metafunc.config.getoption("repeat")
    if n > 1:
        metafunc.fixturenames.append("_repeat")
        metafunc.parametrize("_repeat", range(n), ids=lambda i: f"run{i + 1}")
