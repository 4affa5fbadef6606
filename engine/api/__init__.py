"""The engine's front door: what the tuner, the entry points (colibri/) and benchmarks/ import of
the engine, and all they import of it (tests/test_import_graph.py fails on a reach past it).
engine/api/lab.py is the door's bench-side room: single kernels and operators a benchmark times
on their own.

  run, bench        a whole `colibri run` / `colibri bench`: RunResult, BenchResult (typed,
                    schema ids, the JSON unchanged in `.to_dict()`; engine/api/results.py)
  generate          one generation on a loaded Engine (Sampler, Generation, load_tokenizer); its
                    grammar mask for structured output (json_grammar, GrammarTokenizer)
  Scheduler         several generations batched on one Engine (BatchSequence, each a Decoding:
                    generate's per-token logic; StepInfo), serve's worker
  quality           KL / top-1 / perplexity against a reference (measure_quality)
  plan              the memory plan of a checkpoint under a config (MemoryPlan, make_plan);
                    `colibri plan`'s cost-model answer is PlanResult / CalibrationResult
  Engine, EngineConfig and its knobs; the errors; model resolution (resolve_model, synth
  presets); checkpoint facts (Checkpoint, model_args, checkpoint_dtype, ExpertLayout, kv_storage);
  conversion and containers; workloads; the small file and input helpers every command uses.

Names resolve lazily (PEP 562): `from engine.api import Engine` imports the engine's runtime (and
torch) only then, so a command that needs the config alone stays light (colibri/cli.py). A name's
home is listed once below: a module that moves inside the engine changes one line here.
"""

from __future__ import annotations

from engine import __version__
from engine.api.lazy import homes, resolver
from engine.api.results import (METRICS_SCHEMA, BenchResult, CalibrationResult, EngineResult, PlanResult, Result,
                                RunResult, SynthResult, fact, figure, figures)

# home module -> the names the door re-exports from it
_HOMES = {
    "engine.api.entry": "run bench quality plan",
    # configuration and errors
    "engine.base.config": "EngineConfig CTX_MAX KV_QUANT_NAMES PREFILL_CHUNK knob format_size parse_size size_label",
    "engine.base.errors": "ColibriError ConfigError BudgetError BusyError DraftBudgetError ModelFormatError PromptError",
    # the engine and one generation
    "engine.run.runtime": "Engine DTYPE_NAMES checkpoint_dtype physical_cores",
    "engine.run.generate": "Decoding Generation Sampler check_finite_logits generate load_tokenizer random_prompt_ids",
    "engine.run.speculative": "Steps accept_rows",
    "engine.run.batch": "BatchSequence Scheduler StepInfo",
    "engine.run.grammar": "GrammarError GrammarProcessor GrammarTokenizer json_grammar json_lark lark_grammar",
    "engine.run.sampling": "LogitsProcessor TokenLogprob TOP_LOGPROBS_MAX",
    "engine.run.context": "default_ctx_size",
    "engine.run.oneshot": "run_generation",
    "engine.run.bench": "run_bench",
    "engine.run.spec_gate": "DRAFT_GAIN",
    "engine.run.spec_stats": "draft_speedup expected_tokens independent_union",
    "engine.run.mtp_drafter": "plan_drafting",
    "engine.run.steady": ("STEADY_TEMPERATURE STEADY_TOP_P STEADY_WARM_SHARE counted_prompts degenerate prompt_lengths "
                          "steady_requests"),
    "engine.run.quality": "Reference format_quality measure_quality stdlib_corpus token_stream",
    "engine.run.run_metrics": "SUMMARY_KEYS git_commit peak_rss_bytes",
    "engine.run.prompts_file": "Request conversation_reuse describe load_requests load_workload save_requests",
    # request traces (JSON Lines of arrivals) and their replay through serve's scheduler
    "engine.run.request_trace": "TraceRequest check_context load_trace read_trace save_trace trace_digest",
    "engine.run.trace_replay": "TRACE_KEYS replay replay_figures",
    # model resolution and synthetic models
    "engine.run.resolve": "cache_root kv_root resolve_model",
    "engine.run.kv_store": "is_kv_file is_kv_root",
    "engine.run.prefix_cache": "BLOCK_TOKENS",
    "engine": "synth",  # the synth library (engine/synth/__init__.py is its own facade)
    "engine.synth": "list_presets load_geometry_file load_preset synthesize",
    "engine.synth.geometry_check": "check_geometry",
    # checkpoint and model facts (the tuner's model_facts, cost model and probe)
    "engine.format.checkpoint": "Checkpoint",
    "engine.format.layout": "ExpertLayout",
    "engine.arch.registry": "model_args",
    "engine.arch.args": "dense_tensor_names dense_tensors",
    "engine.arch.kvquant": "kv_storage supports_quantized_kv",
    "engine.base.dtypes": "short_name",
    "engine.movement.plan": "MemoryPlan make_plan",
    "engine.movement.cache": "PINNED_FRACTION hottest_keys make_cache routing_histogram_load",
    # conversion, containers, quantized weights
    "engine.format.convert": "Converter convert fingerprint",
    "engine.format.container": "CONFIG_KEY QuantSpec container_spec dense_quantized",
    "engine.weights.quantized": "GROUP_SIZES QUANTS QuantWeight quantize",
    "engine.weights.stored": "linear",
    "engine.format.gguf": "is_gguf",
    "engine.format.gguf.importer": "import_and_convert",
    # machine facts the probe and doctor read
    "engine.base.hugepages": "thp_mode",
    "engine.base.align": "align_down align_up",
    "engine.api.kernels": "load_native_kernels native_kernels_build native_kernels_ready runnable_native_builds",
    # files, inputs and progress
    "engine.base.durable": "DirectoryLock atomic_write_text lock_path_for",
    "engine.base.inputs": "check_regular printable read_input read_text_input",
    "engine.base.jsonlimits": "load_json_input loads_limited",
    "engine.base.output_target": ("OUTPUT_KINDS any_of directory_target file_target in_place_files json_file_with "
                                  "json_lines_head_with read_small_json replace_directory run_directory_target "
                                  "stamped"),
    "engine.movement.io.trace": "TRACE_FORMAT",
    "engine.base.progress": "Progress end_open_line rewrite_line",
}
_HOME = homes(_HOMES)

__all__ = sorted({"__version__", "METRICS_SCHEMA", "BenchResult", "CalibrationResult", "EngineResult", "PlanResult",
                  "Result", "RunResult", "SynthResult", "fact", "figure", "figures", *_HOME})


def home(name: str) -> str:
    """The engine module a door name comes from."""
    return _HOME[name]


__getattr__ = resolver(__name__, _HOME)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
