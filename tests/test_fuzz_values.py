"""Fuzzing the readers of issue 37, item 6: FP8 checkpoints, prompts files, HTTP bodies and framing.

FP8 checkpoints and prompts files go through the CLI in the fork server of tests/colibri_fuzz.py
(an address-space limit and an alarm per call): exit 0, or exit 2 with one `colibri <cmd>: error:`
line naming the input; no traceback, no hang. HTTP goes to one real `colibri serve` process
(tests/colibri_http.py): every reply is a 200 or a 4xx whose body is an OpenAI error object
(or no reply, where the client itself stopped mid-body), and the server's log never holds a
traceback. Outcomes are counted in $COLIBRI_FUZZ_REPORT (tests/colibri_fuzz.py) per input kind.

CI runs a bounded, derandomized set (seconds); `make fuzz` (COLIBRI_FUZZ_EXAMPLES) runs more.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from colibri_fuzz import Call, assert_batch, record
from colibri_http import ServeProcess, exchange
from colibri_tiny import make_tiny
from engine.weights import fp8
from engine.format.fp8_checkpoint import SCALE_SUFFIX
from engine.synth.fp8_writer import write_fp8_checkpoint
from test_fuzz import VALUES
from test_fuzz_commands import Outs, batches

CAMPAIGN = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "0"))
RUN = ("--prompt-tokens", "3", "--max-new-tokens", "2", "--ctx-size", "16")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-values")
    tiny = make_tiny(root / "tiny")
    write_fp8_checkpoint(tiny, root / "fp8", block=(16, 16))
    return {"root": root, "tiny": tiny, "fp8": root / "fp8"}


# --- FP8 checkpoints -------------------------------------------------------------------------------

SCALES = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-45, 1e-4, 3e38, 1e10, fp8.MAX_SCALE,
                          fp8.MAX_SCALE * 1.01])
CODES = st.one_of(st.sampled_from([0x7F, 0xFF, 0x7E, 0xFE, 0x00, 0x80]), st.integers(0, 255))
WHERE = st.one_of(st.just("all"), st.floats(0, 1, exclude_max=True))
QC_FIELDS = st.sampled_from(["quant_method", "fmt", "weight_block_size", "activation_scheme"])
FP8_MUTATION = st.one_of(
    # finite codes (0x00-0x7e) at one place: a model that still runs, so exit 0 stays in the mix
    st.tuples(st.just("codes"), st.integers(0, 10**6), st.tuples(st.floats(0, 1, exclude_max=True),
                                                                  st.integers(0, 0x7E))),
    st.tuples(st.just("codes"), st.integers(0, 10**6), st.tuples(WHERE, CODES)),
    st.tuples(st.just("scale"), st.integers(0, 10**6), st.tuples(WHERE, SCALES)),
    st.tuples(st.just("qconfig"), st.just(0), VALUES),
    st.tuples(st.just("qfield"), st.just(0), st.tuples(QC_FIELDS, st.one_of(
        VALUES, st.sampled_from([[16, 16], [16], [0, 16], [16, 16, 16], "16", [10**9, 1], "e5m2", "static"])))),
)


def _at(t: torch.Tensor, where) -> slice | int:
    return slice(None) if where == "all" else int(where * t.numel())


def mutate_fp8(src: Path, dst: Path, mutations) -> None:
    import shutil
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    weights = sorted(n for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn)
    config = json.loads((dst / "config.json").read_text())
    for op, pick, arg in mutations:
        if op in ("codes", "scale"):
            name = weights[pick % len(weights)] + ("" if op == "codes" else SCALE_SUFFIX)
            t = tensors[name]
            flat = (t.view(torch.uint8) if op == "codes" else t).reshape(-1).clone()
            flat[_at(flat, arg[0])] = arg[1]
            tensors[name] = (flat.view(torch.float8_e4m3fn) if op == "codes" else flat).reshape(t.shape)
        elif op == "qconfig":
            config["quantization_config"] = arg
        elif isinstance(config.get("quantization_config"), dict):
            config["quantization_config"][arg[0]] = arg[1]
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))  # NaN literals included: json.loads takes them


@batches(2, campaign_share=0.02)
@given(cases=st.lists(st.lists(FP8_MUTATION, min_size=1, max_size=3), min_size=3, max_size=3))
def test_fuzz_fp8_checkpoints_through_run_convert_quality(models, tmp_path_factory, cases):
    root = tmp_path_factory.mktemp("fp8-cases")
    outs = Outs(root / "outs")
    calls = []
    for i, mutations in enumerate(cases):
        m = root / f"m{i}"
        mutate_fp8(models["fp8"], m, mutations)
        names = (str(m), m.name)
        for argv in (["run", "--model", str(m), *RUN, "--json"],
                     ["convert", str(m), "-o", outs.path(), "--quant", "int8", "--json"],
                     ["quality", "--model", str(m), "--reference", str(models["fp8"]), "--tokens", "32",
                      "--ctx", "16", "--json"]):
            calls.append(Call(argv, names=names, cwd=outs.cwd(), note=f"fp8 {mutations!r}"[:300], kind="fp8 checkpoint"))
    assert_batch(calls, call_s=60)


# --- prompts files ---------------------------------------------------------------------------------

ANY_TEXT = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=()), max_size=12)
PROMPT_LINE = st.one_of(
    st.text("abcdefghij (){}:=.\u2028\u00e9", min_size=1, max_size=20),  # plain prompts that run
    st.builds(lambda p, n: json.dumps({"prompt": p, "max_new_tokens": n}, ensure_ascii=False),
              ANY_TEXT, st.one_of(st.integers(1, 3), st.sampled_from([0, -1, 10**6, 2**63, True, None, 1.5]))),
    st.builds(lambda p: json.dumps({"prompt": p}), ANY_TEXT),  # \u-escaped, lone surrogates included
    st.builds(lambda sep, p: '{"prompt": "a' + sep + p + '"}', st.sampled_from(["\u2028", "\u2029", "\x85", "\t",
                                                                                   "\x0c", "\x00"]), ANY_TEXT),
    st.builds(lambda v: json.dumps(v), VALUES),
    st.builds(lambda n, key: '{"' + key + '": ' + "[" * n + "]" * n + "}", st.integers(1, 200_000),
              st.sampled_from(["prompt", "max_new_tokens", "x"])),
    st.builds(lambda n: '{"prompt": "a"' + ', "prompt": "b"' * n + "}", st.integers(1, 3)),
    ANY_TEXT,
)
PROMPTS_FILE = st.tuples(st.lists(PROMPT_LINE, min_size=1, max_size=4), st.sampled_from(["\n", "\r\n", "\u2028"]),
                         st.booleans())


def write_prompts(path: Path, case) -> None:
    lines, newline, json_first = case
    if json_first:
        lines = ['{"prompt": "x", "max_new_tokens": 1}', *lines]
    path.write_bytes(newline.join(lines).encode("utf-8", "surrogatepass"))


@batches(3, campaign_share=0.02)
@given(cases=st.lists(PROMPTS_FILE, min_size=6, max_size=6))
def test_fuzz_prompts_files_through_bench(models, tmp_path_factory, cases):
    root = tmp_path_factory.mktemp("prompts-cases")
    outs = Outs(root / "outs")
    calls = []
    for i, case in enumerate(cases):
        p = root / f"prompts-{i}.jsonl"
        write_prompts(p, case)
        calls.append(Call(["bench", "--model", str(models["tiny"]), "--tokens", "1", "--repeats", "1",
                           "--ctx-size", "64", "--prompts", str(p), "--json"],
                          names=(str(p), p.name), cwd=outs.cwd(), note=f"prompts {case!r}"[:300], kind="prompts file"))
    assert_batch(calls, call_s=60)


# --- HTTP bodies and framing ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(models):
    s = ServeProcess(models["tiny"], models["root"] / "serve.log")
    yield s
    s.close()


def http_settings(ci_examples: int):
    return settings(max_examples=max(ci_examples, CAMPAIGN // 4) if CAMPAIGN else ci_examples, deadline=None,
                    derandomize=not CAMPAIGN, database=None, suppress_health_check=list(HealthCheck))


SMALL = st.one_of(st.integers(1, 3), VALUES)
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
                           "content": st.one_of(ANY_TEXT, st.none(), VALUES,
                                                st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                                "text": ANY_TEXT}), max_size=2))}),
    VALUES)
BODY = st.one_of(
    st.tuples(st.just("/v1/completions"), st.fixed_dictionaries(
        {"prompt": st.one_of(ANY_TEXT, st.lists(ANY_TEXT, max_size=2), st.lists(st.integers(-5, 400), max_size=4),
                             VALUES)},
        optional={"max_tokens": SMALL, "temperature": VALUES, "top_p": VALUES, "stop": VALUES,
                  "stream": st.booleans(), "seed": VALUES, "model": st.sampled_from(["tiny", "x"])})),
    st.tuples(st.just("/v1/chat/completions"), st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(MESSAGE, max_size=3), VALUES)},
        optional={"max_tokens": SMALL, "stream": st.booleans()})),
)
RAW_BODY = st.one_of(
    st.binary(max_size=64),
    st.integers(1, 100_000).map(lambda n: b'{"prompt": ' + b"[" * n + b"]" * n + b"}"),
    st.tuples(BODY, st.floats(0, 1)).map(lambda t: json.dumps(t[0][1]).encode()[:int(len(json.dumps(t[0][1])) * t[1])]),
)


def check_reply(reply, kind: str, server, half_closed: bool = False) -> None:
    log = server.log_text()
    if "Traceback" in log or "Exception in ASGI application" in log:
        outcome = "traceback"
    elif reply.status is None and half_closed:
        outcome = "http 4xx"  # the client left mid-body: nobody to answer, and nothing logged
    elif reply.status == 200:
        outcome = "http 200"
    elif reply.status is not None and 400 <= reply.status < 500 and _is_error_object(reply):
        outcome = "http 4xx"
    else:
        outcome = "bad reply"
    record(kind, "serve", outcome)
    assert outcome.startswith("http "), (outcome, reply.raw[:600], log[-2000:])


def _is_error_object(reply) -> bool:
    try:
        err = reply.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return reply.headers.get("content-type", "").startswith("application/json") and bool(err.get("message"))


def _request(path: str, body: bytes, headers: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@http_settings(40)
@given(body=st.one_of(BODY.map(lambda b: (b[0], json.dumps(b[1]).encode())),
                      st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), RAW_BODY)))
def test_fuzz_http_bodies(server, body):
    path, data = body
    if b'"stream": true' in data:  # a streamed reply is SSE: its status line is what is checked
        data = data.replace(b'"stream": true', b'"stream": false')
    check_reply(exchange(server.port, _request(path, data), timeout=60), "http body", server)


CHUNK_SIZE = st.one_of(st.text("0123456789abcdefABCDEF", min_size=1, max_size=22),
                       st.text("0123456789xzg-+", min_size=0, max_size=6))
FRAMING = st.one_of(
    st.tuples(st.just("chunked"), st.lists(st.tuples(CHUNK_SIZE, st.binary(max_size=16)), min_size=1, max_size=3)),
    st.tuples(st.just("length"), st.tuples(st.integers(-3, 3), st.sampled_from(["", "+5", "5, 7", "0x10", " 99",
                                                                                 "99999999999999999999"]))),
    st.tuples(st.just("raw"), st.binary(max_size=80)),
    st.tuples(st.just("header"), st.binary(max_size=40)),
)
HEX = re.compile(rb"[0-9A-Fa-f]{1,20}")  # h11's chunk size (no extensions are generated)


def framed(case) -> tuple[bytes, bool]:
    """(request bytes, whether the request is cut short: the client then closes its sending side,
    and no reply is owed). A complete request is never half-closed: uvicorn closes a connection
    at the client's EOF, and a reply still being computed would be lost."""
    op, arg = case
    body = b'{"prompt": "a", "max_tokens": 1}'
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nConnection: close\r\n"
    if op == "chunked":
        chunks = [size.encode() + b"\r\n" + data + b"\r\n" for size, data in arg]
        tail = b"".join(chunks) + b"0\r\n\r\n"
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + tail, _chunks_cut_short(tail)
    if op == "length":
        delta, declared = arg
        length = declared or str(len(body) + delta)
        cut = length.strip().isdigit() and int(length) > len(body)
        return head + f"Content-Length: {length}\r\n\r\n".encode() + body, cut
    if op == "raw":  # "X" first: a method token, so the request line is never an empty one h11 skips
        return b"X" + arg + b"\r\n\r\n", False
    return head + b"X-Fuzz: " + arg + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body, False


def _chunks_cut_short(tail: bytes) -> bool:
    """Whether h11 would still be waiting for bytes at the end of this chunked body (so no reply
    is owed once the client stops). Parsed from the bytes as h11 reads them (a chunk's data may
    swallow the CRLFs meant to end it); where unsure, True: that only excuses a missing reply,
    a reply that comes must still be a JSON error object."""
    at = 0
    while True:
        end = tail.find(b"\r\n", at)
        if end < 0:
            return True  # the size line is not complete
        size = tail[at:end]
        if not HEX.fullmatch(size):
            return False  # a framing error: answered at once
        n, at = int(size, 16), end + 2
        if n == 0:
            return not tail[at:].startswith(b"\r\n")  # trailers of ours end at once; others: unsure
        if at + n + 2 > len(tail):
            return True
        if tail[at + n:at + n + 2] != b"\r\n":
            return False  # the chunk's end is not where its size says: a framing error
        at += n + 2


@http_settings(40)
@given(case=FRAMING)
def test_fuzz_http_framing(server, case):
    request, cut = framed(case)
    check_reply(exchange(server.port, request, timeout=20, half_close=cut), "http framing", server, half_closed=cut)
