"""Geometry presets: the bundled specs (engine/presets/*.json), user geometry files, their
validation, and parameter counts for any geometry (including the geometry-only specs of real
models, which are never materialized).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from engine.dtypes import FLOAT_NAMES
from engine.errors import ConfigError

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

# Byte-level tokenizer: 256 byte tokens, then <|endoftext|>, then filler up to vocab_size.
EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 256
MIN_VOCAB = 257


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
        geom = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path.name}: not valid JSON ({exc})") from None
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
    if g["model_type"] != "qwen3_moe":
        raise ConfigError(f"{name}: synth writes only model_type 'qwen3_moe', not {g['model_type']!r}")
    for key in _REQUIRED_INT:
        v = g.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name}: '{key}' must be a positive integer, got {v!r}")
    if g["intermediate_size"] is None:
        g["intermediate_size"] = g["moe_intermediate_size"]
    if g["num_attention_heads"] % g["num_key_value_heads"]:
        raise ConfigError(f"{name}: num_attention_heads must be a multiple of num_key_value_heads")
    if g["head_dim"] % 2:
        raise ConfigError(f"{name}: head_dim must be even (RoPE rotates pairs)")
    if g["num_experts_per_tok"] > g["num_experts"]:
        raise ConfigError(f"{name}: num_experts_per_tok exceeds num_experts")
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
    """Parameter counts by role, for qwen3_moe, mixtral, olmoe, deepseek_v3 and glm_moe_dsa geometries.

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
        if mt == "qwen3_moe":
            attn += 2 * hd
        elif mt == "olmoe":
            attn += H + nkv * hd
        moe_i = g["moe_intermediate_size"] if mt == "qwen3_moe" else g["intermediate_size"]
        dense_layers, shared, router = 0, 0, E * H
    expert = 3 * H * moe_i
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
