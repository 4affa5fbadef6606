"""The engine's front door (engine/api): typed results over the unchanged JSON, printers that iterate
their fields, the lazy re-exports, and `colibri plan`'s typed request and result."""

import dataclasses
import subprocess
import sys
from typing import ClassVar, Optional

import engine.api as door
from engine.api import BenchResult, PlanResult, RunResult, figure, figures
from tuner.results.printers import bench_text, run_text

BENCH = {"schema": "colibri.metrics/1", "kind": "bench", "model": "/m", "geometry": {"model_type": "qwen3_moe"},
         "compute_dtype": "bfloat16", "quant": "int8", "kernel": "k", "threads": 2, "cold": True, "tokens": 8,
         "repeats": 2, "config": {"ram_budget": 0, "chunk_size": 1 << 20, "prefetch_depth": 1, "io_mode": "direct"},
         "summary": {"decode_tok_s": {"median": 3.5, "min": 3.0, "max": 4.0, "stdev": 0.5, "n": 2}},
         "decode_tok_s": 3.5, "ttft_s": 0.25, "bytes_read_per_token": 2048.0, "hit_rate": {"ram": 0.5},
         "io_mode_effective": "direct", "io_backend_effective": "threads", "runs": [{"x": 1}]}


def test_a_result_keeps_the_engines_json_whole():
    r = BenchResult.from_dict(BENCH)
    assert r.to_dict() == BENCH and r.decode_tok_s == 3.5 and r["runs"] == [{"x": 1}]
    assert BenchResult.SCHEMA != RunResult.SCHEMA and r.spread()["n"] == 2


def test_every_figure_field_says_how_it_prints():
    for cls in (RunResult, BenchResult):
        for f in figures(cls):
            assert {"label", "kind", "line"} <= set(f.metadata), f.name


def test_the_printers_iterate_the_fields():
    text = bench_text(BENCH)
    for f in figures(BenchResult):
        if BENCH.get(f.name) is not None:
            assert f.metadata["label"] in text, f.name
    assert "decode 3.50 tok/s" in text and "read per token 2.0 KiB" in text and "hit rate ram 50.0%" in text


def test_a_new_figure_is_one_field():
    @dataclasses.dataclass(frozen=True)
    class WithFigure(BenchResult):
        SCHEMA: ClassVar[str] = "test/1"
        joules_per_token: Optional[float] = figure("energy", "J/tok", "float", "J/token")

    assert "energy 1.25 J/token" in run_text(WithFigure.from_dict({**BENCH, "joules_per_token": 1.25}))


def test_the_door_resolves_lazily_and_sees_a_patched_home(monkeypatch):
    out = subprocess.run([sys.executable, "-c", "import sys; from engine.api import EngineConfig, ConfigError; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # the config alone does not load the runtime
    import engine.run.resolve as home
    monkeypatch.setattr(home, "resolve_model", lambda *a, **k: "patched")
    assert door.resolve_model("x") == "patched" and door.home("resolve_model") == "engine.run.resolve"


def test_plan_result_json_is_its_fields_and_its_schema():
    r = PlanResult(model={"name": "m"}, quant="bf16", routing="uniform", conditions="steady", what_if=[])
    d = r.to_dict()
    assert d["schema"] == "colibri.plan/1" and d["quant"] == "bf16" and list(d)[1:3] == ["model", "quant"]


def test_plan_takes_a_typed_request_built_from_the_flags():
    from colibri.cli import build_parser
    from colibri.commands.machine import plan_request
    args = build_parser("plan").parse_args(["plan", "--model", "glm-5", "--profile", "p.json", "--what-if", "ram=8GiB"])
    req = plan_request(args)
    assert req.model == "glm-5" and req.what_if == ("ram=8GiB",) and req.calibrate == () and req.top == 3
