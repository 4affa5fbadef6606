"""The byte-level BPE tokenizer synth writes: deterministic, lossless, real merges, loadable by others."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from engine.synth import bpe_tokenizer
from engine import synth

REPO = Path(__file__).resolve().parents[1]
TINY_VOCAB = synth.load_preset("tiny")["vocab_size"]
SAMPLES = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return sorted(argv, key=len)  # tabs\tand  double  spaces\n\n",
    "naïve café — 東京 🦙🦙 3.14159 ''' \"quoted\" ''' ?!",
    "\n \n\n \t\t x",
    "trailing space ",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return synth.synthesize(synth.load_preset("tiny"), tmp_path_factory.mktemp("bpe") / "tiny",
                            seed=0, progress=False)


def _in_fresh_process(code: str) -> str:
    # A fresh interpreter, with its own hash seed. The module needs only the standard library and
    # tokenizers, so it is imported as the top-level module it also runs as (its training child):
    # the engine.synth package would import torch first, seconds of each child's time.
    prelude = f"import sys; sys.path.insert(0, {str(REPO / 'engine' / 'synth')!r}); import bpe_tokenizer; "
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(REPO)}).stdout


@pytest.fixture(scope="module")
def demo_sized() -> dict:
    """The demo-sized tokenizer (32000 ids), built in a child: it adds ~30 MB to a process, which
    later tests' memory plans would measure as runtime overhead. The child also round-trips SAMPLES."""
    code = ("import json; t = bpe_tokenizer.build_tokenizer(32000); "
            f"s = json.loads({json.dumps(json.dumps(SAMPLES))}); "
            "print(json.dumps({'json': t.to_str(), "
            "'round_trips': [[t.decode(t.encode(x).ids), len(t.encode(x).ids)] for x in s]}))")
    return json.loads(_in_fresh_process(code))


def test_training_gives_the_same_bytes_in_two_processes():
    # The trainer's hash maps are seeded per process, so this is what could differ: a build in a
    # fresh interpreter against one here (each trains in its own child, tokenizer.json byte for byte).
    first = _in_fresh_process(f"print(bpe_tokenizer.build_tokenizer({TINY_VOCAB}).to_str())").rstrip("\n")
    assert first and first == bpe_tokenizer.build_tokenizer(TINY_VOCAB).to_str()
    assert json.loads(first)["model"]["merges"]


def test_synth_writes_the_trained_tokenizer(tiny_dir):
    written = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert written.to_str() == bpe_tokenizer.build_tokenizer(TINY_VOCAB).to_str()
    info = json.loads((tiny_dir / "tokenizer_config.json").read_text())["colibri_tokenizer"]["corpus"]
    assert info == bpe_tokenizer.corpus_info() and info["files"] > 50


@pytest.mark.parametrize("vocab_size", [TINY_VOCAB, 32000])
def test_vocab_has_bytes_eos_and_merges(vocab_size, request):
    built = request.getfixturevalue("demo_sized")["json"] if vocab_size == 32000 else \
        bpe_tokenizer.build_tokenizer(vocab_size).to_str()
    model = json.loads(built)["model"]
    vocab, merges = model["vocab"], model["merges"]
    assert sorted(vocab.values()) == list(range(vocab_size))
    b2u = bpe_tokenizer.bytes_to_unicode()
    assert all(vocab[b2u[b]] == b for b in range(256))
    assert vocab[bpe_tokenizer.EOS_TOKEN] == bpe_tokenizer.EOS_TOKEN_ID == 256
    # The stdlib corpus is big enough that every id past the bytes and EOS is a learned merge.
    assert len(merges) >= vocab_size - bpe_tokenizer.MIN_VOCAB
    for left, right in (m if isinstance(m, list) else m.split(" ", 1) for m in merges):
        assert left in vocab and right in vocab and left + right in vocab


def test_merges_shorten_text_and_text_round_trips(demo_sized):
    out = demo_sized["round_trips"]
    assert [text for text, _ in out] == SAMPLES
    english = SAMPLES[0]
    assert out[0][1] < len(english.encode()) / 2


def test_eos_is_one_special_token():
    tok = bpe_tokenizer.build_tokenizer(TINY_VOCAB)
    ids = tok.encode("a<|endoftext|>b").ids
    assert bpe_tokenizer.EOS_TOKEN_ID in ids and len(ids) == 3
    assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_corpus_shortfall_is_filled_with_distinct_fillers(monkeypatch):
    monkeypatch.setattr(bpe_tokenizer, "_trained_merges", lambda vocab_size: (("Ġ", "t"), ("Ġt", "h")))
    tok = bpe_tokenizer.build_tokenizer(300)
    vocab = tok.get_vocab()
    assert len(vocab) == 300 and vocab["Ġt"] == 257 and vocab["Ġth"] == 258
    assert "Ġab" in vocab and tok.decode([vocab["Ġab"]]) == " ab"


def test_transformers_loads_it_and_agrees(tiny_dir):
    # In a child: importing transformers here would add ~100 MB to this process, which later
    # tests' memory plans measure as runtime overhead.
    code = ("import json, sys; from transformers import AutoTokenizer; t = AutoTokenizer.from_pretrained(sys.argv[1]); "
            "s = json.loads(sys.argv[2]); print(json.dumps({'ids': [t.encode(x) for x in s], "
            "'text': [t.decode(t.encode(x)) for x in s], 'eos': t.eos_token_id, 'bos': t.bos_token_id}))")
    out = json.loads(subprocess.run([sys.executable, "-c", code, str(tiny_dir), json.dumps(SAMPLES)],
                                    capture_output=True, text=True, check=True).stdout)
    ours = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    assert out["ids"] == [ours.encode(text).ids for text in SAMPLES]
    assert out["text"] == SAMPLES
    assert out["eos"] == bpe_tokenizer.EOS_TOKEN_ID and out["bos"] is None


def test_engine_text_prompt_uses_the_merges(tiny_dir):
    # `colibri run` in a child, as a user runs it (and so this process's RSS stays as it was).
    text = "the quick brown fox"
    run = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(tiny_dir), "--prompt", text,
                          "--max-new-tokens", "3", "--ctx-size", "64", "--threads", "1", "--json"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert run.returncode == 0, run.stderr[-500:]
    result = json.loads(run.stdout)
    expected = Tokenizer.from_file(str(tiny_dir / "tokenizer.json")).encode(text).ids
    assert result["prompt_ids"] == expected and len(expected) < len(text)
    assert len(result["output_ids"]) == 3 and isinstance(result["text"], str)


def test_too_small_vocab_is_refused():
    with pytest.raises(ValueError, match="at least 257"):
        bpe_tokenizer.build_tokenizer(256)
