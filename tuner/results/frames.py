"""The printers that go through pandas: CSV (trials.csv, compare's tables) and report.html's trial frame.

Apart from printers.py because pandas costs ~40 MiB of RSS and ~0.4 s to import, and every trial
is a `colibri bench` process whose RSS the memory plan charges as runtime overhead: a bench
process that never writes a CSV must not import it (tests/test_cli_dispatch.py checks).
"""

from __future__ import annotations

import io
from typing import Sequence

import pandas as pd

from tuner.results.printers import TRIAL_COLUMNS, trial_rows


def csv_text(rows: list[dict], columns: Sequence[str]) -> str:
    """CSV through pandas (the format people open it with); cells keep their Python types."""
    frame = pd.DataFrame(rows, columns=list(columns), dtype=object)
    buf = io.StringIO()
    frame.to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()


def trials_frame(trials) -> pd.DataFrame:
    """The trials as one pandas frame, trials.csv's columns in order (cells keep their types):
    trials.csv and report.html's table are both written from it."""
    return pd.DataFrame(trial_rows(trials), columns=list(TRIAL_COLUMNS), dtype=object)


def trials_csv(trials) -> str:
    buf = io.StringIO()
    trials_frame(trials).to_csv(buf, index=False, lineterminator="\n")
    return buf.getvalue()
