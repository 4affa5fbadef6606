"""Every repository path named in a comment, a docstring or a doc exists, so the docs cannot drift
from the tree (issue 38: 16 comment lines cited 10 paths that had moved away).

What counts as a path: a token that starts with one of the repository's top-level directories
and a `/` (`engine/run/bench.py`, `tuner/search/`, `benchmarks/io/io_bound.py`), read up to the
first character that cannot be part of a file name here (space, backquote, `:` as in
`engine/run/bench.py:main`, a closing bracket). It exists when it names a file or a directory, a
module without its `.py` (`engine/run/bench`) or a module's attribute (`engine/arch/args.dense_tensors`).
A token preceded by `/`, `.` or a word character is not one (`../engine/...` is outside the clone,
`github.com/o/engine/...` is a URL, `colibri.bench/1` a schema id). Placeholders are checked up to
the directory before them, which must exist: `reports/<run>`, a glob (`engine/native/*.cpp`), an
elision (`reports/tune-demo-.../report.html`), a name in capitals (`benchmarks/TOOL.py`,
`tests/FILE.py`). Under reports/ only the directory itself is checked: what lies there is what a
user's runs write (`reports/mybox`), never part of the clone.

Where it looks: comments and docstrings of the Python sources, comments of the shell scripts and
of the native sources, and the whole text of README.md and docs/*.md. Not in
docs/benchmarks-history.md: its entries are dated and name paths as they were then (the commit
each names has them).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository's top-level directories: a token must start with one of these to be a path.
TOP = ("benchmarks", "colibri", "docs", "engine", "profiles", "reports", "scripts", "tests", "tuner")
CODE_DIRS = ("engine", "tuner", "colibri", "benchmarks", "tests", "scripts")
HISTORY = {"docs/benchmarks-history.md"}  # dated entries: paths as they were, at the commit each names
# (where the path is named, the path) for a name that is meant not to exist in the clone, each with
# its reason. Empty today: the retired tools are cited only in the history file, and placeholders
# are recognised by form (above), not listed.
ALLOWED: set[tuple[str, str]] = set()

CAPITALS = re.compile(r"(?<=/)[A-Z][A-Z_]+(?=[./]|$)")  # a metavariable component: TOOL, FILE, RUN
PATH = re.compile(r"(?<![\w./\-])((?:" + "|".join(TOP) + r")/[^\s`'\"()\[\]{}<>,;:|*?]*)")


def paths_in(text: str) -> list[tuple[str, bool]]:
    """The path tokens of `text`: (token, whether a placeholder or glob follows it)."""
    out = []
    for m in PATH.finditer(text):
        token = m.group(1).rstrip(".")  # a sentence's full stop is not part of the name
        follows = text[m.end():m.end() + 1]
        placeholder = follows in ("<", "*", "{") or "..." in token or token.startswith("reports/")
        if placeholder and "..." in token:
            token = token.split("...", 1)[0]
        if CAPITALS.search(token):  # `benchmarks/TOOL.py`: the name stands for any tool
            token, placeholder = token[:CAPITALS.search(token).start()], True
        out.append((token, placeholder))
    return out


def exists(token: str, pattern: bool) -> bool:
    if pattern:  # `reports/<run>`, `engine/native/*.cpp`: the directory before the placeholder
        return (ROOT / token.rsplit("/", 1)[0]).is_dir()
    path = ROOT / token.rstrip("/")
    if path.exists() or path.with_name(path.name + ".py").is_file():
        return True
    module, dot, _attribute = path.name.rpartition(".")  # `engine/arch/args.dense_tensors`
    return bool(dot) and path.with_name(module + ".py").is_file()


def python_notes(source: str) -> str:
    """The comments and docstrings of a Python source, one after another."""
    parts = [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def line_comments(source: str, marker: str) -> str:
    """The comments of a shell (#) or C++ (//, and /* */ blocks) source."""
    if marker == "//":
        blocks = re.findall(r"/\*.*?\*/", source, flags=re.S)
        return "\n".join(blocks + [line.split("//", 1)[1] for line in source.splitlines() if "//" in line])
    return "\n".join(line.split("#", 1)[1] for line in source.splitlines() if "#" in line)


def notes_by_file() -> dict[str, str]:
    """{repository path: the text of it that names paths for a reader}."""
    notes = {}
    for top in CODE_DIRS:
        for f in sorted((ROOT / top).rglob("*")):
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or "/fixtures/" in rel or not f.is_file():
                continue
            if f.suffix == ".py":
                notes[rel] = python_notes(f.read_text(encoding="utf-8"))
            elif f.suffix == ".sh":
                notes[rel] = line_comments(f.read_text(encoding="utf-8"), "#")
            elif f.suffix in (".cpp", ".h"):
                notes[rel] = line_comments(f.read_text(encoding="utf-8"), "//")
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        rel = doc.relative_to(ROOT).as_posix()
        if rel not in HISTORY:
            notes[rel] = doc.read_text(encoding="utf-8")
    return notes


def test_the_top_level_directories_are_the_repositorys():
    # The path pattern is built from TOP: a directory added at the top or renamed must be named here.
    actual = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
              and not p.name.endswith(".egg-info") and p.name not in ("build", "dist", "node_modules")}
    assert set(TOP) <= actual, sorted(set(TOP) - actual)


def test_paths_in_text_are_read_as_a_reader_would():
    found = paths_in("see engine/run/bench.py:main, `tuner/search/` and reports/<run>/trials.jsonl. "
                     "Not ../engine/x.py, github.com/o/engine/y, colibri.bench/1; benchmarks/io/io_bound.py, "
                     "benchmarks/TOOL.py, scripts/render_report.py reports/tune-demo-.../report.html.")
    assert found == [("engine/run/bench.py", False), ("tuner/search/", False), ("reports/", True),
                     ("benchmarks/io/io_bound.py", False), ("benchmarks/", True),
                     ("scripts/render_report.py", False), ("reports/tune-demo-", True)]
    assert exists("engine/run/bench.py", False) and exists("tuner/search/", False)
    assert exists("engine/run/bench", False)  # a module named without .py
    assert exists("engine/arch/args.dense_tensors", False)  # a module's attribute
    assert not exists("engine/arch/nowhere.dense_tensors", False)
    assert not exists("engine/kvquant.py", False)  # one of the paths issue 38 found stale
    assert exists("reports/", True) and not exists("nowhere/", True)


def test_comments_docstrings_and_docs_name_only_paths_that_exist():
    missing = []
    for rel, text in notes_by_file().items():
        for token, pattern in paths_in(text):
            if (rel, token) not in ALLOWED and not exists(token, pattern):
                missing.append(f"{rel}: {token}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(sorted(set(missing)))


def test_the_allowlist_holds_only_names_still_cited():
    # An entry for a name no longer cited would silently allow it back; keep the list tight.
    notes = notes_by_file()
    stale = [entry for entry in ALLOWED if entry[1] not in {t for t, _ in paths_in(notes.get(entry[0], ""))}]
    assert not stale, stale
