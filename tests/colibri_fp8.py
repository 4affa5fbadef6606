"""Test/benchmark-side FP8 writer: a bf16/fp32 Hugging Face checkpoint → the layout the published
FP8 checkpoints use (DeepSeek-V3/R1, Kimi-K2, GLM/Qwen3 FP8), and the transformers oracle on the
very weights that layout stores.

Quantized, as the releases do: every linear projection (attention, dense MLP, shared and routed
experts, MLA's low-rank projections, the DSA indexer's query/key, MTP's eh_proj) as F8_E4M3 with
`<name>.weight_scale_inv` F32 per [bn, bk] block; embeddings, norms, routers and lm_head stay as
they are. Shards are written with safetensors' own `save_file`, so the order inside a shard (by
dtype, then name) is the one the published files have.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.format.fp8 import dequantize, quantize

QUANTIZED = re.compile(r"(_proj(_with_mqa)?|\.indexer\.(wq_b|wk))\.weight$")


def fp8_names(tensors: dict) -> list[str]:
    return [n for n, t in tensors.items() if QUANTIZED.search(n) and t.dim() == 2]


def _fp8_items(name: str, t: torch.Tensor, block):
    """(stored tensors, the dequantized source tensor) of one source tensor. Fused 3-D experts
    (gate_up_proj [E, 2I, H], down_proj [E, H, I]) are split per expert as the FP8 releases store them."""
    fused = re.search(r"\.experts\.(gate_up_proj|down_proj)$", name)
    if fused and t.dim() == 3:
        base, out, dq = name[: -len(fused.group(1)) - 1], {}, []
        for e in range(t.shape[0]):
            parts = (("gate_proj", "up_proj") if fused.group(1) == "gate_up_proj" else ("down_proj",))
            rows = t[e].chunk(len(parts))
            back = []
            for part, w in zip(parts, rows):
                q, s = quantize(w, block)
                out[f"{base}.{e}.{part}.weight"], out[f"{base}.{e}.{part}.weight_scale_inv"] = q, s
                back.append(dequantize(q, s, block))
            dq.append(torch.cat(back))
        return out, torch.stack(dq)
    if QUANTIZED.search(name) and t.dim() == 2:
        q, s = quantize(t, block)
        return {name: q, name + "_scale_inv": s}, dequantize(q, s, block)
    kept = t.to(torch.bfloat16) if t.is_floating_point() else t
    return {name: kept}, kept.float() if t.is_floating_point() else t


def write_fp8_checkpoint(src: Path, dst: Path, block=(16, 16), shards: int = 3, extra: dict | None = None,
                         config_overrides: dict | None = None, oracle_dir: Path | None = None) -> None:
    """Write `dst` from `src`. `extra`: more tensors (e.g. MTP layers), quantized by the same rule.
    `oracle_dir`: also write src's tensors as the FP8 file's values (fp32, src's names), for
    transformers to load as the oracle of the FP8 run."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out: dict[str, torch.Tensor] = {}
    values: dict[str, torch.Tensor] = {}
    for name, t in list(tensors.items()) + list((extra or {}).items()):
        stored, values[name] = _fp8_items(name, t, block)
        out.update(stored)
    # Shards by layer, as the releases are cut: a layer (its experts with their scales) in one file.
    by_shard: dict[int, list[str]] = {}
    for n in sorted(out):
        layer = re.match(r"model\.layers\.(\d+)\.", n)
        by_shard.setdefault(int(layer.group(1)) % shards if layer else 0, []).append(n)
    weight_map = {}
    for i, part in sorted(by_shard.items()):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: out[n].contiguous() for n in part}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": list(block)}
    config["torch_dtype"] = "bfloat16"
    config.pop("dtype", None)
    config.update(config_overrides or {})
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, dst / f.name)
    if oracle_dir is not None:
        oracle_dir = Path(oracle_dir)
        oracle_dir.mkdir(parents=True, exist_ok=True)
        save_file({n: values[n].contiguous() for n in tensors}, str(oracle_dir / "model.safetensors"),
                  metadata={"format": "pt"})
        shutil.copyfile(src / "config.json", oracle_dir / "config.json")


def oracle_model(oracle_dir: Path):
    """transformers' model on the FP8 file's values (fp32)."""
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(oracle_dir, dtype=torch.float32, attn_implementation="eager").eval()
