"""`colibri tune --quant` on a tiny bf16 model: two levels (bf16, int8) with two short trials
each, interrupted in the second level and resumed; the containers' cache; bad input.

Trials are real `colibri bench` subprocesses (2 decode tokens, 1 repeat); quality is scored on
this repository's README (a real text the tiny model's tokenizer reads) in chunks of 64.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from colibri import cli
from tuner.share import profiles
from tuner.results.printers import kl_text
from tuner.search.quant_tune import QuantTuneOptions, parse_levels, run_quant_tune
from tuner.results.result import TuneResult
from tuner.search.study import TuneOptions

from colibri_tune_fixtures import BUDGET, ROOT, SMALL_CTX, MiB

QUALITY = ["--quality-tokens", "128", "--quality-ctx", "64", "--quality-text", str(ROOT / "README.md")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The model cache the containers go into (never the user's)."""
    root = tmp_path_factory.mktemp("colibri-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLIBRI_CACHE", str(root))
        yield root / "models"


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory) -> Path:
    from engine import synth
    d = tmp_path_factory.mktemp("quant-model") / "tinybf"
    synth.synthesize({**synth.load_preset("tiny"), "dtype": "bfloat16"}, d, seed=0, progress=False)
    return d


def cli_args(model: Path, profile: Path, out: Path, levels: str = "bf16,int8") -> list[str]:
    return ["tune", "--model", str(model), "--quant", levels, "--out", str(out), "--ram-budget", f"{BUDGET // MiB}MiB",
            "--min-ctx", str(SMALL_CTX), "--trials", "2", "--tokens", "2", "--repeats", "1", "--prompt-tokens", "8",
            "--confirm-top", "0", "--sampler", "random", "--profile", str(profile), *QUALITY]


def trials(run_dir: Path) -> list:
    url = f"sqlite:///{run_dir / 'study.db'}"
    (name,) = optuna.study.get_all_study_names(url)
    return optuna.load_study(study_name=name, storage=url).get_trials(states=(TrialState.COMPLETE,))


@pytest.fixture(scope="module")
def tuned(bf16_model, profile_path, cache, tmp_path_factory):
    """Run 1 is interrupted after the int8 level's first trial; run 2 (the CLI, --resume --json)
    finishes it. Returns (out, the first level's result.json bytes after run 1, the summary)."""
    out = tmp_path_factory.mktemp("tune-quant") / "run"
    opts = TuneOptions(model=str(bf16_model), ram_budget=BUDGET, min_ctx=SMALL_CTX, trials=2, tokens=2, repeats=1,
                       prompt_tokens=8, confirm_top=0, sampler="random", profile=str(profile_path), out=out)
    qopts = QuantTuneOptions(opts, parse_levels("bf16,int8"), quality_tokens=128, quality_ctx=64,
                             quality_text=str(ROOT / "README.md"))
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(msg)
        if msg.startswith("[int8] trial 1/2"):
            raise KeyboardInterrupt  # as Ctrl-C right after the second level's first trial

    with pytest.raises(KeyboardInterrupt):
        run_quant_tune(qopts, log=log)
    assert (out / "bf16" / "result.json").is_file() and not (out / "int8" / "result.json").exists()
    assert len(trials(out / "int8")) == 1
    first = (out / "bf16" / "result.json").read_bytes()
    return out, first, lines


@pytest.fixture(scope="module")
def resumed(tuned, bf16_model, profile_path):
    out, _, _ = tuned
    import contextlib
    import io
    buf, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        rc = cli.main(cli_args(bf16_model, profile_path, out) + ["--resume", "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(buf.getvalue()), err.getvalue()


def test_resume_skips_the_finished_level_and_continues_the_interrupted_one(tuned, resumed):
    out, first, _ = tuned
    summary, log = resumed
    assert "[bf16] finished earlier" in log and "[int8] resuming" in log
    assert (out / "bf16" / "result.json").read_bytes() == first  # not re-run, not rewritten
    assert len(trials(out / "bf16")) == 2 and len(trials(out / "int8")) == 2  # int8 kept its first trial
    assert [lv["level"] for lv in summary["levels"]] == ["bf16", "int8"]
    assert [lv["status"] for lv in summary["levels"]] == ["finished earlier", "tuned"]
    assert "reusing" in log and "converting" not in log  # the container of run 1 is reused
    assert "quality: scoring" not in log  # and so is its quality measurement


def test_each_level_is_a_study_with_its_quant_and_quality(tuned, resumed, cache, bf16_model):
    out, _, _ = tuned
    bf16 = TuneResult.from_dict(json.loads((out / "bf16" / "result.json").read_text()))
    int8 = TuneResult.from_dict(json.loads((out / "int8" / "result.json").read_text()))
    assert (bf16.quant, int8.quant) == ("bf16", "int8")
    assert bf16.model.name == int8.model.name == "tinybf"  # one model, two levels
    same = {k: v for k, v in bf16.model.geometry.items() if k != "total_bytes_on_disk"}
    assert same == {k: v for k, v in int8.model.geometry.items() if k != "total_bytes_on_disk"}
    assert int8.model.geometry["total_bytes_on_disk"] < bf16.model.geometry["total_bytes_on_disk"]
    assert bf16.budget_bytes == int8.budget_bytes == BUDGET
    assert bf16.study.name == "tinybf-bf16-512MiB-decode" and int8.study.name == "tinybf-int8-512MiB-decode"
    # The int8 container was converted into the cache, keyed by source fingerprint and quant.
    (container,) = cache.glob("tinybf-int8-*")
    assert Path(int8.model.dir) == container.resolve()
    assert json.loads((container / "config.json").read_text())["colibri_quant"]["quant"] == "int8"
    # Quality: int8 measured against the bf16 source; the source is the reference (KL 0).
    q = int8.quality
    assert q.reference == "tinybf" and q.reference_quant == "bf16" and q.tokens == 128 and q.ctx == 64
    # (The random tiny model's distributions are near uniform: int8 moves them very little.)
    assert 0 <= q.kl_mean <= q.kl_max and 0 < q.kl_max < 1 and q.scored_tokens == 2 * 31
    assert 0.5 < q.top1_agreement <= 1 and q.perplexity > 1
    assert bf16.quality.kl_mean == 0 and bf16.quality.top1_agreement == 1
    assert bf16.quality.perplexity == pytest.approx(q.perplexity_reference)
    # Each level's report says which weights it tuned and how close they are.
    page = (out / "int8" / "report.html").read_text()
    assert "colibri tune: tinybf int8 under" in page and "against tinybf bf16: KL mean" in page
    assert "- weights: int8 (against tinybf bf16" in (out / "int8" / "report.md").read_text()
    # The level shares the probe the parent ran once.
    assert bf16.conditions.profile.fingerprint == int8.conditions.profile.fingerprint


def test_compare_pareto_and_profile_in_the_parent(tuned, resumed):
    out, _, _ = tuned
    summary, _ = resumed
    for name in ("compare.md", "compare.html", "compare.json", "quant-result.json", "profile.json",
                 "plots/speed_quality.png", "plots/decode_tok_s.png", "plots/kl.png"):
        assert (out / name).is_file(), name
    assert summary["files"]["pareto"] == str(out / "plots" / "speed_quality.png")
    cmp = json.loads((out / "compare.json").read_text())
    assert sorted(r["quant"] for r in cmp["ranked"]) == ["bf16", "int8"]
    assert cmp["not_comparable"] == {} and cmp["varying"]["quant"] and cmp["common"]["budget"] == "512.0 MiB"
    assert {r["quant"]: r["kl_mean"] for r in cmp["ranked"]}["bf16"] == 0.0
    assert set(cmp["pareto_front"]) <= {"bf16", "int8"} and cmp["pareto_front"]
    md = (out / "compare.md").read_text()
    int8_kl = {r["quant"]: r["kl_mean"] for r in cmp["ranked"]}["int8"]
    assert "| int8 |" in md and f"| {kl_text(int8_kl)} |" in md  # a KL of 1e-6 is not printed as 0.0000
    assert kl_text(3.1e-6) == "3.10e-06" and kl_text(0.0) == "0" and kl_text(0.031) == "0.0310"
    # Every level's best in the hardware profile, one entry per (geometry, quant, budget).
    entries = json.loads((out / "profile.json").read_text())["best_configs"]
    assert sorted(e["quant"] for e in entries) == ["bf16", "int8"]
    assert len({json.dumps(e["geometry"], sort_keys=True) for e in entries}) == 1
    assert {e["ram_budget"] for e in entries} == {BUDGET}
    assert "best_configs" in json.loads((out / "probe.json").read_text())  # the bare probe stays
    assert json.loads((out / "probe.json").read_text())["best_configs"] == []
    # Export of the parent: a shareable profile with both levels, KL kept, no paths.
    shared = profiles.export_profile(out)
    assert sorted((e["quant"], e["quality"]["kl_mean"]) for e in shared["best_configs"])[0] == ("bf16", 0.0)
    assert {e["quant"]: e["quality"]["reference"] for e in shared["best_configs"]} == {"bf16": "tinybf",
                                                                                     "int8": "tinybf"}
    assert str(out) not in json.dumps(shared) and "README" not in json.dumps(shared)


def test_a_later_session_naming_one_level_keeps_the_others(tuned, resumed, bf16_model, profile_path, capsys):
    """`--quant bf16 --resume` tunes nothing new here; the parent's profile and comparison still
    cover both levels, and bf16's reference quality comes from the cached int8 measurement."""
    out, _, _ = tuned
    capsys.readouterr()
    assert cli.main(cli_args(bf16_model, profile_path, out, "bf16") + ["--resume", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [(lv["level"], lv["status"]) for lv in summary["levels"]] == [("bf16", "finished earlier"),
                                                                         ("int8", "earlier session")]
    bf16 = summary["levels"][0]["quality"]
    assert bf16["kl_mean"] == 0 and bf16["perplexity"] > 1
    assert sorted(e["quant"] for e in json.loads((out / "profile.json").read_text())["best_configs"]) == \
        ["bf16", "int8"]
    assert json.loads((out / "quant-run.json").read_text())["levels"] == ["bf16", "int8"]


def test_an_interrupted_conversion_resumes(bf16_model, cache, tmp_path):
    """ensure_container converts into the cache; after an interrupt it keeps finished shards."""
    from engine.format.container import QuantSpec
    from engine.format.convert import Converter, convert
    from tuner.search import quant_cache
    level = parse_levels("int4-g32")[0]
    fingerprint = Converter(bf16_model, QuantSpec("int4", 32, "experts")).fingerprint
    dst = quant_cache.container_dir(bf16_model, fingerprint, "int4-g32")

    def stop_after_first_shard(event, **f):
        if event == "shard" and f["index"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert(bf16_model, dst, "int4", 32, "experts", progress=stop_after_first_shard)
    assert not dst.exists() and (dst.parent / (dst.name + ".partial")).is_dir()
    path, info = quant_cache.ensure_container(bf16_model, level, log=lambda m: None)
    assert path == dst.resolve() and info["action"] == "converted" and info["shards_kept"] >= 1
    path, info = quant_cache.ensure_container(bf16_model, level, log=lambda m: None)
    assert info["action"] == "reused"


def test_scope_all_levels_quantize_the_dense_part_too_and_are_priced_in_quality(bf16_model, cache, tmp_path):
    """int8-all: its own container (convert's scope "all": the attention and dense projections
    quantized too), a smaller resident part than int8's, and a quality cost measured against
    the source like any level's, which a bound it breaks refuses."""
    from engine.arch.args import dense_tensor_names
    from engine.arch.registry import model_args
    from engine.format.checkpoint import Checkpoint
    from engine.format.container import container_spec, dense_quantized
    from tuner.search import lossy, quant_cache
    experts, everything = parse_levels("int8,int8-all")
    assert (experts.label, experts.scope, everything.label, everything.scope) == ("int8", "experts", "int8-all", "all")
    assert parse_levels("int4-g32-all")[0].label == "int4-g32-all"
    dirs = {lv.label: quant_cache.ensure_container(bf16_model, lv, log=lambda m: None)[0] for lv in (experts, everything)}
    assert dirs["int8"] != dirs["int8-all"]
    quantized = {}
    for label, d in dirs.items():
        ckpt = Checkpoint(d)
        spec = container_spec(ckpt)
        quantized[label] = dense_quantized(ckpt, spec, dense_tensor_names(model_args(ckpt.config)))
        assert spec.scope == ("all" if label == "int8-all" else "experts")
    assert not quantized["int8"] and any("self_attn" in n for n in quantized["int8-all"])
    text = str(ROOT / "README.md")
    q = {label: quant_cache.quality(d, bf16_model, tmp_path / f"{label}.json", tokens=128, ctx=64, text=text,
                                    log=lambda m: None) for label, d in dirs.items()}
    assert q["int8-all"]["kl_mean"] > 0 and q["int8-all"]["kl_mean"] != q["int8"]["kl_mean"]
    strict = lossy.QualityBound(max_kl=q["int8-all"]["kl_mean"] / 2)
    assert strict.violation(q["int8-all"]) > 0
    assert lossy.QualityBound(max_kl=q["int8-all"]["kl_mean"] * 2).violation(q["int8-all"]) == 0


@pytest.mark.parametrize("levels, message", [
    ("bf16,int9", "unknown level 'int9'"),
    ("int8,bf16,int8", "level 'int8' is given twice"),
    ("int4,int4-g64", "level 'int4-g64' is given twice"),
    ("int4-g48", "group size 48"),
    ("int8-g32", "unknown level 'int8-g32'"),
    ("bf16-all,int8", "unknown level 'bf16-all'"),
    ("int8-all,int8-all", "level 'int8-all' is given twice"),
    ("bf16,fp32", "both name the unquantized source"),
    ("", "no levels given"),
    ("fp32,int8", "stored as bf16"),
])
def test_bad_levels_are_one_line_exit_2(levels, message, bf16_model, profile_path, tmp_path, capsys, cache):
    rc = cli.main(cli_args(bf16_model, profile_path, tmp_path / "out", levels))
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_resume_needs_a_quant_run_and_a_fresh_run_an_empty_out(tuned, bf16_model, profile_path, tmp_path, capsys):
    out, _, _ = tuned
    assert cli.main(cli_args(bf16_model, profile_path, out)) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert cli.main(cli_args(bf16_model, profile_path, tmp_path / "none") + ["--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert cli.main(cli_args(bf16_model, profile_path, out) + ["--resume", "--ram-budget", "1GiB"]) == 2
    assert "every level shares it" in capsys.readouterr().err
    assert cli.main(["tune", "--model", str(bf16_model), "--prepare-only"]) == 2
    assert "--prepare-only goes with --quant" in capsys.readouterr().err
