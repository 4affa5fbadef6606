"""Every `colibri ...` command line the README shows is one the CLI accepts.

The README's code blocks are what people paste first; an option renamed in the parser but not
in the README fails for them with "unrecognized arguments". Parsing only: nothing runs (the
parsers' types check values, not files)."""

import re
import shlex
from pathlib import Path

import pytest

from colibri.cli import COMMANDS, build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_command_lines() -> list[list[str]]:
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            for command in line.split("&&"):
                argv = shlex.split(command, comments=True)
                if argv and argv[-1] == "&":  # run in the background
                    argv = argv[:-1]
                if argv and Path(argv[0]).name == "colibri":
                    lines.append(argv[1:])
    return lines


def test_readme_shows_every_command():
    shown = {argv[0] for argv in readme_command_lines() if argv}
    # chat is reached from serve's section in prose; every other command has a line to paste
    assert set(COMMANDS) - shown <= {"chat"}, set(COMMANDS) - shown


@pytest.mark.parametrize("argv", readme_command_lines(), ids=lambda argv: " ".join(argv)[:60])
def test_readme_command_line_parses(argv, capsys):
    try:
        build_parser(argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"the README's `colibri {' '.join(argv)}` is refused: {capsys.readouterr().err.strip()}")
