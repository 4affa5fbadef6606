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


def family_model(tiny: Path, out: Path, family: str) -> Path:
    """A copy of the tiny model whose chat template is the family's."""
    template, _, tokens = FAMILIES[family]
    out.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.is_file() and f.name != "tokenizer_config.json":
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    cfg.update(tokens, chat_template=(FIXTURES / template).read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False))
    return out
