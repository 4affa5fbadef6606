"""`colibri quality`: how far a (quantized) model's next-token distributions are from a reference.

The figures llama.cpp's `llama-perplexity --kl-divergence` reports, computed the same way so
they compare: the token stream is cut into chunks of `ctx` tokens, each evaluated from an empty
context (teacher-forced: the true tokens are fed, never the model's own), and only the second
half of each chunk is scored, so every scored token has at least ctx/2 tokens of context.
Per scored position: KL(P_ref || P_q) of the full next-token distributions, whether the two
argmaxes agree, and each model's negative log-likelihood of the true next token.

Both models run through the engine (`engine.runtime.Engine`), fully resident, one after the
other; only the reference's per-chunk log-probabilities are held while the other model runs
(float32 [ctx/2, V] per chunk).
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import torch

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError, ModelFormatError, PromptError
from engine.base.inputs import read_text_input
from engine.format import fp8_checkpoint
from engine.format.checkpoint import Checkpoint
from engine.run.generate import check_finite_logits, load_tokenizer
from engine.run.runtime import Engine, checkpoint_dtype

HELD_OUT_EVERY = 20  # one stdlib file in 20 is held out of training


def stdlib_corpus() -> tuple[str, str, dict]:
    """(train text, held-out text, description): this interpreter's standard library sources.

    Every CPython install has them, offline. Test packages, idlelib, turtledemo and
    site-packages are left out (tests are mostly data); files are sorted by relative path and
    one in HELD_OUT_EVERY (by a hash of that path) is held out, so the split is the same on
    every machine with the same Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "tests", "idlelib", "turtledemo", "site-packages", "lib2to3", "__pycache__")
    files = sorted(p for p in root.rglob("*.py") if not any(part in skip for part in p.relative_to(root).parts))
    train, held = [], []
    for p in files:
        rel = str(p.relative_to(root))
        text = p.read_text(encoding="utf-8", errors="replace")
        (held if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0 else train).append(text)
    import platform
    info = {"description": f"Python {platform.python_version()} standard library .py sources under {root} "
                           f"(tests, idlelib, turtledemo, lib2to3 excluded), 1 file in {HELD_OUT_EVERY} held out",
            "root": str(root), "files_train": len(train), "files_held": len(held)}
    sep = "\n<|endoftext|>\n"
    return sep.join(train), sep.join(held), info


def token_stream(reference_dir, tokens: int, text_file: str | None = None) -> tuple[list[int], str]:
    """The fixed stream both models are scored on, and a description of it."""
    tok = load_tokenizer(reference_dir)
    if tok is None:
        raise PromptError(f"{reference_dir} has no tokenizer.json: quality needs text to score")
    if text_file:
        # Bounded: `--text /dev/zero` used to read until the machine ran out of memory.
        text, what = read_text_input(text_file, "text corpus", ConfigError), text_file
    else:
        _, text, info = stdlib_corpus()
        what = "held-out " + info["description"]
    ids = _encode_prefix(tok, text, tokens)
    if len(ids) < tokens:
        raise ConfigError(f"{what}: the text has {len(ids)} tokens, fewer than --tokens {tokens}")
    return ids[:tokens], what


def _encode_prefix(tok, text: str, tokens: int) -> list[int]:
    """The first `tokens` ids of the text, encoding only as much of it as that needs.

    A 64 MiB corpus (or one long JSON string) would otherwise be tokenized whole for 4k tokens.
    The byte-level pre-tokenizer splits text into words before merging, so a prefix's ids equal
    the whole text's except around the cut; a margin of words past `tokens` keeps the cut out of
    what is returned."""
    margin = 256
    chars = max(64 * (tokens + margin), 1 << 16)
    while True:
        ids = tok.encode(text[:chars]).ids
        if chars >= len(text) or len(ids) >= tokens + margin:
            return ids
        chars *= 4


def _chunks(ids: list[int], ctx: int):
    for s in range(0, len(ids) - ctx + 1, ctx):
        yield ids[s:s + ctx]


@torch.no_grad()
def _chunk_logprobs(engine, chunk: list[int]) -> torch.Tensor:
    """log-softmax of the logits that predict chunk[ctx/2 + 1 :], from an empty context."""
    logits = engine.forward(chunk, 0)  # [ctx, V] fp32
    check_finite_logits(logits, f" for {engine.checkpoint.directory}")
    half = len(chunk) // 2
    return torch.log_softmax(logits[half:-1].float(), dim=-1)


def measure_quality(model_dir, reference_dir, tokens: int = 4096, ctx: int = 512, text_file: str | None = None,
                    dtype: str = "auto", threads: int = 0, progress=None, model_settings: dict | None = None) -> dict:
    """KL / top-1 / perplexity of model_dir against reference_dir on a fixed text.

    model_settings: EngineConfig fields for the scored model only (the lossy ones: kv_dtype,
    top_k_reduction, expert_threshold); the reference always runs as stored, lossless.
    """
    # A bad model is refused before the reference runs (seconds to hours), not after. Every FP8
    # code and scale of both is checked here (a run only samples them): one read of the weights.
    for directory in (model_dir, reference_dir):
        check_values(Checkpoint(directory))
    reference = Reference(reference_dir, tokens, ctx, text_file, dtype, threads, progress)
    return reference.score(model_dir, model_settings)


class Reference:
    """The fixed text's chunks and the reference's log-probabilities on them, computed once, so
    several models or settings are scored against one run of the reference."""

    def __init__(self, reference_dir, tokens: int, ctx: int, text_file: str | None = None, dtype: str = "auto",
                 threads: int = 0, progress=None):
        if ctx < 4 or tokens < ctx:
            raise ConfigError(f"--tokens {tokens} must be at least --ctx {ctx} (and ctx at least 4)")
        self.reference_dir, self.tokens, self.ctx, self.progress = reference_dir, tokens, ctx, progress
        ids, self.text = token_stream(reference_dir, tokens, text_file)
        self.chunks = list(_chunks(ids, ctx))
        self.config = EngineConfig(ctx_size=ctx, dtype=dtype, threads=threads)
        self._logprobs: list[torch.Tensor] | None = None
        self.meta: dict = {}

    def logprobs(self) -> list[torch.Tensor]:
        if self._logprobs is None:
            with Engine(self.reference_dir, self.config) as engine:
                self.vocab_size = engine.args.vocab_size
                self.meta = _meta(engine, self.reference_dir)
                lps = []
                for i, chunk in enumerate(self.chunks):
                    lps.append(_chunk_logprobs(engine, chunk))
                    if self.progress:
                        self.progress("reference", i + 1, len(self.chunks))
            self._logprobs = lps
        return self._logprobs

    def score(self, model_dir, model_settings: dict | None = None) -> dict:
        ref_lp = self.logprobs()
        with Engine(model_dir, self.config.replace(**(model_settings or {}))) as engine:
            if engine.args.vocab_size != self.vocab_size:
                raise ConfigError(f"{model_dir}: vocab size {engine.args.vocab_size} differs from the reference's")
            meta = _meta(engine, model_dir)
            kl, same, nll_q, nll_r = [], 0, 0.0, 0.0
            for i, chunk in enumerate(self.chunks):
                lq, lr = _chunk_logprobs(engine, chunk), ref_lp[i]
                target = torch.tensor(chunk[len(chunk) // 2 + 1:])
                # KL >= 0, but in float32 two nearly equal distributions can sum to -1e-8: clamp
                # the roundoff, or a mean of near-zero KLs may come out negative.
                kl.append((lr.exp() * (lr - lq)).sum(-1).clamp_min(0.0))
                same += int((lr.argmax(-1) == lq.argmax(-1)).sum())
                nll_q -= float(lq.gather(1, target[:, None]).sum())
                nll_r -= float(lr.gather(1, target[:, None]).sum())
                if self.progress:
                    self.progress("model", i + 1, len(self.chunks))
        kl_all = torch.cat(kl).double()
        n = kl_all.numel()
        ppl_q, ppl_r = _exp(nll_q / n), _exp(nll_r / n)
        return finite_figures({
            "kind": "quality", "model": meta, "reference": self.meta, "text": self.text,
            "tokens": self.tokens, "ctx": self.ctx, "chunks": len(self.chunks), "scored_tokens": n,
            "kl_mean": float(kl_all.mean()), "kl_median": float(kl_all.median()),
            "kl_p99": float(torch.quantile(kl_all, 0.99)), "kl_max": float(kl_all.max()),
            "top1_agreement": same / n,
            "ppl_model": ppl_q, "ppl_reference": ppl_r,
            "ppl_ratio": ppl_q / ppl_r, "ppl_change": ppl_q / ppl_r - 1.0, "ppl_delta": ppl_q - ppl_r,
        })


def _exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else math.inf  # math.exp raises OverflowError past ~709.78


def check_values(ckpt: Checkpoint) -> None:
    spec = fp8_checkpoint.fp8_spec(ckpt.config, f"{ckpt.directory}/config.json")
    if spec is not None:
        fp8_checkpoint.check_fp8_values(ckpt, spec)


def finite_figures(result: dict) -> dict:
    """Refuse to report a NaN or infinite figure: JSON has no NaN, and a reader takes `NaN` for a
    result (the logits were checked, so this is an overflow, e.g. a perplexity past float range)."""
    model = (result.get("model") or {}).get("path", "quality")
    for key, value in result.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ModelFormatError(f"{model}: {key} is {value} (the model's probabilities over- or underflow; "
                                   "its weights are not those of a trained model)")
    return result


def _meta(engine, directory) -> dict:
    return {"path": str(directory), "quant": engine_quant_label(engine),
            "compute_dtype": str(engine.dtype).replace("torch.", "")}


def engine_quant_label(engine) -> str:
    """'int4-g64', or the stored dtype of an unquantized model ('bfloat16')."""
    spec = getattr(engine, "quant", None)
    return spec.label if spec is not None else str(checkpoint_dtype(engine.checkpoint)).replace("torch.", "")


def format_quality(r: dict) -> str:
    return "\n".join([
        f"model {r['model']['path']} ({r['model']['quant']}) vs reference {r['reference']['path']} "
        f"({r['reference']['quant']}), compute {r['model']['compute_dtype']}",
        f"text: {r['text']}; {r['scored_tokens']} scored tokens ({r['chunks']} chunks of {r['ctx']}, second halves)",
        f"KL divergence: mean {r['kl_mean']:.6f}, median {r['kl_median']:.6f}, p99 {r['kl_p99']:.6f}, "
        f"max {r['kl_max']:.6f}",
        f"same top-1: {100 * r['top1_agreement']:.2f}%",
        f"perplexity: model {r['ppl_model']:.4f}, reference {r['ppl_reference']:.4f} "
        f"(ratio {r['ppl_ratio']:.5f}, change {100 * r['ppl_change']:+.3f}%, delta {r['ppl_delta']:+.4f})",
    ])
