"""KL divergence and top-1 agreement against bf16 from both tools, on the same text (`peers.py --quant`).

Theirs, llama.cpp's llama-perplexity (scripts/build_llama_cpp.sh builds it):
    llama-perplexity -m BF16.gguf -f TEXT -c CTX --chunks N -t T -b CTX --kl-divergence-base BASE.kld
once (the bf16 log-probabilities and the tokens, saved), then per quantized GGUF
    llama-perplexity -m Q.gguf --kl-divergence-base BASE.kld --kl-divergence -c CTX -t T -b CTX
which re-reads the tokens from BASE.kld, so every quant is scored on the base run's tokens.
Ours: `colibri quality --model OURS --reference BF16_DIR --text TEXT --tokens N*CTX --ctx CTX --threads T --json`.

Both score alike (engine/run/quality.py was written to match llama-perplexity): the token stream
is cut into N chunks of CTX tokens, each evaluated from an empty context, and the last
CTX - 1 - CTX/2 next-token predictions of each are scored: mean / median / p99 / max of
KL(P_bf16 || P_q) over the full vocabulary, and how often the two argmaxes agree. -b CTX keeps
llama-perplexity at one sequence per batch, as ours evaluates one chunk at a time.

Same text, same tokens: TEXT is the held-out Python standard library sources (what `colibri
quality` scores by default), cut to a little more than N*CTX tokens and written once into the
work directory; the ids each tool gives it are compared (llama-tokenize -f, no BOS) and the
conditions say how many of the first N*CTX agree. llama-perplexity puts a BOS token first in each
chunk only when the GGUF says add_bos_token; synth's tokenizer has no BOS (the converter writes
false), so it does not here, and the conditions record the flag.

What differs, and is stated with the figures: llama-quantize quantizes every tensor it
quantizes by default (attention, shared, output included), `colibri convert` only the routed
experts; llama.cpp keeps the base's log-probabilities as 16-bit codes (its own rounding of the
reference); llama.cpp computes with fp32 activations, ours with bf16 ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from engine.api import stdlib_corpus


class PerplexityOutputError(ValueError):
    """llama-perplexity's output lacks a figure the table needs (it failed, or its format changed)."""


_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
# One pattern per figure of llama-perplexity's KL summary (tools/perplexity/perplexity.cpp,
# kl_divergence()): (name, regex, scale to a fraction where it prints a percentage).
_KLD_FIELDS = [
    ("chunks", r"computing over (\d+) chunks, n_ctx=(\d+)", None),
    ("ppl_model", rf"Mean PPL\(Q\)\s*:\s*{_NUM}\s*±\s*{_NUM}", 1.0),
    ("ppl_reference", rf"Mean PPL\(base\)\s*:\s*{_NUM}\s*±\s*{_NUM}", 1.0),
    ("ppl_ratio", rf"Mean PPL\(Q\)/PPL\(base\)\s*:\s*{_NUM}\s*±\s*{_NUM}", 1.0),
    ("kl_mean", rf"Mean\s+KLD:\s*{_NUM}\s*±\s*{_NUM}", 1.0),
    ("kl_max", rf"Maximum KLD:\s*{_NUM}", 1.0),
    ("kl_p99", rf"99\.0%\s+KLD:\s*{_NUM}", 1.0),
    ("kl_median", rf"Median\s+KLD:\s*{_NUM}", 1.0),
    ("top1_agreement", rf"Same top p:\s*{_NUM}\s*±\s*{_NUM}\s*%", 0.01),
]


def parse_kld(text: str) -> dict:
    """The figures of one `llama-perplexity --kl-divergence` run, keyed as `colibri quality --json`
    keys its own (kl_mean, kl_median, kl_p99, kl_max, top1_agreement as a fraction, ppl_*), plus
    the ± llama.cpp prints for the means (`<name>_unc`), chunks and ctx."""
    out: dict = {}
    missing = []
    for name, pattern, scale in _KLD_FIELDS:
        m = re.search(pattern, text)
        if m is None:
            missing.append(name)
            continue
        if scale is None:
            out["chunks"], out["ctx"] = int(m.group(1)), int(m.group(2))
            continue
        out[name] = float(m.group(1)) * scale
        if m.lastindex and m.lastindex >= 2:
            out[name + "_unc"] = float(m.group(2)) * scale
    if missing:
        tail = " | ".join(line for line in text.strip().splitlines()[-3:])
        raise PerplexityOutputError(f"llama-perplexity printed no {', '.join(missing)} (last lines: {tail[:300]!r})")
    out["scored_tokens"] = out["chunks"] * (out["ctx"] - 1 - out["ctx"] // 2)
    return out


def parse_base(text: str) -> dict:
    """The base run's chunk count and context."""
    m = re.search(r"(?:computing|calculating perplexity) over (\d+) chunks, n_ctx=(\d+)", text)
    if m is None:
        raise PerplexityOutputError("llama-perplexity's base run printed no chunk count (did it fail?)")
    return {"chunks": int(m.group(1)), "ctx": int(m.group(2))}


def gguf_add_bos(llama_dir: Path, gguf: Path) -> bool | None:
    """tokenizer.ggml.add_bos_token of a GGUF (llama-perplexity's BOS-per-chunk rule), read with
    llama.cpp's own gguf-py (from the built tree: not a dependency of the project, so imported
    here); None when the key is absent."""
    sys.path.insert(0, str(llama_dir / "src" / "gguf-py"))
    from gguf import GGUFReader
    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.add_bos_token")
    return None if field is None else bool(field.contents())


def write_text(path: Path, tokenizer, tokens: int) -> dict:
    """Write the held-out stdlib text, cut at a line end a little past `tokens` of our tokenizer's
    ids (so neither tool's stream ends inside the scored part), atomically; returns its description."""
    _, held, info = stdlib_corpus()
    chars = 64 * tokens
    while True:
        cut = held.rfind("\n", 0, chars) + 1 or chars
        if len(tokenizer.encode(held[:cut]).ids) >= tokens + 64 or cut >= len(held):
            break
        chars *= 2
    text = held[:cut]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return {"description": "held-out " + info["description"], "chars": len(text),
            "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def same_prefix(a: list[int], b: list[int], n: int) -> int:
    """How many of the first n ids the two streams share before they first differ."""
    for i, (x, y) in enumerate(zip(a[:n], b[:n])):
        if x != y:
            return i
    return min(n, len(a), len(b))


def llama_text_ids(llama_dir: Path, gguf: Path, text: Path) -> list[int]:
    out = subprocess.run([str(llama_dir / "build/bin/llama-tokenize"), "-m", str(gguf), "-f", str(text), "--ids",
                          "--log-disable", "--no-bos"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def llama_perplexity(llama_dir: Path, gguf: Path, argv: list[str], save: Path) -> str:
    """Run llama-perplexity; its figures go to stdout and its log to stderr: both are returned,
    and kept in `save` (the table's figures can be checked against the tool's own print)."""
    run = subprocess.run([str(llama_dir / "build/bin/llama-perplexity"), "-m", str(gguf), *argv],
                         capture_output=True, text=True)
    save.write_text(run.stdout + "\n" + run.stderr)
    if run.returncode != 0:
        tail = run.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise PerplexityOutputError(f"llama-perplexity -m {gguf.name} exited {run.returncode}: {tail[0][:200]}")
    return run.stdout + "\n" + run.stderr


def ours_quality(model: Path, reference: Path, text: Path, tokens: int, ctx: int, threads: int, src: str) -> dict:
    argv = [sys.executable, "-m", "colibri.cli", "quality", "--model", str(model), "--reference", str(reference),
            "--text", str(text), "--tokens", str(tokens), "--ctx", str(ctx), "--threads", str(threads), "--json"]
    # cwd too: `-m` puts the working directory first on sys.path, ahead of PYTHONPATH
    run = subprocess.run(argv, capture_output=True, text=True, cwd=src, env={**os.environ, "PYTHONPATH": src})
    if run.returncode != 0:
        raise PerplexityOutputError(f"colibri quality --model {model.name} failed: "
                                    f"{(run.stderr.strip().splitlines() or ['?'])[-1][:200]}")
    return json.loads(run.stdout)


def measure(work: Path, llama_dir: Path, model: Path, gguf: Path, pairs: list[tuple[str, str, Path, Path]],
            tokens: int, ctx: int, threads: int, src: str, tokenizer, log=print) -> tuple[list[dict], dict]:
    """Rows {quant, theirs, ours: {...}, llama: {...}} for each (quant, their name, our dir, their
    GGUF) and the conditions of the measurement (text, token agreement, both tools' settings)."""
    chunks = tokens // ctx
    tokens = chunks * ctx
    text = work / f"kl-text-{tokens}.txt"
    about = write_text(text, tokenizer, tokens)
    ours_ids = tokenizer.encode(text.read_text(encoding="utf-8")).ids
    agree = same_prefix(ours_ids, llama_text_ids(llama_dir, gguf, text), tokens)
    common = ["-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    base = work / f"{gguf.stem}-{tokens}x{ctx}.kld"
    base_log = base.with_suffix(".log")
    if base.exists() and base_log.exists() and f"saving all logits to {base}" in base_log.read_text():
        base_info = parse_base(base_log.read_text())  # the same text and settings: its logits are kept
    else:
        log(f"peers: llama-perplexity base logits of {gguf.name} ({chunks} chunks of {ctx})")
        base_info = parse_base(llama_perplexity(llama_dir, gguf, ["-f", str(text), "--chunks", str(chunks),
                                                                  "--kl-divergence-base", str(base), *common],
                                                base_log))
    if (base_info["chunks"], base_info["ctx"]) != (chunks, ctx):
        raise PerplexityOutputError(f"llama-perplexity scored {base_info['chunks']} chunks of {base_info['ctx']}, "
                                    f"not {chunks} of {ctx} (fewer tokens of the text than ours?)")
    rows = []
    for quant, theirs, ours_dir, their_gguf in pairs:
        log(f"peers: KL of {their_gguf.name} (llama-perplexity) and {ours_dir.name} (colibri quality)")
        kept = work / f"{their_gguf.stem}-{tokens}x{ctx}.kld.log"
        llama = parse_kld(kept.read_text() if kept.exists() and kept.stat().st_mtime > base.stat().st_mtime and
                          "Same top p" in kept.read_text() else
                          llama_perplexity(llama_dir, their_gguf, ["--kl-divergence-base", str(base),
                                                                   "--kl-divergence", *common], kept))
        ours = ours_quality(ours_dir, model, text, tokens, ctx, threads, src)
        rows.append({"quant": quant, "theirs": theirs, "ours": {k: ours[k] for k in QUALITY_KEYS},
                     "llama": llama})
    conditions = {
        "text": f"{text.name}: {about['description']}, first {about['chars']} characters (sha256 {about['sha256']})",
        "token stream": f"{tokens} tokens = {chunks} chunks of {ctx}, second halves scored "
                        f"({chunks * (ctx - 1 - ctx // 2)} positions); llama.cpp's ids equal ours for the first "
                        f"{agree} of {tokens}; BOS put first in each chunk by llama-perplexity: "
                        f"{gguf_add_bos(llama_dir, gguf)} (tokenizer.ggml.add_bos_token)",
        "llama-perplexity": f"-c {ctx} -b {ctx} -t {threads}, base: -f TEXT --chunks {chunks} --kl-divergence-base "
                            f"{base.name} on {gguf.name}; each quant: --kl-divergence-base {base.name} --kl-divergence",
        "colibri quality": f"--reference {model.name} --text TEXT --tokens {tokens} --ctx {ctx} --threads {threads} "
                           f"(compute dtype auto: bf16)",
    }
    return rows, conditions


QUALITY_KEYS = ("kl_mean", "kl_median", "kl_p99", "kl_max", "top1_agreement", "ppl_model", "ppl_reference",
                "scored_tokens")
