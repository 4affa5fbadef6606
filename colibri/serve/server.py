"""Start `colibri serve`: load the model once, then answer OpenAI requests until stopped.

Bound to localhost by default. Any other address needs an API key (`--api-key` or the
COLIBRI_API_KEY environment variable): a model server on a LAN without one is anyone's.

SIGINT / SIGTERM: uvicorn stops accepting, the app ends every open request at once (an error
event and [DONE] on a stream: colibri/serve/app.py), the running generation stops at its next
token, and the process exits 0 after closing the model, well within the graceful timeout.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from engine.api import ConfigError, Engine, EngineConfig, ModelFormatError, load_tokenizer
from colibri.serve.app import DEFAULT_MAX_BODY, ServeState, build_app
from colibri.serve.chat_template import ChatTemplate
from colibri.serve.framing import JsonErrorH11Protocol
from colibri.serve.prometheus import ServerMetrics
from colibri.serve.worker import GenerationWorker

API_KEY_ENV = "COLIBRI_API_KEY"
MAX_QUEUE = 1024
MAX_GATHER_MS = 1000
DEFAULT_GATHER_MS = 20.0
GRACEFUL_S = 5  # uvicorn's wait for open requests after a signal; they end at once (ServeState.shut_down)


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    queue_size: int = 8
    max_body: int = DEFAULT_MAX_BODY
    model_name: str | None = None
    cors_origins: tuple[str, ...] = ()
    gather_ms: float = DEFAULT_GATHER_MS  # an idle server's wait for simultaneous arrivals (colibri/serve/jobs.py)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_options(opts: ServeOptions) -> ServeOptions:
    """Refuse unsafe or impossible options before the model is loaded."""
    key = opts.api_key if opts.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if key is not None and (not key.strip() or any(c.isspace() for c in key)):
        raise ConfigError("the API key must be non-empty and contain no whitespace")
    if not is_loopback(opts.host) and key is None:
        raise ConfigError(f"--host {opts.host} is not a loopback address: set --api-key (or {API_KEY_ENV}) "
                          "so that strangers on the network cannot use the model")
    if not 0 <= opts.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {opts.port}")
    if not 1 <= opts.queue_size <= MAX_QUEUE:
        raise ConfigError(f"--queue-size must be in [1, {MAX_QUEUE}], got {opts.queue_size}")
    if not 0 <= opts.gather_ms <= MAX_GATHER_MS:
        raise ConfigError(f"--gather-ms must be in [0, {MAX_GATHER_MS}], got {opts.gather_ms:g}")
    if opts.max_body < 1024:
        raise ConfigError(f"--max-body must be at least 1 KiB, got {opts.max_body}")
    for origin in opts.cors_origins:
        if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
            raise ConfigError(f"--cors-origin {origin!r}: an origin is scheme://host[:port] (no path), or *")
    return ServeOptions(opts.host, opts.port, key, opts.queue_size, opts.max_body, opts.model_name,
                        tuple(opts.cors_origins), opts.gather_ms)


def eos_ids(checkpoint_config: dict, model_dir: Path) -> set[int]:
    """End-of-sequence ids from config.json and generation_config.json (an int or a list)."""
    ids: set[int] = set()
    sources = [checkpoint_config]
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file() and gen_path.stat().st_size < (1 << 20):
        try:
            sources.append(json.loads(gen_path.read_text()))
        except (ValueError, UnicodeDecodeError):
            raise ModelFormatError(f"{gen_path}: not valid JSON") from None
    for cfg in sources:
        value = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                ids.add(v)
    return ids


class LoadedModel:
    """The engine, its tokenizer, chat template and worker: what serve and chat share."""

    def __init__(self, model_dir: str | os.PathLike, config: EngineConfig, queue_size: int = 8, *,
                 kv_dir: str | os.PathLike | None = None, kv_disk_bytes: int = 0, log=None,
                 gather_ms: float = 0.0):
        """log: where the worker writes a line per finished sequence (serve's stderr; None: nowhere).
        gather_ms: how long an idle worker waits for arrivals to pause (serve --gather-ms)."""
        self.model_dir = Path(model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        if self.tokenizer is None:
            raise ModelFormatError(f"{self.model_dir} has no tokenizer.json: serve and chat need text")
        self.template = ChatTemplate.for_model(self.model_dir)
        # The prefix cache (config.prefix_cache) and its SSD tier (kv_dir): engine/run/prefix_cache.py.
        self.engine = Engine(self.model_dir, config, kv_dir=kv_dir, kv_disk_bytes=kv_disk_bytes)
        try:
            self.metrics = ServerMetrics()
            self.worker = GenerationWorker(self.engine, self.tokenizer, eos_ids(self.engine.checkpoint.config,
                                                                                self.model_dir),
                                           queue_size, self.metrics, log=log, gather_s=gather_ms / 1000)
        except BaseException:
            self.engine.close()
            raise

    def close(self) -> None:
        self.worker.close()
        self.engine.close()


def make_state(model: LoadedModel, opts: ServeOptions) -> ServeState:
    name = opts.model_name or model.model_dir.resolve().name
    return ServeState(model.worker, model.tokenizer, model.template, name, api_key=opts.api_key,
                      max_body=opts.max_body, metrics=model.metrics, cors_origins=opts.cors_origins)


class _Server(uvicorn.Server):
    """uvicorn's server, with the app told of a stop signal at once (not after the graceful
    timeout, by cancelling its tasks), and without re-raising the signal after shutdown (which
    killed the process before the model was closed)."""

    def __init__(self, config: uvicorn.Config, state: ServeState):
        super().__init__(config)
        self.state = state
        self.stop_signal: int | None = None

    def handle_exit(self, sig, frame) -> None:
        self.stop_signal = sig
        self.state.shut_down()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()  # handled: the process exits normally after closing the model


def serve(model_dir, config: EngineConfig, opts: ServeOptions, log=print, **reuse) -> None:
    """reuse: LoadedModel's kv_dir and kv_disk_bytes (the prefix cache's SSD tier)."""
    opts = check_options(opts)
    model = LoadedModel(model_dir, config, opts.queue_size, log=log, gather_ms=opts.gather_ms, **reuse)
    try:
        state = make_state(model, opts)
        log(f"colibri serve: {state.model_id} on http://{opts.host}:{opts.port}/v1 "
            f"(ctx {model.worker.ctx_size}, max batch {model.worker.max_batch}, queue {opts.queue_size}, "
            f"chat template: {model.template.source})")
        server = _Server(uvicorn.Config(build_app(state), host=opts.host, port=opts.port, log_level="warning",
                                        timeout_graceful_shutdown=GRACEFUL_S, http=JsonErrorH11Protocol), state)
        server.run()
        if server.stop_signal is not None:
            log(f"colibri serve: stopped by {signal.Signals(server.stop_signal).name}")
    finally:
        model.close()
