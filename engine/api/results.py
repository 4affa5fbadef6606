"""The typed results: RunResult (`colibri run`), BenchResult (`colibri bench`), SynthResult, PlanResult and
CalibrationResult (`colibri plan`), and the field metadata every printer iterates (`figure`, `fact`,
`figures`), as llama-bench's printers iterate `get_fields()`.

A result is a frozen dataclass with one schema id (`SCHEMA`). Its figure fields are read from the
engine's JSON (the "colibri.metrics/1" dict engine/run/run_metrics.py fills) by name; `data`
keeps that whole dict, so `to_dict()` is the JSON `--json` prints and a trial parses, unchanged.
A new figure is one field here: `from_dict` fills it from the JSON key of its name (or `key`),
and the printers (tuner/results/printers.py) show it with its label, unit and kind.

Field metadata (the keys tuner/results/columns.py reads from every figure field):
  label   the words before the value ("decode", "TTFT")
  short   a narrow header
  kind    how the value reads: float, seconds, ms, share, shares (a dict of shares), bytes, int, text
  unit    printed after the value ("tok/s", "s")
  line    which printed line the figure sits on (run_text: "speed", "io")
  key     the JSON key, when it is not the field's name ("hit_rate")
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

# The JSON's own schema id (what stored results and trials read): unchanged.
METRICS_SCHEMA = "colibri.metrics/1"


def figure(label: str, short: str = "", kind: str = "float", unit: str = "", line: str = "speed",
           key: str = "", default=None):
    """A figure field: its printed label, kind, unit and line (module docstring)."""
    meta = {"label": label, "short": short or label, "kind": kind, "line": line}
    if unit:
        meta["unit"] = unit
    if key:
        meta["key"] = key
    return field(default=default, metadata=meta)


def figures(result_or_class) -> list[dataclasses.Field]:
    """The figure fields of a result (or its class), in declaration order."""
    return [f for f in dataclasses.fields(result_or_class) if "label" in f.metadata]


@dataclass(frozen=True)
class Result:
    """A typed result with one schema id; its JSON is its fields (and the id, as "schema")."""

    SCHEMA: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        out = {"schema": self.SCHEMA}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None or not f.metadata.get("omit_none"):
                out[f.name] = value
        return out


@dataclass(frozen=True)
class EngineResult(Result):
    """A result the engine wrote as JSON: figure fields over the whole dict (`data`)."""

    data: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineResult":
        """From the engine's JSON: each field from its key (absent: None), the dict kept whole."""
        if isinstance(d, cls):
            return d
        values = {f.name: d.get(f.metadata.get("key") or f.name) for f in dataclasses.fields(cls) if f.name != "data"}
        return cls(data=dict(d), **values)

    def to_dict(self) -> dict[str, Any]:
        """The JSON, as the engine wrote it (what --json prints and trials parse)."""
        return dict(self.data)

    def get(self, key: str, default=None):
        """A key of the JSON that is no field (conditions: config, plan, geometry ...)."""
        return self.data.get(key, default)

    def __getitem__(self, key: str):
        return self.data[key]


@dataclass(frozen=True)
class RunResult(EngineResult):
    """One generation (`colibri run`): latency, speed, memory, and I/O when it streamed."""

    SCHEMA: ClassVar[str] = "colibri.engine-run/1"

    ttft_s: Optional[float] = figure("TTFT", "TTFT", "seconds", "s")
    prefill_tok_s: Optional[float] = figure("prefill", "prefill", "float", "tok/s")
    decode_tok_s: Optional[float] = figure("decode", "decode", "float", "tok/s")
    token_latency_p50_ms: Optional[float] = figure("p50", "p50 ms", "ms", "ms")
    token_latency_p99_ms: Optional[float] = figure("p99", "p99 ms", "ms", "ms")
    peak_rss_bytes: Optional[int] = figure("peak RSS", "peak", "bytes")
    rss_file_bytes: Optional[int] = figure("file-backed", "file RSS", "bytes")
    bytes_read: Optional[int] = figure("read", "read", "bytes", line="io")
    read_gbps: Optional[float] = figure("read rate", "read", "float", "GB/s", line="io")
    hit_rate: Optional[dict] = figure("hit rate", "hit", "shares", line="io")
    lookahead_recall: Optional[float] = figure("lookahead recall", "recall", "share", line="io")
    io_stall_fraction: Optional[float] = figure("I/O stall", "stall", "share", line="io")
    # speculative decoding (engine/run/speculative.py), when on: tokens per decode step (accepted
    # drafts + one), the drafts' acceptance, drafted tokens, bytes read per token produced
    tokens_per_step: Optional[float] = figure("tokens per step", "tok/step", "float", line="draft")
    draft_acceptance: Optional[float] = figure("draft acceptance", "accept", "share", line="draft")
    drafted_tokens: Optional[int] = figure("drafted", "drafted", "int", line="draft")
    draft_bytes_per_token: Optional[float] = figure("read per token", "read/tok", "bytes", line="draft")
    # conditions the header prints (not figures)
    prompt_tokens: Optional[int] = None
    generated_tokens: Optional[int] = None
    compute_dtype: Optional[str] = None
    quant: Optional[str] = None
    kernel: Optional[str] = None
    threads: Optional[int] = None
    text: Optional[str] = None
    output_ids: Optional[list] = None

    @property
    def streamed(self) -> bool:
        """Whether the run read experts from disk (its I/O line means something)."""
        return self.bytes_read is not None


@dataclass(frozen=True)
class BenchResult(RunResult):
    """A bench (`colibri bench`): the run's figures as medians over the repeats, and the repeats'
    spread under `summary`."""

    SCHEMA: ClassVar[str] = "colibri.engine-bench/1"

    bytes_read_per_token: Optional[float] = figure("read per token", "read/tok", "bytes", line="io")
    # `bench --batch B` (engine/run/bench.py): B sequences decoded together; decode_tok_s is then the
    # aggregate too. None in a bench of one sequence.
    batch: Optional[int] = figure("batch", "B", "int", line="batch")
    aggregate_tok_s: Optional[float] = figure("aggregate", "agg tok/s", "float", "tok/s", line="batch")
    sequence_tok_s: Optional[float] = figure("per sequence", "seq tok/s", "float", "tok/s", line="batch")
    ttft_p95_s: Optional[float] = figure("TTFT p95", "TTFT p95", "seconds", "s", line="batch")
    bytes_read_per_step: Optional[float] = figure("read per step", "read/step", "bytes", line="batch")
    union_experts_per_step: Optional[float] = figure("experts per layer per step (union)", "union", "float",
                                                     line="batch")
    # `bench --trace` (engine/run/trace_replay.py): the replay through serve's scheduler, judged
    # against --slo-ttft / --slo-tpot; medians over repeats (its aggregate tok/s and TTFT p95 are the
    # fields above, of the same names). None on the other benches.
    goodput_rps: Optional[float] = figure("goodput", "goodput", "float", "req/s", line="serve")
    slo_met: Optional[int] = figure("requests within the SLOs", "met", "int", line="serve")
    ttft_p50_s: Optional[float] = figure("TTFT p50", "TTFT p50", "seconds", "s", line="serve")
    tpot_p50_s: Optional[float] = figure("TPOT p50", "TPOT p50", "seconds", "s", line="serve")
    tpot_p95_s: Optional[float] = figure("TPOT p95", "TPOT p95", "seconds", "s", line="serve")
    queue_wait_p50_s: Optional[float] = figure("queue wait p50", "wait p50", "seconds", "s", line="serve")
    queue_wait_p95_s: Optional[float] = figure("queue wait p95", "wait p95", "seconds", "s", line="serve")
    makespan_s: Optional[float] = figure("makespan", "makespan", "seconds", "s", line="serve")
    batch_mean: Optional[float] = figure("mean batch", "batch", "float", line="serve")

    cold: Optional[bool] = None
    tokens: Optional[int] = None
    repeats: Optional[int] = None
    tokens_consistent: Optional[bool] = None
    summary: Optional[dict] = None
    io_mode_effective: Optional[str] = None
    io_backend_effective: Optional[str] = None

    def spread(self, name: str = "decode_tok_s") -> dict:
        """One headline figure's spread over the repeats: median, min, max, stdev, n."""
        return (self.summary or {}).get(name) or {"median": None, "min": None, "max": None, "stdev": None, "n": 0}



@dataclass(frozen=True)
class SynthResult(EngineResult):
    """`colibri synth`: what was written (engine/synth `summarize`, and the seconds it took)."""

    SCHEMA: ClassVar[str] = "colibri.synth/1"

    path: Optional[str] = None
    bytes: Optional[int] = figure("size", "size", "bytes", line="synth")
    shards: Optional[int] = figure("shards", "shards", "int", line="synth")
    tensors: Optional[int] = figure("tensors", "tensors", "int", line="synth")
    seed: Optional[int] = figure("seed", "seed", "int", line="synth")
    routing_skew: Optional[float] = figure("routing skew", "skew", "text", line="synth")
    seconds: Optional[float] = figure("took", "s", "seconds", "s", line="synth")

# --- colibri plan ---------------------------------------------------------------------------------
# The cost model's answers (tuner/costmodel/plan_command.py fills them, tuner/results/plan_printers.py
# prints them): the prediction's conditions are fields with a label, printed by iterating.

def fact(label: str, kind: str = "text", default=None, **meta):
    """A condition of a plan, printed as 'label: value' when it has one (kind: text, list; notes:
    words on a value, printed after it)."""
    return field(default=default, metadata={"label": label, "short": label, "kind": kind, "line": "facts", **meta})


@dataclass(frozen=True)
class PlanResult(Result):
    """`colibri plan`: the predicted figures of a config on a hardware profile, and the best
    predicted configs (JSON: these fields, and "schema")."""

    SCHEMA: ClassVar[str] = "colibri.plan/1"

    model: dict
    quant: str
    routing: str = fact("routing")
    conditions: str = fact("conditions", notes={"steady": "warm cache, long generation",
                                                "trial": "cold, 8+8 tokens, 2 repeats"})
    what_if: list = fact("what-if", "list")
    calibrated: bool = False
    factors: dict = field(default_factory=dict)
    lookahead_recall_source: str = fact("lookahead recall")
    # which io modes the profile's calibration has held-out trials of (tuner/costmodel/calibrated_facts.py)
    calibrated_for: str = fact("calibrated for")
    profile_routing: Optional[str] = fact("the profile's routing statistics for this geometry")
    overhead_bytes: int = 0
    config: dict = field(default_factory=dict)
    prediction: dict = field(default_factory=dict)
    best: list = field(default_factory=list)
    # `--batch`: per batch size, the predicted step of that many sequences decoding together
    # (tuner/costmodel/batch_model.py BatchPoint: union of experts, bytes per step, per-sequence and
    # aggregate tok/s, bottleneck)
    batch: list = field(default_factory=list)
    # speculative decoding at the asked acceptance (tuner/costmodel/speculative.py): per depth the
    # speed-up, and the gate's choice; {} when not asked (plan --accept-rate)
    draft: dict = field(default_factory=dict)
    # `plan --prompt-tokens N [--cached-tokens M]`: the time to first token of N new tokens after
    # M reused ones, and its parts (tuner/costmodel/predict.py predict_prefill).
    prefill: Optional[dict] = field(default=None, metadata={"omit_none": True})


@dataclass(frozen=True)
class CalibrationResult(Result):
    """`colibri plan --calibrate`: the fitted factors' cross-validated error, stored in the profile."""

    SCHEMA: ClassVar[str] = "colibri.plan-calibration/1"

    calibration: dict
    held_out: list
    profile: str
    test: Optional[dict] = field(default=None, metadata={"omit_none": True})
