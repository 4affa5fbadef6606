"""Parts of the tune result (colibri.tune/5) that let a reader check its figures: the command that
measures the headline figure again (Reproduce) and the cost model's error on the run (CostModelRun).
Kept apart from result.py for its length; result.py re-exports them, the schema is one import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class Reproduce:
    """The `colibri bench` command that measures the recommended config's headline figure again
    (tuner/results/reproduce.py), and what that figure measured: a re-run must give the same
    prompts (workload sha256), output tokens and bytes read per token; only the timing moves."""

    command: str
    workload_sha256: Optional[str]
    output_sha256: Optional[str]
    generated_tokens: Optional[int]
    bytes_read_per_token: Optional[float]
    degenerate_prompts: Optional[int] = None


@dataclass
class ModeError:
    """The cost model's error on one kind of config in this run: predicted vs measured decode."""

    trials: int
    median_abs_pct_error: Optional[float]


@dataclass
class CostModelRun:
    """How well the cost model predicted this run's trials (every measured trial carries its
    prediction): the median error over all of them, per io mode and per cache policy; and the
    warm starts it enqueued, or why none."""

    calibrated: bool  # the profile's factors were fitted (plan --calibrate), not the defaults
    trials: int
    median_abs_pct_error: Optional[float]
    by_io_mode: dict[str, ModeError]
    by_cache_policy: dict[str, ModeError]
    warm_starts: int
    warm_start_note: str
