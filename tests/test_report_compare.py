"""`colibri compare` over profiles and run directories: ranking, conditions, --force, quality."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from report_fixture import hardware_profile, make_run
from colibri import cli

MiB = 1 << 20


def export(run: Path, path: Path) -> Path:
    assert cli.main(["profile", "export", str(run), "-o", str(path)]) == 0
    return path


def test_two_profiles_of_two_machines(tmp_path, capsys):
    slow = export(make_run(tmp_path / "slow"), tmp_path / "slow-box.json")
    fast = export(make_run(tmp_path / "fast", speed=1.5, profile=hardware_profile("Fast CPU", seq_gbps=3.6)),
                  tmp_path / "fast-box.json")
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert cli.main(["compare", str(slow), str(fast), "--out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in s["ranked"]] == ["fast-box", "slow-box"]
    assert s["ranked"][0]["decode_tok_s"] == pytest.approx(1.5 * s["ranked"][1]["decode_tok_s"])
    assert s["ranked"][1]["of_best"] == pytest.approx(1 / 1.5)
    assert s["ranked"][0]["mib_read_per_token"] == pytest.approx(38000 / MiB)
    assert s["forced"] is False and s["not_comparable"] == {}
    assert set(s["varying"]) == {"machine", "CPU"}  # the disk model and transport are the same
    assert s["common"]["budget"] == "512.0 MiB" and s["common"]["cold/warm"] == "cold"
    md = (out / "compare.md").read_text()
    assert "| 1 | fast-box |" in md and "Compared: machine" in md
    page = (out / "compare.html").read_text()
    assert page.count("<img ") == 4  # decode, TTFT, MiB read per token, hit rate: no quality figures here
    assert not re.search(r"(src|href)=['\"](?!data:)", page)
    for name in ("decode_tok_s", "ttft_s", "bytes_read_per_token", "hit_rate_ram"):
        assert (out / "plots" / f"{name}.png").is_file()


def test_run_dirs_with_different_conditions_are_refused_without_force(tmp_path, capsys):
    cold = make_run(tmp_path / "cold")
    warm = make_run(tmp_path / "warm", cold=False, budget=1024 * MiB, speed=3.0)
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert cli.main(["compare", str(cold), str(warm), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not comparable" in err[0]
    assert "cold/warm: cold vs warm" in err[0] and "budget: 512.0 MiB vs 1.0 GiB" in err[0]
    assert "--force" in err[0] and not out.exists()

    assert cli.main(["compare", str(cold), str(warm), "--out", str(out), "--force"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("NOT LIKE FOR LIKE (--force): ")
    assert "NOT LIKE FOR LIKE" in (out / "compare.md").read_text()
    assert "NOT LIKE FOR LIKE" in (out / "compare.html").read_text()
    s = json.loads((out / "compare.json").read_text())
    assert s["forced"] and set(s["not_comparable"]) == {"budget", "cold/warm"}
    assert [r["label"] for r in s["ranked"]] == ["warm", "cold"]


def test_quant_levels_with_quality_compare_and_plot(tmp_path, capsys):
    """One machine at three quant levels, as `tune --quant` will record them: profiles whose
    entries carry the quant and its KL against the bf16 reference."""
    paths = []
    for q, sp, kl, t1 in (("bf16", 1.0, 0.0, 1.0), ("int8", 1.6, 0.004, 0.99), ("int4", 2.4, 0.05, 0.93)):
        path = export(make_run(tmp_path / q, speed=sp), tmp_path / f"{q}.json")
        data = json.loads(path.read_text())
        data["best_configs"][0].update(quant=q, quality={"kl_mean": kl, "top1_agreement": t1, "perplexity": None,
                                                         "reference": "tiny"})
        path.write_text(json.dumps(data))
        paths.append(path)
    out = tmp_path / "cmp"
    capsys.readouterr()
    assert cli.main(["compare", *map(str, paths), "--out", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["quant"] for r in s["ranked"]] == ["int4", "int8", "bf16"]
    assert [r["kl_mean"] for r in s["ranked"]] == [0.05, 0.004, 0.0]
    assert s["varying"] == {"quant": ["bf16", "int8", "int4"]}
    for name in ("kl", "speed_quality"):
        assert (out / "plots" / f"{name}.png").is_file()
    assert (out / "compare.html").read_text().count("<img ") == 6


def test_compare_needs_two_inputs_and_a_result(tmp_path, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(hardware_profile().to_dict()))
    assert cli.main(["compare", str(make_run(tmp_path / "a")), str(probe)]) == 2
    assert "records no tune result" in capsys.readouterr().err
    assert cli.main(["compare", str(make_run(tmp_path / "b"))]) == 2
    assert "at least two" in capsys.readouterr().err
    assert cli.main(["compare", str(tmp_path / "b"), "no-such-profile"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_model_filter_picks_a_profiles_entries(tmp_path, capsys):
    from tuner.probe.hardware_profile import HardwareProfile
    first = tmp_path / "first.json"
    export(make_run(tmp_path / "a"), first)
    prof = HardwareProfile.from_dict(json.loads(first.read_text()))  # carries tiny's entry
    both = export(make_run(tmp_path / "b", model_name="twin", budget=1024 * MiB, profile=prof), tmp_path / "both.json")
    assert len(json.loads(both.read_text())["best_configs"]) == 2
    run = make_run(tmp_path / "c", speed=1.2)
    capsys.readouterr()
    assert cli.main(["compare", str(both), str(run), "--out", str(tmp_path / "x")]) == 2  # 512 MiB vs 1 GiB
    assert "budget" in capsys.readouterr().err
    assert cli.main(["compare", str(both), str(run), "--model", "tiny", "--out", str(tmp_path / "y"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in s["ranked"]] == ["c", "both"]
    assert cli.main(["compare", str(both), str(run), "--model", "nope"]) == 2
    assert "no best config for model 'nope'" in capsys.readouterr().err
