"""The architecture registry (engine/arch/registry.py): one record per model_type, and each
record's parts agree with each other and with the engine (no files written: plans only)."""

import re
from types import SimpleNamespace

import pytest

from engine import synth
from engine.arch import registry
from engine.arch.args import dense_tensor_names, dense_tensors, expert_tensor_names
from engine.base.config import EngineConfig
from engine.base.errors import ModelFormatError, UnsupportedModelError
from engine.format.tensor_checks import check_shapes
from tuner.costmodel.model_geometry import from_spec
from tuner.costmodel.memplan import fits

MATERIALIZABLE = [p for p in synth.list_presets() if synth.load_preset(p).get("materializable", True)]


def test_each_model_type_has_exactly_one_record():
    listed = [t for a in registry.ARCHITECTURES for t in a.model_types]
    assert len(listed) == len(set(listed)) == len(registry.SUPPORTED_TYPES)
    assert all(registry.architecture(t).rules(t) for t in listed)


@pytest.mark.parametrize("preset", MATERIALIZABLE)
def test_the_synth_plan_holds_exactly_the_tensors_the_engine_reads(preset):
    """A family's synth plan and its parse agree: every resident tensor the engine will ask for is
    written, and everything else written is a routed expert's (per-expert or fused)."""
    g = synth.validate_geometry(synth.load_preset(preset))
    args = registry.model_args(synth.hf_config(g, 0, 0.0))
    planned = [t.name for unit in synth.tensor_plan(g) for t in unit]
    assert len(planned) == len(set(planned))
    dense = set(dense_tensor_names(args))
    assert dense <= set(planned)
    routed = set(planned) - dense
    assert routed and all(".experts." in n for n in routed)
    if args.expert_impl is None:  # per-expert tensors, named as the layout reads them
        assert routed == {n for i in range(args.num_layers) if args.is_moe_layer(i)
                          for e in range(args.num_experts) for n in expert_tensor_names(args, i, e)}


@pytest.mark.parametrize("preset", MATERIALIZABLE)
def test_each_synth_config_passes_its_own_architectures_rules(preset):
    g = synth.validate_geometry(synth.load_preset(preset))
    registry.validate_config(synth.hf_config(g, 0, 0.0))


def test_an_unknown_model_type_is_one_line_naming_the_supported_ones():
    for call in (registry.model_args, registry.validate_config):
        with pytest.raises(UnsupportedModelError, match=r"model_type 'gpt2' is not supported \(supported: qwen3_moe, "):
            call({"model_type": "gpt2"})


def test_a_missing_field_is_one_line_from_the_parse():
    with pytest.raises(ModelFormatError, match=r"^config.json for mixtral is missing or has a bad field: 'hidden_size'$"):
        registry.model_args({"model_type": "mixtral"})


# --- one size formula: load-time shape checks, parameter counts and the cost model ------------

def _preset_args(preset):
    g = synth.validate_geometry(synth.load_preset(preset))
    return g, registry.model_args(synth.hf_config(g, 0, 0.0))


@pytest.mark.parametrize("preset", MATERIALIZABLE)
def test_the_resident_shapes_are_the_ones_synth_writes(preset):
    """dense_tensors (what load checks, counts and plans) against each family's own synth plan."""
    g, args = _preset_args(preset)
    planned = {t.name: t.shape for unit in synth.tensor_plan(g) for t in unit}
    implied = dense_tensors(args)
    assert list(implied) == dense_tensor_names(args)
    assert {n: planned[n] for n in implied} == implied


@pytest.mark.parametrize("preset", synth.list_presets())
def test_param_counts_and_the_cost_model_count_one_model(preset):
    g = synth.load_preset(preset)
    counts, geometry = synth.param_counts(g), from_spec(g)
    assert geometry.dense_params == counts["dense"]
    assert (geometry.num_experts, geometry.top_k, geometry.moe_layers) == (
        counts["num_experts"], counts["top_k"], counts["num_moe_layers"])
    if registry.model_args({"model_type": "qwen3_moe", **g}).expert_impl is None:  # gpt_oss: + expert biases
        assert geometry.total_params == counts["total"] and geometry.active_params + geometry.embed_params == counts["active"]


class _Headers:
    """A checkpoint's headers only: each tensor's path and shape."""

    def __init__(self, shapes):
        self.shapes = shapes

    def info(self, name):
        return SimpleNamespace(path="model.safetensors", shape=self.shapes[name])


@pytest.mark.parametrize("preset", MATERIALIZABLE)
def test_load_refuses_a_resident_tensor_of_the_wrong_shape_in_every_family(preset):
    _, args = _preset_args(preset)
    shapes = dense_tensors(args)
    check_shapes(_Headers(shapes), args, list(shapes))  # as config.json implies: accepted
    name = next(n for n in shapes if n.endswith("o_proj.weight"))
    bad = {**shapes, name: (shapes[name][0], shapes[name][1] + 1)}
    with pytest.raises(ModelFormatError, match=re.escape(f"tensor {name!r} has shape")):
        check_shapes(_Headers(bad), args, list(shapes))


def test_every_architecture_has_a_transformers_oracle():
    """The oracle suites (test_oracle, test_archs) take their tiny configs from the records."""
    from colibri_hf_models import ARCHS
    assert set(ARCHS) <= set(registry.SUPPORTED_TYPES)
    assert all(a.oracle is not None for a in registry.ARCHITECTURES)


@pytest.mark.parametrize("preset", ["glm4-moe-small", "gpt-oss-small"])
def test_every_family_plans_from_a_spec(preset):
    """The cost model's spec geometry is the registry's: architectures it had no formulas for plan too."""
    geometry = from_spec(synth.load_preset(preset))
    assert fits(geometry, "bf16", EngineConfig(ram_budget=4 << 30), overhead_bytes=0)
    assert not fits(geometry, "bf16", EngineConfig(ram_budget=geometry.dense_params), overhead_bytes=0)
