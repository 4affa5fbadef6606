"""The search space: which engine settings the tuner tries, and the memory pre-check over
the model facts (model_facts.py: the engine's own plan).

Ranges are fixed for the whole study (Optuna's multivariate TPE silently falls back to
independent sampling when a parameter's range depends on another one), and every quantity that
depends on several knobs (cache bytes, read-buffer bytes) is derived by the engine's own memory
plan, not sampled. The same `SearchSpace` is rebuilt identically on resume and on every worker of
a shared study: it depends only on the model, the budget, the machine's core count, the GPU and
the user's minimum context.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from engine.base.config import CACHE_POLICIES, IO_MODES, EngineConfig, format_size
from engine.base.errors import BudgetError
from engine.movement.plan import MemoryPlan
from tuner.search.model_facts import ModelFacts

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Read request sizes: expert-sized, 64 KiB..16 MiB, the range the probe measures.
CHUNK_SIZES = tuple(64 * KiB << i for i in range(9))
PREFETCH_DEPTHS = (0, 4)  # inclusive int range
CPU_CACHE_RATIO = (0.25, 1.0, 0.05)  # low, high, step: a bigger cache is not always faster
GPU_CACHE_RATIO = (0.0, 0.9, 0.1)
IO_THREADS = (1, 2, 4, 8, 16)
CTX_MULTIPLES = (1, 2, 4)  # ctx_size choices: the user's minimum and two doublings

# Memory a fresh trial process spends before the model is touched (interpreter, torch, the
# checkpoint index) plus the engine's activation margin. Replaced by a measured figure when one
# is available (the calibration run's plan); this is the fallback measured on a Linux x86 box.
DEFAULT_OVERHEAD_BYTES = 310 * MiB


@dataclass
class SearchSpace:
    budget: int
    physical_cores: int
    logical_cores: int
    has_gpu: bool
    min_ctx: int
    with_pinned: bool = False  # a routing histogram exists to pin from
    routing_histogram: str = ""
    overhead_bytes: int = DEFAULT_OVERHEAD_BYTES
    model: ModelFacts | None = None  # None: no memory pre-check (every config fits)
    # Read sizes and I/O threads to search: all by default; the cost model narrows them to where
    # the probe's read curve still rises or is flat (tuner/costmodel/search.py:curve_region).
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES
    io_thread_choices: tuple[int, ...] = IO_THREADS
    # tune --max-kl / --min-top1: the lossy dimensions (tuner/search/lossy.py), empty = lossless.
    lossy: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.min_ctx < 1:
            raise BudgetError(f"--min-ctx must be at least 1, got {self.min_ctx}")
        self.physical_cores = max(1, self.physical_cores)
        self.logical_cores = max(self.physical_cores, self.logical_cores)

    # --- the distributions --------------------------------------------------------------------

    @property
    def ctx_sizes(self) -> tuple[int, ...]:
        return tuple(self.min_ctx * m for m in CTX_MULTIPLES)

    @property
    def cache_policies(self) -> tuple[str, ...]:
        # pinned needs a recorded routing histogram (the calibration run's)
        return CACHE_POLICIES if self.with_pinned else tuple(p for p in CACHE_POLICIES if p != "pinned")

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        d = {
            "chunk_size": CategoricalDistribution(self.chunk_sizes),
            "prefetch_depth": IntDistribution(*PREFETCH_DEPTHS),
            "cpu_cache_ratio": FloatDistribution(CPU_CACHE_RATIO[0], CPU_CACHE_RATIO[1], step=CPU_CACHE_RATIO[2]),
            "threads": IntDistribution(1, self.logical_cores),
            "ctx_size": CategoricalDistribution(self.ctx_sizes),
            "io_mode": CategoricalDistribution(IO_MODES),
            "io_threads": CategoricalDistribution(self.io_thread_choices),
            "cache_policy": CategoricalDistribution(self.cache_policies),
        }
        if self.has_gpu:
            d["gpu_cache_ratio"] = FloatDistribution(GPU_CACHE_RATIO[0], GPU_CACHE_RATIO[1], step=GPU_CACHE_RATIO[2])
        d.update(self.lossy)
        return d

    def describe(self) -> dict:
        """JSON-able description; stored with the study so a resume can check it is the same."""
        out = {}
        for name, dist in self.distributions().items():
            if isinstance(dist, CategoricalDistribution):
                out[name] = list(dist.choices)
            else:
                out[name] = {"low": dist.low, "high": dist.high, "step": dist.step, "log": dist.log}
        return out

    # --- params <-> EngineConfig --------------------------------------------------------------

    def suggest(self, trial: optuna.Trial) -> EngineConfig:
        params = {name: _suggest(trial, name, dist) for name, dist in self.distributions().items()}
        return self.config_from_params(params)

    def config_from_params(self, params: dict) -> EngineConfig:
        p = dict(params)
        policy = p.get("cache_policy", "lru")
        cpu_ratio = round(float(p["cpu_cache_ratio"]), 4)
        gpu_ratio = round(float(p.get("gpu_cache_ratio", 0.0)), 4)
        return EngineConfig(
            ram_budget=self.budget, chunk_size=int(p["chunk_size"]), prefetch_depth=int(p["prefetch_depth"]),
            cpu_cache_ratio=cpu_ratio, gpu_cache_ratio=gpu_ratio, threads=int(p["threads"]),
            ctx_size=int(p["ctx_size"]), io_mode=p["io_mode"], io_threads=int(p["io_threads"]),
            cache_policy=policy, routing_histogram=self.routing_histogram if policy == "pinned" else "",
            kv_dtype=p.get("kv_dtype", "auto"), top_k_reduction=int(p.get("top_k_reduction", 0)),
            expert_threshold=float(p.get("expert_threshold", 0.0)),
        )

    def params_of(self, config: EngineConfig) -> dict:
        """The point of this space a config sits on (for enqueueing warm starts)."""
        params = {
            "chunk_size": _nearest(self.chunk_sizes, config.chunk_size),
            "prefetch_depth": min(max(config.prefetch_depth, PREFETCH_DEPTHS[0]), PREFETCH_DEPTHS[1]),
            "cpu_cache_ratio": _snap(config.cpu_cache_ratio, *CPU_CACHE_RATIO),
            "threads": min(max(config.threads or self.physical_cores, 1), self.logical_cores),
            "ctx_size": min((c for c in self.ctx_sizes if c >= config.ctx_size), default=self.ctx_sizes[-1]),
            "io_mode": config.io_mode,
            "io_threads": _nearest(self.io_thread_choices, config.io_threads),
            "cache_policy": config.cache_policy if config.cache_policy in self.cache_policies else "lru",
        }
        if self.has_gpu:
            params["gpu_cache_ratio"] = _snap(config.gpu_cache_ratio, *GPU_CACHE_RATIO)
        for name, dist in self.lossy.items():  # a lossy value outside the choices: the nearest lossless one
            value = getattr(config, name)
            params[name] = value if value in dist.choices else dist.choices[0]
        return params

    def baseline(self) -> EngineConfig:
        """The rules of thumb practitioners start from: read ahead 2 layers, one compute thread per
        physical core, the rest of the budget as expert cache, buffered reads."""
        params = {"chunk_size": 1 * MiB, "prefetch_depth": 2, "cpu_cache_ratio": 1.0,
                  "threads": min(self.physical_cores, self.logical_cores), "ctx_size": self.min_ctx,
                  "io_mode": "buffered", "io_threads": 4, "cache_policy": "lru"}
        if self.has_gpu:
            params["gpu_cache_ratio"] = 0.9
        return self.config_from_params(params)

    def smallest(self) -> EngineConfig:
        """The config that needs the least fixed memory: if this cannot fit, nothing can."""
        return self.baseline().replace(prefetch_depth=0)

    # --- the memory pre-check ------------------------------------------------------------------

    def precheck(self, config: EngineConfig) -> tuple[bool, int, str]:
        """(fits, overshoot bytes, message) from the engine's own memory plan, without loading
        any weight. A config whose dense part, KV cache, read buffers and runtime exceed the
        budget is infeasible by `overshoot` bytes."""
        if self.model is None:
            return True, 0, ""
        try:
            plan = self.model.plan(config, self.overhead_bytes)
        except BudgetError as exc:
            fixed = self.fixed_bytes(config)
            return False, max(1, fixed - config.ram_budget), str(exc)
        return True, 0, plan.describe()

    def fixed_bytes(self, config: EngineConfig) -> int:
        """Everything but the expert cache, as the engine's plan counts it."""
        # A budget nothing can exceed: the plan then itemises the fixed parts without raising.
        plan: MemoryPlan = self.model.plan(config.replace(ram_budget=1 << 62), self.overhead_bytes)
        return plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + plan.overhead_bytes + plan.prefill_bytes

    def check_budget(self) -> None:
        """Fail before the study starts when even the leanest config cannot fit."""
        fits, overshoot, message = self.precheck(self.smallest())
        if not fits:
            raise BudgetError(f"{message}; even with prefetch_depth 0 and ctx_size {self.min_ctx} the budget is "
                              f"{format_size(overshoot)} short (raise --ram-budget or lower --min-ctx)")

    def compute_dtype_name(self) -> str:
        """The dtype trials compute in ('bfloat16', 'float32'), or '' without a model."""
        if self.model is None:
            return ""
        return str(self.model.dtype).replace("torch.", "")


def _suggest(trial: optuna.Trial, name: str, dist):
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def _nearest(choices, value):
    return min(choices, key=lambda c: (abs(c - value), c))


def _snap(value: float, low: float, high: float, step: float) -> float:
    k = round((min(max(value, low), high) - low) / step)
    return round(low + k * step, 4)
