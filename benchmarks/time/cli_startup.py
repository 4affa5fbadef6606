"""What one `colibri` process costs before it does anything: `python -m colibri.cli ARGS` from one or
more checkouts, alternated run by run (so a noisy box loads each alike), CPU (user + sys, the
child's own) and wall time, median [min, max].

A tune starts one `colibri bench` process per trial (tuner/search/trial.py), and the test suite
hundreds of `colibri` processes, so this start-up is paid per trial. Compare two commits with a
second checkout (`git worktree add ../before <commit>`):

    python benchmarks/time/cli_startup.py --tree . --tree ../before --repeats 8 --args "bench --help"
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks.benchkit; the measured trees get their own PYTHONPATH

from benchmarks.benchkit import conditions, emit, fmt_spread, spread  # noqa: E402


def one_run(tree: Path, args: list[str]) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of `python -m colibri.cli ARGS` run from `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "colibri.cli", *args], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="a checkout to run from (repeatable; default: this one)")
    p.add_argument("--args", default="bench --help", help="the colibri arguments (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    trees = [t.resolve() for t in (opts.tree or [ROOT])]
    args = shlex.split(opts.args)
    cpu: dict[Path, list[float]] = {t: [] for t in trees}
    wall: dict[Path, list[float]] = {t: [] for t in trees}
    for i in range(opts.repeats):
        for tree in trees:
            c, w = one_run(tree, args)
            cpu[tree].append(c)
            wall[tree].append(w)
        print(f"round {i + 1}/{opts.repeats}", file=sys.stderr, flush=True)
    rows = [{"tree": str(t), "cpu_s": spread(cpu[t]), "wall_s": spread(wall[t]), "runs": opts.repeats} for t in trees]
    cond = conditions(args=" ".join(args), repeats=opts.repeats, alternated=len(trees) > 1)
    emit("cli_startup", rows, cond, opts.json, [
        ("tree", lambda r: r["tree"]),
        ("CPU s: median (min-max)", lambda r: fmt_spread(r["cpu_s"], 2)),
        ("wall s: median (min-max)", lambda r: fmt_spread(r["wall_s"], 2))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
