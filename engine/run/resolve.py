"""Resolve `--model`: a Hugging Face directory, or the name of a synth preset (synthesized once).

A preset is synthesized once into the cache directory ($COLIBRI_CACHE, default
~/.cache/colibri/models) and reused; synthesis is deterministic, so the cache is only a cache.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine import synth
from engine.base.durable import DirectoryLock
from engine.base.errors import ModelFormatError


def cache_root() -> Path:
    return Path(os.environ.get("COLIBRI_CACHE") or Path.home() / ".cache" / "colibri") / "models"


def kv_root() -> Path:
    """Where serve and chat keep KV blocks on the SSD by default (engine/run/kv_store.py): beside
    the model cache, one subdirectory per model fingerprint."""
    return cache_root().parent / "kv"


def resolve_model(spec: str, seed: int = 0, progress: bool = True) -> Path:
    path = Path(spec)
    if path.exists() or os.sep in spec or spec.startswith("."):
        if not path.is_dir():
            raise ModelFormatError(f"model directory {spec!r} does not exist")
        return path
    if spec not in synth.list_presets():
        raise ModelFormatError(f"model {spec!r} is neither a directory nor a preset "
                               f"(presets: {', '.join(synth.list_presets())})")
    target = cache_root() / f"{spec}-seed{seed}"
    if (target / "config.json").exists():
        return target
    # Several processes (workers of one shared study) may want the same preset: the first
    # synthesizes it, the others wait and then reuse it instead of writing it again.
    with DirectoryLock(target, f"synthesizing preset {spec}"):
        if not (target / "config.json").exists():
            synth.synthesize(synth.load_preset(spec), target, seed=seed, progress=progress)
    return target
