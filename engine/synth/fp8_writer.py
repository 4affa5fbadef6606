"""Write a bf16/fp32 Hugging Face checkpoint in the layout the published FP8 checkpoints use
(DeepSeek-V3/R1, Kimi-K2, GLM/Qwen3 FP8): for tests and benchmarks, which need FP8 files of
models they build (no FP8 release is small enough to download into a test).

Quantized, as the releases do: every linear projection (attention, dense MLP, shared and routed
experts, MLA's low-rank projections, the DSA indexer's query/key, MTP's eh_proj) as F8_E4M3 with
`<name>.weight_scale_inv` F32 per [bn, bk] block (engine/weights/fp8.py: amax / 448 per block);
embeddings, norms, routers and lm_head stay bf16. Fused 3-D experts are split per expert, as the
releases store them. Shards are written with safetensors' own `save_file`, so the order inside a
shard (by dtype, then name) is the one the published files have. One source shard at a time.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.weights.fp8 import dequantize, quantize

QUANTIZED = re.compile(r"(_proj(_with_mqa)?|\.indexer\.(wq_b|wk))\.weight$")
_FUSED = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def fp8_items(name: str, t: torch.Tensor, block) -> tuple[dict, torch.Tensor]:
    """(the tensors stored for source tensor `name`, the values they stand for, in src's shape)."""
    fused = _FUSED.search(name)
    if fused and t.dim() == 3:
        base, out, values = name[: -len(fused.group(1)) - 1], {}, []
        parts = ("gate_proj", "up_proj") if fused.group(1) == "gate_up_proj" else ("down_proj",)
        for e in range(t.shape[0]):
            back = []
            for part, w in zip(parts, t[e].chunk(len(parts))):
                q, s = quantize(w, block)
                out[f"{base}.{e}.{part}.weight"], out[f"{base}.{e}.{part}.weight_scale_inv"] = q, s
                back.append(dequantize(q, s, block))
            values.append(torch.cat(back))
        return out, torch.stack(values)
    if QUANTIZED.search(name) and t.dim() == 2:
        q, s = quantize(t, block)
        return {name: q, name + "_scale_inv": s}, dequantize(q, s, block)
    kept = t.to(torch.bfloat16) if t.is_floating_point() else t
    return {name: kept}, kept.float() if t.is_floating_point() else t


def _source_files(src: Path) -> list[Path]:
    index = src / "model.safetensors.index.json"
    if index.exists():
        return [src / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [src / "model.safetensors"]


def write_fp8_checkpoint(src, dst, block=(128, 128), shards: int | None = None, extra: dict | None = None,
                         config_overrides: dict | None = None, values_dir=None, progress=None) -> None:
    """Write `dst` from `src`, one output shard per source shard (or, with `shards`, the tensors
    regrouped by layer into that many files, as the releases are cut: all of src in memory, for
    tiny models). `extra`: more tensors (e.g. MTP layers), quantized by the same rule, written to
    the last shard. `values_dir`: also write src's tensors as the values the FP8 file stands for
    (fp32, src's names: a transformers oracle loads them; tiny models only)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = _source_files(src)
    values: dict[str, torch.Tensor] = {}
    if shards is None:
        plan = [(f.name, lambda f=f: load_file(f)) for f in files]
    else:
        everything = {n: t for f in files for n, t in load_file(f).items()}
        groups: dict[int, list[str]] = {}
        for n in sorted(everything):
            layer = _LAYER.match(n)
            groups.setdefault(int(layer.group(1)) % shards if layer else 0, []).append(n)
        plan = [(f"model-{i + 1:05d}-of-{shards:05d}.safetensors",
                 lambda names=names: {n: everything[n] for n in names}) for i, names in sorted(groups.items())]
    weight_map = {}
    for i, (file, load) in enumerate(plan):
        tensors = load()
        if i == len(plan) - 1:
            tensors.update(extra or {})
        out = {}
        for name, t in tensors.items():
            stored, value = fp8_items(name, t, block)
            out.update(stored)
            if values_dir is not None and name not in (extra or {}):
                values[name] = value
        save_file({n: t.contiguous() for n, t in out.items()}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in out})
        if progress:
            progress(i + 1, len(plan))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    config.pop("colibri_quant", None)
    config.update(config_overrides or {})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, dst / f.name)
    if values_dir is not None:
        values_dir = Path(values_dir)
        values_dir.mkdir(parents=True, exist_ok=True)
        save_file({n: v.contiguous() for n, v in values.items()}, str(values_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copyfile(src / "config.json", values_dir / "config.json")
