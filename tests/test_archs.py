"""deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss against transformers' own classes.

Tolerance: fp32, max |logit difference| <= 1e-4, as in test_oracle.py (measured 3e-6..1e-5 on
these models: MLA's absorbed form sums in a different order from the reference's expanded
per-head keys). Every architecture is checked from a single file and from a sharded
checkpoint; gpt_oss also from MXFP4 blocks + scales written as the published checkpoints are.
"""

import json
import shutil

import pytest
import torch

from engine.arch.model import Transformer

from engine import native
from engine.base.config import EngineConfig
from engine.base.errors import ModelFormatError
from engine.run.generate import Sampler, generate
from engine.arch.layers import KVCache, rms_norm, route_layer
from engine.arch.registry import model_args
from engine.run.runtime import Engine
from colibri_hf_models import (ATOL, PROMPT, assert_greedy_match, assert_logits_match, build, fp32_engine,
                                hf_greedy, hf_logits)

NEW_ARCHS = ["deepseek_v3", "glm4_moe", "glm_moe_dsa", "gpt_oss"]


@pytest.fixture(scope="module", params=[(a, s) for a in NEW_ARCHS for s in (False, True)],
                ids=lambda p: f"{p[0]}-{'sharded' if p[1] else 'single'}")
def arch_pair(request, tmp_path_factory):
    arch, sharded = request.param
    d = tmp_path_factory.mktemp(arch)
    model = build(arch, d, max_shard_size="60KB" if sharded else None)
    if sharded:
        assert len(list(d.glob("model-*.safetensors"))) > 1
    return arch, model, d


def test_logits_match_transformers(arch_pair):
    arch, model, d = arch_pair
    assert_logits_match(d, model, arch)


def test_greedy_tokens_match_transformers(arch_pair):
    _, model, d = arch_pair
    assert_greedy_match(d, model)


VARIANTS = {
    # DeepSeek-V2-Lite style: no q LoRA; rope on halves instead of interleaved pairs; no yarn.
    "deepseek_v3-plain-q": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "glm4_moe-no-qk-norm": ("glm4_moe", dict(use_qk_norm=False, attention_bias=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                              "partial_rotary_factor": 0.25})),
    "gpt_oss-full-only": ("gpt_oss", dict(layer_types=["full_attention"] * 3)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    arch, overrides = VARIANTS[variant]
    model = build(arch, tmp_path, **overrides)
    with fp32_engine(tmp_path) as engine:
        assert (engine.forward(PROMPT, 0) - hf_logits(model, PROMPT)).abs().max().item() <= ATOL
    with fp32_engine(tmp_path) as engine:
        assert generate(engine, PROMPT, 8, Sampler()).output_ids == hf_greedy(model, PROMPT, 8)


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsa")
    return build("glm_moe_dsa", d), d


def test_dsa_selection_decides_what_is_attended(dsa, tmp_path):
    """With index_topk 6 < 32 prompt tokens the indexer's choice matters: attending to every
    position instead moves the logits far beyond the tolerance."""
    model, d = dsa
    dense = tmp_path / "dense"
    shutil.copytree(d, dense)
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["index_topk"] < len(PROMPT)
    cfg["index_topk"] = 64
    (dense / "config.json").write_text(json.dumps(cfg))
    with fp32_engine(dense) as engine:
        assert (engine.forward(PROMPT, 0) - hf_logits(model, PROMPT)).abs().max().item() > 100 * ATOL


def test_dsa_query_blocks_change_nothing(dsa, monkeypatch):
    import engine.arch.mla as mla
    model, d = dsa
    with fp32_engine(d) as engine:
        whole = engine.forward(PROMPT, 0)
    monkeypatch.setattr(mla, "INDEX_QUERY_BLOCK", 5)  # 32 queries in 7 uneven blocks
    with fp32_engine(d) as engine:
        blocked = engine.forward(PROMPT, 0)
    assert torch.equal(whole, blocked)


# --- memory: the compressed cache is what is allocated and what the plan counts -------------

@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_latent_kv_cache_is_planned_and_allocated_per_token(arch, tmp_path):
    build(arch, tmp_path)
    with fp32_engine(tmp_path) as engine:
        cfg, a = engine.checkpoint.config, engine.args
        per_token = a.num_layers * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
        if arch == "glm_moe_dsa":
            per_token += cfg["indexer_types"].count("full") * cfg["index_head_dim"]
        assert engine.plan.kv_bytes == per_token * 64 * 4
        kv = engine.kv
        allocated = sum(t.nbytes for t in kv.latent + kv.rope_key + list(kv.index_key.values()))
        assert allocated == engine.plan.kv_bytes
        per_head = 2 * a.num_layers * cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
        assert engine.plan.kv_bytes < per_head * 64 * 4


def test_gpt_oss_expert_size_counts_biases(tmp_path):
    build("gpt_oss", tmp_path)
    with fp32_engine(tmp_path, ram_budget=0) as engine:
        H, I = engine.args.hidden_size, engine.args.moe_intermediate_size
        assert engine.plan.expert_bytes == (3 * H * I + 2 * I + H) * 4
        loc = engine.layout.location(0, 0)
        assert sum(p.nbytes for p in loc.pieces) == engine.plan.expert_bytes  # fp32 on disk
        # Small gaps between an expert's slices (other experts' biases) are read through.
        assert engine.layout.expert_nbytes >= engine.plan.expert_bytes


# --- router lookahead predicts with the architecture's own rule -----------------------------

class _Hints:
    def __init__(self):
        self.hints = {}

    def hint_experts(self, layer, experts):  # the ExpertStore contract's lookahead call
        self.hints[layer] = experts

    def get(self, layer, experts):
        raise AssertionError("lookahead only hints")


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss"])
def test_lookahead_uses_the_architectures_router(arch, tmp_path):
    """The experts lookahead hints for layer L+1 are those transformers' own router of L+1
    picks on the same input (sigmoid + correction bias + groups; biased top-k softmax)."""
    model = build(arch, tmp_path, num_hidden_layers=3)
    with fp32_engine(tmp_path) as engine:
        a = engine.args
        # The engine's weights under a model built with lookahead on and a store that only records hints.
        m = Transformer(a, engine.model.w, _Hints(), engine.dtype, prefetch_depth=1)
        target = next(i for i in range(1, a.num_layers) if a.is_moe_layer(i))
        h = torch.randn(5, a.hidden_size)
        m._lookahead(target - 1, None, h)
        guess_in = rms_norm(h, m.w[f"model.layers.{target}.post_attention_layernorm.weight"], a.rms_norm_eps)
        hf_router = model.model.layers[target].mlp.router if arch == "gpt_oss" else model.model.layers[target].mlp.gate
        with torch.no_grad():
            hf_ids = hf_router(guess_in)[2]
        assert m.experts.hints[target] == torch.unique(hf_ids).tolist()
        assert torch.equal(route_layer(a, m.w, target, guess_in)[0].sort(-1).values, hf_ids.sort(-1).values)


# --- gpt_oss experts as MXFP4 blocks + scales -----------------------------------------------

def write_mxfp4_checkpoint(src, out):
    """Rewrite a plain gpt_oss checkpoint with MXFP4 experts, laid out as openai/gpt-oss-*'s:
    `<proj>_blocks` [E, out, in/32, 16] uint8, `<proj>_scales` [E, out, in/32], bf16 biases."""
    from safetensors.torch import load_file, save_file

    from engine.weights.mxfp4 import mxfp4_quantize
    state = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    new = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            new[name + "_blocks"], new[name + "_scales"] = mxfp4_quantize(t.transpose(1, 2).contiguous())
        elif ".experts." in name:
            new[name] = t.to(torch.bfloat16)
        else:
            new[name] = t
    out.mkdir()
    save_file(new, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(cfg))
    return new


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    root = tmp_path_factory.mktemp("mxfp4")
    build("gpt_oss", root / "plain", hidden_size=64, intermediate_size=64)
    state = write_mxfp4_checkpoint(root / "plain", root / "mx")
    model = AutoModelForCausalLM.from_pretrained(root / "mx", quantization_config=Mxfp4Config(dequantize=True),
                                                 dtype=torch.float32, attn_implementation="eager").eval()
    return model, root / "mx", state


def test_mxfp4_dequantizes_exactly_as_transformers(mxfp4):
    from engine.weights.mxfp4 import mxfp4_dequantize
    model, _, state = mxfp4
    for layer, block in enumerate(model.model.layers):
        for proj in ("gate_up_proj", "down_proj"):
            base = f"model.layers.{layer}.mlp.experts.{proj}"
            ours = mxfp4_dequantize(state[base + "_blocks"], state[base + "_scales"], torch.float32)
            assert torch.equal(ours.transpose(1, 2), getattr(block.mlp.experts, proj).data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantize_matches_transformers_across_chunks(dtype, monkeypatch):
    """Every byte value and a spread of exponents, rows split over several uneven chunks."""
    import engine.weights.mxfp4 as mx
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 70, 5, 16), dtype=torch.uint8, generator=gen)
    # Every exponent byte but 255 (E8M0's NaN): subnormal and huge powers of two round the same.
    scales = (torch.arange(3 * 70 * 5) % 255).to(torch.uint8).view(3, 70, 5)
    monkeypatch.setattr(mx, "DEQUANT_CHUNK", 3 * 5 * 16)  # 3 rows per chunk; 70 is not a multiple
    ours = mx.mxfp4_dequantize(blocks, scales, dtype)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2))


def test_mxfp4_quantize_round_trips_representable_values():
    from engine.weights.mxfp4 import FP4_VALUES, mxfp4_dequantize, mxfp4_quantize
    values = torch.tensor(FP4_VALUES).repeat(4)  # 64 values: two blocks whose largest is 6
    w = torch.stack([values * 2.0 ** -3, values * 2.0 ** 5])  # [2, 64]: exponents -3 and 5
    blocks, scales = mxfp4_quantize(w)
    assert scales.tolist() == [[124, 124], [132, 132]]
    assert torch.equal(mxfp4_dequantize(blocks, scales, torch.float32), w)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "dequantize-on-read"])
def test_mxfp4_checkpoint_matches_transformers(mxfp4, fused, monkeypatch):
    """The native fused kernel (experts kept as stored) and the torch fallback (dequantized on
    read, as without AVX-512 or with COLIBRI_NATIVE=0) both match transformers."""
    import engine.weights.mxfp4 as mx
    if fused and not mx.fused_kernel_available():
        pytest.skip(f"native kernels unavailable: {native.load()}")
    if not fused:
        monkeypatch.setattr(mx, "fused_kernel_available", lambda: False)
    model, d, _ = mxfp4
    with fp32_engine(d) as engine:
        assert engine.kernel == (mx.MXFP4_FUSED if fused else mx.MXFP4_DEQUANT)
        a = engine.args
        H, I = a.hidden_size, a.moe_intermediate_size
        if fused:  # the plan counts the stored 4.25 bits per weight, biases in the compute dtype (fp32)
            stored = (2 * I * H + H * I) // 32 * 17
            assert engine.plan.expert_bytes == stored + (2 * I + H) * 4
        else:  # 4.25 bits per weight + bf16 biases (+ small gaps read through) against fp32 in memory
            assert engine.layout.expert_nbytes < engine.plan.expert_bytes / 5
        diff = (engine.forward(PROMPT, 0) - hf_logits(model, PROMPT)).abs().max().item()
    print(f"gpt_oss MXFP4 {'fused' if fused else 'dequantized'}: max |dlogit| = {diff:.3e}")
    assert diff <= ATOL
    with fp32_engine(d) as engine:
        assert generate(engine, PROMPT, 16, Sampler()).output_ids == hf_greedy(model, PROMPT, 16)


# --- bad configs: one line naming the field -------------------------------------------------

def _cfg(tmp_path_factory, arch):
    d = tmp_path_factory.mktemp(f"cfg-{arch}")
    build(arch, d, num_hidden_layers=2)
    return json.loads((d / "config.json").read_text())


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return {a: _cfg(tmp_path_factory, a) for a in NEW_ARCHS}


BAD = [
    ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank must be >= 1"),
    ("deepseek_v3", {"q_lora_rank": -3}, "q_lora_rank must be >= 1"),
    ("deepseek_v3", {"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group 5 exceeds n_group 4"),
    ("deepseek_v3", {"n_group": 3}, "n_routed_experts 8 is not divisible by n_group 3"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 1}, "fewer than 2 experts per group"),
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "exceeds the 2 experts in topk_group 1"),
    ("deepseek_v3", {"first_k_dense_replace": 9}, "first_k_dense_replace 9 exceeds num_hidden_layers 2"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor 1.5"),
    ("glm4_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds n_routed_experts 8"),
    ("glm_moe_dsa", {"index_topk": 0}, "index_topk must be >= 1"),
    ("glm_moe_dsa", {"q_lora_rank": None}, "q_lora_rank is required"),
    ("glm_moe_dsa", {"indexer_types": ["shared", "full"]}, "indexer_types[0] must be 'full'"),
    ("glm_moe_dsa", {"index_head_dim": 4}, "index_head_dim 4 is smaller than qk_rope_head_dim 8"),
    ("gpt_oss", {"sliding_window": 0}, "sliding_window must be a positive integer"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types must list"),
    ("gpt_oss", {"num_key_value_heads": 3}, "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
]


@pytest.mark.parametrize("arch,patch,needle", BAD, ids=[f"{a}-{next(iter(p))}" for a, p, _ in BAD])
def test_bad_config_is_one_line_error(configs, arch, patch, needle):
    cfg = {**configs[arch], **patch}
    with pytest.raises(ModelFormatError) as err:
        model_args(cfg)
    message = str(err.value)
    assert "\n" not in message and needle in message and arch in message, message


def test_bad_config_through_the_cli(tmp_path, capsys):
    from test_bad_input import assert_one_line_error
    from colibri.cli import main
    build("deepseek_v3", tmp_path, num_hidden_layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["topk_group"] = 7
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["run", "--model", str(tmp_path), "--prompt-tokens", "2"])
    assert code == 2
    assert_one_line_error(code, capsys.readouterr().err, "topk_group 7 exceeds n_group 4")


def test_kv_cache_of_per_head_archs_is_unchanged(tmp_path):
    build("glm4_moe", tmp_path)
    with fp32_engine(tmp_path) as engine:
        a = engine.args
        assert isinstance(engine.kv, KVCache)
        assert engine.plan.kv_bytes == 2 * a.num_layers * a.num_kv_heads * 64 * a.head_dim * 4
        assert sum(t.nbytes for t in engine.kv.k + engine.kv.v) == engine.plan.kv_bytes


# --- gpt_oss sliding layers: a ring of `sliding_window` positions, planned as allocated --------

def test_gpt_oss_sliding_layers_hold_only_the_window(tmp_path):
    build("gpt_oss", tmp_path)  # layers sliding, full, sliding; window 8, ctx 64
    with fp32_engine(tmp_path) as engine:
        a, window = engine.args, engine.checkpoint.config["sliding_window"]
        positions = [t.shape[1] for t in engine.kv.k]
        assert positions == [window, 64, window]
        per_position = 2 * a.num_kv_heads * a.head_dim * 4
        assert engine.plan.kv_bytes == per_position * (64 + 2 * window)
        assert sum(t.nbytes for t in engine.kv.k + engine.kv.v) == engine.plan.kv_bytes
    with Engine(tmp_path, EngineConfig(ctx_size=4, dtype="fp32", threads=1)) as small:
        assert [t.shape[1] for t in small.kv.k] == [4, 4, 4]  # a context shorter than the window


# Chunks of a teacher-forced sequence: shorter than the window, single decode steps, and longer
# than the window (a prefill that overwrites the ring it reads), 44 positions in all (window 8).
CHUNKS = [5, 1, 1, 7, 1, 12, 1, 1, 3, 1, 11]


def test_gpt_oss_logits_match_transformers_past_the_window(tmp_path):
    model = build("gpt_oss", tmp_path)
    seq = [(11 * i + 5) % 256 for i in range(sum(CHUNKS))]
    with fp32_engine(tmp_path) as engine:
        ours, start = [], 0
        for n in CHUNKS:
            ours.append(engine.forward(seq[start:start + n], start))
            start += n
    diff = (torch.cat(ours) - hf_logits(model, seq)).abs().max().item()
    print(f"gpt_oss past the window: max |dlogit| = {diff:.3e}")
    assert diff <= ATOL


def test_gpt_oss_generation_longer_than_the_window_matches_transformers(tmp_path):
    model = build("gpt_oss", tmp_path)
    prompt = PROMPT[:4]  # shorter than the window; the 40 new tokens wrap the ring five times
    with fp32_engine(tmp_path) as engine:
        assert generate(engine, prompt, 40, Sampler()).output_ids == hf_greedy(model, prompt, 40)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32)])
def test_mla_runs_a_scope_all_container(arch, quant, group, tmp_path):
    """`convert --scope all` quantizes every MLA projection, the DSA indexer's included: each is
    multiplied by its kernel (it used to be F.linear on a QuantWeight), and kv_b_proj, which the
    absorbed form views per head, is dequantized at load. The logits equal the same model's with
    every quantized matrix replaced by its dequantized values, and the plan counts kv_b_proj in
    the compute dtype."""
    from engine.format.convert import convert
    from engine.weights.quantized import QuantWeight
    src = tmp_path / "src"
    build(arch, src, kv_lora_rank=32, v_head_dim=16)  # groups of 32 divide every projection's input
    out = convert(src, tmp_path / "all", quant, group_size=group or 64, scope="all")["path"]
    with fp32_engine(out) as engine:
        w = engine.model.w
        kv_b = [n for n in w if n.endswith("kv_b_proj.weight")]
        assert kv_b and all(type(w[n]) is torch.Tensor and w[n].dtype == torch.float32 for n in kv_b)
        quantized = [n for n in w if isinstance(w[n], QuantWeight)]
        assert any(".self_attn.o_proj." in n for n in quantized)
        if arch == "glm_moe_dsa":
            assert any(".indexer.weights_proj." in n for n in quantized)
        assert engine.plan.dense_bytes == sum(t.nbytes for t in w.values())  # what is held, as held
        logits = engine.forward(PROMPT, 0)
        for n in quantized:  # dequantized, or the int4 strips' float64 reference (their int8 activations)
            w[n] = w[n].reference()
            w[n] = w[n].float() if isinstance(w[n], torch.Tensor) else w[n]
        engine.kv = KVCache.allocate(engine.args, 64, torch.float32, torch.float32)
        reference = engine.forward(PROMPT, 0)
    assert float((logits - reference).abs().max()) <= 1e-4 * float(reference.abs().max())


def test_convert_refuses_gpt_oss_in_one_line(tmp_path):
    """gpt_oss's experts (fused [E, H, 2I] with biases, or MXFP4) have no container layout: a
    clear refusal before anything is written (it crashed mid-write on a shape mismatch)."""
    from engine.base.errors import UnsupportedModelError
    from engine.format.convert import convert
    build("gpt_oss", tmp_path / "src")
    with pytest.raises(UnsupportedModelError) as err:
        convert(tmp_path / "src", tmp_path / "out", "int8", 0, "experts")
    assert "gpt_oss" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
