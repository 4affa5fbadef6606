"""The generation worker: one engine thread running the batch scheduler, behind a bounded FIFO queue.

Requests run together up to the engine's max_batch (EngineConfig.max_batch, `serve --max-batch`):
the scheduler (engine/run/batch.py) admits the queue's head at a step boundary when the pool has a
KV cache free for each of its sequences, prefills a newcomer's prompt one pass per step between
the running sequences' decode steps (at most one sub-chunk per pass while they decode, the whole
group when nothing else runs; the groups of prompts waiting together in one pass while they fit
one group, each routed expert read once for all of them), and decodes every running sequence in one step (each routed
expert read once for all of them). max_batch 1, the default, runs one generation at a time:
people who stream a 300-700B model from an SSD found serial requests the stable choice, and a
batch takes a KV cache per sequence, which the memory plan charges before the model loads.

The rest wait in arrival order; a full queue is refused at once (the HTTP layer answers 503 with
Retry-After) rather than growing without bound. A sequence whose client has gone leaves at the
next step, and a queued one is skipped. `n` > 1 choices are n sequences of one prompt, prefilled
once (engine/run/batch.py, groups), each sampling with its own seed: seed, seed + 1, ...
The model, its caches and the native kernels are loaded once and reused, and nothing is allocated
per request beyond the generation itself, so the memory plan holds for the server's life.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

from engine.api import BatchSequence, ConfigError, Decoding, Generation, GrammarTokenizer, Sampler, Scheduler, generate
from colibri.serve.jobs import Job, JobQueue, JobResult
from colibri.serve.prometheus import ServerMetrics
from colibri.serve.protocol import SEED_MAX, ApiError, Sampling


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


class GenerationWorker:
    def __init__(self, engine, tokenizer, eos_ids: set[int], queue_size: int, metrics: ServerMetrics, log=None,
                 gather_s: float = 0.0):
        """log: called with one line per finished sequence (its wait, TTFT and tok/s), or None.
        gather_s: an idle worker waits for arrivals to pause this long before it starts them
        (colibri/serve/jobs.py), where a batch can take more than one."""
        self.engine, self.tokenizer, self.eos_ids = engine, tokenizer, eos_ids
        self.metrics, self.log = metrics, log
        self.jobs = JobQueue(queue_size, gather_s)
        self.scheduler = Scheduler(engine)
        # Speculative decoding (EngineConfig.draft, engine/run/speculative.py) runs inside generate(),
        # one sequence at a time: with it on, each job runs through generate() in turn.
        self.serial = getattr(engine, "speculator", None) is not None
        if self.serial and self.scheduler.max_batch > 1:
            raise ConfigError("speculative decoding (--draft) runs one sequence at a time: it goes with "
                              "--max-batch 1")
        self._serial_busy = False
        self._grammar_tokenizer: GrammarTokenizer | None = None  # built by the first structured request
        # The seq of the most recent jobs as they start (FIFO is checked on it); capped, so a
        # server that runs for weeks does not grow by one entry per request.
        self.started_order: list[int] = []
        self._seq = itertools.count(1)
        self._running_jobs: set[Job] = set()  # read by close() on another thread: changed under _lock
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="colibri-generation", daemon=True)
        self._thread.start()

    @property
    def ctx_size(self) -> int:
        return self.engine.kv.ctx_size

    @property
    def max_batch(self) -> int:
        return self.scheduler.max_batch

    @property
    def busy(self) -> bool:
        """Whether a sequence is running (or its group is about to)."""
        return self.scheduler.active or self._serial_busy

    def running(self) -> int:
        """Sequences in the running batch now."""
        return len(self.scheduler.running) + int(self._serial_busy)

    def check_fits(self, prompt_ids: list[int], sampling: Sampling) -> None:
        """Refuse, before it is queued, a request the KV cache or the vocabulary cannot hold; a
        request without max_tokens gets the room its prompt leaves (as OpenAI, vLLM and
        llama-server do), so only a prompt that fills the context is refused."""
        if not prompt_ids:
            raise ApiError(400, "prompt: encodes to zero tokens", param="prompt")
        n = getattr(sampling, "n", 1)
        if n > self.max_batch:
            raise ApiError(400, f"n: {n} choices run at once, and this server runs at most {self.max_batch} "
                                "sequences together (serve --max-batch)", param="n")
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
        job.submitted_at = time.perf_counter()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            with self.metrics.lock:
                self.metrics.rejected_full += 1
            raise ApiError(503, "the server is busy: the request queue is full, retry later", type="server_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        return job.seq

    def queue_length(self) -> int:
        """Requests waiting: queued, or taken for the next step's admission."""
        return self.jobs.qsize() + len(self.scheduler.waiting)

    def close(self) -> None:
        # Queued jobs are told the server is going; the running ones stop at the next step.
        for job in self.jobs.close():
            job.cancelled.set()
            self._emit_all(job, "done", lambda: JobResult("", [], "cancelled", len(job.prompt_ids), None))
        with self._lock:
            for job in self._running_jobs:
                job.cancelled.set()
        self._thread.join(timeout=60)

    # --- the engine thread ------------------------------------------------------------------------

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            if not sched.active and not self.jobs.wait(gather=sched.max_batch > 1):
                return  # closed, nothing left
            if self.serial:
                self._run_serial()
                continue
            self._start_jobs()
            if not sched.active:
                continue
            try:
                info = sched.step()
            except Exception as exc:  # a scheduler fault must not take the server down: its sequences fail
                sched.abort(exc)
                continue
            for s in info.admitted:
                if s is s.group[0]:
                    self.metrics.record_wait(s.wait_seconds)
            self.metrics.record_step(info.rows, info.union_experts, len(sched.running))

    def _start_jobs(self) -> None:
        """Move queued jobs into the scheduler while it has a cache for each of their sequences (FIFO:
        the head waits for room, the rest wait behind it)."""
        while True:
            job = self.jobs.head()
            if job is None:
                return
            if job.cancelled.is_set():  # its client left while it waited: a cancelled request too
                self.jobs.pop()
                with self.metrics.lock:
                    self.metrics.cancelled += 1
                self._emit_all(job, "done", lambda: JobResult("", [], "cancelled", len(job.prompt_ids), None))
                continue
            if self.scheduler.room() < min(job.n, self.max_batch):  # more than max_batch: refused below
                return
            self.jobs.pop()
            self.started_order.append(job.seq)
            if len(self.started_order) > STARTED_KEPT:
                del self.started_order[:-STARTED_KEPT]
            try:
                seqs = [_Choice(self, job, i).sequence for i in range(job.n)]
                with self._lock:
                    self._running_jobs.add(job)
                self.scheduler.submit(seqs)
            except Exception as exc:  # a grammar, a sampler or an n the request's values make impossible
                with self._lock:
                    self._running_jobs.discard(job)
                why = f"{type(exc).__name__}: {exc}"
                self._emit_all(job, "done", lambda: JobResult("", [], "error", len(job.prompt_ids), None, error=why))

    def _run_serial(self) -> None:
        """The queue's head through generate() (drafting on), as one sequence."""
        job = self.jobs.pop()
        if job.cancelled.is_set():
            with self.metrics.lock:
                self.metrics.cancelled += 1
            self._emit_all(job, "done", lambda: JobResult("", [], "cancelled", len(job.prompt_ids), None))
            return
        self.started_order.append(job.seq)
        if len(self.started_order) > STARTED_KEPT:
            del self.started_order[:-STARTED_KEPT]
        self._serial_busy = True
        try:
            try:
                choice = _Choice(self, job, 0)
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                self._emit_all(job, "done", lambda: JobResult("", [], "error", len(job.prompt_ids), None, error=why))
                return
            seq, d = choice.sequence, choice.sequence.decoding
            seq.admitted = time.perf_counter()
            self.metrics.record_wait(seq.wait_seconds)
            with self._lock:
                self._running_jobs.add(job)  # close() cancels it
            try:
                generate(self.engine, job.prompt_ids, d.max_new_tokens, d.sampler, on_token=choice.on_token,
                         logprobs=d.logprobs, generation=choice.gen, processors=choice.processors)
                seq.outcome = "finished"
            except Exception as exc:  # a failed generation must not take the server down
                seq.outcome, seq.error = "error", exc
            gen = choice.gen
            seq.first_token_at = seq.admitted + gen.ttft_seconds
            seq.last_token_at = seq.first_token_at + sum(gen.token_seconds)
            choice.done(seq)
        finally:
            self._serial_busy = False

    def _emit_all(self, job: Job, kind: str, value) -> None:
        for i in range(job.n):
            v = value()
            job.emit(kind, v if job.n == 1 else (i, v))

    def _finished(self, job: Job, choice: "_Choice") -> None:
        choice.left = True
        if all(c.left for c in job.choices):
            with self._lock:
                self._running_jobs.discard(job)

    def _grammar(self, grammar: str):
        # The tokenizer's token trie costs ~0.4 s at 32k tokens, 1-2 s at 152k: once per model, on
        # this thread, and only when a request asks for structure.
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer, self.engine.args.vocab_size, self.eos_ids)
        return self._grammar_tokenizer.processor(grammar)


class _Choice:
    """One sequence of a job (choice `index` of its n): its text stream, its sampler (seed + index),
    its processors, and what it emits as its tokens come and when it leaves the batch."""

    def __init__(self, worker: GenerationWorker, job: Job, index: int):
        self.worker, self.job, self.index = worker, job, index
        self.left = False
        job.choices.append(self)
        s = job.sampling
        if job.processors and job.n > 1:
            raise ValueError("a job's own processors hold one generation's state: they go with n = 1")
        self.stream = TextStream(SpecialText(worker.tokenizer) if job.special_text else worker.tokenizer, s.stop)
        self.gen = Generation(list(job.prompt_ids))
        grammar = worker._grammar(s.grammar) if s.grammar else None
        sampler = Sampler(s.temperature, s.top_p, (s.seed + index) % (SEED_MAX + 1), min_p=s.min_p,
                          presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
                          repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias)
        self.processors = [*job.processors, *([grammar] if grammar else [])]
        decoding = Decoding(worker.engine, job.prompt_ids, s.max_tokens, sampler, on_token=self.on_token,
                            logprobs=s.logprobs, generation=self.gen, processors=self.processors)
        self.sequence = BatchSequence(decoding, cancelled=job.cancelled.is_set, on_done=self.done)
        self.sequence.submitted = job.submitted_at

    def emit(self, kind: str, value) -> None:
        self.job.emit(kind, value if self.job.n == 1 else (self.index, value))

    def on_token(self, token: int) -> bool:
        if self.job.cancelled.is_set():
            return True
        if token in self.worker.eos_ids:
            return True
        if self.job.sampling.logprobs is not None:
            self.emit("logprob", (self.gen.logprobs[-1], len(self.stream.text)))  # the token and where its text starts
        piece = self.stream.push(token)
        if piece:
            self.emit("text", piece)
        return self.stream.stopped

    def done(self, seq) -> None:
        """The sequence has left the batch (on the worker thread): its tail, its result, its figures."""
        job, worker, gen = self.job, self.worker, self.gen
        try:
            if seq.outcome == "error":
                exc = seq.error
                self.emit("done", JobResult("", [], "error", len(job.prompt_ids), None,
                                            error=f"{type(exc).__name__}: {exc}"))
                return
            ids = gen.output_ids
            cancelled = job.cancelled.is_set() or seq.outcome == "cancelled"
            if not cancelled:
                # Before the finish reason: the tail may complete a stop (after a character that
                # was still split when the last token came).
                tail = self.stream.flush()
                if tail:
                    self.emit("text", tail)
            if cancelled:
                reason = "cancelled"
            elif self.stream.stopped or gen.stopped_by_processor or (ids and ids[-1] in worker.eos_ids):
                reason = "stop"  # a complete grammar ends the answer as end-of-sequence does
            else:
                reason = "length"
            output_ids = ids[:-1] if ids and ids[-1] in worker.eos_ids else ids
            # The tokens usage reports (an end-of-sequence token is not one), so the two agree.
            ran = time.perf_counter() - seq.admitted if seq.admitted is not None else 0.0
            worker.metrics.record_generation(len(job.prompt_ids), len(output_ids), gen.ttft_seconds, gen.token_seconds,
                                             ran, reason == "cancelled")
            if worker.log is not None:
                worker.log(_log_line(job, self.index, seq, len(output_ids), reason))
            self.emit("done", JobResult(self.stream.text, output_ids, reason, len(job.prompt_ids), gen))
        finally:
            worker._finished(job, self)


def _log_line(job: Job, index: int, seq, generated: int, reason: str) -> str:
    """One line per finished sequence: its wait in the queue, TTFT (from its admission) and decode speed."""
    gen = seq.decoding.gen
    name = f"request {job.seq}" + (f" choice {index}" if job.n > 1 else "")
    decode = seq.decode_seconds
    steps = len(gen.output_ids) - 1  # tokens after the first, over the time from the first to the last
    speed = f"{steps / decode:.1f} tok/s" if steps > 0 and decode > 0 else "- tok/s"
    wait = seq.wait_seconds or 0.0
    return (f"colibri serve: {name}: {len(job.prompt_ids)} prompt tokens ({gen.cached_tokens} cached), "
            f"wait {wait:.2f} s, TTFT {gen.ttft_seconds:.2f} s, {generated} tokens at {speed}, {reason}")
