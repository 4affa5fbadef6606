"""colibri/cli.py builds the parser of the one command it runs (a `colibri bench` trial process then
imports only colibri/commands/run.py's libraries), and the whole parser for anything else."""

from __future__ import annotations

from colibri import cli


def _choices(parser) -> set[str]:
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return set(sub.choices)


def test_every_command_is_declared_by_its_module():
    assert _choices(cli.build_parser()) == set(cli.COMMANDS)
    for name in cli.COMMANDS:
        assert _choices(cli.build_parser(only=name)) == {name}


def test_a_known_command_parses_as_with_the_whole_parser():
    argv = ["bench", "--model", "tiny", "--tokens", "3", "--threads", "1", "--json"]
    alone = vars(cli.build_parser(only="bench").parse_args(argv))
    whole = vars(cli.build_parser().parse_args(argv))
    assert alone.keys() == whole.keys()
    assert {k: v for k, v in alone.items() if k != "func"} == {k: v for k, v in whole.items() if k != "func"}
    assert alone["func"] is whole["func"]


def test_anything_else_gets_every_command(capsys):
    assert cli.main(["bnech"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid choice: 'bnech'" in err[0]
    assert all(f"'{name}'" in err[0] for name in cli.COMMANDS)  # the refusal names every command
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"    {name} " in out for name in cli.COMMANDS)
    assert cli.main([]) == 2 and "required: COMMAND" in capsys.readouterr().err


def test_a_known_commands_own_errors_are_unchanged(capsys):
    assert cli.main(["bench", "--tokens", "zero"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["colibri bench: error: argument --tokens: 'zero': expected an integer in [1, 4194304] "
                   "(see colibri bench --help)"]


def test_a_trial_process_imports_no_table_or_study_libraries():
    """Every trial is a `colibri bench` process, and the memory plan charges its RSS as runtime
    overhead: pandas (~40 MiB, through the CSV printers) and optuna have no business there."""
    import subprocess
    import sys
    code = ("import sys; from colibri import cli; cli.build_parser(only='bench'); import colibri.commands.run; "
            "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "torch" in out and "engine" in out  # the bench's own imports did run
    assert not {"pandas", "optuna", "matplotlib", "sqlalchemy", "transformers"} & set(out)
