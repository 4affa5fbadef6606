"""What the machine is: CPU, NUMA, RAM and cgroup limit, the disk under a directory, GPUs.

Identity only, never personal: no hostname, user, serial numbers or paths are recorded.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import time
from pathlib import Path
from typing import Optional

import psutil

from tuner.probe.hardware_profile import CpuInfo, DiskInfo, GpuInfo, MemoryInfo, Quantity, SystemInfo
from tuner.sandbox import current_memory_limit

# Flags that decide which matmul kernels a CPU can run (x86 names, then Arm names).
INTERESTING_CPU_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
    "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm",
)


def collect_system(directory: Path) -> SystemInfo:
    return SystemInfo(
        os=f"{platform.system()} {platform.release()}",
        cpu=cpu_info(),
        memory=memory_info(),
        disk=disk_info(directory),
    )


# --- CPU ------------------------------------------------------------------------------------

def cpu_info(cpuinfo_path: str = "/proc/cpuinfo") -> CpuInfo:
    model, flags = _parse_cpuinfo(cpuinfo_path)
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) or logical
    return CpuInfo(
        model=model or platform.processor() or platform.machine(),
        arch=platform.machine(),
        physical_cores=physical,
        logical_cores=logical,
        numa_nodes=numa_nodes(),
        flags=[f for f in INTERESTING_CPU_FLAGS if f in flags],
    )


def _parse_cpuinfo(path: str) -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, flags


def numa_nodes(root: str = "/sys/devices/system/node") -> int:
    try:
        nodes = [p for p in Path(root).iterdir()
                 if p.name.startswith("node") and p.name[4:].isdigit()]
    except OSError:
        return 1
    return max(1, len(nodes))


def thread_counts(physical_cores: int) -> list[int]:
    """1, 2, 4, ... up to the physical cores, and the physical count itself."""
    counts, n = [], 1
    while n < physical_cores:
        counts.append(n)
        n *= 2
    counts.append(physical_cores)
    return counts


# --- memory ---------------------------------------------------------------------------------

def memory_info() -> MemoryInfo:
    vm = psutil.virtual_memory()
    limit = current_memory_limit()
    return MemoryInfo(
        total=Quantity(float(vm.total), "B"),
        available=Quantity(float(vm.available), "B"),
        cgroup_limit=Quantity(float(limit), "B") if limit is not None else None,
        cgroup_version=cgroup_version(),
    )


def cgroup_version(proc_cgroup: str = "/proc/self/cgroup") -> Optional[str]:
    """'v1' when a v1 hierarchy holds the memory controller, 'v2' for the unified one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    controllers = [line.split(":", 2)[1] for line in lines if line.count(":") >= 2]
    if any("memory" in c.split(",") for c in controllers):
        return "v1"
    if "" in controllers:
        return "v2"
    return None


# --- disk -----------------------------------------------------------------------------------

def disk_info(directory: Path) -> DiskInfo:
    usage = shutil.disk_usage(directory)
    device = _block_device(directory)
    transport, rotational, model = _device_facts(device)
    return DiskInfo(
        device=device, transport=transport, rotational=rotational, model=model,
        filesystem=_filesystem(directory),
        free=Quantity(float(usage.free), "B"),
        total=Quantity(float(usage.total), "B"),
    )


def _block_device(directory: Path) -> Optional[str]:
    """The whole disk (not the partition) holding `directory`, e.g. 'nvme0n1'; None for
    filesystems without one (overlay, tmpfs, network)."""
    st = os.stat(directory)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        real = sys_dev.resolve(strict=True)
    except OSError:
        return None
    if (real / "partition").exists():
        real = real.parent
    return real.name


def _device_facts(device: Optional[str]) -> tuple[str, Optional[bool], Optional[str]]:
    if device is None:
        return "none", None, None
    block = Path("/sys/block") / device
    slaves = sorted((block / "slaves").glob("*")) if (block / "slaves").is_dir() else []
    if slaves and device.startswith(("dm-", "md")):
        # Device-mapper (LVM, LUKS) and md RAID: describe the first disk underneath.
        transport, rotational, model = _device_facts(_whole_disk(slaves[0].name))
        kind = "dm" if device.startswith("dm-") else "md"
        return f"{kind}:{transport}", rotational, model
    rotational = _read_sys(block / "queue" / "rotational")
    model = _read_sys(block / "device" / "model")
    return (_transport(device, block),
            None if rotational is None else rotational == "1",
            model or None)


def _whole_disk(name: str) -> str:
    real = (Path("/sys/class/block") / name).resolve()
    return real.parent.name if (real / "partition").exists() else name


def _transport(device: str, block: Path) -> str:
    if device.startswith("nvme"):
        return "nvme"
    for prefix, kind in (("loop", "loop"), ("zram", "zram"), ("ram", "ram"), ("md", "md"),
                         ("dm-", "dm"), ("mmcblk", "mmc"), ("vd", "virtio"), ("xvd", "xen")):
        if device.startswith(prefix):
            return kind
    try:
        sys_path = str((block / "device").resolve(strict=True))
    except OSError:
        return "unknown"
    for marker, kind in (("/usb", "usb"), ("/ata", "sata"), ("virtio", "virtio"),
                         ("/nvme", "nvme"), ("/host", "scsi")):
        if marker in sys_path:
            return kind
    return "unknown"


def _filesystem(directory: Path) -> Optional[str]:
    """fstype of the longest mount point containing `directory`."""
    target = str(Path(directory).resolve())
    best, fstype = "", None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        inside = target == mp or target.startswith(mp.rstrip("/") + "/")
        if inside and len(mp) >= len(best):
            best, fstype = mp, part.fstype
    return fstype


def _read_sys(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# --- GPU ------------------------------------------------------------------------------------

def gpu_info(measure_h2d: bool = True, h2d_bytes: int = 256 << 20) -> list[GpuInfo]:
    """CUDA devices with VRAM and pinned host-to-device copy bandwidth; [] without CUDA."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        h2d = _h2d_bandwidth(torch, index, h2d_bytes) if measure_h2d else None
        gpus.append(GpuInfo(
            index=index, name=props.name,
            vram=Quantity(float(props.total_memory), "B"),
            h2d_bandwidth=Quantity(h2d, "B/s") if h2d is not None else None))
    return gpus


def _h2d_bandwidth(torch, index: int, nbytes: int, repeats: int = 5) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{index}")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize(index)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(index)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)
