"""Tiny models whose tokenizer_config.json carries the chat templates of the tool-calling families
(tests/fixtures/chat_templates/*.jinja), and the requests the tool tests share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
# family → (template file, the format the server must detect, extra special tokens of the family)
FAMILIES = {
    "qwen3": ("qwen3.jinja", "hermes", {"eos_token": "<|im_end|>"}),
    "deepseek_v3": ("deepseek_v3.jinja", "deepseek_v3", {"bos_token": "<｜begin▁of▁sentence｜>"}),
    "glm4_moe": ("glm4_moe.jinja", "glm4_moe", {}),
    "gpt_oss": ("gpt_oss.jinja", "harmony", {}),
}

# Each format's markers, which the real families' vocabularies hold as added tokens (one token each).
MARKERS = {
    "qwen3": ["<tool_call>", "</tool_call>"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁sep｜>"],
    "glm4_moe": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"],
    "gpt_oss": ["<|channel|>", "<|message|>", "<|constrain|>", "<|start|>", "<|end|>", "<|call|>", "<|return|>"],
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOLS = [WEATHER, TIME]


def history(arguments: str = '{"city": "Paris", "days": 2}') -> list[dict]:
    """A round trip as an OpenAI client sends it back: the question, the model's call (content
    null), the tool's result; the final answer is the model's next turn."""
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "high": 21}'}]


def family_model(tiny: Path, out: Path, family: str, marker_tokens: bool = False) -> Path:
    """A copy of the tiny model whose chat template is the family's. marker_tokens: the family's
    markers are added tokens of its vocabulary, as in the real families (else plain text)."""
    template, _, tokens = FAMILIES[family]
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg.update(tokens, chat_template=(FIXTURES / template).read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    if marker_tokens:
        _markers_as_tokens(out / "tokenizer.json", MARKERS[family])
    return out


def _markers_as_tokens(path: Path, markers: list[str]) -> None:
    """Give `markers` the ids of the tokenizer's last BPE merges (the model's embedding rows stay
    as they are): the merges learned last are inputs to no other, so dropping them keeps every other
    token; the markers become added tokens with those ids, which the model can sample."""
    tok = json.loads(path.read_text())
    vocab, merges = tok["model"]["vocab"], tok["model"]["merges"]
    top = max(vocab.values()) + 1
    freed = list(range(top - len(markers), top))
    dropped = {t for t, i in vocab.items() if i in freed}
    merges[:] = [m for m in merges if not ({*(m.split(" ") if isinstance(m, str) else m), "".join(
        m.split(" ") if isinstance(m, str) else m)} & dropped)]
    for t in dropped:
        del vocab[t]
    for i, marker in zip(freed, markers):
        vocab[marker] = i
        tok["added_tokens"].append({"id": i, "content": marker, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    path.write_text(json.dumps(tok, ensure_ascii=False))
