"""FP8 block-scaled checkpoints as published (engine/format/fp8_checkpoint.py, engine/weights/fp8.py), MTP layers
(engine/format/mtp.py).

Each architecture: a tiny random model built with transformers' classes, written the way the FP8
releases store it (tests/colibri_fp8.py: e4m3 weights + weight_scale_inv F32 per block, blocks of
24x20 so every matrix has several blocks and partial edge blocks in both dimensions, three shards
cut by layer) and compared with transformers run on the very values the FP8 file stands for.

Tolerance: fp32 compute, max |logit difference| <= 1e-4, as test_archs.py (measured 5e-6..1.5e-5:
the engine sums each block's products before scaling them, transformers multiplies the
dequantized weights; MLA's absorbed form adds its own reordering).
"""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from engine.base.config import EngineConfig
from engine.base.errors import ModelFormatError
from engine.weights import fp8
from engine.format.checkpoint import Checkpoint
from engine.format.layout import ExpertLayout
from engine.arch.args import ModelArgs
from engine import native
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_fp8 import oracle_model, write_sharded_fp8
from colibri_requirements import needs
from colibri_hf_models import PROMPT, assert_greedy_match, assert_logits_match, build, fp32_engine, hf_logits
from test_streaming import PLACEMENTS, budget_for_cache

BLOCK = (24, 20)
ARCHS = ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "qwen3_moe"]


@pytest.fixture(scope="module", params=ARCHS)
def fp8_model(request, tmp_path_factory):
    arch = request.param
    root = tmp_path_factory.mktemp(f"fp8-{arch}")
    build(arch, root / "src")
    write_sharded_fp8(root / "src", root / "fp8", BLOCK, oracle_dir=root / "oracle")
    return arch, root / "fp8", oracle_model(root / "oracle")


def test_logits_match_transformers_on_the_dequantized_weights(fp8_model):
    arch, d, model = fp8_model
    assert_logits_match(d, model, f"{arch} fp8")


def test_greedy_tokens_match_transformers(fp8_model):
    _, d, model = fp8_model
    assert_greedy_match(d, model)


def test_weights_stay_at_their_stored_size(fp8_model):
    arch, d, _ = fp8_model
    with fp32_engine(d) as engine:
        assert engine.quant.label == f"fp8-e4m3-b{BLOCK[0]}x{BLOCK[1]}"
        assert engine.kernel.startswith(fp8.KERNEL_NATIVE if native.ready else fp8.KERNEL_TORCH)
        ckpt, args = engine.checkpoint, engine.args
        # Routed experts: on-disk bytes, read in at most two spans (scales together, weights together).
        e = next(i for i in range(args.num_layers) if args.is_moe_layer(i))
        names = [f"model.layers.{e}.mlp.experts.0.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        stored = sum(ckpt.info(n).nbytes + ckpt.info(n + "_scale_inv").nbytes for n in names)
        assert engine.plan.expert_bytes == stored
        # Read requests: gaps up to layout.MAX_GAP are read through (in these tiny shards the F32
        # section and the F8 section can be that close), so the spans cover at least the stored bytes.
        assert engine.layout.spans_per_expert <= 2 and engine.layout.expert_nbytes >= stored
        weights = engine.experts.for_each_expert
        got = []
        weights(e, [0], lambda _e, w: got.append(w))
        assert all(isinstance(w, fp8.Fp8Weight) and w.weight.dtype == torch.float8_e4m3fn for w in got[0])
        # Dense projections: 1 byte/weight resident, counted so by the plan.
        kept = [n for n, w in engine.model.w.items() if isinstance(w, fp8.Fp8Weight)]
        assert kept and all(engine.model.w[n].weight.dtype == torch.float8_e4m3fn for n in kept)
        o_proj = f"model.layers.0.self_attn.o_proj.weight"
        assert o_proj in kept
        plain = sum(t.numel() * 4 for t in engine.model.w.values() if isinstance(t, torch.Tensor))
        fp8_bytes = sum(engine.model.w[n].weight.numel() + engine.model.w[n].scale.numel() * 4 for n in kept)
        assert engine.plan.dense_bytes == plain + fp8_bytes


def test_bf16_compute_runs_the_fp8_kernel_and_stays_close(fp8_model):
    arch, d, model = fp8_model
    with Engine(d, EngineConfig(ctx_size=64, threads=1)) as engine:  # auto: bf16, as published
        assert engine.dtype == torch.bfloat16
        logits = engine.forward(PROMPT[:8], 0)
        decode = engine.forward([PROMPT[8]], 8)  # one token: the native kernel where loaded
    ref = hf_logits(model, PROMPT[:9])
    assert (logits - ref[:8]).abs().max() < 0.25 * ref.abs().max()
    assert (decode[0] - ref[8]).abs().max() < 0.25 * ref.abs().max()


# --- the kernel ------------------------------------------------------------------------------------

KERNEL_SHAPES = [(37, 53, (16, 16)), (64, 128, (128, 128)), (100, 70, (32, 24)), (1, 1, (1, 1)), (130, 257, (128, 128)),
                 (7, 300, (3, 17))]


@pytest.mark.parametrize("n,k,block", KERNEL_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_kernel_equals_torch_reference(n, k, block, dtype):
    if native.load() is not None:
        pytest.skip(needs("native", f"native FP8 kernel: {native.load()}"))
    torch.manual_seed(n * 1000 + k)
    q, s = fp8.quantize(torch.randn(n, k) * 0.05, block)
    x = torch.randn(3, k).to(dtype)
    ref = x.float() @ fp8.dequantize(q, s, block).T
    got = native.fp8_linear(x, q, s, block)
    assert got.dtype == dtype and got.shape == (3, n)
    if dtype is torch.float32:  # the same products, summed per block first
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    else:  # one bf16 rounding of the output
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -8, atol=1e-5)


def test_native_kernel_decodes_every_e4m3_code_exactly():
    if native.load() is not None:
        pytest.skip(needs("native", f"native FP8 kernel: {native.load()}"))
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16).view(torch.float8_e4m3fn)  # subnormals, NaN, ±0
    one = torch.ones(1, 1)
    for col in range(16):
        x = torch.zeros(1, 16)
        x[0, col] = 1.0
        got = native.fp8_linear(x, codes, one, (16, 16))[0]
        torch.testing.assert_close(got, x[0] @ codes.float().T, rtol=0, atol=0, equal_nan=True)


def test_torch_fallback_for_prefill_equals_reference():
    torch.manual_seed(0)
    q, s = fp8.quantize(torch.randn(45, 70), (16, 32))
    w = fp8.Fp8Weight.from_stored(q, s, (16, 32), "test")
    x = torch.randn(5, 70)
    torch.testing.assert_close(w.linear(x), x @ fp8.dequantize(q, s, (16, 32)).T)


def test_quantize_is_dequantize_exact_on_e4m3_grid():
    # A matrix already on the grid (scale 1 blocks of values e4m3 represents) comes back exactly.
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)][:240].reshape(12, 20)
    values[:, 0] = 448.0  # every block's amax = 448, so its scale is exactly 1
    q, s = fp8.quantize(values, (12, 20))
    assert torch.equal(s, torch.ones(1, 1)) and torch.equal(fp8.dequantize(q, s, (12, 20)), values)


# --- placement invariance ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def streaming_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-stream")
    build("deepseek_v3", root / "src", moe_intermediate_size=384)  # experts of ~75 KiB at FP8
    write_sharded_fp8(root / "src", root / "fp8", BLOCK)
    d = root / "fp8"
    with Engine(d, EngineConfig(threads=1, ctx_size=64)) as engine:
        assert not engine.plan.streaming
        reference = generate(engine, PROMPT[:12], 8, Sampler()).output_ids
    from engine.run.bench import run_bench
    histogram = root / "routing.json"
    run_bench(d, EngineConfig(threads=1, ctx_size=64), tokens=4, repeats=1, cold=False, record_routing=str(histogram))
    return d, reference, str(histogram)


@pytest.mark.parametrize("placement", PLACEMENTS[::3], ids=lambda p: "-".join(str(v) for v in p.values()))
def test_placement_never_changes_fp8_tokens(streaming_fp8, placement):
    d, reference, histogram = streaming_fp8
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, routing_histogram=histogram, **placement)
    config = config.replace(ram_budget=budget_for_cache(d, config, cache_experts=6) + (2 << 20))
    with Engine(d, config) as engine:
        assert engine.plan.streaming
        tokens = generate(engine, PROMPT[:12], 8, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == reference, placement
    assert stats["bytes_read"] > 0


# --- bad files --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_fp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-bad")
    build("qwen3_moe", root / "src")
    write_sharded_fp8(root / "src", root / "fp8", BLOCK)
    return root / "fp8"


def _rewrite(src, dst, change_tensors=None, change_config=None):
    """A copy of the FP8 checkpoint with some tensors or config fields changed."""
    import shutil
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    if change_tensors:
        for f in sorted(dst.glob("*.safetensors")):
            tensors = load_file(f)
            changed = change_tensors(tensors)
            if changed:
                save_file(tensors, str(f), metadata={"format": "pt"})
                index = json.loads((dst / "model.safetensors.index.json").read_text())
                index["weight_map"] = {n: s for n, s in index["weight_map"].items() if n in tensors or s != f.name}
                index["weight_map"].update({n: f.name for n in tensors})
                (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    if change_config:
        cfg = json.loads((dst / "config.json").read_text())
        change_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _expert_scale(tensors, nan=False, shape=None, drop=False):
    name = next((n for n in tensors if n.endswith("experts.3.up_proj.weight_scale_inv")), None)
    if name is None:
        return False
    if drop:
        del tensors[name]
    elif nan:
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[1] = float("nan")
    else:
        tensors[name] = torch.ones(shape)
    return True


def _dense_scale_nan(tensors):
    name = next((n for n in tensors if n.endswith("self_attn.o_proj.weight_scale_inv")), None)
    if name is None:
        return False
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("inf")
    return True


BAD = {
    "scale shape": (dict(change_tensors=lambda t: _expert_scale(t, shape=(3, 3))), "needs [2, 4]"),
    "block size mismatch": (dict(change_config=lambda c: c["quantization_config"].update(weight_block_size=[32, 32])),
                            "in blocks of 32x32"),
    "missing scales": (dict(change_tensors=lambda t: _expert_scale(t, drop=True)), "missing scales"),
    "dense scale not finite": (dict(change_tensors=_dense_scale_nan), "FP8 block scale inf is infinite"),
    "bad block size": (dict(change_config=lambda c: c["quantization_config"].update(weight_block_size=128)),
                       "weight_block_size"),
    "e5m2": (dict(change_config=lambda c: c["quantization_config"].update(fmt="e5m2")), "FP8 e4m3 only"),
    "static activations": (dict(change_config=lambda c: c["quantization_config"].update(activation_scheme="static")),
                           "dynamic only"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_fp8_files_are_one_clear_error(small_fp8, tmp_path, case):
    changes, message = BAD[case]
    d = _rewrite(small_fp8, tmp_path / "bad", **changes)
    with pytest.raises(ModelFormatError, match=re.escape(message)):
        with fp32_engine(d) as engine:
            generate(engine, PROMPT[:4], 2, Sampler())


def test_nan_expert_scale_is_an_error_when_read(small_fp8, tmp_path):
    d = _rewrite(small_fp8, tmp_path / "nan", change_tensors=lambda t: _expert_scale(t, nan=True))
    # Resident: every expert is read at open, so there; streaming: when that expert is read.
    with pytest.raises(ModelFormatError, match="up_proj.weight_scale_inv.: FP8 block scale nan is not a number"):
        fp32_engine(d)
    with fp32_engine(d, ram_budget=1 << 30) as engine:
        assert engine.plan.streaming
        engine.experts.for_each_expert(0, [2], lambda e, w: None)
        with pytest.raises(ModelFormatError, match="up_proj.weight_scale_inv.: FP8 block scale nan is not a number"):
            engine.experts.for_each_expert(0, [3], lambda e, w: None)


def test_bad_fp8_file_on_the_command_line_is_one_line(small_fp8, tmp_path):
    d = _rewrite(small_fp8, tmp_path / "bad", change_tensors=lambda t: _expert_scale(t, drop=True))
    done = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(d), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing scales" in lines[0] and "experts.3.up_proj.weight_scale_inv" in lines[0]


# --- MTP layers -------------------------------------------------------------------------------------

def _mtp_tensors(src_dir, num_layers: int) -> dict:
    """DeepSeek's MTP module as layer `num_layers`: its own embedding, norms, eh_proj and head, and a
    full MoE decoder layer (a copy of the last layer's tensors under the new index)."""
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    last, p = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    mtp = {p + n[len(last):]: t.clone() for n, t in tensors.items() if n.startswith(last)}
    H = tensors["model.norm.weight"].shape[0]
    mtp.update({p + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
                p + "eh_proj.weight": torch.randn(H, 2 * H) * 0.02,
                p + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                p + "shared_head.norm.weight": torch.ones(H)})
    return mtp


@pytest.fixture(scope="module")
def mtp_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    build("deepseek_v3", root / "src")
    layers = json.loads((root / "src" / "config.json").read_text())["num_hidden_layers"]
    write_sharded_fp8(root / "src", root / "with", BLOCK, extra=_mtp_tensors(root / "src", layers),
                         config_overrides={"num_nextn_predict_layers": 1})
    write_sharded_fp8(root / "src", root / "without", BLOCK, config_overrides={"num_nextn_predict_layers": 1})
    return root / "with", root / "without", layers


def test_mtp_layers_are_recognised_and_not_loaded(mtp_pair):
    with_mtp, without, layers = mtp_pair
    assert any(n.startswith(f"model.layers.{layers}.") for n in Checkpoint(with_mtp).tensors)
    with fp32_engine(with_mtp) as a, fp32_engine(without) as b:
        assert a.skipped["mtp_layers"] == [layers] and a.skipped["tensors"] > 10 and a.skipped["bytes"] > 0
        assert b.skipped == {"mtp_layers": [], "tensors": 0, "bytes": 0, "declared": 1}
        assert a.plan.dense_bytes == b.plan.dense_bytes and a.plan.routed_experts == b.plan.routed_experts
        assert not any(n.startswith(f"model.layers.{layers}.") for n in a.model.w)
        assert generate(a, PROMPT[:8], 6, Sampler()).output_ids == generate(b, PROMPT[:8], 6, Sampler()).output_ids


def test_mtp_drafts_from_the_fp8_files(mtp_pair):
    """Drafting with the FP8 checkpoint's MTP layer: its projections loaded as the model's are (e4m3
    with block scales), its experts layer L of the layout; greedy output unchanged."""
    with_mtp, _, layers = mtp_pair
    with fp32_engine(with_mtp) as plain:
        want = generate(plain, PROMPT[:8], 8, Sampler()).output_ids
    with fp32_engine(with_mtp, draft="fixed", drafter="mtp", draft_depth=2) as e:
        assert e.mtp is not None and (layers, 0) in e.layout.keys()
        assert generate(e, PROMPT[:8], 8, Sampler()).output_ids == want
        assert e.speculator.stats.drafted > 0


def test_run_json_lists_mtp_layers_as_skipped(mtp_pair):
    with_mtp, _, layers = mtp_pair
    done = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(with_mtp), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "2", "--threads", "1", "--json"], capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["skipped"]["mtp_layers"] == [layers] and out["skipped"]["declared"] == 1
    assert out["quant"] == f"fp8-e4m3-b{BLOCK[0]}x{BLOCK[1]}" and "fp8" in out["kernel"]


# --- the cost model ---------------------------------------------------------------------------------

def test_cost_model_plans_fp8_bytes_as_the_engine_does(fp8_model):
    from tuner.costmodel.model_geometry import bytes_per_weight, resolve
    from tuner.costmodel.memplan import plan_memory
    arch, d, _ = fp8_model
    g = resolve(str(d))
    assert g.native_quant == "fp8"
    with Engine(d, EngineConfig(ctx_size=64, threads=1)) as engine:
        planned = plan_memory(g, "fp8", EngineConfig(ctx_size=64, threads=1), overhead_bytes=engine.plan.overhead_bytes)
        assert planned.dense_bytes == engine.plan.dense_bytes and planned.expert_bytes == engine.plan.expert_bytes
    # Geometry-only specs (DeepSeek-V3 671B): 1 byte per projection weight + a fp32 per 128x128 block;
    # embeddings, routers and lm_head stay bf16, so the dense part is a little over half of bf16's.
    assert bytes_per_weight("fp8", 7168) == 1 + 4 / (128 * 128)
    big = resolve("deepseek-v3")
    assert big.expert_bytes("fp8") == pytest.approx(big.expert_bytes("bf16") / 2, rel=1e-3)
    assert 0.5 < big.dense_bytes("fp8") / big.dense_bytes("bf16") < 0.7
