"""The new architectures' figures: latent KV bytes, the price of MXFP4 experts, streamed decode.

Three tables (run under `flock /tmp/colibri-bench.lock` on a shared box):

1. KV cache bytes per token (all layers, bf16) of MLA models: the engine's cache (latent +
   rope key per layer, + the indexer key on GLM-5's indexer layers), from the same function the
   memory plan uses, against a per-head K/V cache at the same geometry (N·(qk_nope+qk_rope) keys
   + N·v_head_dim values per layer). For the small presets it also checks the bytes the engine
   really allocates.
2. MXFP4 dequantization on read: ms per expert to turn blocks + scales into bf16 / fp32
   (median of --repeats, one thread), against the bf16 → fp32 cast a plain checkpoint needs, at
   the gpt-oss-small and the published gpt-oss-120b expert geometry; bytes on disk per expert.
3. Decode tok/s of gpt-oss-small with MXFP4 experts and with the same weights in bf16, each
   resident and streamed (cold, io direct, in a memory cgroup at --budget), so the cost of
   dequantizing shows next to what the 3.8x smaller reads save.

(The GLM-5-structured streaming figure comes from benchmarks/io/streaming_roofline.py --model glm-5-small.)

    .venv/bin/python benchmarks/formats/arch_figures.py [--budget 560MiB] [--tokens 16] [--repeats 3] [--scratch DIR]
        [--json] [--lock FILE]

--json prints one colibri.bench/1 document (benchkit.emit) whose rows are the same tables' rows,
keyed by each table's header and tagged with the table's name; --lock holds benchkit.bench_lock
around each timed table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.api import EngineConfig, format_size, git_commit, model_args, parse_size, synth  # noqa: E402
from engine.api.lab import mxfp4_dequantize, mxfp4_quantize  # noqa: E402
from tuner.search.trial import run_trial  # noqa: E402
from benchmarks.benchkit import Tables, add_output_flags, bench_lock, run_conditions  # noqa: E402

TOOL = "arch_figures"
MLA_PRESETS = ("deepseek-v3", "glm-5", "deepseek-v3-small", "glm-5-small")


def kv_table() -> list[str]:
    rows = ["| model | layers | latent cache B/token | per-head K/V B/token | ratio |", "|---|---|---|---|---|"]
    for name in MLA_PRESETS:
        g = synth.load_preset(name)
        cfg = synth.hf_config(synth.validate_geometry(g), 0, 0.0) if g.get("materializable") else g
        args = model_args(cfg)
        m = args.attention_impl
        latent = m.cache_nbytes(args.num_layers, 1, torch.bfloat16)
        per_head = args.num_layers * m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * 2
        rows.append(f"| {name} | {args.num_layers} | {latent:,} | {per_head:,} | {per_head / latent:.1f}x |")
    return rows


def allocated_kv(model_dir: Path, ctx: int) -> tuple[int, int]:
    from engine.api import Engine
    with Engine(model_dir, EngineConfig(ctx_size=ctx, threads=1)) as engine:
        kv = engine.kv
        tensors = kv.latent + kv.rope_key + list(kv.index_key.values())
        return sum(t.nbytes for t in tensors), engine.plan.kv_bytes


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and kernel loading
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def dequant_table(repeats: int) -> list[str]:
    torch.set_num_threads(1)
    try:  # the "before": transformers' CPU dequantization (two nibble gathers + ldexp), if installed
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        convert_moe_packed_tensors = None
    rows = ["| expert geometry (H x I) | MXFP4 bytes | bf16 bytes | dequant → bf16 ms | dequant → fp32 ms "
            "| transformers' dequant → bf16 ms | bf16 → fp32 cast ms |", "|---|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for label, H, I in (("gpt-oss-small 512 x 512", 512, 512), ("gpt-oss-120b 2880 x 2880", 2880, 2880)):
        gate_up = torch.randn(2 * I, H, generator=gen) * 0.02
        down = torch.randn(H, I, generator=gen) * 0.02
        packed = [mxfp4_quantize(gate_up), mxfp4_quantize(down)]
        mx_bytes = sum(b.nbytes + s.nbytes for b, s in packed) + (2 * I + H) * 2
        plain = [gate_up.bfloat16(), down.bfloat16()]
        bf16_bytes = sum(t.nbytes for t in plain) + (2 * I + H) * 2

        def dq(dtype):
            return lambda: [mxfp4_dequantize(b, s, dtype) for b, s in packed]
        hf = "-"
        if convert_moe_packed_tensors is not None:
            hf = f"{_median_ms(lambda: [convert_moe_packed_tensors(b[None], s[None]) for b, s in packed], repeats):.2f}"
        ms = [_median_ms(dq(torch.bfloat16), repeats), _median_ms(dq(torch.float32), repeats),
              _median_ms(lambda: [t.float() for t in plain], repeats)]
        rows.append(f"| {label} | {format_size(mx_bytes)} | {format_size(bf16_bytes)} | {ms[0]:.2f} | {ms[1]:.2f} "
                    f"| {hf} | {ms[2]:.2f} |")
    return rows


def placements(budget: int) -> tuple:
    """The two placements of the gpt-oss-small decode tables (here and benchmarks/quant/mxfp4_fused.py):
    resident, and streamed cold (io direct, prefetch 1) in a memory cgroup at `budget`; each
    (label, config, cgroup limit, cold)."""
    return (("resident", EngineConfig(ctx_size=512), None, False),
            (f"streamed {format_size(budget)} cold", EngineConfig(ctx_size=512, ram_budget=budget, io_mode="direct",
                                                                 prefetch_depth=1), budget, True))


def trial_cells(t) -> str:
    """A trial's decode tok/s (median, min-max) | MiB read/token | RAM hit | cgroup peak, or why it failed."""
    if not t.ok:
        return f"{t.status}: {t.error} | | |"
    m, s = t.metrics, t.metrics["summary"]["decode_tok_s"]
    hit = (m.get("hit_rate") or {}).get("ram")
    return (f"{m['decode_tok_s']:.2f} ({s['min']:.2f}-{s['max']:.2f}) | {m['bytes_read_per_token'] / 2**20:.2f} | "
            f"{'-' if hit is None else f'{hit:.0%}'} | "
            f"{format_size(t.cgroup_peak_bytes) if t.cgroup_peak_bytes else '-'}")


def decode_arguments(ap: argparse.ArgumentParser, scratch: str) -> None:
    """The options of a gpt-oss-small decode table (here and benchmarks/quant/mxfp4_fused.py)."""
    ap.add_argument("--budget", default="560MiB")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scratch", default=scratch)
    ap.add_argument("--skip-decode", action="store_true")


def decode_table(scratch: Path, budget: int, tokens: int, repeats: int) -> list[str]:
    rows = ["| gpt-oss-small experts | placement | decode tok/s (median, min-max) | MiB read/token | RAM hit "
            "| cgroup peak | I/O stall |", "|---|---|---|---|---|---|---|"]
    for fmt in ("mxfp4", "plain"):
        d = scratch / f"gpt-oss-small-{fmt}"
        if not (d / "config.json").exists():
            synth.synthesize({**synth.load_preset("gpt-oss-small"), "expert_format": fmt}, d, seed=0, progress=False)
        for label, cfg, limit, cold in placements(budget):
            t = run_trial(d, cfg, tokens=tokens, repeats=repeats, cold=cold, limit_bytes=limit, timeout=1800)
            stall = t.metrics.get("io_stall_fraction") if t.ok else None
            rows.append(f"| {fmt} | {label} | {trial_cells(t)} | {'-' if stall is None else f'{stall:.0%}'} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    decode_arguments(ap, "/tmp/colibri-archs-bench")
    ap.add_argument("--glm5", help="a synthesized glm-5-small directory (default: synthesize one in --scratch)")
    add_output_flags(ap)
    a = ap.parse_args()
    scratch = Path(a.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    out = Tables(a.json)
    out.line(f"# archs benchmark {time.strftime('%Y-%m-%d')} commit {git_commit()}")
    out.line("\n## KV cache per token (bf16)\n")
    out.table("kv_per_token", kv_table())
    small = Path(a.glm5) if a.glm5 else scratch / "glm-5-small"
    if not (small / "config.json").exists():
        synth.synthesize(synth.load_preset("glm-5-small"), small, seed=0, progress=False)
    allocated, planned = allocated_kv(small, 4096)
    out.note("glm5_small_kv_ctx4096", {"allocated_bytes": allocated, "planned_bytes": planned},
             f"\nglm-5-small at ctx 4096: allocated {allocated:,} B, planned {planned:,} B")
    out.line(f"\n## MXFP4 dequantization per expert (one thread, median of {a.repeats})\n")
    with bench_lock(a.lock):
        out.table("mxfp4_dequant", dequant_table(a.repeats))
    if not a.skip_decode:
        out.line(f"\n## gpt-oss-small decode, {a.tokens} tokens x {a.repeats} repeats\n")
        with bench_lock(a.lock):
            out.table("decode", decode_table(scratch, parse_size(a.budget), a.tokens, a.repeats))
    out.done(TOOL, run_conditions(a, model="gpt-oss-small, glm-5-small (synthesized)", threads_dequant=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
