"""What structured output costs: decode tok/s with and without a JSON-schema mask, the schema's compile
time, and the grammar engines side by side (why engine/run/grammar.py uses llguidance).

decode: one Engine (--model, resident by default or streamed under --budget) generates --tokens
tokens at temperature 1 with no constraint, then under SCHEMA (an array of 64 bounded records:
nested object, enum, anyOf, integer range; it cannot complete before --tokens, so both runs decode
the same count), alternating which goes first per repeat. Rows: tok/s over the decode steps (each
step = forward + mask + sample), the step's median, and the mask's own median (the processor's
__call__ + accept, timed inside the step). The two runs decode different tokens, which route to
different experts: streamed under a budget that changes the cache hits and reads, so the tok/s
pair mixes the mask with the route; the mask column is the grammar's own cost either way. Notes:
the model's grammar tokenizer build (once per model), SCHEMA's compile (json_grammar + matcher,
per request), median of 20, and a tool-call grammar's compile per format (tool_choice required
over TOOLS, two strict functions: colibri/serve/tools/constrain.py's grammar + matcher, per
request), median of 10.

engines: per synth BPE vocabulary (--vocab, the tokenizer engine/synth trains; no downloads), each
grammar engine that imports walks a valid document of ENGINE_SCHEMA token by token: mask into a
bitmask, unpack + -inf fill (the same numpy/torch code for all), advance. llguidance is a
dependency; xgrammar and outlines-core are not — put them on PYTHONPATH to compare, e.g.
`pip install --no-deps --target /tmp/gram xgrammar==0.2.9 apache-tvm-ffi outlines-core==0.2.14`.

    .venv/bin/python benchmarks/serving/grammar_overhead.py decode --model demo --tokens 64 --repeats 2
    .venv/bin/python benchmarks/serving/grammar_overhead.py decode --model demo --budget 1GiB --tokens 32
    PYTHONPATH=/tmp/gram .venv/bin/python benchmarks/serving/grammar_overhead.py engines --vocab 32000 151936
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks.benchkit

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "label": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["alpha", "beta", "gamma"]},
    "where": {"type": "object", "properties": {"x": {"type": "number"}, "tag": {"anyOf": [
        {"type": "null"}, {"type": "string", "maxLength": 8}]}}, "required": ["x", "tag"], "additionalProperties": False}},
    "required": ["id", "label", "kind", "where"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"rows": {"type": "array", "items": RECORD, "minItems": 64, "maxItems": 64}},
          "required": ["rows"], "additionalProperties": False}
ENGINE_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
    "address": {"type": "object", "properties": {"street": {"type": "string", "maxLength": 60},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False},
    "contact": {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}, "score": {"type": "number"}},
    "required": ["name", "age", "role", "tags", "address", "contact", "score"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1,
                                                                                            "maximum": 14},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
             "type": "object", "properties": {"query": {"type": "string", "maxLength": 120},
                                              "limit": {"type": "integer", "minimum": 1, "maximum": 50}},
             "required": ["query", "limit"], "additionalProperties": False}}}]
DOC = {"name": "Ada Lovelace, analyst of engines", "age": 36, "role": "admin", "tags": ["math", "poetry", "engines"],
       "address": {"street": "12 St James's Square, London", "zip": "10115"}, "contact": None, "score": 97.25}


class Timed:
    """A processor whose own time per step is recorded."""

    def __init__(self, inner):
        self.inner, self.seconds, self._t = inner, [], 0.0

    def __call__(self, logits, generated):
        t = time.perf_counter()
        out = self.inner(logits, generated)
        self._t = time.perf_counter() - t
        return out

    def accept(self, token):
        t = time.perf_counter()
        self.inner.accept(token)
        self.seconds.append(self._t + time.perf_counter() - t)

    def done(self):
        return self.inner.done()


def decode(a, benchkit) -> int:
    from engine.api import (Engine, EngineConfig, GrammarTokenizer, Sampler, generate, json_grammar, load_tokenizer,
                            parse_size, resolve_model)
    model_dir = resolve_model(a.model)
    config = EngineConfig(ram_budget=parse_size(a.budget), ctx_size=max(256, a.tokens + 64),
                          **({"threads": a.threads} if a.threads else {}))
    tokenizer = load_tokenizer(model_dir)
    engine = Engine(model_dir, config)
    rows = []
    try:
        t = time.perf_counter()
        eos = engine.checkpoint.config.get("eos_token_id")
        gtok = GrammarTokenizer(tokenizer, engine.args.vocab_size, set(eos if isinstance(eos, list) else [eos]))
        tokenizer_s = time.perf_counter() - t
        compiles = []
        for _ in range(20):
            t = time.perf_counter()
            gtok.processor(json_grammar(SCHEMA))
            compiles.append(time.perf_counter() - t)
        tools = _tool_compiles(tokenizer, gtok, engine.checkpoint.config.get("eos_token_id"))
        prompt = tokenizer.encode("Write the records as JSON:").ids
        generate(engine, prompt, 4, Sampler())  # warm: the first pass pays one-off allocations
        for r in range(a.repeats):
            for mode in (("free", "schema") if r % 2 == 0 else ("schema", "free")):
                timed = Timed(gtok.processor(json_grammar(SCHEMA))) if mode == "schema" else None
                with benchkit.bench_lock(a.lock):
                    gen = generate(engine, prompt, a.tokens, Sampler(temperature=1.0, seed=r),
                                   processors=[timed] if timed else ())
                steps = gen.token_seconds
                rows.append({"repeat": r + 1, "mode": mode, "tokens": len(gen.output_ids),
                             "tok_s": len(steps) / sum(steps), "step_ms_median": statistics.median(steps) * 1e3,
                             "mask_us_median": statistics.median(timed.seconds) * 1e6 if timed else None,
                             "ttft_s": gen.ttft_seconds})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        engine.close()
    tok_s = {m: statistics.median(r["tok_s"] for r in rows if r["mode"] == m) for m in ("free", "schema")}
    notes = {"grammar_tokenizer_build_s": round(tokenizer_s, 3),
             "schema_compile_ms": benchkit.fmt_spread(benchkit.spread(c * 1e3 for c in compiles), 2),
             "tool_grammar_compile_ms": ", ".join(f"{f} {statistics.median(t) * 1e3:.2f}" for f, t in tools.items()),
             "decode_tok_s_free_vs_schema": f"{tok_s['free']:.2f} vs {tok_s['schema']:.2f} "
                                            f"({(tok_s['schema'] / tok_s['free'] - 1) * 100:+.1f}%)"}
    columns = [("repeat", lambda r: r["repeat"]), ("mode", lambda r: r["mode"]), ("tokens", lambda r: r["tokens"]),
               ("decode tok/s", lambda r: round(r["tok_s"], 2)), ("step ms (median)", lambda r: round(r["step_ms_median"], 2)),
               ("mask µs (median)", lambda r: r["mask_us_median"] and round(r["mask_us_median"], 1)),
               ("TTFT s", lambda r: round(r["ttft_s"], 3))]
    benchkit.emit("grammar_overhead", rows, benchkit.run_conditions(a, model_vocab=engine.args.vocab_size), a.json, columns,
                  notes)
    return 0


def _tool_compiles(tokenizer, gtok, eos) -> dict[str, list[float]]:
    """Per tool-call format, the seconds of 10 compiles of TOOLS' grammar (tool_choice required)."""
    from colibri.serve.tools import FORMATS
    from colibri.serve.tools.constrain import Marks, tool_grammar
    from colibri.serve.tools.request import parse_tool_fields
    request = parse_tool_fields({"tools": TOOLS, "tool_choice": "required"})
    marks = Marks.of(tokenizer, set(eos if isinstance(eos, list) else [eos]))
    out = {}
    for fmt in FORMATS:
        out[fmt.name] = []
        for _ in range(10):
            t = time.perf_counter()
            gtok.processor(tool_grammar(fmt, request, marks))
            out[fmt.name].append(time.perf_counter() - t)
    return out


def _gpt2_bytes() -> dict[str, int]:
    """The byte-level BPE alphabet: printable character -> byte (GPT-2's table)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _llguidance(text, vocab, eos):
    import llguidance
    lt = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos)

    def compile_():
        m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(ENGINE_SCHEMA, defaults={
            "whitespace_flexible": False}))
        return lambda bits: m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes), m.consume_token
    return compile_


def _xgrammar(text, vocab, eos):
    import xgrammar
    encoded = [""] * vocab
    for s, i in json.loads(text)["model"]["vocab"].items():
        encoded[i] = s
    info = xgrammar.TokenizerInfo(encoded, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_():
        import torch
        m = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(ENGINE_SCHEMA), any_whitespace=False,
                                                                 separators=(",", ":")))

        def fill(bits):
            m.fill_next_token_bitmask(torch.from_numpy(bits).view(1, -1))
        return fill, m.accept_token
    return compile_


def _outlines(text, vocab, eos):
    import outlines_core
    u2b, vmap = _gpt2_bytes(), {}
    for s, i in json.loads(text)["model"]["vocab"].items():
        if i != eos:
            vmap.setdefault(bytes(u2b[c] for c in s), []).append(i)
    voc = outlines_core.Vocabulary(eos, vmap)

    def compile_():
        g = outlines_core.Guide(outlines_core.Index(
            outlines_core.json_schema.build_regex_from_schema(json.dumps(ENGINE_SCHEMA), r""), voc))

        def fill(bits):
            bits[:] = 0
            g.write_mask_into(bits.ctypes.data, bits.size, 4)
        return fill, g.advance
    return compile_


ENGINES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def engines(a, benchkit) -> int:
    import numpy as np
    import torch
    from engine.api import synth
    torch.set_num_threads(1)
    rows = []
    for vocab in a.vocab:
        tok = synth.build_tokenizer(vocab)
        text, eos = tok.to_str(), tok.token_to_id("<|endoftext|>")
        ids = tok.encode(json.dumps(DOC, separators=(",", ":")), add_special_tokens=False).ids
        logits = torch.randn(vocab)
        for name, make in ENGINES.items():
            try:
                t = time.perf_counter()
                compile_ = make(text, vocab, eos)
                init_s = time.perf_counter() - t
            except ImportError:
                continue
            compiles, masks, fills, advances = [], [], [], []
            with benchkit.bench_lock(a.lock):
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    fill, advance = compile_()
                    compiles.append(time.perf_counter() - t)
                    bits = np.zeros((vocab + 31) // 32, dtype=np.int32)
                    for token in ids:
                        t0 = time.perf_counter()
                        fill(bits)
                        t1 = time.perf_counter()
                        allowed = np.unpackbits(bits.view(np.uint8), bitorder="little", count=vocab)
                        logits.masked_fill(torch.from_numpy(allowed == 0), float("-inf"))
                        t2 = time.perf_counter()
                        assert allowed[token], (name, token)
                        advance(token)
                        masks.append(t1 - t0), fills.append(t2 - t1), advances.append(time.perf_counter() - t2)
            us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
            rows.append({"vocab": vocab, "engine": name, "tokens": len(ids), "tokenizer_init_s": init_s,
                         "compile_ms": statistics.median(compiles) * 1e3, "mask_us": us(masks),
                         "mask_us_p90": sorted(masks)[int(0.9 * len(masks))] * 1e6, "unpack_fill_us": us(fills),
                         "advance_us": us(advances)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    columns = [("vocab", lambda r: r["vocab"]), ("engine", lambda r: r["engine"]),
               ("tokenizer init s", lambda r: round(r["tokenizer_init_s"], 2)),
               ("compile ms (median)", lambda r: round(r["compile_ms"], 1)),
               ("mask µs (median)", lambda r: round(r["mask_us"], 1)), ("mask µs p90", lambda r: round(r["mask_us_p90"], 1)),
               ("unpack+fill µs", lambda r: round(r["unpack_fill_us"], 1)), ("advance µs", lambda r: round(r["advance_us"], 1))]
    benchkit.emit("grammar_overhead", rows, benchkit.run_conditions(a), a.json, columns)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("decode", "engines"))
    p.add_argument("--model", default="demo", help="decode: model directory or synth preset (default demo)")
    p.add_argument("--budget", default="0", help="decode: memory budget, e.g. 1GiB (default 0: resident)")
    p.add_argument("--tokens", type=int, default=64, help="decode: tokens per generation (default 64)")
    p.add_argument("--threads", type=int, default=0, help="decode: compute threads (default: the engine's)")
    p.add_argument("--repeats", type=int, default=2, help="repeats (decode: per mode; engines: document walks)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="engines: synth BPE vocabularies")
    p.add_argument("--lock", help="hold this flock around each measured step (not with `quiet bench`)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from benchmarks import benchkit
    if a.tokens < 2 or a.repeats < 1:
        return benchkit.refuse("grammar_overhead", "--tokens must be >= 2 and --repeats >= 1")
    return decode(a, benchkit) if a.part == "decode" else engines(a, benchkit)


if __name__ == "__main__":
    sys.exit(main())
