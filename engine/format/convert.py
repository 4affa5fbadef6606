"""`colibri convert`: a Hugging Face MoE directory → an int8 / int4 container, shard by shard.

- One output shard per source shard, same names; dense tensors keep their place and dtype
  (scope "experts") or are quantized too (scope "all"; embeddings, norms and routers never).
- Each routed expert's six tensors (gate, up, down × qweight, qscale) are written next to each
  other, so an expert is one contiguous byte range and the engine reads it with one request.
- Atomic: everything is written under `<dst>.partial/` and renamed to `<dst>` at the end.
- Resumable: after every shard, `convert-state.json` records the shard's sha256; a re-run with
  the same source and options keeps every recorded shard whose bytes still hash to it.
- Deterministic: same source and options, same bytes (fixed order, no timestamps, and the
  quantization itself is deterministic fp32 math).
- From a published FP8 checkpoint (engine/format/fp8_checkpoint.py): each FP8 weight is dequantized with
  its block scales (fp32) and requantized; dense FP8 weights that stay unquantized (scope
  "experts") are written as bf16; the `weight_scale_inv` tensors, the `quantization_config`
  and the MTP layers (engine/format/mtp.py: the engine never loads them) are not carried over.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.format.checkpoint import Checkpoint, read_tensor
from engine.format.container import CONFIG_KEY, QuantSpec, container_spec, quant_names
from engine.base.durable import DirectoryLock
from engine.base.errors import ModelFormatError, UnsupportedModelError
from engine.arch.args import expert_tensor_names, fused_expert_tensor_names
from engine.arch.registry import model_args
from engine.weights.quantized import check_group, quantize, stored_shapes
from engine.format.safetensors_writer import ShardWriter, TensorSpec, write_json_atomic
from engine.base.output_target import (OutputTargetError, any_of, check_not_source, directory_target,
                                       read_small_json, replace_directory, stamped)
from engine.format import fp8_checkpoint
from engine.format.mtp import mtp_summary

STATE_FILE = "convert-state.json"
WRITER_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
SHA_PLACEHOLDER = "0" * 64  # same length as a hex sha256, so the header can be restamped in place
HASH_CHUNK = 8 << 20


def quantizable(name: str, shape: tuple[int, ...], scope: str) -> bool:
    """Linear weights only: embeddings are looked up, not multiplied, and routers and norms
    are tiny and decide routing, so they stay exact."""
    if scope == "experts" or len(shape) != 2:
        return False
    return name.endswith("_proj.weight") or name == "lm_head.weight"


@dataclass
class Item:
    """One unit of the output: a dense tensor copied or quantized, or a routed expert."""

    name: str  # dense tensor name, or "layer.expert" for an expert
    specs: list[TensorSpec] = field(default_factory=list)
    expert: tuple[int, int] | None = None
    quantized: bool = True


def _qspecs(name: str, spec: QuantSpec, n: int, k: int) -> list[TensorSpec]:
    qname, sname = quant_names(name)
    qshape, sshape = stored_shapes(spec.quant, spec.group_size, n, k)
    return [TensorSpec(qname, qshape, "int8" if spec.quant == "int8" else "uint8"),
            TensorSpec(sname, sshape, "bfloat16")]


class Converter:
    def __init__(self, src, spec: QuantSpec):
        self.ckpt = Checkpoint(src)
        self.spec = spec
        self.args = model_args(self.ckpt.config)
        if not self.args.is_moe:
            raise ModelFormatError(f"{src}: not a MoE model (convert quantizes routed experts)")
        if container_spec(self.ckpt) is not None:
            raise ModelFormatError(f"{src}: already a quantized container")
        if self.args.expert_impl is not None:  # gpt_oss: experts fused [E, H, 2I] with biases, or MXFP4
            raise UnsupportedModelError(f"{src}: convert does not write {self.ckpt.config.get('model_type')} "
                                        "containers (its experts carry biases in their own fused layout); "
                                        "run the checkpoint as published (MXFP4 experts stream at 4.25 bits/weight)")
        a = self.args
        if spec.quant == "int4":
            check_group(a.hidden_size, spec.group_size, "gate/up projections of the experts (hidden_size)")
            check_group(a.moe_intermediate_size, spec.group_size, "down projection of the experts "
                                                                   "(moe_intermediate_size)")
        self.expert_of: dict[str, tuple[int, int] | int] = {}  # source tensor → expert, or layer if fused
        for layer in range(a.num_layers):
            if not a.is_moe_layer(layer):
                continue
            fused = fused_expert_tensor_names(a, layer)
            if fused[0] in self.ckpt:
                self.expert_of.update({n: layer for n in fused})
            else:
                shapes = [(a.moe_intermediate_size, a.hidden_size)] * 2 + [(a.hidden_size, a.moe_intermediate_size)]
                for e in range(a.num_experts):
                    for n, shape in zip(expert_tensor_names(a, layer, e), shapes):
                        # A missing expert tensor, or one whose shape is not config.json's (the
                        # output's is), is an error now, not a ValueError in the writer mid-way.
                        info = self.ckpt.info(n)
                        if tuple(info.shape) != shape:
                            raise ModelFormatError(f"{info.path}: tensor {n!r} has shape {list(info.shape)}, "
                                                   f"config.json implies {list(shape)}")
                        self.expert_of[n] = (layer, e)
        self.fp8 = fp8_checkpoint.fp8_spec(self.ckpt.config, f"{src}/config.json")
        # Not carried over from an FP8 source: the scales (folded into the weights) and MTP layers.
        self.skipped = mtp_summary(self.ckpt, a)
        mtp_prefixes = tuple(f"model.layers.{i}." for i in self.skipped["mtp_layers"])
        self.dropped = {n for n in self.ckpt.tensors if n.startswith(mtp_prefixes)
                        or (self.fp8 is not None and n.endswith(fp8_checkpoint.SCALE_SUFFIX))}
        self.fingerprint = fingerprint(self.ckpt)
        self._fused_cache: dict[str, torch.Tensor] = {}

    def shards(self) -> dict[str, list[Item]]:
        """Output shard name → its items in order (the source shard's order, experts as units)."""
        by_shard: dict[str, list] = {}
        for info in sorted(self.ckpt.tensors.values(), key=lambda i: (i.path, i.offset)):
            if info.name in self.dropped:
                continue
            by_shard.setdefault(Path(info.path).name, []).append(info)
        a, seen = self.args, set()
        out: dict[str, list[Item]] = {}
        for shard, infos in by_shard.items():
            items = out.setdefault(shard, [])
            for info in infos:
                owner = self.expert_of.get(info.name)
                if owner is None:
                    if quantizable(info.name, info.shape, self.spec.scope):
                        if self.spec.quant == "int4":
                            check_group(info.shape[1], self.spec.group_size, info.name)
                        items.append(Item(info.name, _qspecs(info.name, self.spec, *info.shape)))
                    else:
                        dtype = "bfloat16" if info.dtype == fp8_checkpoint.FP8_TAG else _writer_dtype(info)
                        items.append(Item(info.name, [TensorSpec(info.name, info.shape, dtype)], quantized=False))
                    continue
                keys = [owner] if isinstance(owner, tuple) else [(owner, e) for e in range(a.num_experts)]
                for key in keys:
                    if key in seen:  # an expert lives where its first tensor lives
                        continue
                    seen.add(key)
                    names = expert_tensor_names(a, *key)
                    shapes = [(a.moe_intermediate_size, a.hidden_size)] * 2 + [(a.hidden_size, a.moe_intermediate_size)]
                    specs = [s for n, shape in zip(names, shapes) for s in _qspecs(n, self.spec, *shape)]
                    items.append(Item(f"{key[0]}.{key[1]}", specs, key))
        return out

    def _expert(self, layer: int, e: int) -> list[torch.Tensor]:
        a = self.args
        names = expert_tensor_names(a, layer, e)
        if names[0] in self.ckpt:
            return [self._load(n) for n in names]
        gate_up_name, down_name = fused_expert_tensor_names(a, layer)
        if gate_up_name not in self._fused_cache:  # one layer's fused tensors at a time
            self._fused_cache = {n: self.ckpt.load(n) for n in (gate_up_name, down_name)}
        gate_up, down = self._fused_cache[gate_up_name][e], self._fused_cache[down_name][e]
        I = a.moe_intermediate_size
        return [gate_up[:I], gate_up[I:], down]

    def _load(self, name: str) -> torch.Tensor:
        """A source tensor as its values: FP8 weights dequantized with their block scales (fp32)."""
        if self.fp8 is None or not fp8_checkpoint.is_fp8(self.ckpt, name):
            return self.ckpt.load(name)
        w, s = fp8_checkpoint.check_fp8(self.ckpt, self.fp8, name)
        # Every code checked (run samples them): a converted NaN would be a silent garbage weight.
        return fp8_checkpoint.load_dequantized((w, s), self.fp8, read_tensor, torch.float32, full=True)

    def write_shard(self, path: Path, items: list[Item], progress=None) -> None:
        specs = [s for item in items for s in item.specs]
        source_hash = hashlib.sha256()
        with ShardWriter(path, specs, self.spec.stamp(self.fingerprint, SHA_PLACEHOLDER)) as w:
            for i, item in enumerate(items):
                sources = self._expert(*item.expert) if item.expert else [self._load(item.name)]
                for t in sources:
                    source_hash.update(t.contiguous().view(torch.uint8).numpy())
                tensors = [q for t in sources for q in quantize(t, self.spec.quant, self.spec.group_size)] \
                    if item.quantized else sources
                for spec, t in zip(item.specs, tensors, strict=True):
                    w.write(spec.name, t)
                if progress:
                    progress(i + 1, len(items))
            w.restamp(self.spec.stamp(self.fingerprint, source_hash.hexdigest()))


def fingerprint(ckpt: Checkpoint) -> str:
    """Identity of a checkpoint: config.json, every shard's size and header (not its data)."""
    h = hashlib.sha256((ckpt.directory / "config.json").read_bytes())
    for path in sorted({i.path for i in ckpt.tensors.values()}):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(Path(path).name.encode() + os.path.getsize(path).to_bytes(8, "little") + f.read(n))
    return h.hexdigest()


def _writer_dtype(info) -> str:
    try:
        return WRITER_DTYPE[info.dtype]
    except KeyError:
        raise ModelFormatError(f"{info.path}: tensor {info.name!r} has dtype {info.dtype}, convert copies "
                               f"F32/BF16/F16 only") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def container_recogniser():
    """A previous `convert` output: its config.json carries the container stamp."""
    return stamped("config.json", CONFIG_KEY)


GGUF_SOURCE_KEY = "colibri_gguf_source"  # config.json of `convert X.gguf -o D` (engine/format/gguf/importer.py)


def convert_output_recogniser():
    """Any previous `colibri convert` output: a container, or a bf16 import of a GGUF."""
    return any_of(container_recogniser(), stamped("config.json", GGUF_SOURCE_KEY))


def convert(src, dst, quant: str = "int4", group_size: int = 64, scope: str = "experts", force: bool = False,
            progress=None) -> dict:
    """Write the container; returns a summary. `progress(event, **fields)` is told each step.

    dst is checked by engine/base/output_target.py before anything is read or written: never the
    source, inside it or above it, and a non-empty dst is replaced (with force) only when it is
    a previous container."""
    spec = QuantSpec(quant, group_size if quant == "int4" else 0, scope)
    source = Path(src).expanduser().resolve()
    target = directory_target(dst, command="convert", recognise=convert_output_recogniser(), sources=[source],
                              force=force)
    tmp = target.sibling("partial")
    check_not_source(tmp, [source], "-o", what="the work directory")
    with DirectoryLock(target.path, f"converting {source.name}"):
        conv = Converter(source, spec)
        shards = conv.shards()
        options = {**spec.config_entry(conv.fingerprint)}
        written = write_shards(tmp, shards, options, conv.write_shard, progress)
        _finish(conv, shards, tmp, spec)
        replace_directory(tmp, target)
    out = target.path
    return {"path": str(out), "quant": spec.quant, "group_size": spec.group_size, "scope": spec.scope,
            "label": spec.label, "shards": len(shards), "shards_written": len(written),
            "shards_kept": len(shards) - len(written), "bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
            "source_bytes": conv.ckpt.nbytes(), "source_fingerprint": conv.fingerprint,
            "source_quant": conv.fp8.label if conv.fp8 is not None else None,
            "skipped": conv.skipped}


def _not_ours(tmp: Path, why: str) -> OutputTargetError:
    return OutputTargetError(f"{tmp}: {why}, so it is not an interrupted `colibri convert`; "
                             "remove it or choose another -o")


def read_state(tmp: Path) -> dict | None:
    """The state of an interrupted run in tmp, None for an empty tmp; anything else is refused."""
    if tmp.is_symlink() or not tmp.is_dir():
        raise _not_ours(tmp, "exists and is not a directory")
    state_path = tmp / STATE_FILE
    if not os.path.lexists(state_path):
        if any(os.scandir(tmp)):
            raise _not_ours(tmp, f"holds files but no {STATE_FILE}")
        return None
    state = read_small_json(state_path)
    if (not isinstance(state, dict) or not isinstance(state.get("options"), dict)
            or not isinstance(state.get("shards"), dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in state["shards"].items())):
        raise _not_ours(tmp, f"its {STATE_FILE} is not a conversion state")
    for entry in os.scandir(tmp):
        if entry.is_dir(follow_symlinks=False) or not (entry.is_file(follow_symlinks=False)):
            raise _not_ours(tmp, f"it holds {entry.name!r}, which is not a file convert writes")
    return state


def resume_state(tmp: Path, options: dict, progress, source: str = "source") -> dict[str, str]:
    """Shards of an interrupted run to keep (convert's, or a GGUF import's: `source` names what it
    was made from): same source and options, bytes still matching."""
    if not os.path.lexists(tmp):
        return {}
    state = read_state(tmp)  # a .partial that is not an interrupted convert is refused, named, kept
    if state is None:
        return {}
    if state["options"] != options:
        if progress:
            progress("discard", path=str(tmp), reason=f"made from another {source} or with other options")
        shutil.rmtree(tmp)  # ours: its state says so, and it holds files only (read_state)
        return {}
    kept = {}
    for name, digest in state["shards"].items():
        ok = Path(name).name == name and (tmp / name).is_file() and file_sha256(tmp / name) == digest
        if progress:
            progress("check", name=name, ok=ok)
        if ok:
            kept[name] = digest
    for stray in tmp.iterdir():  # half-written .tmp shards and anything unrecorded (files only: checked)
        if stray.name != STATE_FILE and stray.name not in kept:
            stray.unlink()
    return kept


def write_shards(tmp: Path, shards: dict[str, list], options: dict, write_shard, progress,
                 source: str = "source") -> list[str]:
    """Write under `tmp` every shard an interrupted run with these options did not leave whole
    (resume_state; `source` names what it was made from), each by `write_shard(path, items,
    on_bytes)` into a .tmp renamed in, the state file rewritten after each, so a run stopped
    anywhere resumes from its last whole shard. convert's and a GGUF import's; the names written."""
    kept = resume_state(tmp, options, progress, source)
    tmp.mkdir(parents=True, exist_ok=True)
    state = {"options": options, "shards": kept}
    write_json_atomic(tmp / STATE_FILE, state)  # first: a .partial without it is not ours
    written = []
    for i, (name, items) in enumerate(shards.items(), 1):
        if name in kept:
            continue
        part = tmp / (name + ".tmp")
        write_shard(part, items, (lambda done, total, name=name, i=i: progress(
            "shard", index=i, shards=len(shards), name=name, done=done, total=total)) if progress else None)
        os.replace(part, tmp / name)
        state["shards"][name] = file_sha256(tmp / name)
        write_json_atomic(tmp / STATE_FILE, state)
        written.append(name)
    return written


def _finish(conv: Converter, shards: dict[str, list[Item]], tmp: Path, spec: QuantSpec) -> None:
    """Index, config.json with the stamp, and the source's other small files (tokenizer, ...)."""
    src = conv.ckpt.directory
    if (src / "model.safetensors.index.json").exists() or len(shards) > 1:
        weight_map = {s.name: shard for shard, items in shards.items() for item in items for s in item.specs}
        total = sum(s.nbytes for items in shards.values() for item in items for s in item.specs)
        write_json_atomic(tmp / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    config = dict(conv.ckpt.config)
    if conv.fp8 is not None:  # the container's weights are int8/int4 + bf16 now, not FP8
        config.pop("quantization_config", None)
        config["torch_dtype"] = "bfloat16"
    config[CONFIG_KEY] = spec.config_entry(conv.fingerprint)
    write_json_atomic(tmp / "config.json", config)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, tmp / f.name)
    (tmp / STATE_FILE).unlink(missing_ok=True)
