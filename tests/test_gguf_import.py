"""GGUF import (engine/format/gguf/): block math, every supported type on a tiny model, each MoE
architecture against transformers, split files, the tokenizer, resume, and bad files.

The GGUF files are written by tests/gguf_export.py the way llama.cpp's convert_hf_to_gguf.py
lays them out (the real converter + llama-quantize round trip is benchmarks/formats/gguf_roundtrip.py).
Tolerance against transformers: fp32 compute, max |logit difference| <= 1e-4 (test_archs.py's),
with transformers given the same bf16-rounded weights the import writes.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from tokenizers import Tokenizer

import engine.format.gguf.importer as importer
from engine import synth
from engine.base.config import EngineConfig
from engine.base.errors import ModelFormatError
from engine.run.generate import Sampler, generate
from engine.weights.mxfp4 import mxfp4_dequantize
from engine.format.gguf.dequant import dequantize
from engine.format.gguf.gpt_oss_experts import ggml_mxfp4_to_hf
from engine.format.gguf.reader import GGUFModel
from engine.run.runtime import Engine
from colibri_hf_models import build, hf_greedy, hf_logits
from gguf_export import export, hf_tensors, kquant_pack, kquant_values
from colibri.cli import main as cli_main

PROMPT = [(7 * i + 3) % 256 for i in range(32)]
ATOL = 1e-4
# 256-wide rows: the K-quants' super-block; 2 layers, 4 experts, bf16 like a published checkpoint.
GEOMETRY = {**synth.load_preset("tiny"), "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "head_dim": 64, "num_experts": 4, "dtype": "bfloat16", "max_shard_size": 1 << 30}
LOSSLESS = (T.F32, T.BF16)
GREEDY_SAME = (T.F32, T.F16, T.BF16, T.Q8_0)
# Relative RMS error of the weights after the round trip, by type: bounds a little above what each
# bit width gives on Gaussian weights; more bits must give less error.
MAX_REL_RMS = {T.F16: 1e-3, T.Q8_0: 0.01, T.Q6_K: 0.04, T.Q5_K: 0.06, T.Q4_K: 0.12, T.Q4_0: 0.2, T.MXFP4: 0.25}


def engine_of(d: Path) -> Engine:
    return Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1))


def greedy(d: Path, n: int = 16) -> list[int]:
    with engine_of(d) as e:
        return generate(e, PROMPT, n, Sampler()).output_ids


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return synth.synthesize(GEOMETRY, tmp_path_factory.mktemp("gguf") / "src", progress=False)


# --- block math: from codes chosen here, by ggml-common.h's layouts ---------------------------------

def _tensor_of(tmp_path: Path, qtype: T, blocks: np.ndarray, rows: int, cols: int) -> GGUFModel:
    w = gguf.GGUFWriter(tmp_path / "t.gguf", "qwen3moe")
    w.add_tensor("x.weight", blocks.reshape(rows, -1), raw_shape=(rows, blocks.size // rows), raw_dtype=qtype)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return GGUFModel(tmp_path / "t.gguf").tensors["x.weight"]


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_kquant_blocks_decode_to_their_codes(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    B = 6
    top = {T.Q4_K: 16, T.Q5_K: 32}.get(qtype)
    codes = dict(d=rng.uniform(1e-3, 1e-2, B).astype(np.float16))
    if qtype == T.Q6_K:
        codes.update(q=rng.integers(-32, 32, (B, 256)), sc=rng.integers(-128, 128, (B, 16)))
    else:
        codes.update(q=rng.integers(0, top, (B, 256)), sc=rng.integers(0, 64, (B, 8)),
                     dmin=rng.uniform(1e-3, 1e-2, B).astype(np.float16), mn=rng.integers(0, 64, (B, 8)))
    t = _tensor_of(tmp_path, qtype, kquant_pack(qtype, **codes), 2, 768)
    expected = kquant_values(qtype, **codes).reshape(2, 768)
    assert torch.equal(dequantize(t), torch.from_numpy(expected))


def test_simple_blocks_decode_to_their_codes(tmp_path):
    rng = np.random.default_rng(1)
    d = rng.uniform(0.01, 0.1, 4).astype(np.float16)
    q8 = rng.integers(-127, 128, (4, 32)).astype(np.int8)
    blocks = np.concatenate([d.view(np.uint8).reshape(4, 2), q8.view(np.uint8)], 1)
    got = dequantize(_tensor_of(tmp_path, T.Q8_0, blocks, 2, 64))
    assert torch.equal(got, torch.from_numpy((d.astype(np.float32)[:, None] * q8).reshape(2, 64)))
    q4 = rng.integers(0, 16, (4, 32)).astype(np.uint8)  # element j in the low nibble of byte j, j+16 the high
    blocks = np.concatenate([d.view(np.uint8).reshape(4, 2), q4[:, :16] | (q4[:, 16:] << 4)], 1)
    got = dequantize(_tensor_of(tmp_path, T.Q4_0, blocks, 2, 64))
    assert torch.equal(got, torch.from_numpy((d.astype(np.float32)[:, None] * (q4.astype(np.float32) - 8)).reshape(2, 64)))
    e2m1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    e = rng.integers(120, 130, 4).astype(np.uint8)  # e8m0 scale 2^(e-127)
    blocks = np.concatenate([e[:, None], q4[:, :16] | (q4[:, 16:] << 4)], 1)
    got = dequantize(_tensor_of(tmp_path, T.MXFP4, blocks, 2, 64))
    assert torch.equal(got, torch.from_numpy((e2m1[q4] * np.exp2(e.astype(np.float32) - 127)[:, None]).reshape(2, 64)))


def test_ggml_mxfp4_rows_become_hf_blocks(tmp_path):
    """gpt-oss's experts kept as stored: ggml's nibble order (value j low, j+16 high) re-packed as
    HF's (2b low, 2b+1 high) decode, by the engine's MXFP4 path, to what gguf-py decodes."""
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 16, (6, 32)).astype(np.uint8)
    e = rng.integers(115, 135, 6).astype(np.uint8)
    blocks = np.concatenate([e[:, None], codes[:, :16] | (codes[:, 16:] << 4)], 1)  # block_mxfp4
    t = _tensor_of(tmp_path, T.MXFP4, blocks, 2, 96)
    hf_blocks, hf_scales = ggml_mxfp4_to_hf(t.data)
    assert hf_blocks.shape == (2, 3, 16) and torch.equal(hf_scales.flatten(), torch.from_numpy(e))
    assert torch.equal(hf_blocks.reshape(6, 16), torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4)))
    assert torch.equal(mxfp4_dequantize(hf_blocks, hf_scales, torch.float32), dequantize(t))


# --- every supported type on a tiny model ---------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4],
                         ids=lambda q: q.name)
def test_roundtrip_each_type(source, tmp_path, qtype):
    out = importer.import_gguf(export(source, tmp_path / "m.gguf", qtype), tmp_path / "out")
    assert out["source"]["types"].get(qtype.name if qtype != T.F32 else "F32")
    a, b = hf_tensors(source), hf_tensors(tmp_path / "out")
    assert set(a) == set(b) and all(b[k].dtype == torch.bfloat16 and b[k].shape == a[k].shape for k in a)
    if qtype in LOSSLESS:
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:
        weights = [k for k in a if a[k].ndim == 2]
        rel = max(((a[k].float() - b[k].float()).norm() / a[k].float().norm()).item() for k in weights)
        assert rel <= MAX_REL_RMS[qtype], f"{qtype.name}: relative RMS error {rel:.4f}"
    if qtype in GREEDY_SAME:
        assert greedy(tmp_path / "out") == greedy(source)


def test_more_bits_less_error(source, tmp_path):
    errs = {}
    for q in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0):
        importer.import_gguf(export(source, tmp_path / f"{q.name}.gguf", q), tmp_path / q.name)
        a, b = hf_tensors(source), hf_tensors(tmp_path / q.name)
        errs[q] = sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in a if a[k].ndim == 2)
    assert errs[T.Q4_K] > errs[T.Q5_K] > errs[T.Q6_K] > errs[T.Q8_0], errs


def test_tokenizer_rebuilt(source, tmp_path):
    importer.import_gguf(export(source, tmp_path / "m.gguf", T.Q8_0), tmp_path / "out")
    original, rebuilt = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (source, tmp_path / "out"))
    text = "def main(argv):\n    return {'x': [1, 2, 3]}  # café <|endoftext|>"
    assert rebuilt.encode(text).ids == original.encode(text).ids
    assert rebuilt.decode(rebuilt.encode(text).ids) == original.decode(original.encode(text).ids)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == 256


def test_unknown_pre_tokenizer_writes_no_tokenizer(source, tmp_path):
    s = importer.import_gguf(export(source, tmp_path / "m.gguf", T.F16, pre="some-new-model"), tmp_path / "out")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert "some-new-model" in s["tokenizer"]


def test_split_gguf_equals_single(source, tmp_path):
    export(source, tmp_path / "one.gguf", T.Q8_0)
    export(source, tmp_path / "m.gguf", T.Q8_0, split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    importer.import_gguf(tmp_path / "one.gguf", tmp_path / "a")
    importer.import_gguf(parts[1], tmp_path / "b")  # any part names the whole model
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    parts[-1].unlink()
    with pytest.raises(ModelFormatError, match="missing part"):
        importer.import_gguf(parts[0], tmp_path / "c")


def test_resume_keeps_finished_shards(source, tmp_path, monkeypatch):
    g = export(source, tmp_path / "m.gguf", T.Q8_0)
    importer.import_gguf(g, tmp_path / "clean", max_shard_bytes=1 << 20)
    assert len(list((tmp_path / "clean").glob("model-*.safetensors"))) > 2
    real, calls = importer._write_shard, []

    def dies_on_third(path, items, progress):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real(path, items, progress)
    monkeypatch.setattr(importer, "_write_shard", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        importer.import_gguf(g, tmp_path / "out", max_shard_bytes=1 << 20)
    monkeypatch.setattr(importer, "_write_shard", real)
    events = []
    s = importer.import_gguf(g, tmp_path / "out", max_shard_bytes=1 << 20,
                             progress=lambda ev, **f: events.append((ev, f.get("ok"))))
    assert s["shards_kept"] == 2 and events.count(("check", True)) == 2
    for f in (tmp_path / "clean").iterdir():  # deterministic: same bytes as the uninterrupted run
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name


def test_convert_gguf_to_int8_container(source, tmp_path, capsys):
    g = export(source, tmp_path / "m.gguf", T.Q8_0)
    assert cli_main(["convert", str(g), "-o", str(tmp_path / "int8"), "--quant", "int8", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["label"] == "int8" and summary["imported"]["model_type"] == "qwen3_moe"
    assert not (tmp_path / "int8.gguf-bf16").exists()
    assert len(greedy(tmp_path / "int8", 4)) == 4


def test_int4_group_refused_before_import(tmp_path, capsys):
    model = synth.synthesize({**GEOMETRY, "moe_intermediate_size": 96}, tmp_path / "src", progress=False)
    g = export(model, tmp_path / "m.gguf", T.Q8_0)
    assert cli_main(["convert", str(g), "-o", str(tmp_path / "o"), "--quant", "int4", "--group-size", "64"]) == 2
    assert "does not divide" in capsys.readouterr().err
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir())  # nothing imported, nothing left


# --- each MoE architecture against transformers ---------------------------------------------------

ARCHS = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe"]
# llama.cpp's deepseek2 keeps one YaRN log multiplier (0.1 * mscale_all_dim) and so assumes
# mscale == mscale_all_dim, as in DeepSeek-V3's published config (both 1.0): build it so.
OVERRIDES = {
    # llama.cpp's qwen3moe has no dense-MLP tensors (gguf-py maps none), so its GGUFs have no mlp_only_layers.
    "qwen3_moe": {"mlp_only_layers": []},
    "deepseek_v3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                        "original_max_position_embeddings": 128, "mscale": 0.707,
                                        "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_arch_roundtrip_matches_transformers(tmp_path, arch):
    model = build(arch, tmp_path / "hf", **OVERRIDES.get(arch, {}))
    with torch.no_grad():  # the import writes bf16: give transformers the same weights
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    s = importer.import_gguf(export(tmp_path / "hf", tmp_path / "m.gguf", T.F32), tmp_path / "out")
    assert "no tokenizer" in s["tokenizer"]
    with engine_of(tmp_path / "out") as e:
        diff = (e.forward(PROMPT, 0) - hf_logits(model, PROMPT)).abs().max().item()
        assert diff <= ATOL, f"{arch}: max |dlogit| {diff:.3e}"
        assert generate(e, PROMPT, 16, Sampler()).output_ids == hf_greedy(model, PROMPT, 16)


def test_mixtral_qk_permutation_is_undone(tmp_path):
    build("mixtral", tmp_path / "hf")
    importer.import_gguf(export(tmp_path / "hf", tmp_path / "m.gguf", T.F32), tmp_path / "out")
    raw = GGUFModel(tmp_path / "m.gguf").tensors["blk.0.attn_q.weight"]
    a, b = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "out")
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dequantize(raw).to(torch.bfloat16), a[name].to(torch.bfloat16))  # the file is permuted
    assert torch.equal(b[name], a[name].to(torch.bfloat16))


def test_glm_nextn_layer_skipped(tmp_path):
    build("glm4_moe", tmp_path / "hf")
    g = export(tmp_path / "hf", tmp_path / "m.gguf", T.F32, extra_layers=1)
    s = importer.import_gguf(g, tmp_path / "out")
    assert s["skipped"] and all("multi-token-prediction" in x for x in s["skipped"])
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 3


# --- bad files: one line, exit 2 -------------------------------------------------------------------

def _cli_error(capsys, path: Path, out: Path) -> str:
    assert cli_main(["convert", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_truncated_file(source, tmp_path, capsys):
    g = export(source, tmp_path / "m.gguf", T.Q8_0)
    data = g.read_bytes()
    for n, why in ((len(data) - 1000, "truncated"), (len(data) // 2, "truncated"), (200, "truncated"),
                   (3, "not a readable GGUF")):
        (tmp_path / "cut.gguf").write_bytes(data[:n])
        assert why in _cli_error(capsys, tmp_path / "cut.gguf", tmp_path / "o")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_unknown_architecture(source, tmp_path, capsys):
    g = export(source, tmp_path / "m.gguf", T.F16, arch_override="falcon")
    assert "architecture 'falcon' is not supported" in _cli_error(capsys, g, tmp_path / "o")


def test_every_gguf_record_has_its_config_mapping():
    """The records with GGUF names (engine/arch/families/, registry.BY_GGUF_ARCH) are what import takes:
    each has its metadata → config.json function in gguf_names.CONFIGS, which names no other, and
    one model_type to write."""
    from engine.arch.registry import BY_GGUF_ARCH
    from engine.format.gguf.gguf_names import CONFIGS, FUSED_EXPERTS
    names = {a.name for a in BY_GGUF_ARCH.values()}
    assert set(CONFIGS) == names and set(FUSED_EXPERTS) <= names
    assert all(a.model_types == (a.name,) for a in BY_GGUF_ARCH.values())


def test_unsupported_type_named(source, tmp_path, capsys):
    w = gguf.GGUFWriter(tmp_path / "iq.gguf", "qwen3moe")
    w.add_tensor("token_embd.weight", np.zeros((4, 144), np.uint8), raw_shape=(4, 144), raw_dtype=T.IQ4_NL)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    err = _cli_error(capsys, tmp_path / "iq.gguf", tmp_path / "o")
    assert "IQ4_NL" in err and "Q4_K" in err


def test_not_a_gguf(tmp_path, capsys):
    (tmp_path / "x.gguf").write_bytes(b"not gguf at all" * 10)
    assert "GGUF magic invalid" in _cli_error(capsys, tmp_path / "x.gguf", tmp_path / "o")


def test_unmapped_tensor_refused(source, tmp_path):
    g = export(source, tmp_path / "m.gguf", T.F16, extra_tensors={"blk.0.mystery.weight": torch.ones(4, 4)})
    with pytest.raises(ModelFormatError, match="mystery"):
        importer.import_gguf(g, tmp_path / "o")
