"""docs/BENCHMARKS.md is a guide: a headline table whose rows say what was measured, when, at which
commit and how to reproduce it, one section per question that opens with its headline, only tools a
clean clone has; docs/benchmarks-history.md holds what was superseded, dated, oldest first."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks-history.md"
RETIRED = {"benchmarks/mmap_cold.py", "benchmarks/syscall_counts.py", "benchmarks/token_breakdown.py"}  # cited with the commit that has them
TOOL = re.compile(r"benchmarks/(?:[a-z_0-9]+/)*[A-Za-z_0-9]+\.(?:py|jsonl|json|toml|cpp)\b")
COLUMNS = ["question", "figure", "conditions", "date (UTC)", "commit", "reproduce"]


def _guide() -> str:
    return GUIDE.read_text(encoding="utf-8")


def _sections() -> dict[str, str]:
    """{"## title": its text} of the guide's top-level sections, in order."""
    parts = re.split(r"\n(?=## )", _guide())[1:]
    return {p.splitlines()[0]: p for p in parts}


def _headline_rows() -> list[dict]:
    table = [line for line in _sections()["## Headline figures"].splitlines() if line.startswith("|")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header == COLUMNS
    rows = []
    for line in table[2:]:
        # A cell never holds a bare `|` (commands in the table are written without pipes).
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def _questions() -> dict[str, str]:
    """The sections past the headline table and "How to read this file": one per question."""
    return {t: body for t, body in _sections().items()
            if t not in ("## Headline figures", "## How to read this file")}


def test_the_guide_opens_with_the_headline_table_and_has_no_history_inside():
    titles = list(_sections())
    assert titles[:2] == ["## Headline figures", "## How to read this file"]
    assert "## History" not in titles, "superseded figures belong in docs/benchmarks-history.md"


def test_every_headline_row_is_dated_pinned_to_a_commit_and_reproducible():
    rows = _headline_rows()
    assert len(rows) >= 10
    for row in rows:
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", row["date (UTC)"]), row
        assert re.search(r"\b[0-9a-f]{7,40}\b", row["commit"]), row
        assert re.search(r"`[^`]+`", row["reproduce"]), f"{row['question']}: no command"
        assert row["figure"] and row["conditions"], row


def test_every_headline_figure_is_quoted_in_the_sections_below():
    # The table summarises the sections: a bold figure in a row that no section quotes is a figure
    # nobody can trace to its measurement.
    body = "\n".join(_questions().values())
    for row in _headline_rows():
        for bold in re.findall(r"\*\*(.+?)\*\*", row["figure"]):
            for number in re.findall(r"\d+(?:\.\d+)?(?:e-\d+)?[x%]?", bold):
                assert number in body, f"{row['question']}: {number} is in the table but in no section"


def test_every_question_opens_with_its_headline_and_how_to_reproduce_it():
    questions = _questions()
    assert len(questions) >= 10
    for title, text in questions.items():
        opening = text.split("\n### ", 1)[0]  # the text before the section's first measured subsection
        assert "**Headline" in opening, f"{title}: no headline before its tables"
        assert re.search(r"[Rr]eproduce", opening) and "`" in opening, f"{title}: no command that reproduces it"


def test_history_holds_only_dated_entries_oldest_first():
    text = HISTORY.read_text(encoding="utf-8")
    assert not [line for line in text.splitlines() if line.startswith("## ")], "the history is one list of entries"
    dates = []
    for line in text.splitlines():
        if line.startswith("### "):
            m = re.match(r"### (\d{4}-\d{2}-\d{2})\b", line)
            assert m, f"history entry without its date: {line}"
            dates.append(m.group(1))
    assert len(dates) >= 20 and dates == sorted(dates)


def test_every_tool_the_guide_cites_exists():
    cited = set(TOOL.findall(_guide()))
    assert cited, "the sections cite their tools"
    missing = {c for c in cited - RETIRED if not (ROOT / c).is_file()}
    assert not missing, f"cited but not in the repository: {sorted(missing)}"
    for retired in RETIRED & cited:
        for line in _guide().splitlines():
            if retired in line:
                assert "retired" in line and "e927092" in line, line


def test_every_benchmark_script_is_in_the_benchmarks_readme():
    # benchmarks/README.md is the questions -> scripts map: a script it does not list in its
    # folder's row is one a reader cannot find by its question.
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    rows = {m.group(1): line for line in readme.splitlines() if (m := re.match(r"\|[^|]+\| `(\w+)/` \|", line))}
    assert len(rows) >= 7, "one row per question"
    unlisted = []
    for p in sorted((ROOT / "benchmarks").rglob("*")):
        rel = p.relative_to(ROOT / "benchmarks")
        if p.suffix not in (".py", ".cpp", ".json", ".toml") or "__pycache__" in rel.parts:
            continue
        if len(rel.parts) == 1:  # the shared modules, named under the table
            listed = f"`{rel.name}`" in readme
        else:
            listed = f"`{rel.name}`" in rows.get(rel.parts[0], "")
        if not listed:
            unlisted.append(rel.as_posix())
    assert not unlisted, unlisted


def test_current_commands_use_no_paths_outside_the_clone():
    # /work/shared/notes/ANCHORS.md is named once as where the quoted published figures come from.
    outside = [line for line in _guide().splitlines()
               if re.search(r"(/work/(?!shared/notes/ANCHORS)|/tmp/|~/\.cache/colibri/models)", line)]
    assert not outside, outside
