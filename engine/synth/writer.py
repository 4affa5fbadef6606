"""Writing a synthetic model: shards planned from the tensor plan, written tensor by tensor
(memory bounded by the largest tensor) into a temporary sibling directory that is renamed into
place only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from engine.arch.architecture import PlannedTensor
from engine.arch.registry import architecture, model_args
from engine.base.progress import Progress
from engine.format.container import CONFIG_KEY
from engine.base.dtypes import ITEMSIZE
from engine.base.durable import DirectoryLock, fsync_dir
from engine.base.errors import ConfigError
from engine.base.output_target import DirectoryTarget, directory_target, replace_directory, stamped
from engine.synth.geometry import validate_geometry
from engine.format.safetensors_writer import ShardWriter, TensorSpec, read_header, write_json_atomic
from engine.synth.hf_files import hf_config, write_side_files
from engine.synth.recipe import Recipe


_SYNTH_KEY = stamped("config.json", "colibri_synth")  # what hf_files.py writes into every synthesized model
_CONTAINER_KEY = stamped("config.json", CONFIG_KEY)  # a container of one keeps the key: convert's, not ours


def SYNTH_STAMP(path: Path) -> bool:
    """A previous synth output: config.json stamped by synth and not (since) a convert container."""
    return _SYNTH_KEY(path) and not _CONTAINER_KEY(path)


def tensor_plan(g: dict) -> list[list[PlannedTensor]]:
    """A validated geometry's tensors in file order, in units that stay together in one shard
    (an expert's matrices: the streaming engine reads an expert with one request): its
    architecture's synth plan (engine/arch/families/)."""
    return architecture(g["model_type"]).synth.plan(g, model_args(hf_config(g, 0, 0.0)))


def plan_shards(units: list[list[PlannedTensor]], dtype: str, max_shard_size: int) -> list[list[PlannedTensor]]:
    """Greedy packing of units into shards of at most max_shard_size data bytes (a bigger unit gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for unit in units:
        ub = sum(math.prod(t.shape) * ITEMSIZE[t.dtype or dtype] for t in unit)
        if shards[-1] and size + ub > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += ub
    return shards


def model_bytes(geometry: dict) -> int:
    """Bytes of tensor data a synthesized model of this geometry holds (headers excluded)."""
    g = validate_geometry(geometry)
    return sum(math.prod(t.shape) * ITEMSIZE[t.dtype or g["dtype"]] for unit in tensor_plan(g) for t in unit)


# --- synthesis --------------------------------------------------------------------------------

def synthesize(
    geometry: dict,
    out_dir: str | os.PathLike,
    seed: int = 0,
    routing_skew: float | None = None,
    progress: bool = True,
    force: bool = False,
    sources: tuple = (),
) -> Path:
    """Write a qwen3_moe HF directory for `geometry` to out_dir, atomically; returns its path.

    routing_skew None takes the geometry's own default (the presets' calibrated value).
    out_dir is checked by engine/base/output_target.py first: never the current directory, `/`, one of
    `sources` (e.g. the geometry file) or a directory around them; a non-empty out_dir is replaced
    (with force, and only once the new model is complete) only when it is a previous synth
    output, recognised by the `colibri_synth` stamp of its config.json. A second process synthesizing into the same out_dir waits for the first
    (engine/base/durable.py DirectoryLock) and then finds the directory non-empty.
    """
    name = geometry.get("name", "custom") if isinstance(geometry, dict) else "custom"
    target = directory_target(out_dir, command="synth", recognise=SYNTH_STAMP, sources=sources, force=force)
    with DirectoryLock(target.path, f"synthesizing {name}"):
        return _synthesize(geometry, target, seed, routing_skew, progress, force, sources)


def _synthesize(geometry: dict, target: DirectoryTarget, seed: int, routing_skew: float | None, progress: bool,
                force: bool, sources: tuple) -> Path:
    g = validate_geometry(geometry)
    skew = g["routing_skew"] if routing_skew is None else routing_skew
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not math.isfinite(skew) or skew < 0:
        raise ConfigError(f"routing skew must be a non-negative number, got {skew!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed!r}")
    skew = float(skew)

    # Checked again under the lock: a process we waited for may have filled it meanwhile.
    target = directory_target(target.path, command="synth", recognise=SYNTH_STAMP, sources=sources, force=force)
    out = target.path
    out.parent.mkdir(parents=True, exist_ok=True)

    units = tensor_plan(g)
    shards = plan_shards(units, g["dtype"], g["max_shard_size"])
    total = sum(TensorSpec(t.name, t.shape, t.dtype or g["dtype"]).nbytes for s in shards for t in s)
    free = shutil.disk_usage(out.parent).free
    if free < total + (16 << 20):
        raise ConfigError(
            f"not enough free space in {str(out.parent)!r}: need {total / 2**30:.2f} GiB, have {free / 2**30:.2f} GiB"
        )

    # We hold out's lock, so a sibling left by an earlier writer is debris of one that died
    # (kill -9, power loss), not work in progress: remove it before it fills the disk.
    # Only names this module makes (<out>.partial-<pid>, <out>.old-<pid>), never a user's look-alike.
    for stale in [*out.parent.glob(f"{out.name}.partial-*"), *out.parent.glob(f"{out.name}.old-*")]:
        if stale.name.rsplit("-", 1)[-1].isdigit() and stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
    tmp = target.sibling(f"partial-{os.getpid()}")
    tmp.mkdir()
    import torch
    threads = torch.get_num_threads()
    # Element-wise ops on a few MB gain nothing from OpenMP and lose badly to its spin-waits when
    # the cores are busy (60x slower measured on a loaded 2-core box); randn is serial anyway.
    torch.set_num_threads(1)
    try:
        recipe = Recipe(g, seed, skew)
        n = len(shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map: dict[str, str] = {}
        with Progress(total=total, unit="B", unit_scale=True, desc=f"synth {g.get('name', 'custom')}",
                      enabled=progress) as bar:
            for fname, shard in zip(names, shards):
                specs = [TensorSpec(t.name, t.shape, t.dtype or g["dtype"]) for t in shard]
                with ShardWriter(tmp / fname, specs) as w:
                    for t in shard:
                        bar.update(w.write(t.name, recipe.values(t)))
                        weight_map[t.name] = fname
        if n > 1:
            write_json_atomic(tmp / "model.safetensors.index.json", {
                "metadata": {"total_size": total,
                             "total_parameters": sum(math.prod(t.shape) for s in shards for t in s)},
                "weight_map": dict(sorted(weight_map.items())),
            })
        write_side_files(tmp, g, seed, skew)
        fsync_dir(tmp)
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return out


def summarize(model_dir: str | os.PathLike) -> dict:
    """What a synthesized directory holds: path, bytes of shards, shard and tensor counts, seed, skew."""
    d = Path(model_dir)
    shards = sorted(d.glob("*.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    meta = cfg.get("colibri_synth", {})
    index = d / "model.safetensors.index.json"
    tensors = len(json.loads(index.read_text())["weight_map"]) if index.exists() else None
    if tensors is None:
        tensors = len(read_header(shards[0])) if shards else 0
    return {
        "path": str(d),
        "bytes": sum(p.stat().st_size for p in shards),
        "shards": len(shards),
        "tensors": tensors,
        "seed": meta.get("seed"),
        "routing_skew": meta.get("routing_skew"),
        "preset": meta.get("preset"),
    }
