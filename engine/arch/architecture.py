"""What an architecture is to the engine: one `Architecture` record per family of model_types.

Each record (one module under engine/arch/families/, listed once in engine/arch/registry.py)
holds everything that differs between architectures:

    parse         config.json → ModelArgs. The switches it sets decide the tensor names
                  (engine/arch/args.py reads `moe_prefix`, `expert_names`, `attention_impl`,
                  `router`), the forward pass's strategy objects (`attention_impl`,
                  `expert_impl`) and the routing rule (`router`), which is also the router
                  lookahead rule: lookahead predicts with the very rule the layer will use.
    rules         config.json validation (engine/arch/config_rules.py), run before any tensor
                  is read.
    tensor_roles  dtypes its checkpoints may store beyond the float ones, by tensor name pattern
                  (gpt_oss: MXFP4 blocks and scales are U8), checked by engine/format/tensor_checks.py.
    synth         how `colibri synth` writes one of these models, or None if it cannot.
    oracle        the tiny config.json the tests build with transformers' own classes to check
                  this architecture's forward pass against (tests/colibri_hf_models.py).
    gguf          how llama.cpp's GGUF files name it (`colibri convert model.gguf` imports them,
                  engine/format/gguf/), or None if import does not take it.

Derived from ModelArgs, not per record: every resident tensor's shape (engine/arch/args.dense_tensors:
shape checks at load, synth/params.param_counts, the cost model's geometry) and one expert's size.

`PlannedTensor` (a tensor of a synthetic model: name, shape and how its values are made) lives
here so that an architecture's synth plan stays in its own module, below engine/synth/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engine.arch.args import ModelArgs


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    kind: str            # what the recipe makes of it: embed, lm_head, norm, q, k, v, o, q_norm, ...
    layer: int = -1
    expert: int = -1
    dtype: str | None = None  # None: the geometry's dtype (MXFP4 blocks and scales are uint8)


@dataclass(frozen=True)
class SynthRecipe:
    """How synth writes an architecture (engine/synth/ runs it; the weights are synth's recipe).

    config(geometry, eos_token_id, stamp) → config.json as transformers writes it, `stamp` the
    `colibri_synth` entry. plan(geometry, args) → the tensors in file order, grouped into units
    that stay together in one shard (an expert's matrices: one read). expert_formats: the
    geometry's `expert_format` values it accepts. native_geometry: the geometry itself names
    every size synth's recipe reads (head_dim, num_key_value_heads, num_experts), as qwen3_moe's
    does; otherwise synth derives them by parsing the config it would write.
    """

    config: Callable[[dict, int, dict], dict]
    plan: Callable[[dict, ModelArgs], list[list[PlannedTensor]]]
    expert_formats: tuple[str, ...] = ("plain",)
    native_geometry: bool = False


@dataclass(frozen=True)
class TinyOracle:
    """The transformers oracle's tiny model of an architecture: per model_type, the config.json
    fields beyond the small sizes every oracle shares (tests/colibri_hf_models.BASE), set so that
    each of its code paths runs. transformers initialises biases, attention sinks and the routers'
    score-correction bias to zero; left so, a test could not tell "used for selection only" from
    "not used", so `randomize_zeros` has the tests draw them before saving."""

    configs: dict[str, dict]
    randomize_zeros: bool = False


@dataclass(frozen=True)
class GgufNames:
    """How llama.cpp's GGUF files name an architecture, for engine/format/gguf/ to import them as a
    Hugging Face directory of the record's model_type (its only one; a record of several, such as
    the dense llama layout, takes no GGUF).

    arch:        the file's `general.architecture` (llama.cpp's name: "qwen3moe", "deepseek2", ...).
    tensors:     per layer, GGUF name after `blk.N.` → HF name after `model.layers.N.`, beyond the
                 names every architecture shares (engine/format/gguf/gguf_names.LAYER_NAMES:
                 attention, norms, dense MLP, router): shared experts, sinks, indexers.
    permute_qk:  llama.cpp's converter permuted q/k rows to its interleaved RoPE (the llama
                 family); import undoes it.
    The HF names of the routed experts and the router come from the parsed ModelArgs
    (moe_prefix, expert_names), as for a safetensors checkpoint. The metadata → config.json
    mapping is engine/format/gguf/gguf_names.CONFIGS, one function per record keyed by its name:
    it reads GGUF keys and tensor types through the GGUF reader (gpt-oss's MXFP4 experts through
    gguf-py's type enum), which engine/arch must not import.
    """

    arch: str
    tensors: dict[str, str] = field(default_factory=dict)
    permute_qk: bool = False


@dataclass(frozen=True)
class Architecture:
    name: str
    model_types: tuple[str, ...]
    # (model_type, config.json, the fields every architecture shares: args.common_fields) → ModelArgs.
    # KeyError / TypeError / ValueError become one ModelFormatError line (registry.model_args).
    parse: Callable[[str, dict, dict], ModelArgs]
    rules: Callable[[str], tuple]  # model_type → its config_rules tuple
    tensor_roles: tuple[tuple[str, str, frozenset], ...] = ()  # (role name, regex, allowed dtypes)
    synth: SynthRecipe | None = None
    oracle: TinyOracle | None = field(default=None, hash=False, compare=False)
    gguf: GgufNames | None = field(default=None, hash=False, compare=False)
