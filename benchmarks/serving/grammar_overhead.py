"""What structured output costs: decode tok/s with and without a JSON-schema mask, the schema's compile
time, and the grammar engines side by side (why engine/run/grammar.py uses llguidance).

decode: for each --budget (default: 0, everything resident, and 1GiB, the experts streamed from the
SSD through the RAM cache), one Engine on --model (default demo, synthesized on first use) generates
--tokens tokens at temperature 1 with no constraint, then under SCHEMA (an array of 64 bounded
records: nested object, enum, anyOf, integer range; it cannot complete before --tokens, so both
runs decode the same count), alternating which goes first per repeat. One table row per budget:
decode tok/s over the steps (each step = forward + mask + sample), median (min-max) over the
repeats, free and under the schema; the step's median; and the mask's own median (the processor's
__call__ + accept, timed inside the step). The two runs decode different tokens, which route to
different experts: streamed, that changes the cache hits and reads, so the tok/s pair mixes the
mask with the route; the mask column is the grammar's own cost either way. Notes above the table:
the model's grammar tokenizer build (once per model), SCHEMA's compile (json_grammar + matcher, per
request), median of 20, and a tool-call grammar's compile per format (tool_choice required over
TOOLS, two strict functions: colibri/serve/tools/constrain.py's grammar + matcher, per request),
median of 10. The line above them states the conditions (machine, commit, load, flags, io mode).
Each run's figures also go to stderr as one JSON line; --json prints them in the rows' `runs`.

engines: per synth BPE vocabulary (--vocab, the tokenizer engine/synth trains; no downloads), each
grammar engine that imports walks a valid document of ENGINE_SCHEMA token by token: mask into a
bitmask, unpack + -inf fill (the same numpy/torch code for all), advance. llguidance is a
dependency; xgrammar and outlines-core are not — put them on PYTHONPATH to compare, e.g.
`pip install --no-deps --target /tmp/gram xgrammar==0.2.9 apache-tvm-ffi outlines-core==0.2.14`.

    .venv/bin/python benchmarks/serving/grammar_overhead.py decode                 # demo resident and 1GiB
    .venv/bin/python benchmarks/serving/grammar_overhead.py decode --budget 0 --tokens 4 --repeats 1  # a smoke run
    PYTHONPATH=/tmp/gram .venv/bin/python benchmarks/serving/grammar_overhead.py engines --vocab 32000 151936
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
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
    """Each budget in a child process of its own (decode_child): a fresh process measures its own
    runtime memory (the plan charges the RSS it finds, which a resident engine loaded earlier in
    the same process would have left high) and reads no weights an earlier setting left in RAM."""
    from engine.api import resolve_model
    model_dir = str(resolve_model(a.model))  # demo: synthesized on first use (~/.cache/colibri/models/demo-seed0)
    rows, notes, child_cond = [], {}, {}
    for budget in a.budget:
        args = ["decode", "--child", "--model", model_dir, "--budget", budget, "--tokens", str(a.tokens),
                "--repeats", str(a.repeats), "--threads", str(a.threads), *(["--lock", a.lock] if a.lock else [])]
        # stderr passes through: each run's JSON line as it ends, or the child's error
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *args], stdout=subprocess.PIPE, text=True)
        if out.returncode != 0:
            return benchkit.refuse("grammar_overhead", f"the run with --budget {budget} failed (its error above)")
        got = json.loads(out.stdout)
        rows.append(got["row"])
        notes = notes or got["notes"]  # the compile figures do not depend on the budget: the first run's
        child_cond = got["conditions"]
    columns = [("setting", lambda r: r["setting"]), ("tokens × repeats", lambda r: f"{r['tokens']} × {r['repeats']}"),
               ("decode tok/s, free", lambda r: benchkit.fmt_spread(r["free_tok_s"], 2)),
               ("decode tok/s, JSON schema", lambda r: benchkit.fmt_spread(r["schema_tok_s"], 2)),
               ("schema vs free", lambda r: f"{r['change_pct']:+.1f}%"),
               ("step ms free / schema (median)", lambda r: f"{r['free_step_ms']:.0f} / {r['schema_step_ms']:.0f}"),
               ("mask µs (median)", lambda r: round(r["mask_us"], 1)), ("TTFT s (median)", lambda r: round(r["ttft_s"], 2))]
    flags = {k: v for k, v in vars(a).items() if k not in ("vocab", "part", "child", "json")}
    cond = benchkit.conditions(**flags, part="decode", **child_cond,
                               sampling="temperature 1, seed = repeat, free and schema alternating which runs first",
                               schema="64 bounded records (nested object, enum, anyOf, integer range)")
    benchkit.emit("grammar_overhead", rows, cond, a.json, columns, notes)
    return 0


def decode_child(a) -> dict:
    """One budget (a.budget[0]) on the model directory a.model: {"row", "notes", "conditions"}."""
    from engine.api import (Engine, EngineConfig, GrammarTokenizer, Sampler, generate, json_grammar, load_tokenizer,
                            parse_size)
    from benchmarks import benchkit
    budget = a.budget[0]
    nbytes = parse_size(budget)
    tokenizer = load_tokenizer(a.model)
    prompt = tokenizer.encode("Write the records as JSON:").ids
    config = EngineConfig(ram_budget=nbytes, ctx_size=max(256, a.tokens + 64),
                          **({"threads": a.threads} if a.threads else {}))
    setting = "resident" if nbytes == 0 else f"streamed, budget {budget}"
    notes = {}
    engine = Engine(a.model, config)
    try:
        eos = engine.checkpoint.config.get("eos_token_id")
        t = time.perf_counter()
        gtok = GrammarTokenizer(tokenizer, engine.args.vocab_size, set(eos if isinstance(eos, list) else [eos]))
        notes["grammar tokenizer build s (once per model)"] = round(time.perf_counter() - t, 3)
        compiles = []
        for _ in range(20):
            t = time.perf_counter()
            gtok.processor(json_grammar(SCHEMA))
            compiles.append(time.perf_counter() - t)
        notes["schema compile ms (per request; median (min-max) of 20)"] = benchkit.fmt_spread(
            benchkit.spread(c * 1e3 for c in compiles), 2)
        tools = _tool_compiles(tokenizer, gtok, eos)
        notes["tool-call grammar compile ms (per request; median of 10)"] = ", ".join(
            f"{f} {statistics.median(t) * 1e3:.2f}" for f, t in tools.items())
        generate(engine, prompt, 4, Sampler())  # warm: the first pass pays one-off allocations
        runs = {"free": [], "schema": []}
        for r in range(a.repeats):
            for mode in (("free", "schema") if r % 2 == 0 else ("schema", "free")):
                timed = Timed(gtok.processor(json_grammar(SCHEMA))) if mode == "schema" else None
                with benchkit.bench_lock(a.lock):
                    gen = generate(engine, prompt, a.tokens, Sampler(temperature=1.0, seed=r),
                                   processors=[timed] if timed else ())
                steps = gen.token_seconds
                run = {"setting": setting, "repeat": r + 1, "mode": mode, "tokens": len(gen.output_ids),
                       "tok_s": len(steps) / sum(steps), "step_ms_median": statistics.median(steps) * 1e3,
                       "mask_us_median": statistics.median(timed.seconds) * 1e6 if timed else None,
                       "ttft_s": gen.ttft_seconds}
                runs[mode].append(run)
                print(json.dumps(run), file=sys.stderr, flush=True)
        io_mode, vocab = config.io_mode, engine.args.vocab_size
    finally:
        engine.close()
    free, schema = (benchkit.spread(r["tok_s"] for r in runs[m]) for m in ("free", "schema"))
    row = {"setting": setting, "budget": budget, "tokens": a.tokens, "repeats": a.repeats,
           "free_tok_s": free, "schema_tok_s": schema, "change_pct": (schema["median"] / free["median"] - 1) * 100,
           "free_step_ms": statistics.median(r["step_ms_median"] for r in runs["free"]),
           "schema_step_ms": statistics.median(r["step_ms_median"] for r in runs["schema"]),
           "mask_us": statistics.median(r["mask_us_median"] for r in runs["schema"]),
           "ttft_s": statistics.median(r["ttft_s"] for r in runs["free"] + runs["schema"]),
           "runs": runs["free"] + runs["schema"]}
    # torch as this process ran it (the parent does not load it)
    return {"row": row, "notes": notes, "conditions": {"model_vocab": vocab, "prompt_tokens": len(prompt),
                                                       "io_mode": io_mode,
                                                       "torch": benchkit.conditions()["torch"]}}


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
    cond = benchkit.conditions(part="engines", vocab=a.vocab, repeats=a.repeats, lock=a.lock, torch_threads=1)
    benchkit.emit("grammar_overhead", rows, cond, a.json, columns)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("decode", "engines"))
    p.add_argument("--model", default="demo", help="decode: model directory or synth preset (default demo)")
    p.add_argument("--budget", nargs="+", default=["0", "1GiB"],
                   help="decode: memory budgets, one table row each (default 0 1GiB: resident, then streamed)")
    p.add_argument("--tokens", type=int, default=32, help="decode: tokens per generation (default 32)")
    p.add_argument("--threads", type=int, default=0, help="decode: compute threads (default: the engine's)")
    p.add_argument("--repeats", type=int, default=3, help="repeats (decode: per mode and budget; engines: "
                                                          "document walks; default 3)")
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="engines: synth BPE vocabularies")
    p.add_argument("--lock", help="hold this flock around each measured step (not with `quiet bench`)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # decode: one budget, in its own process
    a = p.parse_args()
    if a.child:
        json.dump(decode_child(a), sys.stdout)
        return 0
    from benchmarks import benchkit
    if a.tokens < 2 or a.repeats < 1:
        return benchkit.refuse("grammar_overhead", "--tokens must be >= 2 and --repeats >= 1")
    from engine.api import ConfigError, parse_size
    for budget in a.budget:
        try:
            parse_size(budget)
        except ConfigError as exc:
            return benchkit.refuse("grammar_overhead", f"--budget {budget}: {exc}")
    return decode(a, benchkit) if a.part == "decode" else engines(a, benchkit)


if __name__ == "__main__":
    sys.exit(main())
