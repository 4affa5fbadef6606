"""benchmarks/benchkit.py: the lock, conditions block, JSON document and table every benchmark tool prints."""

import fcntl
import io
import json
import sys

import pytest

from benchmarks import benchkit


def test_the_lock_excludes_another_holder_while_held(tmp_path):
    path = tmp_path / "bench.lock"
    with benchkit.bench_lock(str(path)):
        with open(path) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:  # released on exit
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with benchkit.bench_lock(None):  # no path: no lock, no file
        pass


def test_conditions_describe_the_machine_and_carry_the_callers_own():
    cond = benchkit.conditions(io_mode="direct", repeats=3)
    assert cond["machine"]["logical_cores"] >= 1 and cond["machine"]["ram_bytes"] > 0
    assert cond["commit"] and cond["date"].endswith("UTC") and cond["cgroup"]
    assert (cond["io_mode"], cond["repeats"]) == ("direct", 3)
    line = benchkit.summary_line(cond)
    assert cond["commit"] in line and "io_mode direct" in line and "repeats 3" in line


def test_emit_prints_one_json_document_or_the_table_of_the_same_rows():
    rows = [{"name": "a", "tok_s": benchkit.spread([1.0, 3.0, 2.0])}, {"name": "b", "tok_s": None}]
    cols = [("config", lambda r: r["name"]), ("tok/s", lambda r: benchkit.fmt_spread(r["tok_s"], 2))]
    cond = benchkit.conditions(budget="1GiB")
    out = io.StringIO()
    benchkit.emit("demo", rows, cond, True, cols, notes={"trace": "1 2 3"}, out=out)
    doc = json.loads(out.getvalue())
    assert doc["schema"] == benchkit.SCHEMA and doc["tool"] == "demo" and doc["notes"] == {"trace": "1 2 3"}
    assert doc["rows"][0]["tok_s"] == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    out = io.StringIO()
    benchkit.emit("demo", rows, cond, False, cols, notes={"trace": "1 2 3"}, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0] == benchkit.summary_line(cond) and "trace: 1 2 3" in lines
    assert lines[-4:] == ["| config | tok/s |", "|---|---|", "| a | 2.00 (1.00-3.00) |", "| b | - |"]


def test_a_converted_tool_prints_the_shared_document(capsys):
    # cli_startup went through benchkit when the scripts were regrouped: its --json is the one
    # schema, its rows the spread every headline quotes.
    from benchmarks.time import cli_startup

    assert cli_startup.main(["--repeats", "1", "--args=--help", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == benchkit.SCHEMA and doc["tool"] == "cli_startup"
    assert doc["conditions"]["args"] == "--help" and doc["conditions"]["repeats"] == 1
    (row,) = doc["rows"]
    assert row["cpu_s"]["n"] == 1 and row["cpu_s"]["median"] > 0 and row["wall_s"]["median"] > 0


def test_run_conditions_carry_the_runs_flags_but_not_how_it_prints():
    import argparse

    args = argparse.Namespace(model=["demo"], tokens=32, rounds=3, before_src=None, json=True, child=False)
    cond = benchkit.run_conditions(args, cpu_capability="AVX512")
    assert (cond["model"], cond["tokens"], cond["rounds"], cond["cpu_capability"]) == (["demo"], 32, 3, "AVX512")
    assert "json" not in cond and "child" not in cond and cond["commit"]


def test_child_json_is_the_childs_last_line_and_a_failed_child_one_line(tmp_path):
    """The child halves of batch_decode.py and draft_decode.py: the JSON of the last stdout line,
    with whether a cgroup held the child; a child that fails stops the run naming what it ran."""
    out = benchkit.child_json("tool", [sys.executable, "-c", "print('progress'); print('{\"tok_s\": 2.5}')"], "0",
                              60, "B=4", tmp_path)
    assert out["tok_s"] == 2.5 and out["cgroup"] is False  # budget "0": no limit
    with pytest.raises(SystemExit) as exc:
        benchkit.child_json("tool", [sys.executable, "-c", "import sys; sys.exit('boom')"], "0", 60, "B=8", tmp_path)
    assert str(exc.value) == "tool: child failed (B=8, oom=False): boom"


def test_the_median_interval_holds_the_median_is_seeded_and_narrows_with_more_pairs():
    import random

    rng = random.Random(7)
    few = [rng.gauss(1.0, 0.2) for _ in range(12)]
    many = few * 8  # the same spread, eight times the pairs
    lo, hi = benchkit.median_interval(few)
    assert lo <= sorted(few)[len(few) // 2] <= hi and lo < hi
    assert benchkit.median_interval(few) == (lo, hi)  # seeded: the same band for the same values
    lo8, hi8 = benchkit.median_interval(many)
    assert hi8 - lo8 < (hi - lo) * 0.7
    assert benchkit.median_interval([0.9, 0.9, 0.9]) == (0.9, 0.9)
    assert benchkit.median_interval([1.0]) is None and benchkit.median_interval([None, 2.0]) is None
    assert benchkit.fmt_interval((0.91234, 1.0)) == "0.912-1.000" and benchkit.fmt_interval(None) == "-"
