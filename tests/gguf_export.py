"""A test-side HF → GGUF exporter laid out as llama.cpp's convert_hf_to_gguf.py writes it.

Tests cannot build llama.cpp, so this writes the same file with gguf-py (GGUFWriter, and
gguf-py's own TensorNameMap for the names, so the importer's inverse table is checked against
llama.cpp's mapping, not against itself): metadata keys of TextModel.set_gguf_parameters and the
arch classes (conversion/{qwen,olmo,llama,deepseek,glm}.py), experts stacked into
`ffn_*_exps`, llama-family q/k permuted (LlamaModel.permute), DeepSeek kv_b_proj split into
attn_k_b/attn_v_b, the gpt2 vocabulary from tokenizer.json. 1-D tensors stay F32, as both the
converter and llama-quantize keep them. The real converter's round trip is
benchmarks/formats/gguf_roundtrip.py.

K-quants (Q4_K, Q5_K, Q6_K): gguf-py cannot quantize them, so `kquant_pack` packs blocks from
integer codes by the struct layouts of ggml-common.h (and `kquant_quantize` picks simple codes
for real weights); the tests compare the importer's decoding with the values those codes stand
for — an independent check of the block math.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

ARCH = {"qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE, "qwen2_moe": gguf.MODEL_ARCH.QWEN2MOE, "olmoe": gguf.MODEL_ARCH.OLMOE,
        "mixtral": gguf.MODEL_ARCH.LLAMA, "deepseek_v3": gguf.MODEL_ARCH.DEEPSEEK2,
        "glm4_moe": gguf.MODEL_ARCH.GLM4_MOE}
QK_K = 256


def hf_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # convert_hf_to_gguf LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_metadata(w: gguf.GGUFWriter, cfg: dict, mt: str) -> None:
    # Only GLM exports its MTP layers (as extra blocks); DeepseekV2Model skips them (skip_mtp).
    w.add_block_count(cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if mt == "glm4_moe" else 0))
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    if cfg.get("intermediate_size"):
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1 if mt == "deepseek_v3" else cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        if mt == "deepseek_v3" and rope.get("mscale_all_dim") is not None:  # DeepseekV2Model
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    w.add_layer_norm_rms_eps(1e-5 if mt == "olmoe" else float(cfg.get("rms_norm_eps", 1e-6)))
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("n_group") is not None:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    if mt not in ("deepseek_v3",) and cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if mt in ("qwen3_moe", "qwen2_moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if mt == "qwen2_moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if mt in ("deepseek_v3", "glm4_moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg.get("n_shared_experts", 1))
        w.add_leading_dense_block_count(cfg.get("first_k_dense_replace", 1))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_scale(cfg.get("routed_scaling_factor", 1.0))
        if cfg.get("norm_topk_prob"):
            w.add_expert_weights_norm(True)
    if mt == "deepseek_v3":
        if cfg.get("q_lora_rank"):
            w.add_q_lora_rank(cfg["q_lora_rank"])
        w.add_kv_lora_rank(cfg["kv_lora_rank"])
        w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        w.add_value_length(cfg["kv_lora_rank"])
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        w.add_value_length_mla(cfg["v_head_dim"])
        w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    if mt == "glm4_moe":
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        w.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 0.5)))
        if cfg.get("num_nextn_predict_layers"):
            w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])


def write_vocab(w: gguf.GGUFWriter, model_dir: Path, pre: str = "gpt-2") -> None:
    if not (Path(model_dir) / "tokenizer.json").exists():  # transformers' tiny models have none
        return
    tj = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if cfg.get("eos_token_id") is not None:  # gguf.SpecialVocab reads them from config.json
        w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("bos_token_id") is not None:
        w.add_bos_token_id(cfg["bos_token_id"])


def gguf_tensors(model_dir: Path, cfg: dict) -> list[tuple[str, torch.Tensor]]:
    """(GGUF name, float32 tensor in torch order), as the converter's modify_tensors yields them."""
    mt = cfg["model_type"]
    layers = cfg["num_hidden_layers"] + (cfg.get("num_nextn_predict_layers", 0) if mt == "glm4_moe" else 0)
    tmap = gguf.get_tensor_name_map(ARCH[mt], layers)
    tensors = hf_tensors(model_dir)
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    out = []
    for name in sorted(tensors, key=_hf_order):
        t = tensors[name].float()
        parts = name.split(".")
        if ".experts." in name and parts[-3].isdigit() and parts[-1] == "weight":  # per-expert HF tensors
            layer, e, proj = int(parts[2]), int(parts[-3]), parts[-2]
            experts.setdefault((layer, proj), {})[e] = t
            continue
        if mt == "mixtral" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads"] if "q_proj" in name else cfg["num_key_value_heads"]
            t = permute(t, heads)
        if mt == "deepseek_v3" and name.endswith("kv_b_proj.weight"):
            H, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kv_b = t.view(H, nope + v, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            out.append((tmap.get_name(name.replace("kv_b_proj", "k_b_proj"), (".weight",)), k_b.transpose(1, 2)))
            out.append((tmap.get_name(name.replace("kv_b_proj", "v_b_proj"), (".weight",)), v_b))
            continue
        if name.endswith("e_score_correction_bias"):  # as conversion/base.py renames it before mapping
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gname = tmap.get_name(name, (".weight", ".bias"))
        assert gname is not None, f"gguf-py has no GGUF name for {name}"
        out.append((gname, t))
    prefix = "block_sparse_moe" if mt == "mixtral" else "mlp"
    for (layer, proj), by_e in sorted(experts.items()):
        stacked = torch.stack([by_e[e] for e in sorted(by_e)])
        gname = tmap.get_name(f"model.layers.{layer}.{prefix}.experts.{proj}.weight", (".weight",)) if mt != "mixtral" \
            else tmap.get_name(f"layers.{layer}.feed_forward.experts.{proj}.weight", (".weight",))
        assert gname is not None, f"gguf-py has no GGUF name for layer {layer} experts {proj}"
        out.append((gname, stacked))
    return out


def _hf_order(name: str):
    parts = name.split(".")
    return (int(parts[2]) if len(parts) > 2 and parts[1] == "layers" else -1, name)


def encode(t: torch.Tensor, qtype: T) -> np.ndarray:
    x = t.float().numpy()
    if qtype == T.F32:
        return x.astype(np.float32)
    if qtype == T.F16:
        return x.astype(np.float16)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return kquant_quantize(x, qtype)
    return gguf.quants.quantize(x, qtype)


def nextn_tensors(cfg: dict, layer: int) -> list[tuple[str, torch.Tensor]]:
    """A GLM multi-token-prediction layer as the converter names it (blk.{L}.nextn.*, after the
    main layers), with random weights: only its names and place matter to the import."""
    H = cfg["hidden_size"]
    g = torch.Generator().manual_seed(layer)
    return [(f"blk.{layer}.nextn.eh_proj.weight", torch.randn(H, 2 * H, generator=g)),
            (f"blk.{layer}.nextn.enorm.weight", torch.ones(H)), (f"blk.{layer}.nextn.hnorm.weight", torch.ones(H)),
            (f"blk.{layer}.attn_norm.weight", torch.ones(H)),
            (f"blk.{layer}.attn_q.weight", torch.randn(H, H, generator=g))]


def export(model_dir: Path, out: Path, qtype: T = T.F16, *, pre: str = "gpt-2", split_max_tensors: int = 0,
           arch_override: str | None = None, extra_layers: int = 0, extra_tensors: dict | None = None) -> Path:
    """Write the GGUF of an HF model dir; 2-D+ tensors in `qtype`, 1-D in F32, like llama.cpp.
    extra_layers: GLM nextn (MTP) layers appended; extra_tensors: more (GGUF name → tensor)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    mt = cfg["model_type"]
    if extra_layers:
        cfg["num_nextn_predict_layers"] = extra_layers
    elif mt == "glm4_moe":  # the HF model has no MTP weights; say so in the metadata as the converter would
        cfg["num_nextn_predict_layers"] = 0
    arch = arch_override or gguf.MODEL_ARCH_NAMES[ARCH[mt]]
    w = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    write_metadata(w, cfg, mt)
    write_vocab(w, model_dir, pre)
    tensors = gguf_tensors(model_dir, cfg)
    for i in range(extra_layers):
        tensors += nextn_tensors(cfg, cfg["num_hidden_layers"] + i)
    tensors += list((extra_tensors or {}).items())
    for name, t in tensors:
        kind = qtype if t.ndim >= 2 else T.F32
        data = encode(t, kind)
        if kind in (T.F32, T.F16):
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:  # GGUFWriter names the parts <stem>-0000i-of-0000n.gguf
        return sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))[0]
    return out


# --- K-quant blocks from codes (ggml-common.h: block_q4_K, block_q5_K, block_q6_K) ------------------

def _pack_scales_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per block → the 12 bytes get_scale_min_k4 reads. [B, 8] → [B, 12]"""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def kquant_pack(qtype: T, d: np.ndarray, q: np.ndarray, sc: np.ndarray, dmin=None, mn=None) -> np.ndarray:
    """Blocks of one K-quant type from codes. d, dmin [B] (f16-representable); q [B, 256]
    (Q4_K 0..15, Q5_K 0..31, Q6_K -32..31); sc, mn [B, 8] 0..63 (Q6_K: sc [B, 16] int8)."""
    B = q.shape[0]
    f16 = lambda a: np.asarray(a, np.float16).reshape(B, 1).view(np.uint8)  # noqa: E731
    if qtype == T.Q6_K:
        u = (q + 32).astype(np.uint8).reshape(B, 2, 4, 32)  # [half, quarter, l]
        ql = np.concatenate([(u[:, :, 0] & 15) | ((u[:, :, 2] & 15) << 4),
                             (u[:, :, 1] & 15) | ((u[:, :, 3] & 15) << 4)], axis=2)  # [B, 2, 64]
        qh = (u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4) | ((u[:, :, 3] >> 4) << 6)
        return np.concatenate([ql.reshape(B, 128), qh.reshape(B, 64), sc.astype(np.int8).view(np.uint8), f16(d)], 1)
    scales = _pack_scales_k4(sc.astype(np.uint8), mn.astype(np.uint8))
    u = q.astype(np.uint8).reshape(B, 4, 2, 32)  # [pair of sub-blocks j, low/high nibble, l]
    qs = ((u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)).reshape(B, 128)
    if qtype == T.Q4_K:
        return np.concatenate([f16(d), f16(dmin), scales, qs], 1)
    hi = (q.astype(np.uint8) >> 4).reshape(B, 8, 32)  # bit 4 of sub-block s lives in bit s of qh[l]
    qh = np.zeros((B, 32), np.uint8)
    for s in range(8):
        qh |= hi[:, s] << s
    return np.concatenate([f16(d), f16(dmin), scales, qh, qs], 1)


def kquant_values(qtype: T, d, q, sc, dmin=None, mn=None) -> np.ndarray:
    """What the codes stand for, straight from the formulas: [B, 256] float32."""
    d = np.asarray(d, np.float16).astype(np.float32)[:, None]
    if qtype == T.Q6_K:
        return d * np.repeat(sc.astype(np.float32), 16, axis=1) * q.astype(np.float32)
    dmin = np.asarray(dmin, np.float16).astype(np.float32)[:, None]
    return (d * np.repeat(sc.astype(np.float32), 32, axis=1) * q.astype(np.float32)
            - dmin * np.repeat(mn.astype(np.float32), 32, axis=1))


def _f16_scale(v: np.ndarray) -> np.ndarray:
    """A block scale as stored (f16), never 0 (an all-zero block then gets codes 0)."""
    d = v.astype(np.float16).astype(np.float32)
    return np.where(d > 0, d, np.float32(2.0 ** -24))


def kquant_codes(x: np.ndarray, qtype: T):
    """Simple (not llama.cpp's optimised) codes for weights x [B, 256]."""
    B = x.shape[0]
    if qtype == T.Q6_K:
        sub = x.reshape(B, 16, 16)
        s = np.abs(sub).max(axis=2) / 31
        d = _f16_scale(s.max(axis=1) / 127)
        sc = np.clip(np.round(s / d[:, None]), -128, 127).astype(np.int8)
        step = d[:, None, None] * sc[:, :, None]
        q = np.clip(np.round(np.divide(sub, step, out=np.zeros_like(sub), where=step != 0)), -32, 31)
        return dict(d=d, q=q.reshape(B, 256).astype(np.int32), sc=sc)
    top = 15 if qtype == T.Q4_K else 31
    sub = x.reshape(B, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0)
    s = (sub.max(axis=2) - lo) / top
    d = _f16_scale(s.max(axis=1) / 63)
    dmin = _f16_scale((-lo).max(axis=1) / 63)
    sc = np.clip(np.round(s / d[:, None]), 1, 63).astype(np.int32)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.int32)
    step = d[:, None, None] * sc[:, :, None]
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[:, :, None]) / step), 0, top)
    return dict(d=d, q=q.reshape(B, 256).astype(np.int32), sc=sc, dmin=dmin, mn=mn)


def kquant_quantize(x: np.ndarray, qtype: T) -> np.ndarray:
    rows = x.reshape(-1, x.shape[-1])
    assert rows.shape[1] % QK_K == 0, f"K-quants need rows of a multiple of {QK_K}, got {rows.shape[1]}"
    blocks = rows.reshape(-1, QK_K)
    packed = kquant_pack(qtype, **kquant_codes(blocks, qtype))
    return packed.reshape(*x.shape[:-1], x.shape[-1] // QK_K * packed.shape[1])
