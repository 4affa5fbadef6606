"""The lossy front compares each lossy setting with lossless at the same placement (tuner/search/lossy.py)."""

import optuna

from tuner.search.lossy import QualityBound, front_summary, markdown

PLACE_SLOW = {"io_mode": "buffered", "chunk_size": 1 << 20, "threads": 2}
PLACE_FAST = {"io_mode": "direct", "chunk_size": 4 << 20, "threads": 0}
LOSSLESS_Q = {"kl_mean": 0.0, "top1_agreement": 1.0}


def trial(number, speed, place, quality=LOSSLESS_Q, status="ok", **lossy):
    config = {**place, "kv_dtype": "auto", "top_k_reduction": 0, "expert_threshold": 0.0, **lossy}
    t = optuna.trial.create_trial(value=speed, distributions={}, params={},
                                  user_attrs={"config": config, "decode_tok_s": speed, "quality": quality,
                                              "status": status})
    t.number = number
    return t


def test_a_probe_at_the_slow_placement_is_priced_against_lossless_there():
    # demo at 1 GiB: the baseline (buffered) 4.69, the defaults (direct) 14.8, k-1 probed at the baseline's placement
    trials = [trial(0, 4.69, PLACE_SLOW), trial(1, 14.8, PLACE_FAST),
              trial(2, 6.41, PLACE_SLOW, {"kl_mean": 1e-5, "top1_agreement": 0.99}, top_k_reduction=1),
              trial(3, 13.5, {**PLACE_FAST, "chunk_size": 64 << 10}, {"kl_mean": 5e-4, "top1_agreement": 0.9},
                    kv_dtype="fp8")]
    s = front_summary(trials, QualityBound(max_kl=0.05), None, None)
    by = {p["label"]: p for p in s["points"]}
    assert by["lossless"]["decode_tok_s"] == 14.8 and by["lossless"]["vs_lossless_same_placement"] is None
    assert abs(by["k-1"]["vs_lossless_same_placement"] - 6.41 / 4.69) < 1e-3  # +37%, though off the front
    assert not by["k-1"]["on_front"]
    assert by["fp8 KV"]["vs_lossless_same_placement"] is None  # no lossless trial at its placement
    table = markdown(s)
    assert "| k-1 | 6.41 | +37% |" in table and "| fp8 KV | 13.5 | - |" in table


def test_a_failed_lossless_trial_is_no_comparison():
    failed = trial(0, 0.0, PLACE_SLOW, status="timeout")
    trials = [failed, trial(1, 2.0, PLACE_SLOW, {"kl_mean": 1e-5, "top1_agreement": 0.99}, expert_threshold=0.1)]
    (point,) = front_summary(trials, QualityBound(max_kl=0.05), None, None)["points"]
    assert point["vs_lossless_same_placement"] is None
