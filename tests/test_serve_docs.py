"""docs/SERVE.md's examples run: every python block, in order, against a real `colibri serve` on a
tiny model with Qwen3's chat template (its markers as added tokens), through the official `openai`
and `anthropic` clients. An example that a server change breaks fails here, not for a reader.

README's serve section lists the request fields and the refusals: each field in its table is one
the server reads (a value of the wrong type is a 400 naming it, where an unknown field would be
ignored), each field the parsers read by name is in the table, and each field the server refuses
outright is in the refused list and refused."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import httpx
import pytest

from colibri_tiny import make_tiny
from colibri_tool_models import family_model
from test_serve import Server

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "SERVE.md"
README = ROOT / "README.md"
PARSERS = [ROOT / "colibri" / "serve" / f for f in ("protocol.py", "structured.py", "tools/request.py")]
BASE = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        "completions": ("/v1/completions", {"prompt": "x", "max_tokens": 2})}
NESTED = {"include_usage": "stream_options"}  # a field of an object field
# Each field the server refuses outright (protocol.py's _refuse_unsupported), with a value it refuses.
REFUSED = {"echo": True, "best_of": 2, "suffix": "x", "tools": [{"type": "function", "function": {"name": "f"}}],
           "functions": [{"name": "f"}], "function_call": {"name": "f"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-docs")
    s = Server(family_model(make_tiny(root / "tiny"), root / "qwen3", "qwen3", marker_tokens=True), model_name="m")
    yield s
    s.close()


def test_every_example_runs(server):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 10
    env: dict = {}
    for block in blocks:
        code = (block.replace("http://127.0.0.1:8000", server.base)
                .replace('model="demo"', 'model="m"'))
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, f"{DOC.name} example", "exec"), env)  # the doc's own code, as a reader runs it


def readme_fields() -> dict[str, set[str]]:
    """The README table's fields → the routes it names them on."""
    text = README.read_text()
    table = text[text.index("Request fields of"):text.index("Refused with a 400 naming the field")]
    out: dict[str, set[str]] = {}
    for row in (line for line in table.splitlines() if line.startswith("| `")):
        names, route = row.strip("|").split("|")[:2]
        routes = {"chat", "completions"} if route.strip() == "both" else {route.strip()}
        assert routes <= set(BASE), row
        for name in re.findall(r"`(\w+)`", names):
            out[name] = routes
    return out


def test_readme_fields_are_the_ones_the_server_reads(server):
    fields = readme_fields()
    assert {"temperature", "tools", "response_format", "logprobs", "n", "stop"} <= set(fields)
    for name, routes in fields.items():
        for route in routes:
            path, body = BASE[route]
            wrong = [[]]  # a list of a list: no field takes it
            body = {**body, **({NESTED[name]: {name: wrong}} if name in NESTED else {name: wrong})}
            r = httpx.post(server.base + path, json=body, timeout=60)
            assert r.status_code == 400, (name, route, r.text)
            assert r.json()["error"]["param"].startswith(NESTED.get(name, name)), (name, route, r.json())
    read = set()
    for source in PARSERS:
        code = source.read_text()
        read |= set(re.findall(r'body\.get\("(\w+)"', code)) | set(re.findall(r'_(?:int|float|bool)\(body, "(\w+)"', code))
        read |= set(re.findall(r'_key: str = "(\w+)"', code))
    assert read - set(REFUSED) - set(fields) == set(), "read by the server, missing from README's table"


def test_readme_refusals_are_the_servers(server):
    text = README.read_text()
    refused = text[text.index("Refused with a 400 naming the field"):]
    refused = refused[:refused.index("\n\n")]
    code = (ROOT / "colibri" / "serve" / "protocol.py").read_text()
    listed = code[code.index("def _refuse_unsupported"):code.index("def _logit_bias")]
    assert set(re.findall(r'\("(\w+)", \(', listed)) == set(REFUSED)
    for name, value in REFUSED.items():
        assert f"`{name}`" in refused, name
        for route in ("completions",) if name == "tools" else ("chat", "completions"):
            path, body = BASE[route]
            r = httpx.post(server.base + path, json={**body, name: value}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, route, r.text)
