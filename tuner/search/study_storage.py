"""Where a study lives: run directory, storage URL (redacted for printing), resume checks,
the study's recorded settings, and the heartbeat that lets shared storages fail a dead worker.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from datetime import datetime
from pathlib import Path

import optuna
from optuna.trial import TrialState

from engine.api import ConfigError

STUDY_ATTR = "colibri"
HEARTBEAT_S = 20  # shared storages: a worker silent for GRACE_S has its RUNNING trial failed
GRACE_S = 120


def default_out(model_name: str, resume: bool, root: Path = Path("reports")) -> Path:
    """A new run gets a new, timestamped directory (so `make tune` twice never collides);
    --resume without --out continues the latest one for this model."""
    if resume:
        runs = sorted(p for p in root.glob(f"tune-{model_name}-*") if (p / "study.db").exists())
        if not runs:
            raise ConfigError(f"nothing to resume: no earlier run for {model_name!r} under {root}/ (pass --out DIR)")
        return runs[-1]
    return root / f"tune-{model_name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def redact_url(url: str) -> str:
    """A storage URL fit to print: the password replaced by ***."""
    return re.sub(r"(://[^:/@]+:)[^@]*@", r"\1***@", url)


def is_shared(url: str | None) -> bool:
    """Several processes may work on the study at once (anything but the default SQLite file)."""
    return url is not None and not url.startswith("sqlite")


# What the loser of the table-creation race is told: a table (PostgreSQL: "duplicate"; SQLite:
# "already exists") or Optuna's alembic version row (SQLite: "UNIQUE constraint failed") is there.
_CREATION_RACE = ("duplicate", "already exists", "unique constraint failed")


STORAGE_BACKENDS = ("sqlite", "postgresql", "mysql")  # the RDB backends Optuna supports


def check_url(url: str) -> None:
    """Refuse a malformed storage URL, or one of a database Optuna cannot use, in one line
    (before the run creates anything; opening it may still fail, also in one line)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise ConfigError(f"cannot open study storage {redact_url(str(url))!r}: not a database URL ({exc}); e.g. "
                          "sqlite:///study.db or postgresql://user@host/db") from None
    if parsed.get_backend_name() not in STORAGE_BACKENDS:
        raise ConfigError(f"cannot open study storage {redact_url(str(url))!r}: {parsed.get_backend_name()!r} is not a database "
                          f"Optuna can use ({', '.join(STORAGE_BACKENDS)})")


def open_storage(url: str, shared: bool):
    """An Optuna RDB storage, or one clear error naming the URL (password hidden)."""
    kwargs = {}
    if shared and not url.startswith("sqlite"):
        kwargs = dict(heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
    engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    # Whoever opens a new database first creates Optuna's tables, table by table, check then
    # create; a second process opening it meanwhile (a worker started at the same time, or just
    # a reader of a SQLite study such as a dashboard) loses the race and its CREATE fails on a
    # duplicate. A second attempt finds the tables made. (This was the intermittent failure of
    # the interrupt/kill/resume test, 4 runs in 30: docs/BENCHMARKS.md; tests/test_storage_race.py.)
    attempts = 4
    for attempt in range(attempts):
        try:
            with warnings.catch_warnings():
                # Heartbeats are "experimental" in Optuna's words; they are what fails a dead worker's trial.
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs, **kwargs)
        except Exception as exc:  # sqlalchemy and driver errors have no common base worth naming
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            if attempt + 1 < attempts and any(m in first.lower() for m in _CREATION_RACE):
                time.sleep(0.5 + attempt)
                continue
            raise ConfigError(f"cannot open study storage {redact_url(url)!r}: {first[:300]}") from None


def check_resume(storage, url: str, study_name: str, resume: bool, shared: bool) -> list[str]:
    """The study names in storage, after refusing to extend a study silently or resume nothing."""
    existing = optuna.study.get_all_study_names(storage)
    if study_name in existing and not resume and not shared:
        raise ConfigError(f"study {study_name!r} already exists in {redact_url(url)}; "
                          f"pass --resume to continue it, or choose another --out or --study-name")
    if resume and study_name not in existing:
        raise ConfigError(f"nothing to resume: no study {study_name!r} in {redact_url(url)} "
                          f"(studies there: {', '.join(existing) or 'none'})")
    return existing


def recorded_settings(storage, study_name: str) -> dict | None:
    return optuna.load_study(study_name=study_name, storage=storage).user_attrs.get(STUDY_ATTR)


def check_settings(study: optuna.Study, mine: dict) -> None:
    """A resumed or joined study must be about the same thing (the seed may differ)."""
    recorded = study.user_attrs.get(STUDY_ATTR)
    if recorded is None:
        study.set_user_attr(STUDY_ATTR, mine)
        return
    diff = [k for k in mine if k != "seed" and recorded.get(k) != mine[k]]
    if diff:
        detail = "; ".join(f"{k}: study has {recorded.get(k)!r}, this run {mine[k]!r}" for k in diff[:3])
        raise ConfigError(f"study {study.study_name!r} was made with other settings ({detail}); "
                          f"use the same settings or another --study-name")


def fail_unfinished(study: optuna.Study, shared: bool, log, when: str = "resume") -> None:
    """RUNNING trials nobody is measuring become FAIL (unmeasured), never fake figures."""
    if shared:
        optuna.storages.fail_stale_trials(study)
        return
    # SQLite is one process at a time: a RUNNING trial here was left by a killed run (on resume)
    # or by this one, interrupted between asking for a trial and measuring it.
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(t.number, state=TrialState.FAIL)
        log(f"{when}: trial {t.number} was cut short by the interruption; recorded as FAIL (unmeasured)")


class Heartbeat:
    """Shared storages only: tell the others this worker's RUNNING trial is alive, so a killed
    worker's trial is failed by `fail_stale_trials` instead of staying RUNNING forever."""

    def __init__(self, storage, trial, enabled: bool):
        self.enabled = enabled and hasattr(storage, "record_heartbeat")
        self.storage, self.trial = storage, trial
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.enabled:
            # Optuna exposes a trial's storage id only as `_trial_id`; its own optimize() uses it.
            trial_id = self.trial._trial_id
            self.storage.record_heartbeat(trial_id)

            def beat():
                while not self._stop.wait(HEARTBEAT_S):
                    try:
                        self.storage.record_heartbeat(trial_id)
                    except Exception:
                        pass

            self._thread = threading.Thread(target=beat, daemon=True, name="colibri-heartbeat")
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
