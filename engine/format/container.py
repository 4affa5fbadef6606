"""Quantized containers: the stamp, the tensor names, and the checks a reader runs.

A container is a Hugging Face directory whose routed experts (scope "experts") or every linear
weight but the embeddings and routers (scope "all") are stored as two tensors per matrix:

    <name>.qweight   int8 codes I8 [N, K]          | int4 nibbles U8 [N, K/2]
    <name>.qscale    scales BF16 [N]               | scales and zeros BF16 [K/group, N, 2]

where <name> is the source tensor's name without ".weight". Every shard's safetensors
`__metadata__` carries the stamp (see STAMP_KEYS) and config.json repeats it under
"colibri_quant"; a reader refuses a container whose stamps disagree or that it does not know.
Layout and rationale: docs/FORMAT.md.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.base.errors import ModelFormatError
from engine.base.inputs import printable
from engine.format.checkpoint import read_tensor
from engine.weights.quantized import (GROUP_SIZES, QUANTS, SCALE_DTYPE, QuantWeight, check_group, check_scales, int4_strips_on,
                                  dequantize, stored_shapes)

FORMAT_NAME = "colibri.quant"
FORMAT_VERSION = 1
SCOPES = ("experts", "all")
CONFIG_KEY = "colibri_quant"
# Keys of the stamp in every shard's __metadata__ (safetensors metadata values are strings).
STAMP_KEYS = ("colibri_format", "format_version", "quant", "group_size", "scope", "source_fingerprint",
              "source_sha256")

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")

QWEIGHT, QSCALE = "qweight", "qscale"
QWEIGHT_DTYPE = {"int8": "I8", "int4": "U8"}


@dataclass(frozen=True)
class QuantSpec:
    quant: str
    group_size: int  # 0 for int8 (one scale per row)
    scope: str

    def __post_init__(self):
        if self.quant not in QUANTS:
            raise ModelFormatError(f"unknown quant {self.quant!r} (known: {', '.join(QUANTS)})")
        if self.scope not in SCOPES:
            raise ModelFormatError(f"unknown quant scope {self.scope!r} (known: {', '.join(SCOPES)})")
        if self.quant == "int4" and self.group_size not in GROUP_SIZES:
            raise ModelFormatError(f"int4 group size {self.group_size} is not one of {GROUP_SIZES}")

    @property
    def label(self) -> str:
        return "int8" if self.quant == "int8" else f"int4-g{self.group_size}"

    def config_entry(self, fingerprint: str) -> dict:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "quant": self.quant,
                "group_size": self.group_size, "scope": self.scope, "source_fingerprint": fingerprint}

    def stamp(self, fingerprint: str, source_sha256: str) -> dict[str, str]:
        return {"colibri_format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "quant": self.quant,
                "group_size": str(self.group_size), "scope": self.scope, "source_fingerprint": fingerprint,
                "source_sha256": source_sha256}


def quant_names(name: str) -> tuple[str, str]:
    """`...gate_proj.weight` → the container's (`...gate_proj.qweight`, `...gate_proj.qscale`)."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return f"{base}.{QWEIGHT}", f"{base}.{QSCALE}"


def read_metadata(path: str | Path) -> dict:
    """A safetensors file's `__metadata__` (the checkpoint reader has validated the header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    meta = header.get("__metadata__") or {}
    return meta if isinstance(meta, dict) else {}


def _spec_from_stamp(where: str, stamp: dict) -> QuantSpec:
    if stamp.get("colibri_format") != FORMAT_NAME and stamp.get("format") != FORMAT_NAME:
        raise ModelFormatError(f"{where}: unknown quantization stamp {stamp.get('colibri_format')!r}")
    version = str(stamp.get("format_version"))
    if version != str(FORMAT_VERSION):
        raise ModelFormatError(f"{where}: {FORMAT_NAME} format version {version} is not supported "
                               f"(this engine reads version {FORMAT_VERSION})")
    try:
        return QuantSpec(str(stamp.get("quant")), int(stamp.get("group_size")), str(stamp.get("scope")))
    except (TypeError, ValueError):
        raise ModelFormatError(f"{where}: quantization stamp has a bad group_size {stamp.get('group_size')!r}") from None
    except ModelFormatError as exc:
        raise ModelFormatError(f"{where}: {exc}") from None


def container_spec(ckpt) -> QuantSpec | None:
    """The checkpoint's QuantSpec, None for a plain (unquantized) model; an error if the
    stamps are unknown, disagree between config.json and the shards, or are missing while
    quantized tensors are present."""
    entry = ckpt.config.get(CONFIG_KEY)
    shards = sorted({info.path for info in ckpt.tensors.values()})
    stamps = {p: read_metadata(p) for p in shards}
    stamped = {p: m for p, m in stamps.items() if "colibri_format" in m or "quant" in m}
    has_q = any(n.endswith("." + QWEIGHT) or n.endswith("." + QSCALE) for n in ckpt.tensors)
    if entry is None and not stamped:
        if has_q:
            raise ModelFormatError(f"{ckpt.directory}: has quantized tensors (.{QWEIGHT}/.{QSCALE}) but no "
                                   f"quantization stamp in config.json or the shards' __metadata__")
        return None
    if entry is None:
        raise ModelFormatError(f"{ckpt.directory}/config.json: no {CONFIG_KEY!r} entry, but the shards are "
                               f"stamped as a quantized container")
    if not isinstance(entry, dict):
        raise ModelFormatError(f"{ckpt.directory}/config.json: {CONFIG_KEY!r} is not an object")
    spec = _spec_from_stamp(f"{ckpt.directory}/config.json", {**entry, "colibri_format": entry.get("format")})
    fp = entry.get("source_fingerprint")
    if not isinstance(fp, str) or not _SHA256_HEX.fullmatch(fp):
        raise ModelFormatError(f"{ckpt.directory}/config.json: {CONFIG_KEY}.source_fingerprint "
                               f"{printable(fp)!r} is not a sha256 (64 hex digits)")
    for path in shards:
        if path not in stamped:
            raise ModelFormatError(f"{path}: no quantization stamp in __metadata__ (config.json says {spec.label})")
        shard_spec = _spec_from_stamp(path, stamped[path])
        if shard_spec != spec:
            raise ModelFormatError(f"{path}: stamped {shard_spec.label}/{shard_spec.scope}, but config.json says "
                                   f"{spec.label}/{spec.scope}")
        # Every shard was made from the same source as config.json says (docs/FORMAT.md): a shard
        # from another conversion, or an edited stamp, is refused rather than mixed in.
        if stamped[path].get("source_fingerprint") != fp:
            raise ModelFormatError(f"{path}: source_fingerprint "
                                   f"{printable(stamped[path].get('source_fingerprint'))!r} differs from "
                                   f"config.json's ({fp[:16]}...): the shard comes from another source or was edited")
    return spec


def check_quantized(ckpt, spec: QuantSpec, name: str, shape: tuple[int, int]):
    """The (qweight, qscale) TensorInfos standing for weight `name` of shape [N, K], checked.

    Missing tensors, wrong dtypes or shapes, and a group size that does not divide K are each
    one line naming the tensor.
    """
    n, k = shape
    qname, sname = quant_names(name)
    where = f"{ckpt.directory}: {qname[: -len(QWEIGHT) - 1]}"
    if qname not in ckpt:
        raise ModelFormatError(f"{where}: missing tensor {qname!r} of a {spec.label} container")
    if sname not in ckpt:
        raise ModelFormatError(f"{where}: missing scales {sname!r} of a {spec.label} container")
    if spec.quant == "int4":
        check_group(k, spec.group_size, where)
    q, s = ckpt.info(qname), ckpt.info(sname)
    want_q, want_s = stored_shapes(spec.quant, spec.group_size, n, k)
    if q.dtype != QWEIGHT_DTYPE[spec.quant] or q.shape != want_q:
        raise ModelFormatError(f"{where}: {QWEIGHT} is {q.dtype} {list(q.shape)}, a {spec.label} [{n}x{k}] "
                               f"matrix needs {QWEIGHT_DTYPE[spec.quant]} {list(want_q)}")
    if s.torch_dtype != SCALE_DTYPE or s.shape != want_s:
        raise ModelFormatError(f"{where}: {QSCALE} is {s.dtype} {list(s.shape)}, a {spec.label} [{n}x{k}] "
                               f"matrix needs BF16 {list(want_s)}")
    return q, s


def dense_quantized(ckpt, spec: QuantSpec | None, names: list[str]) -> dict:
    """Of the resident tensors `names`, those stored quantized (scope "all"): name → (qweight,
    qscale) infos, checked. A name stored neither way is the checkpoint's missing-tensor error."""
    out = {}
    for name in names:
        if name in ckpt:
            continue
        qname = quant_names(name)[0]
        if spec is None or qname not in ckpt:
            ckpt.info(name)  # raises: missing tensor
        q = ckpt.info(qname)
        if len(q.shape) != 2:
            raise ModelFormatError(f"{q.path}: {qname!r} has shape {list(q.shape)}, a quantized matrix is 2-D")
        k = q.shape[1] * (2 if spec.quant == "int4" else 1)
        out[name] = check_quantized(ckpt, spec, name, (q.shape[0], k))
    return out


# MLA's kv_b_proj is never multiplied as a matrix: its absorbed form views it per head
# (engine/arch/mla.py). Quantized by `convert --scope all` like every projection, it is
# dequantized once at load into the compute dtype (and counted so by the plan), as FP8
# checkpoints' is (engine/format/fp8_checkpoint.py).
_DEQUANTIZED_AT_LOAD = re.compile(r"kv_b_proj\.qweight$")


def dequantized_at_load(infos) -> bool:
    return bool(_DEQUANTIZED_AT_LOAD.search(infos[0].name))


def load_dense(ckpt, spec: QuantSpec, infos, dtype, alloc=None):
    """One resident quantized matrix, ready for its kernel (or a plain tensor in `dtype`, for
    the one the model reads as a tensor). `alloc` makes the codes' and scales' storage."""
    q, s = infos
    alloc = None if dequantized_at_load(infos) else alloc  # the codes die here: not worth arena space
    joined = None
    if spec.quant == "int4" and not dequantized_at_load(infos):
        # codes then scales in one allocation: the strips are repacked there, in place
        joined = torch.empty(q.nbytes + s.nbytes, dtype=torch.uint8) if alloc is None else alloc(q.nbytes + s.nbytes)
        codes, scales = read_tensor(q, lambda n: joined[:n]), read_tensor(s, lambda n: joined[q.nbytes:q.nbytes + n])
    else:
        codes, scales = read_tensor(q, alloc), read_tensor(s, alloc)
    if dequantized_at_load(infos):
        n, k = q.shape[0], q.shape[1] * (2 if spec.quant == "int4" else 1)
        check_scales(scales, spec.quant, (n, k))
        return dequantize(codes, scales, spec.quant, spec.group_size).to(dtype)
    return QuantWeight.prepare(codes, scales, spec.quant, spec.group_size, dtype, joined=joined)


def dense_nbytes(spec: QuantSpec | None, infos, dtype_bytes: int) -> int:
    """RAM of one resident quantized matrix: codes as stored, scales in the compute dtype (or
    the whole matrix in the compute dtype where it is dequantized at load)."""
    q, s = infos
    if dequantized_at_load(infos):
        return q.shape[0] * q.shape[1] * (2 if q.dtype == QWEIGHT_DTYPE["int4"] else 1) * dtype_bytes
    if q.dtype == QWEIGHT_DTYPE["int4"] and int4_strips_on():
        return q.nbytes + s.nbytes  # the strips: as stored, bf16 scales inside
    return q.nbytes + s.nbytes // 2 * dtype_bytes
