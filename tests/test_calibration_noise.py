"""tune's calibration warns when a trial's decode is too short to measure (tuner/search/budget.py: longer_decode)."""

from tuner.search.budget import SHORT_DECODE_S, longer_decode


def test_a_decode_long_enough_gets_no_suggestion():
    assert longer_decode(8, 4.0) is None  # demo at 1 GiB: 2 s per repeat
    assert longer_decode(8, 8 / SHORT_DECODE_S) is None  # exactly at the bound


def test_a_fast_model_gets_a_power_of_two_that_decodes_for_twice_the_bound():
    # the trained reference at ~300 tok/s: 8 tokens are 27 ms
    n = longer_decode(8, 300.0)
    assert n == 256 and n / 300.0 >= 2 * SHORT_DECODE_S and (n // 2) / 300.0 < 2 * SHORT_DECODE_S
    assert longer_decode(8, 40.0) == 32  # 0.2 s -> 0.8 s
    assert longer_decode(100, 1000.0) == 800  # starts from the user's own count


def test_no_figure_no_suggestion():
    assert longer_decode(8, None) is None
    assert longer_decode(8, 0.0) is None
