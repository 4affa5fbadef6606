"""`colibri quality`: KL, top-1 agreement and perplexity of a model against a reference."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from engine import synth
from engine.format.convert import convert
from colibri_hf_models import build
from engine.run.quality import measure_quality

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    # Random weights at initializer_range 0.2 (tests/colibri_hf_models.py) give peaked, varied logits, so
    # quantization error shows; synth's tiny preset supplies a byte-level tokenizer of 300 ids.
    tiny = synth.synthesize(synth.load_preset("tiny"), root / "tiny", seed=0, progress=False)
    src = root / "src"
    build("qwen3_moe", src, vocab_size=300, hidden_size=64, moe_intermediate_size=64, mlp_only_layers=[])
    shutil.copyfile(tiny / "tokenizer.json", src / "tokenizer.json")
    (root / "text.txt").write_text(TEXT)
    return {"src": src, "int8": convert(src, root / "int8", "int8")["path"],
            "int4": convert(src, root / "int4", "int4", 32)["path"], "text": str(root / "text.txt")}


def test_model_against_itself_is_exact(models):
    r = measure_quality(models["src"], models["src"], tokens=256, ctx=64, text_file=models["text"], threads=1)
    assert r["kl_mean"] == 0 and r["kl_p99"] == 0 and r["top1_agreement"] == 1.0
    assert r["ppl_ratio"] == 1.0 and r["ppl_model"] == r["ppl_reference"]
    assert r["scored_tokens"] == 4 * 31  # 4 chunks of 64, second halves: positions 32..62 predict 33..63


def test_figures_follow_the_definitions(models):
    r = measure_quality(models["int4"], models["src"], tokens=256, ctx=64, text_file=models["text"], threads=1)
    assert r["kl_mean"] > 0 and r["kl_p99"] >= r["kl_median"] and r["kl_max"] >= r["kl_p99"]
    assert 0 <= r["top1_agreement"] <= 1
    assert math.isclose(r["ppl_ratio"], r["ppl_model"] / r["ppl_reference"])
    assert math.isclose(r["ppl_change"], r["ppl_ratio"] - 1)
    assert r["model"]["quant"] == "int4-g32" and r["reference"]["quant"] == "float32"
    assert r["top1_agreement"] < 1  # the error is visible on this model


def test_int4_is_further_from_the_reference_than_int8(models):
    kl = {q: measure_quality(models[q], models["src"], tokens=256, ctx=64, text_file=models["text"],
                             threads=1)["kl_mean"] for q in ("int8", "int4")}
    assert 0 < kl["int8"] < kl["int4"]


def test_kl_matches_a_direct_computation(models):
    """The first scored position's KL, recomputed here from both engines' logits."""
    from engine.base.config import EngineConfig
    from engine.run.generate import load_tokenizer
    from engine.run.runtime import Engine
    ids = load_tokenizer(models["src"]).encode(TEXT).ids[:64]
    lp = {}
    for q in ("src", "int8"):
        with Engine(models[q], EngineConfig(ctx_size=64, threads=1)) as e:
            lp[q] = torch.log_softmax(e.forward(ids, 0)[32].double(), -1)
    expected = float((lp["src"].exp() * (lp["src"] - lp["int8"])).sum())
    r = measure_quality(models["int8"], models["src"], tokens=64, ctx=64, text_file=models["text"], threads=1)
    assert r["scored_tokens"] == 31
    assert r["kl_max"] >= expected * (1 - 1e-4) - 1e-9


def test_cli_json_and_errors(models, tmp_path):
    cmd = [sys.executable, "-m", "colibri.cli", "quality", "--model", models["int8"], "--reference", models["src"],
           "--tokens", "128", "--ctx", "64", "--text", models["text"], "--threads", "1"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert {"kl_mean", "kl_p99", "top1_agreement", "ppl_model", "ppl_reference", "ppl_change"} <= set(r)
    too_long = subprocess.run(cmd[:-6] + ["--tokens", "100000", "--text", models["text"]], capture_output=True,
                              text=True)
    assert too_long.returncode == 2 and "fewer than --tokens 100000" in too_long.stderr
    assert len(too_long.stderr.strip().splitlines()) == 1
