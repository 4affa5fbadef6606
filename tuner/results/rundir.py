"""A tune run directory, read back through its files: result.json, profile.json, study.db.

The report, `colibri profile export` and `colibri compare` all start here, so they depend on the
documented files (docs/TUNING.md) and not on the tuner's internals. Problems are the input's
fault and come back as one ColibriError line.
"""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from engine.api import ColibriError, printable, read_input, read_text_input
from tuner.probe import load_profile
from tuner.probe.hardware_profile import HardwareProfile
from tuner.results.result import TuneResult
from tuner.results.trial_record import TRIAL_SCHEMA, TrialRecord

RESULT_MAX_BYTES = 64 << 20  # a result.json is a few hundred KiB; anything far bigger is not ours


class RunDirError(ColibriError):
    pass


@dataclass
class RunDir:
    """A run directory read back: its result as the typed TuneResult (strictly loaded, older
    versions migrated), its profile, and its study's trials as TrialRecords."""

    path: Path
    tune: TuneResult
    profile: HardwareProfile | None = None  # when profile.json is there
    _study: object | None = field(default=None, repr=False)
    storage: str | None = None

    @property
    def study(self):
        """The Optuna study (loaded on first use): study.db, or the storage URL given."""
        if self._study is None:
            self._study = load_study(self.path, self.tune, self.storage)
        return self._study

    def trials(self) -> list[TrialRecord]:
        """The study's measured trials (those with a record), typed, in trial-number order."""
        return [TrialRecord.from_attrs(t.user_attrs)
                for t in sorted(self.study.get_trials(deepcopy=False), key=lambda t: t.number)
                if t.user_attrs.get("schema") == TRIAL_SCHEMA]

    @property
    def has_study(self) -> bool:
        return self._study is not None or (self.path / "study.db").is_file() or bool(self.storage)

    def trial_attrs(self, number: int | None) -> dict:
        """user_attrs of one trial (its bench metrics among them); {} when it is not there."""
        if number is None or not self.has_study:
            return {}
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number:
                return dict(t.user_attrs)
        return {}

    def trial_row(self, number: int | None) -> dict:
        """The trials.csv row of one trial: the figures without needing the study."""
        path = self.path / "trials.csv"
        if number is None or not os.path.lexists(path):
            return {}
        return next((row for row in read_trials_csv(path) if row.get("number") == str(number)), {})


def read_trials_csv(path: Path) -> list[dict]:
    """A run's trials.csv as rows: a regular file under the cap, strict UTF-8 text, parseable CSV.
    A binary or truncated file is one RunDirError line, not a UnicodeDecodeError or csv.Error."""
    text = read_text_input(path, "trials.csv", RunDirError)
    if "\x00" in text:
        raise RunDirError(f"{path}: trials.csv holds NUL bytes: not a CSV file")
    try:
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    except csv.Error as exc:
        raise RunDirError(f"{path}: not a valid CSV file ({exc})") from None
    if rows and "number" not in rows[0]:
        raise RunDirError(f"{path}: no 'number' column: not a colibri trials.csv")
    return rows


def is_run_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "result.json").is_file()


def open_run(path: str | Path, study=None, storage: str | None = None) -> RunDir:
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    result_path = path / "result.json"
    if not result_path.is_file():
        raise RunDirError(f"{path}: no result.json (not a finished `colibri tune` run directory)")
    # The one result schema, strictly; a result of the versions before is read migrated, so every
    # reader sees the current fields.
    data = read_json(result_path, RESULT_MAX_BYTES)
    check_schema_against_content(data, str(result_path))
    tune = TuneResult.from_dict(data, source=str(result_path))
    profile = None
    if (path / "profile.json").is_file():
        profile = load_profile(path / "profile.json")
    return RunDir(path=path, tune=tune, profile=profile, _study=study, storage=storage)


# What each result version added (tuner/results/result.py), as paths into result.json; "*" is
# every item of a list, CANDIDATE every candidate (recommended, baseline, defaults, candidates[*]).
CANDIDATE = "candidate"
ADDED_IN = {
    "colibri.tune/2": [("quant",), ("quality",)],
    "colibri.tune/3": [("defaults",), ("gain_over_defaults",), ("workload",),
                       *[("study", k) for k in ("measured_trials", "re_proposals", "distinct_points", "explored",
                                                "stop_reason", "measuring_seconds", "measuring_share")],
                       (CANDIDATE, "confirmed", "request_s"), (CANDIDATE, "runs", "*", "request_s")],
    "colibri.tune/4": [(CANDIDATE, "quality")],
    "colibri.tune/5": [("reproduce",), ("cost_model",),
                       *[("workload", k) for k in ("temperature", "top_p", "seed", "cycle_tokens")]],
    "colibri.tune/6": [*[(CANDIDATE, "confirmed", k) for k in ("goodput_rps", "goodput_min", "goodput_max",
                                                                "ttft_p95_s", "tpot_p95_s")],
                       *[(CANDIDATE, "runs", "*", k) for k in ("goodput_rps", "slo_met", "ttft_p95_s", "tpot_p95_s",
                                                               "queue_wait_p95_s", "aggregate_tok_s")],
                       *[("workload", k) for k in ("slo_ttft_s", "slo_tpot_s", "span_s", "sequences")]],
}
VERSIONS = ["colibri.tune/1", *ADDED_IN]


def check_schema_against_content(data, source: str) -> None:
    """A result.json whose schema names a version older than its content is refused: it was
    mislabelled or edited, and migrating it (which fills in what the newer versions added) would
    silently keep or overwrite the newer fields. (A current one missing its version's fields is
    refused by the strict decoder: "missing key".)"""
    if not isinstance(data, dict) or data.get("schema") not in VERSIONS[:-1]:
        return
    declared = data["schema"]
    found = []
    for version in VERSIONS[VERSIONS.index(declared) + 1:]:
        names = sorted(".".join(p).replace(".*", "[]") for p in ADDED_IN[version] if _holds(data, p))
        if names:
            found.append(f"{', '.join(names[:4])}{', ...' if len(names) > 4 else ''} (added in {version})")
    if found:
        raise RunDirError(f"{source}: schema says {declared} but it holds {'; '.join(found)}: "
                          "a mislabelled or edited result")


def _holds(node, path: tuple[str, ...]) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == CANDIDATE and isinstance(node, dict):
        candidates = [node.get(k) for k in ("recommended", "baseline", "defaults")]
        candidates += node.get("candidates") if isinstance(node.get("candidates"), list) else []
        return any(_holds(c, rest) for c in candidates)
    if head == "*":
        return isinstance(node, list) and any(_holds(item, rest) for item in node)
    return isinstance(node, dict) and head in node and _holds(node[head], rest)


def load_study(path: Path, result: TuneResult, storage: str | None = None):
    import optuna
    url = storage
    if url is None:
        db = path / "study.db"
        if not db.is_file():
            raise RunDirError(f"{path}: no study.db (a study in PostgreSQL? pass its URL with --storage)")
        url = f"sqlite:///{db}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = result.study.name
    try:
        names = optuna.study.get_all_study_names(url)
        if name not in names:
            # Never another study in its place: a study.db copied from another run would render
            # that run's trials under this run's result.
            raise RunDirError(f"{path}: study {printable(name)!r} of result.json is not in the storage "
                              f"(it holds {', '.join(printable(n) for n in names[:5]) or 'none'}): not this run's study")
        study = optuna.load_study(study_name=name, storage=url)
        check_study_belongs(path, result, study)
        return study
    except RunDirError:
        raise
    except Exception as exc:  # a corrupt or foreign database: say so in one line
        first = (str(exc).strip().splitlines() or [""])[0][:160]  # SQLAlchemy appends SQL and a URL
        raise RunDirError(f"{path}: cannot open the study ({type(exc).__name__}: {first})") from None


def check_study_belongs(path: Path, result: TuneResult, study) -> None:
    """The study is the one result.json was written from: study names repeat across runs (model,
    budget, objective), so a study.db from another run of the same model has the same name.
    Its directions, at least the trials result.json counts, and the recommended trial's params
    equal to the recommended config are what only this run's study has."""
    info = result.study
    directions = [d.name.lower() for d in study.directions]
    if info.directions and [str(d).lower() for d in info.directions] != directions:
        raise RunDirError(f"{path}: the study's directions {directions} are not result.json's "
                          f"{info.directions}: not this run's study")
    trials = study.get_trials(deepcopy=False)
    if len(trials) < info.trials:
        raise RunDirError(f"{path}: the study holds {len(trials)} trial(s), result.json counts {info.trials}: "
                          "not this run's study (or it was cut short)")
    rec = result.recommended
    if rec is None or rec.trial_number is None:
        return
    number, config = rec.trial_number, rec.config
    trial = next((t for t in trials if t.number == number), None)
    if trial is None:
        raise RunDirError(f"{path}: the recommended trial #{number} is not in the study: not this run's study")
    differ = [k for k, v in trial.params.items() if k in config and not _same(v, config[k])]
    if differ:
        raise RunDirError(f"{path}: trial #{number} of the study has {differ[0]}={trial.params[differ[0]]!r}, "
                          f"result.json recommends {config[differ[0]]!r}: not this run's study")


def _same(a, b, rel: float = 1e-9) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)
    return a == b


def read_json(path: Path, max_bytes: int):
    """Parse a JSON file no bigger than max_bytes; NaN/Infinity and duplicate keys are refused."""
    raw = read_input(path, "result.json", RunDirError, limit=max_bytes)
    try:
        return strict_loads(raw)
    except ValueError as exc:
        raise RunDirError(f"{path}: {exc}") from None


def strict_loads(raw: bytes):
    """JSON from untrusted bytes: UTF-8 only, no NaN/Infinity, no duplicate keys (a second value
    for a key is how a crafted file shows one figure to one reader and another to the next).
    Every problem is a ValueError whose message is one line."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant, object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out
