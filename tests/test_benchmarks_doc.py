"""docs/BENCHMARKS.md's current figures cite only what a clean clone has: tools that exist, no paths outside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RETIRED = {"benchmarks/mmap_cold.py", "benchmarks/syscall_counts.py", "benchmarks/token_breakdown.py"}  # cited with the commit that has them


def _parts() -> tuple[str, str]:
    """(the current figures, History)."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert text.count("\n## History\n") == 1
    current, history = text.split("\n## History\n", 1)
    return current, history


def _current() -> str:
    return _parts()[0]


def test_every_topic_opens_with_its_headline_and_how_to_reproduce_it():
    topics = re.split(r"\n(?=## )", _current())[2:]  # past the title and "How to read this file"
    assert len(topics) >= 10
    for topic in topics:
        opening = topic.split("\n### ", 1)[0]  # the text before the topic's first table section
        title = topic.splitlines()[0]
        assert "**Headline" in opening, f"{title}: no headline before its tables"
        assert re.search(r"[Rr]eproduce", opening) and "`" in opening, f"{title}: no command that reproduces it"


def test_history_is_the_last_section_and_holds_only_dated_entries():
    # New figures go into their topic as a ### subsection, never after History: a top-level
    # section there is outside every topic, so no headline ever points at it.
    history = _parts()[1]
    top = [line for line in history.splitlines() if line.startswith("## ")]
    assert not top, f"top-level sections after History (fold them into their topics): {top}"
    for line in history.splitlines():
        if line.startswith("### "):
            assert re.match(r"### \d{4}-\d{2}-\d{2}\b", line), f"History entry without its date: {line}"


def test_every_tool_the_current_figures_cite_exists():
    cited = set(re.findall(r"benchmarks/[a-z_0-9]+\.(?:py|json)", _current()))
    assert cited, "the current sections cite their tools"
    missing = {c for c in cited - RETIRED if not (ROOT / c).is_file()}
    assert not missing, f"cited but not in the repository: {sorted(missing)}"
    for retired in RETIRED & cited:
        for line in _current().splitlines():
            if retired in line:
                assert "retired" in line and "e927092" in line, line


def test_current_commands_use_no_paths_outside_the_clone():
    # /work/shared/notes/ANCHORS.md is named once as where the quoted published figures come from.
    outside = [line for line in _current().splitlines()
               if re.search(r"(/work/(?!shared/notes/ANCHORS)|/tmp/|~/\.cache/colibri/models)", line)]
    assert not outside, outside
