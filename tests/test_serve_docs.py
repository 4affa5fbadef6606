"""docs/SERVE.md's examples run: every python block, in order, against a real `colibri serve` on a
tiny model with Qwen3's chat template (its markers as added tokens), through the official `openai`
and `anthropic` clients. An example that a server change breaks fails here, not for a reader."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from colibri_tiny import make_tiny
from colibri_tool_models import family_model
from test_serve import Server

DOC = Path(__file__).resolve().parents[1] / "docs" / "SERVE.md"


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
