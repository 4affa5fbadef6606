"""Tool calling: which syntax the model writes its calls in, read from its chat template, and per
syntax (one module each) a parser that turns the answer's text back into OpenAI `tool_calls` and
the grammar that holds a constrained answer to that syntax (colibri/serve/tools/constrain.py).

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes)
  deepseek_v3  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name ```json ...``` <｜tool▁call▁end｜>`
  glm4_moe     `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>` (GLM-4.5..5)
  harmony      gpt-oss channels, `<|channel|>commentary to=functions.name ... <|message|>{...}`

The format is chosen from the template's own text: the markers it renders an assistant's calls
with are the markers the model was trained to write. A template with none of them (ChatML, the
fallback) has no tool format, and a request with tools is refused rather than answered by a model
that was never shown how to call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from colibri.serve.tools import deepseek_v3, glm4_moe, harmony, hermes
from colibri.serve.tools.base import BlockParser, ToolCall
from colibri.serve.tools.deepseek_v3 import DeepSeekV3Parser
from colibri.serve.tools.glm4_moe import Glm4MoeParser
from colibri.serve.tools.harmony import HarmonyParser
from colibri.serve.tools.hermes import HermesParser


@dataclass(frozen=True)
class ToolFormat:
    name: str
    parser: type
    # (marks, calls, *, forced, parallel, response_schema) -> the lark grammar of the calls in this
    # syntax (colibri/serve/tools/constrain.py)
    grammar: Callable[..., str]

    def new_parser(self, tools: list[dict] | None):
        return self.parser(tools)


HARMONY = ToolFormat("harmony", HarmonyParser, harmony.grammar)
DEEPSEEK_V3 = ToolFormat("deepseek_v3", DeepSeekV3Parser, deepseek_v3.grammar)
GLM4_MOE = ToolFormat("glm4_moe", Glm4MoeParser, glm4_moe.grammar)
HERMES = ToolFormat("hermes", HermesParser, hermes.grammar)
FORMATS = (HARMONY, DEEPSEEK_V3, GLM4_MOE, HERMES)


def detect_format(template_text: str | None) -> ToolFormat | None:
    """The tool format a chat template's text implies, or None. Checked most specific first:
    GLM's blocks are `<tool_call>` too, told apart by `<arg_key>`; Qwen3-Coder's
    `<function=...>` XML inside `<tool_call>` is a format of its own, not parsed here."""
    t = template_text or ""
    if "<|channel|>" in t and "to=functions." in t:
        return HARMONY
    if "tool▁call▁begin" in t:
        return DEEPSEEK_V3
    if "<tool_call>" in t and "<arg_key>" in t:
        return GLM4_MOE
    if "<tool_call>" in t and "<function=" not in t:
        return HERMES
    return None


__all__ = ["BlockParser", "FORMATS", "ToolCall", "ToolFormat", "detect_format"]
