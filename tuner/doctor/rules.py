"""The doctor's rules: pure functions from measured `Facts` to findings (symptom, cause, fix).

Each rule looks at one thing a streaming run depends on and says nothing when it cannot know
(a fact that could not be measured is None, and the rule is skipped, not guessed). Thresholds
come from what practitioners measured and published: a 4 KiB random read
under ~50k IOPS marks the SSD as the bottleneck; fragmented files and throttled CPUs cost
throughput; a budget that cannot hold the dense part, the KV cache and the read buffers cannot run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from engine.api import format_size

GiB = 1 << 30
IOPS_BOTTLENECK = 50_000  # 4 KiB random reads at QD32: under this the SSD is the bottleneck
QD1_LATENCY_SLOW_US = 200.0  # a good NVMe answers a 4 KiB QD1 read in ~80-100 us; SATA ~200+
EXTENTS_PER_GIB_HIGH = 64  # ext4/xfs keep big files in 128 MiB extents: 8/GiB is a clean file
BACKGROUND_SHARE = 0.20  # more than this of RAM taken by others is worth saying
FREQ_THROTTLED = 0.80  # current clock under 80% of the maximum while idle-ish


@dataclass
class Facts:
    """What doctor measured (None where it could not)."""

    model_dir: str | None = None
    model_error: str | None = None  # the loader `run` uses refused the model (then no other model fact)
    model_summary: str | None = None
    model_bytes: int | None = None
    disk_free_bytes: int | None = None
    mem_total_bytes: int | None = None
    mem_available_bytes: int | None = None
    swap_total_bytes: int | None = None
    swap_used_bytes: int | None = None
    o_direct: bool | None = None
    o_direct_error: str | None = None
    extents_per_gib: float | None = None
    worst_file: str | None = None
    qd1_latency_us: float | None = None
    iops_4k: float | None = None
    iops_source: str | None = None
    native_error: str | None = None  # None with native_checked: the native kernels load
    native_checked: bool = False
    model_dtype: str | None = None
    cpu_has_avx512_bf16: bool | None = None
    cpu_has_avx2: bool | None = None  # (with FMA: the native kernels' AVX2 build)
    native_build: str | None = None  # which build loaded: "avx512" or "avx2"
    cgroup_available: bool | None = None
    cgroup_reason: str | None = None
    freq_ratio: float | None = None
    throttle_events: int | None = None
    thp_mode: str | None = None  # transparent huge pages: always / madvise / never (None: no THP)
    budget_bytes: int | None = None
    plan_error: str | None = None
    plan_fixed_bytes: int | None = None
    plan_cache_bytes: int | None = None
    # speculative decoding as the cost model predicts it here (tuner/costmodel/speculative.py), at
    # draft_acceptance: the best depth's speed-up over plain decoding (<= 1: drafting loses)
    draft_acceptance: float | None = None
    draft_best_speedup: float | None = None
    draft_best_depth: int | None = None
    draft_bytes_per_token: float | None = None  # plain decoding's expert reads per token, for the words
    draft_union: float | None = None  # the best depth's verify union (expert bytes of its rows over one row's)
    # doctor --conversation-tokens N: a conversation of N tokens (its KV at every position of every
    # layer, as the prefix cache keeps it), the prefix cache's RAM and the SSD tier's bound and room.
    conversation_tokens: int | None = None
    conversation_error: str | None = None  # the plan at ctx_size N with the prefix cache refused
    conversation_kv_bytes: int | None = None
    prefix_cache_bytes: int | None = None
    kv_disk_bytes: int | None = None
    kv_disk_free_bytes: int | None = None
    kv_restore_seconds: float | None = None  # one conversation's KV read back (the probe's buffered curve)


@dataclass
class Finding:
    rule: str
    severity: str  # "ok" | "warn" | "problem"
    symptom: str
    cause: str = ""
    fix: str = ""


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "problem"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warn"]

    def verdict(self) -> str:
        if self.problems:
            return f"not ready: {len(self.problems)} problem(s), {len(self.warnings)} warning(s); first: {self.problems[0].symptom}"
        if self.warnings:
            return f"ready, with {len(self.warnings)} warning(s): {self.warnings[0].symptom}"
        return f"ready: {len(self.findings)} checks passed"

    def to_dict(self) -> dict:
        return {"verdict": self.verdict(), "findings": [asdict(f) for f in self.findings]}


def model(f: Facts) -> list[Finding]:
    if f.model_error:
        return [Finding("model", "problem", f.model_error, "run opens the model the same way and would refuse it",
                        "point --model at a Hugging Face model directory (config.json and its *.safetensors), "
                        "or fix the file named")]
    if f.model_summary:
        return [Finding("model", "ok", f.model_summary)]
    return []


def disk_space(f: Facts) -> list[Finding]:
    if f.model_bytes is None or f.disk_free_bytes is None:
        return []
    # Converting a model writes a second copy of about its size next to it (int8 ~half, int4 ~quarter).
    if f.disk_free_bytes < f.model_bytes // 4:
        return [Finding("disk_space", "warn", f"{format_size(f.disk_free_bytes)} free on the model's filesystem, "
                        f"the model is {format_size(f.model_bytes)}",
                        "not enough room for a quantized copy (`tune --quant`, `convert`)",
                        "free space, or convert to another disk with `convert -o /other/disk/...`")]
    return [Finding("disk_space", "ok", f"{format_size(f.disk_free_bytes)} free for a {format_size(f.model_bytes)} model")]


def memory(f: Facts) -> list[Finding]:
    out = []
    if f.mem_total_bytes and f.mem_available_bytes is not None:
        used = 1 - f.mem_available_bytes / f.mem_total_bytes
        if used > BACKGROUND_SHARE:
            out.append(Finding("memory", "warn", f"{format_size(f.mem_available_bytes)} available of "
                               f"{format_size(f.mem_total_bytes)} nominal ({used:.0%} in use by other processes)",
                               "background programs hold memory the expert cache could use",
                               "close them, or size --ram-budget to the available memory, not the nominal"))
        else:
            out.append(Finding("memory", "ok", f"{format_size(f.mem_available_bytes)} of {format_size(f.mem_total_bytes)} available"))
    if f.swap_used_bytes:
        out.append(Finding("swap", "warn", f"{format_size(f.swap_used_bytes)} of swap in use",
                           "pages swapped to the same SSD compete with expert reads",
                           "lower the budget below available RAM, or `swapoff` while streaming"))
    return out


def o_direct(f: Facts) -> list[Finding]:
    if f.o_direct is None:
        return []
    if not f.o_direct:
        return [Finding("o_direct", "warn", f"O_DIRECT reads fail on the model's filesystem ({f.o_direct_error})",
                        "the filesystem (tmpfs, some FUSE/network filesystems) refuses direct I/O",
                        "use io_mode = \"buffered\" with a memory cgroup, or move the model to ext4/xfs on the SSD")]
    return [Finding("o_direct", "ok", "O_DIRECT reads work on the model's filesystem")]


def fragmentation(f: Facts) -> list[Finding]:
    if f.extents_per_gib is None:
        return []
    if f.extents_per_gib > EXTENTS_PER_GIB_HIGH:
        return [Finding("fragmentation", "warn", f"{f.extents_per_gib:.0f} extents per GiB (worst: {f.worst_file})",
                        "a fragmented file turns one expert read into many scattered ones",
                        "copy the model to a fresh directory (cp writes files in long extents), or e4defrag it")]
    return [Finding("fragmentation", "ok", f"{f.extents_per_gib:.1f} extents per GiB")]


def ssd(f: Facts) -> list[Finding]:
    out = []
    if f.iops_4k is not None:
        if f.iops_4k < IOPS_BOTTLENECK:
            out.append(Finding("ssd_iops", "warn", f"4 KiB random reads at {f.iops_4k:,.0f} IOPS ({f.iops_source})",
                               f"under ~{IOPS_BOTTLENECK:,} IOPS the SSD is the bottleneck for expert streaming "
                               "(SATA, DRAM-less or virtual disks, an exhausted SLC cache)",
                               "an NVMe SSD; meanwhile a larger expert cache and prefetch (what `tune` searches)"))
        else:
            out.append(Finding("ssd_iops", "ok", f"4 KiB random reads at {f.iops_4k:,.0f} IOPS"))
    if f.qd1_latency_us is not None and f.qd1_latency_us > QD1_LATENCY_SLOW_US:
        out.append(Finding("ssd_latency", "warn", f"4 KiB QD1 read latency {f.qd1_latency_us:.0f} us",
                           "every demand read the compute waits for costs at least this",
                           "more prefetch depth and io_threads hide it; a faster SSD removes it"))
    return out


def native_kernels(f: Facts) -> list[Finding]:
    if not f.native_checked:
        return []
    if f.native_error is None:
        build = "AVX2 build of the native" if f.native_build == "avx2" else "native AVX-512"
        return [Finding("native_kernels", "ok", f"the {build} decode kernels load")]
    bf16 = f.model_dtype == "bf16"
    return [Finding("native_kernels", "warn" if bf16 else "ok",
                    f"native kernels not active: {f.native_error}",
                    "decode falls back to torch's matmuls" + (" (slower for a bf16 model)" if bf16 else ""),
                    "install g++ (scripts/setup.sh does), unset COLIBRI_NATIVE=0, or accept the fallback"
                    if f.cpu_has_avx512_bf16 is not False or f.cpu_has_avx2 is not False
                    else "this CPU lacks AVX512-BF16 and AVX2: the fallback is expected")]


def cgroup(f: Facts) -> list[Finding]:
    if f.cgroup_available is None:
        return []
    if not f.cgroup_available:
        return [Finding("cgroup", "warn", f"no memory cgroup for trials ({f.cgroup_reason})",
                        "without one, buffered and mmap trials can borrow page cache beyond the budget",
                        "run as root with cgroup v1 memory, or delegate a cgroup v2 subtree to this user")]
    return [Finding("cgroup", "ok", "memory cgroups available: trials hold their budget, page cache included")]


def throttling(f: Facts) -> list[Finding]:
    out = []
    if f.throttle_events:
        out.append(Finding("throttling", "warn", f"{f.throttle_events} thermal throttle events since boot",
                           "the CPU slowed itself down to cool", "improve cooling; compare runs at the same temperature"))
    if f.freq_ratio is not None and f.freq_ratio < FREQ_THROTTLED:
        out.append(Finding("frequency", "warn", f"CPU clock at {f.freq_ratio:.0%} of its maximum",
                           "a power-saving governor or a thermal limit", "set the `performance` governor while tuning"))
    return out


def huge_pages(f: Facts) -> list[Finding]:
    if f.thp_mode is None:
        return []
    if f.thp_mode == "never":
        return [Finding("huge_pages", "warn", "transparent huge pages are off (enabled = never)",
                        "resident weights are read through 4 KiB pages, a TLB miss per 4 KiB a token reads: "
                        "resident decode measured 1.07-1.11x slower without them (docs/BENCHMARKS.md)",
                        "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (as root): the engine asks "
                        "for huge pages only on its own weights")]
    return [Finding("huge_pages", "ok", f"transparent huge pages available ({f.thp_mode}): resident weights get 2 MiB pages")]


def budget(f: Facts) -> list[Finding]:
    if f.budget_bytes is None:
        return []
    if f.plan_error:
        return [Finding("budget", "problem", f.plan_error, "the dense part, KV cache and read buffers need more",
                        "raise --ram-budget, lower ctx_size or prefetch_depth, or use a quantized container")]
    return [Finding("budget", "ok", f"budget {format_size(f.budget_bytes)} holds the fixed part "
                    f"({format_size(f.plan_fixed_bytes)}) and leaves {format_size(f.plan_cache_bytes)} of expert cache")]


def drafting(f: Facts) -> list[Finding]:
    """Whether speculative decoding pays on this machine for this model and budget (the cost model
    at an assumed acceptance): a verify's rows read the union of their experts, which under
    streaming can cost more bytes than the accepted tokens save."""
    if f.draft_best_speedup is None or f.draft_acceptance is None:
        return []
    if f.draft_best_speedup <= 1.0:
        return [Finding("drafting", "warn",
                        f"speculative decoding loses here: at {f.draft_acceptance:.0%} acceptance the best depth "
                        f"({f.draft_best_depth}) decodes at {f.draft_best_speedup:.2f}x plain",
                        f"a verify of {f.draft_best_depth + 1} rows reads {f.draft_union:.2f}x a token's expert bytes "
                        f"({format_size(f.draft_bytes_per_token)} per plain token), more than the accepted drafts save",
                        "keep draft = \"off\", or \"gate\", which measures the acceptance and turns itself off; a larger "
                        "budget (more experts cached) or a copy-heavy workload (higher acceptance) changes it")]
    return [Finding("drafting", "ok", f"speculative decoding pays here: depth {f.draft_best_depth} at "
                    f"{f.draft_acceptance:.0%} acceptance predicted {f.draft_best_speedup:.2f}x (draft = \"gate\")")]



def conversation(f: Facts) -> list[Finding]:
    """Can the budget hold a conversation's KV (the KV cache at its length, and its copy in the
    prefix cache for when another conversation comes between), and what the SSD tier gives."""
    if f.conversation_tokens is None:
        return []
    n = f.conversation_tokens
    if f.conversation_error:
        return [Finding("conversation", "problem", f"a conversation of {n} tokens does not fit: {f.conversation_error}",
                        "its KV cache at that context (every position kept, for reuse) and the prefix cache's "
                        "RAM are charged beside the dense part and the read buffers",
                        "raise --ram-budget, lower --prefix-cache, or store the KV in int8 (kv_dtype = \"int8\": "
                        "half the bytes; lossy)")]
    kv, ram, disk = f.conversation_kv_bytes or 0, f.prefix_cache_bytes or 0, f.kv_disk_bytes or 0
    room = min(disk, f.kv_disk_free_bytes) if f.kv_disk_free_bytes is not None else disk
    held = room // kv if kv else 0
    restore = f" each read back in ~{f.kv_restore_seconds:.2g} s" if f.kv_restore_seconds is not None else ""
    tier = (f"the SSD tier (--kv-disk {format_size(disk)}) keeps {held} such conversation(s),{restore} instead of "
            "recomputing them, and after a restart" if held else
            "the SSD tier is off (--kv-disk 0)" if not disk else
            f"the SSD tier's {format_size(room)} cannot hold one either")
    if ram < kv:
        return [Finding("conversation", "warn", f"the prefix cache ({format_size(ram)}) holds "
                        f"{ram * n // kv if kv else 0} tokens of KV; a conversation of {n} tokens needs {format_size(kv)}",
                        "a turn that follows another conversation recomputes the history RAM could not keep "
                        "(the next turn of the same conversation reuses the KV cache as it stands)",
                        f"{tier}; or raise --prefix-cache to {format_size(kv)} (the plan takes it from the expert "
                        "cache)" if held else f"{tier}: raise --prefix-cache to {format_size(kv)} or --kv-disk")]
    return [Finding("conversation", "ok", f"the prefix cache ({format_size(ram)}) holds {ram // kv if kv else 0} "
                    f"conversation(s) of {n} tokens ({format_size(kv)} of KV each); {tier}")]



RULES = (model, disk_space, memory, o_direct, fragmentation, ssd, native_kernels, cgroup, throttling, huge_pages,
         budget, drafting, conversation)


def diagnose(facts: Facts) -> Diagnosis:
    return Diagnosis([finding for rule in RULES for finding in rule(facts)])
