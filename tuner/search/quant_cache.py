"""What `tune --quant` reuses between runs: converted containers and quality figures.

A container lives in the model cache ($COLIBRI_CACHE/models, engine/run/resolve.py) under
`<source name>-<label>-<source fingerprint[:12]>`, and is reused when its config.json stamp
(engine/format/container.py) names the same source fingerprint, quant, group size and scope: the name
finds it, the stamp vouches for it, so a container converted elsewhere can be adopted by linking
it there. Conversion is engine/format/convert.py's: atomic (written under `<dir>.partial`) and
resumable (an interrupted one keeps its finished, checksummed shards).

A quality measurement (engine/run/quality.py) is cached as JSON in the run directory, keyed by both
models, their fingerprints and the text settings.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.api import (CONFIG_KEY, Checkpoint, ConfigError, Converter, DirectoryLock, ModelFormatError, QuantSpec,
                        atomic_write_text, cache_root, convert, fingerprint, measure_quality)
from tuner.results.printers import convert_progress, quality_progress
from tuner.search.model_facts import stored_quant

SCOPE = "experts"  # what a tune --quant level converts by default: the routed experts, the part that streams


def check_source(source: Path, levels) -> str:
    """The source's stored dtype ('bf16'); an error if it is a container or another dtype than
    the unquantized level names."""
    stored = stored_quant(Checkpoint(source))
    if stored.startswith("int"):
        raise ModelFormatError(f"{source} is already a quantized container ({stored}); tune --quant needs the "
                               f"unquantized source")
    for level in levels:
        if level.quant is None and level.dtype != stored:
            raise ConfigError(f"--quant {level.dtype}: the source {source.name} is stored as {stored} "
                              f"(name it {stored}; tune --quant does not re-cast the source)")
    return stored


def container_dir(source: Path, fingerprint: str, label: str) -> Path:
    return cache_root() / f"{source.name}-{label}-{fingerprint[:12]}"


def ensure_container(source: Path, level, log) -> tuple[Path, dict]:
    """(container directory, what happened): reused from the cache, or converted into it now."""
    import torch

    spec = QuantSpec(level.quant, level.group_size, level.scope)
    fingerprint = Converter(source, spec).fingerprint  # also checks the source converts (MoE, group fits)
    dst = container_dir(source, fingerprint, level.label)  # int8 and int8-all: two containers
    if _matches(dst, spec, fingerprint):
        log(f"{level.label}: reusing {dst}")
        return dst.resolve(), {"action": "reused", "path": str(dst)}
    with DirectoryLock(dst, f"converting {source.name} to {level.label}"):
        if _matches(dst, spec, fingerprint):  # another process converted it while we waited
            return dst.resolve(), {"action": "reused", "path": str(dst)}
        if dst.exists() or dst.is_symlink():
            raise ConfigError(f"{dst} exists but is not the {level.label} container of {source} (another "
                              f"source or options); remove it and run again")
        log(f"{level.label}: converting {source} into {dst} (once; an interrupted conversion resumes) ...")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # per-matrix work is small; on a shared box extra threads only spin
        try:
            summary = convert(source, dst, spec.quant, spec.group_size, spec.scope, progress=convert_progress())
        finally:
            torch.set_num_threads(threads)
    log(f"{level.label}: {summary['bytes'] / 2**20:.1f} MiB from {summary['source_bytes'] / 2**20:.1f} MiB, "
        f"{summary['shards']} shard(s) ({summary['shards_kept']} kept from an interrupted conversion)")
    return dst.resolve(), {"action": "converted", "path": str(dst), "shards": summary["shards"],
                           "shards_kept": summary["shards_kept"]}


def _matches(dst: Path, spec, fingerprint: str) -> bool:
    try:
        config = json.loads((dst / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get(CONFIG_KEY) == spec.config_entry(fingerprint)


def quality(model_dir: Path, reference_dir: Path, path: Path, *, tokens: int, ctx: int, text: str | None,
            log) -> dict:
    """measure_quality's result, from `path` when it was measured with the same inputs."""
    key = {"model": str(model_dir), "model_fingerprint": _fingerprint(model_dir),
           **_reference_key(reference_dir, tokens, ctx, text)}
    cached = _read_cached(path)
    if cached and cached["key"] == key:
        return cached["result"]
    log(f"quality: scoring {model_dir.name} against {reference_dir.name} ({tokens} tokens, ctx {ctx}) ...")
    result = measure_quality(model_dir, reference_dir, tokens=tokens, ctx=ctx, text_file=text,
                             progress=quality_progress())
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"key": key, "result": result}, indent=2) + "\n")
    return result


def cached_qualities(directory: Path, reference_dir: Path, tokens: int, ctx: int, text: str | None) -> list[dict]:
    """Every cached measurement in `directory` made against this reference with these settings."""
    want = _reference_key(reference_dir, tokens, ctx, text)
    found = [_read_cached(p) for p in sorted(Path(directory).glob("*.json"))]
    return [c["result"] for c in found if c and all(c["key"].get(k) == v for k, v in want.items())]


def _reference_key(reference_dir: Path, tokens: int, ctx: int, text: str | None) -> dict:
    return {"reference": str(reference_dir), "reference_fingerprint": _fingerprint(reference_dir), "tokens": tokens,
            "ctx": ctx, "text": str(Path(text).resolve()) if text else None}


def _read_cached(path: Path) -> dict | None:
    try:
        cached = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(cached, dict) and isinstance(cached.get("key"), dict) and isinstance(cached.get("result"), dict)
    return cached if ok else None


def _fingerprint(model_dir: Path) -> str:
    return fingerprint(Checkpoint(model_dir))
