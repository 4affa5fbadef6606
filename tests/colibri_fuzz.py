"""Driving `colibri` with hostile inputs, safely: batches of command lines in one child process
each (tests/colibri_fuzz_runner.py) under an address-space limit, a per-call alarm and a wall-time
watchdog, and the property every call must have.

The property (issue 23): a call exits 0, or exits 2 with exactly one stderr line
`colibri <cmd>: error: ...` that names the input; no traceback, no hang, peak RSS under a bound;
and every victim (a sentinel file or a source directory) is byte-for-byte intact afterwards.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import select
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
START_S = 300  # the server's imports (torch, the CLI) on a busy machine


@dataclass
class Call:
    argv: list[str]
    names: tuple[str, ...] = ()  # the error line must contain one of these (the input's name); () = any
    cwd: str | None = None
    note: str = ""  # what the input is, for the failure message
    kind: str = ""  # the input kind, for the campaign summary (COLIBRI_FUZZ_REPORT)

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
    peak_bound: int = PEAK_RSS_BYTES

    def outcome(self) -> str:
        """The summary's outcome class: exit 0, exit 2, or which way it broke the property."""
        if self.code in ("hang", "traceback", "died"):
            return self.code
        if "Traceback (most recent call last)" in self.stderr:
            return "traceback"
        if self.peak_rss > self.peak_bound:
            return "bound exceeded"
        if self.code in (0, 2):
            return f"exit {self.code}" if self.problem() is None else "bad error line"
        return "other exit"

    def problem(self) -> str | None:
        """Why this call breaks the property, or None."""
        if self.code in ("hang", "traceback", "died"):
            return f"{self.code}: {self.traceback.strip()[-1500:] or self.stderr.strip()[-800:]}"
        if "Traceback (most recent call last)" in self.stderr:
            return f"traceback on stderr: {self.stderr[-1500:]}"
        if self.peak_rss > self.peak_bound:
            return f"peak RSS {self.peak_rss / 2**20:.0f} MiB > {self.peak_bound >> 20} MiB"
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
              env: dict | None = None, peak_bound: int = PEAK_RSS_BYTES, **request) -> list[Result]:
    """Run the calls in order, each in its own fork of the session's server (one torch import for
    the whole session). A call that hangs, blows up or kills its process is that call's failure;
    the rest still run."""
    server = ForkServer.shared()
    results = []
    for c in calls:
        record = server.call({"argv": [str(a) for a in c.argv], "cwd": c.cwd, "env": env or {},
                              "as_bytes": as_bytes, "call_s": call_s, **request})
        results.append(Result(c, record["code"], record["stderr"], record["traceback"], record["seconds"],
                              record["peak_rss"], record["stdout"], peak_bound))
    report(results)
    return results


class ForkServer:
    """tests/colibri_fuzz_runner.py in a child process: imports the CLI once, forks per call."""

    _shared: "ForkServer | None" = None

    @classmethod
    def shared(cls) -> "ForkServer":
        if cls._shared is None or cls._shared.proc.poll() is not None:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def __init__(self):
        self.log = tempfile.NamedTemporaryFile(prefix="colibri-fuzz-server-", suffix=".log", delete=False)
        control_r, control_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
               "COLIBRI_LOCK_TIMEOUT": "0", "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen([sys.executable, str(RUNNER), str(control_w)], stdin=subprocess.PIPE,
                                     stdout=self.log, stderr=self.log, env=env, start_new_session=True,
                                     pass_fds=(control_w,), text=True)
        os.close(control_w)
        self.control = os.fdopen(control_r, "r", encoding="utf-8")
        ready = self._read(START_S)
        if not (ready or {}).get("ready"):
            self.close()
            raise RuntimeError(f"the fuzz server did not start: {self.log_tail()}")

    def call(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # the server is gone: reported below
        record = self._read(request["call_s"] + 60)
        if record is None:  # the server itself died or stopped answering: this call is the failure
            note = f"the fuzz server stopped answering; log: {self.log_tail()}"
            self.close()
            return {"code": "died", "stderr": "", "traceback": note, "seconds": 0.0, "peak_rss": 0, "stdout": ""}
        return record

    def _read(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.control], [], [], timeout)
        line = self.control.readline() if ready else ""
        return json.loads(line) if line else None

    def log_tail(self) -> str:
        return Path(self.log.name).read_text(errors="replace")[-3000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # our own child's session
                self.proc.wait()
        self.control.close()
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)


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


# --- the campaign summary ---------------------------------------------------------------------------

REPORT_ENV = "COLIBRI_FUZZ_REPORT"
# HTTP kinds (tests/test_fuzz_values.py): "http 200" served, "http 4xx" an OpenAI error object; a
# reply that is neither, or a traceback in the server's log, is "bad reply" / "traceback".
OUTCOMES = ["exit 0", "exit 2", "http 200", "http 4xx", "bad error line", "bad reply", "other exit", "bound exceeded",
            "traceback", "hang", "died"]


def record(kind: str, command: str, outcome: str, seconds: float = 0.0, peak_rss: int = 0) -> None:
    """One call's outcome as a JSON line in $COLIBRI_FUZZ_REPORT (when set): what `make fuzz` counts."""
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "command": command, "outcome": outcome, "seconds": seconds,
                                "peak_rss": peak_rss}) + "\n")


def report(results: list[Result]) -> None:
    for r in results:
        argv = [str(a) for a in r.call.argv]
        command = " ".join(argv[:2] if argv[:1] == ["profile"] else argv[:1])
        record(r.call.kind or "other", command, r.outcome(), r.seconds, r.peak_rss)


def summarize(path: Path) -> dict:
    """{kind: {outcome: count}}, plus totals, the slowest call and the largest peak RSS."""
    by_kind: dict[str, dict[str, int]] = {}
    slowest, peak = 0.0, 0
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        counts = by_kind.setdefault(r["kind"], {})
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
        slowest, peak = max(slowest, r["seconds"]), max(peak, r["peak_rss"])
    total = {o: sum(c.get(o, 0) for c in by_kind.values()) for o in OUTCOMES}
    return {"by_kind": dict(sorted(by_kind.items())), "total": total, "calls": sum(total.values()),
            "slowest_call_s": slowest, "max_peak_rss_mib": round(peak / 2**20)}


def summary_table(summary: dict) -> str:
    cols = [o for o in OUTCOMES if summary["total"][o]] or OUTCOMES[:2]
    width = max([len(k) for k in summary["by_kind"]] + [10])
    lines = [f"{'input kind':<{width}}  " + "  ".join(f"{c:>8}" for c in cols) + "     total"]
    for kind, counts in summary["by_kind"].items():
        lines.append(f"{kind:<{width}}  " + "  ".join(f"{counts.get(c, 0):>8}" for c in cols)
                     + f"  {sum(counts.values()):>8}")
    lines.append(f"{'all':<{width}}  " + "  ".join(f"{summary['total'][c]:>8}" for c in cols)
                 + f"  {summary['calls']:>8}")
    lines.append(f"slowest call {summary['slowest_call_s']:.1f} s; largest peak RSS {summary['max_peak_rss_mib']} MiB"
                 " (in-process examples: not measured, 0)")
    return "\n".join(lines)


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


if __name__ == "__main__":  # `make fuzz`: python tests/colibri_fuzz.py REPORT.jsonl [--json]
    summary = summarize(Path(sys.argv[1]))
    print(json.dumps(summary, indent=2) if "--json" in sys.argv[2:] else summary_table(summary))
