"""The time budget of a tune run: how long trials take, and whether another one fits.

One reserve formula: the confirmation round re-measures up to three candidates and the
baseline, so the search stops while there is still time for that many more trials.
"""

from __future__ import annotations

import re
import statistics
import time

from engine.api import ConfigError

DEFAULT_TIME_BUDGET_S = 15 * 60  # the whole run (probe, search, confirmation) on demo, here
MIN_TRIAL_TIMEOUT_S = 60.0
FIRST_TRIAL_TIMEOUT_S = 600.0
CONFIRM_RESERVE_MAX = 3  # candidates the reserve plans for (plus the baseline)
# tune --max-kl --front-rounds: one front round's runs the reserve plans for (lossless and the four
# probes, the usual front; front_confirm.py runs further rounds only while time allows), so a
# time-budgeted run does not spend on the search the time its front needs to be measured fairly.
FRONT_RESERVE_RUNS = 5


class TimeBudget:
    def __init__(self, seconds: float | None, confirm_top: int, fixed_trial_timeout: float | None = None,
                 front_runs: int = 0):
        self.t0 = time.monotonic()
        self.seconds = seconds  # None: no time limit (the trial count limits the run)
        self.confirm_top = confirm_top
        self.front_runs = front_runs  # runs reserved for the front's first round (0: no front rounds)
        self.fixed_trial_timeout = fixed_trial_timeout
        self.walls: list[float] = []  # wall seconds of this session's measurements

    @classmethod
    def for_run(cls, time_budget: float | None, trials: int | None, confirm_top: int,
                trial_timeout: float | None, front_runs: int = 0) -> "TimeBudget":
        """No budget and no trial count: the default 15 minutes."""
        seconds = float(DEFAULT_TIME_BUDGET_S) if time_budget is None and trials is None else time_budget
        return cls(seconds, confirm_top, trial_timeout, front_runs)

    def record(self, wall_seconds: float) -> None:
        self.walls.append(wall_seconds)

    def used(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float | None:
        return None if self.seconds is None else max(0.0, self.seconds - self.used())

    def est_trial_s(self) -> float | None:
        return statistics.median(self.walls) if self.walls else None

    def trial_timeout(self) -> float:
        """The fixed --trial-timeout, else 5x a measured trial (at least a minute)."""
        if self.fixed_trial_timeout is not None:
            return float(self.fixed_trial_timeout)
        est = self.est_trial_s()
        return FIRST_TRIAL_TIMEOUT_S if est is None else max(MIN_TRIAL_TIMEOUT_S, 5.0 * est)

    def confirm_reserve(self) -> float:
        est = self.est_trial_s() or 0.0
        # the candidates, then the engine's defaults and the baseline; then the front's first round
        confirm = (min(self.confirm_top, CONFIRM_RESERVE_MAX) + 2) if self.confirm_top else 0
        return est * (confirm + self.front_runs)

    def room_for_trial(self) -> bool:
        left = self.left()
        return left is None or left >= (self.est_trial_s() or 0.0) + self.confirm_reserve()

    def trials_left(self) -> int:
        left, est = self.left(), self.est_trial_s()
        if left is None or not est:
            return 0
        return max(0, int((left - self.confirm_reserve()) // est))

    def room_for_round(self, runs: int) -> bool:
        """Another confirmation round of `runs` measurements still fits."""
        left = self.left()
        return left is None or left >= (self.est_trial_s() or 0.0) * runs

    def clock(self) -> str:
        left = self.left()
        return f"{format_clock(self.used())} used" + (f", {format_clock(left)} left" if left is not None else "")


def parse_duration(text: str) -> float:
    """'10m', '90s', '1h30m', '45' (seconds) → seconds."""
    s = str(text).strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", s)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != s.replace(" ", ""):
        raise ConfigError(f"cannot parse duration {text!r} (examples: 10m, 90s, 1h30m)")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def format_clock(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


# A trial's decode figure is tokens / decode time; below about a quarter of a second per repeat one
# scheduling or I/O stall moves it by tens of percent. Measured: on the trained reference at ~300
# tok/s, 8 tokens (27 ms) gave one config 328 tok/s in its tune and 149 re-measured minutes later
# (docs/benchmarks-history.md, tunebench, 2026-12-02).
SHORT_DECODE_S = 0.25


def longer_decode(tokens: int, decode_tok_s: float | None) -> int | None:
    """The --tokens to suggest when `tokens` decode in under SHORT_DECODE_S at the calibration's
    speed (a power of two decoding for at least twice that), else None."""
    if not decode_tok_s or decode_tok_s <= 0 or tokens / decode_tok_s >= SHORT_DECODE_S:
        return None
    want = 2 * SHORT_DECODE_S * decode_tok_s
    n = max(tokens, 1)
    while n < want:
        n *= 2
    return n
