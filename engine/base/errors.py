"""Errors a user can cause. The CLI prints each as one line and exits non-zero.

Anything else escaping is a bug and keeps its traceback.
"""


class ColibriError(Exception):
    """Base for every error that is the input's fault, not ours."""

    exit_code = 2


class ModelFormatError(ColibriError):
    """A model directory, config.json or safetensors file is missing, corrupt or hostile."""


class UnsupportedModelError(ColibriError):
    """config.json describes an architecture the engine does not implement."""


class ConfigError(ColibriError):
    """An engine config (TOML or flags) is malformed or out of range."""


class BudgetError(ColibriError):
    """The memory plan cannot fit the requested budget."""


class DraftBudgetError(BudgetError):
    """Drafting's bytes do not fit beside the prompt group that decoding without drafts uses at this
    budget: a smaller group would change a prompt's bits, and drafting must not change a token."""


class PromptError(ColibriError):
    """The prompt cannot be run (too long for ctx_size, bad token ids, no tokenizer)."""


class BusyError(ColibriError):
    """Another process holds the lock on a directory this one must write (and we may not wait)."""
