"""The response bodies of `colibri serve`: completions and chat, whole and streamed, with log-probs.

Log-probs are the model's own (the log_softmax of the raw logits of each step, before penalties,
bias, temperature or top_p: engine/run/sampling.py), one entry per token `usage` counts (an
end-of-sequence token is not one). Chat gives choices[].logprobs.content[] = {token, logprob,
bytes, top_logprobs}; completions give logprobs = {tokens, token_logprobs, top_logprobs,
text_offset}, text_offset counted in characters of the completion's text (vLLM's choice without
echo). A token that is not whole UTF-8 on its own (a byte of a split character) is written
"bytes:\\xNN..." as OpenAI does; `bytes` always has its exact bytes.
"""

from __future__ import annotations

import json
import time
import uuid

LOGPROB_FLOOR = -9999.0  # what OpenAI reports for a probability that underflows (JSON has no -inf)


class TokenText:
    """Token id → (its bytes, its text), from the tokenizer's vocabulary: a byte-level BPE token's
    characters map back to bytes (GPT-2's table); a <0xNN> byte-fallback token is that byte; a
    Metaspace "▁" is a space; special tokens are their own name. Cached per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[bytes, str]] = {}
        try:
            spec = json.loads(tokenizer.to_str())
        except (AttributeError, ValueError, TypeError):
            spec = {}
        self.byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        self.metaspace = "Metaspace" in json.dumps(spec.get("decoder") or {})
        self.special = {i for i, t in _added(tokenizer).items() if getattr(t, "special", False)}
        self.unbyte = {c: b for b, c in _bytes_to_unicode().items()}

    def get(self, token: int) -> tuple[bytes, str]:
        hit = self.cache.get(token)
        if hit is None:
            raw = self._bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self.cache[token] = (raw, text)
        return hit

    def _bytes(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if token in self.special:
            return piece.encode("utf-8")
        if self.byte_level and all(c in self.unbyte for c in piece):
            return bytes(self.unbyte[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self.metaspace:
            return piece.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token]).encode("utf-8")


def _added(tokenizer) -> dict:
    try:
        return dict(tokenizer.get_added_tokens_decoder())
    except (AttributeError, TypeError):
        return {}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, which byte-level BPE vocabularies are written in."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def chat_logprobs(entries, tokens: TokenText) -> dict:
    """entries: [(TokenLogprob, text_offset)] → {"content": [...]} of a chat choice."""
    content = []
    for tl, _ in entries:
        raw, text = tokens.get(tl.token)
        top = []
        for i, lp in tl.top:
            b, t = tokens.get(i)
            top.append({"token": t, "logprob": _lp(lp), "bytes": list(b)})
        content.append({"token": text, "logprob": _lp(tl.logprob), "bytes": list(raw), "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(entries, tokens: TokenText) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tl, offset in entries:
        out["tokens"].append(tokens.get(tl.token)[1])
        out["token_logprobs"].append(_lp(tl.logprob))
        out["top_logprobs"].append({tokens.get(i)[1]: _lp(lp) for i, lp in tl.top})
        out["text_offset"].append(offset)
    return out


def usage(result, *more) -> dict:
    """One request's usage: its prompt once, the completion tokens of every choice (n > 1: `more`)."""
    n = sum(len(r.output_ids) for r in (result, *more))
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


class CompletionShape:
    @staticmethod
    def new_id() -> str:
        return f"cmpl-{uuid.uuid4().hex[:24]}"

    @staticmethod
    def _head(ident, state, seed) -> dict:
        return {"id": ident, "object": "text_completion", "created": int(time.time()), "model": state.model_id,
                "seed": seed}

    @staticmethod
    def whole(ident, text, result, state, seed, logprobs=None) -> dict:
        return CompletionShape.whole_choices(ident, [(text, result, logprobs)], state, seed)

    @staticmethod
    def whole_choices(ident, choices, state, seed) -> dict:
        """choices: [(text, JobResult, log-prob entries or None)] in index order (n of them)."""
        out = []
        for i, (text, result, logprobs) in enumerate(choices):
            lp = completion_logprobs(logprobs, state.token_text) if logprobs is not None else None
            out.append({"index": i, "text": text, "finish_reason": result.finish_reason, "logprobs": lp})
        return {**CompletionShape._head(ident, state, seed), "choices": out,
                "usage": usage(*(result for _, result, _ in choices))}

    @staticmethod
    def chunk(ident, text, finish, state, seed, first=False, logprobs=None, index=0) -> dict | None:
        if first:  # completions have no opening role chunk
            return None
        lp = completion_logprobs(logprobs, state.token_text) if logprobs else None
        return {**CompletionShape._head(ident, state, seed),
                "choices": [{"index": index, "text": text or "", "finish_reason": finish, "logprobs": lp}]}


class ChatShape:
    @staticmethod
    def new_id() -> str:
        return f"chatcmpl-{uuid.uuid4().hex[:24]}"

    @staticmethod
    def _head(ident, state, seed, kind) -> dict:
        return {"id": ident, "object": kind, "created": int(time.time()), "model": state.model_id, "seed": seed}

    @staticmethod
    def whole(ident, text, result, state, seed, logprobs=None) -> dict:
        return ChatShape.whole_choices(ident, [(text, result, logprobs)], state, seed)

    @staticmethod
    def whole_choices(ident, choices, state, seed) -> dict:
        """choices: [(text, JobResult, log-prob entries or None)] in index order (n of them)."""
        out = []
        for i, (text, result, logprobs) in enumerate(choices):
            lp = chat_logprobs(logprobs, state.token_text) if logprobs is not None else None
            out.append({"index": i, "message": {"role": "assistant", "content": text},
                        "finish_reason": result.finish_reason, "logprobs": lp})
        return {**ChatShape._head(ident, state, seed, "chat.completion"), "choices": out,
                "usage": usage(*(result for _, result, _ in choices))}

    @staticmethod
    def chunk(ident, text, finish, state, seed, first=False, logprobs=None, index=0) -> dict:
        delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text is not None else {})
        lp = chat_logprobs(logprobs, state.token_text) if logprobs else None
        return {**ChatShape._head(ident, state, seed, "chat.completion.chunk"),
                "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}]}
