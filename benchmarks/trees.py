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


def run_in_tree(script: str | Path, tree: Path, args: list[str], timeout: float = 1800) -> dict:
    argv = [sys.executable, str(Path(script).resolve()), "--child", *args]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(argv, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{Path(script).name} failed in {tree}: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout)
