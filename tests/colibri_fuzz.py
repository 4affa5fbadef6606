"""Driving `colibri` with hostile inputs, safely: batches of command lines in one child process
each (tests/colibri_fuzz_runner.py) under an address-space limit, a per-call alarm and a wall-time
watchdog, and the property every call must have.

The property (issue 23): a call exits 0, or exits 2 with exactly one stderr line
`colibri <cmd>: error: ...` that names the input; no traceback, no hang, peak RSS under a bound;
and every victim (a sentinel file or a source directory) is byte-for-byte intact afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).with_name("colibri_fuzz_runner.py")

# Bounds. A normal call on the tiny inputs takes well under 2 s and ~300 MB; the address-space
# limit leaves room for torch's mappings and thread stacks (~1.2 GB virtual after a run) and
# turns a reader that grows without bound into a MemoryError long before the machine swaps.
CALL_S = float(os.environ.get("COLIBRI_FUZZ_CALL_S", "30"))
AS_BYTES = 6 << 30
PEAK_RSS_BYTES = 2 << 30


@dataclass
class Call:
    argv: list[str]
    names: tuple[str, ...] = ()  # the error line must contain one of these (the input's name); () = any
    cwd: str | None = None
    note: str = ""  # what the input is, for the failure message

    def label(self) -> str:
        return f"colibri {' '.join(self.argv)}" + (f"  [{self.note}]" if self.note else "")


@dataclass
class Result:
    call: Call
    code: int | str  # exit code, or "hang" / "traceback" / "died"
    stderr: str = ""
    traceback: str = ""
    seconds: float = 0.0
    peak_rss: int = 0
    stdout: str = ""

    def problem(self) -> str | None:
        """Why this call breaks the property, or None."""
        if self.code in ("hang", "traceback", "died"):
            return f"{self.code}: {self.traceback.strip()[-1500:] or self.stderr.strip()[-800:]}"
        if "Traceback (most recent call last)" in self.stderr:
            return f"traceback on stderr: {self.stderr[-1500:]}"
        if self.peak_rss > PEAK_RSS_BYTES:
            return f"peak RSS {self.peak_rss / 2**20:.0f} MiB > {PEAK_RSS_BYTES >> 20} MiB"
        if self.code == 0:
            return None
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        if self.code != 2:
            return f"exit {self.code} (expected 0 or 2): {self.stderr.strip()[-800:]}"
        if len(lines) != 1 or not lines[0].startswith("colibri ") or ": error: " not in lines[0]:
            return f"exit 2 but not one `colibri <cmd>: error:` line: {self.stderr.strip()[-800:]!r}"
        if self.call.names and not any(n in lines[0] for n in self.call.names):
            return f"the error does not name the input ({' or '.join(self.call.names)}): {lines[0]}"
        return None


def run_batch(calls: list[Call], call_s: float = CALL_S, as_bytes: int = AS_BYTES,
              env: dict | None = None) -> list[Result]:
    """Run the calls in order in child processes: one for all of them, plus a fresh one after a
    call that hung, blew up or killed its process (that call is the failure; the rest still run)."""
    records: dict[int, dict] = {}
    start = 0
    while start < len(calls):
        got, note = _run_some(calls[start:], call_s, as_bytes, env)
        for i, r in got.items():
            records[start + i] = r
        done = max(got, default=-1) + 1
        if start + done >= len(calls):
            break
        if note or done == 0:  # the process died in calls[start + done]
            records[start + done] = {"code": "died", "stderr": "", "traceback": note or "runner reported nothing",
                                     "seconds": 0.0, "peak_rss": 0, "stdout": ""}
            done += 1
        start += done
    return [Result(c, r["code"], r["stderr"], r["traceback"], r["seconds"], r["peak_rss"], r["stdout"])
            for c, r in ((c, records.get(i)) for i, c in enumerate(calls)) if r is not None]


def _run_some(calls: list[Call], call_s: float, as_bytes: int, env: dict | None) -> tuple[dict[int, dict], str]:
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-batch-") as tmp:
        spec, results, log = Path(tmp) / "spec.json", Path(tmp) / "results.jsonl", Path(tmp) / "log"
        spec.write_text(json.dumps({"calls": [{"argv": [str(a) for a in c.argv], "cwd": c.cwd} for c in calls],
                                    "as_bytes": as_bytes, "call_s": call_s, "restart_rss": PEAK_RSS_BYTES // 2,
                                    "results": str(results)}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               "COLIBRI_LOCK_TIMEOUT": "0", "PYTHONFAULTHANDLER": "1", **(env or {})}
        with open(log, "wb") as log_f:
            proc = subprocess.Popen([sys.executable, str(RUNNER), str(spec)], stdin=subprocess.DEVNULL,
                                    stdout=log_f, stderr=log_f, env=env, start_new_session=True)
            try:
                proc.wait(timeout=call_s * len(calls) + 120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # our own child's session: the runner and what it spawned
                proc.wait()
        got = {}
        if results.exists():
            for line in results.read_text().splitlines():
                r = json.loads(line)
                got[r["i"]] = r
        note = "" if proc.returncode in (0, 3) else (
            f"runner exit {proc.returncode} before reporting; log: {log.read_text(errors='replace')[-3000:]}")
        return got, note


def failures(results: list[Result]) -> list[str]:
    return [f"{r.call.label()}\n    -> {p}" for r in results if (p := r.problem())]


def assert_batch(calls: list[Call], victims: "Victims | None" = None, **kw) -> list[Result]:
    results = run_batch(calls, **kw)
    problems = failures(results)
    if len(results) < len(calls):
        problems.append(f"{len(calls) - len(results)} call(s) did not run")
    if victims is not None:
        problems += victims.damaged()
    assert not problems, f"{len(problems)} of {len(calls)} calls break the property:\n" + "\n".join(problems)
    return results


# --- victims --------------------------------------------------------------------------------------

def tree_digest(path: Path) -> str:
    """Names, kinds and bytes of everything under `path` (symlinks as their targets' text)."""
    h = hashlib.sha256()
    if not path.exists() and not path.is_symlink():
        return "missing"
    items = [path] if not path.is_dir() or path.is_symlink() else sorted(path.rglob("*"))
    for p in items:
        h.update(str(p.relative_to(path) if p != path else ".").encode())
        if p.is_symlink():
            h.update(b"L" + os.readlink(p).encode())
        elif p.is_file():
            h.update(b"F" + p.read_bytes())
        else:
            h.update(b"D")
    return h.hexdigest()


@dataclass
class Victims:
    """Paths that no call may change: recorded when added, compared by damaged()."""
    digests: dict[Path, str] = field(default_factory=dict)

    def add(self, *paths: Path) -> "Victims":
        for p in paths:
            self.digests[Path(p)] = tree_digest(Path(p))
        return self

    def sentinel(self, directory: Path, name: str = "SENTINEL-do-not-delete") -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        s = directory / name
        s.write_text(f"sentinel in {directory}\n")
        self.add(s)
        return s

    def damaged(self) -> list[str]:
        return [f"victim changed: {p} (a command destroyed or altered what it did not write)"
                for p, d in self.digests.items() if tree_digest(p) != d]


# --- special paths --------------------------------------------------------------------------------

def special_paths(root: Path, source: Path | None = None) -> dict[str, Path]:
    """The paths users pass by mistake, made under `root`: each kind -> a path."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    fifo = root / "fifo-input"
    if not fifo.exists():
        os.mkfifo(fifo)
    paths["fifo"] = fifo
    paths["dev_zero"] = Path("/dev/zero")
    paths["directory"] = root / "a-directory"
    paths["directory"].mkdir(exist_ok=True)
    loop = root / "symlink-loop"
    if not loop.is_symlink():
        os.symlink(loop.name, loop)  # points at itself
    paths["symlink_loop"] = loop
    paths["missing"] = root / "no-such-file"
    paths["empty"] = root / "empty-file"
    paths["empty"].write_bytes(b"")
    paths["binary"] = root / "binary-garbage"
    paths["binary"].write_bytes(bytes(range(256)) * 64 + b"\xff\xfe\x00" * 100)
    big = root / "sparse-2GB"
    if not big.exists():
        with open(big, "wb") as f:  # a hole: 2 GB of zeros that cost no disk
            f.truncate(2 << 30)
    paths["huge_sparse"] = big
    return paths
