"""Strict config.json validation: the rule types and the blocks architectures share, run before any tensor is read.

Why: values that are each well-typed but together inconsistent (`num_attention_heads: 0`,
top-k above the expert count, `rope_scaling` as a list, kv heads that do not divide the heads)
used to reach the model code and die there with a traceback. Every field the engine reads is
described once — type, range, whether it may be null — plus the cross-field rules, here when
architectures share it, else in its architecture's module; a failure is one line naming the
field, its value and the rule.

Each architecture (engine/arch/families/) builds its rule tuple from the blocks below (COMMON,
MOE, ...) and fields of its own; engine/arch/registry.validate_config runs the tuple of a
config's model_type:

    rules=lambda model_type: (*COMMON, *MOE, Int("my_rank", 1, 1 << 16, required=True),
                              Consistent(lambda c: ..., "my_rank", "must be ..."))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, Callable, ClassVar, Iterator


MISSING: Any = object()


@dataclass(frozen=True)
class Problem:
    field: str
    value: Any
    rule: str

    def line(self) -> str:
        if self.value is MISSING:
            return f"{self.field} is missing: {self.rule}"
        return f"{self.field} = {short_repr(self.value)}: {self.rule}"


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite JSON number (bools are not numbers; huge ints are finite)."""
    if is_int(v):
        return True
    return isinstance(v, float) and math.isfinite(v)


# --- single-field rules ------------------------------------------------------------------------

@dataclass(frozen=True)
class Field:
    """Base of the single-field rules: presence and null handling; subclasses say what a value must be."""

    name: str
    required: bool = dataclass_field(default=False, kw_only=True)
    # null means "use the default", as the engine's `cfg.get(x) or default` does
    nullable: bool = dataclass_field(default=False, kw_only=True)

    def check(self, cfg: dict) -> Iterator[Problem]:
        value = cfg.get(self.name, MISSING)
        if value is MISSING:
            if self.required:
                yield Problem(self.name, MISSING, self.rule())
            return
        if value is None:
            if not self.nullable:
                yield Problem(self.name, None, self.rule() + " (null is not allowed)")
            return
        if not self.accepts(value):
            yield Problem(self.name, value, self.rule())

    def accepts(self, value) -> bool:
        raise NotImplementedError

    def rule(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Field):
    lo: int
    hi: int

    def accepts(self, value) -> bool:
        return is_int(value) and self.lo <= value <= self.hi

    def rule(self) -> str:
        return f"must be an integer in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Number(Field):
    """A finite number above `lo` (or at least `lo` when `lo_inclusive`) and at most `hi`."""

    lo: float
    hi: float = math.inf
    lo_inclusive: bool = False

    def accepts(self, value) -> bool:
        if not is_number(value):
            return False
        return (value >= self.lo if self.lo_inclusive else value > self.lo) and value <= self.hi

    def rule(self) -> str:
        upper = "" if self.hi == math.inf else f" and <= {self.hi:g}"
        return f"must be a finite number {'>=' if self.lo_inclusive else '>'} {self.lo:g}{upper}"


@dataclass(frozen=True)
class Typed(Field):
    """A value of one JSON type; each subclass names the type and how the rule reads."""

    json_type: ClassVar[type] = object
    described: ClassVar[str] = "any value"

    def accepts(self, value) -> bool:
        return isinstance(value, self.json_type)

    def rule(self) -> str:
        return f"must be {self.described}"


class Bool(Typed):
    json_type, described = bool, "true or false"


class Str(Typed):
    json_type, described = str, "a string"


@dataclass(frozen=True)
class Choice(Field):
    options: tuple
    why: str = ""

    def accepts(self, value) -> bool:
        return isinstance(value, str) and value in self.options

    def rule(self) -> str:
        return f"must be one of {', '.join(self.options)}" + (f" ({self.why})" if self.why else "")


@dataclass(frozen=True)
class LayerList(Field):
    """A list of distinct layer indices in [0, num_hidden_layers)."""

    def accepts(self, value) -> bool:
        return isinstance(value, list) and all(is_int(v) for v in value)

    def rule(self) -> str:
        return "must be a list of layer indices"

    def check(self, cfg: dict) -> Iterator[Problem]:
        problems = list(super().check(cfg))
        yield from problems
        value, layers = cfg.get(self.name), cfg.get("num_hidden_layers")
        if problems or not isinstance(value, list) or not is_int(layers):
            return
        bad = [v for v in value if not 0 <= v < layers]
        if bad:
            yield Problem(self.name, value, f"index {bad[0]} is outside [0, {layers}) (num_hidden_layers)")


@dataclass(frozen=True)
class QuantizationConfig(Field):
    """`quantization_config`: an object whose `quant_method` (if given) is a string. Readers do
    `config["quantization_config"].get(...)`; a string there ("fp8") was an AttributeError in
    every command that opened the model. The FP8 fields are engine/format/fp8_checkpoint.fp8_spec's."""

    def accepts(self, value) -> bool:
        return isinstance(value, dict) and isinstance(value.get("quant_method", ""), str)

    def rule(self) -> str:
        return 'must be an object with a string quant_method (e.g. {"quant_method": "fp8", ...})'


# --- cross-field rules ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Consistent:
    """A rule over several fields, checked only once every single-field rule passed.

    `holds(cfg)` returns True when the config is consistent; `field` names what the message
    points at and `rule` says what must hold (it may use {placeholders} filled from the config
    and the derived values of `derived(cfg)`).
    """

    holds: Callable[[dict], bool]
    field: str
    rule: str

    def problem(self, cfg: dict) -> Problem | None:
        if self.holds(cfg):
            return None
        return Problem(self.field, cfg.get(self.field, MISSING), self.rule.format(**derived(cfg)))


def derived(cfg: dict) -> dict:
    """The values the engine derives when a field is absent, for messages and cross rules."""
    heads = cfg.get("num_attention_heads")
    hidden = cfg.get("hidden_size")
    head_dim = cfg.get("head_dim") or (hidden // heads if is_int(hidden) and is_int(heads) and heads else None)
    return {**{k: v for k, v in cfg.items() if isinstance(k, str) and k.isidentifier()},
            "heads": heads, "kv_heads": cfg.get("num_key_value_heads") or heads, "head_dim_eff": head_dim,
            "experts": cfg.get("num_experts") or cfg.get("num_local_experts") or 0}


# --- RoPE: a mapping whose type is known and carries that type's keys --------------------------

ROPE_TYPES: dict[str, tuple[Field, ...]] = {
    "default": (),
    "linear": (Number("factor", 0, required=True),),
    "dynamic": (Number("factor", 0, required=True),),
    "llama3": (Number("factor", 0, required=True), Number("low_freq_factor", 0, required=True),
               Number("high_freq_factor", 0, required=True),
               Int("original_max_position_embeddings", 1, 1 << 31, required=True)),
    "yarn": (Number("factor", 0, nullable=True), Int("original_max_position_embeddings", 1, 1 << 31, nullable=True),
             Number("attention_factor", 0, nullable=True), Number("beta_fast", 0, nullable=True),
             Number("beta_slow", 0, nullable=True), Number("mscale", 0, lo_inclusive=True, nullable=True),
             Number("mscale_all_dim", 0, lo_inclusive=True, nullable=True), Bool("truncate")),
}


@dataclass(frozen=True)
class Rope:
    """rope_parameters (transformers 5) and rope_scaling (4.x), merged as the engine merges them."""

    def check(self, cfg: dict) -> Iterator[Problem]:
        merged: dict = {}
        for name in ("rope_parameters", "rope_scaling"):
            value = cfg.get(name)
            if value is None:
                continue
            if not isinstance(value, dict):
                yield Problem(name, value, "must be a mapping (an object of RoPE parameters) or null")
                return
            merged.update({k: v for k, v in value.items() if k not in merged})
        kind = merged.get("rope_type", merged.get("type", "default"))
        where = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
        if not isinstance(kind, str) or kind not in ROPE_TYPES:
            yield Problem(f"{where}.rope_type", kind, f"must be one of {', '.join(ROPE_TYPES)}")
            return
        theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
        if not is_number(theta) or theta <= 1:
            yield Problem(f"{where}.rope_theta" if "rope_theta" in merged else "rope_theta", theta,
                          "must be a finite number > 1 (the RoPE base)")
        for rule in ROPE_TYPES[kind]:
            for p in rule.check(merged):
                yield Problem(f"{where}.{p.field}", p.value, f"{p.rule} for rope_type {kind}")
        if kind == "llama3" and all(is_number(merged.get(k)) for k in ("low_freq_factor", "high_freq_factor")) \
                and merged["high_freq_factor"] <= merged["low_freq_factor"]:
            yield Problem(f"{where}.high_freq_factor", merged["high_freq_factor"],
                          "must be larger than low_freq_factor for rope_type llama3")
        head_dim = derived(cfg)["head_dim_eff"]
        if kind == "dynamic" and is_int(head_dim) and head_dim <= 2:
            yield Problem("head_dim", head_dim, "must be > 2 for rope_type dynamic")


# --- rule blocks ---------------------------------------------------------------------------------

K16, M1, M4 = 1 << 16, 1 << 20, 1 << 22  # sanity caps: far above any real model, low enough to stop runaway loops

COMMON: tuple = (
    Int("hidden_size", 1, M1, required=True),
    Int("num_hidden_layers", 1, K16, required=True),
    Int("num_attention_heads", 1, K16, required=True),
    Int("num_key_value_heads", 1, K16, nullable=True),
    Int("head_dim", 2, K16, nullable=True),
    Int("vocab_size", 1, 1 << 24, required=True),
    Number("rms_norm_eps", 0, 1),
    Int("max_position_embeddings", 1, 1 << 31),
    Bool("tie_word_embeddings"),
    Bool("attention_bias"),
    Choice("hidden_act", ("silu", "swish"), why="the engine implements SwiGLU MLPs"),
    Number("rope_theta", 1, nullable=True),
    Rope(),
    Int("sliding_window", 0, 1 << 31, nullable=True),
    Bool("use_sliding_window"),
    Str("torch_dtype", nullable=True),
    Str("dtype", nullable=True),
    QuantizationConfig("quantization_config", nullable=True),
    Consistent(lambda c: c["num_attention_heads"] % derived(c)["kv_heads"] == 0, "num_key_value_heads",
               "must divide num_attention_heads ({num_attention_heads})"),
    Consistent(lambda c: c.get("head_dim") or c["hidden_size"] % c["num_attention_heads"] == 0, "hidden_size",
               "must be a multiple of num_attention_heads ({num_attention_heads}) when head_dim is not given"),
    Consistent(lambda c: derived(c)["head_dim_eff"] >= 2 and derived(c)["head_dim_eff"] % 2 == 0, "head_dim",
               "must be even and >= 2 (RoPE rotates pairs); derived head_dim is {head_dim_eff}"),
)


def _window_used(c: dict, default: bool) -> bool:
    return bool(c.get("use_sliding_window", default))


def sliding_window_rule(default_used: bool) -> Consistent:
    return Consistent(lambda c: not _window_used(c, default_used) or c.get("sliding_window") is None
                      or c["sliding_window"] >= 1, "sliding_window", "must be >= 1 (or null) when sliding-window attention is used")


DENSE: tuple = (Int("intermediate_size", 1, M4, required=True), sliding_window_rule(False))

MOE: tuple = (
    Int("num_experts", 1, K16, nullable=True),
    Int("num_local_experts", 1, K16, nullable=True),
    Int("num_experts_per_tok", 1, K16, required=True),
    Bool("norm_topk_prob"),
    Consistent(lambda c: derived(c)["experts"] >= 1, "num_experts",
               "an MoE model needs num_experts (or num_local_experts) >= 1"),
    Consistent(lambda c: not (c.get("num_experts") and c.get("num_local_experts"))
               or c["num_experts"] == c["num_local_experts"], "num_local_experts",
               "must equal num_experts ({num_experts}) when both are given"),
    Consistent(lambda c: c["num_experts_per_tok"] <= derived(c)["experts"], "num_experts_per_tok",
               "must be <= the number of experts ({experts})"),
)

QWEN_MOE: tuple = (
    Int("moe_intermediate_size", 1, M4, required=True),
    Int("intermediate_size", 0, M4, nullable=True),  # 0 / null: no dense layers (checked below)
    LayerList("mlp_only_layers", nullable=True),
    Int("decoder_sparse_step", 1, K16, nullable=True),
    sliding_window_rule(False),
    # Layers that are plain MLPs (listed, or skipped by the sparse step) need the dense size.
    Consistent(lambda c: c.get("intermediate_size") or not (c.get("mlp_only_layers") or (c.get("decoder_sparse_step") or 1) > 1),
               "intermediate_size", "is needed (> 0) when mlp_only_layers or decoder_sparse_step > 1 make dense layers"),
)

# --- running the rules ---------------------------------------------------------------------------

def config_problems(cfg: dict, rules: tuple) -> list[Problem]:
    """Every problem of cfg under rules: field rules first; cross rules only if those all pass."""
    problems = [p for r in rules if not isinstance(r, Consistent) for p in r.check(cfg)]
    if problems:
        return problems
    for r in rules:
        if isinstance(r, Consistent):
            p = r.problem(cfg)
            if p is not None:
                problems.append(p)
                break  # later cross rules may assume this one (e.g. a divisor > 0)
    return problems
