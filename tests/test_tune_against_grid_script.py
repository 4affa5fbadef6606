"""benchmarks/tuning/tune_against_grid.py: a bad --geometry or a geometry without a measured grid is
one error line before anything is synthesized, tuned or measured; the warm-start minutes are the
cost model's trials (role "model") of the run's trials.csv; a re-run of the printed command counts
as the same measurement only with the same prompts, tokens and bytes per token. The tune and the
trials themselves are tests/test_tune*.py's; the end-to-end run is a benchmark (docs/BENCHMARKS.md)."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks.tuning import tune_against_grid as tag


def test_a_bad_geometry_or_a_missing_grid_is_one_error_line_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "out"
    assert tag.main(["--geometry", "no-budget", "--out", str(out)]) == 2
    assert tag.main(["--geometry", "engine/presets/tiny.json:400MiB", "--grids", str(tmp_path / "none"),
                     "--models", str(tmp_path / "models"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("tune_against_grid: error: ") for line in err)
    assert "FILE:BUDGET" in err[0] and "no grid for tiny" in err[1] and "tuner_unseen.py" in err[1]
    assert not (tmp_path / "models").exists() and not out.exists()


def test_warm_start_minutes_are_the_cost_models_trials_that_ran(tmp_path):
    (tmp_path / "trials.csv").write_text(
        "number,role,status,wall_seconds\n0,baseline,ok,90.0\n1,defaults,ok,60.0\n2,model,ok,30.0\n3,model,slow,90.0\n"
        "4,model,,\n5,,ok,45.0\n")
    assert tag.warm_start_minutes(tmp_path) == (3, 2, 2.0)
    assert tag.warm_text((3, 2, 2.0)) == "2 ran, 2.0 min (1 more enqueued)"
    assert tag.warm_start_minutes(tmp_path / "no-run") == (0, 0, 0.0)


def _result(nbytes=1000.0):
    rep = SimpleNamespace(workload_sha256="sha256:w", output_sha256="sha256:o", bytes_read_per_token=nbytes,
                          command="colibri bench")
    return SimpleNamespace(reproduce=rep)


def test_a_rerun_is_the_same_measurement_only_with_the_same_prompts_tokens_and_bytes():
    same = {"workload_sha256": "sha256:w", "output_sha256": "sha256:o", "bytes_read_per_token": 1000.0}
    assert tag.same_measure(_result(), [same, same]).startswith("yes")
    for key, other in (("workload_sha256", "sha256:x"), ("output_sha256", "sha256:x"), ("bytes_read_per_token", 900.0),
                       ("bytes_read_per_token", None)):
        assert tag.same_measure(_result(), [same, {**same, key: other}]).startswith("NO"), key
    # lookahead's reads move the bytes a little with timing: within the tolerance, and said
    near = tag.same_measure(_result(), [same, {**same, "bytes_read_per_token": 1004.0}])
    assert near.startswith("yes") and "within 0.40%" in near
