"""The shared profile's best_configs entry is checked by the one strict decoder
(tuner/base/typed_json.py) from its dataclasses (tuner/share/profile_schema.py), and the format
on disk is what it was: the profiles committed under profiles/ still load, and an entry exported
now has their keys in their order."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from report_fixture import make_run
from tuner.base.typed_json import decode, rules
from tuner.probe.probe_errors import ProfileError
from tuner.share import compare, profiles
from tuner.share.profile_schema import validate_shared

COMMITTED = sorted((Path(__file__).resolve().parent.parent / "profiles").glob("*.json"))
ADDED_LATER = ["defaults_figures", "gain_over_defaults", "workload"]  # optional: older entries lack them


def test_there_is_a_committed_profile_to_check():
    assert COMMITTED, "profiles/*.json"


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: p.name)
def test_the_committed_profiles_still_load(path):
    data = json.loads(path.read_text())
    _, entries, _ = validate_shared(data)
    assert entries and all(e["schema"] == "colibri.best_config/1" for e in entries)
    # `profile import` and `profile show` read them through the same check
    assert profiles.read_profile_file(path) == data


def test_an_entry_exported_now_has_the_committed_keys_in_their_order(tmp_path):
    committed = json.loads(COMMITTED[0].read_text())["best_configs"][0]
    entry = profiles.export_profile(make_run(tmp_path / "run"))["best_configs"][-1]
    assert list(entry) == list(committed) + ADDED_LATER
    assert list(entry["figures"]) == list(committed["figures"])
    assert list(entry["conditions"]) == list(committed["conditions"])
    assert list(entry["tool"]) == list(committed["tool"])
    assert list(entry["geometry"]) == list(committed["geometry"])


def test_the_figure_lists_come_from_the_shared_figures_and_the_column_registry():
    # the confirmed figures, then the ones copied from the trial's trials.csv column of the registry
    assert profiles.FIGURE_KEYS == ("decode_tok_s", "ttft_s", "decode_min", "decode_max", "decode_stdev",
                                    "ttft_min", "ttft_max", "measurements", "samples")
    assert dict(profiles.TRIAL_FIGURES)["peak_bytes"] == "cgroup_peak_bytes"
    assert [m[:4] for m in compare.METRICS] == [
        ("decode_tok_s", "decode tok/s (median)", "decode_min", "decode_max"),
        ("ttft_s", "TTFT s (median)", "ttft_min", "ttft_max"),
        ("bytes_read_per_token", "MiB read per token", None, None),
        ("hit_rate_ram", "RAM hit rate", None, None)]


@pytest.mark.parametrize("edit,message", [
    (lambda e: e.pop("defaults_figures"), None),  # added later: may be absent
    (lambda e: e.pop("figures"), ": missing key 'figures'"),
    (lambda e: e["figures"].pop("samples"), ".figures: missing key 'samples'"),
    (lambda e: e["figures"].update(read_gbps=None), None),  # null: not measured
    (lambda e: e["figures"].update(unconfirmed=None), ".figures.unconfirmed: expected boolean, got null"),
    (lambda e: e["figures"].update(io_stall_fraction=1.5), ".figures.io_stall_fraction: 1.5 is outside [0, 1]"),
    (lambda e: e["conditions"].update(tokens=0), ".conditions.tokens: 0 is outside [1, 1e+06]"),
    (lambda e: e["conditions"].update(cold="yes"), ".conditions.cold: expected boolean"),
    (lambda e: e.update(created_utc="yesterday"), ".created_utc: 'yesterday' is not of the form"),
    (lambda e: e.update(objective="fast"), ".objective: 'fast' is not one of"),
    (lambda e: e["geometry"].update(layers=0), ".geometry.layers: 0 is outside [1, 1.67772e+07]"),
    (lambda e: e.update(workload={"kind": "prompts"}), ".workload: missing key 'requests'"),
])
def test_each_rule_of_an_entry_is_one_line_naming_its_path(edit, message):
    data = json.loads(COMMITTED[0].read_text())
    entry = data["best_configs"][0]
    entry.update(defaults_figures=copy.deepcopy(entry["figures"]), gain_over_defaults=0.1, workload=None)
    edit(entry)
    if message is None:
        validate_shared(data)
        return
    with pytest.raises(ProfileError) as err:
        validate_shared(data)
    assert f"profile.best_configs[0]{message}" in str(err.value) and "\n" not in str(err.value)


@dataclass
class _Ruled:
    n: Optional[int] = field(default=None, metadata=rules(bounds=(1, 8)))
    tag: str = field(default="", metadata=rules(pattern=re.compile(r"^[a-z]+$")))
    pick: str = field(default="a", metadata=rules(choices=("a", "b")))


def test_the_decoders_value_rules():
    assert decode(_Ruled, {"n": 8, "tag": "ok", "pick": "b"}, "x", ProfileError) == _Ruled(8, "ok", "b")
    assert decode(_Ruled, {"n": None, "tag": "ok", "pick": "a"}, "x", ProfileError).n is None  # null: no rule
    for bad, message in [({"n": 9}, "x.n: 9 is outside [1, 8]"), ({"tag": "A1"}, "x.tag: 'A1' is not of the form"),
                         ({"pick": "c"}, "x.pick: 'c' is not one of 'a', 'b'")]:
        with pytest.raises(ProfileError, match=re.escape(message)):
            decode(_Ruled, {"n": 1, "tag": "ok", "pick": "a", **bad}, "x", ProfileError)
