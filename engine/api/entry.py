"""The engine's entry functions with typed results: run and bench (the library calls under `colibri
run` and `colibri bench`), quality and plan (the memory plan).

`generate` (one generation on a loaded Engine: engine/run/generate.py) is the door's too, under
its own name; these are the whole-command calls around it.
"""

from __future__ import annotations

from engine.api.results import BenchResult, RunResult
from engine.base.config import EngineConfig
from engine.movement.plan import MemoryPlan, make_plan
from engine.run.bench import run_bench
from engine.run.oneshot import run_generation
from engine.run.quality import measure_quality


def run(model_dir, config: EngineConfig, **kw) -> RunResult:
    """Load the model, generate, measure (engine/run/oneshot.py `run_generation`'s arguments)."""
    return RunResult.from_dict(run_generation(model_dir, config, **kw))


def bench(model_dir, config: EngineConfig, **kw) -> BenchResult:
    """Warm up, then decode `tokens` tokens `repeats` times (engine/run/bench.py `run_bench`'s
    arguments); medians and spread."""
    return BenchResult.from_dict(run_bench(model_dir, config, **kw))


def quality(model_dir, reference_dir, **kw) -> dict:
    """KL / top-1 / perplexity of a model against its reference (engine/run/quality.py)."""
    return measure_quality(model_dir, reference_dir, **kw)


def plan(ckpt, args, layout, config: EngineConfig, dtype, kv_dtype, overhead_bytes: int | None = None) -> MemoryPlan:
    """The memory plan of a checkpoint under a config (engine/movement/plan.py `make_plan`)."""
    return make_plan(ckpt, args, layout, config, dtype, kv_dtype, overhead_bytes)
