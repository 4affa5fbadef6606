"""What a GGUF's metadata and tensors must be before an import writes anything.

Why: `convert` used to write config.json straight from the metadata, so values our own `run`
refuses (expert_count 0, top-k 99 of 8 experts, 3 heads over 2 KV heads, an epsilon of NaN, a
RoPE base of -inf, a context of 2^63, token_embd with its dims swapped) came out as a model
directory that did not load, or, where `run` has no rule, loaded and computed garbage; and a
head count of 0 or a block count of 2^32-1 crashed or hung the import itself.

Two steps, both with config.json's rule types (engine/arch/config_rules.py):
- `check_metadata`: every GGUF key the import reads has its type and a range that makes the
  config safe to build (no division by a zero head count, no loop over 2^32 layers); the line
  names the GGUF key.
- `check_plan`: the config the metadata makes goes through engine.arch.registry.validate_config,
  the validator `run` applies to config.json, and every tensor the plan would write has the
  shape that config implies (engine.arch.args.dense_tensors, the formula `run`'s shape check
  uses; routed experts as [I, H], [I, H], [H, I], exactly num_experts of them per MoE layer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.arch.args import dense_tensors, expert_tensor_names
from engine.arch.config_rules import K16, M1, M4, Bool, Field, Int, Number, Str, config_problems, is_int, is_number
from engine.arch.registry import model_args, validate_config
from engine.base.errors import ModelFormatError

CTX = 1 << 31  # config_rules' max_position_embeddings cap
TOKEN_ID = 1 << 24  # config_rules' vocab_size cap


@dataclass(frozen=True)
class ListOf(Field):
    """A metadata array whose items are all of one kind ("str", "int", "bool", "number")."""

    item: str = "str"

    def accepts(self, value) -> bool:
        ok = {"str": lambda v: isinstance(v, str), "int": is_int, "bool": lambda v: isinstance(v, bool),
              "number": is_number}[self.item]
        return isinstance(value, list) and all(ok(v) for v in value)

    def rule(self) -> str:
        return f"must be an array of {self.item} values"


def _arch_rules(arch: str) -> tuple:
    """Every `{arch}.*` key archs.py reads. Ranges are only what building the config needs; the
    config's own rules (validate_config) then judge the values as config.json's."""
    a = f"{arch}."
    return (
        Int(a + "block_count", 1, K16, required=True),
        Int(a + "attention.head_count", 1, K16, required=True),
        Int(a + "attention.head_count_kv", 1, K16),
        Int(a + "embedding_length", 1, M1, required=True),
        Int(a + "attention.key_length", 1, M1), Int(a + "attention.value_length", 1, M1),
        Int(a + "attention.key_length_mla", 0, M1), Int(a + "attention.value_length_mla", 0, M1),
        Int(a + "attention.kv_lora_rank", 0, M1), Int(a + "attention.q_lora_rank", 0, M1),
        Int(a + "rope.dimension_count", 0, M1),
        Int(a + "feed_forward_length", 0, M4), Int(a + "expert_feed_forward_length", 0, M4),
        Int(a + "expert_shared_feed_forward_length", 0, M4),
        Number(a + "attention.layer_norm_rms_epsilon", 0, 1),
        Number(a + "rope.freq_base", 1),
        Int(a + "context_length", 1, CTX),
        Int(a + "expert_count", 0, K16), Int(a + "expert_used_count", 0, K16),
        Int(a + "expert_shared_count", 0, K16), Int(a + "expert_group_count", 0, K16),
        Int(a + "expert_group_used_count", 0, K16), Int(a + "leading_dense_block_count", 0, K16),
        Int(a + "nextn_predict_layers", 0, K16), Int(a + "expert_gating_func", 0, 16),
        Number(a + "expert_weights_scale", 0, lo_inclusive=True), Bool(a + "expert_weights_norm"),
        Int(a + "attention.sliding_window", 0, CTX),
        Int(a + "attention.indexer.head_count", 1, K16), Int(a + "attention.indexer.key_length", 1, M1),
        Int(a + "attention.indexer.top_k", 1, CTX), ListOf(a + "attention.indexer.types", item="bool"),
        Str(a + "rope.scaling.type"), Number(a + "rope.scaling.factor", 0),
        Int(a + "rope.scaling.original_context_length", 1, CTX),
        Number(a + "rope.scaling.yarn_beta_fast", 0), Number(a + "rope.scaling.yarn_beta_slow", 0),
        Number(a + "rope.scaling.yarn_ext_factor", -math.inf), Number(a + "rope.scaling.yarn_log_multiplier", 0,
                                                                      lo_inclusive=True),
    )


GLOBAL_RULES = (
    Str("general.architecture", required=True),
    Int("tokenizer.ggml.bos_token_id", 0, TOKEN_ID), Int("tokenizer.ggml.eos_token_id", 0, TOKEN_ID),
    Str("tokenizer.ggml.model"), Str("tokenizer.ggml.pre"),
    ListOf("tokenizer.ggml.tokens"), ListOf("tokenizer.ggml.merges"), ListOf("tokenizer.ggml.token_type", item="int"),
    ListOf("tokenizer.ggml.scores", item="number"),
    Int("split.count", 1, 1 << 16),
)


def check_metadata(m) -> None:
    """One ModelFormatError line for the first GGUF key of the wrong type or out of range."""
    arch = m.metadata.get("general.architecture")
    rules = GLOBAL_RULES + (_arch_rules(arch) if isinstance(arch, str) else ())
    problems = config_problems(m.metadata, rules)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise ModelFormatError(f"{m.paths[0]}: GGUF metadata {problems[0].line()}{more}")


def check_plan(m, plan) -> None:
    """The config through `run`'s validator, then every planned tensor against the shapes it implies."""
    where = m.paths[0]
    validate_config(plan.config, source=f"{where}: the config.json its metadata makes")
    args = model_args(plan.config)
    want = dense_tensors(args)
    if args.expert_impl is None:  # per-expert tensors (gpt_oss fuses its own; its module checks those)
        I, H = args.moe_intermediate_size, args.hidden_size
        for layer in range(args.num_layers):
            if args.is_moe_layer(layer):
                for e in range(args.num_experts):
                    want.update(zip(expert_tensor_names(args, layer, e), ((I, H), (I, H), (H, I))))
    planned = {t.name: t for item in plan.items for t in item.tensors}
    for name, t in planned.items():
        shape = want.get(name)
        if shape is None and ".experts." in name and args.expert_impl is None:
            raise ModelFormatError(f"{where}: {_source(t)} makes {name}, beyond the config's {args.num_experts} "
                                   f"experts (from {m.arch}.expert_count)")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ModelFormatError(
                f"{where}: {_source(t)} would be written as {name} with shape {list(t.shape)}; the config its "
                f"metadata makes implies {list(shape)} (vocab {args.vocab_size}, hidden {args.hidden_size}, heads "
                f"{args.num_heads}/{args.num_kv_heads}, head_dim {args.head_dim})")
    missing = [n for n in want if n not in planned]
    if missing:
        raise ModelFormatError(f"{where}: the config its metadata makes needs {missing[0]}, which no GGUF tensor "
                               f"provides" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    _check_vocab(m, args.vocab_size)


def _check_vocab(m, vocab: int) -> None:
    """The token list is the vocabulary in id order (llama.cpp takes n_vocab from it and requires
    token_embd to have that many rows); the per-token arrays are as long, and the special ids
    inside it. A mismatch used to be truncated by zip() or give ids the model has no row for."""
    tokens = m.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if len(tokens) != vocab:
        raise ModelFormatError(f"{m.paths[0]}: tokenizer.ggml.tokens holds {len(tokens)} tokens, token_embd.weight "
                               f"has {vocab} rows (they must be equal)")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if m.get(key) is not None and len(m.get(key)) != len(tokens):
            raise ModelFormatError(f"{m.paths[0]}: {key} has {len(m.get(key))} entries for {len(tokens)} tokens")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        if m.get(key) is not None and m.get(key) >= vocab:
            raise ModelFormatError(f"{m.paths[0]}: {key} = {m.get(key)} is outside the {vocab} tokens")


def _source(t) -> str:
    return f"GGUF tensor {t.source!r}" if getattr(t, "source", "") else f"tensor {t.name!r}"
