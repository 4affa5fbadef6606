"""gpt-oss GGUF experts → the fused per-layer experts the engine reads (engine/arch/gpt_oss_layers.py).

llama.cpp's converter (conversion/gpt_oss.py) splits HF's fused experts: `gate_up_proj`
[E, H, 2I] (gate at even output columns, up at odd) becomes `ffn_gate_exps` / `ffn_up_exps`
[E, I, H], `down_proj` [E, I, H] becomes `ffn_down_exps` [E, H, I] (transposed: x @ W → W @ x),
and each bias likewise (`ffn_*_exps.bias`, F32). Published gpt-oss checkpoints hold MXFP4
experts, which the converter keeps as ggml MXFP4 blocks (1 byte e8m0 exponent + 16 bytes of
FP4 e2m1 codes per 32 values, value j in the low nibble of byte j and value j+16 in its high
nibble) instead of HF's `*_blocks` (value 2b in the low nibble of byte b, 2b+1 in the high) and
`*_scales` (the same exponent byte).

Two ways back:
- every routed expert weight of the file is MXFP4 (a published gpt-oss GGUF, or llama-quantize
  MXFP4_MOE): written as HF's MXFP4 storage, byte for byte what the published checkpoint holds
  (codes re-nibbled, gate/up rows re-interleaved), so the engine streams and computes them at
  4.25 bits/weight with its fused kernel;
- otherwise the experts are dequantized and written plain in bf16 (gate_up_proj [E, H, 2I],
  down_proj [E, I, H]).
One Item per layer, each fused tensor written one expert at a time (ShardWriter.write_rows), so
an import never holds a layer's experts in float32.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from engine.base.errors import ModelFormatError
from engine.format.gguf.dequant import dequantize
from engine.format.gguf.items import Item, OutTensor
from engine.format.gguf.reader import GGUFModel, GGUFTensor

PARTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
MX_BLOCK = 32
MX_BLOCK_BYTES = 17  # ggml block_mxfp4: e8m0 exponent + 16 bytes of codes
MXFP4_QUANT_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def stores_mxfp4(m: GGUFModel) -> bool:
    """Whether every routed expert weight is ggml MXFP4 (then written as HF's MXFP4 storage)."""
    weights = [t for n, t in m.tensors.items() if n.endswith(tuple(f".{p}.weight" for p in PARTS))]
    return bool(weights) and all(t.ggml_type == T.MXFP4 for t in weights)


def ggml_mxfp4_to_hf(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ggml MXFP4 rows [N, G*17] uint8 → HF (blocks [N, G, 16], scales [N, G]) uint8."""
    blocks = torch.from_numpy(np.array(raw)).reshape(raw.shape[0], -1, MX_BLOCK_BYTES)  # a copy: the map is read-only
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # [N, G, 32]: values 0..15, then 16..31
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[I, ...] and [I, ...] → [2I, ...] with gate's row i at 2i and up's at 2i+1 (HF's gate_up)."""
    return torch.stack([gate, up], dim=1).reshape(2 * gate.shape[0], *gate.shape[1:])


def experts(m: GGUFModel, args, config: dict, layer: int, used: set) -> list[Item]:
    """The layer's fused experts as one Item (gguf_names.FUSED_EXPERTS' gpt-oss entry; args: its ModelArgs)."""
    pre = f"blk.{layer}."
    weights = [m.tensors.get(f"{pre}{p}.weight") for p in PARTS]
    biases = [m.tensors.get(f"{pre}{p}.bias") for p in PARTS]
    if not any(weights):
        return []
    if not all(weights) or not all(biases):
        raise ModelFormatError(f"{m.paths[0]}: layer {layer} has only some of gpt-oss's expert weights and biases")
    gate, up, down = weights
    E, H, I = down.shape[0], down.shape[1], down.shape[2]
    for t, want in zip((*weights, *biases), ((E, I, H), (E, I, H), (E, H, I), (E, I), (E, I), (E, H))):
        if tuple(t.shape) != want:
            raise ModelFormatError(f"{m.paths[0]}: {t.name} has shape {t.shape}, expected {want} from {down.name}")
    used.update(t.name for t in (*weights, *biases))
    base = f"model.layers.{layer}.mlp.experts"
    gate_b, up_b, down_b = biases

    def gate_up_bias() -> torch.Tensor:
        return _interleave_rows(dequantize(gate_b).t(), dequantize(up_b).t()).t().contiguous()  # [E, 2I]

    bias_tensors = [OutTensor(f"{base}.gate_up_proj_bias", (E, 2 * I), gate_up_bias),
                    OutTensor(f"{base}.down_proj_bias", (E, H), lambda: dequantize(down_b))]
    if "quantization_config" in config:  # MXFP4 as stored
        tensors = _mxfp4_tensors(base, gate, up, down, E, H, I)
    else:
        tensors = _plain_tensors(base, gate, up, down, E, H, I)
    # The engine reads expert e as a slice of each; order: gate_up weights, its bias, down, its bias.
    n = len(tensors) // 2
    ordered = [*tensors[:n], bias_tensors[0], *tensors[n:], bias_tensors[1]]
    return [Item(f"layer {layer} experts", layer, ordered)]


def _plain_tensors(base: str, gate: GGUFTensor, up: GGUFTensor, down: GGUFTensor, E: int, H: int, I: int):
    def gate_up():
        for e in range(E):  # [1, H, 2I]: stored as x @ W
            yield _interleave_rows(dequantize(gate, e), dequantize(up, e)).t().unsqueeze(0)

    def down_proj():
        for e in range(E):  # [1, I, H]
            yield dequantize(down, e).t().unsqueeze(0)
    return [OutTensor(f"{base}.gate_up_proj", (E, H, 2 * I), None, chunks=gate_up),
            OutTensor(f"{base}.down_proj", (E, I, H), None, chunks=down_proj)]


def _mxfp4_tensors(base: str, gate: GGUFTensor, up: GGUFTensor, down: GGUFTensor, E: int, H: int, I: int):
    for t, cols in ((gate, H), (up, H), (down, I)):
        if cols % MX_BLOCK:
            raise ModelFormatError(f"{t.path}: {t.name} rows of {cols} are not whole MXFP4 blocks")

    def gate_up(k: int):  # k 0: blocks, 1: scales
        for e in range(E):
            g, u = ggml_mxfp4_to_hf(gate.data[e]), ggml_mxfp4_to_hf(up.data[e])
            yield _interleave_rows(g[k], u[k]).unsqueeze(0)

    def down_part(k: int):
        for e in range(E):
            yield ggml_mxfp4_to_hf(down.data[e])[k].unsqueeze(0)
    G, Gd = H // MX_BLOCK, I // MX_BLOCK
    return [OutTensor(f"{base}.gate_up_proj_blocks", (E, 2 * I, G, 16), None, "uint8", lambda: gate_up(0)),
            OutTensor(f"{base}.gate_up_proj_scales", (E, 2 * I, G), None, "uint8", lambda: gate_up(1)),
            OutTensor(f"{base}.down_proj_blocks", (E, H, Gd, 16), None, "uint8", lambda: down_part(0)),
            OutTensor(f"{base}.down_proj_scales", (E, H, Gd), None, "uint8", lambda: down_part(1))]
