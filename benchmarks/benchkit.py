"""What every benchmark script shares: the lock, the conditions block, one JSON output, one table printer.

- `bench_lock(path)`: the shared benchmark lock, held for one measured step. On the team's box
  the convention is `quiet bench CMD` (an exclusive flock on /tmp/colibri-bench.lock held by the
  shell around the whole command); `--lock PATH` is the finer one, held per step by the script.
  Use one or the other on a given file, never both: the script's own flock on the file the
  shell already holds would wait for itself.
- `conditions(**extra)`: the machine (CPU model and the kernel-relevant flags, cores, RAM),
  commit, UTC date, memory cgroup, load average and torch build, plus what the caller adds
  (io mode, budget, repeats, cold/warm). docs/BENCHMARKS.md quotes these.
- `emit(tool, rows, conditions, as_json, columns, notes)`: prints either one JSON document,
  {"schema": "colibri.bench/1", "tool", "conditions", "rows", "notes"}, or a markdown table of
  the rows under a one-line summary of the conditions — the same two printers in every tool.
- `run_conditions(args, **extra)`: conditions() with the run's own flags (an argparse Namespace)
  added, for the tools whose flags are their conditions.
- `spread(values)`: the median and its min-max, the way every headline figure is quoted.
- `add_run_flags(parser, budget=..., tokens=...)`: the measurement flags every tool spells alike.
- `add_output_flags(parser)`: `--json` (the one document) and `--lock FILE` (bench_lock per step).
- `child_json(tool, argv, budget, timeout, what, cwd)`: a tool's child half (this script with --child)
  run in a memory cgroup at the budget, its last stdout line the JSON it reports.
- `table_rows(lines, **tags)` and `Tables`: for a tool whose text product is the markdown tables it
  already builds line by line: the same rows, keyed by the table's header, become the JSON rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Iterable, Sequence

import psutil

from engine.api import git_commit
from tuner.probe.system import cpu_info
from tuner.sandbox import detect_memory_cgroup

SCHEMA = "colibri.bench/1"


@contextlib.contextmanager
def bench_lock(path: str | None):
    """Hold the lock at `path` for one step (a build, a conversion, one measured run); None: no lock."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def conditions(**extra) -> dict:
    """The conditions block of one run: machine, commit, date, cgroup, load, plus the caller's own."""
    cpu = cpu_info()
    cgroup = detect_memory_cgroup()
    # torch is named only when the tool loaded it (it measured the engine); a pure I/O tool does
    # not pay the import for a line that would not describe its figures.
    torch = sys.modules.get("torch")
    torch_build = None if torch is None else (
        f"{torch.__version__} ({'CPU' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda})")
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": git_commit(),
        "machine": {"cpu": cpu.model, "logical_cores": cpu.logical_cores, "physical_cores": cpu.physical_cores,
                    "flags": [f for f in cpu.flags if f.startswith(("avx512", "amx"))],
                    "ram_bytes": psutil.virtual_memory().total},
        "cgroup": f"v{cgroup.version}" if cgroup.available else f"none ({cgroup.reason})",
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch_build,
        **extra,
    }


def run_conditions(args, **extra) -> dict:
    """conditions() plus the run's flags: every argparse option but the output switch (--json) and
    the child half's (--child), which say how the figures are printed, not how they were measured."""
    flags = {k: v for k, v in vars(args).items() if k not in ("json", "child")}
    return conditions(**flags, **extra)


def summary_line(cond: dict) -> str:
    """The conditions as the one line above a table."""
    m = cond["machine"]
    fixed = (f"{cond['date']}, commit {cond['commit']}, {m['cpu']} ({m['logical_cores']} vCPU, "
             f"{m['ram_bytes'] / 2**30:.1f} GiB, {'+'.join(m['flags']) or 'no AVX-512'}), cgroup {cond['cgroup']}, "
             f"load {cond['load_avg_1m']}")
    known = {"date", "commit", "machine", "cgroup", "load_avg_1m", "torch"}
    rest = ", ".join(f"{k} {v}" for k, v in cond.items() if k not in known and v is not None)
    return fixed + (f"; {rest}" if rest else "")


def spread(values: Iterable[float]) -> dict | None:
    """{"median", "min", "max", "n"} of the values (None when there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def median_interval(values: Iterable[float], level: float = 0.9, draws: int = 2000,
                    seed: int = 0) -> tuple[float, float] | None:
    """The percentile bootstrap interval of the values' median: where the median of as many values drawn
    again from these falls `level` of the time. For paired ratios it is the comparison's noise band (a
    twin control's band says what "within the noise" means on this box, the day it ran). Seeded: the
    same values give the same interval. None for fewer than two values."""
    vals = [v for v in values if v is not None]
    if len(vals) < 2:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(vals, k=len(vals))) for _ in range(draws))
    tail = int(draws * (1 - level) / 2)
    return medians[tail], medians[draws - 1 - tail]


def fmt_interval(interval: tuple[float, float] | None, digits: int = 3) -> str:
    """'lo-hi', or '-' where there is none."""
    return f"{interval[0]:.{digits}f}-{interval[1]:.{digits}f}" if interval else "-"


def fmt_spread(s: dict | None, digits: int = 3) -> str:
    """'median (min-max)', the form every table quotes a repeated figure in."""
    if not s:
        return "-"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


Column = tuple[str, Callable[[dict], object]]  # (header, the cell of one row)


def md_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    """A markdown table: one line per row, cells from each column's function."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(get(row)) for _, get in columns) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def emit(tool: str, rows: list[dict], cond: dict, as_json: bool, columns: Sequence[Column],
         notes: dict | None = None, out=None) -> None:
    """Print the run: one JSON document (as_json) or the summary line, the notes (one
    "name: value" line each: a figure that is not a row, such as a per-second trace) and a
    markdown table."""
    out = out or sys.stdout
    if as_json:
        doc = {"schema": SCHEMA, "tool": tool, "conditions": cond, "rows": rows, "notes": notes or {}}
        json.dump(doc, out, indent=2, default=str)
        out.write("\n")
        return
    text = [summary_line(cond), ""]
    text += [f"{k}: {v}" for k, v in (notes or {}).items()] + ([""] if notes else [])
    out.write("\n".join(text) + "\n" + md_table(rows, columns) + "\n")


RUN_FLAGS = {"budget": "the memory budget (and the cold trials' cgroup limit)", "tokens": "decode tokens per repeat",
             "repeats": "repeats per measurement (the median is quoted)", "prompt_tokens": "prompt tokens",
             "threads": "compute threads"}


def add_run_flags(parser, **defaults) -> None:
    """The measurement flags the tools share (--budget, --tokens, --repeats, --prompt-tokens,
    --threads), each with the tool's own default; only those given a default are added."""
    for name, default in defaults.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, default=default, type=type(default), help=f"{RUN_FLAGS[name]} (default {default})")


def refuse(tool: str, message: str) -> int:
    """The one-line refusal every tool prints for bad input (and the exit status it returns)."""
    print(f"{tool}: error: {message}", file=sys.stderr)
    return 2


def add_output_flags(parser, lock: bool = True) -> None:
    """--json (print one colibri.bench/1 document instead of the text) and, for a tool that times
    anything, --lock FILE (bench_lock around each measured step; leave it out under `quiet bench`)."""
    parser.add_argument("--json", action="store_true", help="print one colibri.bench/1 JSON document")
    if lock:
        parser.add_argument("--lock", default=None,
                            help="flock this file around each measured step (not under `quiet bench`)")


def table_rows(lines: Sequence[str], **tags) -> list[dict]:
    """The rows of a markdown table (a header line, the |---| rule, a line per row) as dicts keyed
    by the header's cells, each with `tags` added (which table, which run): a tool that builds its
    tables as text gives --json the same rows."""
    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip().strip("|").split("|")]
    lines = [ln for ln in lines if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    header = cells(lines[0])
    rows = []
    for ln in lines[2:]:
        vals = cells(ln)
        rows.append({**tags, **{h: (v if v != "" else None) for h, v in zip(header, vals + [""] * len(header))}})
    return rows


class Tables:
    """The printers of a tool whose text product is a report of markdown tables: in text mode
    `line` and `table` print as the tool always has; with --json they print nothing and keep the
    tables' rows (table_rows, tagged with the table's name) and the notes for one `emit` at the end."""

    def __init__(self, as_json: bool):
        self.as_json, self.rows, self.notes = as_json, [], {}

    def line(self, text: str = "") -> None:
        if not self.as_json:
            print(text, flush=True)

    def table(self, name: str, lines: Sequence[str], **tags) -> None:
        self.rows += table_rows(lines, table=name, **tags)
        self.line("\n".join(lines))

    def note(self, key: str, value, text: str | None = None) -> None:
        """A figure that is not a row: kept under `key` for --json, printed as `text` (when given) otherwise."""
        self.notes[key] = value
        if text is not None:
            self.line(text)

    def done(self, tool: str, cond: dict) -> None:
        if self.as_json:
            emit(tool, self.rows, cond, True, [], notes=self.notes)


def child_json(tool: str, argv: list[str], budget: str, timeout: float, what: str, cwd,
               env: dict | None = None) -> dict:
    """Run a tool's child half (argv: the script with --child and its flags) in a memory cgroup at
    `budget` ("0": no limit), and return the JSON of its last stdout line with `cgroup` (whether the
    limit held it) added. A failed child stops the run: one line naming `what` and the child's error.
    env: the child's environment (another tree's: benchmarks/trees.py tree_env), else this one's."""
    from engine.api import parse_size
    from tuner.sandbox import run_limited
    res = run_limited(argv, parse_size(budget) or None, timeout=timeout, env=env, cwd=cwd)
    if res.returncode != 0:
        raise SystemExit(f"{tool}: child failed ({what}, oom={res.oom_killed}): {res.stderr.strip()[-600:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["cgroup"] = res.limited
    return out


def cold_read_bandwidth(model: str, request: int, threads: int, total: int) -> float:
    """Bytes/s of O_DIRECT reads of `request` bytes over the model's shards (pages dropped first)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    files = sorted(Path(model).glob("*.safetensors"))
    jobs = []
    for f in files:
        size = f.stat().st_size // 4096 * 4096
        jobs += [(f, off) for off in range(0, size - request, request)]
    jobs = jobs[:: max(1, len(jobs) // max(1, total // request))][: total // request]
    if not jobs:
        raise SystemExit(f"error: {model}'s shards are smaller than one {request}-byte request")
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)

    def read(job):
        f, off = job
        buf = mmap.mmap(-1, request)
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [buf], off)
        finally:
            os.close(fd)
            buf.close()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(read, jobs))
    return done / (time.perf_counter() - t0)
