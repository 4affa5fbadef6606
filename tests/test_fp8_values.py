"""FP8 values (issue 37, item 4): a typed quantization_config, e4m3 NaN codes and absurd scales
refused by name (a sample at load, every value in convert and quality), NaN logits stopping a
run, quality never reporting NaN, and convert refusing an expert whose shape is off by one.

Each command-line case asserts the behaviour users see: a non-zero exit, one `colibri <cmd>:
error:` line naming the problem, no traceback. The checkpoints are the tiny synth model written
in the published FP8 layout (engine/synth/fp8_writer.py): no transformers import, a second.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from colibri_tiny import make_tiny
from engine.base.errors import ModelFormatError
from engine.weights import fp8
from engine.format.fp8_checkpoint import SCALE_SUFFIX
from engine.run.quality import finite_figures
from engine.synth.fp8_writer import write_fp8_checkpoint
from colibri.cli import main

BLOCK = (16, 16)
RUN = ("--prompt-tokens", "3", "--max-new-tokens", "2", "--ctx-size", "16")
QUALITY = ("--tokens", "32", "--ctx", "16", "--json")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-values")
    write_fp8_checkpoint(make_tiny(root / "src"), root / "fp8", block=BLOCK)
    return root / "fp8"


def copy_with(good: Path, dst: Path, tensors=None, config=None) -> Path:
    """A copy of the FP8 model; `tensors(dict)` edits its tensors in place, `config(dict)` its config."""
    shutil.copytree(good, dst)
    if tensors:
        f = dst / "model.safetensors"
        t = load_file(f)
        tensors(t)
        save_file(t, str(f), metadata={"format": "pt"})
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error_line(code: int, err: str, command: str, *needles: str) -> str:
    """Exit 2 and, after any progress lines, exactly one line that is the error (never glued
    onto a progress line: every line holding "error:" starts with `colibri <cmd>: error:`)."""
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.replace("\r", "\n").split("\n") if ln.strip()]
    errors = [ln for ln in err.split("\n") if "error:" in ln]
    assert len(errors) == 1 and errors[0].startswith(f"colibri {command}: error: "), err
    assert lines[-1] == errors[0], err
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def set_codes(name: str, index: int | slice, code: int):
    def edit(t):
        codes = t[name].view(torch.uint8).reshape(-1).clone()
        codes[index] = code
        t[name] = codes.view(torch.float8_e4m3fn).reshape(t[name].shape)
    return edit


EXPERT_UP = "model.layers.1.mlp.experts.3.up_proj.weight"
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def sample_layout(numel: int) -> tuple[int, int]:
    """(run, stride) of the load-time sample of a matrix of `numel` codes (engine/weights/fp8.py)."""
    run = fp8.SAMPLED_CODES // fp8.SAMPLE_RUNS
    return run, (numel - run) // (fp8.SAMPLE_RUNS - 1)


def unsampled_index(numel: int) -> int:
    """A code index the load-time sample does not look at: just past its first run."""
    run, stride = sample_layout(numel)
    assert numel > fp8.SAMPLED_CODES and stride > run
    return run


# --- quantization_config typed ------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "bench", "convert", "quality", "tune", "serve", "chat"])
def test_quantization_config_string_is_one_line_in_every_command(good, tmp_path, capsys, command):
    m = copy_with(good, tmp_path / "m", config=lambda c: c.update(quantization_config="fp8"))
    argv = {"run": ["run", "--model", m, *RUN],
            "bench": ["bench", "--model", m, "--tokens", "1", "--repeats", "1", "--prompt-tokens", "2",
                      "--ctx-size", "16"],
            "convert": ["convert", m, "-o", tmp_path / "out", "--quant", "int8"],
            "quality": ["quality", "--model", m, "--reference", m, *QUALITY],
            "tune": ["tune", "--model", m, "--trials", "1", "--out", tmp_path / "run"],
            "serve": ["serve", "--model", m, "--port", "0"],
            "chat": ["chat", "--model", m]}[command]
    code, _, err = cli(capsys, *argv)
    assert_one_error_line(code, err, command, "quantization_config = 'fp8'", "must be an object")


def test_doctor_reports_the_string_quantization_config_as_a_problem(good, tmp_path, capsys):
    m = copy_with(good, tmp_path / "m", config=lambda c: c.update(quantization_config="fp8"))
    code, out, err = cli(capsys, "doctor", "--model", m)
    assert code == 1 and "Traceback" not in err
    assert "not ready" in out and "quantization_config = 'fp8'" in out


# --- NaN codes and absurd scales at load -------------------------------------------------------

@pytest.mark.parametrize("code_byte", [0x7F, 0xFF])
def test_a_projection_of_nan_codes_is_refused_by_name_at_load(good, tmp_path, capsys, code_byte):
    m = copy_with(good, tmp_path / "m", tensors=set_codes(EXPERT_UP, slice(None), code_byte))
    code, _, err = cli(capsys, "run", "--model", m, *RUN)
    assert_one_error_line(code, err, "run", EXPERT_UP, f"FP8 code 0x{code_byte:02x}", "is NaN")


@pytest.mark.parametrize("scale,kind", [(3e38, "is absurd"), (float("inf"), "is infinite"),
                                        (float("nan"), "is not a number"), (-1.0, "is negative")])
def test_bad_scales_are_refused_by_name_at_load(good, tmp_path, capsys, scale, kind):
    name = EXPERT_UP + SCALE_SUFFIX
    m = copy_with(good, tmp_path / "m", tensors=lambda t: t[name].view(-1).__setitem__(0, scale))
    code, _, err = cli(capsys, "run", "--model", m, *RUN)
    assert_one_error_line(code, err, "run", name, kind)


def test_the_largest_allowed_scale_loads():
    fp8.check_scale_values(torch.tensor([0.0, 1e-30, fp8.MAX_SCALE]), "ok")
    with pytest.raises(ModelFormatError, match="absurd"):
        fp8.check_scale_values(torch.tensor([fp8.MAX_SCALE * 1.001]), "x")


def test_the_load_sample_sees_runs_and_the_full_check_sees_every_code():
    w = torch.zeros(64, 96, dtype=torch.uint8)
    run, stride = sample_layout(w.numel())
    sampled, unsampled = w.clone(), w.clone()
    sampled.view(-1)[stride * 7 + 5] = 0x7F
    unsampled.view(-1)[stride * 7 + run] = 0xFF
    as_fp8 = lambda t: t.view(torch.float8_e4m3fn)  # noqa: E731
    where = divmod(stride * 7 + 5, 96)
    with pytest.raises(ModelFormatError, match=rf"0x7f at \[{where[0]}, {where[1]}\] is NaN"):
        fp8.check_codes(as_fp8(sampled), "w")
    fp8.check_codes(as_fp8(unsampled), "w")  # between two sampled runs: the sample misses it ...
    where = divmod(stride * 7 + run, 96)
    with pytest.raises(ModelFormatError, match=rf"0xff at \[{where[0]}, {where[1]}\] is NaN"):
        fp8.check_codes(as_fp8(unsampled), "w", full=True)  # ... the full check does not
    small = torch.zeros(8, 16, dtype=torch.uint8)
    small.view(-1)[77] = 0x7F  # a matrix of at most SAMPLED_CODES codes is checked whole, even at load
    with pytest.raises(ModelFormatError, match=r"0x7f at \[4, 13\]"):
        fp8.check_codes(as_fp8(small), "w")


# --- a NaN the sample missed: the logits stop the run -----------------------------------------------

def test_nan_logits_stop_a_run_with_one_line_instead_of_token_0(good, tmp_path, capsys):
    numel = math.prod(load_file(good / "model.safetensors")[O_PROJ].shape)
    m = copy_with(good, tmp_path / "m", tensors=set_codes(O_PROJ, unsampled_index(numel), 0x7F))
    code, out, err = cli(capsys, "run", "--model", m, *RUN, "--json")
    assert_one_error_line(code, err, "run", "NaN logits", "colibri quality")
    assert out == ""  # no generated tokens reported


def test_convert_checks_every_code_and_its_error_starts_a_line(good, tmp_path, capsys):
    numel = math.prod(load_file(good / "model.safetensors")[O_PROJ].shape)
    m = copy_with(good, tmp_path / "m", tensors=set_codes(O_PROJ, unsampled_index(numel), 0x7F))
    code, _, err = cli(capsys, "convert", m, "-o", tmp_path / "out", "--quant", "int8", "--scope", "all")
    assert_one_error_line(code, err, "convert", O_PROJ, "is NaN")


def test_quality_checks_every_code_and_prints_no_nan(good, tmp_path, capsys):
    numel = math.prod(load_file(good / "model.safetensors")[O_PROJ].shape)
    m = copy_with(good, tmp_path / "m", tensors=set_codes(O_PROJ, unsampled_index(numel), 0xFF))
    code, out, err = cli(capsys, "quality", "--model", m, "--reference", good, *QUALITY)
    assert_one_error_line(code, err, "quality", O_PROJ, "0xff", "is NaN")
    assert "NaN" not in out and out == ""


def test_quality_of_a_good_fp8_model_is_finite_json(good, capsys):
    code, out, err = cli(capsys, "quality", "--model", good, "--reference", good, *QUALITY)
    assert code == 0, err
    assert "NaN" not in out and "Infinity" not in out
    assert json.loads(out)["kl_mean"] == pytest.approx(0.0, abs=1e-6)


def test_quality_figures_that_overflow_are_refused_not_printed():
    with pytest.raises(ModelFormatError, match="ppl_ratio is nan"):
        finite_figures({"kl_mean": 0.1, "ppl_ratio": float("nan")})
    assert finite_figures({"kl_mean": 0.1, "label": "x"}) == {"kl_mean": 0.1, "label": "x"}


# --- convert: an expert one row or column off ----------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1])
def test_convert_refuses_an_expert_one_row_or_column_off(good, tmp_path, capsys, axis):
    def off_by_one(t):
        w = fp8.dequantize(t[EXPERT_UP], t[EXPERT_UP + SCALE_SUFFIX], BLOCK)
        w = w[:-1] if axis == 0 else w[:, :-1]
        t[EXPERT_UP], t[EXPERT_UP + SCALE_SUFFIX] = fp8.quantize(w, BLOCK)
    m = copy_with(good, tmp_path / "m", tensors=off_by_one)
    code, _, err = cli(capsys, "convert", m, "-o", tmp_path / "out", "--quant", "int8")
    assert_one_error_line(code, err, "convert", EXPERT_UP, "config.json implies")
    assert not (tmp_path / "out").exists()
