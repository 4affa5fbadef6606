"""One validator per input kind, used by every command that reads it (issue 23, item 3):
geometry files (synth, plan, the cost model), profiles (plan, profile import/show/diff),
quantized containers (scales, stamps, shards) and run directories (schema, study.db).

Each case is an example of the issue's "Why" list: the input, the command, and one error line
naming the problem, exit code 2, no traceback.
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from colibri_tiny import RUN_ARGS, make_tiny, read_header, write_header
from engine import synth
from engine.base.errors import ConfigError, ModelFormatError
from engine.format.checkpoint import Checkpoint
from engine.synth.geometry_check import MAX_LAYER_EXPERT_PAIRS, check_geometry
from report_fixture import hardware_profile, make_run
from colibri import cli
from tuner.costmodel.model_geometry import from_spec
from tuner.probe.hardware_profile import compute_fingerprint, load_profile
from tuner.results.result import TuneResult
from tuner.probe.probe_errors import ProfileError


def run_cli(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli.main([str(a) for a in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return rc, (err[0] if len(err) == 1 else "\n".join(err))


@pytest.fixture(scope="module")
def profile_data() -> dict:
    return hardware_profile().to_dict()


def write_profile(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "colibri" / "profiles"


# --- geometry: the same checks in synth, plan and the cost model --------------------------------

TINY = synth.load_preset("tiny")


@pytest.mark.parametrize("patch, needle", [
    ({"hidden_size": 0}, "hidden_size = 0: must be an integer in [1,"),
    ({"num_experts": 0}, "num_experts = 0: must be an integer in [1,"),
    ({"num_experts_per_tok": 9, "num_experts": 8}, "num_experts_per_tok = 9: must be <= the number of experts (8)"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok = 0: must be an integer in [1,"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0: must be an integer in [1,"),
    ({"num_hidden_layers": 10 ** 30}, "num_hidden_layers = 1000000000000000000000000000000: must be an integer"),
    ({"vocab_size": 0}, "vocab_size = 0: must be an integer in [1,"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0: must be an integer in [1,"),
    ({"moe_intermediate_size": -64}, "moe_intermediate_size = -64: must be an integer"),
    ({"hidden_size": "64"}, "hidden_size = '64': must be an integer"),
    ({"hidden_size": True}, "hidden_size = True: must be an integer"),
    ({"hidden_size": 8.5}, "hidden_size = 8.5: must be an integer"),
    ({"num_experts": 10 ** 9}, "num_experts = 1000000000: must be an integer in [1, 65536]"),
    ({"num_hidden_layers": 10 ** 6}, "num_hidden_layers = 1000000: must be an integer in [1, 65536]"),
    ({"num_expert_per_tok": 2}, "unknown key 'num_expert_per_tok' (did you mean 'num_experts_per_tok'?)"),
    ({"routing_skew": -1}, "'routing_skew' must be a finite number >= 0"),
    ({"description": 5}, "'description' must be a string"),
])
def test_bad_geometry_is_refused_the_same_way_by_synth_and_plan(patch, needle, tmp_path, capsys, profile_data):
    geometry = tmp_path / "g.json"
    geometry.write_text(json.dumps({**TINY, **patch}))
    # the validator itself, the cost model, and both commands: one message
    with pytest.raises(ConfigError, match=".*" + needle.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("?", r"\?")):
        check_geometry({**TINY, **patch}, "g.json")
    with pytest.raises(ConfigError) as info:
        from_spec({**TINY, **patch})
    assert needle in str(info.value)
    rc, line = run_cli(["synth", "--geometry", geometry, "-o", tmp_path / "out"], capsys)
    assert rc == 2 and needle in line and not (tmp_path / "out").exists()
    profile = write_profile(tmp_path / "p.json", profile_data)
    rc, line = run_cli(["plan", "--model", geometry, "--profile", profile], capsys)
    assert rc == 2 and needle in line


def test_deepseek_geometry_without_its_mla_keys(tmp_path, capsys):
    g = {k: v for k, v in synth.load_preset("deepseek-v3-small").items() if k != "kv_lora_rank"}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(g))
    rc, line = run_cli(["synth", "--geometry", path, "-o", tmp_path / "out"], capsys)
    assert rc == 2 and "kv_lora_rank is missing" in line


def test_size_is_bounded_arithmetically_before_anything_is_allocated():
    many = {**TINY, "num_hidden_layers": 4096, "num_experts": 4096, "num_experts_per_tok": 2}
    with pytest.raises(ConfigError, match=f"more than the {MAX_LAYER_EXPERT_PAIRS} .layer, expert. pairs"):
        from_spec(many)
    huge = {**TINY, "hidden_size": 1 << 20, "moe_intermediate_size": 1 << 22, "head_dim": 128,
            "num_attention_heads": 64, "num_key_value_heads": 8}
    with pytest.raises(ConfigError, match="parameters is beyond"):
        from_spec(huge)


def test_every_bundled_preset_passes_the_validator():
    for name in synth.list_presets():
        check_geometry(synth.load_preset(name), name)


# --- profiles: one strict loader, physical ranges ----------------------------------------------

def _mutate(data: dict, fn) -> dict:
    out = copy.deepcopy(data)
    fn(out)
    return out


def _set_factors(**factors):
    def fn(d):
        d["cost_model"] = {"schema": "colibri.costmodel/1", "factors": factors}
    return fn


def _zero_memory_bw(d):
    d["memory_bandwidth"][0]["bandwidth"]["value"] = 0.0


def _no_curve(d):
    d["storage"]["points"] = [p for p in d["storage"]["points"] if p["role"] != "curve"]


def _zero_request(d):
    next(p for p in d["storage"]["points"] if p["role"] == "curve")["request_bytes"] = 0


def _zero_curve_bw(d):
    for p in d["storage"]["points"]:
        if p["role"] == "curve":
            p["bandwidth"]["value"] = 0.0


BAD_PROFILES = [
    (_zero_memory_bw, "memory_bandwidth[0].bandwidth: must be positive"),
    (_no_curve, "no direct random-read curve point"),
    (_zero_request, "request_bytes"),
    (_zero_curve_bw, "bandwidth: must be positive"),
    (_set_factors(eta_io=0.0), "eta_io: 0.0 is outside its physical range"),
    (_set_factors(eta_compute=-1.0), "eta_compute: -1.0 is outside its physical range"),
    (_set_factors(c_request=-0.001), "c_request: -0.001 is outside its physical range"),
    (_set_factors(lookahead_recall=5), "lookahead_recall: 5 is outside its physical range"),
]


@pytest.mark.parametrize("mutate, needle", BAD_PROFILES)
def test_plan_and_profile_import_refuse_unphysical_profiles(mutate, needle, tmp_path, capsys, profile_data, store):
    path = write_profile(tmp_path / "p.json", _mutate(profile_data, mutate))
    with pytest.raises(ProfileError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_profile(path)
    rc, line = run_cli(["plan", "--model", "tiny", "--profile", path], capsys)
    assert rc == 2 and needle in line and "inf" not in line.split(":")[-1]
    rc, line = run_cli(["profile", "import", path], capsys)
    assert rc == 2 and needle in line and not store.exists()
    rc, line = run_cli(["profile", "show", path], capsys)
    assert rc == 2 and needle in line


def test_a_sane_profile_still_plans(tmp_path, capsys, profile_data):
    path = write_profile(tmp_path / "p.json", _mutate(profile_data, _set_factors(eta_io=0.8, lookahead_recall=0.5)))
    rc, _ = run_cli(["plan", "--model", "tiny", "--profile", path, "--json"], capsys)
    assert rc == 0


def test_plan_refuses_nan_and_duplicate_keys_in_a_profile(tmp_path, capsys, profile_data):
    text = json.dumps(profile_data)
    nan = tmp_path / "nan.json"
    nan.write_text(text.replace('"numa_nodes": 1', '"numa_nodes": NaN'))
    rc, line = run_cli(["plan", "--model", "tiny", "--profile", nan], capsys)
    assert rc == 2 and "NaN is not valid JSON" in line
    dup = tmp_path / "dup.json"
    dup.write_text(text.replace('"schema_version": 1', '"schema_version": 1, "schema_version": 1'))
    rc, line = run_cli(["plan", "--model", "tiny", "--profile", dup], capsys)
    assert rc == 2 and "duplicate key 'schema_version'" in line


def test_disk_transport_nvme_imports_under_a_lower_case_name(tmp_path, capsys, store):
    profile = hardware_profile()
    profile.system.disk.transport = "NVMe"  # as another tool spells it; the user gives no --name
    profile.fingerprint = compute_fingerprint(profile.system, profile.gpus)
    path = write_profile(tmp_path / "nvme.json", profile.to_dict())
    rc, line = run_cli(["profile", "import", path], capsys)
    assert rc == 0, line
    (stored,) = store.glob("*.json")
    assert "-nvme-" in stored.name and stored.name == stored.name.lower()


# --- containers: scales, stamps, shards -----------------------------------------------------------

@pytest.fixture(scope="module")
def int8_container(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("container")
    src = make_tiny(root / "src")
    assert cli.main(["convert", str(src), "-o", str(root / "int8"), "--quant", "int8"]) == 0
    return root / "int8"


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _poke_scale(model: Path, value: float) -> int:
    """Overwrite the first row scale of every routed expert's gate_proj with `value` (bf16), so
    whichever experts the prompt routes to, one poisoned scale is read."""
    poked = 0
    for shard in model.glob("*.safetensors"):
        raw = bytearray(shard.read_bytes())
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        for name, entry in header.items():
            if name.endswith("gate_proj.qscale") and ".experts." in name:
                begin = 8 + n + entry["data_offsets"][0]
                raw[begin:begin + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
                poked += 1
        shard.write_bytes(bytes(raw))
    assert poked
    return poked


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_non_finite_or_non_positive_scales_are_refused(value, int8_container, tmp_path, capsys):
    model = _copy(int8_container, tmp_path / "bad")
    _poke_scale(model, value)
    rc, line = run_cli(["run", "--model", model, *RUN_ARGS], capsys)
    assert rc == 2 and "scales hold NaN, Inf, zero or negative values" in line


def test_the_untouched_container_runs(int8_container, capsys):
    rc, _ = run_cli(["run", "--model", int8_container, *RUN_ARGS], capsys)
    assert rc == 0


def test_altered_source_fingerprint_is_refused(int8_container, tmp_path, capsys):
    model = _copy(int8_container, tmp_path / "fp")
    cfg = json.loads((model / "config.json").read_text())
    fp = cfg["colibri_quant"]["source_fingerprint"]
    cfg["colibri_quant"]["source_fingerprint"] = ("0" if fp[0] != "0" else "1") + fp[1:]
    (model / "config.json").write_text(json.dumps(cfg))
    rc, line = run_cli(["run", "--model", model, *RUN_ARGS], capsys)
    assert rc == 2 and "source_fingerprint" in line and "differs from config.json's" in line
    cfg["colibri_quant"]["source_fingerprint"] = "not-a-hash"
    (model / "config.json").write_text(json.dumps(cfg))
    rc, line = run_cli(["run", "--model", model, *RUN_ARGS], capsys)
    assert rc == 2 and "is not a sha256" in line


def test_duplicate_tensor_names_across_shards_are_refused(tmp_path):
    model = make_tiny(tmp_path / "sharded", sharded=True)
    shards = sorted(model.glob("model-*.safetensors"))
    assert len(shards) >= 2
    first, _ = read_header(shards[0])
    name = next(k for k in first if k != "__metadata__")
    blob = shards[0].read_bytes()
    n0 = struct.unpack("<Q", blob[:8])[0]
    lo, hi = first[name]["data_offsets"]
    tensor_bytes = blob[8 + n0 + lo: 8 + n0 + hi]
    header, data = read_header(shards[1])
    header[name] = {**first[name], "data_offsets": [len(data), len(data) + len(tensor_bytes)]}
    write_header(shards[1], header, data + tensor_bytes)
    with pytest.raises(ModelFormatError, match="duplicate tensor names across shards"):
        Checkpoint(model)


def test_duplicate_key_in_one_header_or_the_index_is_refused(tmp_path):
    model = make_tiny(tmp_path / "one")
    header, data = read_header(model / "model.safetensors")
    name = next(k for k in header if k != "__metadata__")
    text = json.dumps(header)
    entry = json.dumps({name: header[name]})[1:-1]
    write_header(model / "model.safetensors", (text[:-1] + ", " + entry + "}").encode(), data)
    with pytest.raises(ModelFormatError, match="duplicate key"):
        Checkpoint(model)
    sharded = make_tiny(tmp_path / "two", sharded=True)
    index = (sharded / "model.safetensors.index.json").read_text()
    key = next(iter(json.loads(index)["weight_map"]))
    (sharded / "model.safetensors.index.json").write_text(
        index.replace('"weight_map": {', f'"weight_map": {{"{key}": "model-00002-of-00002.safetensors", ', 1))
    with pytest.raises(ModelFormatError, match="duplicate key"):
        Checkpoint(sharded)


# --- run directories -------------------------------------------------------------------------------

def test_result_json_schema_is_checked_against_its_content(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    result = json.loads((run / "result.json").read_text())
    result["schema"] = "colibri.tune/1"  # but it keeps /2's quant and quality fields
    (run / "result.json").write_text(json.dumps(result))
    rc, line = run_cli(["report", run], capsys)
    assert rc == 2 and "schema says colibri.tune/1 but it holds quality, quant" in line


@pytest.mark.parametrize("declared", ["colibri.tune/2", "colibri.tune/1"])
def test_result_json_declaring_an_older_schema_than_its_colibri_tune_3_content_is_refused(tmp_path, capsys, declared):
    """A /3 result relabelled /2 (or /1) would be migrated: the /3 fields kept as if /2 had them."""
    run = make_run(tmp_path / "run")
    result = as_current(run)
    result["schema"] = declared
    (run / "result.json").write_text(json.dumps(result))
    for argv in (["report", run], ["profile", "export", run], ["compare", run, run, "--out", tmp_path / "c.md"]):
        rc, line = run_cli(argv, capsys)
        assert rc == 2 and f"schema says {declared} but it holds " in line, line
        assert "defaults, gain_over_defaults" in line and "(added in colibri.tune/3)" in line, line
        assert str(run / "result.json") in line
    assert not (tmp_path / "c.md").exists()


def test_result_json_holding_only_a_nested_colibri_tune_3_field_is_refused(tmp_path, capsys):
    """The check walks into the candidates: one /3 figure (request_s) in a /2 file is enough."""
    run = make_run(tmp_path / "run")  # the fixture writes a colibri.tune/2 result
    result = json.loads((run / "result.json").read_text())
    assert result["schema"] == "colibri.tune/2" and "request_s" not in json.dumps(result)
    rc, line = run_cli(["profile", "export", run], capsys)
    assert rc == 0, line  # a true /2 result: migrated and read (export: the report would draw for seconds)
    result["candidates"][-1]["confirmed"]["request_s"] = 1.5
    (run / "result.json").write_text(json.dumps(result))
    rc, line = run_cli(["report", run], capsys)
    assert rc == 2 and "schema says colibri.tune/2 but it holds candidate.confirmed.request_s" in line, line
    del result["candidates"][-1]["confirmed"]["request_s"]
    result["candidates"][-1]["runs"] = [{"request_s": 1.5}]  # a run summary's own figure: found as deep
    (run / "result.json").write_text(json.dumps(result))
    rc, line = run_cli(["report", run], capsys)
    assert rc == 2 and "holds candidate.runs[].request_s (added in colibri.tune/3)" in line, line


def as_current(run: Path) -> dict:
    """The fixture's result.json (colibri.tune/2) as the tuner writes it now (colibri.tune/6)."""
    result = TuneResult.from_dict(json.loads((run / "result.json").read_text())).to_dict()
    assert result["schema"] == "colibri.tune/6" and "defaults" in result and "measured_trials" in result["study"]
    (run / "result.json").write_text(json.dumps(result))
    return result


@pytest.mark.parametrize("missing", ["defaults", "workload", "study.measured_trials"])
def test_colibri_tune_3_result_missing_a_colibri_tune_3_field_is_refused(tmp_path, capsys, missing):
    run = make_run(tmp_path / "run")
    result = as_current(run)
    rc, line = run_cli(["profile", "export", run], capsys)
    assert rc == 0, line
    node, key = (result["study"], "measured_trials") if "." in missing else (result, missing)
    del node[key]
    (run / "result.json").write_text(json.dumps(result))
    rc, line = run_cli(["report", run], capsys)
    assert rc == 2 and f"missing key {key!r}" in line and "result.json" in line, line


def test_report_refuses_another_runs_study_db(tmp_path, capsys):
    mine = make_run(tmp_path / "mine")
    other = make_run(tmp_path / "other", model_name="other-model")  # the only study in its study.db
    shutil.copy(other / "study.db", mine / "study.db")
    rc, line = run_cli(["report", mine], capsys)
    assert rc == 2 and "not this run's study" in line
    rc, line = run_cli(["report", other], capsys)
    assert rc == 0, line
