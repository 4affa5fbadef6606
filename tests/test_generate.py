"""colibri run: sampling, text prompts through tokenizer.json, the --json record, config files."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import synth
from engine.base.config import EngineConfig
from engine.base.errors import ConfigError
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri.cli import main

from colibri_sync import GUARD_S

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return synth.synthesize(synth.load_preset("tiny"), tmp_path_factory.mktemp("gen") / "tiny", seed=1,
                            progress=False)


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine(tiny, EngineConfig(ctx_size=128, threads=1))


PROMPT = [10, 20, 30, 40, 50, 60]


def test_seeded_sampling_is_reproducible_and_seed_dependent(engine):
    runs = {seed: generate(engine, PROMPT, 24, Sampler(temperature=1.5, seed=seed)).output_ids for seed in range(4)}
    assert generate(engine, PROMPT, 24, Sampler(temperature=1.5, seed=0)).output_ids == runs[0]
    assert len({tuple(v) for v in runs.values()}) > 1


def test_tiny_top_p_is_greedy(engine):
    greedy = generate(engine, PROMPT, 12, Sampler()).output_ids
    # top_p this small keeps only the most likely token, whatever the temperature.
    assert generate(engine, PROMPT, 12, Sampler(temperature=2.0, top_p=1e-6, seed=5)).output_ids == greedy


def test_sampler_rejects_bad_values():
    from engine.base.errors import PromptError
    with pytest.raises(PromptError):
        Sampler(temperature=-1)
    with pytest.raises(PromptError):
        Sampler(top_p=0)


def test_run_json_carries_ids_and_text_prompt_uses_tokenizer(tiny, capsys):
    code = main(["run", "--model", str(tiny), "--prompt", "hello world", "--max-new-tokens", "5", "--json",
                 "--ctx-size", "64"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    from tokenizers import Tokenizer
    assert out["prompt_ids"] == Tokenizer.from_file(str(tiny / "tokenizer.json")).encode("hello world").ids
    assert len(out["output_ids"]) == 5 and isinstance(out["text"], str)
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s", "peak_rss_bytes", "config", "geometry", "git_commit"):
        assert key in out


def test_prompt_tokens_are_drawn_from_the_seed(tiny, capsys):
    def ids(seed):
        main(["run", "--model", str(tiny), "--prompt-tokens", "7", "--seed", str(seed), "--max-new-tokens", "1",
              "--json", "--ctx-size", "64"])
        return json.loads(capsys.readouterr().out)["prompt_ids"]
    assert ids(3) == ids(3) and len(ids(3)) == 7 and ids(3) != ids(4)


def test_config_toml_round_trip_and_flags_override(tiny, tmp_path):
    cfg = EngineConfig(ram_budget=1 << 30, chunk_size=256 << 10, prefetch_depth=3, io_mode="buffered",
                       cache_policy="lfu", ctx_size=96)
    path = tmp_path / "cfg.toml"
    cfg.save(path, header="test")
    assert EngineConfig.load(path) == cfg
    # Run as a user does, in a fresh process: the memory plan counts the running process's RSS
    # as overhead, and this (pytest) process's size depends on which tests ran before.
    run = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(tiny), "--config", str(path),
                          "--prefetch-depth", "1", "--prompt-tokens", "4", "--max-new-tokens", "2", "--json"],
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=GUARD_S)
    assert run.returncode == 0, run.stderr
    used = json.loads(run.stdout)["config"]
    assert used["prefetch_depth"] == 1 and used["cache_policy"] == "lfu" and used["ctx_size"] == 96
    assert used["ram_budget"] == 1 << 30


@pytest.mark.parametrize("bad", [{"chunk_size": 100}, {"io_mode": "aio"}, {"cpu_cache_ratio": 1.5},
                                 {"ram_budget": "lots"}, {"threads": "two"}])
def test_config_values_are_validated(bad):
    with pytest.raises(ConfigError):
        EngineConfig.from_dict(bad)


def test_check_finite_logits_finds_any_nan_or_infinity_and_not_an_overflowing_sum():
    """The check sums the logits (a NaN or an infinity carries through); a sum that overflows on
    finite entries is checked entry by entry, so it is no error."""
    from engine.base.errors import ModelFormatError
    from engine.run.generate import check_finite_logits
    logits = torch.randn(4096)
    check_finite_logits(logits)
    for value, word in ((float("nan"), "NaN"), (float("inf"), "infinite"), (float("-inf"), "infinite")):
        bad = logits.clone()
        bad[1234] = value
        with pytest.raises(ModelFormatError, match=f"{word} logits"):
            check_finite_logits(bad)
    both = logits.clone()
    both[0], both[1] = float("inf"), float("-inf")  # their sum is NaN: still caught
    with pytest.raises(ModelFormatError, match="infinite logits"):
        check_finite_logits(both)
    huge = torch.full((8,), 3e38)  # finite entries whose sum is inf in fp32
    assert not torch.isfinite(huge.sum())
    check_finite_logits(huge)
