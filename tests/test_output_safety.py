"""Never destroy what we did not write (issue 23, item 1): every writing command's output target.

Each test names one rule of engine/base/output_target.py, drives the command as a user would (the CLI,
in process), and asserts three things: exit 2 with one line on stderr naming the problem, no
traceback, and the would-be victim (a sentinel file, or the source model's bytes) intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from colibri_readonly import make_read_only, undo_read_only
from engine import synth
from report_fixture import hardware_profile, make_run
from engine.format.convert import STATE_FILE
from colibri import cli

SENTINEL = "sentinel.txt"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synth.synthesize(synth.load_preset("tiny"), tmp_path_factory.mktemp("src") / "tiny", seed=0,
                            progress=False)


@pytest.fixture(scope="module")
def container(tiny, tmp_path_factory) -> Path:
    """A previous convert output (int8: the quickest to make)."""
    out = tmp_path_factory.mktemp("prev") / "tiny-int8"
    assert cli.main(["convert", str(tiny), "-o", str(out), "--quant", "int8", "--json"]) == 0
    return out


def digest(root: Path) -> dict[str, str]:
    """Every file under root → sha256 (what must survive a refused command unchanged)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def victim(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SENTINEL).write_text("not colibri's")
    return directory


def survives(directory: Path) -> bool:
    return (directory / SENTINEL).read_text() == "not colibri's"


def refused(argv: list[str], capsys, *words: str) -> str:
    """Run the CLI; it must exit 2 with one line naming the problem (each of `words` in it)."""
    capsys.readouterr()
    rc = cli.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"colibri {argv[0]}: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def convert_argv(src, dst, *extra) -> list[str]:
    return ["convert", str(src), "-o", str(dst), "--quant", "int8", "--json", *extra]


# --- convert: the cases issue 23 found ------------------------------------------------------------

def test_convert_empty_output_in_a_non_empty_cwd_is_refused(tiny, tmp_path, capsys, monkeypatch):
    cwd = victim(tmp_path / "work")
    monkeypatch.chdir(cwd)
    refused(convert_argv(tiny, "", "--force"), capsys, "empty path")
    assert survives(cwd) and sorted(os.listdir(cwd)) == [SENTINEL]


def test_convert_into_the_current_directory_is_refused(tiny, tmp_path, capsys, monkeypatch):
    cwd = tmp_path / "work"
    cwd.mkdir()  # even empty: the current directory is never an output
    monkeypatch.chdir(cwd)
    refused(convert_argv(tiny, ".", "--force"), capsys, "current directory")
    assert os.listdir(cwd) == []


def test_convert_onto_its_source_is_refused(tiny, capsys):
    before = digest(tiny)
    refused(convert_argv(tiny, tiny, "--force"), capsys, "is the source")
    assert digest(tiny) == before


def test_convert_inside_its_source_is_refused(tiny, capsys):
    before = digest(tiny)
    refused(convert_argv(tiny, tiny / "q", "--force"), capsys, "inside the source")
    assert digest(tiny) == before and not (tiny / "q").exists()
    assert not (tiny / "q.partial").exists() and not (tiny / ".q.lock").exists()


def test_convert_onto_an_ancestor_of_its_source_is_refused(tiny, tmp_path, capsys):
    parent = tmp_path / "models"
    src = parent / "tiny"
    shutil.copytree(tiny, src)
    victim(parent)
    before = digest(parent)
    refused(convert_argv(src, parent, "--force"), capsys, "contains the source")
    assert digest(parent) == before


def test_convert_onto_the_root_directory_is_refused(tiny, capsys):
    refused(convert_argv(tiny, "/", "--force"), capsys, "root directory")


def test_convert_onto_a_foreign_directory_is_refused_even_with_force(tiny, tmp_path, capsys):
    dst = victim(tmp_path / "mine")
    for extra in ([], ["--force"]):
        refused(convert_argv(tiny, dst, *extra), capsys, "not a previous `colibri convert` output")
        assert survives(dst) and os.listdir(dst) == [SENTINEL]
    assert sorted(os.listdir(tmp_path)) == ["mine"]


def test_convert_onto_a_synth_model_is_refused_even_with_force(tiny, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(tiny, other)  # a colibri output, but another command's
    before = digest(other)
    refused(convert_argv(tiny, other, "--force"), capsys, "not a previous `colibri convert` output")
    assert digest(other) == before


def test_force_replaces_only_a_previous_container(tiny, container, tmp_path, capsys):
    dst = tmp_path / "again"
    shutil.copytree(container, dst)
    next(dst.glob("*.safetensors")).unlink()  # a previous container missing a shard: still replaced whole
    before = digest(dst)
    refused(convert_argv(tiny, dst), capsys, "--force")  # without --force: kept
    assert digest(dst) == before
    assert cli.main(convert_argv(tiny, dst, "--force")) == 0
    assert digest(dst) == digest(container)
    assert sorted(os.listdir(tmp_path)) == ["again"]  # no .partial, .old or lock left


def test_force_keeps_a_previous_container_holding_a_users_file(tiny, container, tmp_path, capsys):
    """Issue 37: a file the user dropped into a previous output is not ours (the output's manifest
    does not list it): the output is not replaced, even with --force."""
    dst = tmp_path / "again"
    shutil.copytree(container, dst)
    (dst / "notes.txt").write_text("the user's")
    before = digest(dst)
    refused(convert_argv(tiny, dst, "--force"), capsys, "notes.txt", "did not write")
    assert digest(dst) == before


def test_convert_onto_a_file_is_refused(tiny, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.write_text("a file of the user's")
    refused(convert_argv(tiny, dst, "--force"), capsys, "not a directory")
    assert dst.read_text() == "a file of the user's"


def test_convert_onto_a_symlink_to_its_source_is_refused(tiny, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(tiny, target_is_directory=True)
    before = digest(tiny)
    refused(convert_argv(tiny, link, "--force"), capsys, "is the source")
    assert digest(tiny) == before and link.is_symlink()


def test_convert_onto_a_symlink_to_a_foreign_directory_is_refused(tiny, tmp_path, capsys):
    dst = victim(tmp_path / "elsewhere")
    link = tmp_path / "link"
    link.symlink_to(dst, target_is_directory=True)
    refused(convert_argv(tiny, link, "--force"), capsys, str(dst))  # named by what it resolves to
    assert survives(dst)


@contextlib.contextmanager
def read_only_directory(path: Path):
    """A directory nobody may create files in, root included (colibri_fuzz.make_read_only)."""
    path.mkdir()
    why_not = make_read_only(path)
    if why_not:
        pytest.skip(f"{why_not}: no directory is read-only to root here")
    try:
        yield path
    finally:
        undo_read_only(path)


def test_convert_into_a_read_only_directory_is_refused_up_front(tiny, tmp_path, capsys):
    with read_only_directory(tmp_path / "ro") as ro:
        line = refused(convert_argv(tiny, ro / "q"), capsys, str(ro))
        # os.access answers for the permission bits; as root the write probe finds the immutable flag
        assert "not writable" in line or "cannot create files" in line, line
        assert os.listdir(ro) == []


def test_convert_partial_that_is_a_file_is_refused(tiny, tmp_path, capsys):
    (tmp_path / "q.partial").write_text("the user's file")
    refused(convert_argv(tiny, tmp_path / "q"), capsys, "q.partial", "not an interrupted")
    assert (tmp_path / "q.partial").read_text() == "the user's file"
    assert not (tmp_path / "q").exists()


def test_convert_partial_holding_a_subdirectory_is_refused(tiny, tmp_path, capsys):
    partial = tmp_path / "q.partial"
    victim(partial / "sub")
    (partial / STATE_FILE).write_text(json.dumps({"options": {}, "shards": {}}))
    refused(convert_argv(tiny, tmp_path / "q"), capsys, "'sub'")
    assert survives(partial / "sub")


@pytest.mark.parametrize("state", [[], {"options": {}, "shards": []}, "text", None])
def test_convert_partial_with_a_state_of_the_wrong_shape_is_refused(tiny, tmp_path, capsys, state):
    partial = victim(tmp_path / "q.partial")
    (partial / STATE_FILE).write_text(json.dumps(state))
    before = digest(partial)
    refused(convert_argv(tiny, tmp_path / "q"), capsys, STATE_FILE)
    assert digest(partial) == before


def test_convert_partial_without_a_state_is_refused(tiny, tmp_path, capsys):
    partial = victim(tmp_path / "q.partial")
    refused(convert_argv(tiny, tmp_path / "q"), capsys, f"no {STATE_FILE}")
    assert survives(partial)


def test_convert_empty_partial_is_reused(tiny, container, tmp_path):
    (tmp_path / "q.partial").mkdir()  # what a run killed before its first state write could leave
    assert cli.main(convert_argv(tiny, tmp_path / "q")) == 0
    assert digest(tmp_path / "q") == digest(container)


# --- synth ------------------------------------------------------------------------------------------

def test_synth_empty_output_in_a_non_empty_cwd_is_refused(tmp_path, capsys, monkeypatch):
    cwd = victim(tmp_path / "work")
    monkeypatch.chdir(cwd)
    refused(["synth", "tiny", "-o", "", "--force", "--json"], capsys, "empty path")
    assert survives(cwd) and os.listdir(cwd) == [SENTINEL]


def test_synth_around_its_geometry_file_is_refused(tmp_path, capsys):
    d = victim(tmp_path / "specs")
    geometry = d / "g.json"
    geometry.write_text(json.dumps(synth.load_preset("tiny")))
    refused(["synth", "--geometry", str(geometry), "-o", str(d), "--force", "--json"], capsys, "contains the source")
    assert survives(d) and geometry.exists()


def test_synth_onto_a_container_is_refused_even_with_force(container, tmp_path, capsys):
    dst = tmp_path / "c"
    shutil.copytree(container, dst)
    before = digest(dst)
    refused(["synth", "tiny", "-o", str(dst), "--force", "--json"], capsys, "not a previous `colibri synth` output")
    assert digest(dst) == before


def test_synth_leaves_look_alike_siblings_alone(tmp_path):
    keep = victim(tmp_path / "m.partial-mine")  # not <out>.partial-<pid>: not synth's debris
    synth.synthesize(synth.load_preset("tiny"), tmp_path / "m", progress=False)
    assert survives(keep)


# --- compare --out ------------------------------------------------------------------------------------

@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    return [make_run(tmp_path / "slow"), make_run(tmp_path / "fast", speed=1.5,
                                                   profile=hardware_profile("Fast CPU", seq_gbps=3.6))]


def compare_argv(runs, out) -> list[str]:
    return ["compare", *map(str, runs), "--out", str(out), "--json"]


def test_compare_out_naming_an_existing_file_is_refused(two_runs, tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("the user's notes")
    refused(compare_argv(two_runs, out), capsys, "not a directory")
    assert out.read_text() == "the user's notes"


def test_compare_out_into_a_foreign_directory_is_refused(two_runs, tmp_path, capsys):
    out = victim(tmp_path / "docs")
    refused(compare_argv(two_runs, out), capsys, "not a previous `colibri compare` output")
    assert survives(out) and os.listdir(out) == [SENTINEL]


def test_compare_out_inside_or_onto_an_input_is_refused(two_runs, capsys):
    for out in (two_runs[0], two_runs[0] / "cmp", two_runs[0].parent):
        before = digest(two_runs[0])
        refused(compare_argv(two_runs, out), capsys, "source")
        assert digest(two_runs[0]) == before


def test_compare_replaces_its_previous_output_whole(two_runs, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert cli.main(compare_argv(two_runs, out)) == 0
    (out / "plots" / "stale.png").write_bytes(b"not written by compare")  # issue 37: not ours, kept
    refused(compare_argv(two_runs, out), capsys, "plots/stale.png")
    (out / "plots" / "stale.png").unlink()
    (out / "compare.md").unlink()
    assert cli.main(compare_argv(two_runs, out)) == 0
    assert (out / "compare.md").is_file() and (out / "compare.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".partial" in p.name or ".old" in p.name]


# --- probe -o, profile export -o, profile import ----------------------------------------------------

def test_probe_output_onto_a_foreign_file_is_refused_before_probing(tmp_path, capsys):
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": true}')
    refused(["probe", "--dir", str(tmp_path), "--no-fio", "-o", str(notes)], capsys, "refusing to overwrite")
    assert notes.read_text() == '{"mine": true}'
    assert sorted(os.listdir(tmp_path)) == ["notes.json"]  # not even the probe's test file


@pytest.mark.parametrize("make", ["dir", "fifo"])
def test_probe_output_onto_a_directory_or_fifo_is_refused(tmp_path, capsys, make):
    target = tmp_path / "t"
    if make == "dir":
        victim(target)
    else:
        os.mkfifo(target)
    refused(["probe", "--dir", str(tmp_path), "--no-fio", "-o", str(target)], capsys,
            "a directory" if make == "dir" else "a FIFO")
    assert survives(target) if make == "dir" else target.is_fifo()


def test_profile_export_onto_its_source_or_into_its_run_is_refused(two_runs, tmp_path, capsys):
    run = two_runs[0]
    before = digest(run)
    refused(["profile", "export", str(run), "-o", str(run / "profile.json")], capsys, "inside the source")
    exported = tmp_path / "box.json"
    assert cli.main(["profile", "export", str(run), "-o", str(exported)]) == 0
    probe = exported.read_bytes()
    refused(["profile", "export", str(exported), "-o", str(exported)], capsys, "is the source")
    assert digest(run) == before and exported.read_bytes() == probe


def test_profile_export_replaces_a_profile_but_not_another_file(two_runs, tmp_path, capsys):
    out = tmp_path / "box.json"
    assert cli.main(["profile", "export", str(two_runs[0]), "-o", str(out)]) == 0
    assert cli.main(["profile", "export", str(two_runs[1]), "-o", str(out)]) == 0  # a previous profile: replaced
    other = tmp_path / "config.json"
    other.write_text('{"not": "a profile"}')
    refused(["profile", "export", str(two_runs[0]), "-o", str(other)], capsys, "refusing to overwrite")
    assert other.read_text() == '{"not": "a profile"}'


def test_profile_import_force_never_replaces_a_directory(two_runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    exported = tmp_path / "box.json"
    assert cli.main(["profile", "export", str(two_runs[0]), "-o", str(exported)]) == 0
    squatter = victim(tmp_path / "cfg" / "colibri" / "profiles" / "box.json")
    refused(["profile", "import", str(exported), "--name", "box", "--force"], capsys, "a directory")
    assert survives(squatter)


# --- run / bench --record-routing -------------------------------------------------------------------

def run_argv(model, path) -> list[str]:
    return ["run", "--model", str(model), "--prompt-tokens", "4", "--max-new-tokens", "1", "--threads", "1",
            "--json", "--record-routing", str(path)]


@pytest.mark.parametrize("where,words", [("/proc/colibri-routing.json", "/proc"),
                                         ("dir", "a directory"), ("foreign", "refusing to overwrite")])
def test_record_routing_is_refused_before_the_run(tiny, tmp_path, capsys, where, words):
    if where == "dir":
        path = victim(tmp_path / "hist")
    elif where == "foreign":
        path = tmp_path / "notes.json"
        path.write_text('{"mine": 1}')
    else:
        path = Path(where)
    refused(run_argv(tiny, path), capsys, words)
    if where == "dir":
        assert survives(path)
    elif where == "foreign":
        assert path.read_text() == '{"mine": 1}'


def test_record_routing_replaces_its_own_histogram(tiny, tmp_path, capsys):
    path = tmp_path / "routing.json"
    for _ in range(2):  # the second run finds the first one's histogram: replaced
        assert cli.main(run_argv(tiny, path)) == 0
        assert json.loads(path.read_text())["counts"]
