"""The GGUF's tokenizer → tokenizer.json, where it can be rebuilt exactly.

Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: the token list is the vocabulary
in id order and `tokenizer.ggml.merges` the merges in rank order), with the pre-tokenizers
named in PRE_TOKENIZERS (`tokenizer.ggml.pre`; the regexes are those of llama.cpp's
llama-vocab.cpp, which are the HF tokenizer.json regexes of the same models). Control and
user-defined tokens (token_type 3 and 4) become special added tokens. Anything else
(SentencePiece "llama", WordPiece "bert", RWKV, an unknown pre-tokenizer) is not guessed: no
tokenizer.json is written and the import says why.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.format.gguf.reader import GGUFModel

LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre → the regex split before byte-level mapping (None: GPT-2's own regex).
PRE_TOKENIZERS = {"gpt-2": None, "default": None, "llama-bpe": LLAMA3_REGEX, "llama3": LLAMA3_REGEX,
                  "qwen2": QWEN2_REGEX}
SPECIAL_TYPES = (3, 4)  # ggml token types CONTROL, USER_DEFINED


def build_tokenizer(m: GGUFModel) -> tuple[Tokenizer | None, str]:
    """(tokenizer, what it is) or (None, why not)."""
    kind = m.get("tokenizer.ggml.model")
    if kind is None:
        return None, "the GGUF has no tokenizer"
    if kind != "gpt2":
        return None, f"tokenizer kind {kind!r} is not converted (supported: gpt2 byte-level BPE)"
    pre = m.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        return None, (f"pre-tokenizer {pre!r} is not converted (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    tokens = m.get("tokenizer.ggml.tokens") or []
    merges = m.get("tokenizer.ggml.merges") or []
    types = m.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        return None, "the token list has duplicate entries (not a BPE vocabulary)"
    pairs = [tuple(mg.split(" ", 1)) for mg in merges]
    if any(len(p) != 2 for p in pairs):
        return None, "a merge is not two tokens separated by a space"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    regex = PRE_TOKENIZERS[pre]
    if regex is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in SPECIAL_TYPES]
    if special:
        tok.add_special_tokens(special)
    return tok, f"gpt2 byte-level BPE, pre-tokenizer {pre!r}, {len(tokens)} tokens, {len(merges)} merges"
