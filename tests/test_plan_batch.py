"""`colibri plan --batch`: the predicted step of B sequences decoding together (engine/arch/decode_rows.py).

The model is the one-token prediction with the experts of a step being the union of the B tokens'
routes (expected from the routing model's popularity), the dense weights read once, and the rows'
matmuls and dispatch per row. Checked for its arithmetic and its direction, not for speed.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.base.config import EngineConfig
from tests.test_probe_profile import make_profile
from tuner.costmodel.hardware import HardwareView
from tuner.costmodel.model_geometry import resolve
from tuner.costmodel.batch_model import expected_union, predict_batch
from tuner.costmodel.predict import Factors, RunConditions, predict
from tuner.costmodel.routing_model import RoutingModel, synth_skew, uniform

MiB, GiB = 1 << 20, 1 << 30
FACTORS = Factors(eta_io=0.7, c_request=1e-4, c_layer=1e-4, overlap=0.5)


def test_the_expected_union_of_b_tokens():
    """Uniform routing over E experts, top-k: E (1 - (1 - k/E)^B); one token routes to exactly k;
    a layer whose routing always picks the same k experts has a union of k at any B."""
    assert expected_union(uniform(3, 64), 8, 1) == pytest.approx(8)
    assert expected_union(uniform(3, 64), 8, 4) == pytest.approx(64 * (1 - (1 - 8 / 64) ** 4))
    fixed = np.zeros((2, 16))
    fixed[:, :2] = 0.5
    assert expected_union(RoutingModel("histogram", fixed, 0.0), 2, 8) == pytest.approx(2)


def test_one_sequence_is_the_one_token_prediction_and_more_sequences_share_reads():
    """B = 1 gives predict's decode tok/s; with B the union grows slower than B, so bytes per token
    fall, each sequence gets slower and the aggregate faster."""
    g = resolve("olmoe-1b-7b")
    cfg = EngineConfig(ram_budget=int(3 * GiB), prefetch_depth=1, ctx_size=256)  # KV small beside the cache
    hw = HardwareView(make_profile())
    routing = synth_skew(g.moe_layers, g.num_experts, g.top_k, 1.0)
    run = RunConditions.steady()
    one = predict(g, "int4", cfg, hw, routing, FACTORS, run, 300 * MiB)
    points = predict_batch(g, "int4", cfg, hw, routing, FACTORS, run, 300 * MiB, (1, 2, 4, 8))
    assert all(p.fits for p in points)
    assert points[0].per_sequence_tok_s == pytest.approx(one.decode_tok_s, rel=1e-9)
    assert points[0].union_experts == pytest.approx(g.top_k, abs=1e-3)
    for a, b in zip(points, points[1:]):
        assert a.union_experts < b.union_experts < a.union_experts * b.batch / a.batch
        assert b.bytes_per_step / b.batch < a.bytes_per_step / a.batch
        assert b.per_sequence_tok_s < a.per_sequence_tok_s and b.aggregate_tok_s > a.aggregate_tok_s


def test_a_batch_whose_kv_caches_do_not_fit_is_named():
    """max_batch B charges B KV caches: a budget that holds one sequence's refuses many, naming the KV cache."""
    g = resolve("olmoe-1b-7b")
    cfg = EngineConfig(ram_budget=int(1.5 * GiB), ctx_size=4096)  # one KV cache: 512 MiB
    points = predict_batch(g, "int4", cfg, HardwareView(make_profile()), uniform(g.moe_layers, g.num_experts),
                           FACTORS, RunConditions.steady(), 300 * MiB, (1, 4))
    assert points[0].fits and not points[1].fits and "KV cache" in points[1].reason


def test_plan_cli_prints_the_batch_table(tmp_path, capsys):
    from colibri.cli import main
    from tuner.probe.hardware_profile import save_profile
    save_profile(make_profile(), tmp_path / "p.json")
    argv = ["plan", "--model", "olmoe-1b-7b", "--profile", str(tmp_path / "p.json"), "--quant", "int4",
            "--budget", "3GiB", "--top", "1", "--batch", "1,4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "batched decode" in out and "aggregate" in out
    assert main(argv + ["--json"]) == 0
    batch = json.loads(capsys.readouterr().out)["batch"]
    assert [p["batch"] for p in batch] == [1, 4] and batch[1]["union_experts"] > batch[0]["union_experts"]
    assert main(argv[:-1] + ["1,0"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
