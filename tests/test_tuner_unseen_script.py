"""benchmarks/tuning/tuner_unseen.py on benchkit: a bad --geometry is one error line before anything
is synthesized or measured; a run prints through benchkit's printers (the conditions line and the
table, or with --json one colibri.bench/1 document) and writes that same document to
--out/tuner_unseen.json. The grid is a made-up table here: the measurement is `colibri bench`
trials (tests/test_tune.py covers those); what is under test is the replay and the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

from benchmarks.benchkit import SCHEMA
from benchmarks.tuning import tuner_quality, tuner_unseen


def test_a_bad_geometry_is_one_error_line_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert tuner_unseen.main(["--geometry", str(tmp_path / "missing.json") + ":1GiB", "--out", str(out)]) == 2
    assert tuner_unseen.main(["--geometry", "no-budget", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("tuner_unseen: error: ") for line in err)
    assert "not found" in err[0] and "FILE:BUDGET" in err[1]
    assert not out.exists()


def _fake_run(monkeypatch, tmp_path):
    """synthesize, the model facts and the grid's trials replaced: each point's tok/s is its index."""
    keys = [tuner_quality.key_of(p) for p in tuner_quality.all_points()]
    table = {k: {"status": "ok", "decode_tok_s": float(i + 1)} for i, k in enumerate(keys)}
    monkeypatch.setattr(tuner_unseen, "synthesize", lambda geometry, model_dir, progress: None)
    monkeypatch.setattr(tuner_unseen, "ModelFacts", SimpleNamespace(read=lambda model_dir: None))
    monkeypatch.setattr(tuner_unseen, "steady_tokens", lambda facts, budget, overhead: (16, 4.0))
    monkeypatch.setattr(tuner_unseen, "measure_grid", lambda model_dir, budget, tokens, args, cache: table)
    return ["--geometry", "engine/presets/tiny.json:400MiB", "--trials", "4", "--seeds", "2", "--models",
            str(tmp_path / "models"), "--out", str(tmp_path / "out")]


def test_the_report_is_one_benchkit_document_on_stdout_and_in_the_run_directory(monkeypatch, tmp_path, capsys):
    argv = _fake_run(monkeypatch, tmp_path)
    assert tuner_unseen.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == SCHEMA and doc["tool"] == "tuner_unseen"
    (row,) = doc["rows"]
    assert row["geometry"] == "tiny" and row["tokens"] == 16 and row["points"] == len(tuner_quality.all_points())
    assert row["best"] == float(row["points"]) and row["evaluations"] == 4
    assert 0 < row["share_worst"] <= row["share_median"] <= 1
    assert doc["conditions"]["cold"] is True and doc["conditions"]["seeds"] == 2  # the run's flags are its conditions
    saved = json.loads((tmp_path / "out" / "tuner_unseen.json").read_text())
    assert saved["rows"] == doc["rows"] and saved["schema"] == SCHEMA


def test_the_text_report_is_the_conditions_line_and_the_table(monkeypatch, tmp_path, capsys):
    argv = _fake_run(monkeypatch, tmp_path)
    assert tuner_unseen.main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert "commit" in lines[0] and "seeds 2" in lines[0]
    header = next(i for i, line in enumerate(lines) if line.startswith("| geometry |"))
    assert lines[header + 1].startswith("|---") and lines[header + 2].startswith(f"| tiny | {tuner_unseen.format_size(400 << 20)} | 16 | 36 | 36 |")
