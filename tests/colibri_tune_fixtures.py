"""Fixtures shared by the tune tests (test_tune*.py, test_lossy_tune.py, test_trial_outcomes.py, ...):
the tiny model and a shrunk probe, and their constants. Imported by module name (pytest puts
tests/ on sys.path, pyproject.toml), never as `tests.…`: an installed distribution that ships a
top-level `tests` package would shadow that.

The two fixtures are session-wide, registered by conftest.py: one model and one probe for every
module (neither is ever written to; a tune copies the probe into its run directory). A module
must not import them itself: pytest would then build that module its own copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BUDGET = 512 * MiB
# The tune tests' smallest context: 32K positions (KV 32 MiB on tiny), so the smallest config fits
# 512 MiB with ~60 MiB to spare beside a trial process whose RSS is at its largest (a fresh
# install's libraries hot in the page cache: ~375 MiB counted, ~310 MiB otherwise), and 4x it may not.
MIN_CTX = 32768
SMALL_CTX = 256  # every ctx choice fits: each trial really runs


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    from engine import synth
    d = tmp_path_factory.mktemp("tune-model") / "tiny"
    synth.synthesize(synth.load_preset("tiny"), d, seed=0, progress=False)
    return d


@pytest.fixture(scope="session")
def profile_path(tmp_path_factory) -> Path:
    """A real probe, shrunk to a few tiny jobs (the tune command reuses it via --profile)."""
    from tuner.probe import ProbePlan, run_probe, save_profile
    from tuner.probe.storage import StorageJob, StoragePlan
    d = tmp_path_factory.mktemp("tune-profile")
    jobs = (StorageJob("sequential", "read", 256 * 1024, 2), StorageJob("curve", "randread", 256 * 1024, 2),
            StorageJob("buffered", "randread", 256 * 1024, 2, direct=False, time_based=False))
    plan = ProbePlan(mode="custom", storage=StoragePlan(file_bytes=4 * MiB, runtime_s=0.05, jobs=jobs,
                                                        min_file_bytes=1 * MiB),
                     memory_buffer_bytes=4 * MiB, memory_repeats=1, matmul_ms=(1,), matmul_min_time_s=0.005,
                     measure_gpu=False, thread_counts=(1,))
    return save_profile(run_probe(d, use_fio=False, plan=plan), d / "profile.json")
