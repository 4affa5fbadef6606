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
