"""GGUF reader bounds and metadata validation (issue 37): every damaged GGUF of the issue, and the
neighbours found while fixing them, is refused by `convert` with exit 2 and one line naming the
problem, before anything is written; the hang cases fail fast under a memory bound.

The files are a valid export of the tiny model taken apart and written back with one thing
changed (tests/gguf_craft.py); the untouched file converts and runs, so each refusal is the
change's doing.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
import torch
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf import GGUFValueType as V
from safetensors.torch import load_file

from colibri_fuzz import Call, assert_batch
from colibri_tiny import RUN_ARGS, make_tiny
from engine.format.gguf.reader import GGUFModel
from engine.format.safetensors_writer import ShardWriter, TensorSpec
from gguf_craft import Doc, array, entry, string, take_apart
from gguf_export import export
from colibri.cli import main as cli_main

A = "qwen3moe."


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gguf-bounds")
    return export(make_tiny(root / "hf"), root / "m.gguf", T.F16)


def header_len(doc: Doc) -> int:
    return len(doc.to_bytes()) - len(doc.data)


def set_kv(key: str, raw: bytes):
    def edit(doc: Doc) -> None:
        doc.kv[key] = raw
    return edit


def set_tensor(name: str, **changes):
    def edit(doc: Doc) -> None:
        t = doc.tensor(name)
        for k, v in changes.items():
            setattr(t, k, v(t) if callable(v) else v)
    return edit


def wrap_offset(doc: Doc) -> None:
    """attn_q's offset chosen so that data start + offset wraps past 2^64 to byte 0 of the file
    (gguf-py's uint64 sum then reads the header as weights: converted with exit 0 before)."""
    doc.tensor("blk.0.attn_q.weight").offset = (1 << 64) - header_len(doc)


def duplicate_tensor(doc: Doc) -> None:
    t = doc.tensor("output_norm.weight")
    doc.tensors.append(type(t)(t.name, list(t.dims), t.ggml_type, t.offset))


def overlap(doc: Doc) -> None:
    doc.tensor("blk.0.attn_k.weight").offset = doc.tensor("blk.0.attn_q.weight").offset


def nested_deep(doc: Doc) -> None:
    inner = struct.pack("<IQ", V.UINT8, 1) + b"\0"
    middle = struct.pack("<IQ", V.ARRAY, 1) + inner
    doc.kv["x.deep"] = struct.pack("<IIQ", V.ARRAY, V.ARRAY, 1) + middle


# name -> (edit, what the error line must say)
CASES = {
    # --- the list ---
    "metadata array claims 2^31 items (64 present)": (set_kv("x.extra", array(V.UINT8, [0] * 64, claim=1 << 31)),
                                                     "array claims 2147483648 items"),
    "block_count 2^32-1": (set_kv(A + "block_count", entry(V.UINT32, (1 << 32) - 1)),
                           "qwen3moe.block_count = 4294967295: must be an integer in [1, 65536]"),
    "tensor offset off by one byte": (set_tensor("blk.0.attn_q.weight", offset=lambda t: t.offset + 1),
                                      "not a multiple of the alignment 32"),
    "tensor offset wrapping past 2^64": (wrap_offset, "'blk.0.attn_q.weight'"),
    "expert_count 0": (set_kv(A + "expert_count", entry(V.UINT32, 0)), "num_experts = 0"),
    "expert_used_count 99 of 8": (set_kv(A + "expert_used_count", entry(V.UINT32, 99)),
                                  "num_experts_per_tok = 99: must be <= the number of experts (8)"),
    "head_count 3 with 2 KV heads": (set_kv(A + "attention.head_count", entry(V.UINT32, 3)),
                                     "num_key_value_heads = 2: must divide num_attention_heads (3)"),
    "rms epsilon NaN": (set_kv(A + "attention.layer_norm_rms_epsilon", entry(V.FLOAT32, math.nan)),
                        "qwen3moe.attention.layer_norm_rms_epsilon = nan: must be a finite number"),
    "rope base -inf": (set_kv(A + "rope.freq_base", entry(V.FLOAT32, -math.inf)),
                       "qwen3moe.rope.freq_base = -inf: must be a finite number > 1"),
    "context length 2^63": (set_kv(A + "context_length", entry(V.UINT64, 1 << 63)),
                            "qwen3moe.context_length = 9223372036854775808"),
    "token_embd dims swapped": (set_tensor("token_embd.weight", dims=lambda t: t.dims[::-1]),
                                "'token_embd.weight' would be written as model.embed_tokens.weight "
                                "with shape [64, 300]"),
    "5-D attention weight": (set_tensor("blk.0.attn_q.weight", dims=lambda t: t.dims + [1, 1, 1]),
                             "'blk.0.attn_q.weight' has 5 dimensions"),
    "head_count 0": (set_kv(A + "attention.head_count", entry(V.UINT32, 0)),
                     "qwen3moe.attention.head_count = 0: must be an integer in [1, 65536]"),
    "a zero-sized tensor dim": (set_tensor("blk.0.attn_norm.weight", dims=[0]), "has dims [0]"),
    # --- found beside them ---
    "3-D attention weight": (set_tensor("blk.0.attn_q.weight", dims=lambda t: t.dims + [1]),
                             "'blk.0.attn_q.weight' would be written as model.layers.0.self_attn.q_proj.weight"),
    "dims whose product wraps to 0 in uint64": (set_tensor("token_embd.weight", dims=[1 << 32, 1 << 32]),
                                                "runs past the end of the file"),
    "offset 2^64-32 (aligned, far past the end)": (set_tensor("output.weight", offset=(1 << 64) - 32),
                                                   "runs past the end of the file"),
    "tensor count 2^40": (lambda d: setattr(d, "tensor_count", 1 << 40), "claims 1099511627776 tensors"),
    "metadata count 2^40": (lambda d: setattr(d, "kv_count", 1 << 40), "claims 1099511627776 metadata entries"),
    "string length 2^62": (set_kv("x.s", struct.pack("<I", V.STRING) + string(b"abc", claim=1 << 62)),
                           "the value of x.s needs 4611686018427387904 bytes"),
    "unknown value type": (set_kv("x.t", struct.pack("<I", 99) + b"\0" * 8), "x.t: unknown value type 99"),
    "arrays nested three deep": (nested_deep, "x.deep: arrays nested deeper than 2"),
    "alignment 3": (set_kv("general.alignment", entry(V.UINT32, 3)), "general.alignment = 3: must be a power of two"),
    "alignment as a string": (set_kv("general.alignment", entry(V.STRING, "32")), "general.alignment has value type 8"),
    "duplicate tensor name": (duplicate_tensor, "'output_norm.weight' appears twice"),
    "overlapping tensors": (overlap, "overlaps tensor"),
    "unknown ggml type": (set_tensor("output_norm.weight", ggml_type=200), "unknown ggml type 200"),
    "Q8_0 row not a whole block": (set_tensor("token_embd.weight", ggml_type=int(T.Q8_0), dims=[48, 300]),
                                   "is not a whole number of Q8_0 blocks of 32"),
    "head_count as a string": (set_kv(A + "attention.head_count", entry(V.STRING, "4")),
                               "qwen3moe.attention.head_count = '4': must be an integer"),
    "head_count as a float": (set_kv(A + "attention.head_count", entry(V.FLOAT32, 4.5)),
                              "qwen3moe.attention.head_count = 4.5: must be an integer"),
    "token list of integers": (set_kv("tokenizer.ggml.tokens", array(V.UINT32, list(range(300)))),
                               "tokenizer.ggml.tokens = [0, 1, 2"),
    "token list longer than token_embd": (set_kv("tokenizer.ggml.tokens",
                                                 array(V.STRING, [f"t{i}" for i in range(301)])),
                                          "tokenizer.ggml.tokens holds 301 tokens, token_embd.weight has 300 rows"),
    "token types shorter than the tokens": (set_kv("tokenizer.ggml.token_type", array(V.INT32, [1] * 299)),
                                            "tokenizer.ggml.token_type has 299 entries for 300 tokens"),
    "eos id outside the vocabulary": (set_kv("tokenizer.ggml.eos_token_id", entry(V.UINT32, 5000)),
                                      "tokenizer.ggml.eos_token_id = 5000 is outside the 300 tokens"),
    "expert_count 4 over 8 stacked experts": (set_kv(A + "expert_count", entry(V.UINT32, 4)),
                                              "implies [4, 64]"),
    "version 1": (lambda d: setattr(d, "version", 1), "version 1; supported: 2, 3"),
    "nextn_predict_layers 1 on a file without MTP layers": (
        set_kv(A + "nextn_predict_layers", entry(V.UINT32, 1)),
        "layer 1 is counted as a multi-token-prediction layer (qwen3moe.nextn_predict_layers = 1)"),
    "block_count 1 over 2 layers of tensors": (set_kv(A + "block_count", entry(V.UINT32, 1)),
                                               "is in layer 1, beyond qwen3moe.block_count (1)"),
    "big-endian file": (lambda d: setattr(d, "version", 3 << 24), "big-endian GGUF"),
    "metadata arrays above 2^22 items in all": (set_kv("x.big", array(V.UINT8, [0] * ((1 << 22) + 1))),
                                                "the metadata arrays hold 419"),
    "scalar string not UTF-8": (set_kv("general.name", entry(V.STRING, b"\xff\xfe")), "is not UTF-8"),
}


def test_parser_agrees_with_gguf_py(base):
    """engine/format/gguf/header.py replaced gguf-py's reader: on a valid file both give the same
    metadata values and the same tensor arrays (dtype, shape, bytes)."""
    ours, theirs = GGUFModel(base), GGUFReader(base)
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, f in fields.items():
        want = f.contents()
        if f.types == [V.FLOAT32]:
            want = float(str(np.float32(want)))
        assert ours.metadata[key] == want, key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == t.tensor_type and mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        assert mine.data.tobytes() == t.data.tobytes(), t.name


def convert_error(capsys, path: Path, out: Path) -> str:
    assert cli_main(["convert", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("colibri convert: error: ") and str(path) in err, err
    return err


def test_untouched_file_writes_back_and_converts(base, tmp_path, capsys):
    doc = take_apart(base)
    assert doc.to_bytes() == base.read_bytes()  # the crafting itself changes nothing
    assert cli_main(["convert", str(base), "-o", str(tmp_path / "out")]) == 0
    assert cli_main(["run", "--model", str(tmp_path / "out"), *RUN_ARGS, "--json"]) == 0


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_gguf_refused_before_writing(base, tmp_path, capsys, case):
    edit, says = CASES[case]
    doc = take_apart(base)
    edit(doc)
    path = doc.write(tmp_path / "x.gguf")
    err = convert_error(capsys, path, tmp_path / "out")
    assert says in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_hang_cases_fail_fast_under_a_memory_bound(base, tmp_path):
    """Before: the 2^31-item array hung at 5.4 GB RSS and block_count 2^32-1 at 3.2 GB. Each call
    here runs in a forked process under the fuzz harness's address-space limit and alarm; a peak
    RSS above 1 GiB or a call over 20 s fails."""
    names = ["metadata array claims 2^31 items (64 present)", "block_count 2^32-1",
             "dims whose product wraps to 0 in uint64", "tensor count 2^40"]
    edits = [CASES[name][0] for name in names]
    # 2^21 real array items: gguf-py's reader took ~760 bytes each (1.5 GiB); converts, bounded.
    names.append("2^21 metadata array items, all present")
    edits.append(set_kv("x.big", struct.pack("<IIQ", V.ARRAY, V.UINT8, 1 << 21) + bytes(1 << 21)))
    calls = []
    for i, (name, edit) in enumerate(zip(names, edits)):
        doc = take_apart(base)
        edit(doc)
        path = doc.write(tmp_path / f"hang{i}.gguf")
        calls.append(Call(["convert", str(path), "-o", str(tmp_path / f"out{i}")], names=(str(path),), note=name,
                          kind="GGUF (examples)"))
    results = assert_batch(calls, call_s=20, peak_bound=1 << 30)
    assert [r.code for r in results] == [2, 2, 2, 2, 0], [(r.call.note, r.code, r.stderr) for r in results]


def test_shard_writer_writes_zero_sized_tensors(tmp_path):
    """A zero-sized tensor used to die in memoryview().cast with a TypeError."""
    specs = [TensorSpec("empty", (0, 4), "bfloat16"), TensorSpec("x", (2, 2), "bfloat16")]
    with ShardWriter(tmp_path / "s.safetensors", specs) as w:
        w.write("empty", torch.zeros(0, 4))
        w.write("x", torch.ones(2, 2))
    back = load_file(tmp_path / "s.safetensors")
    assert back["empty"].shape == (0, 4) and torch.equal(back["x"], torch.ones(2, 2, dtype=torch.bfloat16))
