"""The cost model: plan arithmetic, monotonicity, calibration, what-if, pre-filter."""

import copy
import dataclasses
import math

import pytest

from engine import synth
from engine.base.config import EngineConfig
from engine.base.errors import BudgetError
from tests.test_probe_profile import make_profile
from tuner.costmodel import fit as cal
from tuner.costmodel.model_geometry import bytes_per_weight, from_model_dir, resolve
from tuner.costmodel.hardware import HardwareView, apply_what_if
from tuner.costmodel.memplan import fits, plan_memory
from tuner.costmodel.predict import Factors, RunConditions, combine, components, predict, predict_prefill
from tuner.costmodel.routing_model import synth_skew, uniform
from tuner.costmodel.best_config import curve_region, prefilter

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("costmodel") / "tiny"
    synth.synthesize(synth.load_preset("tiny"), d, seed=0, progress=False)
    return d


@pytest.fixture()
def hw():
    return HardwareView(make_profile())


# --- plan arithmetic ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["glm-5", "deepseek-v3", "qwen3-235b-a22b", "mixtral-8x22b", "olmoe-1b-7b"])
def test_spec_parameter_counts_match_the_published_totals(name):
    g = resolve(name)
    assert g.total_params == pytest.approx(g.published_total_params, rel=0.01)
    assert g.active_params == pytest.approx(g.published_active_params, rel=0.1)


def test_glm5_sizes_at_int4_and_mla_kv():
    g = resolve("glm-5")
    # 75 MoE layers x 256 experts; one expert = 3 x 6144 x 2048 weights at 4.5 bits + group scales.
    assert g.routed_experts == 75 * 256
    assert g.expert_bytes("int4") == 3 * 6144 * 2048 * (0.5 + 4 / 64)
    assert bytes_per_weight("int8", 2048) == 1 + 2 / 2048
    plan = plan_memory(g, "int4", EngineConfig(ram_budget=64 * GiB, ctx_size=8192, prefetch_depth=1), 300 * MiB)
    # KV: latent 512 + rope key 64 + indexer key 128 per position per layer, bf16.
    assert plan.kv_bytes == 78 * (512 + 64 + 128) * 8192 * 2
    assert plan.dense_bytes == pytest.approx(g.dense_bytes("int4"), abs=4096)
    left = 64 * GiB - plan.dense_bytes - plan.kv_bytes - plan.buffer_bytes - 300 * MiB - plan.prefill_bytes
    entry = plan.cache_entry_bytes  # the cache is whole slots (engine/movement/slots.py)
    assert plan.cache_bytes == int(left) // entry * entry


def test_stand_in_plan_equals_the_engines_plan_on_a_real_checkpoint(tiny):
    g = from_model_dir(tiny)
    cfg = EngineConfig(ram_budget=400 * MiB, ctx_size=256, prefetch_depth=2, cpu_cache_ratio=0.7)
    native = plan_memory(g, "bf16", cfg, 200 * MiB)
    spec = plan_memory(dataclasses.replace(g, model_dir=None), "bf16", cfg, 200 * MiB)
    for key in ("dense_bytes", "kv_bytes", "cache_bytes", "routed_experts", "max_inflight_experts"):
        assert getattr(spec, key) == pytest.approx(getattr(native, key), rel=1e-6), key
    assert spec.buffer_bytes == pytest.approx(native.buffer_bytes, rel=0.01)


def test_a_budget_too_small_is_refused_like_the_engine_does(tiny):
    g = from_model_dir(tiny)
    with pytest.raises(BudgetError):
        plan_memory(g, "bf16", EngineConfig(ram_budget=100 * MiB), 200 * MiB)
    assert predict(g, "bf16", EngineConfig(ram_budget=100 * MiB), HardwareView(make_profile()),
                   uniform(g.moe_layers, g.num_experts), overhead_bytes=200 * MiB).fits is False


# --- monotonicity ------------------------------------------------------------------------------

def _decode(g, cfg, profile, factors=None, quant="int4"):
    p = predict(g, quant, cfg, HardwareView(profile), synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0),
                factors or Factors(eta_io=0.7, c_request=1e-4, c_layer=1e-3, overlap=0.5), RunConditions(),
                overhead_bytes=300 * MiB)
    assert p.fits
    return p.decode_tok_s


@pytest.mark.parametrize("edit", ["disk_scale=2", "memory_bw=50GB/s", "matmul_scale=3", "cores=32"])
def test_faster_hardware_never_predicts_slower(edit):
    g = resolve("olmoe-1b-7b")
    cfg = EngineConfig(ram_budget=int(1.5 * GiB), prefetch_depth=1, threads=0)
    base = make_profile()
    assert _decode(g, cfg, apply_what_if(base, [edit])) >= _decode(g, cfg, base)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_more_memory_or_cache_never_predicts_slower(policy):
    g = resolve("olmoe-1b-7b")
    profile = make_profile()
    speeds = [_decode(g, EngineConfig(ram_budget=int(b * GiB), cpu_cache_ratio=r, prefetch_depth=0,
                                      cache_policy=policy), profile)
              for b, r in ((1.0, 0.5), (1.0, 1.0), (1.5, 1.0), (3.0, 1.0))]
    assert speeds == sorted(speeds)
    assert speeds[-1] > speeds[0]


# --- calibration -------------------------------------------------------------------------------

def test_calibration_recovers_known_factors_from_synthetic_trials(tiny, hw):
    g = from_model_dir(tiny)
    routing = synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0)
    truth = Factors(eta_io=0.45, eta_compute=0.6, overlap=0.3, c_request=2e-4, c_layer=3e-3, c_page_buffered=1e-9,
                    c_page_mmap=3e-9, lookahead_recall=0.8)
    trials = []
    for i, (chunk, depth, ratio, mode, qd, threads) in enumerate([
            (64 << 10, 0, 0.3, "direct", 1, 1), (1 << 20, 1, 0.6, "direct", 4, 2), (256 << 10, 2, 1.0, "buffered", 8, 4),
            (4 << 20, 0, 0.5, "mmap", 2, 8), (16 << 20, 3, 0.8, "direct", 16, 1), (128 << 10, 1, 0.4, "buffered", 1, 2),
            (2 << 20, 0, 1.0, "direct", 2, 4), (512 << 10, 2, 0.7, "mmap", 4, 8), (1 << 20, 0, 0.9, "buffered", 4, 2),
            (8 << 20, 1, 0.5, "mmap", 16, 1)]):
        cfg = EngineConfig(ram_budget=340 * MiB, chunk_size=chunk, prefetch_depth=depth, cpu_cache_ratio=ratio,
                           io_mode=mode, io_threads=qd, threads=threads, ctx_size=256)
        trials.append(cal.Trial(i, cfg, 1.0, 1.0))
    study = cal.Study(trials, RunConditions(), 250 * MiB, 340 * MiB)
    ready = cal.prepare(study, g, "bf16", hw, routing, truth.lookahead_recall)
    assert len(ready) == len(trials)
    for t in ready:  # "measure" with the true factors
        out = combine(t.comps, truth)
        t.decode_tok_s, t.ttft_s = 1 / out["token_s"], out["ttft_s"]
    got = cal.fit(ready, truth.lookahead_recall)
    for t in ready:
        assert 1 / combine(t.comps, got)["token_s"] == pytest.approx(t.decode_tok_s, rel=0.01)
    assert got.eta_io == pytest.approx(truth.eta_io, rel=0.05)
    assert got.c_request == pytest.approx(truth.c_request, rel=0.1)
    assert got.c_layer == pytest.approx(truth.c_layer, rel=0.1)
    assert got.c_page_buffered == pytest.approx(truth.c_page_buffered, rel=0.1)
    assert got.c_page_mmap == pytest.approx(truth.c_page_mmap, rel=0.1)
    # Direct reads bypass the page cache: trials that all read direct say nothing about its
    # cost, and the fit leaves it at 0 rather than wherever the optimiser wandered.
    direct = [t for t in ready if t.config.io_mode == "direct"]
    only_direct = cal.fit(direct, truth.lookahead_recall)
    assert only_direct.c_page_buffered == 0 and only_direct.c_page_mmap == 0
    summary = cal.error_summary(cal.cross_validate(ready, truth.lookahead_recall))
    assert summary["decode_median_abs_pct_error"] < 2
    assert summary["decode_spearman"] > 0.95


def test_fitted_factors_round_trip_through_the_profile(tmp_path):
    from tuner.probe.hardware_profile import HardwareProfile, load_profile, save_profile
    profile = make_profile()
    data = profile.to_dict()
    del data["cost_model"]  # a profile written before the section existed still loads
    assert HardwareProfile.from_dict(data).cost_model == {}
    study = cal.Study([], RunConditions(), 1, 1)
    f = Factors(eta_io=0.5, c_layer=0.002)
    profile.cost_model = cal.cost_model_section(f, {"trials": 0}, resolve("olmoe-1b-7b"), "bf16", study)
    save_profile(profile, tmp_path / "p.json")
    assert cal.factors_from_profile(load_profile(tmp_path / "p.json")) == f


# --- what-if -----------------------------------------------------------------------------------

def _diff(a, b, path=""):
    if isinstance(a, dict):
        return [p for k in a for p in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _diff(x, y, f"{path}[]")]
    return [path] if a != b else []


@pytest.mark.parametrize("edit,allowed", [
    ("disk_bw=7GB/s", {".storage.points[].bandwidth.value", ".storage.points[].iops.value"}),
    ("memory_bw=100GB/s", {".memory_bandwidth[].bandwidth.value"}),
    ("ram=64GiB", {".system.memory.total.value", ".system.memory.available.value"}),
    ("cores=16", {".system.cpu.physical_cores", ".system.cpu.logical_cores"}),
    ("matmul_scale=2", {".cpu_matmul[].throughput.value", ".expert_kernels[].throughput.value"}),
])
def test_what_if_edits_only_what_it_names(edit, allowed):
    base = make_profile(kernels=True)
    before = copy.deepcopy(base.to_dict())
    edited = apply_what_if(base, [edit])
    changed = set(_diff(before, edited.to_dict()))
    assert changed and changed <= allowed
    assert base.to_dict() == before  # the input profile is untouched


def test_what_if_disk_bw_sets_the_best_random_read():
    edited = apply_what_if(make_profile(), ["disk_bw=7GB/s"])
    assert max(p.bandwidth.value for p in edited.storage.points if p.role == "curve") == pytest.approx(7e9)


@pytest.mark.parametrize("edit", ["disk_bw", "speed=3", "ram=lots", "cores=0"])
def test_what_if_rejects_bad_edits(edit):
    from engine.base.errors import ConfigError
    with pytest.raises(ConfigError, match="--what-if"):
        apply_what_if(make_profile(), [edit])


# --- search helpers ----------------------------------------------------------------------------

def test_curve_region_keeps_the_rising_part_and_the_plateau(hw):
    region = curve_region(hw, [64 << 10, 1 << 20, 16 << 20], [1, 4, 16])
    assert region["chunk_size"] == [64 << 10, 1 << 20, 16 << 20]  # the test curve rises all the way
    flat = make_profile()
    # QD 16 reads half what QD 4 does: past the peak, so the region stops at 4.
    flat.storage.points = [dataclasses.replace(p, bandwidth=dataclasses.replace(p.bandwidth, value=p.bandwidth.value * 0.5))
                           if p.role == "curve" and p.queue_depth == 16 else p for p in flat.storage.points]
    assert curve_region(HardwareView(flat), [64 << 10, 1 << 20], [1, 4, 16])["io_threads"] == [1, 4]


def test_prefilter_never_drops_a_config_the_engines_plan_accepts(tiny):
    from engine.format.checkpoint import Checkpoint
    from engine.format.layout import ExpertLayout
    from engine.arch.registry import model_args
    from engine.movement.plan import make_plan
    import torch
    ckpt = Checkpoint(tiny)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    g = from_model_dir(tiny)
    import psutil
    # Budgets around what this process already holds: the engine's plan measures its own RSS.
    rss = psutil.Process().memory_info().rss
    configs = [EngineConfig(ram_budget=rss + b * MiB, prefetch_depth=d, ctx_size=c, cpu_cache_ratio=0.5)
               for b in (-100, 0, 100, 200, 400) for d in (0, 2, 4) for c in (256, 4096, 1 << 20)]
    # A lower bound of the engine's overhead (the tuner gives the study's measured figure).
    kept = prefilter(g, "bf16", configs, overhead_bytes=rss // 2)
    accepted = 0
    for cfg in configs:
        try:  # the engine's own plan, overhead measured from this process as the engine does
            make_plan(ckpt, args, layout, cfg, torch.bfloat16, torch.bfloat16)
        except BudgetError:
            continue
        accepted += 1
        assert cfg in kept
    assert 0 < accepted and len(kept) < len(configs)  # it accepts some and drops some


def test_warm_starts_are_distinct_fitting_points_of_the_space(tiny, hw):
    from tuner.costmodel.best_config import warm_starts
    from tuner.search.space import ModelFacts, SearchSpace
    space = SearchSpace(budget=400 * MiB, physical_cores=2, logical_cores=2, has_gpu=False, min_ctx=256,
                        overhead_bytes=200 * MiB, model=ModelFacts.read(tiny))
    g = from_model_dir(tiny)
    starts = warm_starts(space, g, hw, uniform(g.moe_layers, g.num_experts), Factors(), RunConditions(), 200 * MiB)
    assert len(starts) == 3
    params = [space.params_of(s.config) for s in starts]
    assert len({tuple(sorted(p.items())) for p in params}) == 3
    assert all(space.precheck(s.config)[0] for s in starts)
    speeds = [s.prediction.decode_tok_s for s in starts]
    assert speeds == sorted(speeds, reverse=True)


# --- the CLI -----------------------------------------------------------------------------------

def _run_cli(argv, capsys):
    from colibri.cli import main
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_cli_prints_plan_prediction_and_best_configs(tiny, tmp_path, capsys):
    import json
    from tuner.probe.hardware_profile import save_profile
    save_profile(make_profile(), tmp_path / "p.json")
    rc, out, _ = _run_cli(["plan", "--model", "mixtral-8x22b", "--profile", str(tmp_path / "p.json"), "--quant", "int4",
                           "--budget", "48GiB", "--what-if", "disk_bw=7GB/s", "--top", "2"], capsys)
    assert rc == 0
    assert "plan: dense" in out and "bottleneck:" in out and "best predicted #2" in out and "disk_bw=7GB/s" in out
    rc, out, _ = _run_cli(["plan", "--model", str(tiny), "--profile", str(tmp_path / "p.json"), "--budget", "400MiB",
                           "--json"], capsys)
    r = json.loads(out)
    assert rc == 0 and r["prediction"]["fits"] and r["prediction"]["decode_tok_s"] > 0
    assert r["best"][0]["prediction"]["decode_tok_s"] >= r["best"][-1]["prediction"]["decode_tok_s"]


@pytest.mark.parametrize("argv,message", [
    (["--model", "no-such-model"], "neither a model directory"),
    (["--model", "glm-5", "--what-if", "speed=2"], "--what-if"),
    (["--model", "glm-5", "--routing", "/no/such.json"], "routing histogram"),
    (["--model", "glm-5", "--calibrate", "/"], "no trials.csv"),
    (["--model", "glm-5", "--cached-tokens", "100"], "--cached-tokens goes with --prompt-tokens"),
    (["--model", "glm-5", "--prompt-tokens", "0"], "--prompt-tokens"),
])
def test_plan_cli_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    from tuner.probe.hardware_profile import save_profile
    save_profile(make_profile(), tmp_path / "p.json")
    rc, out, err = _run_cli(["plan", "--profile", str(tmp_path / "p.json"), *argv], capsys)
    assert rc == 2 and message in err and err.count("\n") == 1


def test_plan_cli_calibrates_a_grid_and_stores_the_factors(tiny, tmp_path, capsys, hw):
    import json
    from tuner.probe.hardware_profile import load_profile, save_profile
    g = from_model_dir(tiny)
    truth = Factors(eta_io=0.5, eta_compute=0.7, overlap=0.4, c_request=1e-4, c_layer=2e-3)
    cond = {"budget": 380 * MiB, "threads": 2, "ctx_size": 256, "tokens": 8, "repeats": 2, "prompt_tokens": 8,
            "cold": True}
    routing = synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0)
    table = {}
    for chunk in (256 << 10, 1 << 20, 4 << 20):
        for depth in (0, 2):
            for mode in ("direct", "buffered"):
                point = {"chunk_size": chunk, "prefetch_depth": depth, "cpu_cache_ratio": 1.0, "io_mode": mode}
                cfg = EngineConfig(ram_budget=cond["budget"], threads=2, ctx_size=256, io_threads=4, **point)
                _, _, comps, _, _ = components(g, "bf16", cfg, hw, routing, RunConditions(), 250 * MiB,
                                               truth.lookahead_recall)
                out = combine(comps, truth)
                table[json.dumps(point, sort_keys=True)] = {"status": "ok", "decode_tok_s": 1 / out["token_s"],
                                                            "ttft_s": out["ttft_s"]}
    (tmp_path / "grid.json").write_text(json.dumps({"conditions": cond, "table": table}))
    save_profile(make_profile(), tmp_path / "p.json")
    rc, out, _ = _run_cli(["plan", "--model", str(tiny), "--profile", str(tmp_path / "p.json"), "--routing", "skew:1",
                           "--calibrate", str(tmp_path / "grid.json")], capsys)
    assert rc == 0 and "held-out" in out
    section = load_profile(tmp_path / "p.json").cost_model
    assert section["schema"] == "colibri.costmodel/1" and section["held_out"]["trials"] == len(table)
    assert section["held_out"]["decode_median_abs_pct_error"] < 5


def test_narrow_space_keeps_the_curve_region_and_the_baseline(tiny):
    from tuner.costmodel.best_config import narrow_space
    from tuner.search.space import ModelFacts, SearchSpace
    profile = make_profile()
    # Past 1 MiB the disk gets slower at every queue depth: bigger reads are not searched.
    profile.storage.points = [dataclasses.replace(p, bandwidth=dataclasses.replace(p.bandwidth, value=p.bandwidth.value * 0.3))
                              if p.role == "curve" and p.request_bytes > (1 << 20) else p for p in profile.storage.points]
    space = SearchSpace(budget=400 * MiB, physical_cores=2, logical_cores=2, has_gpu=False, min_ctx=256,
                        model=ModelFacts.read(tiny))
    region = narrow_space(space, profile)
    assert max(region["chunk_size"]) == 1 << 20 and 64 << 10 in region["chunk_size"]
    assert list(space.distributions()["chunk_size"].choices) == region["chunk_size"]
    base = space.baseline()
    assert base.chunk_size in space.chunk_sizes and base.io_threads in space.io_thread_choices
    assert space.params_of(base)["chunk_size"] == base.chunk_size


# --- expert kernels per quant level (the probe's expert_kernels) ---------------------------------

def test_kernel_rates_are_read_per_quant_shape_and_rows():
    from tests.test_probe_profile import KERNEL_RATES
    hw = HardwareView(make_profile(kernels=True))
    for q, rate in KERNEL_RATES.items():
        assert hw.kernel_flops(q, 1, 1, 1024, 512) == pytest.approx(rate * 1e9)  # measured points exactly
        assert hw.kernel_flops(q, 4, 1, 6144, 2048) == pytest.approx(rate * 6e9)
        # Between the shapes: linear in log2(k·n); outside: held at the edge.
        mid = 2 ** ((math.log2(1024 * 512) + math.log2(6144 * 2048)) / 2)
        assert hw.kernel_flops(q, 1, 1, int(mid), 1) == pytest.approx(rate * 1.5e9, rel=1e-3)
        assert hw.kernel_flops(q, 1, 1, 64, 64) == pytest.approx(rate * 1e9)
        # More threads than measured grow at the measured per-thread rate, as matmul_flops does.
        assert hw.kernel_flops(q, 1, 4, 1024, 512) == pytest.approx(4 * rate * 1e9)
    # A profile without kernel points charges every format at the bf16 F.linear rate.
    old = HardwareView(make_profile())
    assert old.kernel_flops("int4", 1, 1, 1024, 512) == old.kernel_flops("bf16", 1, 1, 1024, 512) == \
        old.matmul_flops("bf16", 1, 1)


def _compute_s(g, quant, profile, cfg, run=None):
    _, _, comps, _, _ = components(g, quant, cfg, HardwareView(profile), uniform(g.moe_layers, g.num_experts),
                                   run or RunConditions(), 300 * MiB, 0.7)
    return comps


def test_quantized_compute_is_charged_at_its_kernels_measured_rate():
    g = resolve("olmoe-1b-7b")
    resident = EngineConfig(ram_budget=40 * GiB, threads=1)  # everything resident: compute alone
    with_kernels = make_profile(kernels=True)
    c = {q: _compute_s(g, q, with_kernels, resident) for q in ("bf16", "int8", "int4")}
    # The made-up kernels are slow enough that FLOPs bound every level: int4's kernel at half
    # int8's rate takes twice as long, though it reads half the bytes.
    assert not any(x.compute_is_memory for x in c.values())
    # (rel 1e-3: the cold trial's first reads also pay a few µs of prepare time each)
    assert c["int4"].compute_s == pytest.approx(2 * c["int8"].compute_s, rel=1e-3)
    assert c["int8"].compute_s == pytest.approx(2 * c["bf16"].compute_s, rel=1e-3)
    # Without the probe's kernel points int4 can only look faster than bf16 (fewer bytes, same rate).
    old = make_profile()
    assert _compute_s(g, "int4", old, resident).compute_s <= _compute_s(g, "bf16", old, resident).compute_s


def test_each_streamed_quantized_expert_pays_the_measured_prepare_time():
    g = resolve("olmoe-1b-7b")
    streaming = EngineConfig(ram_budget=int(1.5 * GiB), prefetch_depth=0)
    profile = make_profile(kernels=True)
    free = dataclasses.replace(profile, expert_kernels=[dataclasses.replace(k, prepare_time=type(k.prepare_time)(
        0.0, "us")) for k in profile.expert_kernels])
    hw = HardwareView(profile)
    _, rates, comps, _, _ = components(g, "int4", streaming, hw, uniform(g.moe_layers, g.num_experts),
                                       RunConditions(), 300 * MiB, 0.7)
    base = _compute_s(g, "int4", free, streaming)
    reads = rates.decode_misses_per_token + rates.wasted_prefetch_per_token
    assert reads > 0
    assert comps.compute_s - base.compute_s == pytest.approx(reads * 3 * 5e-6, rel=1e-6)


def test_faster_kernels_never_predict_slower():
    g = resolve("olmoe-1b-7b")
    cfg = EngineConfig(ram_budget=int(1.5 * GiB), prefetch_depth=1, threads=0)
    base = make_profile(kernels=True)
    assert _decode(g, cfg, apply_what_if(base, ["matmul_scale=3"])) > _decode(g, cfg, base)


# --- following the engine: read requests, the bench's repeats, mmap hits -------------------------

@pytest.mark.parametrize("span", [3 * MiB, 64 << 10, 3 * MiB + 4096, 40 * MiB])
@pytest.mark.parametrize("chunk", [64 << 10, 1 * MiB, 4 * MiB, 16 * MiB])
@pytest.mark.parametrize("io_threads", [1, 4, 16])
def test_read_requests_are_the_read_pools_pieces(span, chunk, io_threads):
    """One request per expert span unless it exceeds chunk_size, then min(io_threads, spans /
    chunk) pieces: exactly what engine/movement/io/pool.py submits (its own splitting, asked directly)."""
    from engine.movement.io import ReadPool
    from tuner.costmodel.predict import read_requests
    with ReadPool("buffered", io_threads, chunk) as pool:
        pieces = pool._pieces(0, span)
    n, size = read_requests(span, chunk, io_threads)
    assert n == len(pieces)
    assert size == pytest.approx(max(hi - lo for lo, hi in pieces), rel=0.01, abs=4096)


def test_cold_repeats_keep_lfu_counts_and_replay_the_same_tokens():
    """colibri bench replays one prompt (greedy) in every repeat and empties the cache with
    clear(), which keeps lfu's request counts: a replayed lru repeat hits exactly as often as
    the first, lfu's later repeat hits more (it knows the stream's popular experts)."""
    from tuner.costmodel.routing_model import simulate
    routing = synth_skew(16, 64, 8, 1.0)
    kw = dict(prompt_tokens=8, tokens=8, cold=True, replay=True, prelude_tokens=0, seed=3)
    for policy, later_more in (("lru", False), ("lfu", True)):
        one = simulate(routing, 8, 60, policy, repeats=1, **kw)
        two = simulate(routing, 8, 60, policy, repeats=2, **kw)
        assert two.prefill_misses_per_layer == one.prefill_misses_per_layer  # cold: the prompt misses again
        if later_more:
            assert two.decode_last > one.decode_last
        else:
            assert two.decode_last == one.decode_last
    # Fresh tokens per repeat (no replay) give lfu no such head start.
    fresh = simulate(routing, 8, 60, "lfu", repeats=2, **{**kw, "replay": False})
    assert fresh.decode_last < simulate(routing, 8, 60, "lfu", repeats=2, **kw).decode_last


def test_pinned_keys_from_a_sample_pin_less_of_the_popular_set():
    """The engine pins the hottest experts of one recorded prompt, a sample: ranked by a small
    sample the pins catch fewer of the tokens' experts than ranked by the true popularity."""
    from tuner.costmodel.routing_model import simulate
    routing = synth_skew(16, 64, 8, 1.0)
    kw = dict(prompt_tokens=8, tokens=16, repeats=2, cold=True, replay=True, seed=5)
    exact = simulate(routing, 8, 100, "pinned", pinned_from=None, **kw).decode
    sampled = simulate(routing, 8, 100, "pinned", pinned_from=24, **kw).decode
    assert sampled < exact


def test_an_mmap_cache_hit_saves_only_what_the_page_cache_keeps(hw):
    """mmap cache entries are views of page-cache pages the kernel reclaims by recency: a
    policy's extra hits buy no disk time over lru's in mmap mode, while they do with pread."""
    g = resolve("olmoe-1b-7b")  # a cache of 62 of its 1024 experts: lfu and lru differ
    routing = synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0)

    def pred(mode, policy):
        cfg = EngineConfig(ram_budget=3 * GiB, cpu_cache_ratio=0.5, prefetch_depth=0, io_mode=mode,
                           cache_policy=policy)
        return predict(g, "bf16", cfg, hw, routing, Factors(c_page_mmap=2e-9), RunConditions(),
                       overhead_bytes=300 * MiB)

    for mode in ("mmap", "direct"):
        lru, lfu = pred(mode, "lru"), pred(mode, "lfu")
        assert lfu.hit_rate > lru.hit_rate  # what the engine's counters report, in both modes
        if mode == "mmap":
            assert lfu.components.disk_s == pytest.approx(lru.components.disk_s)
        else:
            assert lfu.components.disk_s < lru.components.disk_s


def test_disk_bound_trials_leave_compute_efficiency_and_layer_overhead_at_their_defaults():
    """Where every token waits on the disk, compute efficiency and per-layer overhead cannot be
    told apart (nor from the overlap): the fit leaves them at 1 and 0 instead of wherever the
    optimiser wanders; one compute-bound trial makes them fitted again."""
    from tuner.costmodel.predict import Components

    def trial(i, compute_s, disk_s, mode="direct"):
        c = Components(layers=16, compute_s=compute_s, compute_is_memory=True, disk_s=disk_s, requests=100.0 + i,
                       covered=0.9, prefill_compute_s=compute_s * 4, prefill_disk_s=disk_s * 4,
                       prefill_requests=400.0, io_mode=mode)
        t = cal.Trial(i, EngineConfig(prefetch_depth=1, io_mode=mode), 1.0, 1.0)
        t.comps = c
        out = combine(c, Factors(eta_io=0.8, c_layer=2e-3, overlap=0.3))
        t.decode_tok_s, t.ttft_s = 1 / out["token_s"], out["ttft_s"]
        return t

    disk_bound = [trial(i, 0.02, 0.3 + 0.05 * i) for i in range(6)]
    assert "eta_compute" not in cal.informed(disk_bound) and "c_layer" not in cal.informed(disk_bound)
    got = cal.fit(disk_bound, 0.9)
    assert got.eta_compute == 1.0 and got.c_layer == 0.0
    mixed = disk_bound + [trial(10, 0.05, 0.01), trial(11, 0.08, 0.02)]
    assert {"eta_compute", "c_layer"} <= set(cal.informed(mixed))


def test_overlap_defaults_to_one_and_is_fitted_only_from_compute_bound_prefetching_trials():
    """Lookahead reads run on the read pool's threads while the layers compute, so by default
    they hide behind all of it (overlap 1). A disk-bound token has too little compute for the
    overlap to show, so disk-bound trials leave it at 1 even though the "truth" they were made
    with says 0.2; a compute-bound trial informs it only if it prefetched."""
    from tuner.costmodel.predict import Components

    assert Factors().overlap == 1.0

    def trial(i, compute_s, disk_s, depth):
        c = Components(layers=16, compute_s=compute_s, compute_is_memory=True, disk_s=disk_s, requests=100.0 + i,
                       covered=0.9, prefill_compute_s=compute_s * 4, prefill_disk_s=disk_s * 4,
                       prefill_requests=400.0, io_mode="direct")
        t = cal.Trial(i, EngineConfig(prefetch_depth=depth, io_mode="direct"), 1.0, 1.0)
        t.comps = c
        out = combine(c, Factors(eta_io=0.8, overlap=0.2))
        t.decode_tok_s, t.ttft_s = 1 / out["token_s"], out["ttft_s"]
        return t

    disk_bound = [trial(i, 0.02, 0.3 + 0.05 * i, depth=i % 3) for i in range(6)]
    assert "overlap" not in cal.informed(disk_bound)
    assert cal.fit(disk_bound, 0.9).overlap == 1.0
    # Compute-bound but without lookahead: it says nothing about hiding reads.
    no_prefetch = disk_bound + [trial(10, 0.05, 0.01, depth=0), trial(11, 0.08, 0.02, depth=0)]
    assert "eta_compute" in cal.informed(no_prefetch) and "overlap" not in cal.informed(no_prefetch)
    prefetching = disk_bound + [trial(10, 0.05, 0.04, depth=2), trial(11, 0.08, 0.05, depth=1),
                                trial(12, 0.06, 0.03, depth=0)]
    assert "overlap" in cal.informed(prefetching)
    assert cal.fit(prefetching, 0.9).overlap == pytest.approx(0.2, abs=0.05)


# --- time to first token after cached tokens (plan --prompt-tokens N --cached-tokens M) -------------

def test_ttft_after_cached_tokens_counts_reads_compute_and_restores(tiny, hw):
    """N new tokens after M reused: the reads and matmuls of N, attention over all M + N positions,
    and the M positions' KV restored (from RAM where the prefix cache's share holds them, else
    from the SSD: slower); computing all M + N instead costs more."""
    g = from_model_dir(tiny)
    routing = synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0)
    config = EngineConfig(ram_budget=1 * GiB, ctx_size=4096, prefix_cache=64 * MiB)
    kw = dict(geometry=g, quant=g.native_quant, hw=hw, routing=routing, factors=Factors(), overhead_bytes=300 * MiB)
    cold = predict_prefill(config=config, new_tokens=200, cached_tokens=0, **kw)
    ram = predict_prefill(config=config, new_tokens=200, cached_tokens=1800, **kw)
    ssd = predict_prefill(config=config.replace(prefix_cache=64 << 10), new_tokens=200, cached_tokens=1800, **kw)
    whole = predict_prefill(config=config, new_tokens=2000, cached_tokens=0, **kw)
    assert cold["fits"] and cold["restore_from"] == "none" and cold["restore_s"] == cold["restore_bytes"] == 0
    assert ram["restore_from"] == "ram" and ssd["restore_from"] == "ssd"
    assert 0 < ram["restore_s"] == ram["restore_ram_s"] < ram["restore_ssd_s"] == ssd["restore_s"]
    # every position of every layer, as a prefix block keeps it: the plan's KV at ctx, per position
    kept = plan_memory(g, g.native_quant, config, 300 * MiB)
    assert ram["restore_bytes"] == round(1800 * kept.kv_bytes / 4096)
    assert ram["attention_s"] > cold["attention_s"] > 0  # the new tokens attend to the cached ones
    assert ram["read_bytes"] == cold["read_bytes"] <= whole["read_bytes"]
    assert cold["ttft_s"] < ram["ttft_s"] < ssd["ttft_s"] < whole["ttft_s"]
    assert ram["ttft_s"] == pytest.approx(ram["read_s"] + ram["compute_s"] + ram["overhead_s"] + ram["restore_s"])
    # A group smaller than the prompt: that many groups, each reading its union again.
    grouped = predict_prefill(config=config.replace(prefill_chunk=64), new_tokens=200, cached_tokens=0, **kw)
    assert grouped["groups"] == 4 and grouped["prefill_group"] == 64 and grouped["read_bytes"] > cold["read_bytes"]
    # A budget that cannot hold it: the reason, not a figure.
    refused = predict_prefill(config=config.replace(ram_budget=64 * MiB), new_tokens=200, cached_tokens=0, **kw)
    assert not refused["fits"] and "budget" in refused["reason"]


def test_plan_cli_predicts_the_ttft_of_new_tokens_after_cached_ones(tiny, tmp_path, capsys):
    import json
    from tuner.probe.hardware_profile import save_profile
    save_profile(make_profile(), tmp_path / "p.json")
    (tmp_path / "c.toml").write_text('prefix_cache = "64MiB"\n')
    base = ["plan", "--model", str(tiny), "--profile", str(tmp_path / "p.json"), "--budget", "600MiB",
            "--config", str(tmp_path / "c.toml"), "--prompt-tokens", "100"]
    rc, out, _ = _run_cli(base + ["--cached-tokens", "900", "--json"], capsys)
    p = json.loads(out)["prefill"]
    assert rc == 0 and (p["new_tokens"], p["cached_tokens"], p["restore_from"]) == (100, 900, "ram")
    assert p["ttft_s"] < p["ttft_without_reuse_s"]
    rc, out, _ = _run_cli(base + ["--cached-tokens", "900"], capsys)
    assert rc == 0 and "first token after 100 new tokens and 900 cached" in out and "without reuse" in out
    rc, out, _ = _run_cli(base[:-2] + ["--json"], capsys)
    assert rc == 0 and "prefill" not in json.loads(out)  # only when asked
