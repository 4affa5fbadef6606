"""The write plan of a GGUF import: every HF tensor to write, in order, with how to make it.

Order: embeddings, final norm, lm_head, then layer by layer (dense tensors in LAYER_NAMES
order, then each routed expert's gate, up, down together). Every GGUF tensor must land
somewhere, be a table llama.cpp derives (rope_freqs), or belong to a skipped MTP layer: a
tensor with no HF counterpart stops the import, since dropping weights silently would make a
model that runs and is wrong.
"""

from __future__ import annotations

import torch

from engine.arch.architecture import Architecture
from engine.arch.args import ModelArgs, expert_tensor_names
from engine.arch.registry import model_args
from engine.base.errors import ModelFormatError
from engine.format.gguf.gguf_names import (BLK_RE, CONFIGS, DERIVED, EXPERT_PARTS, FUSED_EXPERTS, FUSED_GATE_UP,
                                           GLOBAL_NAMES, LAYER_NAMES, arch_for, unpermute)
from engine.format.gguf.checks import check_metadata, check_plan
from engine.format.gguf.items import Item, OutTensor, Plan
from engine.format.gguf.dequant import check_type, dequantize
from engine.format.gguf.reader import GGUFModel, GGUFTensor


def _load(t: GGUFTensor, index: int | None = None, transform=None):
    def load() -> torch.Tensor:
        x = dequantize(t, index)
        return transform(x) if transform else x
    return load


def build_plan(m: GGUFModel) -> Plan:
    """The plan, checked: metadata typed first (engine/format/gguf/checks.py), then the config it
    makes through `run`'s validator and every planned tensor's shape against that config."""
    arch = arch_for(m)
    for t in m.tensors.values():  # refuse an unsupported type before anything is written
        check_type(t)
    check_metadata(m)
    nextn = int(m.arch_key("nextn_predict_layers", 0) or 0)
    layers = int(m.require("block_count")) - nextn
    if layers < 1:
        raise ModelFormatError(f"{m.paths[0]}: block_count leaves {layers} layers")
    moe_layers = [f"blk.{i}.ffn_gate_inp.weight" in m.tensors for i in range(layers)]
    if not any(moe_layers):
        raise ModelFormatError(f"{m.paths[0]}: no layer has routed experts (ffn_gate_inp); not a MoE model")
    config = CONFIGS[arch.name](m, layers, moe_layers)
    args = model_args(config)  # the HF names of the experts and the router, as for a safetensors checkpoint
    used: set[str] = set()
    items: list[Item] = []
    for gname, hf in GLOBAL_NAMES.items():
        if gname in m.tensors:
            items.append(_dense(m, gname, hf, -1, used))
    for layer in range(layers):
        items += _layer_items(m, arch, args, config, layer, used)
    skipped = []
    # An MTP block carries llama.cpp's `nextn.*` tensors; without them, a nextn_predict_layers that
    # does not belong to the file would skip real layers (a model that runs, silently truncated).
    mtp_blocks = {int(b[1]) for n in m.tensors if (b := BLK_RE.match(n)) and b[2].startswith("nextn.")}
    for name in m.tensors:
        if name in used:
            continue
        blk = BLK_RE.match(name)
        if name in DERIVED:
            skipped.append(f"{name} (derived by llama.cpp from the RoPE settings)")
        elif blk and layers <= int(blk[1]) < layers + nextn:
            if int(blk[1]) not in mtp_blocks:
                raise ModelFormatError(f"{m.paths[0]}: layer {int(blk[1])} is counted as a multi-token-prediction "
                                       f"layer ({m.arch}.nextn_predict_layers = {nextn}) but has no nextn.* tensors")
            skipped.append(f"{name} (multi-token-prediction layer)")
        elif blk and int(blk[1]) >= layers:  # a block_count too small would drop real layers silently
            raise ModelFormatError(f"{m.paths[0]}: tensor {name!r} is in layer {int(blk[1])}, beyond "
                                   f"{m.arch}.block_count ({layers + nextn}"
                                   + (f", of which {nextn} multi-token-prediction layers)" if nextn else ")"))
        else:
            raise ModelFormatError(f"{m.paths[0]}: tensor {name!r} has no Hugging Face counterpart for "
                                   f"{m.arch}; refusing to drop weights")
    plan = Plan(config, items, skipped)
    check_plan(m, plan)
    return plan


def _dense(m: GGUFModel, gname: str, hf: str, layer: int, used: set, transform=None, shape=None) -> Item:
    t = m.tensors[gname]
    used.add(gname)
    return Item(hf, layer, [OutTensor(hf, tuple(shape or t.shape), _load(t, None, transform), source=gname)])


def _layer_items(m: GGUFModel, arch: Architecture, args: ModelArgs, config: dict, layer: int, used: set) -> list[Item]:
    pre, out = f"blk.{layer}.", []
    hf_pre = f"model.layers.{layer}."
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for suffix, hf in {**LAYER_NAMES, **arch.gguf.tensors}.items():
        gname = pre + suffix
        if gname not in m.tensors:
            continue
        hf_name = hf_pre + hf.format(moe=args.moe_prefix)
        transform, shape = None, None
        if arch.gguf.permute_qk and suffix.startswith(("attn_q.", "attn_k.")):
            n = heads if suffix.startswith("attn_q.") else kv_heads
            transform = lambda x, n=n: unpermute(x, n)  # noqa: E731
        if suffix == "ffn_gate_inp_shexp.weight":  # HF keeps it as a [1, hidden] linear
            shape = (1, config["hidden_size"])
            transform = lambda x, s=shape: x.reshape(s)  # noqa: E731
        out.append(_dense(m, gname, hf_name, layer, used, transform, shape))
    if pre + "attn_k_b.weight" in m.tensors:
        out.append(_kv_b(m, pre, hf_pre, config, layer, used))
    out += FUSED_EXPERTS.get(arch.name, _experts)(m, args, config, layer, used)
    return out


def _kv_b(m: GGUFModel, pre: str, hf_pre: str, config: dict, layer: int, used: set) -> Item:
    """Rejoin DeepSeek's kv_b_proj [H*(nope+v), kv_rank] from attn_k_b [H, kv_rank, nope] and
    attn_v_b [H, v, kv_rank] (the converter's split, with k_b transposed for weight absorption)."""
    k_b, v_b = m.tensors[pre + "attn_k_b.weight"], m.tensors.get(pre + "attn_v_b.weight")
    if v_b is None:
        raise ModelFormatError(f"{m.paths[0]}: {pre}attn_k_b.weight without {pre}attn_v_b.weight")
    used.update({k_b.name, v_b.name})
    H, nope, v, rank = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"], \
        config["kv_lora_rank"]
    if tuple(k_b.shape) != (H, rank, nope) or tuple(v_b.shape) != (H, v, rank):
        raise ModelFormatError(f"{m.paths[0]}: {pre}attn_k_b/v_b have shapes {k_b.shape}/{v_b.shape}, expected "
                               f"{(H, rank, nope)}/{(H, v, rank)}")

    def load() -> torch.Tensor:
        kv = torch.cat([dequantize(k_b).transpose(1, 2), dequantize(v_b)], dim=1)  # [H, nope+v, rank]
        return kv.reshape(H * (nope + v), rank)
    name = hf_pre + "self_attn.kv_b_proj.weight"
    return Item(name, int(pre.split(".")[1]), [OutTensor(name, (H * (nope + v), rank), load)])


def _experts(m: GGUFModel, args: ModelArgs, config: dict, layer: int, used: set) -> list[Item]:
    """One Item per routed expert: its gate, up, down sliced out of the stacked 3-D tensors."""
    pre = f"blk.{layer}."
    gate, up, down = (m.tensors.get(pre + p) for p in EXPERT_PARTS)
    fused = m.tensors.get(pre + FUSED_GATE_UP)
    if down is None and gate is None and fused is None:
        return []
    if down is None or (fused is None and (gate is None or up is None)):
        raise ModelFormatError(f"{m.paths[0]}: layer {layer} has only some of its expert tensors")
    E, H, I = down.shape[0], down.shape[1], down.shape[2]
    for t, want in ((gate, (E, I, H)), (up, (E, I, H)), (fused, (E, 2 * I, H))):
        if t is not None and tuple(t.shape) != want:
            raise ModelFormatError(f"{m.paths[0]}: {t.name} has shape {t.shape}, expected {want} from {down.name}")
    used.update(t.name for t in (gate, up, down, fused) if t is not None)
    items = []
    for e in range(E):
        if fused is not None:
            gate_load = _load(fused, e, lambda x: x[:I].contiguous())
            up_load = _load(fused, e, lambda x: x[I:].contiguous())
        else:
            gate_load, up_load = _load(gate, e), _load(up, e)
        g, u, d = expert_tensor_names(args, layer, e)
        items.append(Item(f"layer {layer} expert {e}", layer, [
            OutTensor(g, (I, H), gate_load, source=(fused or gate).name),
            OutTensor(u, (I, H), up_load, source=(fused or up).name),
            OutTensor(d, (H, I), _load(down, e), source=down.name)]))
    return items
