"""A real `colibri serve` child process and raw HTTP/1.1 over a socket, for the tests that need
what a client on the wire sees (framing errors never reach the app) and what the server logs.

Raw sockets, not httpx: httpx cannot send a malformed chunk size or a body shorter than its
Content-Length, which is what these tests send.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m colibri.cli serve` on a free loopback port; its stderr is the server's log."""

    def __init__(self, model_dir: Path, log_path: Path, extra: tuple[str, ...] = ("--ctx-size", "256")):
        self.port = free_port()
        self.log_path = log_path
        self.log = open(log_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri.cli", "serve", "--model", str(model_dir),
                                      "--port", str(self.port), *extra],
                                     stdout=self.log, stderr=self.log, env=env, cwd=str(ROOT))
        deadline = time.monotonic() + START_S
        while not self._answers():  # waiting for a condition (the port answers), with a deadline
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"colibri serve did not start: {self.log_text()[-2000:]}")
            time.sleep(0.1)

    def _answers(self) -> bool:
        try:
            return exchange(self.port, b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
                            timeout=2).status == 200
        except OSError:
            return False

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Reply:
    def __init__(self, raw: bytes):
        self.raw = raw
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2) if lines and lines[0] else []
        self.status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
        self.headers = {k.strip().lower().decode("latin-1"): v.strip().decode("latin-1")
                        for k, _, v in (ln.partition(b":") for ln in lines[1:])}
        if self.headers.get("transfer-encoding") == "chunked":
            self.body = _unchunk(self.body)

    def json(self):
        return json.loads(self.body)


def _unchunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        n = int(size.split(b";")[0] or b"0", 16)
        if n == 0:
            break
        out, data = out + rest[:n], rest[n + 2:]
    return out


def exchange(port: int, request: bytes, timeout: float = 60, half_close: bool = False) -> Reply:
    """Send `request`, read until the server closes; `half_close`: then shut our sending side
    (a client that stops mid-body), so a server waiting for more sees the end at once."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        raw = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            raw += chunk
    return Reply(raw)


def post(port: int, path: str, body: bytes, timeout: float = 60) -> Reply:
    head = (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return exchange(port, head + body, timeout)
