"""Geometry presets: the bundled specs (engine/presets/*.json), user geometry files, their
validation, and parameter counts for any geometry (including the geometry-only specs of real
models, which are never materialized).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from engine.synth import arch_writers as synth_archs
from engine.base.dtypes import FLOAT_NAMES
# The tokenizer (engine/synth/bpe_tokenizer.py): 256 byte tokens, <|endoftext|> at 256, then BPE merges.
from engine.synth.bpe_tokenizer import EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB  # noqa: F401  (re-exported)
from engine.base.errors import ConfigError, ModelFormatError
from engine.base.jsonlimits import loads_limited
from engine.format.validate import validate_config

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
    if not path.is_file():
        raise ConfigError(f"geometry file {str(path)!r} not found")
    return _read_geometry_json(path)


def _read_geometry_json(path: Path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path.name}: cannot read: {exc.strerror or exc}") from None
    geom = loads_limited(raw, path.name, error=ConfigError)
    if not isinstance(geom, dict):
        raise ConfigError(f"{path.name}: expected a JSON object of geometry keys")
    geom.setdefault("name", path.stem)
    return geom


def validate_geometry(geometry: dict) -> dict:
    """Checks a geometry can be materialized; returns a copy with defaults filled in."""
    if not isinstance(geometry, dict):
        raise ConfigError("geometry must be a JSON object")
    name = geometry.get("name", "custom")
    if geometry.get("materializable") is False:
        src = geometry.get("source", "its published config")
        raise ConfigError(
            f"preset {name!r} is a geometry-only spec of a real model ({src}) for planning; "
            "it is never materialized — use 'tiny', 'demo' or --geometry FILE"
        )
    g = {**_DEFAULTS, **geometry}
    if g["model_type"] in synth_archs.ARCH_TYPES:
        return synth_archs.validate(geometry, _DEFAULTS)
    if g["model_type"] != "qwen3_moe":
        raise ConfigError(f"{name}: synth writes model_type qwen3_moe or "
                          f"{', '.join(synth_archs.ARCH_TYPES)}, not {g['model_type']!r}")
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


def param_counts(geometry: dict) -> dict:
    """Parameter counts by role, for qwen3_moe, mixtral, olmoe, deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss.

    Returns total, active (per token), routed_expert (one expert), routed_total, dense (everything
    that is not a routed expert: the part a streaming engine keeps resident), num_moe_layers,
    num_experts, top_k. Multi-token-prediction layers are not counted (inference skips them).
    """
    g = geometry
    mt = g.get("model_type")
    H, L, V = g["hidden_size"], g["num_hidden_layers"], g["vocab_size"]
    E = g.get("num_experts") or g.get("n_routed_experts") or g.get("num_local_experts")
    k = g["num_experts_per_tok"]
    if not E:
        raise ConfigError(f"{g.get('name', mt)}: geometry has no expert count")
    nh = g["num_attention_heads"]
    if mt in ("deepseek_v3", "glm_moe_dsa"):
        qk_head = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
        qr, kvr = g.get("q_lora_rank"), g["kv_lora_rank"]
        q = (H * qr + qr + qr * nh * qk_head) if qr else H * nh * qk_head
        kv = H * (kvr + g["qk_rope_head_dim"]) + kvr + kvr * nh * (g["qk_nope_head_dim"] + g["v_head_dim"])
        attn = q + kv + nh * g["v_head_dim"] * H
        if mt == "glm_moe_dsa":  # DSA lightning indexer
            ih, idim = g["index_n_heads"], g["index_head_dim"]
            attn += (qr or H) * ih * idim + H * idim + 2 * idim + H * ih
        moe_i = g["moe_intermediate_size"]
        dense_layers = g.get("first_k_dense_replace", 0)
        shared = g.get("n_shared_experts", 0) or 0
        router = E * H + E  # + e_score_correction_bias
    else:
        hd = g.get("head_dim") or H // nh
        nkv = g.get("num_key_value_heads", nh)
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
        if mt == "qwen3_moe" or (mt == "glm4_moe" and g.get("use_qk_norm")):
            attn += 2 * hd
        elif mt == "olmoe":
            attn += H + nkv * hd
        if mt == "gpt_oss" or (mt == "glm4_moe" and g.get("attention_bias")):
            attn += nh * hd + 2 * nkv * hd
        if mt == "gpt_oss":
            attn += H + nh  # o_proj bias, attention sinks
        moe_i = g["moe_intermediate_size"] if mt in ("qwen3_moe", "glm4_moe") else g["intermediate_size"]
        dense_layers, shared, router = 0, 0, E * H
        if mt == "glm4_moe":
            dense_layers, shared, router = g.get("first_k_dense_replace", 1), g.get("n_shared_experts", 1), E * H + E
        elif mt == "gpt_oss":
            router = E * H + E
    expert = 3 * H * moe_i + (2 * moe_i + H if mt == "gpt_oss" else 0)  # gpt_oss experts carry biases
    moe_layers = L - dense_layers
    norms = 2 * H
    dense_mlp = 3 * H * g.get("intermediate_size", 0)
    embed = V * H * (1 if g.get("tie_word_embeddings") else 2)
    resident = (embed + H + L * (attn + norms) + dense_layers * dense_mlp
                + moe_layers * (router + shared * expert))
    routed_total = moe_layers * E * expert
    return {
        "total": resident + routed_total,
        "active": resident + moe_layers * k * expert,
        "routed_expert": expert,
        "routed_total": routed_total,
        "dense": resident,
        "num_moe_layers": moe_layers,
        "num_experts": E,
        "top_k": k,
    }


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
