"""EngineConfig: every knob of the engine, validated, with TOML load/save.

The same file is what `tune` recommends (`recommended.toml`) and what `run --config` reads, so
an unknown key is an error (a misspelt knob silently ignored is a classic tuning trap).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
import tomli_w

from engine.base.dtypes import SHORT_NAMES
from engine.base.durable import atomic_write_text  # noqa: F401  (re-exported: callers import it from here)
from engine.base.errors import ConfigError
from engine.base.inputs import LIMITS, read_text_input

# The one home of the engine's enums: every module, flag and search space imports them from here.
IO_MODES = ("direct", "buffered", "mmap")
# What issues the reads (engine/movement/io): reader threads, io_uring, or io_uring where the kernel allows.
IO_BACKENDS = ("threads", "uring", "auto")
CACHE_POLICIES = ("lru", "lfu", "pinned")
# int8 / fp8 (e4m3): a quantized KV cache, one scale per token per head (engine/arch/kvquant.py); lossy.
KV_QUANT_NAMES = ("fp8", "int8")
KV_DTYPES = ("auto", *SHORT_NAMES, *KV_QUANT_NAMES)
MAX_TOP_K_REDUCTION = 8
CTX_MAX = 1 << 22  # the longest context a config may ask for (prompt and new tokens must fit in it)
# Prompt tokens per sub-chunk of a prefill group (engine/arch/prefill.py): the attention, norms,
# router and dense MLP of a group run over this many tokens at a time, and an expert over at most
# this many tokens' rows, so a layer's transients are bounded whatever the group. Without a bound, a
# 2,000-token prompt on demo-small (hidden 512) grew the trial's resident set by ~310 MiB over an
# 8-token one (every transient of a layer is [T, ...], and every distinct per-expert row count is
# one more cached oneDNN matmul primitive) and was OOM-killed under a 400 MiB budget the plan said
# it fitted. The memory plan charges one sub-chunk's transients (engine/movement/plan.py). One value
# for every placement: the sub-chunks decide the attention's arithmetic, and a budget must not.
PREFILL_CHUNK = 256
COMPUTE_DTYPES = ("auto", "bf16", "fp32")
# Speculative decoding (engine/run/speculative.py): off; gate (each step's depth from the measured
# acceptance against what the verify's extra rows and expert bytes cost); fixed (always the most the
# drafter gives, up to draft_depth: the forced depths a benchmark compares against the gate).
DRAFT_POLICIES = ("off", "gate", "fixed")
# Who drafts (engine/run/drafters.py): lookup (n-gram over the prompt and output), mtp (the
# checkpoint's multi-token-prediction layers), auto (lookup where the text repeats, else MTP where
# the checkpoint has it).
DRAFTERS = ("auto", "lookup", "mtp")
MAX_DRAFT_DEPTH = 16  # fp16 is computed in fp32 on CPU (slow fp16 matmuls)

# An engine config is a dozen keys; anything this large is not one (and is not read whole).
MAX_TOML_BYTES = LIMITS["engine config"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value) -> int:
    """'1GiB', '512M', '1.5g', 4096 → bytes (binary units: K=1024)."""
    if isinstance(value, bool):
        raise ConfigError(f"size {value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError(f"cannot parse size {_short(value)} (examples: 1GiB, 512M, 4096)")
        number, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b").rstrip("i")
    # int(inf) / int(nan) raise; "9" * 400 + "G" parses to inf: all one error, not a traceback.
    if isinstance(number, float) and not math.isfinite(number * _UNITS[unit]):
        raise ConfigError(f"size {_short(value)} is not a finite number of bytes")
    # int() truncates: "0.5B" became 0, which --ram-budget reads as "fully resident".
    if 0 < abs(number * _UNITS[unit]) < 1:
        raise ConfigError(f"size {_short(value)} is less than one byte (0 is written 0)")
    return int(number * _UNITS[unit])


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def format_size(n: int | float | None) -> str:
    """A readable approximate size: 1.5 GiB, 300.0 MiB, 512 B; '-' when unknown."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def size_label(n: int, smallest: str = "B") -> str:
    """A compact exact label, the inverse of parse_size: 1048576 → '1MiB', 1536 → '1536B'.

    Below `smallest` ("KiB", "MiB") nothing is spelt out: the value is rounded down to it.
    """
    units = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
    floor = dict(units)[smallest]
    for unit, size in units:
        if size >= floor and n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n // floor}{smallest}"


def knob(default, doc: str, *, kind: str, label: str = "", short: str = "", lo=None, hi=None, choices=None,
         lt=None, unit: str = "", zero_means: str = "", lossy: bool = False, search: dict | None = None, **flag):
    """An EngineConfig field with what every reader of a knob needs, in one place: its validation
    (knob_problem), the CLI flag (colibri/commands/knob_flags.py: `--name`, its ranged type from
    kind + lo/hi or its choices, `doc` as its help; zero_means: what 0 means, for a size that may
    be 0) and the tables' column (tuner/results/columns.py: label, short name, unit). kind: int, size (bytes; flags take 1GiB), float, choice, path. lo/hi are
    the closed bounds EngineConfig.validate checks (knob_problem; lt: an open upper bound instead),
    the same the flag parses with (tests/test_argtypes.py checks both ends of each).
    search: the range `colibri tune` searches this knob over (tuner/search/space.py reads it; no
    search: the tuner leaves it at its default): choices=(...), or low/high (+ step for a
    float); baseline=, the rules-of-thumb value the study starts from; a range may name a fact
    of the tuning run instead of a number (logical_cores, physical_cores, min_ctx; multiples=
    of min_ctx), needs="gpu" or "serve" (searched only with a GPU, or by tune --objective serve),
    fit="plan" (only the choices the memory plan fits beside the leanest config; the baseline
    the largest of them at most its own), and with_histogram=(choices offered only with a
    routing histogram).
    The tuner's options (tuner/search/options.py TuneOptions) are knobs too, with more kinds
    (duration, seconds, switch, text) and `flag` keywords: flag (its name), group, metavar, output (the
    rule of engine/base/output_target.py a flag naming what tune writes goes through: OUTPUT_KINDS)."""
    meta = {"doc": doc, "zero_means": zero_means, "kind": kind, "lo": lo, "hi": hi, "lt": lt, "choices": choices,
            "lossy": lossy, **flag}
    if label:  # a column of the tables (tuner/results/columns.py)
        meta.update(label=label, short=short, unit=unit)
    if search:  # searched by `colibri tune` (tuner/search/space.py)
        meta["search"] = search
    return dataclasses.field(default=default, metadata=meta)


def knob_problem(f: dataclasses.Field, value) -> str:
    """What `value` of knob field `f` must be, when it is not ("" when it is fine)."""
    m = f.metadata
    kind, lo, hi, lt = m["kind"], m.get("lo"), m.get("hi"), m.get("lt")
    if kind in ("int", "size"):
        if not isinstance(value, int) or isinstance(value, bool):
            return "an integer"
        show = (lambda n: size_label(n) if n else "0") if kind == "size" else str
        if value < lo or (hi is not None and value > hi):
            return f"in [{show(lo)}, {show(hi)}]" if hi is not None else f">= {show(lo)}"
    elif kind == "float":
        top = lt if lt is not None else hi
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value \
            and (value < lt if lt is not None else value <= hi)  # NaN fails every comparison
        if not ok:
            return f"a number in [{lo:g}, {top:g}{')' if lt is not None else ']'}"
    elif kind == "choice":
        if value not in m["choices"]:
            return f"one of {', '.join(m['choices'])}"
    elif not isinstance(value, str):
        return "a path string"
    return ""


@dataclass
class EngineConfig:
    # Memory budget for the whole process (weights, KV, buffers, cache, runtime). 0 = no limit:
    # everything resident.
    ram_budget: int = knob(0, "memory budget, e.g. 1GiB (0 = everything resident)", kind="size", lo=0,
                           zero_means="everything resident", label="RAM budget", short="budget", unit="B")
    # A span (one expert) larger than this is split across the io_threads readers; smaller ones
    # are one request. 4 MiB: demo's 3 MiB experts are read whole, which measured 1.37x the
    # decode speed of splitting them at 1 MiB (docs/benchmarks-history.md, 2026-12-01 10:09-11:35,
    # "One request per span").
    # Searched: expert-sized read requests, 64 KiB..16 MiB, the range the probe measures.
    chunk_size: int = knob(4 << 20, "read request size, e.g. 1MiB", kind="size", lo=4096, hi=1 << 30,
                           label="read size", short="chunk", unit="B",
                           search=dict(choices=tuple(64 << 10 << i for i in range(9)), baseline=1 << 20))
    prefetch_depth: int = knob(1, "layers of router lookahead", kind="int", lo=0, hi=16, label="prefetch depth",
                               short="prefetch", search=dict(low=0, high=4, baseline=2))
    # Searched from 0.25: a bigger cache is not always faster (it leaves the page cache less).
    cpu_cache_ratio: float = knob(1.0, "share of what the budget leaves that the RAM expert cache takes",
                                  kind="float", lo=0.0, hi=1.0, label="RAM cache share", short="cache",
                                  search=dict(low=0.25, high=1.0, step=0.05, baseline=1.0))
    gpu_cache_ratio: float = knob(0.0, "share of free VRAM for the VRAM expert tier (CUDA only)", kind="float",
                                  lo=0.0, hi=1.0, label="VRAM cache share", short="vram",
                                  search=dict(low=0.0, high=0.9, step=0.1, baseline=0.9, needs="gpu"))
    threads: int = knob(0, "torch compute threads (0 = physical cores)", kind="int", lo=0, hi=1024,
                        label="compute threads", short="threads",
                        search=dict(low=1, high="logical_cores", baseline="physical_cores", zero="physical_cores"))
    # Searched: the user's minimum context and two doublings (a config that fits is what matters).
    ctx_size: int = knob(2048, "context size in tokens", kind="int", lo=1, hi=CTX_MAX, label="context",
                         short="ctx", search=dict(multiples=(1, 2, 4), baseline="min_ctx"))
    # A prompt goes through in groups of this many tokens, each group one layer at a time, so each
    # routed expert is read at most once per layer per group (engine/arch/prefill.py). A smaller group
    # shrinks the plan's charge (more room for the expert cache) at the cost of more groups on long
    # prompts, each re-reading the experts the cache cannot hold. tune sizes it from its workload's
    # longest prompt (tuner/search/space.py:prefill_chunk_for) and with --prompts searches it and two
    # halvings (prefill_chunks_for). 0: the largest group
    # the budget allows (engine/movement/plan.py:prefill_group_for); a set group the budget cannot
    # hold is refused.
    prefill_chunk: int = knob(0, "prompt tokens per prefill group, taken through one layer at a time (the "
                              "memory plan charges one group; 0 = the largest the budget allows, up to ctx_size)",
                              kind="int", lo=0, hi=CTX_MAX, label="prefill group", short="group")
    # Sequences decoded together (engine/arch/decode_rows.py: one step over every running sequence,
    # each routed expert read once for all of them): serve's running batch. The memory plan charges a
    # KV cache for each. Not searched for one stream's speed (a batch cannot help it): only tune's
    # serve objective searches it (needs="serve"), over the choices the memory plan fits beside the
    # leanest config (fit="plan"; tuner/search/space.py); baseline 4, a few requests at once.
    max_batch: int = knob(1, "sequences decoded together in one step (serve: requests running at once); the "
                          "memory plan charges a KV cache for each", kind="int", lo=1, hi=256, label="max batch",
                          short="batch", search=dict(choices=(1, 2, 4, 8), baseline=4, needs="serve", fit="plan"))
    kv_dtype: str = knob("auto", "KV cache precision (auto = the compute dtype; int8 / fp8 are lossy)",
                         kind="choice", choices=KV_DTYPES, label="KV dtype", short="kv", lossy=True)
    # Prefix reuse (engine/run/prefix_cache.py): RAM that keeps the KV of recent sequences in
    # blocks, so a prompt sharing a prefix with one prefills only the rest; the memory plan charges
    # it whole. 0 = off: run and bench measure a prompt's full prefill; serve and chat turn it on
    # (colibri/commands/serve.py), as llama-server's cache_prompt is on by default. tune searches it
    # for a conversation workload only (tuner/search/space.py:prefix_caches_for): for independent
    # prompts it could only take RAM from the expert cache.
    prefix_cache: int = knob(0, "RAM for the KV of recent prompts, reused when a later prompt begins the same "
                             "way, e.g. 256MiB", kind="size", lo=0, zero_means="off", label="prefix cache",
                             short="prefix", unit="B")
    io_mode: str = knob("direct", "how expert bytes are read: O_DIRECT, the page cache, or mmap", kind="choice",
                        choices=IO_MODES, label="I/O mode", short="io",
                        search=dict(choices=IO_MODES, baseline="buffered"))
    io_threads: int = knob(4, "reader threads (io_backend uring: reads in flight)", kind="int", lo=1, hi=256,
                           label="I/O threads", short="io thr", search=dict(choices=(1, 2, 4, 8, 16), baseline=4))
    # threads: preadv on io_threads workers. uring: one io_uring ring (the uring-api package),
    # an error where the kernel refuses io_uring; auto: uring where it works, else threads.
    # mmap mode always faults in on the threads. Default threads: docs/BENCHMARKS.md, "io_backend in the engine".
    io_backend: str = knob("threads", "what issues the reads: reader threads or io_uring", kind="choice",
                           choices=IO_BACKENDS, label="I/O backend", short="backend")
    cache_policy: str = knob("lru", "expert cache policy", kind="choice", choices=CACHE_POLICIES,
                             label="cache policy", short="policy",
                             search=dict(choices=CACHE_POLICIES, baseline="lru", with_histogram=("pinned",)))
    routing_histogram: str = knob("", "routing histogram JSON for cache_policy=pinned (from --record-routing)",
                                  kind="path", label="routing histogram", short="histogram")
    dtype: str = knob("auto", "compute dtype (auto: the checkpoint's)", kind="choice", choices=COMPUTE_DTYPES,
                      label="compute dtype", short="dtype")
    # Lossy routing, off by default (engine/arch/router.py:routing_trim): use top_k - top_k_reduction
    # experts per token, and skip an expert whose share of the chosen experts' routing weight is
    # below expert_threshold (the heaviest is always kept); both change the output tokens.
    top_k_reduction: int = knob(0, "route k-N experts per token instead of k (0: as the model)", kind="int", lo=0,
                                hi=MAX_TOP_K_REDUCTION, label="top-k reduction", short="k-", lossy=True)
    # [0, 1) (lt: an open upper bound); the flag's closed bound hi is the largest value below 1 it takes
    expert_threshold: float = knob(0.0, "skip an expert whose share of the token's routing weight is below this "
                                   "(0: none)", kind="float", lo=0.0, hi=0.999999, lt=1.0, label="expert threshold",
                                   short="thresh", lossy=True)

    # Speculative decoding, lossless (greedy: the same tokens; sampling: the same distribution).
    # Searched off / gate: a gated draft turns itself off where it loses, so the tuner asks whether
    # the workload repeats enough to pay. drafter is not searched: MTP exists only in some checkpoints,
    # and auto already takes lookup first.
    draft: str = knob("off", "speculative decoding: off, gate (each step's depth from the measured acceptance "
                      "against the verify's extra rows and expert bytes), fixed (always the drafter's most, up "
                      "to draft_depth)", kind="choice", choices=DRAFT_POLICIES, label="draft policy", short="draft",
                      search=dict(choices=("off", "gate"), baseline="off"))
    draft_depth: int = knob(4, "most tokens drafted per step", kind="int", lo=1, hi=MAX_DRAFT_DEPTH,
                            label="draft depth", short="depth", search=dict(low=1, high=8, baseline=4))
    # (its flag's help avoids the words test_writer_guard takes for a path written: "output")
    drafter: str = knob("auto", "who drafts: lookup (n-gram over the prompt and the text so far), mtp (the "
                        "checkpoint's multi-token-prediction layers), auto (lookup where the text repeats, else "
                        "MTP where the checkpoint has it)", kind="choice", choices=DRAFTERS, label="drafter",
                        short="drafter")

    def __post_init__(self):
        self.validate()

    def validate(self) -> "EngineConfig":
        """Every field against its knob metadata (kind, bounds, choices): one rule per field, the
        same one its flag parses with (colibri/commands/knob_flags.py)."""
        for f in fields(self):
            problem = knob_problem(f, getattr(self, f.name))
            if problem:
                raise ConfigError(f"{f.name} must be {problem}, got {getattr(self, f.name)!r}")
        return self

    @property
    def lossless(self) -> bool:
        """No setting that changes the output tokens (placement and threads aside)."""
        return self.kv_dtype not in KV_QUANT_NAMES and not self.top_k_reduction and not self.expert_threshold

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "EngineConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a table of engine settings")
        if set(data) == {"engine"}:
            data = data["engine"]
            if not isinstance(data, dict):
                raise ConfigError(f"{source}: [engine] must be a table of engine settings")
        data = dict(data)
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(unknown)} "
                              f"(known: {', '.join(cls.field_names())})")
        if "ram_budget" in data:
            data["ram_budget"] = parse_size(data["ram_budget"])
        if "chunk_size" in data:
            data["chunk_size"] = parse_size(data["chunk_size"])
        if "prefix_cache" in data:
            data["prefix_cache"] = parse_size(data["prefix_cache"])
        try:
            return cls(**data)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike, defaults: dict | None = None) -> "EngineConfig":
        """The TOML file's settings over `defaults` (a command's own, e.g. serve's prefix cache),
        over the knobs' defaults."""
        path = Path(path)
        if not os.path.lexists(path):
            raise ConfigError(f"config file {str(path)!r} does not exist")
        text = read_text_input(path, "engine config", ConfigError, limit=MAX_TOML_BYTES)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
        except RecursionError:  # tomllib recurses per nesting level of arrays / inline tables
            raise ConfigError(f"{path}: not valid TOML (nested too deeply)") from None
        if defaults:
            inner = data["engine"] if set(data) == {"engine"} and isinstance(data["engine"], dict) else data
            data = {**defaults, **inner}
        return cls.from_dict(data, source=str(path))

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike, header: str = "") -> None:
        text = tomli_w.dumps({"engine": self.to_dict()})
        if header:
            text = "".join(f"# {line}\n" for line in header.splitlines()) + text
        atomic_write_text(path, text)
