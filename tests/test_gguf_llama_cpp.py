"""GGUF import of gpt-oss and glm-dsa against llama.cpp's own converter.

A tiny gpt_oss (experts in MXFP4 as published, and plain bf16) and a tiny glm_moe_dsa (MLA + the
DSA indexer, a dense first layer, a "shared" indexer layer) are synthesized, converted by
llama.cpp's convert_hf_to_gguf.py (tests/gguf_llama.py: the vendored tree as shipped, one
process for every conversion) to F16, BF16 and Q8_0, and imported back with `colibri convert`:
16 greedy tokens must equal the original's; BF16 (lossless for bf16 weights) must give back
every tensor bit for bit, MXFP4 blocks and scales included. Where llama-quantize is built too,
the imported MXFP4 experts must dequantize to exactly what ggml's own dequantizer gives.
Skipped, tagged [requires llama_cpp], without the llama.cpp source tree (scripts/setup.sh fetches it).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

import engine.format.gguf.importer as importer
from colibri_requirements import needs
from engine import synth
from engine.weights.mxfp4 import mxfp4_dequantize
from engine.base.config import EngineConfig
from engine.format.gguf.dequant import dequantize
from engine.format.gguf.reader import GGUFModel
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from gguf_export import hf_tensors
from gguf_llama import convert_all, llama_dir, write_glm_tokenizer
from colibri.cli import main as cli_main

pytestmark = pytest.mark.skipif(llama_dir() is None, reason=needs(
    "llama_cpp", "no llama.cpp source tree with convert_hf_to_gguf.py ($LLAMA_CPP_DIR; scripts/setup.sh fetches it)"))

PROMPT = [(7 * i + 3) % 256 for i in range(32)]
TYPES = ("f16", "bf16", "q8_0")
GPT_OSS = {**synth.load_preset("gpt-oss-small"), "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "sliding_window": 8, "vocab_size": 300, "max_position_embeddings": 4096,
           "max_shard_size": 1 << 30,
           "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}}
# index_topk 6 < the 32-token prompt, so the indexer decides what is attended; layer 2 reuses layer 1's pick.
GLM_DSA = {**synth.load_preset("glm-5-small"), "hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 96,
           "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
           "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12,
           "index_n_heads": 4, "index_head_dim": 16, "index_topk": 6, "vocab_size": 300, "max_shard_size": 1 << 30}
MODELS = {"gpt_oss-mxfp4": GPT_OSS, "gpt_oss-plain": {**GPT_OSS, "expert_format": "plain"}, "glm_moe_dsa": GLM_DSA}


def greedy(d: Path) -> list[int]:
    with Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as e:
        return generate(e, PROMPT, 16, Sampler()).output_ids


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict[str, Path], dict[str, list[int]]]:
    root = tmp_path_factory.mktemp("llama-gguf")
    models = {name: synth.synthesize(g, root / name, progress=False) for name, g in MODELS.items()}
    write_glm_tokenizer(models["glm_moe_dsa"], GLM_DSA["vocab_size"])  # the GLM specials the converter wants
    convert_all([(models[n], root / f"{n}-{t}.gguf", t) for n in models for t in TYPES], root / "convert.log")
    return root, models, {n: greedy(d) for n, d in models.items()}


@pytest.mark.parametrize("outtype", TYPES)
@pytest.mark.parametrize("name", MODELS)
def test_round_trip_through_llama_cpp(converted, tmp_path, name, outtype):
    root, models, want = converted
    g = root / f"{name}-{outtype}.gguf"
    s = importer.import_gguf(g, tmp_path / "out")
    assert s["model_type"] == name.split("-")[0] and not s["skipped"]
    assert s["tokenizer"].startswith("gpt2 byte-level BPE")
    if name == "gpt_oss-mxfp4":  # the converter keeps published MXFP4 experts whatever --outtype says
        assert s["source"]["types"]["MXFP4"] == 3 * GPT_OSS["num_hidden_layers"]
    assert greedy(tmp_path / "out") == want[name]
    a, b = hf_tensors(models[name]), hf_tensors(tmp_path / "out")
    assert set(a) == set(b)
    if outtype == "bf16":
        different = [k for k in a if not torch.equal(a[k], b[k])]
        assert not different, f"{name}: {len(different)} tensors changed, e.g. {different[:3]}"
    src_cfg, cfg = (json.loads((d / "config.json").read_text()) for d in (models[name], tmp_path / "out"))
    keys = (("index_n_heads", "index_head_dim", "index_topk", "first_k_dense_replace", "n_routed_experts",
             "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
            if name == "glm_moe_dsa" else
            ("num_local_experts", "num_experts_per_tok", "sliding_window", "intermediate_size", "head_dim"))
    assert {k: cfg[k] for k in keys} == {k: src_cfg[k] for k in keys}
    assert ("quantization_config" in cfg) == (name == "gpt_oss-mxfp4")


def test_glm_dsa_indexer_types_and_tensors(converted, tmp_path):
    root, models, _ = converted
    m = GGUFModel(root / "glm_moe_dsa-f16.gguf")
    assert m.arch == "glm-dsa" and "blk.1.indexer.attn_q_b.weight" in m.tensors
    importer.import_gguf(m.paths[0], tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["indexer_types"] == json.loads((models["glm_moe_dsa"] / "config.json").read_text()).get(
        "indexer_types", ["full"] * GLM_DSA["num_hidden_layers"])
    b = hf_tensors(tmp_path / "out")
    assert b["model.layers.1.self_attn.indexer.k_norm.bias"].shape == (GLM_DSA["index_head_dim"],)


def test_mxfp4_experts_equal_ggml_dequantization(converted, tmp_path):
    """ggml's own dequantizer (llama-quantize requantizing to F32) is the reference."""
    quantize = llama_dir() / "build" / "bin" / "llama-quantize"
    if not quantize.is_file():
        pytest.skip(f"no {quantize} (scripts/build_llama_cpp.sh with EXTRA_TARGETS=llama-quantize)")
    root, _, _ = converted
    g, f32 = root / "gpt_oss-mxfp4-bf16.gguf", tmp_path / "f32.gguf"
    subprocess.run([str(quantize), "--allow-requantize", str(g), str(f32), "F32"], check=True, capture_output=True)
    importer.import_gguf(g, tmp_path / "out")
    ours, ggml = hf_tensors(tmp_path / "out"), GGUFModel(f32).tensors
    assert ggml["blk.0.ffn_gate_exps.weight"].ggml_type == T.F32
    for layer in range(GPT_OSS["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        gate_up = mxfp4_dequantize(ours[p + "gate_up_proj_blocks"], ours[p + "gate_up_proj_scales"], torch.float32)
        down = mxfp4_dequantize(ours[p + "down_proj_blocks"], ours[p + "down_proj_scales"], torch.float32)
        assert torch.equal(gate_up[:, 0::2], dequantize(ggml[f"blk.{layer}.ffn_gate_exps.weight"]))
        assert torch.equal(gate_up[:, 1::2], dequantize(ggml[f"blk.{layer}.ffn_up_exps.weight"]))
        assert torch.equal(down, dequantize(ggml[f"blk.{layer}.ffn_down_exps.weight"]))


def test_gpt_oss_quant_refused_before_import(converted, tmp_path, capsys):
    root, _, _ = converted
    assert cli_main(["convert", str(root / "gpt_oss-mxfp4-bf16.gguf"), "-o", str(tmp_path / "o"),
                     "--quant", "int8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "gpt_oss" in err
    assert not any(tmp_path.iterdir())
