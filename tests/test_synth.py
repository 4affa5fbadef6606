"""colibri synth: layout, determinism, atomicity, refusals, and transformers as the reader."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from engine import synth
from engine.base.errors import ConfigError
from engine.format.safetensors_writer import DATA_ALIGN, ShardWriter, read_header

EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return synth.synthesize(synth.load_preset("tiny"), tmp_path_factory.mktemp("synth") / "tiny",
                            seed=0, progress=False)


def _tree_digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def _planned_names(geometry: dict) -> list[str]:
    g = synth.validate_geometry(geometry)
    return [t.name for unit in synth.tensor_plan(g) for t in unit]


# --- layout ---------------------------------------------------------------------------------

def test_tiny_is_a_sharded_hf_directory(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "tiny must be sharded so tests cover sharding"
    assert shards == sorted(n for n in names if n.endswith(".safetensors"))
    assert sorted(index["weight_map"]) == sorted(_planned_names(synth.load_preset("tiny")))

    from safetensors import safe_open
    seen: dict[str, str] = {}
    total = 0
    for shard in shards:
        with safe_open(str(tiny_dir / shard), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                t = f.get_tensor(name)
                assert t.dtype == torch.float32 and torch.isfinite(t).all()
                seen[name] = shard
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total


def test_config_matches_geometry(tiny_dir):
    g = synth.load_preset("tiny")
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size"):
        assert cfg[key] == g[key], key
    assert cfg["num_local_experts"] == g["num_experts"]
    assert cfg["norm_topk_prob"] is True and cfg["dtype"] == cfg["torch_dtype"] == "float32"
    assert cfg["colibri_synth"] == {"version": synth.SYNTH_VERSION, "preset": "tiny", "seed": 0,
                                    "routing_skew": g["routing_skew"]}


def test_expert_matrices_are_adjacent_and_data_aligned(tiny_dir):
    g = synth.load_preset("tiny")
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    headers = {s: read_header(tiny_dir / s) for s in set(index["weight_map"].values())}
    for shard in headers:
        with open(tiny_dir / shard, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        assert (8 + n) % DATA_ALIGN == 0
    for layer in range(g["num_hidden_layers"]):
        for e in range(g["num_experts"]):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for p in EXPERT_PARTS]
            files = {index["weight_map"][n] for n in names}
            assert len(files) == 1, f"expert {layer}/{e} split across shards"
            h = headers[files.pop()]
            spans = [h[n]["data_offsets"] for n in names]
            assert spans[0][1] == spans[1][0] and spans[1][1] == spans[2][0], f"expert {layer}/{e} not contiguous"


def test_shard_writer_refuses_a_header_that_would_lie(tmp_path):
    from engine.format.safetensors_writer import TensorSpec
    specs = [TensorSpec("a", (2, 2), "float32"), TensorSpec("b", (3,), "bfloat16")]
    with pytest.raises(ValueError, match="expected a"):
        with ShardWriter(tmp_path / "x.safetensors", specs) as w:
            w.write("a", torch.zeros(3))
    with pytest.raises(ValueError, match="closed before writing b"):
        with ShardWriter(tmp_path / "y.safetensors", specs) as w:
            w.write("a", torch.zeros(2, 2))


# --- determinism ----------------------------------------------------------------------------

def test_same_seed_same_bytes_other_seed_or_skew_other_bytes(tmp_path, tiny_dir):
    g = synth.load_preset("tiny")
    again = synth.synthesize(g, tmp_path / "again", seed=0, progress=False)
    assert _tree_digest(again) == _tree_digest(tiny_dir)

    other = _tree_digest(synth.synthesize(g, tmp_path / "seed1", seed=1, progress=False))
    base = _tree_digest(tiny_dir)
    shards = [n for n in base if n.endswith(".safetensors")]
    assert all(other[n] != base[n] for n in shards)

    skewed = _tree_digest(synth.synthesize(g, tmp_path / "skew0", seed=0, routing_skew=0.0, progress=False))
    assert any(skewed[n] != base[n] for n in shards)


def test_bf16_geometry_writes_bf16(tmp_path):
    g = {**synth.load_preset("tiny"), "dtype": "bfloat16", "num_hidden_layers": 1, "max_shard_size": 1 << 30}
    d = synth.synthesize(g, tmp_path / "bf16", progress=False)
    assert (d / "model.safetensors").exists() and not (d / "model.safetensors.index.json").exists()
    from safetensors import safe_open
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        t = f.get_tensor("model.layers.0.mlp.experts.0.up_proj.weight")
    assert t.dtype == torch.bfloat16 and torch.isfinite(t.float()).all() and t.float().std() > 0


# --- atomicity and refusals -----------------------------------------------------------------

def test_failure_midway_leaves_nothing_behind(tmp_path, monkeypatch):
    written = []
    real_write = ShardWriter.write

    def failing_write(self, name, tensor):
        if len(written) == 20:
            raise OSError(28, "No space left on device")
        written.append(name)
        return real_write(self, name, tensor)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    with pytest.raises(OSError):
        synth.synthesize(synth.load_preset("tiny"), tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_failed_force_keeps_the_old_model(tmp_path, monkeypatch, tiny_dir):
    import shutil
    dest = tmp_path / "model"
    shutil.copytree(tiny_dir, dest)
    before = _tree_digest(dest)

    def boom(self, t):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(synth.Recipe, "values", boom)
    with pytest.raises(RuntimeError):
        synth.synthesize(synth.load_preset("tiny"), dest, seed=5, force=True, progress=False)
    assert _tree_digest(dest) == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_refuses_non_empty_dir_even_with_force(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    for force in (False, True):  # not a previous synth output: --force does not make it one
        with pytest.raises(ConfigError, match="not empty"):
            synth.synthesize(synth.load_preset("tiny"), dest, force=force, progress=False)
        assert (dest / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_force_replaces_a_previous_synth_output(tmp_path, tiny_dir):
    import shutil
    dest = tmp_path / "model"
    shutil.copytree(tiny_dir, dest)
    with pytest.raises(ConfigError, match="--force"):
        synth.synthesize(synth.load_preset("tiny"), dest, progress=False)
    # A file dropped into the previous output is not in its manifest: not ours, never replaced (issue 37).
    (dest / "notes.txt").write_text("the user's")
    with pytest.raises(ConfigError, match="notes.txt"):
        synth.synthesize(synth.load_preset("tiny"), dest, force=True, progress=False)
    assert (dest / "notes.txt").read_text() == "the user's"
    (dest / "notes.txt").unlink()
    synth.synthesize(synth.load_preset("tiny"), dest, force=True, progress=False)
    assert (dest / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_empty_existing_dir_is_used(tmp_path):
    dest = tmp_path / "model"
    dest.mkdir()
    synth.synthesize(synth.load_preset("tiny"), dest, progress=False)
    assert (dest / "config.json").exists()


@pytest.mark.parametrize("name", ["glm-5", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "olmoe-1b-7b"])
def test_geometry_only_presets_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="geometry-only"):
        synth.synthesize(synth.load_preset(name), tmp_path / "x", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError) as exc:
        synth.load_preset("gpt-9")
    msg = str(exc.value)
    assert "gpt-9" in msg and "tiny" in msg and "demo" in msg and "\n" not in msg


def test_malformed_geometry_file_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match="not valid JSON") as exc:
        synth.load_geometry_file(bad)
    assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="not found"):
        synth.load_geometry_file(tmp_path / "missing.json")

    g = synth.load_preset("tiny")
    for key, value, match in (("num_experts", 0, "num_experts"), ("head_dim", "16", "head_dim"),
                              ("vocab_size", 100, "vocab_size"), ("dtype", "int4", "dtype"),
                              ("num_experts_per_tok", 99, "num_experts_per_tok = 99: must be <="), ("model_type", "mixtral", "qwen3_moe")):
        with pytest.raises(ConfigError, match=match):
            synth.validate_geometry({**g, key: value})
    with pytest.raises(ConfigError, match="routing skew"):
        synth.synthesize(g, tmp_path / "neg", routing_skew=-1, progress=False)


def test_cli_synth(tmp_path, capsys):
    from colibri.cli import main
    geom = tmp_path / "g.json"
    geom.write_text(json.dumps({**synth.load_preset("tiny"), "num_hidden_layers": 2}))
    assert main(["synth", "--geometry", str(geom), "-o", str(tmp_path / "m"), "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 3 and out["shards"] >= 1 and out["bytes"] > 0
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 2

    assert main(["synth", "glm-5", "-o", str(tmp_path / "glm")]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("colibri synth: error:") and "geometry-only" in err and "\n" not in err
    assert not (tmp_path / "glm").exists()

    assert main(["synth", "--list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["tiny"]["materializable"] and not rows["glm-5"]["materializable"]


# --- geometry specs -------------------------------------------------------------------------

def test_presets_listed():
    names = synth.list_presets()
    for n in ("tiny", "demo", "glm-5", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "olmoe-1b-7b"):
        assert n in names


@pytest.mark.parametrize("name", ["glm-5", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "olmoe-1b-7b"])
def test_real_specs_reproduce_published_sizes(name):
    g = synth.load_preset(name)
    assert g["materializable"] is False and g["source"].startswith("huggingface.co/")
    counts = synth.param_counts(g)
    assert counts["total"] == pytest.approx(g["published_total_params"], rel=0.03)
    assert counts["active"] == pytest.approx(g["published_active_params"], rel=0.06)


def test_demo_geometry_streams_under_1gib():
    g = synth.load_preset("demo")
    size = synth.model_bytes(g)
    assert 2.5e9 < size < 4e9
    counts = synth.param_counts(synth.validate_geometry(g))
    assert counts["dense"] * 2 < 0.3 * 2**30 < counts["routed_total"] * 2


# --- transformers as the reference reader ---------------------------------------------------

def test_transformers_loads_tiny_and_runs(tiny_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.eval()
    from safetensors import safe_open
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    with safe_open(str(tiny_dir / index["weight_map"][name]), "pt") as f:
        down = f.get_tensor(name)
    loaded = dict(model.named_parameters())
    fused = loaded.get("model.layers.1.mlp.experts.down_proj")  # transformers 5 fuses experts
    assert torch.equal(fused[3] if fused is not None else loaded[name], down)

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    text = "héllo, wörld"
    ids = tok(text, return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == text and ids.max() < 256
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], synth.load_preset("tiny")["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 1e-3


def _routing(model_dir: Path, tokens: int = 128) -> list[list[set[int]]]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    k = model.config.num_experts_per_tok
    per_layer: list[list[set[int]]] = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out: per_layer.append([set(r) for r in out[2].reshape(-1, k).tolist()]))
        for layer in model.model.layers]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return per_layer


def test_routing_skew_raises_popularity_and_locality(tmp_path):
    g = synth.load_preset("tiny")
    k = g["num_experts_per_tok"]

    def stats(skew):
        layers = _routing(synth.synthesize(g, tmp_path / f"s{skew}", routing_skew=skew, progress=False))
        reuse = sum(len(a & b) / k for sets in layers for a, b in zip(sets, sets[1:])) / sum(
            len(sets) - 1 for sets in layers)
        far = sum(len(a & b) / k for sets in layers for a, b in zip(sets, sets[16:])) / sum(
            len(sets) - 16 for sets in layers)
        return reuse, far

    uniform = k / g["num_experts"]
    reuse0, _ = stats(0.0)
    reuse2, far2 = stats(2.0)
    assert abs(reuse0 - uniform) < 0.08           # X=0: consecutive tokens overlap as by chance
    assert reuse2 > reuse0 + 0.2                  # skew: consecutive tokens share experts
    assert reuse2 > far2 + 0.1                    # ... more than distant tokens do: locality, not only popularity
