"""The model's chat template (tokenizer_config.json's `chat_template`), rendered as transformers does.

transformers renders chat templates with jinja2 in an immutable sandbox, `trim_blocks` and
`lstrip_blocks` on, a `tojson` filter, a `raise_exception` global and the tokenizer's special
tokens as variables; a template written for it renders the same here. A model without a template
gets ChatML (what llama-server falls back to), and `/v1/models` says which one is in use.
"""

from __future__ import annotations

import json
import os
import stat
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.api import ModelFormatError, loads_limited

MAX_CONFIG_BYTES = 16 << 20

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TemplateError(ModelFormatError):
    """The chat template cannot be rendered for these messages (the request, not the server, is wrong)."""


def _token_text(value) -> str | None:
    # tokenizer_config.json stores a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_tokenizer_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "tokenizer_config.json"
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    if not stat.S_ISREG(st.st_mode):
        raise ModelFormatError(f"{path}: not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ModelFormatError(f"{path}: {st.st_size} bytes is larger than the {MAX_CONFIG_BYTES}-byte limit")
    cfg = loads_limited(path.read_bytes(), str(path), max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(cfg, dict):
        raise ModelFormatError(f"{path}: must be a JSON object")
    return cfg


def _pick_template(value) -> str | None:
    # A list of {name, template} is how tokenizers with several templates store them: "default" wins.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class ChatTemplate:
    """messages → prompt text, with the model's template (or ChatML)."""

    def __init__(self, template: str | None, special_tokens: dict[str, str | None]):
        self.source = "tokenizer_config.json" if template else "chatml (the model has no chat_template)"
        self.special_tokens = special_tokens
        self.text = template or CHATML  # what the tool-call format is read from (colibri/serve/tools/)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False, separators=None: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)
        env.globals["raise_exception"] = self._raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(template or CHATML)
        except jinja2.TemplateError as exc:
            raise ModelFormatError(f"tokenizer_config.json: chat_template does not compile ({exc})") from None

    @staticmethod
    def _raise(message):
        raise TemplateError(f"chat template: {message}")

    @classmethod
    def for_model(cls, model_dir: str | os.PathLike) -> "ChatTemplate":
        cfg = read_tokenizer_config(model_dir)
        return cls(_pick_template(cfg.get("chat_template")), {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKENS})

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        # `tools` is always defined, None when there are none, as transformers passes it. A special
        # token the tokenizer does not set is left undefined, as in transformers (not the text "None").
        tokens = {k: v for k, v in self.special_tokens.items() if v is not None}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, **tokens)
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
