"""What `colibri doctor` measures: the machine, the model's files and a probe, as `Facts`.

Everything here is a reading (statvfs, /proc, sysfs, FIEMAP, one O_DIRECT read, the engine's own
memory plan); the judging is in rules.py. A reading that fails leaves its fact None.
"""

from __future__ import annotations

import array
import fcntl
import mmap
import os
import struct
from pathlib import Path

import psutil

from engine.api import load_native_kernels, native_kernels_build, runnable_native_builds
from engine.api import (BLOCK_TOKENS, BudgetError, Checkpoint, ColibriError, DTYPE_NAMES, EngineConfig, ExpertLayout,
                        checkpoint_dtype, make_plan, model_args, thp_mode)
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.model_geometry import resolve
from tuner.costmodel.predict import Factors, RunConditions
from tuner.costmodel.routing_model import make_routing
from tuner.costmodel.speculative import DEFAULT_ACCEPTANCE, draft_prediction
from tuner.doctor.rules import GiB, Facts
from tuner.probe.hardware_profile import HardwareProfile
from tuner.sandbox import detect_memory_cgroup

FS_IOC_FIEMAP = 0xC020660B
FRAGMENTATION_MIN_FILE = 64 << 20
FIEMAP_HEADER = struct.Struct("=QQLLLL")  # start, length, flags, mapped_extents, extent_count, reserved
# The runtime a bench process carries (torch, the index) before any expert: the tuner's fallback.
OVERHEAD_BYTES = 310 << 20


def extent_count(path: Path) -> int | None:
    """Extents of a file from the FIEMAP ioctl (extent_count 0 asks only for the count)."""
    buf = array.array("B", FIEMAP_HEADER.pack(0, 0xFFFFFFFFFFFFFFFF, 0, 0, 0, 0))
    try:
        with open(path, "rb") as f:
            fcntl.ioctl(f.fileno(), FS_IOC_FIEMAP, buf)
    except OSError:
        return None
    return FIEMAP_HEADER.unpack(buf.tobytes())[3]


def o_direct_read(path: Path) -> str | None:
    """None if a 4 KiB O_DIRECT read of `path` works, else why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        return exc.strerror or str(exc)
    try:
        buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
        try:
            os.preadv(fd, [buf], 0)
        except OSError as exc:
            return exc.strerror or str(exc)
        finally:
            buf.close()
    finally:
        os.close(fd)
    return None


def open_model(model_dir: Path, facts: Facts) -> Checkpoint | None:
    """The model through the loader `run` uses (config.json a regular JSON file within its limits
    and valid for its model_type, every shard's header checked), or None with the reason in
    facts.model_error: `doctor --model /` used to say "ready" for a 0 B model."""
    facts.model_dir = str(model_dir)
    try:
        ckpt = Checkpoint(model_dir)
    except ColibriError as exc:
        facts.model_error = str(exc)
        return None
    shards = {info.path for info in ckpt.tensors.values()}
    facts.model_summary = (f"{ckpt.config.get('model_type')}: config.json valid, {len(ckpt.tensors)} tensors "
                           f"in {len(shards)} shard(s)")
    return ckpt


def model_facts(ckpt: Checkpoint, facts: Facts) -> None:
    """Sizes, free space, O_DIRECT and fragmentation of the shards the checkpoint indexes (those
    it reads: not every *.safetensors beside them)."""
    model_dir = ckpt.directory
    files = sorted({Path(info.path) for info in ckpt.tensors.values()})
    facts.model_bytes = sum(p.stat().st_size for p in files)
    st = os.statvfs(model_dir)
    facts.disk_free_bytes = st.f_bavail * st.f_frsize
    if files:
        facts.o_direct_error = o_direct_read(files[0])
        facts.o_direct = facts.o_direct_error is None
        # Extents per GiB only mean something for big files: a small one is one extent whatever.
        big = [p for p in files if p.stat().st_size >= FRAGMENTATION_MIN_FILE]
        counts = {p: extent_count(p) for p in big}
        if big and all(c is not None for c in counts.values()):
            facts.extents_per_gib = sum(counts.values()) / (sum(p.stat().st_size for p in big) / GiB)
            worst = max(big, key=lambda p: counts[p] / p.stat().st_size)
            facts.worst_file = f"{worst.name}: {counts[worst]} extents in {worst.stat().st_size / GiB:.2f} GiB"


def plan_facts(ckpt: Checkpoint, config: EngineConfig, facts: Facts) -> None:
    facts.budget_bytes = config.ram_budget
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args) if args.is_moe else None
    dtype = checkpoint_dtype(ckpt)
    facts.model_dtype = next((k for k, v in DTYPE_NAMES.items() if v == dtype), str(dtype))
    kv = dtype if config.kv_dtype == "auto" else DTYPE_NAMES[config.kv_dtype]
    try:
        plan = make_plan(ckpt, args, layout, config, dtype, kv, overhead_bytes=OVERHEAD_BYTES)
    except BudgetError as exc:
        facts.plan_error = str(exc)
        return
    facts.plan_fixed_bytes = (plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + plan.overhead_bytes
                              + plan.prefill_bytes + plan.prefix_cache_bytes + plan.draft_bytes)
    facts.plan_cache_bytes = plan.cache_bytes


def conversation_facts(ckpt: Checkpoint, config: EngineConfig, tokens: int, kv_disk_bytes: int, kv_dir: Path,
                       profile: HardwareProfile | None, facts: Facts) -> None:
    """A conversation of `tokens`: the plan at that context with the prefix cache (every position
    kept), its KV bytes, the prefix cache's RAM, and the SSD tier's bound, room and read-back time."""
    facts.conversation_tokens = tokens
    facts.prefix_cache_bytes = config.prefix_cache
    facts.kv_disk_bytes = kv_disk_bytes
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args) if args.is_moe else None
    dtype = checkpoint_dtype(ckpt)
    kv = dtype if config.kv_dtype == "auto" else DTYPE_NAMES[config.kv_dtype]
    at = config.replace(ctx_size=tokens)
    try:
        plan = make_plan(ckpt, args, layout, at, dtype, kv, overhead_bytes=OVERHEAD_BYTES, keep_positions=True)
    except BudgetError as exc:
        facts.conversation_error = str(exc)
        return
    facts.conversation_kv_bytes = plan.kv_bytes
    where = next((p for p in (kv_dir, *kv_dir.parents) if p.exists()), None)
    if where is not None:
        st = os.statvfs(where)
        facts.kv_disk_free_bytes = st.f_bavail * st.f_frsize
    if profile is not None and plan.kv_bytes:
        block = max(4096, plan.kv_bytes * BLOCK_TOKENS // tokens)  # one SSD file per prefix block
        facts.kv_restore_seconds = plan.kv_bytes / profile.read_bandwidth(block, 1, direct=False)


def machine_facts(facts: Facts) -> None:
    vm, sw = psutil.virtual_memory(), psutil.swap_memory()
    facts.mem_total_bytes, facts.mem_available_bytes = vm.total, vm.available
    facts.swap_total_bytes, facts.swap_used_bytes = sw.total, sw.used
    facts.native_error = load_native_kernels()
    facts.native_build = native_kernels_build()
    facts.native_checked = True
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
        facts.cpu_has_avx512_bf16 = "avx512_bf16" in flags
        facts.cpu_has_avx2 = "avx2" in runnable_native_builds()
    except (OSError, IndexError):
        pass
    support = detect_memory_cgroup()
    facts.cgroup_available, facts.cgroup_reason = support.available, support.reason
    facts.freq_ratio = cpu_freq_ratio()
    facts.throttle_events = throttle_events()
    mode = thp_mode()
    facts.thp_mode = None if mode == "unavailable" else mode


def cpu_freq_ratio(root: Path = Path("/sys/devices/system/cpu")) -> float | None:
    ratios = []
    for cpu in root.glob("cpu[0-9]*/cpufreq"):
        try:
            ratios.append(int((cpu / "scaling_cur_freq").read_text()) / int((cpu / "cpuinfo_max_freq").read_text()))
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return min(ratios) if ratios else None


def throttle_events(root: Path = Path("/sys/devices/system/cpu")) -> int | None:
    counts = []
    for f in root.glob("cpu[0-9]*/thermal_throttle/*_throttle_count"):
        try:
            counts.append(int(f.read_text()))
        except (OSError, ValueError):
            continue
    return sum(counts) if counts else None


def probe_facts(profile: HardwareProfile, facts: Facts) -> None:
    lat = profile.storage_point("latency_4k")
    iops = profile.storage_point("iops_4k")
    if lat is not None:
        facts.qd1_latency_us = lat.lat_p50.value or lat.lat_mean.value
    if iops is not None:
        facts.iops_4k = iops.iops.value
        facts.iops_source = f"{profile.storage.method} {iops.request_bytes // 1024} KiB QD{iops.queue_depth}"


def draft_facts(model_dir: Path, config: EngineConfig, profile: HardwareProfile, facts: Facts,
                acceptance: float = DEFAULT_ACCEPTANCE) -> None:
    """The cost model's speculative-decoding prediction for this model, budget and machine."""
    geometry = resolve(str(model_dir))
    routing = make_routing("auto", geometry)
    try:
        d = draft_prediction(geometry, geometry.native_quant, config.replace(draft_depth=max(config.draft_depth, 4)),
                             HardwareView(profile), routing, Factors(), RunConditions.steady(), OVERHEAD_BYTES,
                             acceptance)
    except BudgetError:
        return  # the budget rule says why
    best = max(d["depths"], key=lambda x: x["speedup"] or 0.0, default=None)
    if best is None or best["speedup"] is None:
        return
    facts.draft_acceptance, facts.draft_best_speedup, facts.draft_best_depth = acceptance, best["speedup"], best["depth"]
    facts.draft_bytes_per_token, facts.draft_union = d["plain_bytes_per_token"], best["union"]


def gather(model_dir: Path | None, config: EngineConfig | None, profile: HardwareProfile | None,
           conversation: tuple[EngineConfig, int, int, Path] | None = None) -> Facts:
    """Every reading; the memory plan only when a budget (config) is given; the drafting rule's
    prediction when a profile and a model are (at the config's budget, or all resident); a
    conversation's KV when asked (its engine config, tokens, the SSD tier's bound and directory)."""
    facts = Facts()
    machine_facts(facts)
    ckpt = open_model(model_dir, facts) if model_dir is not None else None
    if ckpt is not None:
        model_facts(ckpt, facts)
        if config is not None:
            try:
                plan_facts(ckpt, config, facts)
            except ColibriError as exc:
                facts.plan_error = str(exc)
        if conversation is not None:
            try:
                conversation_facts(ckpt, *conversation, profile, facts)
            except ColibriError as exc:
                facts.conversation_error = str(exc)
    if profile is not None:
        probe_facts(profile, facts)
        if ckpt is not None and facts.plan_error is None:
            try:
                draft_facts(model_dir, config or EngineConfig(), profile, facts)
            except ColibriError:
                pass  # a geometry the cost model cannot read: the rule stays quiet
    return facts
