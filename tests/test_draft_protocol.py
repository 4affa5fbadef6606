"""benchmarks/time/draft_runs.py's paired protocol: the order the modes take a prompt in, and one mode's
drafting counters over its processes."""

import pytest

from benchmarks.time.draft_runs import PROMPTS, merge_draft_stats, turn_order


@pytest.mark.parametrize("modes", [3, 4, 5])
def test_over_as_many_rounds_as_modes_every_prompt_sees_each_mode_in_each_place(modes):
    live = [f"m{n}" for n in range(modes)]
    for prompt in range(PROMPTS):
        places = {m: set() for m in live}
        for r in range(modes):
            turn = turn_order(live, r, prompt)
            assert sorted(turn) == live  # each mode once a turn
            for place, m in enumerate(turn):
                places[m].add(place)
        assert all(p == set(range(modes)) for p in places.values()), places


def test_a_modes_counters_over_its_processes_are_summed_and_its_rates_taken_from_the_sums():
    a = {"steps": 100, "drafted": 8, "accepted": 6, "emitted": 104, "mtp_loads": 2,
         "decisions": {"gated off": 96, "explored": 4}, "acceptance": 0.75, "tokens_per_step": 1.04}
    b = {"steps": 300, "drafted": 2, "accepted": 0, "emitted": 300, "mtp_loads": 1,
         "decisions": {"gated off": 298, "measuring": 2}, "acceptance": 0.0, "tokens_per_step": 1.0}
    merged = merge_draft_stats([a, b])
    assert merged["drafted"] == 10 and merged["accepted"] == 6 and merged["mtp_loads"] == 3
    assert merged["acceptance"] == pytest.approx(0.6)  # 6 of 10, not the mean of 0.75 and 0.0
    assert merged["tokens_per_step"] == pytest.approx(404 / 400)
    assert merged["decisions"] == {"explored": 4, "gated off": 394, "measuring": 2}
    assert merge_draft_stats([{}, {}]) == {}  # drafting off in every process
