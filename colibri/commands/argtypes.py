"""argparse types with ranges: every numeric flag of every command is parsed by one of these.

A value outside its range is refused while the arguments are parsed, before anything is read,
written or started, with one line naming the flag (argparse adds `argument --tokens:`) and the
range. NaN and infinities are refused everywhere: `float("nan")` compares false with every bound,
so a plain `type=float` with a later `x < 0` check lets it through.

Each factory returns a callable for `add_argument(type=...)`; its `range_text` says what it
accepts (docs/VALIDATION.md lists them per flag) and `tests/test_argtypes.py` checks both ends.
"""

from __future__ import annotations

import argparse
import math
import re

from engine.api import OUTPUT_KINDS, ColibriError, parse_size
from tuner.search.budget import parse_duration

# Python refuses int() of more than 4300 digits with a ValueError whose text talks about
# sys.set_int_max_str_digits; anything near that long is not a count a user meant.
_MAX_INT_DIGITS = 40
_INT_RE = re.compile(r"^\s*[+-]?\d+\s*$")

# 2**70 overflowed torch.Generator.manual_seed (64-bit); 32 bits leave room for the seed + N
# that tune and calibration derive per trial, and are what every seeded tool accepts.
SEED_MAX = 2**32 - 1


def _range_text(lo, hi, lo_open: bool = False) -> str:
    def num(x):
        return f"{x:g}" if isinstance(x, float) else str(x)
    if hi is None:
        return f"> {num(lo)}" if lo_open else f">= {num(lo)}"
    return f"in {'(' if lo_open else '['}{num(lo)}, {num(hi)}]"


def _typed(func, name: str, range_text: str, lo=None, hi=None):
    func.__name__ = name  # argparse names the type in its "invalid <type> value" messages
    func.range_text = range_text
    func.lo, func.hi = lo, hi  # the closed bounds (None: unbounded), for docs and tests
    return func


def int_in(lo: int, hi: int | None = None, name: str = "integer"):
    """An integer in [lo, hi] (hi None: no upper bound beyond the digit limit)."""
    text = _range_text(lo, hi)

    def parse(value: str) -> int:
        if not _INT_RE.match(value) or len(value.strip().lstrip("+-")) > _MAX_INT_DIGITS:
            raise argparse.ArgumentTypeError(f"{value!r}: expected an integer {text}")
        n = int(value)
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(f"{n}: must be {text}")
        return n
    return _typed(parse, name, text, lo, hi)


def int_list(lo: int, hi: int | None = None):
    """Comma-separated integers, each in [lo, hi], distinct, in the order given: e.g. 1,2,4,8."""
    one = int_in(lo, hi)
    text = f"comma-separated integers {_range_text(lo, hi)}"

    def parse(value: str) -> tuple[int, ...]:
        parts = value.split(",")
        if len(parts) > 64:
            raise argparse.ArgumentTypeError(f"{value[:40]!r}...: at most 64 values")
        try:
            numbers = tuple(one(p) for p in parts)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{value!r}: expected {text}") from None
        if len(set(numbers)) != len(numbers):
            raise argparse.ArgumentTypeError(f"{value!r}: a value is given twice")
        return numbers
    return _typed(parse, "integer list", text, lo, hi)


def positive_int(hi: int | None = None):
    return int_in(1, hi, "positive integer")


def nonneg_int(hi: int | None = None):
    return int_in(0, hi, "non-negative integer")


def seed():
    return int_in(0, SEED_MAX, "seed")


def finite_float(lo: float | None = None, hi: float | None = None, lo_open: bool = False,
                 zero_ok: bool = False, name: str = "number"):
    """A finite number in [lo, hi] ((lo, hi] with lo_open); zero_ok also lets exactly 0 through
    (temperature: 0 = greedy, else at least 0.01)."""
    if lo is None:
        text = "finite" if hi is None else f"<= {hi}"
    else:
        text = _range_text(lo, hi, lo_open)
    if zero_ok:
        text = f"0 or {text}"

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: expected a number {text}") from None
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{value!r}: must be a finite number ({text})")
        if zero_ok and x == 0:
            return 0.0
        below = lo is not None and (x <= lo if lo_open else x < lo)
        if below or (hi is not None and x > hi):
            raise argparse.ArgumentTypeError(f"{value}: must be {text}")
        return x
    return _typed(parse, name, text, 0.0 if zero_ok else lo, hi)


# Far above any machine, low enough that no later arithmetic or syscall (a cgroup limit, a timer)
# overflows: 1 PiB, a week per trial, a month per tune.
SIZE_MAX = 1 << 50
TIMEOUT_MAX_S = 7 * 86400
DURATION_MAX_S = 30 * 86400


def _unsigned(value: str, parser, sign: str):
    """parser(value), its ColibriError as argparse's error; a leading "-" is refused as a sign
    (see size), not handed to the parser."""
    if value.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"{value}: must be {sign}")
    try:
        return parser(value)
    except ColibriError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size(zero_ok: bool = False, lo: int = 1, hi: int = SIZE_MAX, zero_means: str = ""):
    """A byte size ('1GiB', '512M', '4096') -> int bytes, positive (zero_ok: or 0).

    `--ram-budget -1GiB` reaches here as a value (ColibriArgumentParser reads "-<digit>..." as a
    value, not an unknown option), so a negative size gets the same answer as `--ram-budget=-1GiB`.
    """
    text = _range_text(lo, hi) + " bytes"
    if zero_ok:
        text = f"0 ({zero_means}) or in [1, {hi}] bytes" if zero_means else f"in [0, {hi}] bytes"

    def parse(value: str) -> int:
        n = _unsigned(value, parse_size, "positive or 0" if zero_ok else "positive")
        if n == 0 and zero_ok:
            return 0
        if n == 0 or n < lo:
            raise argparse.ArgumentTypeError(f"{value}: must be positive" + ("" if n == 0 else f" and >= {lo} bytes"))
        if hi is not None and n > hi:
            raise argparse.ArgumentTypeError(f"{value}: must be at most {hi} bytes")
        return n
    return _typed(parse, "size", text, 0 if zero_ok else lo, hi)


def duration(hi_s: float = DURATION_MAX_S):
    """A positive duration ('10m', '90s', '1h30m', '45' = seconds) -> float seconds."""
    text = "positive" + (f", at most {hi_s:g} s" if hi_s else "")

    def parse(value: str) -> float:
        s = _unsigned(value, parse_duration, "positive")
        if not math.isfinite(s) or s <= 0:
            raise argparse.ArgumentTypeError(f"{value}: must be positive")
        if hi_s is not None and s > hi_s:
            raise argparse.ArgumentTypeError(f"{value}: must be at most {hi_s:g} s")
        return s
    return _typed(parse, "duration", text, 0.0, hi_s)


def seconds(hi_s: float = TIMEOUT_MAX_S):
    """A positive finite number of seconds (a timeout): `--timeout -1` is refused, not run and then
    reported as 'timed out after -1 s'."""
    return finite_float(0.0, hi_s, lo_open=True, name="seconds")


# --- options that name something a command writes ----------------------------------------------

def add_output_option(parser, *flags: str, kind: str, **kwargs):
    """Declare an option (or positional) that names something the command writes. `kind` is the
    rule of engine/base/output_target.py that the command checks it with, before any work
    (OUTPUT_KINDS: "file", "directory", "run directory", "in place", "scratch"). The action carries
    it, so tests/test_writer_guard.py can find every writer in the parsers, and fails on an option
    that says it writes but was added without this."""
    if kind not in OUTPUT_KINDS:
        raise ValueError(f"unknown output kind {kind!r} (one of {', '.join(OUTPUT_KINDS)})")
    action = parser.add_argument(*flags, **kwargs)
    action.output_kind = kind
    return action


# --- the parser -------------------------------------------------------------------------------

class ColibriArgumentParser(argparse.ArgumentParser):
    """argparse with two changes every colibri command needs.

    - A value that starts with '-' and a digit, '.', 'inf' or 'nan' is a value, not an option:
      argparse's own test only knows plain negative numbers, so `--ram-budget -1GiB` failed with
      "expected one argument" and `--temperature -inf` likewise. No colibri option looks like a
      number, so nothing is lost. (argparse keeps this test in a private attribute; it is the one
      knob it offers for it.)
    - An error is one line, `colibri run: error: argument --tokens: 0: must be >= 1 (see colibri
      run --help)`, like every other refusal of the CLI, instead of the usage block and then the
      error. Subparsers inherit the class.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\.?\d|inf|nan)", re.IGNORECASE)

    def parse_known_args(self, args=None, namespace=None):
        # Python 3.11's argparse drops a value of `--` (`--tokens=--`) and stores [] without
        # calling the type, so `bench --tokens=--` reached the engine as a list (found by
        # tests/test_fuzz_commands.py). An option that takes one value must have received one.
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if not action.option_strings or action.nargs is not None or action.const is not None:
                continue  # flags (store_true, ...) and multi-value options are not one-value options
            value = getattr(namespace, action.dest, None)
            appended = action.default == [] and isinstance(value, list)
            if (value == [] and action.default != []) or (appended and any(v == [] for v in value)):
                self.error(f"argument {'/'.join(action.option_strings)}: needs a value ('--' is not one)")
        return namespace, extras

    def error(self, message: str):
        one_line = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")
