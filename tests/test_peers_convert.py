"""llama.cpp's converter on a synth model: refused as shipped, accepted through benchmarks/peers/peers_convert.py.

Needs the llama.cpp tree that scripts/build_llama_cpp.sh unpacks, found where the other llama.cpp
tests find it (tests/gguf_llama.py: $LLAMA_CPP_DIR, then ~/.cache/colibri/llama.cpp); skipped,
tagged [requires llama_cpp], without it. Slow (the converter imports torch and transformers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from colibri_requirements import needs
from engine import synth
from gguf_llama import llama_dir

REPO = Path(__file__).resolve().parents[1]
LLAMA = llama_dir()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(LLAMA is None, reason=needs(
                  "llama_cpp", "no llama.cpp source tree with convert_hf_to_gguf.py ($LLAMA_CPP_DIR; "
                               "scripts/build_llama_cpp.sh unpacks it)"))]
TEXTS = ["the quick brown fox", "def main(argv):\n    return 0\n", "naïve café 🦙 3.14"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth.synthesize(synth.load_preset("tiny"), tmp_path_factory.mktemp("conv") / "tiny", seed=0,
                            progress=False)


def _convert(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_shipped_converter_refuses_the_unknown_hash(tiny, tmp_path):
    run = _convert([str(LLAMA / "src" / "convert_hf_to_gguf.py"), str(tiny), "--outfile", str(tmp_path / "x.gguf")])
    assert run.returncode != 0 and "pre-tokenizer was not recognized" in run.stderr


def test_wrapper_maps_it_to_gpt2_and_keeps_the_vocab(tiny, tmp_path):
    out = tmp_path / "tiny.gguf"
    run = _convert([str(REPO / "benchmarks" / "peers" / "peers_convert.py"), "--llama-src", str(LLAMA / "src"), str(tiny),
                    "--outfile", str(out), "--outtype", "f32"])
    assert run.returncode == 0, run.stderr[-2000:]
    sys.path.insert(0, str(LLAMA / "src" / "gguf-py"))
    from gguf import GGUFReader
    fields = GGUFReader(out).fields

    def value(name):
        f = fields[name]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tobytes().decode()

    assert value("tokenizer.ggml.pre") == "gpt-2"
    model = json.loads((tiny / "tokenizer.json").read_text())["model"]
    tokens = value("tokenizer.ggml.tokens")
    assert [tokens[i] for i in range(len(tokens))] == sorted(model["vocab"], key=model["vocab"].get)
    assert len(value("tokenizer.ggml.merges")) == len(model["merges"]) > 0

    tokenize = LLAMA / "build" / "bin" / "llama-tokenize"
    if tokenize.exists():  # llama.cpp's own BPE gives our ids for the same text
        ours = Tokenizer.from_file(str(tiny / "tokenizer.json"))
        for text in TEXTS:
            got = subprocess.run([str(tokenize), "-m", str(out), "-p", text, "--ids", "--log-disable", "--no-bos"],
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            assert json.loads(got) == ours.encode(text).ids


def test_wrapper_keeps_the_refusal_for_other_tokenizers(tiny, tmp_path):
    cfg_path = tiny.parent / "foreign"
    cfg_path.mkdir()
    for f in tiny.iterdir():
        (cfg_path / f.name).symlink_to(f)
    (cfg_path / "tokenizer_config.json").unlink()
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    del cfg["colibri_tokenizer"]
    (cfg_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    run = _convert([str(REPO / "benchmarks" / "peers" / "peers_convert.py"), "--llama-src", str(LLAMA / "src"), str(cfg_path),
                    "--outfile", str(tmp_path / "y.gguf")])
    assert run.returncode != 0 and "pre-tokenizer was not recognized" in run.stderr
