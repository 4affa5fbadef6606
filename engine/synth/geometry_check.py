"""The one validator of a geometry (a bundled preset, or a user's geometry JSON), used by
`synth`, `plan` and the cost model alike.

Why one: `synth` and `plan` each checked geometries their own way, so a file `synth` refused in
2 s made `plan` run for minutes at 10 GB (1e9 experts), divide by zero (hidden_size 0, heads 0)
or predict for nonsense ("64", true, 8.5 as sizes), and a misspelt key (`num_expert_per_tok`)
was silently ignored. The checks, in order, each failing with one ConfigError line naming the
file and the key:

1. keys: every key is one the engine, synth or the cost model reads (or harmless Hugging Face
   config boilerplate); an unknown key gets the closest known one as a suggestion (difflib);
2. the engine's config.json rules for the geometry's model_type (engine/arch/registry.validate_config: types,
   ranges, cross-field rules such as 1 <= top-k <= experts, MLA ranks for deepseek_v3);
3. the geometry's own keys (name, description, routing_skew, published counts...);
4. size, arithmetically before anything is allocated: total parameters and the number of
   (layer, expert) pairs the cost model tabulates.
"""

from __future__ import annotations

import difflib
import math

from engine.base.errors import ConfigError, ModelFormatError
from engine.base.inputs import printable
from engine.synth.params import param_counts
from engine.arch.config_rules import Field, Rope, is_number
from engine.arch.registry import RULES, validate_config

# Far above any real model (GLM-5: 744e9 parameters, 78 x 256 routed experts), far below what
# would make the cost model's per-layer tensors and per-(layer, expert) tables exhaust memory.
MAX_TOTAL_PARAMS = 10 ** 14
MAX_LAYER_EXPERT_PAIRS = 1 << 22

# The geometry's own keys (not config.json's): what synth, plan and the preset listing read.
GEOMETRY_KEYS = {"name", "description", "source", "materializable", "published_total_params",
                 "published_active_params", "routing_skew", "max_shard_size", "initializer_range",
                 "expert_format", "dtype"}
# Keys the architectures read that no rule declares, and the boilerplate of a Hugging Face
# config.json (a geometry is often one copied from a model card): read or harmless, never typos.
ARCH_EXTRA_KEYS = {"num_nextn_predict_layers", "partial_rotary_factor", "rope_interleave", "swiglu_alpha",
                   "swiglu_limit", "use_qk_norm", "norm_topk_prob", "n_group", "topk_group", "index_topk",
                   "routed_scaling_factor", "attention_bias", "layer_types", "scoring_func", "topk_method",
                   "moe_layer_freq", "max_window_layers", "qkv_bias", "mlp_bias", "head_dim",
                   "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "ep_size"}
HF_BOILERPLATE = {"architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
                  "transformers_version", "torch_dtype", "use_cache", "attention_dropout", "hidden_act",
                  "output_router_logits", "router_aux_loss_coef", "router_jitter_noise", "aux_loss_alpha",
                  "seq_aux", "pretraining_tp", "quantization_config", "rope_scaling", "rope_parameters",
                  "model_type", "use_sliding_window", "sliding_window", "tie_word_embeddings", "clip_qkv",
                  "num_local_experts", "num_experts", "n_routed_experts", "colibri_synth"}


def known_keys() -> set[str]:
    names = GEOMETRY_KEYS | ARCH_EXTRA_KEYS | HF_BOILERPLATE
    for rules in RULES.values():
        for rule in rules:
            if isinstance(rule, Field):
                names.add(rule.name)
            elif isinstance(rule, Rope):
                names |= {"rope_parameters", "rope_scaling"}
    return names


def check_geometry(geometry, source: str) -> None:
    """Raise one ConfigError line for the first problem of a geometry dict; source names it."""
    if not isinstance(geometry, dict):
        raise ConfigError(f"{source}: expected a JSON object of geometry keys")
    _check_keys(geometry, source)
    mt = geometry.get("model_type", "qwen3_moe")  # synth's default architecture
    if not isinstance(mt, str) or mt not in RULES:
        raise ConfigError(f"{source}: model_type {printable(repr(mt))} has no geometry rules "
                          f"(known: {', '.join(sorted(RULES))})")
    try:
        validate_config({"model_type": mt, **geometry}, source=source)
    except ModelFormatError as exc:  # a geometry is a file the user wrote, not a model's config.json
        raise ConfigError(str(exc)) from None
    _check_own_keys(geometry, source)
    _check_size(geometry, mt, source)


def _check_keys(geometry: dict, source: str) -> None:
    known = known_keys()
    for key in geometry:
        if not isinstance(key, str) or key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{source}: unknown key {printable(key)!r}{hint}")


def _check_own_keys(g: dict, source: str) -> None:
    for key in ("name", "description", "source", "expert_format", "dtype"):
        if key in g and g[key] is not None and not isinstance(g[key], str):
            raise ConfigError(f"{source}: {key!r} must be a string, got {printable(repr(g[key]))[:60]}")
    if "materializable" in g and not isinstance(g["materializable"], bool):
        raise ConfigError(f"{source}: 'materializable' must be true or false")
    for key in ("published_total_params", "published_active_params", "routing_skew", "initializer_range"):
        v = g.get(key)
        if v is not None and (not is_number(v) or v < 0):
            raise ConfigError(f"{source}: {key!r} must be a finite number >= 0, got {printable(repr(v))[:60]}")
    ms = g.get("max_shard_size")
    if ms is not None and (isinstance(ms, bool) or not isinstance(ms, int) or not 1 << 12 <= ms <= 1 << 40):
        raise ConfigError(f"{source}: 'max_shard_size' must be an integer number of bytes in [4 KiB, 1 TiB], "
                          f"got {printable(repr(ms))[:60]}")


def _check_size(g: dict, mt: str, source: str) -> None:
    """Total parameters and (layer, expert) pairs, computed with Python ints: nothing allocated."""
    try:
        counts = param_counts({"model_type": mt, **g})
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{source}: missing or bad key {exc} for model_type {mt}") from None
    layers = g["num_hidden_layers"]
    pairs = layers * (counts["num_experts"] + 1)
    if pairs > MAX_LAYER_EXPERT_PAIRS:
        raise ConfigError(f"{source}: {layers} layers x {counts['num_experts']} experts is more than the "
                          f"{MAX_LAYER_EXPERT_PAIRS} (layer, expert) pairs any real model has")
    if not math.isfinite(counts["total"]) or counts["total"] > MAX_TOTAL_PARAMS:
        raise ConfigError(f"{source}: {counts['total']:.3g} parameters is beyond the {MAX_TOTAL_PARAMS:.0e} "
                          "this tool plans for (check the sizes)")
