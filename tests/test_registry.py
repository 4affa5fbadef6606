"""The architecture registry (engine/arch/registry.py): one record per model_type, and each
record's parts agree with each other and with the engine (no files written: plans only)."""

import pytest

from engine import synth
from engine.arch import registry
from engine.arch.args import dense_tensor_names, expert_tensor_names
from engine.base.errors import ModelFormatError, UnsupportedModelError

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
