"""A trial's outcome as data: what the trial process says happened, and what the kernel says.

The trial process (`colibri bench --outcome FILE`) writes one JSON record before it exits:
ok (with the bench metrics), over_budget (the memory plan refused the config), bad_config (any
other input error), or crashed (the exception's type and message). What the process cannot
write itself comes from the parent: timeout (it ran past its time), oom_killed (the cgroup's
own OOM counter / events rose), killed (another signal, named). Nothing is inferred from
stderr text, and a SIGKILL is an OOM only when the cgroup says so.
"""

from __future__ import annotations

import json
import os
import signal
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.api import BudgetError, ColibriError, atomic_write_text, read_small_json
from tuner.results.result import TrialStatus

KINDS = typing.get_args(TrialStatus)  # ok, over_budget, oom_killed, killed, timeout, crashed, bad_config


@dataclass
class Outcome:
    kind: str
    error: str = ""  # one line for people
    exception: str = ""  # crashed: the exception's type
    signal: str = ""  # killed / oom_killed: the signal's name
    metrics: dict = field(default_factory=dict)  # ok: the bench JSON

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown outcome kind {self.kind!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def outcome_of_exception(exc: BaseException) -> Outcome:
    """How the trial process reports the exception that ends it."""
    if isinstance(exc, BudgetError):
        return Outcome("over_budget", error=str(exc))
    if isinstance(exc, ColibriError):
        return Outcome("bad_config", error=str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Outcome("killed", error="interrupted", signal=str(exc) or "SIGINT")
    message = " ".join(str(exc).split())[:500]
    return Outcome("crashed", error=f"{type(exc).__name__}: {message}" if message else type(exc).__name__,
                   exception=type(exc).__name__)


def _is_outcome_file(path) -> bool:
    """A previous outcome record (what `bench --outcome` may replace): a JSON object whose kind is
    one of KINDS and that carries the record's other keys."""
    data = read_small_json(Path(path))
    return (isinstance(data, dict) and data.get("kind") in KINDS
            and all(k in data for k in ("error", "exception", "signal", "metrics")))


OUTCOME_FILE = _is_outcome_file


def write_outcome(path: str | os.PathLike, outcome: Outcome) -> None:
    atomic_write_text(path, json.dumps(outcome.to_dict(), default=str) + "\n")


def read_outcome(path: str | os.PathLike) -> Outcome | None:
    """The record the trial process left, or None if it left none (or one we cannot read)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return Outcome(**{k: data[k] for k in ("kind", "error", "exception", "signal", "metrics") if k in data})
    except (OSError, ValueError, TypeError):
        return None


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def classify(returncode: int, *, timed_out: bool, oom_killed: bool, record: Outcome | None,
             timeout: float | None, limit_bytes: int | None) -> Outcome:
    """One outcome from the process's exit, the cgroup's OOM evidence and the record it wrote."""
    if timed_out:
        return Outcome("timeout", error=f"timed out after {timeout:.0f} s" if timeout else "timed out")
    if returncode < 0:  # died of a signal: only the kernel can say which and why
        name = signal_name(returncode)
        if oom_killed:
            limit = f" {limit_bytes / 2**20:.0f} MiB" if limit_bytes else ""
            return Outcome("oom_killed", signal=name,
                           error=f"killed ({name}) by the OOM killer: the trial's memory cgroup{limit} "
                                 f"counted an OOM kill")
        return Outcome("killed", signal=name, error=f"killed by {name} (the cgroup counted no OOM kill)")
    if record is not None:
        if record.kind == "ok" and returncode != 0:
            return Outcome("crashed", error=f"exit status {returncode} after reporting success")
        return record
    return Outcome("crashed", error=f"exit status {returncode} without an outcome record")
