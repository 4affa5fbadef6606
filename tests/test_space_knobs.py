"""Which engine settings `colibri tune` searches, and over which ranges, is the knobs' own
metadata (engine/base/config.py `knob(search=...)`): the search space reads it, so a searched
knob is one field."""

from __future__ import annotations

import dataclasses

import optuna
import pytest

from engine.base.config import IO_BACKENDS, EngineConfig
from tuner.results.columns import CONFIG_COLUMNS
from tuner.search import space as space_mod
from tuner.search.space import SearchSpace

GiB = 1 << 30
KNOBS = {f.name: f.metadata for f in dataclasses.fields(EngineConfig)}


def _space(**kw) -> SearchSpace:
    return SearchSpace(**{"budget": GiB, "physical_cores": 2, "logical_cores": 4, "has_gpu": False, "min_ctx": 256,
                          **kw})


def test_the_space_searches_exactly_the_knobs_with_a_search_range():
    with_range = [name for name, meta in KNOBS.items() if meta.get("search")]
    assert list(_space(has_gpu=True, serve=True).distributions()) == with_range
    # gpu_cache_ratio needs a GPU; max_batch is searched by tune --objective serve alone
    assert list(_space().distributions()) == [n for n in with_range if n not in ("gpu_cache_ratio", "max_batch")]
    assert list(_space(has_gpu=True).distributions()) == [n for n in with_range if n != "max_batch"]
    assert [c.name for c in CONFIG_COLUMNS if c.searched] == with_range  # report.md's searched columns


def test_ranges_name_the_runs_facts():
    d = _space(min_ctx=300).distributions()
    assert (d["threads"].low, d["threads"].high) == (1, 4)  # logical cores
    assert d["ctx_size"].choices == (300, 600, 1200)  # the user's minimum and two doublings
    assert "pinned" not in d["cache_policy"].choices and "pinned" in _space(with_pinned=True).distributions()[
        "cache_policy"].choices  # pinned only with a routing histogram
    base = _space(min_ctx=300).baseline()
    assert (base.threads, base.ctx_size, base.io_mode, base.chunk_size) == (2, 300, "buffered", 1 << 20)


def test_a_knob_given_a_search_range_is_searched_end_to_end(monkeypatch):
    # What adding `search=dict(choices=IO_BACKENDS, baseline="threads")` to io_backend's field does:
    monkeypatch.setitem(space_mod.SEARCHED, "io_backend", {"choices": IO_BACKENDS, "baseline": "threads"})
    space = _space()
    assert space.describe()["io_backend"] == list(IO_BACKENDS)
    assert space.baseline().io_backend == "threads"
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    seen = set()
    for _ in range(20):
        trial = study.ask()
        config = space.suggest(trial)
        assert config.io_backend == trial.params["io_backend"]
        assert space.params_of(config)["io_backend"] == config.io_backend  # a config maps back onto its point
        seen.add(config.io_backend)
        study.tell(trial, 1.0)
    assert seen == set(IO_BACKENDS)


@pytest.mark.parametrize("name", [n for n, m in KNOBS.items() if m.get("search")])
def test_each_search_range_lies_within_the_knobs_own_bounds(name):
    meta, rule = KNOBS[name], KNOBS[name]["search"]
    space = _space(has_gpu=True, with_pinned=True, min_ctx=1, serve=True)
    dist = space.distributions()[name]
    values = dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)
    for value in values:  # every point the search may propose is a valid config (EngineConfig validates)
        EngineConfig(**{name: value})
    assert meta["kind"] in ("int", "size", "float", "choice")
    base = getattr(space.baseline(), name)  # the rules-of-thumb baseline is a point of the space
    assert "baseline" in rule and (base in values if hasattr(dist, "choices") else dist.low <= base <= dist.high)
