"""A stored small tune run, built without running the engine: an Optuna study in study.db with
trials as `colibri tune` records them, result.json, trials.csv and profile.json.

The report, profile and compare tests read it through the same files a real run leaves, so
they test those readers, not a second copy of the tuner. Knobs (cold/warm, budget, speed,
the machine, the model's name) let two fixture runs differ in exactly one condition.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import optuna
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from engine.base.config import EngineConfig
from tuner.probe.hardware_profile import (
    SCHEMA_VERSION, CpuInfo, DiskInfo, HardwareProfile, CpuMatmulPoint, MemoryBandwidthPoint, MemoryInfo,
    ProbeRun, Quantity, StoragePoint, StorageResult, SystemInfo, ToolInfo, compute_fingerprint, save_profile,
)
from tuner.results.outputs import write_trials_csv

MiB, GiB = 1 << 20, 1 << 30
GEOMETRY = {"model_type": "qwen3_moe", "layers": 4, "hidden_size": 64, "experts": 8, "top_k": 2,
            "moe_intermediate_size": 32, "moe_layers": 4, "vocab_size": 300, "total_bytes_on_disk": 1147648,
            "expert_bytes_on_disk": 24576}
DISTRIBUTIONS = {
    "chunk_size": CategoricalDistribution([65536, 262144, 1048576, 4194304]),
    "prefetch_depth": IntDistribution(0, 4), "cpu_cache_ratio": FloatDistribution(0.25, 1.0, step=0.05),
    "threads": IntDistribution(1, 2), "ctx_size": CategoricalDistribution([256, 512, 1024]),
    "io_mode": CategoricalDistribution(["direct", "buffered", "mmap"]),
    "io_threads": CategoricalDistribution([1, 2, 4, 8, 16]), "cache_policy": CategoricalDistribution(["lru", "lfu"]),
}
# (params, decode tok/s, TTFT s): the baseline first, as tune enqueues it.
TRIALS = [
    ({"chunk_size": 1048576, "prefetch_depth": 2, "cpu_cache_ratio": 1.0, "threads": 2, "ctx_size": 256,
      "io_mode": "buffered", "io_threads": 4, "cache_policy": "lru"}, 300.0, 0.012),
    ({"chunk_size": 65536, "prefetch_depth": 0, "cpu_cache_ratio": 0.5, "threads": 1, "ctx_size": 512,
      "io_mode": "direct", "io_threads": 1, "cache_policy": "lfu"}, 150.0, 0.030),
    ({"chunk_size": 262144, "prefetch_depth": 1, "cpu_cache_ratio": 0.25, "threads": 1, "ctx_size": 256,
      "io_mode": "mmap", "io_threads": 16, "cache_policy": "lru"}, 450.0, 0.007),
    ({"chunk_size": 4194304, "prefetch_depth": 4, "cpu_cache_ratio": 0.75, "threads": 2, "ctx_size": 1024,
      "io_mode": "buffered", "io_threads": 8, "cache_policy": "lfu"}, 220.0, 0.020),
    ({"chunk_size": 262144, "prefetch_depth": 3, "cpu_cache_ratio": 0.4, "threads": 1, "ctx_size": 256,
      "io_mode": "direct", "io_threads": 16, "cache_policy": "lru"}, 380.0, 0.009),
    ({"chunk_size": 1048576, "prefetch_depth": 1, "cpu_cache_ratio": 0.6, "threads": 2, "ctx_size": 512,
      "io_mode": "mmap", "io_threads": 2, "cache_policy": "lru"}, 260.0, 0.015),
    ({"chunk_size": 65536, "prefetch_depth": 2, "cpu_cache_ratio": 0.9, "threads": 1, "ctx_size": 256,
      "io_mode": "buffered", "io_threads": 4, "cache_policy": "lfu"}, 330.0, 0.010),
]
RECOMMENDED = 2


def hardware_profile(cpu_model: str = "Fixture CPU 9000", seq_gbps: float = 1.8) -> HardwareProfile:
    """A plausible probe result (a 2-core virtio box) with a full disk curve."""
    def q(v, unit):
        return Quantity(float(v), unit)

    points = [StoragePoint("sequential", "read", MiB, 32, True, q(0.4, "s"), q(seq_gbps * 1e9, "B/s"),
                           q(seq_gbps * 1e9 / MiB, "IO/s"), q(1e4, "us"), q(9e3, "us"), q(3e4, "us"))]
    for qd, scale in ((1, 0.5), (16, 1.0)):
        for size, bw in ((64 << 10, 0.4), (256 << 10, 0.8), (MiB, 1.4), (4 * MiB, 1.7), (16 * MiB, 1.8)):
            bps = bw * scale * seq_gbps / 1.8 * 1e9
            points.append(StoragePoint("curve", "randread", size, qd, True, q(0.4, "s"), q(bps, "B/s"),
                                       q(bps / size, "IO/s"), q(500, "us"), q(400, "us"), q(2000, "us")))
    points.append(StoragePoint("latency_4k", "randread", 4096, 1, True, q(0.4, "s"), q(4.6e7, "B/s"),
                               q(11000, "IO/s"), q(80, "us"), q(60, "us"), q(600, "us")))
    points.append(StoragePoint("buffered", "randread", MiB, 4, False, q(0.4, "s"), q(0.8e9, "B/s"),
                               q(800, "IO/s"), q(4000, "us"), q(4000, "us"), q(14000, "us")))
    system = SystemInfo(
        os="Linux 6.1.0",
        cpu=CpuInfo(cpu_model, "x86_64", 2, 2, 1, ["avx", "avx2", "fma"]),
        memory=MemoryInfo(q(24 * GiB, "B"), q(22 * GiB, "B"), None, "v1"),
        disk=DiskInfo("vda", "virtio", True, None, "ext4", q(70 * GiB, "B"), q(250 * GiB, "B")))
    return HardwareProfile(
        schema_version=SCHEMA_VERSION, tool=ToolInfo("colibri-tune", "0.1.0"), created_utc="2026-12-01T07:00:00Z",
        fingerprint=compute_fingerprint(system, []), probe=ProbeRun("quick", "2026-12-01T06:59:48Z", q(12, "s")),
        system=system,
        storage=StorageResult("fio", "fio-3.33", "io_uring", points, q(256 * MiB, "B"), q(0.4, "s")),
        memory_bandwidth=[MemoryBandwidthPoint("read", 1, 3, q(128 * MiB, "B"), q(7.3e9, "B/s")),
                          MemoryBandwidthPoint("read", 2, 3, q(128 * MiB, "B"), q(11.2e9, "B/s"))],
        cpu_matmul=[CpuMatmulPoint("fp32", 1, 2048, 768, 1, 100, q(19.3, "GFLOP/s"), q(160, "us"))],
        gpus=[], best_configs=[])


def make_run(out: Path, *, cold: bool = True, budget: int = 512 * MiB,
             speed: float = 1.0, profile: HardwareProfile | None = None,
             model_name: str = "tiny", model_dir: str = "/work/models/tiny", tokens: int = 4) -> Path:
    """Write a finished run directory under `out` and return it."""
    out.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"{model_name}-{budget}-decode"
    study = optuna.create_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}", direction="maximize")
    for i, (params, decode, ttft) in enumerate(TRIALS):
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=DISTRIBUTIONS, value=decode * speed,
            user_attrs=_attrs(i, params, decode * speed, ttft, budget), system_attrs={}))
    # An OOM-killed trial: recorded, infeasible, no figures.
    oom = {**TRIALS[3][0], "cpu_cache_ratio": 1.0, "ctx_size": 1024}
    study.add_trial(optuna.trial.create_trial(
        params=oom, distributions=DISTRIBUTIONS, value=0.0,
        user_attrs={"role": "search", "status": "oom_killed", "constraint": 0.12, "error": "killed by the cgroup OOM killer",
                    "wall_seconds": 3.2}))
    write_trials_csv(study.get_trials(), out / "trials.csv")
    profile = profile or hardware_profile()
    save_profile(profile, out / "profile.json")
    rec_params, rec_decode, rec_ttft = TRIALS[RECOMMENDED]
    base_params, base_decode, base_ttft = TRIALS[0]
    rec = _entry(f"trial {RECOMMENDED}", RECOMMENDED, rec_params, budget, rec_decode * speed * 0.95, rec_ttft)
    base = _entry("baseline", 0, base_params, budget, base_decode * speed, base_ttft)
    result = {
        "schema": "colibri.tune/2", "created_utc": "2026-12-01T07:05:00Z", "started_utc": "2026-12-01T07:02:00Z",
        "model": {"name": model_name, "dir": model_dir, "geometry": GEOMETRY, "compute_dtype": "float32"},
        "budget_bytes": budget, "budget": f"{budget / MiB:.1f} MiB", "objective": "decode",
        "recommended": rec, "baseline": base, "gain_metric": "decode_tok_s",
        "gain_over_baseline": rec["confirmed"]["decode_tok_s"] / base["confirmed"]["decode_tok_s"] - 1,
        "candidates": [rec, base],
        "confirmation": {"rounds": 2, "confirmed": True, "order": "winner first, baseline last, interleaved per round",
                         "figure": "median over rounds of each run's median over repeats; spread over all repeats"},
        "study": {"name": name, "storage": f"sqlite:///{out / 'study.db'}", "trials": len(TRIALS) + 1,
                  "feasible": len(TRIALS), "by_status": {"ok": len(TRIALS), "oom_killed": 1}, "sampler": "GPSampler",
                  "sampler_note": "fixture", "directions": ["MAXIMIZE"]},
        "conditions": {
            "cold": cold, "cold_means": "pages dropped before every repeat" if cold else "warm: caches persist",
            "tokens": tokens, "repeats": 2, "prompt_tokens": 8, "seed": 0, "min_ctx": 256,
            "memory_limit": {"cgroup_limit_bytes": budget, "cgroup": True, "reason": ""},
            "precheck_overhead_bytes": 391 * MiB, "time_budget_s": 180.0, "wall_seconds": 178.2,
            "physical_cores": 2, "logical_cores": 2, "gpu": False,
            "profile": {"source": str(out / "profile.json"), "fingerprint": profile.fingerprint,
                        "probe_mode": profile.probe.mode, "storage_method": profile.storage.method,
                        "disk_transport": profile.system.disk.transport, "disk_model": profile.system.disk.model,
                        "filesystem": profile.system.disk.filesystem, "read_gbps_1MiB_qd4_direct": 1.05,
                        "sequential_gbps": 1.8},
            "search_space": {k: str(v) for k, v in DISTRIBUTIONS.items()},
            "versions": {"engine": "0.1.0", "git_commit": "32851d055f65", "optuna": optuna.__version__,
                         "python": "3.11.7"}},
        "quant": "fp32", "quality": None,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return out


def _attrs(i: int, params: dict, decode: float, ttft: float, budget: int) -> dict:
    plan = {"budget": budget, "streaming": True, "dense_bytes": 361216, "kv_bytes": params["ctx_size"] * 1024,
            "buffer_bytes": 2 * (1 + params["prefetch_depth"]) * 32768, "overhead_bytes": 391 * MiB,
            "cache_bytes": int(params["cpu_cache_ratio"] * 786432), "gpu_cache_bytes": 0, "expert_bytes": 24576,
            "expert_disk_bytes": 24576, "routed_experts": 32, "max_inflight_experts": 4}
    read = 40000.0 * (1.2 - params["cpu_cache_ratio"])
    return {"role": "baseline" if i == 0 else "search", "status": "ok", "constraint": 0.0, "decode_tok_s": decode,
            "ttft_s": ttft, "bytes_read_per_token": read, "hit_rate_ram": 0.5 + 0.4 * params["cpu_cache_ratio"],
            "read_gbps": 0.02, "io_stall_fraction": 0.1, "cgroup_peak_bytes": 150 * MiB, "wall_seconds": 2.5,
            "metrics": {"schema": "colibri.metrics/1", "plan": plan}}


def _entry(label: str, number: int, params: dict, budget: int, decode: float, ttft: float) -> dict:
    config = dataclasses.replace(EngineConfig(), ram_budget=budget, **params,
                                 routing_histogram="/work/scratch/run/routing.json").to_dict()
    return {"label": label, "trial_number": number, "role": "search", "config": config,
            "confirmed": {"decode_tok_s": decode, "ttft_s": ttft, "measurements": 2, "decode_min": decode * 0.9,
                          "decode_max": decode * 1.1, "decode_stdev": decode * 0.05, "ttft_min": ttft * 0.9,
                          "ttft_max": ttft * 1.1, "samples": 4, "unconfirmed": False},
            "search_values": [decode], "runs": [], "disqualified": None, "note": None}
