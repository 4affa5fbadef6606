"""Prompts files, doctor and sizes (issue 37, item 5): every JSON Lines file through one bounded
reader (engine/base/jsonlimits.json_lines), `doctor` opening the model with run's loader so
"ready" means ready, and sizes below one byte refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from colibri_tiny import make_tiny
from engine.base.config import parse_size
from engine.base.errors import ConfigError, PromptError
from engine.run.prompts_file import load_requests, read_prompts
from colibri.cli import main

BENCH = ("--tokens", "1", "--repeats", "1", "--ctx-size", "64")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("values") / "tiny")


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, command: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"colibri {command}: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]


# --- prompts files -----------------------------------------------------------------------------

DEEP = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n"


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_a_prompt_line_nested_100k_deep_is_one_error_line(tiny, tmp_path, capsys, command):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "a"}\n' + DEEP)
    argv = (["bench", "--model", tiny, *BENCH] if command == "bench"
            else ["tune", "--model", tiny, "--trials", "1", "--out", tmp_path / "run"])
    code, _, err = cli(capsys, *argv, "--prompts", p)
    assert_one_error_line(code, err, command, str(p), "line 2", "nested deeper than")
    assert not (tmp_path / "run").exists()


def test_a_workload_line_nested_deep_is_one_error_line(tmp_path):
    p = tmp_path / "w.jsonl"
    p.write_text('{"prompt_ids": ' + "[" * 50_000 + "]" * 50_000 + ', "max_new_tokens": 1}\n')
    with pytest.raises(PromptError, match="line 1: JSON nested deeper than"):
        load_requests(p)


@pytest.mark.parametrize("char", ["\u2028", "\u2029", "\x85"])  # a raw \x0c is a control character: not JSON
def test_json_allows_line_separators_raw_inside_a_string(tmp_path, char):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "one' + char + 'two", "max_new_tokens": 3}\n{"prompt": "x"}\n', encoding="utf-8")
    assert read_prompts(p, 5) == [(f"one{char}two", 3), ("x", 5)]


def test_plain_prompt_lines_split_at_newlines_only(tmp_path):
    p = tmp_path / "p.txt"
    p.write_bytes("a\u2028b\r\nc\n\n".encode())
    assert read_prompts(p, 4) == [("a\u2028b", 4), ("c", 4)]


def test_a_bench_over_a_prompt_holding_u2028_runs(tiny, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "def f():\u2028    return 1", "max_new_tokens": 1}\n', encoding="utf-8")
    code, out, err = cli(capsys, "bench", "--model", tiny, *BENCH, "--prompts", p, "--json")
    assert code == 0, err
    assert json.loads(out)["workload"]["requests"] == 1


def test_a_prompt_longer_than_ctx_is_refused_naming_the_file_and_request(tiny, tmp_path, capsys):
    # Found by tests/test_fuzz_values.py: generate's refusal named neither the file nor the request.
    p = tmp_path / "p.txt"
    p.write_text("short\n" + "word " * 200 + "\n")
    code, _, err = cli(capsys, "bench", "--model", tiny, *BENCH, "--prompts", p)
    assert_one_error_line(code, err, "bench", f"--prompts {p}: request 2 needs", "more than --ctx-size 64")


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "a", "prompt": "b"}', "duplicate key 'prompt'"),
    ('{"prompt": "a", "max_new_tokens": NaN}', "NaN is not valid JSON"),
    ('{"prompt": "a", "max_new_tokens": 1e999}', "\"max_new_tokens\" must be an integer"),
])
def test_json_lines_are_strict(tmp_path, line, message):
    p = tmp_path / "p.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(PromptError, match=message):
        read_prompts(p, 4)


# --- doctor --------------------------------------------------------------------------------------

def _broken(tiny, tmp_path, kind):
    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    config = m / "config.json"
    if kind == "root":
        return "/", "config.json is missing"
    if kind == "fifo":
        config.unlink()
        os.mkfifo(config)
        return m, "FIFO"
    if kind == "directory":
        config.unlink()
        config.mkdir()
        return m, "is a directory"
    if kind == "dev_zero":
        config.unlink()
        config.symlink_to("/dev/zero")
        return m, "character device"
    if kind == "sparse_2gb":
        with open(config, "r+b") as f:
            f.truncate(2 << 30)
        return m, "over the"
    if kind == "shard_fifo":
        (m / "model.safetensors").unlink()
        os.mkfifo(m / "model.safetensors")
        return m, "FIFO"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["root", "fifo", "directory", "dev_zero", "sparse_2gb", "shard_fifo"])
def test_doctor_is_not_ready_for_what_run_refuses(tiny, tmp_path, capsys, kind):
    model, reason = _broken(tiny, tmp_path, kind)
    code, out, err = cli(capsys, "doctor", "--model", model, "--json")
    assert code == 1 and "Traceback" not in err, err
    report = json.loads(out)
    assert report["verdict"].startswith("not ready")
    finding = next(f for f in report["findings"] if f["rule"] == "model")
    assert finding["severity"] == "problem" and reason in finding["symptom"]
    assert not any(f["rule"] == "disk_space" for f in report["findings"])  # no "free for a 0 B model"
    # ... and run refuses the same model with the same reason.
    code, _, err = cli(capsys, "run", "--model", model, "--prompt-tokens", "2", "--max-new-tokens", "1")
    assert_one_error_line(code, err, "run", reason)


def test_doctor_says_ready_for_a_model_run_opens(tiny, capsys):
    code, out, _ = cli(capsys, "doctor", "--model", tiny, "--json")
    finding = next(f for f in json.loads(out)["findings"] if f["rule"] == "model")
    assert finding["severity"] == "ok" and "qwen3_moe: config.json valid" in finding["symptom"]
    assert code in (0, 1)  # the machine's own findings (memory, cgroup) are this box's


def test_doctor_of_a_missing_model_is_one_error_line(tmp_path, capsys):
    code, _, err = cli(capsys, "doctor", "--model", tmp_path / "nope")
    assert_one_error_line(code, err, "doctor", "does not exist")


# --- sizes below one byte -----------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0.5B", "0.5", "0.0001K", "0.9b"])
def test_sizes_below_one_byte_are_refused(value):
    with pytest.raises(ConfigError, match="less than one byte"):
        parse_size(value)


def test_zero_and_whole_bytes_still_parse():
    assert parse_size("0") == 0 and parse_size("0B") == 0 and parse_size("1.5K") == 1536 and parse_size("1B") == 1


def test_ram_budget_half_a_byte_is_refused_not_fully_resident(tiny, capsys):
    code, _, err = cli(capsys, "run", "--model", tiny, "--ram-budget", "0.5B", "--prompt-tokens", "2")
    assert_one_error_line(code, err, "run", "--ram-budget", "less than one byte")
