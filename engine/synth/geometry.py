"""Geometry presets: the bundled specs (engine/presets/*.json), user geometry files, their
validation, and parameter counts for any geometry (including the geometry-only specs of real
models, which are never materialized).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from engine.arch.registry import SYNTH_TYPES, architecture, model_args, validate_config
from engine.base.dtypes import FLOAT_NAMES
# The tokenizer (engine/synth/bpe_tokenizer.py): 256 byte tokens, <|endoftext|> at 256, then BPE merges.
from engine.synth.bpe_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB  # noqa: F401  (re-exported)
from engine.base.errors import ColibriError, ConfigError, ModelFormatError
from engine.base.inputs import printable
from engine.base.jsonlimits import load_json_input
from engine.synth.geometry_check import check_geometry
from engine.synth.hf_files import hf_config
from engine.synth.params import param_counts  # noqa: F401  (re-exported: engine.synth.param_counts)

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"

# Keys every materializable (qwen3_moe) geometry must provide, with their types.
_REQUIRED_INT = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size",
)
_DEFAULTS = {
    "model_type": "qwen3_moe",
    "intermediate_size": None,  # filled from moe_intermediate_size; unused when every layer is MoE
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "norm_topk_prob": True,
    "dtype": "bfloat16",
    "routing_skew": 1.0,
    "max_shard_size": 512 * 1024 * 1024,
    "initializer_range": 0.02,
}



def list_presets() -> list[str]:
    """Names of the bundled presets: materializable ones and geometry-only specs of real models."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> dict:
    """The geometry dict of a bundled preset (config.json-like keys plus name/materializable/source)."""
    path = PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(list_presets())}")
    return _read_geometry_json(path)


def load_geometry_file(path: str | os.PathLike) -> dict:
    """A user geometry JSON with the same keys as a preset."""
    path = Path(path)
    if not os.path.lexists(path):
        raise ConfigError(f"geometry file {str(path)!r} not found")
    return _read_geometry_json(path)


def _read_geometry_json(path: Path) -> dict:
    geom = load_json_input(path, "geometry", error=ConfigError, unique_keys=True)
    check_geometry(geom, path.name)
    geom.setdefault("name", path.stem)
    return geom


def validate_geometry(geometry: dict) -> dict:
    """Checks a geometry can be materialized; returns a copy with defaults filled in."""
    if not isinstance(geometry, dict):
        raise ConfigError("geometry must be a JSON object")
    name = geometry.get("name", "custom")
    check_geometry(geometry, f"geometry {printable(name)}")
    if geometry.get("materializable") is False:
        src = geometry.get("source", "its published config")
        raise ConfigError(
            f"preset {name!r} is a geometry-only spec of a real model ({src}) for planning; "
            "it is never materialized — use 'tiny', 'demo' or --geometry FILE"
        )
    g = {**_DEFAULTS, **geometry}
    if g["model_type"] not in SYNTH_TYPES:
        raise ConfigError(f"{name}: synth writes model_type {SYNTH_TYPES[0]} or "
                          f"{', '.join(SYNTH_TYPES[1:])}, not {g['model_type']!r}")
    recipe = architecture(g["model_type"]).synth
    if not recipe.native_geometry:
        return _derived_geometry(geometry, recipe.expert_formats)
    # The same rules the engine applies to the config.json this geometry becomes.
    try:
        validate_config(g, source=f"geometry {name}")
    except ModelFormatError as exc:  # a geometry is a config the user wrote, not a model file
        raise ConfigError(str(exc)) from None
    for key in _REQUIRED_INT:
        v = g.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name}: '{key}' must be a positive integer, got {v!r}")
    if g["intermediate_size"] is None:
        g["intermediate_size"] = g["moe_intermediate_size"]
    if g["vocab_size"] < MIN_VOCAB:
        raise ConfigError(f"{name}: vocab_size must be at least {MIN_VOCAB} (256 byte tokens + {EOS_TOKEN})")
    if g["dtype"] not in FLOAT_NAMES:
        raise ConfigError(f"{name}: dtype must be one of {', '.join(FLOAT_NAMES)}, got {g['dtype']!r}")
    for key in ("routing_skew", "rope_theta", "rms_norm_eps", "initializer_range"):
        v = g[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name}: '{key}' must be a non-negative number, got {v!r}")
    ms = g["max_shard_size"]
    if isinstance(ms, bool) or not isinstance(ms, int) or ms <= 0:
        raise ConfigError(f"{name}: 'max_shard_size' must be a positive integer (bytes), got {ms!r}")
    return g


def _derived_geometry(geometry: dict, expert_formats: tuple[str, ...]) -> dict:
    """A geometry of config.json keys (deepseek_v3, glm4_moe, glm_moe_dsa, gpt_oss), with defaults
    filled in and checked by the engine's own config parser (so synth can only write what the
    engine and transformers can run), plus the sizes synth's recipe reads, derived from it."""
    g = {**{k: v for k, v in _DEFAULTS.items() if k != "model_type"}, **geometry}
    name, mt = g.get("name", "custom"), g["model_type"]
    if g.get("intermediate_size") is None:
        g["intermediate_size"] = g.get("moe_intermediate_size")
    if g["dtype"] not in FLOAT_NAMES:
        raise ConfigError(f"{name}: dtype must be one of {', '.join(FLOAT_NAMES)}, got {g['dtype']!r}")
    vocab = g.get("vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < MIN_VOCAB:
        raise ConfigError(f"{name}: vocab_size must be an integer of at least {MIN_VOCAB}, got {vocab!r}")
    fmt = g.setdefault("expert_format", "plain")
    if fmt not in expert_formats:
        raise ConfigError(f"{name}: expert_format must be 'plain'{''.join(f' or {f}' for f in expert_formats[1:])}, "
                          f"got {fmt!r}")
    try:
        args = model_args(hf_config(g, seed=0, skew=0.0))
    except ColibriError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    if fmt == "mxfp4" and (args.hidden_size % 32 or args.moe_intermediate_size % 32):
        raise ConfigError(f"{name}: MXFP4 experts need hidden_size and intermediate_size divisible by 32")
    # What synth's recipe reads: the expert count, a rope dimension and theta.
    g["num_experts"] = args.num_experts
    g["head_dim"] = args.head_dim
    g["rope_theta"] = float(args.rope["rope_theta"])
    g["num_key_value_heads"] = args.num_kv_heads
    g["_eos"] = EOS_TOKEN_ID
    return g


def describe_presets() -> list[dict]:
    """One row per preset: name, materializable, description, source, total/active params."""
    rows = []
    for name in list_presets():
        g = load_preset(name)
        counts = param_counts({**_DEFAULTS, **g}) if g.get("materializable", True) else param_counts(g)
        rows.append({
            "name": name,
            "materializable": g.get("materializable", True) is not False,
            "description": g.get("description", ""),
            "source": g.get("source"),
            "total_params": counts["total"],
            "active_params": counts["active"],
        })
    return rows
