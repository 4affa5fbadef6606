"""The sparse full-scale checkpoints fullscale.py measures: DeepSeek-V3 671B and GLM-5 744B with
their published tensor names, shapes, dtypes and shard layout (real safetensors headers and a real
model.safetensors.index.json), every tensor's bytes a hole (a helper of fullscale.py, not a
command; `fullscale.py build` runs `build`).

What is written, per model (geometry from engine/presets/<name>.json):
  * deepseek-v3: as deepseek-ai/DeepSeek-V3 publishes it. `--dtype fp8`: every linear weight
    F8_E4M3 with an F32 `weight_scale_inv` of 128x128 blocks ([ceil(out/128), ceil(in/128)]),
    embeddings, norms, router and lm_head BF16, e_score_correction_bias F32,
    quantization_config {quant_method fp8, fmt e4m3, weight_block_size [128, 128], dynamic
    activations}; the multi-token-prediction layer 61 (a full MoE layer plus enorm, hnorm,
    eh_proj, shared_head, embed_tokens); 163 shards. `--dtype bf16`: the same geometry, names
    and layer 61 in bf16 (what the engine opens before the FP8 reader lands).
  * glm-5: glm_moe_dsa (MLA + the DSA indexer on its layers), MTP layer 78, bf16 by default.
  * `--dtype int4`: our own int4-g128 container (`colibri convert --scope all`, docs/FORMAT.md)
    of the same geometry, stamped: the one form whose dense part (~11 GiB) fits a 16 GiB budget,
    so a decode step on holes can run at full scale.
Within a shard, tensors are ordered as the safetensors library writes them (dtype, then name);
one expert's tensors never straddle two shards.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

from engine.api import CONFIG_KEY, synth
from engine.api.lab import FORMAT_NAME, FORMAT_VERSION

BLOCK = 128  # FP8 weight_block_size of the published checkpoints
# The safetensors library writes a shard's tensors sorted by dtype (its enum, larger first), then name.
DTYPE_RANK = {"F32": 0, "BF16": 1, "F8_E4M3": 2, "U8": 3}
ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}
INT4_GROUP = 128
MODELS = {"deepseek-v3": {"shards": 163, "dtype": "fp8"}, "glm-5": {"shards": 282, "dtype": "bf16"}}
PRESET_ONLY = ("name", "description", "materializable", "source", "published_total_params", "published_active_params")
# No real source: the sha256 of the builder's name, a well-formed stamp that says where it came from.
FINGERPRINT = hashlib.sha256(b"sparse-fullscale-builder").hexdigest()
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


# --- the tensor plan ---------------------------------------------------------------------------

def _linear(name: str, out: int, inp: int, fmt: str) -> list[tuple[str, str, tuple]]:
    """One linear layer's weight: BF16; F8_E4M3 with its F32 block scales; or our int4-g128
    container's codes and scales (docs/FORMAT.md), where `colibri convert --scope all` would
    quantize it (a `_proj.weight`)."""
    if fmt == "fp8":
        return [(name, "F8_E4M3", (out, inp)),
                (name + "_scale_inv", "F32", (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)))]
    if fmt == "int4" and name.endswith("_proj.weight"):
        base = name.removesuffix(".weight")
        return [(f"{base}.qweight", "U8", (out, inp // 2)), (f"{base}.qscale", "BF16", (inp // INT4_GROUP, out, 2))]
    return [(name, "BF16", (out, inp))]


def _attention(cfg: dict, p: str, indexer: bool, fmt: str) -> list:
    H, N = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = f"{p}.self_attn"
    t = [*_linear(f"{a}.q_a_proj.weight", q_rank, H, fmt), (f"{a}.q_a_layernorm.weight", "BF16", (q_rank,)),
         *_linear(f"{a}.q_b_proj.weight", N * (nope + rope), q_rank, fmt),
         *_linear(f"{a}.kv_a_proj_with_mqa.weight", kv_rank + rope, H, fmt),
         (f"{a}.kv_a_layernorm.weight", "BF16", (kv_rank,)),
         *_linear(f"{a}.kv_b_proj.weight", N * (nope + v), kv_rank, fmt),
         *_linear(f"{a}.o_proj.weight", H, N * v, fmt)]
    if indexer:  # GLM-5's DSA indexer (engine/arch/mla.py names it as transformers does)
        i, heads, dim = f"{a}.indexer", cfg["index_n_heads"], cfg["index_head_dim"]
        t += [*_linear(f"{i}.wq_b.weight", heads * dim, q_rank, fmt), *_linear(f"{i}.wk.weight", dim, H, fmt),
              (f"{i}.k_norm.weight", "BF16", (dim,)), (f"{i}.k_norm.bias", "BF16", (dim,)),
              *_linear(f"{i}.weights_proj.weight", heads, H, "int4" if fmt == "int4" else "bf16")]
    return t


def _mlp(p: str, inter: int, H: int, fmt: str) -> list:
    return [*_linear(f"{p}.gate_proj.weight", inter, H, fmt), *_linear(f"{p}.up_proj.weight", inter, H, fmt),
            *_linear(f"{p}.down_proj.weight", H, inter, fmt)]


def tensor_groups(cfg: dict, fmt: str, indexer_layers: set[int]) -> list[list[tuple[str, str, tuple]]]:
    """Every tensor of the checkpoint, in groups that stay in one shard (a layer's dense tensors,
    one expert), in the order the published files go: embeddings, layers 0..L-1, the MTP
    layers, the final norm and lm_head."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    E, MI = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    mtp = cfg.get("num_nextn_predict_layers", 0)
    groups = [[("model.embed_tokens.weight", "BF16", (V, H))]]
    for i in range(L + mtp):
        p = f"model.layers.{i}"
        dense = [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,)),
                 *_attention(cfg, p, i in indexer_layers, fmt)]
        if i < cfg["first_k_dense_replace"]:
            groups.append(dense + _mlp(f"{p}.mlp", cfg["intermediate_size"], H, fmt))
            continue
        dense += [(f"{p}.mlp.gate.weight", "BF16", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,)),
                  *_mlp(f"{p}.mlp.shared_experts", MI * cfg["n_shared_experts"], H, fmt)]
        if i >= L:  # multi-token prediction: its own embedding, norms, projection and head
            dense += [(f"{p}.enorm.weight", "BF16", (H,)), (f"{p}.hnorm.weight", "BF16", (H,)),
                      (f"{p}.eh_proj.weight", "BF16", (H, 2 * H)), (f"{p}.shared_head.norm.weight", "BF16", (H,)),
                      (f"{p}.shared_head.head.weight", "BF16", (V, H)), (f"{p}.embed_tokens.weight", "BF16", (V, H))]
        groups.append(dense)
        groups += [_mlp(f"{p}.mlp.experts.{e}", MI, H, fmt) for e in range(E)]
    head = _linear("lm_head.weight", V, H, "bf16")
    if fmt == "int4":  # `--scope all` quantizes the output head too (engine/format/convert.quantizable)
        head = [("lm_head.qweight", "U8", (V, H // 2)), ("lm_head.qscale", "BF16", (H // INT4_GROUP, V, 2))]
    groups.append([("model.norm.weight", "BF16", (H,)), *head])
    return groups


def _nbytes(t) -> int:
    return math.prod(t[2]) * ITEMSIZE[t[1]]


def hf_config(name: str, fmt: str, layers: int | None = None) -> dict:
    """layers: keep only the first N decoder layers (the same widths, experts and shard size), so a
    memory question about the full model can be asked of a few layers and scaled by the layer count."""
    cfg = {k: v for k, v in synth.load_preset(name).items() if k not in PRESET_ONLY}
    if layers is not None:
        if not cfg["first_k_dense_replace"] < layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in ({cfg['first_k_dense_replace']}, {cfg['num_hidden_layers']}]")
        cfg["num_hidden_layers"] = layers
    if fmt == "fp8":
        cfg["quantization_config"] = dict(FP8_CONFIG)
    if fmt == "int4":
        cfg[CONFIG_KEY] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "quant": "int4",
                           "group_size": INT4_GROUP, "scope": "all", "source_fingerprint": FINGERPRINT}
    return cfg


def indexer_layers_of(cfg: dict) -> set[int]:
    """Layers whose attention runs the DSA indexer, as the engine's parser decides them."""
    from engine.api import model_args
    mla = model_args(cfg).attention_impl
    indexer = getattr(mla, "indexer", None)
    return set(indexer.full_layers) if indexer is not None else set()


# --- writing ---------------------------------------------------------------------------------

# The few bytes written for real, so that a decode step on holes runs (the engine refuses zero
# scales as corrupt, and all-equal router scores would route to whichever experts ties pick):
#   * every scale the decode step reads: FP8 scale_inv 1.0; int4 (scale 2^-10, zero 8 * 2^-10),
#     so a hole's codes (0) dequantize to exactly 0 (engine/weights/quantized.py: (code - 8) * s + z);
#   * e_score_correction_bias = -e * 2^-10: the router's scores all tie at sigmoid(0) on holes,
#     the bias then picks experts 0..K-1 in every layer, so only their scales need writing
#     (K = num_experts_per_tok; ~0.6 GiB of int4 scales for DeepSeek-V3 instead of 20 GiB).
SCALE_FILL = {"F32": struct.pack("<f", 1.0), "BF16": struct.pack("<HH", 0x3A80, 0x3C00)}  # bf16 2^-10, 2^-7
BIAS_STEP = 2.0 ** -10


def _real_bytes(name: str, tag: str, shape: tuple, routed_k: int) -> bytes | None:
    """The bytes a tensor gets instead of a hole (see SCALE_FILL), or None for a hole."""
    if name.endswith("e_score_correction_bias"):
        return struct.pack(f"<{shape[0]}f", *(-e * BIAS_STEP for e in range(shape[0])))
    if not name.endswith(("_scale_inv", ".qscale")):
        return None
    if ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= routed_k:
        return None  # an expert the biased router never picks: its scales stay a hole
    return SCALE_FILL[tag] * (math.prod(shape) * ITEMSIZE[tag] // len(SCALE_FILL[tag]))


def _write_shard(path: Path, tensors: list, fmt: str, routed_k: int | None) -> int:
    """Header for real, data as a hole: the file is truncated to its full size, and only the
    scales and router biases a decode step reads are written (`_real_bytes`). Published
    formats in the safetensors library's order; our container keeps each expert's six tensors
    in one range (docs/FORMAT.md), its data 4 KiB-aligned, its stamp in __metadata__."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    if fmt == "int4":
        header["__metadata__"] = {"colibri_format": FORMAT_NAME, "format_version": str(FORMAT_VERSION),
                                  "quant": "int4", "group_size": str(INT4_GROUP), "scope": "all",
                                  "source_fingerprint": FINGERPRINT, "source_sha256": FINGERPRINT}
    ordered = tensors if fmt == "int4" else sorted(tensors, key=lambda t: (DTYPE_RANK[t[1]], t[0]))
    for name, tag, shape in ordered:
        n = math.prod(shape) * ITEMSIZE[tag]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    align = 4096 if fmt == "int4" else 8  # the library aligns to 8; our container to 4 KiB
    raw += b" " * (-(8 + len(raw)) % align)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
        for name, tag, shape in ordered if routed_k is not None else ():
            data = _real_bytes(name, tag, shape, routed_k)
            if data is not None:
                f.seek(8 + len(raw) + header[name]["data_offsets"][0])
                f.write(data)
    return 8 + len(raw) + offset


def build(name: str, out: Path, dtype: str, shards: int | None = None, decodable: bool = False,
          layers: int | None = None) -> dict:
    """decodable: also write the scales and router biases a decode step reads (`_real_bytes`;
    ~1 GiB for an int4 container), else every tensor is a hole (the metadata figures).
    layers: the first N layers only (hf_config), in as many shards as keep the published shard size."""
    cfg = hf_config(name, dtype, layers)
    groups = tensor_groups(cfg, dtype, indexer_layers_of(cfg))
    total = sum(_nbytes(t) for g in groups for t in g)
    full_layers = synth.load_preset(name)["num_hidden_layers"]
    count = shards or max(1, round(MODELS[name]["shards"] * cfg["num_hidden_layers"] / full_layers))
    target = total / count
    assigned: list[list] = [[]]
    size = 0
    for g in groups:  # greedy, in file order: a shard closes when the next group would pass the target
        gb = sum(_nbytes(t) for t in g)
        if assigned[-1] and size + gb > target * 1.001 and len(assigned) < count:
            assigned.append([])
            size = 0
        assigned[-1].extend(g)
        size += gb
    out.mkdir(parents=True, exist_ok=False)
    weight_map, n = {}, len(assigned)
    for k, tensors in enumerate(assigned, 1):
        file = f"model-{k:05d}-of-{n:06d}.safetensors"
        _write_shard(out / file, tensors, dtype, cfg["num_experts_per_tok"] if decodable else None)
        weight_map.update({t[0]: file for t in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"model": name, "dtype": dtype, "shards": n, "tensors": len(weight_map), "apparent_bytes": total,
            "disk_bytes": sum(os.stat(p).st_blocks * 512 for p in out.iterdir())}
