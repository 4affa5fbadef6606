"""CLI values (issue 23, item 4): every numeric flag is parsed by a ranged type from
colibri/commands/argtypes.py; a value outside its range, NaN or Inf is one line and exit 2, before
anything runs."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from pathlib import Path

import pytest

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from tests.test_probe_profile import make_profile
from colibri.cli import build_parser, main
from colibri.commands import argtypes
from tuner.probe.hardware_profile import save_profile


def cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as exc:  # argparse refuses by exiting
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def subparsers(parser) -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command parser by its prog: 'colibri run', 'colibri profile import', ..."""
    found = {}
    for action in parser._actions:  # argparse offers no public walk of its subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found[sub.prog] = sub
                found.update(subparsers(sub))
    return found


# Flags whose value is a number (or a size / duration) although their default is None.
NUMERIC_DESTS = {"ram_budget", "chunk_size", "cgroup_limit", "budget", "time_budget", "timeout", "trial_timeout",
                 "routing_skew"}


def test_every_numeric_flag_has_a_ranged_type():
    unranged = []
    for prog, sub in subparsers(build_parser()).items():
        for action in sub._actions:
            numeric = action.type in (int, float) or isinstance(action.default, (int, float)) and not isinstance(
                action.default, bool) or action.dest in NUMERIC_DESTS
            if numeric and not hasattr(action.type, "range_text") and action.choices is None:
                unranged.append(f"{prog} {action.option_strings}")
    assert not unranged, unranged


# The examples issue 23 lists, and their neighbours: each is refused while parsing.
REFUSED = [
    (["run", "--model", "m", "--temperature", "nan"], "--temperature"),
    (["run", "--model", "m", "--temperature", "inf"], "--temperature"),
    (["run", "--model", "m", "--temperature", "-inf"], "--temperature"),
    (["run", "--model", "m", "--temperature", "1e-30"], "--temperature"),
    (["run", "--model", "m", "--top-p", "0"], "--top-p"),
    (["run", "--model", "m", "--top-p", "nan"], "--top-p"),
    (["run", "--model", "m", "--seed", str(2**70)], "--seed"),
    (["run", "--model", "m", "--seed", "-1"], "--seed"),
    (["run", "--model", "m", "--max-new-tokens", "-1"], "--max-new-tokens"),
    (["run", "--model", "m", "--prompt-tokens", "0"], "--prompt-tokens"),
    (["run", "--model", "m", "--ctx-size", "9" * 5000], "--ctx-size"),
    (["run", "--model", "m", "--cpu-cache-ratio", "nan"], "--cpu-cache-ratio"),
    (["run", "--model", "m", "--ram-budget", "-1GiB"], "must be positive"),
    (["run", "--model", "m", "--ram-budget=-1GiB"], "must be positive"),
    (["run", "--model", "m", "--ram-budget", "1e400G"], "--ram-budget"),
    (["run", "--model", "m", "--chunk-size", "1"], "--chunk-size"),
    (["bench", "--model", "m", "--tokens", "0"], "--tokens"),
    (["bench", "--model", "m", "--repeats", "-2"], "--repeats"),
    (["bench", "--model", "m", "--timeout", "-1"], "--timeout"),
    (["bench", "--model", "m", "--timeout", "nan"], "--timeout"),
    (["bench", "--model", "m", "--cgroup-limit", "-1GiB"], "must be positive"),
    (["convert", "src", "-o", "dst", "--threads", "-3"], "--threads"),
    (["quality", "--model", "a", "--reference", "b", "--ctx", "2"], "--ctx"),
    (["synth", "tiny", "-o", "x", "--routing-skew", "nan"], "--routing-skew"),
    (["synth", "tiny", "-o", "x", "--seed", "-5"], "--seed"),
    (["tune", "--trial-timeout", "nan"], "--trial-timeout"),
    (["tune", "--time-budget", "-10m"], "must be positive"),
    (["tune", "--time-budget", "9" * 400], "--time-budget"),
    (["tune", "--ram-budget", "0"], "--ram-budget"),
    (["tune", "--trials", "0"], "--trials"),
    (["tune", "--confirm-top", "-1"], "--confirm-top"),
    (["tune", "--seed", str(argtypes.SEED_MAX)], "--seed"),
    (["plan", "--model", "m", "--profile", "p", "--budget", "-1GiB"], "must be positive"),
    (["plan", "--model", "m", "--profile", "p", "--top", "0"], "--top"),
    # argparse (3.11) stores [] for a value of `--` without calling the type (found by the fuzzer)
    (["bench", "--model", "m", "--tokens=--"], "--tokens: needs a value"),
    (["run", "--model=--"], "--model: needs a value"),
    (["plan", "--model", "m", "--profile", "p", "--what-if=--"], "--what-if: needs a value"),
]


@pytest.mark.parametrize("argv,needle", REFUSED, ids=[" ".join(a)[:60] for a, _ in REFUSED])
def test_bad_values_are_one_line_and_exit_2(argv, needle):
    code, out, err = cli(*argv)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"colibri {argv[0]}: error: argument ") and needle in lines[0], err
    assert "Traceback" not in err and "expected one argument" not in err


def test_good_values_parse_to_numbers():
    args = build_parser().parse_args(["run", "--model", "m", "--ram-budget", "1GiB", "--chunk-size", "1MiB",
                                      "--temperature", "0.7", "--top-p", "1", "--seed", str(argtypes.SEED_MAX)])
    assert (args.ram_budget, args.chunk_size, args.temperature, args.seed) == (1 << 30, 1 << 20, 0.7, 2**32 - 1)
    assert build_parser().parse_args(["run", "--model", "m", "--ram-budget", "0"]).ram_budget == 0
    tune = build_parser().parse_args(["tune", "--time-budget", "1h30m", "--trial-timeout", "90"])
    assert (tune.time_budget, tune.trial_timeout) == (5400.0, 90.0)


def _engine_flag_ranges():
    """(flag, EngineConfig field, lo, hi) of each ranged int/float engine flag of `run`."""
    sub = subparsers(build_parser())["colibri run"]
    for action in sub._actions:
        field = action.dest
        if field in EngineConfig.field_names() and hasattr(action.type, "range_text") and action.type.__name__ != "size":
            lo, hi = (float(x) for x in action.type.range_text.strip("in []").split(","))
            yield action.option_strings[0], field, lo, hi


@pytest.mark.parametrize("flag,field,lo,hi", list(_engine_flag_ranges()))
def test_engine_flag_ranges_agree_with_engine_config(flag, field, lo, hi):
    """The flag's range is EngineConfig.validate's: both ends accepted by both, one step beyond
    refused by both (a drift would refuse a valid config, or let the engine refuse it later)."""
    sub = subparsers(build_parser())["colibri run"]
    step = 1 if lo.is_integer() and hi.is_integer() and field not in ("cpu_cache_ratio", "gpu_cache_ratio") else 0.01
    cast = int if step == 1 else float
    for value in (lo, hi):
        parsed = getattr(sub.parse_args(["--model", "m", flag, str(cast(value))]), field)
        EngineConfig(**{field: parsed})
    for value in (lo - step, hi + step):
        code, _, err = cli("run", "--model", "m", flag, str(cast(value)))
        assert code == 2 and flag in err
        with pytest.raises(ConfigError):
            EngineConfig(**{field: cast(value)})


def test_output_file_refuses_what_cannot_be_written(tmp_path):
    """The output files of run/bench/probe go through engine/base/output_target.file_target (the
    one guard; argtypes.check_output_file was folded into it)."""
    from engine.base.output_target import file_target
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, needle in ((tmp_path, "a directory"), (fifo, "a FIFO"),
                         (tmp_path / "no" / "x.json", "not an existing directory"),
                         ("/proc/x", "cannot create files in /proc"), ("", "empty path")):
        with pytest.raises(ConfigError, match=needle):
            file_target(str(path), command="run", recognise=None, flag="--record-routing")
    file_target(str(tmp_path / "ok.json"), command="run", recognise=None, flag="--record-routing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]  # the probe file is gone


def test_record_routing_into_proc_is_refused_before_the_run(tmp_path):
    from colibri_tiny import RUN_ARGS, make_tiny
    model = make_tiny(tmp_path / "m")
    code, _, err = cli("run", "--model", model, *RUN_ARGS, "--record-routing", "/proc/x")
    assert code == 2 and err.count("\n") == 1 and "--record-routing /proc/x" in err, err
    code, _, err = cli("bench", "--model", model, "--tokens", "1", "--repeats", "1", "--timeout", "5")
    assert code == 2 and "--timeout goes with --cgroup-limit" in err


@pytest.mark.parametrize("argv,needle", [
    (["--what-if", "disk_scale=inf"], "--what-if"), (["--what-if", "disk_scale=nan"], "--what-if"),
    (["--what-if", "memory_bw=infGB/s"], "--what-if"), (["--what-if", "matmul_scale=0"], "--what-if"),
    (["--what-if", "cores=100000000"], "--what-if"), (["--routing", "skew:nan"], "--routing"),
    (["--routing", "skew:-1"], "--routing"), (["--routing", "skew:inf"], "--routing"),
])
def test_plan_what_if_and_routing_values_are_finite(argv, needle, tmp_path):
    save_profile(make_profile(), tmp_path / "p.json")
    code, _, err = cli("plan", "--model", "glm-5", "--profile", tmp_path / "p.json", *argv)
    assert code == 2 and err.count("\n") == 1 and needle in err, err
