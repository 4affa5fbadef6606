"""Run a benchmark's child half inside one source tree (the "before" or "after" checkout).

Each tree gets its own interpreter, with cwd and PYTHONPATH set to the tree, so its engine is
the one imported; the child prints one JSON object, which comes back parsed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def run_in_tree(script: str | Path, tree: Path, args: list[str], timeout: float = 1800) -> dict:
    argv = [sys.executable, str(Path(script).resolve()), "--child", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{Path(script).name} failed in {tree}: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout)


def measure_sides(root: Path, before_src: str | None, measure: Callable[[Path], dict]) -> list[dict]:
    """The "after" tree (this checkout), then the "before" tree if given: one row per side."""
    trees = [("after", root)] + ([("before", Path(before_src).resolve())] if before_src else [])
    rows = []
    for side, tree in trees:
        print(f"measuring {side} ({tree}) ...", file=sys.stderr)
        rows.append({"side": side, "tree": str(tree), "load_avg_1m": os.getloadavg()[0], **measure(tree)})
    return rows
