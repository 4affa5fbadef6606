"""What the cost model reads from a HardwareProfile, and `--what-if` edits of it.

Every speed figure here is a measurement from the profile, interpolated between measured
points: random-read bandwidth at a request size and queue depth (the fio curve), memory read
bandwidth per thread count, matmul throughput per dtype, rows (m) and thread count, and the
expert kernels' throughput per weight format (bf16 F.linear, int8 and int4 packed kernels) per
projection shape, rows and thread count. Nothing is a spec-sheet constant. Outside the measured thread counts, matmul throughput grows with threads
at the per-thread rate of the largest measured count, and memory bandwidth stays at its largest
measured figure (it saturates; a what-if names a new one when a machine has more channels).

A what-if edits a copy of the profile's measured figures and nothing else:
  disk_bw=7GB/s     scale every storage point so the best random-read bandwidth is 7 GB/s
  disk_scale=2      scale every storage point's bandwidth and IOPS by 2
  memory_bw=100GB/s set every memory-bandwidth point to 100 GB/s (copy points to twice that)
  ram=64GiB         total and available memory
  cores=16          physical and logical cores (compute extrapolates from the measured threads)
  matmul_scale=2    scale every matmul and expert-kernel throughput by 2
"""

from __future__ import annotations

import copy
import math

from engine.api import ConfigError, parse_size
from tuner.probe.hardware_profile import Quantity, interp_log2

WHAT_IF_KEYS = ("disk_bw", "disk_scale", "memory_bw", "ram", "cores", "matmul_scale")


def _rate(text: str) -> float:
    """'7GB/s', '7e9', '3.5 GB/s' → bytes/s (decimal units, as disk vendors and the probe print)."""
    s = str(text).strip().lower().replace(" ", "")
    s = s[:-2] if s.endswith("/s") else s
    for unit, mult in (("tb", 1e12), ("gb", 1e9), ("mb", 1e6), ("kb", 1e3), ("b", 1.0)):
        if s.endswith(unit):
            return float(s[: -len(unit)]) * mult
    return float(s)


def _positive(x: float, hi: float | None = None) -> float:
    """A what-if figure must be a finite positive number: float() takes 'inf' and 'nan', and
    `not nan > 0` would have been the only guard (disk_scale=inf predicted 0 s reads)."""
    if not math.isfinite(x) or x <= 0:
        raise ValueError("must be a finite positive number")
    if hi is not None and x > hi:
        raise ValueError(f"must be at most {hi:g}")
    return x


def apply_what_if(profile, edits: list[str]):
    """A copy of `profile` with the named measured figures edited (see the module docstring)."""
    p = copy.deepcopy(profile)
    for edit in edits:
        key, sep, value = edit.partition("=")
        key = key.strip()
        if not sep or key not in WHAT_IF_KEYS:
            raise ConfigError(f"--what-if {edit!r}: expected KEY=VALUE with KEY one of {', '.join(WHAT_IF_KEYS)}")
        try:
            _apply_one(p, key, value.strip())
        except (ValueError, ConfigError) as exc:
            raise ConfigError(f"--what-if {edit!r}: bad value ({exc})") from None
    return p


def _apply_one(p, key: str, value: str) -> None:
    """Edit `p` in place (its point records are frozen: they are replaced, not mutated)."""
    from dataclasses import replace

    def scaled(q, factor):
        return Quantity(q.value * factor, q.unit)

    if key in ("disk_bw", "disk_scale"):
        if key == "disk_bw":
            best = max(pt.bandwidth.value for pt in p.storage.points if pt.role == "curve")
            factor = _positive(_rate(value)) / best
        else:
            factor = _positive(float(value), hi=1e6)
        _positive(factor)
        p.storage.points = [replace(pt, bandwidth=scaled(pt.bandwidth, factor), iops=scaled(pt.iops, factor))
                            for pt in p.storage.points]
    elif key == "memory_bw":
        bw = _positive(_rate(value))
        p.memory_bandwidth = [replace(pt, bandwidth=Quantity(bw * (2 if pt.op == "copy" else 1), "B/s"))
                              for pt in p.memory_bandwidth]
    elif key == "ram":
        n = _positive(float(parse_size(value)))
        p.system.memory.total = Quantity(n, "B")
        p.system.memory.available = Quantity(n, "B")
    elif key == "cores":
        n = int(value)
        if not 1 <= n <= 65536:
            raise ValueError("must be in [1, 65536]")
        smt = max(1, p.system.cpu.logical_cores // max(p.system.cpu.physical_cores, 1))
        p.system.cpu.physical_cores = n
        p.system.cpu.logical_cores = n * smt
    elif key == "matmul_scale":
        f = _positive(float(value), hi=1e6)
        p.cpu_matmul = [replace(pt, throughput=scaled(pt.throughput, f)) for pt in p.cpu_matmul]
        p.expert_kernels = [replace(pt, throughput=scaled(pt.throughput, f)) for pt in p.expert_kernels]


class HardwareView:
    """Interpolated measured figures of one profile."""

    def __init__(self, profile):
        self.profile = profile
        self.physical_cores = profile.system.cpu.physical_cores
        self.ram_bytes = profile.system.memory.available.value
        self._mem = sorted((pt.threads, pt.bandwidth.value) for pt in profile.memory_bandwidth if pt.op == "read")
        self._matmul: dict[str, dict[int, list[tuple[int, float]]]] = {}
        for pt in profile.cpu_matmul:
            self._matmul.setdefault(pt.dtype, {}).setdefault(pt.m, []).append((pt.threads, pt.throughput.value * 1e9))
        if not self._mem or not self._matmul:
            raise ConfigError("profile has no memory-bandwidth or matmul measurements; run `colibri probe` again")
        # quant -> (k, n) -> m -> [(threads, FLOP/s)], and quant -> (k, n) -> prepare seconds
        self._kernels: dict[str, dict[tuple[int, int], dict[int, list[tuple[int, float]]]]] = {}
        self._prepare: dict[str, dict[tuple[int, int], float]] = {}
        for pt in getattr(profile, "expert_kernels", None) or []:
            shape = (pt.k, pt.n)
            self._kernels.setdefault(pt.quant, {}).setdefault(shape, {}).setdefault(pt.m, []).append(
                (pt.threads, pt.throughput.value * 1e9))
            prep = self._prepare.setdefault(pt.quant, {})
            prep[shape] = max(prep.get(shape, 0.0), pt.prepare_time.value * 1e-6)

    def read_bandwidth(self, request_bytes: int, queue_depth: int, io_mode: str) -> float:
        """bytes/s; mmap is paged through the page cache, so it reads the buffered figure."""
        return self.profile.read_bandwidth(max(int(request_bytes), 4096), max(int(queue_depth), 1),
                                           direct=io_mode == "direct")

    def memory_bandwidth(self, threads: int) -> float:
        return _by_threads(self._mem, threads, grows=False)

    def copy_bandwidth(self) -> float:
        """Bytes/s one thread copies (the probe's copy figure counts read + write, as STREAM
        does, so a copy of N bytes moves 2N). What a buffered read's kernel copy costs."""
        copy = sorted((pt.threads, pt.bandwidth.value) for pt in self.profile.memory_bandwidth if pt.op == "copy")
        return copy[0][1] / 2 if copy else self._mem[0][1] / 2

    def matmul_flops(self, dtype: str, m: int, threads: int) -> float:
        """FLOP/s of F.linear at `m` rows; between measured m, linear in log2(m)."""
        table = self._matmul.get(dtype) or next(iter(self._matmul.values()))
        ms = sorted(table)
        return interp_log2([(mm, _by_threads(sorted(table[mm]), threads, grows=True)) for mm in ms], m)

    def has_kernels(self, quant: str) -> bool:
        return quant in self._kernels

    def kernel_flops(self, quant: str, m: int, threads: int, k: int, n: int) -> float:
        """FLOP/s of one [n, k] projection at `m` rows through the kernel the engine runs for the
        weight format `quant`, from the probe's expert-kernel points: linear in log2(k·n)
        between measured shapes (held at the ends), in log2(m) between measured rows; beyond the
        largest measured m the rate grows as the bf16 F.linear's does between those rows.
        A format the profile did not time (a profile probed before the kernels were, or fp32)
        is charged at the F.linear rate of its compute dtype."""
        table = self._kernels.get(quant)
        if not table:
            return self.matmul_flops("fp32" if quant == "fp32" else "bf16", m, threads)
        top_m = min(max(ms) for ms in table.values())
        at = min(m, top_m)
        by_shape = sorted((kk * nn, interp_log2(
            [(mm, _by_threads(sorted(pts), threads, grows=True)) for mm, pts in sorted(rows.items())], at))
            for (kk, nn), rows in table.items())
        rate = interp_log2(by_shape, k * n)
        if m > top_m:
            rate *= self.matmul_flops("bf16", m, threads) / self.matmul_flops("bf16", top_m, threads)
        return rate

    def prepare_seconds(self, quant: str, k: int, n: int) -> float:
        """Seconds to turn one stored [n, k] matrix into its kernel's operand (per expert read)."""
        table = self._prepare.get(quant)
        if not table:
            return 0.0
        return interp_log2(sorted((kk * nn, s) for (kk, nn), s in table.items()), k * n)


def _by_threads(points: list[tuple[int, float]], threads: int, grows: bool) -> float:
    """The best measured figure at <= threads; beyond the largest measured count, grow at its
    per-thread rate (compute) or hold it (memory bandwidth saturates)."""
    threads = max(int(threads), 1)
    best_within = max((v for t, v in points if t <= threads), default=points[0][1])
    top_t, top_v = max(points, key=lambda tv: tv[0])
    if threads > top_t and grows:
        return max(best_within, top_v * threads / top_t)
    return best_within
