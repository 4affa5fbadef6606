"""benchmarks/trees.py: a before/after benchmark runs each commit's own code, checked out from git."""

import subprocess
import sys

import pytest

from benchmarks import trees


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A two-commit repository whose `engine` package says which commit it is."""
    d = tmp_path_factory.mktemp("repo")
    git = lambda *a: subprocess.run(["git", "-C", str(d), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (d / "engine").mkdir()
    for which in ("first", "second"):
        (d / "engine" / "__init__.py").write_text(f"WHICH = {which!r}\n")
        git("add", "-A")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", which)
    return d


def _which(tree) -> str:
    out = subprocess.run([sys.executable, "-c", "import engine; print(engine.WHICH, engine.__file__)"],
                         cwd=tree, env=trees.tree_env(tree), capture_output=True, text=True, check=True)
    return out.stdout.strip()


def test_a_revision_is_checked_out_and_its_own_code_imported(repo):
    with trees.source_tree("HEAD~1", repo) as tree:
        which, path = _which(tree).split()
        assert which == "first" and path.startswith(str(tree))
    assert not tree.exists()  # the temporary worktree is gone
    listed = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert str(tree) not in listed  # and unregistered
    with trees.source_tree(str(repo), repo) as tree:  # a directory is used as it is
        assert tree == repo.resolve() and _which(tree).split()[0] == "second"


def test_neither_a_directory_nor_a_revision_is_refused(repo):
    with pytest.raises(SystemExit, match="neither a directory nor a revision"):
        with trees.source_tree("no-such-rev", repo):
            pass


@pytest.mark.parametrize("flags", [[], ["--paired", "--in-process"]])
def test_draft_decode_takes_a_before_tree_only_for_paired_processes(tmp_path, capsys, flags):
    """--before-src runs each drafting mode again in that tree's own children: only the paired processes
    (under a budget, or resident) have such children; elsewhere one clear error."""
    from benchmarks.time import draft_decode

    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--drafter", "lookup", "--budget", "362MiB", "--before-src", "HEAD", *flags]
    assert draft_decode.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draft_decode: error: --before-src")


@pytest.mark.parametrize("flags", [["--processes", "2"], ["--paired", "--in-process", "--processes", "2"],
                                   ["--paired", "--budget", "0", "--processes", "9"], ["--paired", "--processes", "9"]])
def test_draft_decode_takes_several_processes_only_for_paired_processes(tmp_path, capsys, flags):
    """--processes N runs the modes in N processes each: only the paired processes have them (under a
    budget, or resident), 1 to 8; elsewhere one clear error."""
    from benchmarks.time import draft_decode

    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--drafter", "lookup", "--budget", "362MiB", *flags]
    assert draft_decode.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draft_decode: error: --processes")


@pytest.mark.parametrize("flags", [["--runtime-overhead", "336MiB"], ["--paired", "--in-process", "--runtime-overhead", "1GiB"],
                                   ["--paired", "--budget", "0", "--runtime-overhead", "336MiB"],
                                   ["--paired", "--runtime-overhead", "lots"]])
def test_draft_decode_takes_a_runtime_overhead_only_for_paired_processes_under_a_budget(tmp_path, capsys, flags):
    """--runtime-overhead replaces the overhead a first off child measures, which only the paired processes
    under a budget have; a size that does not parse is named. Elsewhere one clear error."""
    from benchmarks.time import draft_decode

    (tmp_path / "config.json").write_text("{}")
    argv = ["--model", str(tmp_path), "--drafter", "lookup", "--budget", "362MiB", *flags]
    assert draft_decode.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("draft_decode: error: --runtime-overhead")
