"""A tune run directory, read back through its files: result.json, profile.json, study.db.

The report, `colibri profile export` and `colibri compare` all start here, so they depend on the
documented files (docs/TUNING.md) and not on the tuner's internals. Problems are the input's
fault and come back as one ColibriError line.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.errors import ColibriError

RESULT_MAX_BYTES = 64 << 20  # a result.json is a few hundred KiB; anything far bigger is not ours


class RunDirError(ColibriError):
    pass


@dataclass
class RunDir:
    path: Path
    result: dict
    profile: object | None = None  # tuner.probe.HardwareProfile, when profile.json is there
    _study: object | None = field(default=None, repr=False)
    storage: str | None = None

    @property
    def study(self):
        """The Optuna study (loaded on first use): study.db, or the storage URL given."""
        if self._study is None:
            self._study = load_study(self.path, self.result, self.storage)
        return self._study

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
        if number is None or not path.is_file():
            return {}
        with open(path, newline="", encoding="utf-8") as f:
            for row in csv.DictReader(f):
                if row.get("number") == str(number):
                    return row
        return {}


def is_run_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / "result.json").is_file()


def open_run(path: str | Path, study=None, storage: str | None = None) -> RunDir:
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    result_path = path / "result.json"
    if not result_path.is_file():
        raise RunDirError(f"{path}: no result.json (not a finished `colibri tune` run directory)")
    from tuner.results.result import TuneResult
    # The one result schema, strictly; a result of the version before is read migrated, so every
    # reader below sees the current fields.
    result = TuneResult.from_dict(read_json(result_path, RESULT_MAX_BYTES), source=str(result_path)).to_dict()
    profile = None
    if (path / "profile.json").is_file():
        from tuner.probe import load_profile
        profile = load_profile(path / "profile.json")
    return RunDir(path=path, result=result, profile=profile, _study=study, storage=storage)


def load_study(path: Path, result: dict, storage: str | None = None):
    import optuna
    url = storage
    if url is None:
        db = path / "study.db"
        if not db.is_file():
            raise RunDirError(f"{path}: no study.db (a study in PostgreSQL? pass its URL with --storage)")
        url = f"sqlite:///{db}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = (result.get("study") or {}).get("name")
    try:
        names = optuna.study.get_all_study_names(url)
        if name not in names:
            if len(names) != 1:
                raise RunDirError(f"{path}: study {name!r} is not in the storage (it holds {names})")
            name = names[0]
        return optuna.load_study(study_name=name, storage=url)
    except RunDirError:
        raise
    except Exception as exc:  # a corrupt or foreign database: say so in one line
        first = (str(exc).strip().splitlines() or [""])[0][:160]  # SQLAlchemy appends SQL and a URL
        raise RunDirError(f"{path}: cannot open the study ({type(exc).__name__}: {first})") from None


def read_json(path: Path, max_bytes: int):
    """Parse a JSON file no bigger than max_bytes; NaN/Infinity and duplicate keys are refused."""
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise RunDirError(f"{path}: {size} bytes is over the {max_bytes}-byte limit")
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise RunDirError(f"cannot read {path}: {exc.strerror or exc}") from None
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
