"""config.json rules, tensor dtype roles and shapes, JSON limits: one line naming field, value and rule."""

import json
import os
import shutil

import pytest

from engine.format import tensor_checks
from engine.format.checkpoint import MAX_HEADER_BYTES, TensorInfo
from engine.base.errors import ModelFormatError
from engine.arch.registry import SUPPORTED_TYPES
from engine.arch.config_rules import Consistent, Int, config_problems
from engine.arch.registry import RULES, validate_config
from colibri_tiny import RUN_ARGS, make_tiny, read_header, write_header
from colibri.cli import main


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("v") / "tiny")


@pytest.fixture
def model(good_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good_model, d)
    return d


def run(capsys, *argv):
    code = main([*map(str, argv)])
    return code, capsys.readouterr().err


def one_line(code, err, *needles):
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def set_config(model, **changes):
    cfg = json.loads((model / "config.json").read_text())
    for k, v in changes.items():
        if v is KeyError:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (model / "config.json").write_text(json.dumps(cfg))


# Each row: a change to the tiny qwen3_moe config.json, and what the one error line must say.
BAD_CONFIGS = [
    (dict(num_attention_heads=0), ["num_attention_heads = 0", "integer in [1,"]),
    (dict(num_experts_per_tok=9), ["num_experts_per_tok = 9", "<= the number of experts (8)"]),
    (dict(rope_scaling=[1.0, 2.0]), ["rope_scaling = [1.0, 2.0]", "must be a mapping"]),
    (dict(num_key_value_heads=3), ["num_key_value_heads = 3", "must divide num_attention_heads (4)"]),
    (dict(num_experts=0, num_local_experts=0), ["num_experts = 0", "integer in [1,"]),
    (dict(num_experts=8, num_local_experts=4), ["num_local_experts = 4", "must equal num_experts (8)"]),
    (dict(head_dim=15), ["head_dim", "must be even"]),
    (dict(head_dim=KeyError, hidden_size=66), ["hidden_size = 66", "multiple of num_attention_heads"]),
    (dict(moe_intermediate_size=0), ["moe_intermediate_size = 0"]),
    (dict(intermediate_size=0, mlp_only_layers=[1]), ["intermediate_size", "mlp_only_layers"]),
    (dict(mlp_only_layers=[0, 2]), ["mlp_only_layers = [0, 2]", "index 2 is outside [0, 2)"]),
    (dict(mlp_only_layers={"0": 1}), ["mlp_only_layers", "list of layer indices"]),
    (dict(vocab_size=0), ["vocab_size = 0"]),
    (dict(vocab_size=KeyError), ["vocab_size is missing"]),
    (dict(rms_norm_eps=0), ["rms_norm_eps = 0", "> 0"]),
    (dict(rms_norm_eps=None), ["rms_norm_eps = None", "null is not allowed"]),
    (dict(max_position_embeddings=0), ["max_position_embeddings = 0"]),
    (dict(hidden_size=10**30), ["hidden_size = 1000000000000000000000000000000"]),
    (dict(num_hidden_layers="2"), ["num_hidden_layers = '2'", "must be an integer"]),
    (dict(norm_topk_prob="yes"), ["norm_topk_prob = 'yes'", "true or false"]),
    (dict(hidden_act="gelu"), ["hidden_act = 'gelu'", "silu"]),
    (dict(rope_parameters={"rope_type": "longrope"}), ["rope_parameters.rope_type = 'longrope'", "yarn"]),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4}),
     ["rope_parameters.factor is missing", "rope_type linear"]),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0,
                           "high_freq_factor": 1.0, "original_max_position_embeddings": 64}),
     ["high_freq_factor = 1.0", "larger than low_freq_factor"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.5}), ["rope_theta = 0.5", "> 1"]),
    (dict(use_sliding_window=True, sliding_window=0), ["sliding_window = 0", ">= 1"]),
    (dict(torch_dtype=["float32"], dtype=None), ["torch_dtype", "must be a string"]),
]


@pytest.mark.parametrize("changes,needles", BAD_CONFIGS, ids=[",".join(c) for c, _ in BAD_CONFIGS])
def test_bad_config_is_one_line_naming_field_value_and_rule(model, capsys, changes, needles):
    set_config(model, **changes)
    line = one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), *needles)
    assert "config.json" in line


def test_config_is_checked_before_any_shard_is_opened(model, capsys):
    set_config(model, num_attention_heads=0)
    (model / "model.safetensors").write_bytes(b"garbage")
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "num_attention_heads = 0")


def test_several_problems_report_the_first_and_count_the_rest():
    cfg = json.loads(json.dumps({"model_type": "qwen3_moe", "hidden_size": 0, "num_hidden_layers": -1,
                                 "num_attention_heads": 4, "vocab_size": 300, "num_experts": 8,
                                 "num_experts_per_tok": 2, "moe_intermediate_size": 32}))
    with pytest.raises(ModelFormatError, match=r"hidden_size = 0: .* \(and 1 more problem"):
        validate_config(cfg)


def test_every_supported_architecture_has_its_own_rule_set():
    assert set(SUPPORTED_TYPES) <= set(RULES), set(SUPPORTED_TYPES) - set(RULES)


def test_transformers_configs_of_every_architecture_pass(tmp_path):
    """Real configs as transformers writes them (the oracle's) are accepted unchanged."""
    from transformers import AutoConfig
    from colibri_hf_models import ARCHS, BASE
    for model_type in [*ARCHS, "qwen2"]:
        AutoConfig.for_model(model_type, **{**BASE, **ARCHS.get(model_type, {})}).save_pretrained(tmp_path / model_type)
        validate_config(json.loads((tmp_path / model_type / "config.json").read_text()), model_type)


def test_rule_blocks_compose_for_a_new_architecture():
    """What an architecture added later does: its own fields and cross rules next to the common ones."""
    rules = (*RULES["qwen3_moe"], Int("kv_lora_rank", 1, 4096, required=True),
             Consistent(lambda c: c["kv_lora_rank"] <= c["hidden_size"], "kv_lora_rank",
                        "must be <= hidden_size ({hidden_size})"))
    cfg = {"model_type": "x", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 300, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert [p.line() for p in config_problems(cfg, rules)] == ["kv_lora_rank is missing: must be an integer in [1, 4096]"]
    assert [p.line() for p in config_problems({**cfg, "kv_lora_rank": 128}, rules)] == [
        "kv_lora_rank = 128: must be <= hidden_size (64)"]
    assert config_problems({**cfg, "kv_lora_rank": 32}, rules) == []


def test_geometry_file_goes_through_the_same_rules(tmp_path, capsys):
    from colibri_tiny import TINY
    geom = tmp_path / "g.json"
    geom.write_text(json.dumps({**TINY, "num_key_value_heads": 3}))
    one_line(*run(capsys, "synth", "--geometry", geom, "-o", tmp_path / "out"),
             "num_key_value_heads = 3", "must divide num_attention_heads (4)")
    geom.write_text(json.dumps({**TINY, "rope_scaling": ["x"]}))
    one_line(*run(capsys, "synth", "--geometry", geom, "-o", tmp_path / "out"), "rope_scaling", "mapping")
    assert not (tmp_path / "out").exists()


# --- tensor dtypes by role --------------------------------------------------------------------------

def retype(model, name_part, dtype, per_elem):
    """Give the first tensor whose name contains name_part `dtype`, with a shape that fills its bytes."""
    f = model / "model.safetensors"
    header, data = read_header(f)
    name = next(k for k in header if name_part in k)
    b, e = header[name]["data_offsets"]
    header[name].update(dtype=dtype, shape=[(e - b) // per_elem])
    write_header(f, header, data)
    return name


@pytest.mark.parametrize("dtype,size", [("I8", 1), ("U8", 1), ("BOOL", 1), ("I32", 4)])
@pytest.mark.parametrize("part,role", [("experts.1.up_proj", "routed expert weight"),
                                       ("self_attn.q_proj", "attention weight"),
                                       ("embed_tokens", "embedding")])
def test_integer_or_bool_weights_are_an_error_not_a_cast(model, capsys, dtype, size, part, role):
    name = retype(model, part, dtype, size)
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), name, f"({role}) has dtype {dtype}", "BF16")


def test_a_format_can_register_its_own_roles(monkeypatch):
    """MXFP4-style U8 blocks: allowed once a role for them is registered for that checkpoint kind."""
    monkeypatch.setattr(tensor_checks, "_ROLES", list(tensor_checks._ROLES))
    blocks = TensorInfo("model.layers.0.mlp.experts.gate_up_proj_blocks", "/m.safetensors", "U8", (4, 16), 0, 64)
    with pytest.raises(ModelFormatError, match=r"routed expert weight\) has dtype U8"):
        tensor_checks.check_dtypes({blocks.name: blocks}, {"quantization_config": {"quant_method": "mxfp4"}})
    tensor_checks.register_role("mxfp4 expert blocks", r"\.experts\.\w+_blocks$", {"U8"},
                                applies=lambda cfg: (cfg.get("quantization_config") or {}).get("quant_method") == "mxfp4")
    tensor_checks.check_dtypes({blocks.name: blocks}, {"quantization_config": {"quant_method": "mxfp4"}})
    with pytest.raises(ModelFormatError):  # a checkpoint that does not declare the format gets no exemption
        tensor_checks.check_dtypes({blocks.name: blocks}, {})


def test_projection_shape_must_match_heads_and_head_dim(model, capsys):
    set_config(model, head_dim=8)  # q_proj on disk is [4*16, 64]
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "self_attn.q_proj.weight", "[64, 64]",
             "config.json implies [32, 64]")


# --- JSON limits ------------------------------------------------------------------------------------

def test_deeply_nested_header_stops_before_the_parser(model, capsys):
    f = model / "model.safetensors"
    header, data = read_header(f)
    blob = json.dumps(header)[:-1] + ', "bomb": ' + "[" * 50000 + "]" * 50000 + "}"
    write_header(f, blob.encode(), data)
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "safetensors header", "nested deeper than 3")


def test_header_larger_than_the_limit_is_refused_unread(model, capsys):
    f = model / "model.safetensors"
    with open(f, "r+b") as fh:  # a sparse file just larger than the limit: nothing is really written
        fh.write((MAX_HEADER_BYTES + 1).to_bytes(8, "little"))
        fh.truncate(MAX_HEADER_BYTES + 100)
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "header length", "implausibly large")
    assert os.stat(f).st_blocks * 512 < 16 << 20


@pytest.mark.parametrize("text,needle", [
    ('{"a": ' + "[" * 20000 + "]" * 20000 + "}", "nested deeper than 64"),
    ('{"hidden_size": ' + "9" * 5000 + "}", "not valid JSON"),
    ('{"hidden_size": 64', "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
])
def test_hostile_config_json_is_one_line(model, capsys, text, needle):
    (model / "config.json").write_text(text)
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "config.json", needle)


def test_index_weight_map_must_map_names_to_file_names(tmp_path, capsys):
    d = make_tiny(tmp_path / "sharded", sharded=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = ["not", "a", "name"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    one_line(*run(capsys, "run", "--model", d, *RUN_ARGS), "index", "weight_map")


@pytest.mark.parametrize("field,value,needle", [
    ("dtype", [], "unknown dtype []"),  # found by the fuzz campaign: was TypeError: unhashable type
    ("dtype", {"a": 1}, "unknown dtype"),
    ("shape", {"0": 1}, "is not a list of non-negative integers"),
    ("data_offsets", [0, 1, 2], "is not a pair of integers"),
])
def test_malformed_header_entries_are_one_line(model, capsys, field, value, needle):
    f = model / "model.safetensors"
    header, data = read_header(f)
    header["model.norm.weight"][field] = value
    write_header(f, header, data)
    one_line(*run(capsys, "run", "--model", model, *RUN_ARGS), "model.norm.weight", needle)
