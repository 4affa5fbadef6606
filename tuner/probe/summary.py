"""The profile as a table a person can read. Units: GB/s = 1e9 B/s, GiB/MiB binary."""

from __future__ import annotations

from tuner.probe.hardware_profile import KERNEL_QUANTS, HardwareProfile, Quantity
from engine.api import format_size, size_label
from tuner.probe.probe_errors import ProfileError
from tuner.base.text import text_table

GiB = 1 << 30


def _gbs(q: Quantity) -> str:
    return f"{q.value / 1e9:.2f}"


def _gib(q: Quantity) -> str:
    return f"{q.value / GiB:.1f} GiB"


def format_summary(profile: HardwareProfile) -> str:
    p, s = profile, profile.system
    lines = [f"Hardware profile {p.fingerprint}  ({p.probe.mode} probe, "
             f"{p.probe.duration.value:.1f} s, {p.created_utc})", ""]
    cpu = s.cpu
    lines.append(f"CPU      {cpu.model} ({cpu.arch}), {cpu.physical_cores} physical / "
                 f"{cpu.logical_cores} logical cores, {cpu.numa_nodes} NUMA node"
                 f"{'s' if cpu.numa_nodes > 1 else ''}")
    lines.append(f"         flags: {' '.join(cpu.flags) or '(none of interest)'}")
    mem = s.memory
    limit = (f"{_gib(mem.cgroup_limit)} (cgroup {mem.cgroup_version})" if mem.cgroup_limit
             else "none")
    lines.append(f"Memory   {_gib(mem.total)} total, {_gib(mem.available)} available, "
                 f"cgroup limit: {limit}")
    d = s.disk
    rot = {True: "rotational", False: "non-rotational", None: "rotational: unknown"}[d.rotational]
    lines.append(f"Disk     {d.device or '(no block device)'}: {d.transport}, {rot}, model "
                 f"{d.model or 'unknown'}, {d.filesystem or '?'}, {_gib(d.free)} free of "
                 f"{_gib(d.total)}")
    if p.gpus:
        for g in p.gpus:
            h2d = f", host-to-device {_gbs(g.h2d_bandwidth)} GB/s" if g.h2d_bandwidth else ""
            lines.append(f"GPU {g.index}    {g.name}, {_gib(g.vram)}{h2d}")
    else:
        lines.append("GPU      none (no CUDA)")
    lines += [""] + _storage_lines(p) + [""] + _memory_lines(p) + [""] + _matmul_lines(p) + _kernel_lines(p)
    return "\n".join(lines)


def _storage_lines(p: HardwareProfile) -> list[str]:
    st = p.storage
    label = "fio" if st.method == "fio" else "FALLBACK (no fio)"
    out = [f"Storage  {label}: {st.tool}, engine {st.ioengine}, test file "
           f"{size_label(int(st.test_file.value))}, {st.runtime_per_job.value:g} s per job"]
    curve = [pt for pt in st.points if pt.role == "curve" and pt.direct]
    if curve:
        sizes = sorted({pt.request_bytes for pt in curve})
        qds = sorted({pt.queue_depth for pt in curve})
        cell = {(pt.request_bytes, pt.queue_depth): pt for pt in curve}
        rows = [[size_label(size)] + [_gbs(cell[(size, q)].bandwidth) if (size, q) in cell
                                       else "-" for q in qds] for size in sizes]
        out.append("  Random read, direct (GB/s)")
        out += text_table(["request"] + [f"QD {q}" for q in qds], rows)
    rows = []
    for pt in st.points:
        if pt.role == "curve":
            continue
        what = {"sequential": "sequential read", "latency_4k": "4 KiB latency",
                "iops_4k": "4 KiB IOPS", "buffered": "buffered read"}[pt.role]
        rows.append([what, f"{pt.pattern} {size_label(pt.request_bytes)} QD{pt.queue_depth}"
                     f"{'' if pt.direct else ' (cache dropped)'}",
                     _gbs(pt.bandwidth), f"{pt.iops.value:,.0f}", f"{pt.lat_p50.value:,.0f}",
                     f"{pt.lat_p99.value:,.0f}"])
    if rows:
        out.append("")
        out += text_table(["job", "parameters", "GB/s", "IOPS", "p50 µs", "p99 µs"], rows, left=2)
    return out


def _memory_lines(p: HardwareProfile) -> list[str]:
    if not p.memory_bandwidth:
        return []
    buf = p.memory_bandwidth[0].buffer
    cell = {(m.threads, m.op): m for m in p.memory_bandwidth}
    threads = sorted({m.threads for m in p.memory_bandwidth})
    rows = [[str(t)] + [_gbs(cell[(t, op)].bandwidth) if (t, op) in cell else "-"
                        for op in ("read", "copy")] for t in threads]
    return [f"Memory bandwidth (GB/s; {size_label(int(buf.value))} buffer; copy counts "
            f"read + write)"] + text_table(["threads", "read", "copy"], rows)


def _matmul_lines(p: HardwareProfile) -> list[str]:
    if not p.cpu_matmul:
        return []
    first = p.cpu_matmul[0]
    ms = sorted({m.m for m in p.cpu_matmul})
    keys = sorted({(m.threads, m.dtype) for m in p.cpu_matmul})
    cell = {(m.threads, m.dtype, m.m): m for m in p.cpu_matmul}
    rows = [[str(t), dt] + [f"{cell[(t, dt, m)].throughput.value:.1f}" if (t, dt, m) in cell
                            else "-" for m in ms] for t, dt in keys]
    return [f"CPU matmul (GFLOP/s; x[m,{first.k}] times W[{first.n},{first.k}]^T)"] + \
        text_table(["threads", "dtype"] + [f"m={m}" for m in ms], rows)


def _kernel_lines(p: HardwareProfile) -> list[str]:
    if not p.expert_kernels:
        return []
    cols = sorted({(pt.k, pt.n, pt.m) for pt in p.expert_kernels})
    keys = sorted({(pt.threads, pt.quant, pt.kernel) for pt in p.expert_kernels},
                  key=lambda t: (t[0], KERNEL_QUANTS.index(t[1])))
    cell = {(pt.threads, pt.quant, pt.kernel, pt.k, pt.n, pt.m): pt for pt in p.expert_kernels}
    rows = []
    for t, quant, kernel in keys:
        prep = max((pt.prepare_time.value for pt in p.expert_kernels
                    if (pt.threads, pt.quant, pt.kernel) == (t, quant, kernel)), default=0.0)
        rows.append([str(t), quant, kernel] + [
            f"{cell[(t, quant, kernel, k, n, m)].throughput.value:.1f}" if (t, quant, kernel, k, n, m) in cell
            else "-" for k, n, m in cols] + [f"{prep:,.0f}"])
    return ["", "Expert kernels (GFLOP/s; x[m,k] times W[n,k]^T through the engine's kernel per weight format)"] + \
        text_table(["threads", "weights", "kernel"] + [f"{k}x{n} m={m}" for k, n, m in cols] + ["prepare µs"], rows)


def hardware_facts(data: dict) -> dict:
    """The figures people compare machines by, as label → printable value."""
    p = HardwareProfile.from_dict({k: v for k, v in data.items() if k != "identity"})
    s = p.system
    seq, lat = p.storage_point("sequential"), p.storage_point("latency_4k")
    try:
        mib_qd4 = f"{p.read_bandwidth(1 << 20, 4) / 1e9:.2f} GB/s"
    except ProfileError:
        mib_qd4 = "-"
    iops = p.storage_point("iops_4k")
    mem = max((m.bandwidth.value for m in p.memory_bandwidth if m.op == "read"), default=None)
    gemv = max((m.throughput.value for m in p.cpu_matmul if m.m == 1), default=None)
    return {
        "fingerprint": p.fingerprint, "cpu": f"{s.cpu.model} ({s.cpu.arch})",
        "cores": f"{s.cpu.physical_cores} physical / {s.cpu.logical_cores} logical, {s.cpu.numa_nodes} NUMA node(s)",
        "cpu flags": " ".join(s.cpu.flags), "RAM": format_size(s.memory.total.value)
        + (f", cgroup limit {format_size(s.memory.cgroup_limit.value)}" if s.memory.cgroup_limit else ""),
        "disk": f"{s.disk.transport} {s.disk.model or ''} ({s.disk.filesystem}, rotational {s.disk.rotational})"
        .replace("  ", " "),
        "storage method": f"{p.storage.method} ({p.storage.tool}, {p.storage.ioengine}), {p.probe.mode} probe",
        "sequential read": f"{seq.bandwidth.value / 1e9:.2f} GB/s" if seq else "-",
        "1 MiB QD4 random read": mib_qd4,
        "4 KiB QD1 latency p50": f"{lat.lat_p50.value:.0f} us" if lat else "-",
        "4 KiB QD32 random read": f"{iops.iops.value:.0f} IO/s" if iops else "-",
        "memory read bandwidth": f"{mem / 1e9:.2f} GB/s" if mem else "-",
        "matmul (expert GEMV, best)": f"{gemv:.2f} GFLOP/s" if gemv else "-",
        "GPUs": ", ".join(f"{g.name} {format_size(g.vram.value)}" for g in p.gpus) or "none",
        "tool": p.tool.version,
    }
