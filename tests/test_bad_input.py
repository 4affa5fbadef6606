"""Bad input: one clear error line naming the problem, a non-zero exit, never a traceback."""

import json
import shutil
import struct

import pytest

from colibri_hf_models import build
from colibri.cli import main


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    build("qwen3_moe", d, num_hidden_layers=2)
    return d


@pytest.fixture
def model(good_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(good_model, d)
    return d


def run_cli(capsys, *argv):
    code = main(["run", *map(str, argv)])
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *needles):
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def rewrite_header(path, mutate):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    mutate(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def first_tensor(header, contains="experts.1.up_proj"):
    return next(k for k in header if contains in k)


def test_good_model_runs(model, capsys):
    code, err = run_cli(capsys, "--model", model, "--prompt-tokens", 4, "--max-new-tokens", 2, "--ctx-size", 16)
    assert code == 0, err


def test_missing_directory(tmp_path, capsys):
    assert_one_line_error(*run_cli(capsys, "--model", tmp_path / "nope", "--prompt-tokens", 2), "does not exist")


def test_missing_config(model, capsys):
    (model / "config.json").unlink()
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "config.json is missing")


def test_unsupported_model_type_lists_supported(model, capsys):
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (model / "config.json").write_text(json.dumps(cfg))
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "'gpt2'", "qwen3_moe", "mixtral")


def test_header_length_larger_than_file(model, capsys):
    f = model / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "header length", "larger than the file")


def test_header_not_json(model, capsys):
    f = model / "model.safetensors"
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    f.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n:])
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "not valid JSON")


def test_offsets_out_of_range(model, capsys):
    def mutate(h):
        k = first_tensor(h)
        b, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [b + 10**9, e + 10**9]
    rewrite_header(model / "model.safetensors", mutate)
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "beyond the file")


def test_overlapping_offsets(model, capsys):
    def mutate(h):
        a, b = first_tensor(h, "experts.1.up_proj"), first_tensor(h, "experts.1.gate_proj")
        h[a]["data_offsets"] = list(h[b]["data_offsets"])
    rewrite_header(model / "model.safetensors", mutate)
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "overlap")


def test_shape_does_not_match_bytes(model, capsys):
    def mutate(h):
        k = first_tensor(h)
        h[k]["shape"] = [h[k]["shape"][0] * 2, h[k]["shape"][1]]
    rewrite_header(model / "model.safetensors", mutate)
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "needs", "bytes")


def test_missing_tensor(model, capsys):
    def mutate(h):
        del h[first_tensor(h, "layers.1.self_attn.q_proj")]
    rewrite_header(model / "model.safetensors", mutate)
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "missing tensor",
                          "layers.1.self_attn.q_proj")


def test_truncated_shard(model, capsys):
    f = model / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(raw[: len(raw) - 1000])
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 2), "truncated")


def test_prompt_longer_than_ctx(model, capsys):
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-tokens", 30, "--ctx-size", 16),
                          "exceeds ctx_size 16")


def test_bad_prompt_ids(model, capsys):
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-ids", "1,x"), "comma-separated")
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt-ids", "99999"), "outside the vocabulary")


def test_text_prompt_without_tokenizer(model, capsys):
    assert_one_line_error(*run_cli(capsys, "--model", model, "--prompt", "hello"), "tokenizer.json")


def test_malformed_config_toml(model, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nchunk_size = = 3\n")
    assert_one_line_error(*run_cli(capsys, "--model", model, "--config", bad), "not valid TOML")
    bad.write_text("[engine]\nprefetch_dept = 3\n")
    assert_one_line_error(*run_cli(capsys, "--model", model, "--config", bad), "unknown key", "prefetch_dept")
