"""`colibri convert model.gguf -o DIR`: a GGUF (single or split) → a bf16 HF safetensors directory
(gpt-oss's MXFP4 experts kept as stored).

Same rules as engine/format/convert.py: DIR is checked by engine/base/output_target.py before the GGUF
is even opened (never the GGUF or its directory, `.`, `/`, a file, or a non-empty directory that
is not a previous `convert` output; --force replaces only such an output); written under
`<DIR>.partial/` (which holds `convert-state.json` from its first moment, so a look-alike of the
user's is refused, never emptied) and renamed into place at the end; after each shard the state
records its sha256, and a re-run from the same GGUF keeps every recorded shard whose bytes still
match (resumable); fixed order and no timestamps (deterministic). Shards hold whole items (an
expert's three matrices never straddle two), about `max_shard_bytes` each. With `quant`, the
bf16 directory is an intermediate (`<DIR>.gguf-bf16`, checked like DIR, replaced only when it is
an import) that engine.convert quantizes into DIR and that is removed afterwards.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections import Counter
from pathlib import Path

import torch

from engine.base.durable import DirectoryLock
from engine.base.errors import UnsupportedModelError
from engine.base.output_target import DirectoryTarget, check_not_source, directory_target, replace_directory, stamped
from engine.format.convert import GGUF_SOURCE_KEY, STATE_FILE, convert, convert_output_recogniser, write_shards
from engine.format.gguf.items import Item, Plan
from engine.format.gguf.reader import GGUFModel
from engine.format.gguf.tensors import build_plan
from engine.format.gguf.vocab import build_tokenizer
from engine.arch.registry import model_args
from engine.weights.quantized import check_group
from engine.format.safetensors_writer import ShardWriter, TensorSpec, write_json_atomic

MAX_SHARD_BYTES = 4 << 30
PROVENANCE_KEY = GGUF_SOURCE_KEY
IMPORT_STAMP = stamped("config.json", PROVENANCE_KEY)  # the bf16 intermediate of --quant: only an import


def fingerprint(m: GGUFModel) -> str:
    """Identity of the GGUF: each part's name, size and header (metadata + tensor table)."""
    h = hashlib.sha256()
    for part in m.paths:
        with open(part, "rb") as f:
            h.update(part.name.encode() + part.stat().st_size.to_bytes(8, "little") + f.read(m.header_sizes[part]))
    return h.hexdigest()


def plan_shards(items: list[Item], max_bytes: int) -> dict[str, list[Item]]:
    groups: list[list[Item]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    n = len(groups)
    return {f"model-{i:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups, 1)}


def _write_shard(path: Path, items: list[Item], progress) -> None:
    specs = [TensorSpec(t.name, t.shape, t.dtype) for item in items for t in item.tensors]
    with ShardWriter(path, specs, {"format": "pt"}) as w:
        for i, item in enumerate(items, 1):
            for t in item.tensors:
                if t.chunks is not None:  # written slice by slice (ShardWriter checks the shapes)
                    w.write_rows(t.name, t.chunks())
                    continue
                x = t.load()
                if tuple(x.shape) != tuple(t.shape):  # a bug in the plan, not the user's input
                    raise AssertionError(f"{t.name}: made {tuple(x.shape)}, planned {t.shape}")
                w.write(t.name, x if t.dtype == "uint8" else x.to(torch.bfloat16).contiguous())
            if progress:
                progress(i, len(items))


def _source(src) -> Path:
    return Path(src).expanduser().resolve()


def gguf_target(src, dst, force: bool, recognise=None, flag: str = "-o") -> DirectoryTarget:
    """Where `convert X.gguf -o DST` may write (engine/base/output_target.py), checked first."""
    return directory_target(dst, command="convert", recognise=recognise or convert_output_recogniser(),
                            sources=[_source(src)], force=force, flag=flag)


def import_gguf(src, dst, force: bool = False, progress=None, max_shard_bytes: int = MAX_SHARD_BYTES,
                target: DirectoryTarget | None = None) -> dict:
    """Write the bf16 directory; returns a summary. `progress(event, **fields)` as engine.convert's.
    `target`: dst already checked (import_and_convert's intermediate)."""
    target = target or gguf_target(src, dst, force)
    tmp = target.sibling("partial")
    check_not_source(tmp, [_source(src)], "-o", what="the work directory")
    with DirectoryLock(target.path, f"importing {Path(src).name}"):
        return _import(src, target, tmp, progress, max_shard_bytes)


def _import(src, target: DirectoryTarget, tmp: Path, progress, max_shard_bytes: int) -> dict:
    m = GGUFModel(src)
    check_not_source(target.path, m.paths, "-o")  # every part of a split GGUF, not only the one named
    plan = build_plan(m)
    tokenizer, tokenizer_note = build_tokenizer(m)
    shards = plan_shards(plan.items, max_shard_bytes)
    source = {"file": m.paths[0].name, "parts": len(m.paths), "architecture": m.arch,
              "fingerprint": fingerprint(m),
              "types": dict(sorted(Counter(t.type_name for t in m.tensors.values()).items()))}
    options = {"source": source, "max_shard_bytes": max_shard_bytes}
    written = write_shards(tmp, shards, options, _write_shard, progress, source="GGUF")
    _finish(tmp, plan, shards, source, tokenizer)
    replace_directory(tmp, target)
    dst = target.path
    return {"path": str(dst), "source": source, "model_type": plan.config["model_type"], "dtype": "bfloat16",
            "tensors": sum(len(item.tensors) for item in plan.items), "shards": len(shards),
            "shards_written": len(written), "shards_kept": len(shards) - len(written),
            "bytes": sum(p.stat().st_size for p in dst.glob("*.safetensors")),
            "source_bytes": sum(p.stat().st_size for p in m.paths), "skipped": plan.skipped,
            "tokenizer": tokenizer_note if tokenizer is not None else f"not written: {tokenizer_note}"}


def import_and_convert(src, dst, quant: str | None, group_size: int = 64, scope: str = "experts",
                       force: bool = False, progress=None) -> dict:
    """The `colibri convert x.gguf` command: import to bf16, then optionally quantize."""
    target = gguf_target(src, dst, force)  # before the GGUF is opened
    if quant is None:
        return import_gguf(src, dst, progress=progress, target=target)
    # The bf16 intermediate beside DST: fresh, empty, or an import left by an earlier run (replaced);
    # a directory of the user's that happens to carry the name is refused, never emptied.
    bf16 = gguf_target(src, target.sibling("gguf-bf16"), True, recognise=IMPORT_STAMP)
    args = model_args(build_plan(GGUFModel(src)).config)  # refuse what cannot apply before importing anything
    if args.expert_impl is not None:
        raise UnsupportedModelError(f"{src}: --quant does not apply to {args.model_type} (its experts carry biases "
                                    f"in their own fused layout); import it without --quant and run it as it is")
    if quant == "int4":
        check_group(args.hidden_size, group_size, "gate/up projections of the experts (hidden_size)")
        check_group(args.moe_intermediate_size, group_size, "down projection of the experts (moe_intermediate_size)")
    imported = import_gguf(src, bf16.path, progress=progress, target=bf16)
    summary = convert(bf16.path, target.path, quant, group_size, scope, force=force, progress=progress)
    shutil.rmtree(bf16.path)  # written by this run (checked above, renamed in by import_gguf)
    return {**summary, "imported": {k: imported[k] for k in ("source", "model_type", "tensors", "skipped",
                                                             "tokenizer")}}


def _finish(tmp: Path, plan: Plan, shards: dict[str, list[Item]], source: dict, tokenizer) -> None:
    if len(shards) > 1:
        weight_map = {t.name: shard for shard, items in shards.items() for item in items for t in item.tensors}
        total = sum(item.nbytes for items in shards.values() for item in items)
        write_json_atomic(tmp / "model.safetensors.index.json",
                          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    write_json_atomic(tmp / "config.json", {**plan.config, PROVENANCE_KEY: source})
    if tokenizer is not None:
        tokenizer.save(str(tmp / "tokenizer.json.tmp"))
        os.replace(tmp / "tokenizer.json.tmp", tmp / "tokenizer.json")
    (tmp / STATE_FILE).unlink(missing_ok=True)
