"""One generation at a time, behind a bounded FIFO queue, on a model that stays loaded.

People who stream a 300-700B model from an SSD found that serial requests are the stable choice
(continuous batching ran their machines out of memory; concurrent requests all timed out), so the
engine runs one job at a time on its own thread and the rest wait in arrival order. A full queue
is refused at once (the HTTP layer answers 503 with Retry-After) rather than growing without
bound. A job whose client has gone is cancelled at its next token, and a queued one is skipped.
The model, its caches and the native kernels are loaded once and reused, and nothing is
allocated per request beyond the generation itself, so the memory plan holds for the server's
life.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from engine.api import Generation, GrammarTokenizer, Sampler, generate
from colibri.serve.prometheus import ServerMetrics
from colibri.serve.protocol import ApiError, Sampling


STARTED_KEPT = 4096


class TextStream:
    """Token ids → text pieces as they become final: whole UTF-8 characters only, and never the
    beginning of a stop sequence that a later token may complete.

    Incremental: each token decodes a short window of ids, not the whole output (which made a
    streamed answer quadratic in its length). The window is `ids[prefix:]`; its first part,
    `ids[prefix:read]`, is already text and is decoded again only as context, because decoders
    treat a sequence's first token specially (Metaspace and Strip drop its leading space) and
    merge bytes across tokens (ByteLevel, ByteFallback): the new text is the window's decode
    past that context's decode, which is the whole-text decode's new tail. `prefix` stays at a
    token that produced text, so a skipped special token never becomes the window's first.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0  # the window's first id
        self.read = 0    # ids[:read] are text already (sent or pending)
        self.sent: list[str] = []
        self.pending = ""  # text past what was sent: held back as the possible start of a stop
        self.stopped = False

    @property
    def text(self) -> str:
        """All the text so far (up to a stop, once one is found)."""
        return "".join(self.sent) + self.pending

    def push(self, token: int) -> str:
        self.ids.append(token)
        new = self._new_text(final=False)
        if new is None:  # a character split across tokens: wait for the rest
            return ""
        return self._accept(new, self.hold)

    def flush(self) -> str:
        """The rest, at the end: a trailing partial character stays a replacement character, as
        a whole-text decode gives it."""
        if self.stopped:
            return ""
        return self._accept(self._new_text(final=True), 0)

    def _accept(self, new: str, hold: int) -> str:
        buf = self.pending + new
        # The earliest stop in what was not sent: one that began earlier would have been found
        # then, since `hold` kept the last len(longest stop) - 1 characters unsent.
        found = [at for at in (buf.find(stop) for stop in self.stops) if at != -1]
        if found:
            self.stopped = True
            self.pending = ""
            return self._send(buf[:min(found)])
        end = max(0, len(buf) - hold)
        self.pending = buf[end:]
        return self._send(buf[:end])

    def _new_text(self, final: bool) -> str | None:
        """The text of ids[read:], or None while it ends inside a character (unless final)."""
        if self.read == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        if self.read == 0:
            new = decode(self.ids)
        else:
            context = decode(self.ids[self.prefix:self.read])
            window = decode(self.ids[self.prefix:])
            if window.startswith(context):
                new = window[len(context):]
            else:  # a decoder that rewrites text across the window's start: decode it all, once
                new = decode(self.ids)[len(self.text):]
        if new.endswith("\ufffd") and not final:
            return None
        if new:
            self.prefix = self.read
        self.read = len(self.ids)
        return new

    def _send(self, piece: str) -> str:
        if piece:
            self.sent.append(piece)
        return piece


class SpecialText:
    """A tokenizer whose decode keeps special tokens (`tokenizers` skips them by default)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass
class Job:
    prompt_ids: list[int]
    sampling: Sampling
    # emit(kind, value), called on the worker thread: ("text", str) and, when log-probs were
    # asked, ("logprob", TokenLogprob) before the text its token gave; then ("done", JobResult)
    emit: object
    cancelled: threading.Event = field(default_factory=threading.Event)
    seq: int = 0
    # Keep special tokens in the text: tool-call markers are special tokens in some vocabularies
    # (gpt-oss's harmony channels, GLM's <tool_call>), and a parser cannot find what decode drops.
    special_text: bool = False
    # engine LogitsProcessors for this job only, after the sampler's penalties (and a
    # response_format's grammar, which the worker adds); one whose done() ends the generation
    # ends it with finish_reason "stop"
    processors: list = field(default_factory=list)


@dataclass
class JobResult:
    text: str
    output_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    generation: Generation | None
    error: str | None = None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was reused, not computed (OpenAI usage.prompt_tokens_details)."""
        return self.generation.cached_tokens if self.generation is not None else 0


class GenerationWorker:
    def __init__(self, engine, tokenizer, eos_ids: set[int], queue_size: int, metrics: ServerMetrics):
        self.engine, self.tokenizer, self.eos_ids = engine, tokenizer, eos_ids
        self.metrics = metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built by the first structured request
        self.busy = False
        # The seq of the most recent jobs as they start (FIFO is checked on it); capped, so a
        # server that runs for weeks does not grow by one entry per request.
        self.started_order: list[int] = []
        self._seq = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="colibri-generation", daemon=True)
        self._thread.start()

    @property
    def ctx_size(self) -> int:
        return self.engine.kv.ctx_size

    def check_fits(self, prompt_ids: list[int], sampling: Sampling) -> None:
        """Refuse, before it is queued, a request the KV cache or the vocabulary cannot hold; a
        request without max_tokens gets the room its prompt leaves (as OpenAI, vLLM and
        llama-server do), so only a prompt that fills the context is refused."""
        if not prompt_ids:
            raise ApiError(400, "prompt: encodes to zero tokens", param="prompt")
        room = self.ctx_size - len(prompt_ids)
        if sampling.max_tokens is None:
            if room < 1:
                raise ApiError(400, f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                                    f"{self.ctx_size} tokens", code="context_length_exceeded")
            sampling.max_tokens = room
        elif sampling.max_tokens > room:
            raise ApiError(400, f"prompt of {len(prompt_ids)} tokens + max_tokens {sampling.max_tokens} exceeds the "
                                f"context of {self.ctx_size} tokens", param="max_tokens", code="context_length_exceeded")
        vocab = self.engine.args.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        bad = next((t for t in sampling.logit_bias if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"logit_bias: token id {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")

    def submit(self, job: Job) -> int:
        job.seq = next(self._seq)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.rejected_full += 1
            raise ApiError(503, "the server is busy: the request queue is full, retry later", type="server_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return job.seq

    def queue_length(self) -> int:
        return self.jobs.qsize()

    def close(self) -> None:
        # Queued jobs are told the server is going; the running one stops at its next token.
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancelled.set()
                job.emit("done", JobResult("", [], "cancelled", len(job.prompt_ids), None))
        self.jobs.put(None)
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():  # its client left while it waited: a cancelled request too
                with self.metrics.lock:
                    self.metrics.cancelled += 1
                job.emit("done", JobResult("", [], "cancelled", len(job.prompt_ids), None))
                continue
            self.busy = True
            self.started_order.append(job.seq)
            if len(self.started_order) > STARTED_KEPT:
                del self.started_order[:-STARTED_KEPT]
            try:
                job.emit("done", self._run(job))
            except Exception as exc:  # a failed generation must not take the server down
                job.emit("done", JobResult("", [], "error", len(job.prompt_ids), None, error=f"{type(exc).__name__}: {exc}"))
            finally:
                self.busy = False

    def _grammar(self, grammar: str):
        # The tokenizer's token trie costs ~0.4 s at 32k tokens, 1-2 s at 152k: once per model, on
        # this thread (jobs run one at a time), and only when a request asks for structure.
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.engine.args.vocab_size, self.eos_ids)
        return self._grammar_tokenizer.processor(grammar)

    def _run(self, job: Job) -> JobResult:
        s = job.sampling
        stream = TextStream(SpecialText(self.tokenizer) if job.special_text else self.tokenizer, s.stop)
        started = time.perf_counter()
        gen = Generation(list(job.prompt_ids))

        def on_token(token: int) -> bool:
            if job.cancelled.is_set():
                return True
            if token in self.eos_ids:
                return True
            if s.logprobs is not None:
                job.emit("logprob", (gen.logprobs[-1], len(stream.text)))  # the token and where its text starts
            piece = stream.push(token)
            if piece:
                job.emit("text", piece)
            return stream.stopped

        grammar = self._grammar(s.grammar) if s.grammar else None
        sampler = Sampler(s.temperature, s.top_p, s.seed, min_p=s.min_p, presence_penalty=s.presence_penalty,
                          frequency_penalty=s.frequency_penalty, repetition_penalty=s.repetition_penalty,
                          logit_bias=s.logit_bias)
        generate(self.engine, job.prompt_ids, s.max_tokens, sampler, on_token=on_token, logprobs=s.logprobs,
                 generation=gen, processors=[*job.processors, *([grammar] if grammar else [])])
        ids = gen.output_ids
        if not job.cancelled.is_set():
            # Before the finish reason: the tail may complete a stop (after a character that
            # was still split when the last token came).
            tail = stream.flush()
            if tail:
                job.emit("text", tail)
        if job.cancelled.is_set():
            reason = "cancelled"
        elif stream.stopped or gen.stopped_by_processor or (ids and ids[-1] in self.eos_ids):
            reason = "stop"  # a complete grammar ends the answer as end-of-sequence does
        else:
            reason = "length"
        output_ids = ids[:-1] if ids and ids[-1] in self.eos_ids else ids
        # The tokens usage reports (an end-of-sequence token is not one), so the two agree.
        self.metrics.record_generation(len(job.prompt_ids), len(output_ids), gen.ttft_seconds, gen.token_seconds,
                                       time.perf_counter() - started, reason == "cancelled")
        return JobResult(stream.text, output_ids, reason, len(job.prompt_ids), gen)
