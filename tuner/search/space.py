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

import dataclasses
from dataclasses import dataclass, field

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from engine.api import BudgetError, EngineConfig, MemoryPlan, format_size
from tuner.search.model_facts import ModelFacts

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Which knobs the search tunes, their ranges and the rules-of-thumb baseline: EngineConfig's
# knob(search=...) metadata (engine/base/config.py), in field order; a new searched knob is its field.
SEARCHED = {f.name: f.metadata["search"] for f in dataclasses.fields(EngineConfig) if f.metadata.get("search")}
KINDS = {f.name: f.metadata["kind"] for f in dataclasses.fields(EngineConfig)}
CHUNK_SIZES = SEARCHED["chunk_size"]["choices"]
IO_THREADS = SEARCHED["io_threads"]["choices"]
FACTS = ("physical_cores", "logical_cores", "min_ctx")  # what a range may name instead of a number
# The smallest prefill group a tune recommends: a prompt a little longer than the tuned workload's
# then still goes through in few groups, for a charge of a few MiB.
MIN_PREFILL_CHUNK = 32


def prefill_chunk_for(longest_prompt: int) -> int:
    """The prefill group for a workload whose longest prompt is `longest_prompt` tokens: the next
    power of two, at least MIN_PREFILL_CHUNK, so every prompt goes through as one group (each
    routed expert read once per layer); the plan charges it (and refuses a budget that cannot)."""
    fit = 1 << max(0, int(longest_prompt) - 1).bit_length()
    return max(MIN_PREFILL_CHUNK, fit)


def prefill_chunks_for(longest_prompt: int) -> tuple[int, ...]:
    """The prefill groups a `tune --prompts` searches: the one that holds the longest prompt whole
    (prefill_chunk_for) and its half and quarter, at least MIN_PREFILL_CHUNK. A smaller group
    charges the plan less (more room for the expert cache) and reads each expert once per group."""
    top = prefill_chunk_for(longest_prompt)
    return tuple(sorted({max(MIN_PREFILL_CHUNK, top >> i) for i in range(3)}))


def prefix_caches_for(longest_history: int, conversations: int, kv_bytes_per_token: float) -> tuple[int, ...]:
    """The prefix cache sizes a conversation workload's tune searches: 0 (off: every turn computes
    its whole history), the KV of its longest conversation's history in whole MiB (a turn that
    follows its own conversation's reuses the KV cache as it stands; a block copy is kept for one
    that does not), and every conversation's (interleaved conversations each keep theirs)."""
    one = -(-int(longest_history * kv_bytes_per_token) // MiB) * MiB
    return tuple(sorted({0, one, one * max(1, conversations)}))

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
    # the probe's read curve still rises or is flat (tuner/costmodel/best_config.py:curve_region).
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES
    io_thread_choices: tuple[int, ...] = IO_THREADS
    # tune --max-kl / --min-top1: the lossy dimensions (tuner/search/lossy.py), empty = lossless.
    lossy: dict = field(default_factory=dict)
    # Prompt tokens per prefill group every candidate runs with: from the workload's longest prompt
    # (prefill_chunk_for), never longer, because a group longer than any prompt the workload sends
    # only charges the plan activations that the expert cache could have had. 0: the engine's own
    # (the largest the budget allows). A `tune --prompts` searches it among `prefill_chunks`
    # (prefill_chunks_for: a shorter group reads the experts again per group, for a smaller charge).
    prefill_chunk: int = 0
    prefill_chunks: tuple[int, ...] = ()  # searched where more than one
    # A conversation workload's prefix cache sizes (prefix_caches_for), searched where more than
    # one; else the engine's default (0: each prompt computed whole, as independent prompts want).
    prefix_caches: tuple[int, ...] = ()
    # tune --objective serve: the knobs searched only for it (needs="serve": max_batch) enter the space.
    serve: bool = False
    # A fit="plan" knob's choices the memory plan fits beside the leanest config (fit_choices), by
    # name; a knob not here offers all its choices.
    fitted: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.min_ctx < 1:
            raise BudgetError(f"--min-ctx must be at least 1, got {self.min_ctx}")
        self.physical_cores = max(1, self.physical_cores)
        self.logical_cores = max(self.physical_cores, self.logical_cores)

    # --- the distributions (from the knobs' search metadata) -----------------------------------

    def _fact(self, value):
        """A range's number, or the tuning run's fact it names (FACTS)."""
        return getattr(self, value) if isinstance(value, str) and value in FACTS else value

    def _choices(self, name: str, rule: dict) -> tuple:
        if "multiples" in rule:
            return tuple(self._fact("min_ctx") * m for m in rule["multiples"])
        # The cost model narrows the read sizes and I/O threads (tuner/costmodel/best_config.py); the
        # memory plan, a fit="plan" knob's (fit_choices).
        choices = {"chunk_size": self.chunk_sizes, "io_threads": self.io_thread_choices,
                   **self.fitted}.get(name, rule["choices"])
        # pinned needs a recorded routing histogram (the calibration run's)
        return tuple(c for c in choices if self.with_pinned or c not in rule.get("with_histogram", ()))

    def needed(self, rule: dict) -> bool:
        """Whether a knob searched only under a condition (its rule's needs=) is searched in this run."""
        return {"gpu": self.has_gpu, "serve": self.serve}.get(rule.get("needs"), True)

    def distributions(self) -> dict[str, optuna.distributions.BaseDistribution]:
        d = {}
        for name, rule in SEARCHED.items():
            if not self.needed(rule):
                continue
            if "choices" in rule or "multiples" in rule:
                d[name] = CategoricalDistribution(self._choices(name, rule))
            elif KINDS[name] == "float":
                d[name] = FloatDistribution(rule["low"], self._fact(rule["high"]), step=rule.get("step"))
            else:
                d[name] = IntDistribution(rule["low"], self._fact(rule["high"]))
        d.update({name: CategoricalDistribution(choices) for name, choices in self._workload_choices().items()})
        d.update(self.lossy)
        return d

    def _workload_choices(self) -> dict[str, tuple[int, ...]]:
        """The knobs the workload decides the range of (the prefill group, the prefix cache), where
        it gives a choice."""
        both = {"prefill_chunk": self.prefill_chunks, "prefix_cache": self.prefix_caches}
        return {name: tuple(choices) for name, choices in both.items() if len(choices) > 1}

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
        """A point as the engine config it stands for: each value as its knob's kind (a stepped
        float rounded off its step artefacts); unsearched knobs at their defaults."""
        values = {}
        for name, value in params.items():
            kind = KINDS[name]
            if kind in ("int", "size"):
                values[name] = int(value)
            elif kind == "float":
                values[name] = round(float(value), 4) if SEARCHED.get(name, {}).get("step") else float(value)
            else:
                values[name] = value
        pinned = values.get("cache_policy") == "pinned"
        return EngineConfig(**{"ram_budget": self.budget, "routing_histogram": self.routing_histogram if pinned else "",
                               "prefill_chunk": self.prefill_chunk, **values})

    def params_of(self, config: EngineConfig) -> dict:
        """The point of this space a config sits on (for enqueueing warm starts)."""
        params = {}
        workload = self._workload_choices()
        for name, dist in self.distributions().items():
            if name in self.lossy:
                continue
            if name in workload:  # a group of 0 is the engine's largest: the whole-prompt one here
                value = getattr(config, name) or (max(dist.choices) if name == "prefill_chunk" else 0)
                params[name] = _nearest(dist.choices, value)
                continue
            rule, value = SEARCHED[name], getattr(config, name)
            if "zero" in rule and not value:  # threads 0: the physical cores
                value = self._fact(rule["zero"])
            params[name] = _point(dist, value, rule, self._fact(rule["baseline"]))
        for name, dist in self.lossy.items():  # a lossy value outside the choices: the nearest lossless one
            value = getattr(config, name)
            params[name] = value if value in dist.choices else dist.choices[0]
        return params

    def baseline(self) -> EngineConfig:
        """The rules of thumb practitioners start from (each searched knob's baseline): read ahead
        2 layers, one compute thread per physical core, the rest of the budget as expert cache,
        buffered reads."""
        dists = self.distributions()
        workload = self._workload_choices()
        # The workload's knobs: the group that holds the longest prompt whole, the largest prefix cache.
        params = {name: max(choices) if name == "prefix_cache" else self.prefill_chunk or max(choices)
                  for name, choices in workload.items()}
        return self.config_from_params({**{name: self._baseline_value(name, dists[name]) for name in dists
                                           if name not in self.lossy and name not in workload}, **params})

    def _baseline_value(self, name: str, dist):
        value = self._fact(SEARCHED[name]["baseline"])
        if SEARCHED[name].get("fit") == "plan" and value not in dist.choices:
            # the plan fits fewer: the largest it fits below the rule of thumb (1 always fits, fit_choices)
            value = max((c for c in dist.choices if c <= value), default=dist.choices[0])
        return value

    def fit_choices(self) -> None:
        """Cap each fit="plan" knob (max_batch: the plan charges a KV cache per sequence) to the choices
        the memory plan fits at the leanest config, so the study never proposes a value no config can
        run; the smallest choice stays, as the budget check (check_budget) already passed it."""
        lean = self.smallest()
        for name, rule in SEARCHED.items():
            if rule.get("fit") != "plan" or not self.needed(rule):
                continue
            first, *rest = rule["choices"]
            self.fitted[name] = (first, *(c for c in rest if self.precheck(lean.replace(**{name: c}))[0]))

    def smallest(self) -> EngineConfig:
        """The config that needs the least fixed memory: if this cannot fit, nothing can."""
        least = {name: rule["choices"][0] for name, rule in SEARCHED.items()
                 if rule.get("fit") == "plan" and self.needed(rule)}  # one KV cache, not the baseline's batch
        least.update({name: min(choices) for name, choices in self._workload_choices().items()})
        return self.baseline().replace(prefetch_depth=0, **least)

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
        # A budget nothing can exceed: the plan then itemises the fixed parts without raising. The
        # prefill group is the smallest (unless set): under a budget the default group shrinks to
        # fit, so only its least is fixed (unbounded, it would be the whole context).
        plan: MemoryPlan = self.model.plan(config.replace(ram_budget=1 << 62, prefill_chunk=config.prefill_chunk or 1),
                                           self.overhead_bytes)
        return (plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + plan.overhead_bytes + plan.prefill_bytes
                + plan.prefix_cache_bytes + plan.draft_bytes)

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


def _point(dist, value, rule: dict, fallback):
    """The value of `dist` nearest to a config's `value`: a number among numeric choices (the
    smallest at least it for a context, which must fit), a choice itself or else `fallback`, a
    number clamped into its range (and onto its step)."""
    if isinstance(dist, CategoricalDistribution):
        if isinstance(dist.choices[0], str):
            return value if value in dist.choices else fallback
        if "multiples" in rule:
            return min((c for c in dist.choices if c >= value), default=dist.choices[-1])
        return _nearest(dist.choices, value)
    if isinstance(dist, FloatDistribution) and dist.step:
        return _snap(value, dist.low, dist.high, dist.step)
    return min(max(value, dist.low), dist.high)


def _nearest(choices, value):
    return min(choices, key=lambda c: (abs(c - value), c))


def _snap(value: float, low: float, high: float, step: float) -> float:
    k = round((min(max(value, low), high) - low) / step)
    return round(low + k * step, 4)
