"""Fuzzing the GGUF input kind (issue 37, item 6): mutated headers, counts, metadata values and
types, tensor dims, types and offsets, and truncations of a valid export of the tiny model,
through `colibri convert` and then `colibri run` on whatever convert wrote.

The property: convert exits 0, or exits 2 with one `colibri convert: error:` line naming the
file; no traceback, no hang, peak RSS bounded (each call forked under the fuzz harness's
address-space limit and alarm, tests/colibri_fuzz.py); and a model convert wrote runs (exit 0):
convert never writes a config or tensors our own `run` refuses.

CI runs a few derandomized batches (about 20 s on the CI box); `make fuzz` (COLIBRI_FUZZ_EXAMPLES)
runs more, randomly. Outcomes go to COLIBRI_FUZZ_REPORT under the kinds "GGUF (convert)" and
"GGUF (run after convert)".
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from colibri_fuzz import Call, assert_batch
from colibri_tiny import RUN_ARGS, make_tiny
from gguf_craft import CODES, Doc, array, entry, take_apart
from gguf_export import export

CAMPAIGN = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "0"))
FILES_PER_BATCH = 8
CALL_S = 20
A = "qwen3moe."


def batches(ci_examples: int, campaign_share: float = 0.02):
    """A batch is a list of files run through one fork server: CI runs a few, derandomized, and
    does not shrink (the failure message lists every failing call)."""
    examples = max(ci_examples, int(CAMPAIGN * campaign_share)) if CAMPAIGN else ci_examples
    return settings(max_examples=examples, deadline=None, derandomize=not CAMPAIGN, database=None,
                    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if CAMPAIGN else []),
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-fuzz")
    return export(make_tiny(root / "hf"), root / "m.gguf", T.F16)


# --- values and mutations ------------------------------------------------------------------------

INTS = [0, 1, 2, 3, 4, 7, 8, 9, 16, 64, 99, 300, 65536, 65537, 2**31, 2**32 - 1, 2**63, 2**64 - 1, -1, -2**63]
FLOATS = [0.0, -0.0, 1e-6, 0.5, 1.0, 2.0, 1e4, 1e38, -1.0, math.nan, math.inf, -math.inf, 1e-45]
STRINGS = ["", "x", "qwen3moe", "llama", "gpt2", "yarn", "linear", "\udcff"]
SCALAR_TYPES = list(CODES)
# Keys the import reads, present or not in the base file.
KEYS = [A + k for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                        "attention.head_count", "attention.head_count_kv", "rope.freq_base",
                        "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count",
                        "attention.key_length", "attention.value_length", "expert_feed_forward_length",
                        "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
                        "expert_weights_norm", "nextn_predict_layers")] + [
    "general.architecture", "general.alignment", "tokenizer.ggml.model", "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.bos_token_id", "split.count"]
GGML_TYPES = [int(T.F32), int(T.F16), int(T.Q8_0), int(T.BF16), int(T.Q4_K), int(T.MXFP4), int(T.IQ4_NL), 5, 200]


def encode(vtype: int, v) -> bytes:
    """An entry of `vtype` carrying (a wrapped or coerced form of) v: every value fits some way."""
    if vtype == V.STRING:
        return entry(V.STRING, str(v).encode("utf-8", "surrogatepass"))
    code = CODES[V(vtype)]
    if code in "fd":
        v = float(v) if not isinstance(v, str) else math.nan
    elif code == "?":
        v = bool(v)
    else:
        bits = struct.calcsize(code) * 8
        n = int(v) if isinstance(v, (int, bool)) or (isinstance(v, float) and math.isfinite(v)) else 0
        n %= 1 << bits
        if code.islower() and n >= 1 << (bits - 1):  # signed: two's complement
            n -= 1 << bits
        v = n
    return entry(vtype, v)


VALUE = st.one_of(st.sampled_from(INTS), st.sampled_from(FLOATS), st.sampled_from(STRINGS), st.booleans())
MUTATION = st.one_of(
    # a key set to a value of some type (often its own type: then the value rules, not the type, decide)
    st.tuples(st.just("kv"), st.sampled_from(KEYS), st.sampled_from([None, *SCALAR_TYPES, V.STRING]), VALUE),
    st.tuples(st.just("drop"), st.sampled_from(KEYS)),
    # an array whose count lies (or is honest), of some item type
    st.tuples(st.just("array"), st.sampled_from(KEYS + ["x.extra"]), st.sampled_from([V.UINT8, V.UINT32, V.STRING,
                                                                                      V.FLOAT32, V.ARRAY, 13]),
              st.integers(0, 70), st.sampled_from([None, 0, 1, 2**31, 2**32, 2**62, 2**64 - 1])),
    st.tuples(st.just("dims"), st.integers(0, 10**6), st.sampled_from(["swap", "append1", "drop", "set"]),
              st.integers(0, 5), st.sampled_from([0, 1, 2, 3, 32, 300, 2**32, 2**63 - 1, 2**63, 2**64 - 1])),
    st.tuples(st.just("offset"), st.integers(0, 10**6),
              st.sampled_from([1, -1, 2, 31, 32, -32, 64, 2**63, 2**64 - 32, 2**64 - 1, "wrap", "same"])),
    st.tuples(st.just("type"), st.integers(0, 10**6), st.sampled_from(GGML_TYPES)),
    st.tuples(st.just("count"), st.sampled_from(["tensor_count", "kv_count"]),
              st.sampled_from([0, 1, -1, 2**31, 2**40, 2**64 - 1, "+1"])),
    st.tuples(st.just("version"), st.sampled_from([0, 1, 2, 4, 2**32 - 1, 3 << 16])),
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
)


def apply(doc: Doc, op: tuple) -> bytes | None:
    """Mutate doc in place; returns whole-file bytes instead when the mutation is on the bytes."""
    kind = op[0]
    if kind == "kv":
        _, key, vtype, v = op
        if vtype is None:  # the key's own type, when it has one
            vtype = struct.unpack_from("<I", doc.kv[key])[0] if key in doc.kv else V.UINT32
            vtype = V.STRING if vtype == V.ARRAY else vtype
        doc.kv[key] = encode(vtype, v)
    elif kind == "drop":
        doc.kv.pop(op[1], None)
    elif kind == "array":
        _, key, itype, n, claim = op
        items = {V.STRING: ["a"] * n, V.FLOAT32: [0.5] * n}.get(itype, [1] * n)
        if itype in (V.ARRAY, 13):  # nested or unknown item types: the header itself says how many
            doc.kv[key] = struct.pack("<IIQ", V.ARRAY, itype, n if claim is None else claim) + b"\0" * (12 * n)
        else:
            doc.kv[key] = array(itype, items, claim)
    elif kind == "dims":
        _, pick, how, i, v = op
        t = doc.tensors[pick % len(doc.tensors)]
        if how == "swap":
            t.dims = t.dims[::-1]
        elif how == "append1":
            t.dims = t.dims + [1]
        elif how == "drop":
            t.dims = t.dims[:-1]
        else:
            t.dims[i % len(t.dims)] = v
    elif kind == "offset":
        _, pick, delta = op
        t = doc.tensors[pick % len(doc.tensors)]
        if delta == "wrap":  # data start + offset wraps past 2^64 to the file's first byte
            t.offset = (1 << 64) - (len(doc.to_bytes()) - len(doc.data))
        elif delta == "same":
            t.offset = doc.tensors[(pick + 1) % len(doc.tensors)].offset
        else:
            t.offset = (t.offset + delta) % (1 << 64)
    elif kind == "type":
        doc.tensors[op[1] % len(doc.tensors)].ggml_type = op[2]
    elif kind == "count":
        n = len(doc.tensors) if op[1] == "tensor_count" else len(doc.kv)
        setattr(doc, op[1], (n + 1 if op[2] == "+1" else op[2]) % (1 << 64))
    elif kind == "version":
        doc.version = op[1]
    elif kind == "truncate":
        raw = doc.to_bytes()
        return raw[:int(len(raw) * op[1])]
    return None


@batches(ci_examples=3)
@given(files=st.lists(st.lists(MUTATION, min_size=1, max_size=3), min_size=FILES_PER_BATCH,
                      max_size=FILES_PER_BATCH))
def test_fuzz_gguf(base, tmp_path_factory, files):
    root = tmp_path_factory.mktemp("gguf-batch")
    converts = []
    for i, ops in enumerate(files):
        doc, raw = take_apart(base), None
        for op in ops:  # a truncation ends the list: it works on the bytes, not the parts
            if raw is None:
                raw = apply(doc, op)
        path = root / f"f{i}.gguf"
        path.write_bytes(doc.to_bytes() if raw is None else raw)
        converts.append(Call(["convert", str(path), "-o", str(root / f"out{i}")], names=(str(path),),
                             note=repr(ops)[:300], kind="GGUF (convert)"))
    results = assert_batch(converts, call_s=CALL_S)
    runs = [Call(["run", "--model", str(root / f"out{i}"), *RUN_ARGS, "--json"], note=f"after {c.note}",
                 kind="GGUF (run after convert)") for i, (c, r) in enumerate(zip(converts, results)) if r.code == 0]
    ran = assert_batch(runs, call_s=CALL_S) if runs else []
    refused = [f"{r.call.note}: {r.stderr.strip()}" for r in ran if r.code != 0]
    assert not refused, "convert wrote a model our own run refuses:\n" + "\n".join(refused)
