"""Before/after across commits: check a commit out, and run that tree's own code in it.

A benchmark that compares two commits measures each with its own engine and its own CLI: the
product code carries no compatibility shims for older trees. `source_tree(spec)` turns a
--before-src value into a tree — a directory as given, or any git revision of this repository
checked out into a temporary worktree (removed afterwards) — and everything run there gets the
tree as its cwd and PYTHONPATH, so `python -m colibri.cli` and `import engine` are that tree's.
`run_in_tree` runs a benchmark's own child half there (it prints one JSON object, which comes
back parsed); `tree_cli` runs the tree's `colibri` CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

ROOT = Path(__file__).resolve().parent.parent


def tree_env(tree: Path) -> dict:
    """The environment of a child that must import `tree`'s packages and nothing else's."""
    return {**os.environ, "PYTHONPATH": str(tree)}


@contextlib.contextmanager
def source_tree(spec: str, repo: Path = ROOT) -> Iterator[Path]:
    """A directory as given, or a git revision of `repo` checked out (detached) for the duration."""
    if Path(spec).is_dir():
        yield Path(spec).resolve()
        return
    rev = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise SystemExit(f"trees: error: {spec!r} is neither a directory nor a revision of {repo}")
    with tempfile.TemporaryDirectory(prefix="colibri-tree-") as tmp:
        tree = Path(tmp) / rev.stdout.strip()[:12]
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(tree),
                        rev.stdout.strip()], check=True, capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)


def tree_cli(tree: Path, args: list[str], timeout: float = 1800) -> subprocess.CompletedProcess:
    """`colibri ARGS` as `tree` ships it (its cwd first on sys.path, then its PYTHONPATH)."""
    return subprocess.run([sys.executable, "-m", "colibri.cli", *args], cwd=tree, env=tree_env(tree),
                          capture_output=True, text=True, timeout=timeout)


def run_in_tree(script: str | Path, tree: Path, args: list[str], timeout: float = 1800) -> dict:
    """The benchmark's `--child` half, importing `tree`'s engine; its one JSON object, parsed."""
    argv = [sys.executable, str(Path(script).resolve()), "--child", *args]
    out = subprocess.run(argv, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise SystemExit(f"{Path(script).name} failed in {tree}: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout)


def measure_sides(root: Path, before_src: str | None, measure: Callable[[Path], dict]) -> list[dict]:
    """The "after" tree (this checkout), then the "before" tree if given (a directory or a
    revision): one row per side."""
    return [{k: v for k, v in row.items() if k != "round"} for row in alternate_sides(root, before_src, 1, measure)]


def alternate_sides(root: Path, before_src: str | None, rounds: int, measure: Callable[[Path], dict]) -> list[dict]:
    """measure_sides for `rounds` rounds, the trees alternating (after, before, after, ...), so slow
    drift of a noisy box falls on both; one row per (round, side), "round" in each."""
    rows = []
    with contextlib.ExitStack() as stack:
        trees = [("after", root)] + ([("before", stack.enter_context(source_tree(before_src)))] if before_src else [])
        for r in range(rounds):
            for side, tree in trees:
                print(f"round {r + 1}/{rounds}: measuring {side} ({tree}) ...", file=sys.stderr)
                rows.append({"side": side, "round": r, "tree": str(tree), "load_avg_1m": os.getloadavg()[0],
                             **measure(tree)})
    return rows
