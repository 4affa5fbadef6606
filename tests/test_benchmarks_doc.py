"""docs/BENCHMARKS.md's current figures cite only what a clean clone has: tools that exist, no paths outside it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RETIRED = {"benchmarks/mmap_cold.py", "benchmarks/syscall_counts.py", "benchmarks/token_breakdown.py"}  # cited with the commit that has them


def _current() -> str:
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert "\n## History\n" in text and text.rstrip().count("\n## Added this session\n") == 1
    return text.split("\n## History\n", 1)[0]


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
