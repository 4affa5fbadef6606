"""The server serve_client.py measures (a helper of its modes, not a command).

`ServerProcess` runs `colibri serve` as a subprocess in a child memory cgroup of its own (when one
can be made: the limit is a safety ceiling, --cgroup-ceiling, not the budget), waits for it to
answer, scrapes its /metrics, reads its log by offset and stops it; `engine_side` is the engine's
own timing of one request, from two scrapes around it. serve_client.py's --overhead,
serve_arrivals.py and serve_soak.py all run on it; the clients that load it are serve_load.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from engine.api import parse_size
from tuner.sandbox.cgroups import Cgroup, detect_memory_cgroup

ROOT = Path(__file__).resolve().parents[2]
TOOL = "serve_client"  # the tool every document of these modes names (serve_client.py runs them)


class ServerProcess:
    """`colibri serve` as a subprocess, in its own memory cgroup when one can be made."""

    def __init__(self, args, port: int, flags: tuple[str, ...] = ()):
        self.base = f"http://127.0.0.1:{port}"
        support = detect_memory_cgroup()
        self.cgroup = Cgroup.create(support, parse_size(args.cgroup_ceiling)) if support.available else None
        self.cgroup_note = ("own child cgroup, ceiling " + args.cgroup_ceiling) if self.cgroup else support.reason
        cmd = [sys.executable, "-m", "colibri.cli", "serve", "--model", args.model, "--port", str(port),
               "--model-name", "bench", *(["--config", args.config] if args.config else []),
               *(["--ram-budget", args.ram_budget] if args.ram_budget else []), *flags, *args.serve_arg]
        # The log goes to a file: a pipe nobody reads would block the server once it filled.
        self.log = tempfile.TemporaryFile(mode="w+")
        procs = str(self.cgroup.procs_file) if self.cgroup else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log,
                                     preexec_fn=(lambda: _join_cgroup(procs)) if procs else None)
        self.started = time.monotonic()
        try:
            self._wait_up()
        except BaseException:
            self.stop()
            raise
        self.up_seconds = time.monotonic() - self.started
        # One client with a kept-alive connection, as the openai client keeps one: a new
        # httpx client per request builds an SSL context (25-300 ms here), which is not the server's.
        self.http = httpx.Client(base_url=self.base, timeout=600)

    def _wait_up(self) -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise SystemExit(f"serve exited ({self.proc.returncode}): {self.log.read()[-800:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a process that is still loading, with a deadline
        raise SystemExit("serve did not come up in 10 minutes")

    def scrape(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def log_since(self, offset: int) -> tuple[str, int]:
        """The server's log written since `offset` (a byte offset of its log file), and the new offset."""
        fd = self.log.fileno()  # read by offset: the server appends to the file through its own descriptor
        size = os.fstat(fd).st_size
        return os.pread(fd, max(0, size - offset), offset).decode("utf-8", "replace"), size

    def cgroup_bytes(self) -> int | None:
        return self.cgroup.current() if self.cgroup else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "http", None) is not None:
            self.http.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        self.log.close()


def _join_cgroup(procs_file: str) -> None:
    # Runs in the child between fork and exec: everything the server allocates is charged to it.
    with open(procs_file, "w") as f:
        f.write(str(os.getpid()))


def engine_side(before: dict, after: dict) -> dict:
    """The engine's own timing of the one request between two scrapes."""
    steps = after["colibri_decode_token_seconds_count"] - before["colibri_decode_token_seconds_count"]
    step_s = after["colibri_decode_token_seconds_sum"] - before["colibri_decode_token_seconds_sum"]
    return {"ttft_s": after["colibri_ttft_seconds_sum"] - before["colibri_ttft_seconds_sum"],
            "s_per_token": step_s / steps if steps else None,
            "wall_s": after["colibri_request_seconds_sum"] - before["colibri_request_seconds_sum"],
            "tokens": int(after["colibri_generated_tokens_total"] - before["colibri_generated_tokens_total"])}
