"""`colibri convert` from a published FP8 checkpoint to int8 / int4 (engine/format/convert.py), and
`colibri quality` of the conversions against the FP8 model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from engine.base.config import EngineConfig
from engine.format.convert import convert
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from engine.run.quality import measure_quality
from engine.synth.bpe_tokenizer import build_tokenizer
from colibri_fp8 import write_sharded_fp8
from colibri_hf_models import build
from test_fp8 import BLOCK, _mtp_tensors

PROMPT = [(7 * i + 3) % 256 for i in range(16)]


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory):
    """deepseek_v3 FP8 with an MTP layer; its values also as an fp32 checkpoint (the oracle dir)."""
    root = tmp_path_factory.mktemp("fp8-convert")
    build("deepseek_v3", root / "src", moe_intermediate_size=64, vocab_size=300)
    build_tokenizer(300).save(str(root / "src" / "tokenizer.json"))  # quality scores text
    layers = json.loads((root / "src" / "config.json").read_text())["num_hidden_layers"]
    write_sharded_fp8(root / "src", root / "fp8", BLOCK, extra=_mtp_tensors(root / "src", layers),
                         config_overrides={"num_nextn_predict_layers": 1}, oracle_dir=root / "values")
    return root, layers


def _tensors(d):
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32), ("int4", 64)])
def test_fp8_converts_like_its_dequantized_values(fp8_source, quant, group):
    root, layers = fp8_source
    a = convert(root / "fp8", root / f"from-fp8-{quant}{group}", quant, group or 64, "experts")
    b = convert(root / "values", root / f"from-values-{quant}{group}", quant, group or 64, "experts")
    assert a["source_quant"] == f"fp8-e4m3-b{BLOCK[0]}x{BLOCK[1]}" and a["skipped"]["mtp_layers"] == [layers]
    ta, tb = _tensors(root / f"from-fp8-{quant}{group}"), _tensors(root / f"from-values-{quant}{group}")
    # Every matrix quantized from the FP8 file is the one quantized from its dequantized values.
    q = [n for n in tb if n.endswith((".qweight", ".qscale"))]
    assert q and set(q) <= set(ta) and all(torch.equal(ta[n], tb[n]) for n in q)
    assert not any(n.endswith("_scale_inv") or n.startswith(f"model.layers.{layers}.") for n in ta)
    config = json.loads((root / f"from-fp8-{quant}{group}" / "config.json").read_text())
    assert "quantization_config" not in config and config["colibri_quant"]["quant"] == quant


def test_scope_experts_keeps_dense_fp8_as_bf16_and_is_deterministic(fp8_source):
    root, _ = fp8_source
    one = convert(root / "fp8", root / "e1", "int4", 32, "experts")
    two = convert(root / "fp8", root / "e2", "int4", 32, "experts")
    for f in sorted((root / "e1").glob("*.safetensors")):
        assert f.read_bytes() == (root / "e2" / f.name).read_bytes()
    assert one["bytes"] == two["bytes"]
    t = _tensors(root / "e1")
    o_proj = t["model.layers.0.self_attn.o_proj.weight"]
    values = _tensors(root / "values")["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj.dtype == torch.bfloat16 and torch.equal(o_proj, values.to(torch.bfloat16))
    with Engine(root / "e1", EngineConfig(ctx_size=64, threads=1, dtype="fp32")) as engine:
        assert engine.quant.label == "int4-g32"
        assert len(generate(engine, PROMPT, 4, Sampler()).output_ids) == 4


def test_quality_compares_an_fp8_model_with_its_conversion(fp8_source):
    root, _ = fp8_source
    convert(root / "fp8", root / "q8", "int8", 64, "experts")
    r = measure_quality(root / "q8", root / "fp8", tokens=64, ctx=32, dtype="fp32", threads=1)
    assert r["reference"]["quant"] == f"fp8-e4m3-b{BLOCK[0]}x{BLOCK[1]}" and r["model"]["quant"] == "int8"
    assert 0.0 <= r["kl_mean"] < 0.05 and r["top1_agreement"] > 0.8
