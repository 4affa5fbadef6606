"""Progress of long work on stderr, through tqdm.

On a terminal: one line, rewritten in place. Anywhere else (a pipe, a log file, CI): a plain
line at most every SPARSE_S seconds plus the last one, instead of tqdm's stream of
carriage-return updates that a log file keeps as hundreds of fragments.
"""

from __future__ import annotations

import sys

SPARSE_S = 10.0  # seconds between lines when stderr is not a terminal

# The stream whose last write was a line rewritten in place ("\r ... 7/22") without its newline,
# or None. An error printed then would be glued onto that line; `end_open_line` ends it first.
_open_line: list = [None]


def rewrite_line(stream, text: str, last: bool) -> None:
    """`text` over the current line of `stream`; `last`: end the line."""
    print("\r" + text, end="\n" if last else "", file=stream, flush=True)
    _open_line[0] = None if last else stream


def end_open_line(stream) -> None:
    """Before a message on `stream`: end a progress line left open there."""
    if _open_line[0] is stream:
        print(file=stream, flush=True)
    _open_line[0] = None


class _Lines:
    """A file for tqdm that turns each in-place update into one whole line."""

    def __init__(self, stream):
        self.stream = stream
        self.encoding = getattr(stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> None:
        for line in text.replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return False


class Progress:
    """A tqdm bar: `update(n)` for amounts (bytes), `step(i, n, label)` for numbered steps.

    The bar is made on first use, once its total is known (a step bar learns it from step()).
    """

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "it", enabled: bool = True,
                 unit_scale: bool = False, stream=None):
        stream = stream or sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        self._kwargs = dict(total=total, desc=desc, unit=unit, unit_scale=unit_scale,
                            unit_divisor=1024 if unit == "B" else 1000, disable=not enabled, leave=True,
                            file=stream if tty else _Lines(stream), mininterval=0.1 if tty else SPARSE_S,
                            maxinterval=10.0 if tty else SPARSE_S, dynamic_ncols=tty, ascii=not tty)
        self.bar = None

    def _open(self, total: int | None = None):
        if self.bar is None:
            from tqdm import tqdm
            if total is not None:
                self._kwargs["total"] = total
            self.bar = tqdm(**self._kwargs)
        return self.bar

    def update(self, n: int) -> None:
        self._open().update(n)

    def step(self, i: int, n: int, label: str) -> None:
        """Step i of n (1-based) is starting: the bar shows the steps done and this one's label."""
        bar = self._open(total=n)
        bar.total = n
        bar.set_postfix_str(label, refresh=False)
        bar.update(i - 1 - bar.n)

    def close(self) -> None:
        bar = self._open()
        if bar.total is not None and bar.n < bar.total and not bar.disable:
            bar.update(bar.total - bar.n)  # the last step has finished
        bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        elif self.bar is not None:  # interrupted: leave the bar where it stopped
            self.bar.close()
