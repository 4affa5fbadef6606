"""serve's TextStream: incremental detokenization gives, token by token, exactly what decoding the
whole output every time gives, for the decoder families real tokenizer.json files use (byte-level
BPE, SentencePiece-style byte fallback with a stripped first space, Metaspace, WordPiece), with
characters split across tokens, skipped special tokens and stop strings across token boundaries;
and it decodes O(1) ids per token, not the whole output."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models

from colibri.serve.worker import TextStream
from engine.synth.bpe_tokenizer import bytes_to_unicode

WORDS = ["the", "expert", "cache", "reads", "é", "ß", "€", "日本", "🙂", "END", "\n", "a", "b", "."]


class WholeDecode:
    """The rule, by brute force: decode all the ids at every token; while the text ends inside a
    character, wait; the text ends before the earliest stop; hold back what could begin one."""

    def __init__(self, tokenizer, stops):
        self.tokenizer, self.stops, self.ids, self.sent, self.stopped = tokenizer, stops, [], 0, False
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, token, final=False):
        if token is not None:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") and not final:
            return ""
        found = [at for at in (text.find(s) for s in self.stops) if at != -1]
        end = min(found) if found else max(self.sent, len(text) - (0 if final else self.hold))
        self.stopped = bool(found)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


def byte_level():
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    for w in WORDS + [" " + w for w in WORDS]:  # whole multi-byte characters and words as tokens too
        vocab.setdefault(_chars(w.encode()), len(vocab))
    vocab.setdefault(_chars(b"X\xe2"), len(vocab))  # a token ending inside a character
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    return _with_special(tok)


def _chars(raw: bytes) -> str:
    b2u = bytes_to_unicode()
    return "".join(b2u[b] for b in raw)


def _pieces_vocab():
    vocab = {"<unk>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in WORDS:
        for t in (w, "▁" + w):
            vocab.setdefault(t.replace(" ", "▁"), len(vocab))
    vocab.setdefault("▁", len(vocab))
    vocab.setdefault("▁▁", len(vocab))
    return vocab


def byte_fallback():  # Llama's and Mistral's decoder
    tok = Tokenizer(models.BPE(vocab=_pieces_vocab(), merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return _with_special(tok)


def metaspace():
    tok = Tokenizer(models.BPE(vocab=_pieces_vocab(), merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return _with_special(tok)


def wordpiece():
    vocab = {"[UNK]": 0}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
        vocab.setdefault("##" + w, len(vocab))
    for w in (",", "?", "!", "'", "n't", "'s", "'m", "'ve", "'re"):
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return _with_special(tok)


def _with_special(tok):
    tok.add_special_tokens([AddedToken("<|special|>", special=True, normalized=False)])
    return tok


TOKENIZERS = {"byte-level": byte_level, "byte-fallback": byte_fallback, "metaspace": metaspace,
              "wordpiece": wordpiece}


def _random_case(tok, rng):
    n = tok.get_vocab_size()
    ids = [rng.randrange(n) for _ in range(rng.randrange(1, 40))]
    text = tok.decode(ids)
    stops = []
    for _ in range(rng.randrange(0, 4)):
        if text and rng.random() < 0.7:  # a stop that is in the output, often across token edges
            at = rng.randrange(len(text))
            stops.append(text[at:at + rng.randrange(1, 6)])
        else:
            stops.append(rng.choice(WORDS) + rng.choice(["", "x", " a"]))
    return ids, stops


def _stream(stream, ids):
    pieces = []
    for t in ids:
        pieces.append(stream.push(t))
        if stream.stopped:
            break
    if not stream.stopped:
        pieces.append(stream.flush() if isinstance(stream, TextStream) else stream.push(None, final=True))
    return pieces


def _prefix_stable(tok, ids) -> bool:
    """Whether each complete text (not ending inside a character) begins every later one. Not so
    when ByteFallback meets an invalid byte run: it turns the whole run, bytes already shown as
    text included, into replacement characters; text already streamed cannot follow that."""
    texts = [t for t in (tok.decode(ids[:k]) for k in range(1, len(ids))) if not t.endswith("\ufffd")]
    texts.append(tok.decode(ids))  # the end's text, as flush gives it
    return all(b.startswith(a) for a, b in zip(texts, texts[1:]))


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_pieces_equal_the_whole_text_decode_token_by_token(kind):
    tok = TOKENIZERS[kind]()
    rng = random.Random(kind)
    checked = 0
    for _ in range(2000):
        if checked == 300:
            break
        ids, stops = _random_case(tok, rng)
        if not _prefix_stable(tok, ids):
            continue
        checked += 1
        ours, oracle = TextStream(tok, stops), WholeDecode(tok, stops)
        assert _stream(ours, ids) == _stream(oracle, ids), (ids, stops)
        assert ours.stopped == oracle.stopped and ours.text == "".join(_stream(WholeDecode(tok, stops), ids))
    assert checked == 300


def test_a_character_split_across_byte_tokens_waits_for_its_last_byte():
    tok = byte_level()
    euro = list("€".encode())  # three byte tokens
    s = TextStream(tok, [])
    assert [s.push(t) for t in [ord("a")] + euro + [ord("b")]] == ["a", "", "", "€", "b"]
    s = TextStream(tok, [])
    assert s.push(ord("a")) + s.push(euro[0]) == "a"
    assert s.flush() == "\ufffd"  # ended inside a character: what the whole decode gives


def test_a_stop_across_tokens_is_held_back_and_cut():
    tok = byte_level()
    ids = tok.encode("abcEND", add_special_tokens=False).ids
    assert len(ids) == 6  # one token per character: the stop spans three
    s = TextStream(tok, ["END"])
    pieces = [s.push(t) for t in ids]
    assert pieces == ["", "", "a", "b", "c", ""] and s.stopped and s.text == "abc"  # 2 held: "EN" may begin "END"
    # A stop that came with a token ending inside a character is found when the output ends there.
    s = TextStream(tok, ["X"])
    assert s.push(ord("a")) == "a" and s.push(tok.token_to_id(_chars(b"X\xe2"))) == "" and not s.stopped
    assert s.flush() == "" and s.stopped and s.text == "a"


def test_the_earliest_stop_wins_whatever_the_list_order():
    tok = byte_level()
    s = TextStream(tok, ["b", "a"])
    assert s.push(ord("x")) == "x"
    merged = tok.encode("ab", add_special_tokens=False).ids
    assert "".join(s.push(t) for t in merged) == "" and s.stopped and s.text == "x"


def test_decodes_a_bounded_window_per_token():
    counted = []

    class Counting:
        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids):
            counted.append(len(ids))
            return self.tok.decode(ids)

    tok = byte_level()
    ids = [tok.token_to_id(_chars(w.encode())) for w in (WORDS * 200)[:2000]]
    s = TextStream(Counting(tok), ["never there"])
    text = "".join(s.push(t) for t in ids) + s.flush()
    assert text == tok.decode(ids)
    # Whole-text decoding would decode n(n+1)/2 = 2,001,000 ids; a window is a few tokens.
    assert sum(counted) <= 8 * len(ids), sum(counted)
