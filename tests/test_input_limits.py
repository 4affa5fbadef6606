"""Bounded inputs (issue 23, item 2) and output hygiene (item 6): every reader of a user file
goes through engine/base/inputs.py, so a FIFO, device, directory or socket is named and never
blocks, a size cap holds per kind, bad UTF-8 is one line; the JSON nesting guard's memory does
not grow with string length; names from files are printed with control characters escaped.

The cases that used to hang or eat the machine run as subprocesses under a timeout and an
address-space limit, so a regression fails the test instead of taking the box down.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from colibri_tiny import make_tiny
from engine.base.config import EngineConfig
from engine.base.errors import ColibriError, ConfigError, ModelFormatError, PromptError
from engine.base.inputs import LIMITS, open_input, printable, read_input, read_text_input
from engine.base.jsonlimits import load_json_input, loads_limited, nesting_depth_exceeds
from engine.format.checkpoint import Checkpoint
from engine.run.generate import load_tokenizer
from report_fixture import hardware_profile, make_run
from colibri import cli
from tuner.probe.probe_errors import ProfileError
from tuner.probe.hardware_profile import load_profile, save_profile

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("inputs") / "tiny")


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory) -> Path:
    return save_profile(hardware_profile(), tmp_path_factory.mktemp("prof") / "profile.json")


def colibri(args: list[str], timeout: float = 120, address_space: int = 6 * GiB) -> subprocess.CompletedProcess:
    """The CLI in a child process with a wall-clock timeout and RLIMIT_AS: a hang or a blow-up
    fails the test (TimeoutExpired / MemoryError exit) instead of the machine."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.run([sys.executable, "-m", "colibri.cli", *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit, env=env, cwd=ROOT)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


# --- the helper -------------------------------------------------------------------------------

def test_fifo_is_named_and_never_blocks(fifo):
    # No writer ever opens this FIFO: a blocking open() would hang the test here.
    with pytest.raises(ConfigError, match=r"pipe.json: is a FIFO \(named pipe\), not a regular file"):
        read_input(fifo, "profile", ConfigError)


def test_directory_device_and_socket_are_named(tmp_path):
    with pytest.raises(ColibriError, match="is a directory, not a regular file"):
        read_input(tmp_path, "geometry")
    with pytest.raises(ColibriError, match="is a character device, not a regular file"):
        read_input("/dev/zero", "text corpus")
    sock_path = tmp_path / "s.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(sock_path))
        with pytest.raises(ColibriError, match="is a socket, not a regular file"):
            open_input(sock_path, "profile")


def test_missing_file_and_symlink_loop_are_one_line(tmp_path):
    with pytest.raises(ColibriError, match="absent.json: no such file"):
        read_input(tmp_path / "absent.json", "profile")
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(ColibriError, match="loop: cannot read profile"):
        read_input(loop, "profile")


def test_size_cap_per_kind_is_checked_before_reading(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as f:  # sparse: the cap must fire on the size, not after reading 2 MiB
        f.truncate(LIMITS["profile"] + 1)
    with pytest.raises(ColibriError, match=f"{LIMITS['profile'] + 1} bytes is over the "
                                           f"{LIMITS['profile']}-byte limit for a profile"):
        read_input(big, "profile")
    assert read_input(big, "text corpus") == b"\0" * (LIMITS["profile"] + 1)  # a corpus may be larger


def test_strict_utf8_names_the_offset(tmp_path):
    bad = tmp_path / "corpus.txt"
    bad.write_bytes("héllo".encode() + b"\xff tail")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(invalid byte 0xff at offset 6\)"):
        read_text_input(bad, "text corpus", ConfigError)


# --- the readers use it -----------------------------------------------------------------------

def test_config_json_fifo_in_a_model_directory(tmp_path, tiny):
    model = tmp_path / "m"
    model.mkdir()
    for f in tiny.iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    with pytest.raises(ModelFormatError, match="config.json: is a FIFO"):
        Checkpoint(model)


def test_safetensors_shard_that_is_a_directory(tmp_path, tiny):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_bytes((tiny / "config.json").read_bytes())
    (model / "model.safetensors").mkdir()
    with pytest.raises(ModelFormatError, match="model.safetensors: is a directory"):
        Checkpoint(model)


def test_tokenizer_json_fifo_is_a_prompt_error(tmp_path):
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(PromptError, match="tokenizer.json: is a FIFO"):
        load_tokenizer(tmp_path)


def test_engine_config_toml_fifo_and_size(tmp_path, fifo):
    with pytest.raises(ConfigError, match="is a FIFO"):
        EngineConfig.load(fifo)
    big = tmp_path / "big.toml"
    big.write_text("# pad\n" * (LIMITS["engine config"] // 6 + 1))
    with pytest.raises(ConfigError, match="limit for a engine config"):
        EngineConfig.load(big)


def test_profile_loader_fifo_and_size(tmp_path, fifo):
    with pytest.raises(ProfileError, match="is a FIFO"):
        load_profile(fifo)
    big = tmp_path / "big.json"
    big.write_text('{"pad": "' + "x" * (50 << 20) + '"}')  # the 50 MB profile plan used to parse
    with pytest.raises(ProfileError, match="over the 1048576-byte limit for a profile"):
        load_profile(big)


def test_run_dir_trials_csv_binary_and_fifo(tmp_path):
    from tuner.results.rundir import RunDirError, read_trials_csv
    binary = tmp_path / "trials.csv"
    binary.write_bytes(b"number,status\n1,ok\n\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(RunDirError, match="not UTF-8 text"):
        read_trials_csv(binary)
    binary.write_bytes(b"number,status\n1,o\x00k\n")
    with pytest.raises(RunDirError, match="NUL bytes"):
        read_trials_csv(binary)
    os.mkfifo(tmp_path / "fifo.csv")
    with pytest.raises(RunDirError, match="is a FIFO"):
        read_trials_csv(tmp_path / "fifo.csv")


def test_binary_trials_csv_in_compare_and_profile_export(tmp_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", speed=2.0)
    (a / "trials.csv").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trials.csv" in err[0] and "not UTF-8 text" in err[0]
    assert cli.main(["profile", "export", str(a), "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not UTF-8 text" in err[0]
    assert not (tmp_path / "p.json").exists()


# --- the CLI cases of the issue, in a child under limits -----------------------------------------

def test_plan_profile_fifo_and_dev_zero(tmp_path, fifo):
    line = one_error_line(colibri(["plan", "--model", "tiny", "--profile", str(fifo)], timeout=60))
    assert "is a FIFO" in line
    line = one_error_line(colibri(["plan", "--model", "tiny", "--profile", "/dev/zero"], timeout=60))
    assert "/dev/zero: is a character device" in line


def test_profile_import_fifo(tmp_path, fifo):
    env_home = tmp_path / "xdg"
    os.environ["XDG_CONFIG_HOME"] = str(env_home)
    try:
        line = one_error_line(colibri(["profile", "import", str(fifo)], timeout=60))
    finally:
        del os.environ["XDG_CONFIG_HOME"]
    assert "is a FIFO" in line and not (env_home / "colibri" / "profiles").exists()


def test_quality_text_dev_zero(tiny):
    proc = colibri(["quality", "--model", str(tiny), "--reference", str(tiny), "--text", "/dev/zero",
                    "--tokens", "16", "--ctx", "8"], timeout=120)
    assert "/dev/zero: is a character device" in one_error_line(proc)


# --- the JSON nesting guard ------------------------------------------------------------------------

GUARD_PEAK = r"""
import resource, sys
from engine.base.jsonlimits import nesting_depth_exceeds
kind, n = sys.argv[1], int(sys.argv[2])
body = {"plain": "a" * n, "escapes": "\\n" * (n // 2), "brackets": "[{" * (n // 2)}[kind]
text = '{"description": "' + body + '", "layers": [[1]]}'
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert not nesting_depth_exceeds(text, 3)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.parametrize("kind", ["plain", "escapes", "brackets"])
def test_json_guard_peak_memory_on_a_50mb_string(kind):
    """The guard's extra peak on a 50 MB string stays under 16 MiB (it was ~120 bytes per
    character, 6 GB; RLIMIT_AS turns a regression into a failure here, not an OOM)."""
    n = 50_000_000
    limit = 2 * GiB
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", GUARD_PEAK, kind, str(n)], capture_output=True, text=True,
                          timeout=120, env=env,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert proc.returncode == 0, proc.stderr[-1000:]
    assert int(proc.stdout) < 16 << 20


def test_json_guard_still_counts_only_brackets_outside_strings():
    assert nesting_depth_exceeds("[" * 65 + "]" * 65, 64)
    assert not nesting_depth_exceeds('["' + "[" * 1000 + '"]', 2)
    assert not nesting_depth_exceeds(r'["a \" [[[[ b", "\\"]', 1)
    assert nesting_depth_exceeds(r'["\\", [[1]]]', 2)  # an escaped backslash ends the string
    with pytest.raises(ModelFormatError, match="nested deeper than 64"):
        loads_limited("[" * 100_000, "bomb")


def test_duplicate_keys_and_nan_are_refused_where_asked():
    with pytest.raises(ModelFormatError, match="duplicate key 'a'"):
        loads_limited('{"a": 1, "a": 2}', "x", unique_keys=True)
    with pytest.raises(ModelFormatError, match="NaN is not valid JSON"):
        loads_limited('{"a": NaN}', "x", finite=True)
    assert loads_limited('{"a": 1, "a": 2}', "x") == {"a": 2}  # config.json keeps json's rule


def test_load_json_input_caps_by_kind(tmp_path):
    geometry = tmp_path / "g.json"
    geometry.write_text(json.dumps({"description": "x" * (LIMITS["geometry"] + 1)}))
    with pytest.raises(ConfigError, match="limit for a geometry"):
        load_json_input(geometry, "geometry", error=ConfigError)


# --- output hygiene ----------------------------------------------------------------------------

def test_printable_escapes_controls_and_bidi():
    assert printable("a\x1b[2Jb") == "a\\x1b[2Jb"
    assert printable("x\u202eevil") == "x\\u202eevil"
    assert printable("ok name-1.2") == "ok name-1.2"
    assert printable("é中") == "é中"
    assert printable("n" * 500, limit=10).startswith("n" * 10 + "...(490 more")


def test_compare_refusal_escapes_a_model_names_terminal_sequences(tmp_path, capsys):
    a = make_run(tmp_path / "a", model_name="evil\x1b[2J\x1b]0;pwned\x07")
    b = make_run(tmp_path / "b", model_name="tiny")
    capsys.readouterr()
    assert cli.main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "evil\\x1b[2J\\x1b]0;pwned\\x07" in err and len(err.strip().splitlines()) == 1

