"""The byte-level BPE tokenizer that `synth` writes: real merges, trained deterministically.

Other engines (llama.cpp's converter above all) load a tokenizer only if it is a proper BPE with
merges, so synthesized models get one trained with the `tokenizers` library on text every
machine with Python has: the top-level `*.py` files of the running interpreter's standard
library (`sysconfig.get_paths()["stdlib"]`, sorted by name). The trainer is deterministic for a
given corpus (checked across processes), so the same Python version gives the same
tokenizer.json byte for byte; another Python version has other sources and so other merges —
`corpus_info()` (recorded in tokenizer_config.json) says which corpus was used.

Ids: 0-255 are the 256 bytes in byte order, 256 is <|endoftext|> (the configs' eos_token_id),
257... the merged tokens in the order their merges were learned. If the corpus yields fewer
merges than the vocabulary needs (never for the presets), the remaining ids are filler
pseudo-words (" ab", " ac", ...) that encoding never produces but that decode to readable text.
The pre-tokenizer is GPT-2's regex (ByteLevel, use_regex=True), which llama.cpp implements as
its "gpt-2" pre-tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import subprocess
import sys
import sysconfig
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256
MIN_VOCAB = 257  # 256 byte tokens + EOS
CORPUS_SOURCE = "python-stdlib-toplevel-py"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def corpus_files() -> list[Path]:
    """The training corpus: every top-level .py file of this interpreter's standard library, by name."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"), key=lambda p: p.name)
    if not files:
        raise RuntimeError(f"no standard-library sources under {stdlib} to train the tokenizer on")
    return files


def _corpus_texts() -> list[str]:
    return [p.read_bytes().decode("utf-8", errors="replace") for p in corpus_files()]


@functools.lru_cache(maxsize=1)
def corpus_info() -> dict:
    """What the tokenizer was trained on, for tokenizer_config.json and the docs."""
    digest, files, chars = hashlib.sha256(), 0, 0
    for path in corpus_files():
        data = path.read_bytes()
        digest.update(path.name.encode() + b"\0" + data)
        files += 1
        chars += len(data.decode("utf-8", errors="replace"))
    return {"source": CORPUS_SOURCE, "python": platform.python_version(), "files": files, "chars": chars,
            "sha256": digest.hexdigest()}


def _filler_tokens(count: int, taken: set[str]) -> list[str]:
    """Pseudo-words (' ab', ' ac', ...) for ids the corpus has no merges for, skipping taken strings."""
    space = bytes_to_unicode()[ord(" ")]
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    length = 2
    while len(out) < count:
        for idx in range(len(letters) ** length):
            word = ""
            for _ in range(length):
                idx, r = divmod(idx, len(letters))
                word = letters[r] + word
            if space + word not in taken:
                out.append(space + word)
                if len(out) == count:
                    break
        length += 1
    return out


def train_merges(vocab_size: int) -> list[list[str]]:
    """Merges learned on the corpus, in order, for a vocabulary of vocab_size - 1 symbols (EOS comes later)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(), trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    return [list(m) if isinstance(m, list) else m.split(" ", 1) for m in merges]


@functools.lru_cache(maxsize=4)
def _trained_merges(vocab_size: int) -> tuple[tuple[str, str], ...]:
    # Trained in a child interpreter: the trainer leaves tens of MB in the allocator, and the
    # caller's RSS is what the engine's memory plan measures as runtime overhead.
    out = subprocess.run([sys.executable, "-I", __file__, str(vocab_size)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tokenizer training failed: {out.stderr.strip()[-300:]}")
    return tuple((left, right) for left, right in json.loads(out.stdout))


def build_tokenizer(vocab_size: int):
    """A tokenizers.Tokenizer with exactly vocab_size ids (see the module docstring for the layout)."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB}, got {vocab_size}")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab[EOS_TOKEN] = EOS_TOKEN_ID
    merges: list[tuple[str, str]] = []
    for left, right in _trained_merges(vocab_size):
        merged = left + right
        if merged not in vocab:
            if len(vocab) == vocab_size:
                break
            vocab[merged] = len(vocab)
        merges.append((left, right))
    for filler in _filler_tokens(vocab_size - len(vocab), set(vocab)):
        vocab[filler] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for the tokenizer above (no BOS: prompts are encoded as they are)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "colibri_tokenizer": {"kind": "byte-level-bpe", "corpus": corpus_info()},
    }


if __name__ == "__main__":  # the child of _trained_merges: prints the merges as JSON
    print(json.dumps(train_merges(int(sys.argv[1]))))
