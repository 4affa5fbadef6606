"""Prefix reuse (engine/run/prefix_cache.py) and KV on the SSD (engine/run/kv_store.py).

The invariant (docs/DESIGN.md, "Reuse"): a restored prefix gives the logits a full recompute
gives (fp32 within 1e-5, greedy tokens identical), on every architecture and cache kind, from
the live cache, RAM blocks or files; a file that is corrupt, truncated, foreign or stale is
skipped with one warning line and recomputed; the disk bound holds; a full disk means RAM only.
Blocks of 8 tokens here (64 in the engine) so a 40-token prompt spans several.
"""

from __future__ import annotations

import errno

import pytest
import torch

from engine.base.config import EngineConfig
from engine.run import kv_store
from engine.run.generate import Sampler, generate
from engine.run.runtime import Engine
from colibri_hf_models import ARCHS, build
from colibri_tiny import TINY, make_tiny
from engine import synth

TOL = 1e-5
CTX = 128
BLOCK = 8
P1 = [(7 * i + 3) % 256 for i in range(40)]          # 5 blocks
P2 = P1[:37] + [11, 12, 13, 14, 15, 16]               # shares 37 tokens: 4 whole blocks
OTHER = [(5 * i + 1) % 256 for i in range(30)]       # shares nothing: clobbers the live cache


def engine_for(d, prefix=True, kv_dir=None, disk=0, capacity=64 << 20, **kw):
    config = EngineConfig(ctx_size=CTX, dtype="fp32", threads=1, prefix_cache=capacity if prefix else 0, **kw)
    engine = Engine(d, config, kv_dir=kv_dir, kv_disk_bytes=disk)
    if engine.prefix is not None:
        engine.prefix.block_tokens = BLOCK
    return engine


def reference(d, prompt, n=6, **kw):
    """Full recompute: logits of every position and the greedy continuation, no reuse at all."""
    with engine_for(d, prefix=False, **kw) as e:
        logits = e.forward(prompt, 0)
    with engine_for(d, prefix=False, **kw) as e:
        tokens = generate(e, prompt, n, Sampler()).output_ids
    return logits, tokens


def reused_logits(engine, prompt):
    """(positions reused, logits of the rest) as generation computes them."""
    m = engine.restore_prefix(prompt)
    return m, engine.forward(prompt[m:], m)

def restored_after_another_prompt(e, want, want_tokens, p1_tokens: int = 4) -> int:
    """P1, then OTHER (it takes the live cache), then P2 restored from the RAM blocks: its logits are
    the full recompute's past the reused m positions, and after OTHER again its greedy tokens are
    too. Returns m."""
    generate(e, P1, p1_tokens, Sampler())
    generate(e, OTHER, 2, Sampler())
    m, got = reused_logits(e, P2)
    assert_close(got, want[m:])
    generate(e, OTHER, 2, Sampler())
    assert generate(e, P2, 6, Sampler()).output_ids == want_tokens
    return m


def assert_close(got, want):
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max |dlogit| {diff:.2e}"


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_dir(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    build(request.param, d)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny") / "tiny")


def test_reused_prefix_equals_recompute_every_architecture(arch_dir):
    want, want_tokens = reference(arch_dir, P2)
    with engine_for(arch_dir) as e:
        generate(e, P1, 4, Sampler())
        # 1. the live cache: the previous sequence's positions, token by token
        m, got = reused_logits(e, P2)
        assert m == 37
        assert_close(got, want[m:])
        # 2. RAM blocks, after another prompt took the live cache
        generate(e, OTHER, 2, Sampler())
        m, got = reused_logits(e, P2)
        assert m == 32  # 4 whole blocks; the 5th diverges inside
        assert_close(got, want[m:])
        generate(e, OTHER, 2, Sampler())
        gen = generate(e, P2, 6, Sampler())
        assert gen.cached_tokens == 32 and gen.output_ids == want_tokens


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm_moe_dsa"])
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_codes_and_scales_restore(arch, kv_dtype, tmp_path):
    build(arch, tmp_path)
    want, want_tokens = reference(tmp_path, P2, kv_dtype=kv_dtype)
    with engine_for(tmp_path, kv_dtype=kv_dtype) as e:
        assert restored_after_another_prompt(e, want, want_tokens) == 32


def test_sliding_window_moved_past_the_cached_part(tmp_path):
    """gpt_oss, window 8: the restored prefix (32 tokens) lies mostly outside the window of the
    suffix's queries; every layer keeps every position, so the window's part is there."""
    build("gpt_oss", tmp_path, sliding_window=8)
    want, want_tokens = reference(tmp_path, P2)
    with engine_for(tmp_path) as e:
        assert all(k.shape[1] == CTX for k in e.kv.k)  # per position, not a ring of 8
        assert restored_after_another_prompt(e, want, want_tokens) == 32 > 8


def test_prefix_diverging_inside_a_block(tiny):
    prompt = P1[:20] + [200, 201, 202, 203, 204, 205]  # diverges in block 2 (tokens 16..23)
    want, _ = reference(tiny, prompt)
    with engine_for(tiny) as e:
        generate(e, P1, 2, Sampler())
        m, got = reused_logits(e, prompt)  # live: token by token
        assert m == 20
        assert_close(got, want[m:])
        generate(e, OTHER, 2, Sampler())
        m, got = reused_logits(e, prompt)  # blocks: the one it diverges in is recomputed
        assert m == 16
        assert_close(got, want[m:])


def test_whole_prompt_cached_still_recomputes_its_last_token(tiny):
    prompt = P1[:32]
    want, _ = reference(tiny, prompt)
    with engine_for(tiny) as e:
        generate(e, prompt, 3, Sampler())
        generate(e, OTHER, 2, Sampler())
        m, got = reused_logits(e, prompt)
        assert m == 24  # 31 reusable positions, 3 whole blocks
        assert_close(got, want[m:])


def test_eviction_under_a_tiny_cache(tiny):
    with engine_for(tiny) as probe:
        probe.prefix.block_tokens = BLOCK
        generate(probe, P1, 1, Sampler())
        block = next(iter(probe.prefix.blocks.values())).nbytes
    want, _ = reference(tiny, P2)
    with engine_for(tiny, capacity=2 * block) as e:
        generate(e, P1, 1, Sampler())
        p = e.prefix
        assert len(p.blocks) == 2 and p.used <= 2 * block and p.stats["evicted_blocks"] == 3
        assert [b.start for b in p.blocks.values()] == [8, 0]  # the first blocks stay: they lead to the rest
        generate(e, OTHER, 1, Sampler())  # evicts again: OTHER's 3 blocks take the room
        generate(e, P1[:16] + [9] * 5, 1, Sampler())  # P1's first 2 blocks back (recomputed), LRU
        m, got = reused_logits(e, P2)
        assert m == 16 and p.used <= 2 * block
        assert_close(got, want[m:])


def test_off_by_default_and_with_zero():
    assert EngineConfig().prefix_cache == 0


def test_zero_disables_reuse(tiny):
    with engine_for(tiny, prefix=False) as e:
        assert e.prefix is None
        generate(e, P1, 2, Sampler())
        assert e.restore_prefix(P1) == 0
        assert generate(e, P1, 2, Sampler()).cached_tokens == 0
        assert "prefix cache" in e.plan.describe()


def test_plan_charges_the_prefix_cache(tiny):
    with engine_for(tiny, capacity=3 << 20) as e:
        assert e.plan.prefix_cache_bytes == 3 << 20


# --- the SSD tier ---------------------------------------------------------------------------------

def fill_disk(model, kv_dir, prompt=P1, disk=64 << 20, **kw):
    with engine_for(model, kv_dir=kv_dir, disk=disk, **kw) as e:
        generate(e, prompt, 2, Sampler())
        store = e.prefix.store
    return store


def test_restore_after_restart_from_the_ssd(tiny, tmp_path):
    want, want_tokens = reference(tiny, P2)
    store = fill_disk(tiny, tmp_path)
    files = sorted(store.dir.glob("*.kv.safetensors"))
    assert len(files) == 5  # written when the engine closed
    with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20) as e:  # a new engine: nothing in RAM
        assert not e.prefix.blocks
        m, got = reused_logits(e, P2)
        assert m == 32 and e.prefix.store.read_bytes > 0
        assert_close(got, want[m:])
    with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20) as e:
        assert generate(e, P2, 6, Sampler()).output_ids == want_tokens


@pytest.fixture
def disk_model(tiny, tmp_path):
    """A kv dir holding P1's 5 blocks, and their files in chain order."""
    with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20) as e:
        generate(e, P1, 2, Sampler())
        chain = e.prefix.chain(P1, 5)
        store = e.prefix.store
    return tmp_path, [store.path(key) for key, *_ in chain]


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "header", "empty"])
def test_a_damaged_file_is_skipped_with_one_warning(tiny, disk_model, damage, capsys):
    kv_dir, files = disk_model
    raw = files[2].read_bytes()
    if damage == "corrupt":
        files[2].write_bytes(raw[:-5] + bytes([raw[-5] ^ 0xFF]) + raw[-4:])
    elif damage == "truncated":
        files[2].write_bytes(raw[:len(raw) // 2])
    elif damage == "header":
        files[2].write_bytes(b"\xff" * 8 + raw[8:])
    else:
        files[2].write_bytes(b"")
    want, _ = reference(tiny, P2)
    capsys.readouterr()
    with engine_for(tiny, kv_dir=kv_dir, disk=64 << 20) as e:
        m, got = reused_logits(e, P2)
        assert m == 16  # blocks 0 and 1; block 2 skipped, everything after it recomputed
        assert_close(got, want[m:])
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "KV file skipped" in err and "Traceback" not in err


def test_a_foreign_models_file_is_skipped(tiny, disk_model, tmp_path_factory, capsys):
    """Another model's block (same geometry, other weights) under this model's expected name."""
    kv_dir, files = disk_model
    other = synth.synthesize(TINY, tmp_path_factory.mktemp("other") / "tiny", seed=1, progress=False)
    other_dir = tmp_path_factory.mktemp("otherkv")
    with engine_for(other, kv_dir=other_dir, disk=64 << 20) as e:
        generate(e, P1, 2, Sampler())
        foreign = e.prefix.store.path(e.prefix.chain(P1, 1)[0][0])
    assert foreign.name != files[0].name  # the model is in the key: its names differ
    files[0].write_bytes(foreign.read_bytes())
    want, _ = reference(tiny, P2)
    capsys.readouterr()
    with engine_for(tiny, kv_dir=kv_dir, disk=64 << 20) as e:
        m, got = reused_logits(e, P2)
        assert m == 0
        assert_close(got, want)
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "foreign or stale" in err


def test_the_disk_bound_holds(tiny, tmp_path):
    store = fill_disk(tiny, tmp_path, disk=1 << 30)
    one = max(f.stat().st_size for f in store.dir.glob("*.kv.safetensors"))
    bound = int(2.5 * one)
    with engine_for(tiny, kv_dir=tmp_path / "b", disk=bound, capacity=one // 2) as e:  # RAM holds nothing
        for i in range(4):
            generate(e, [(i * 31 + j) % 256 for j in range(33)], 1, Sampler())
            assert e.prefix.store.used_bytes <= bound
        files = list(e.prefix.store.dir.glob("*.kv.safetensors"))
        assert len(files) == 2 and sum(f.stat().st_size for f in files) <= bound


def test_a_full_disk_degrades_to_ram_only(tiny, tmp_path, monkeypatch, capsys):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kv_store, "write_file", full)
    want, want_tokens = reference(tiny, P2)
    capsys.readouterr()
    with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20, capacity=1) as e:  # every block spills
        generate(e, P1, 2, Sampler())
        assert not e.prefix.store.enabled
        assert generate(e, P2, 6, Sampler()).output_ids == want_tokens
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "disk full" in err


def test_a_second_process_on_the_directory_runs_ram_only(tiny, tmp_path, capsys):
    with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20) as a:
        with engine_for(tiny, kv_dir=tmp_path, disk=64 << 20) as b:
            assert a.prefix.store.enabled and not b.prefix.store.enabled
    assert "in use by another process" in capsys.readouterr().err


def test_kv_files_are_safetensors_with_our_metadata(disk_model):
    from safetensors import safe_open
    _, files = disk_model
    with safe_open(str(files[1]), "pt") as f:  # the reference reader takes them
        meta = f.metadata()
        assert "colibri_kv" in meta and len(list(f.keys())) > 0
    parsed, tensors = kv_store.decode(files[1], None, 1 << 30)
    assert parsed["start"] == BLOCK and parsed["tokens"] == P1[BLOCK:2 * BLOCK] and parsed["format"] == kv_store.FORMAT


# --- run --prompt-cache FILE ----------------------------------------------------------------------

def _run(model, cache, prompt, capsys):
    from colibri import cli
    import json
    capsys.readouterr()
    rc = cli.main(["run", "--model", str(model), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4",
                   "--ctx-size", str(CTX), "--dtype", "fp32", "--threads", "1", "--json", "--prompt-cache", str(cache)])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out), out.err


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_run_prompt_cache_saves_and_restores(arch, tmp_path, capsys):
    model = tmp_path / "m"
    build(arch, model)
    cache = tmp_path / "prompt.kv"
    first, _ = _run(model, cache, P1, capsys)
    assert first["cached_tokens"] == 0 and cache.is_file()
    again, _ = _run(model, cache, P1, capsys)
    assert again["cached_tokens"] == len(P1) - 1 and again["output_ids"] == first["output_ids"]
    _, want_tokens = reference(model, P2, n=4)
    other, _ = _run(model, cache, P2, capsys)  # token granular: the 37 shared tokens
    assert other["cached_tokens"] == 37 and other["output_ids"] == want_tokens


def test_run_prompt_cache_damaged_or_foreign_is_skipped(tiny, tmp_path, capsys):
    cache = tmp_path / "prompt.kv"
    first, _ = _run(tiny, cache, P1, capsys)
    raw = cache.read_bytes()
    cache.write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    again, err = _run(tiny, cache, P1, capsys)
    assert again["cached_tokens"] == 0 and again["output_ids"] == first["output_ids"]
    assert err.count("warning") == 1 and "checksum" in err
    other = synth.synthesize(TINY, tmp_path / "other", seed=1, progress=False)
    _run(other, cache, P1, capsys)  # the file now holds the other model's prompt
    mine, err = _run(tiny, cache, P1, capsys)
    assert mine["cached_tokens"] == 0 and mine["output_ids"] == first["output_ids"] and "foreign or stale" in err


def test_run_prompt_cache_refuses_a_file_it_did_not_write(tiny, tmp_path, capsys):
    from colibri import cli
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    rc = cli.main(["run", "--model", str(tiny), "--prompt-tokens", "3", "--max-new-tokens", "1", "--ctx-size", "16",
                   "--prompt-cache", str(notes)])
    assert rc == 2 and notes.read_text() == "mine"


def test_the_budget_pays_for_the_prefix_cache(tmp_path):
    """Under a budget the prefix cache is a fixed part: the expert cache gets that much less."""
    from engine.api import Checkpoint, ExpertLayout, make_plan, model_args
    model = make_tiny(tmp_path / "m")
    ckpt = Checkpoint(model)
    args = model_args(ckpt.config)
    layout = ExpertLayout(ckpt, args)
    def plan(budget, prefix=0):
        # A set prefill group: the default one shrinks with what the budget leaves, which would
        # hide what the prefix cache takes from the expert cache.
        config = EngineConfig(ram_budget=budget, ctx_size=CTX, dtype="fp32", prefix_cache=prefix, prefill_chunk=32)
        return make_plan(ckpt, args, layout, config, torch.float32, torch.float32, overhead_bytes=8 << 20)

    p = plan(1 << 30)
    fixed = p.dense_bytes + p.kv_bytes + p.buffer_bytes + p.overhead_bytes + p.prefill_bytes
    budget = fixed + p.routed_experts * p.cache_entry_bytes // 2  # room for half the experts
    off, on = plan(budget), plan(budget, prefix=budget - fixed - 3 * p.cache_entry_bytes)
    assert on.prefix_cache_bytes > 0 == off.prefix_cache_bytes
    assert off.cache_bytes - on.cache_bytes >= on.prefix_cache_bytes - on.cache_entry_bytes
    assert on.cache_slots == 3
    with pytest.raises(Exception, match="prefix cache"):
        plan(budget, prefix=budget)


def test_streamed_experts_reuse_equals_resident_recompute(tiny):
    """Placement does not change a restored prefix: experts streamed under a budget, blocks restored."""
    want, want_tokens = reference(tiny, P2)
    # The budget from an engine's own plan, made just before in this process: its runtime overhead is
    # this process's RSS as an engine measures it (a long suite's RSS is far above a fresh one's).
    with engine_for(tiny, capacity=8 << 20, ram_budget=1 << 40, io_mode="buffered") as sizing:
        probe = sizing.plan
    fixed = (probe.dense_bytes + probe.kv_bytes + probe.buffer_bytes + probe.overhead_bytes + probe.prefill_bytes
             + probe.prefix_cache_bytes)
    budget = fixed + 64 * probe.cache_entry_bytes + (64 << 20)  # a few experts; RSS grows meanwhile
    with engine_for(tiny, capacity=8 << 20, ram_budget=budget, io_mode="buffered") as e:
        assert e.plan.streaming
        assert restored_after_another_prompt(e, want, want_tokens, p1_tokens=2) == 32
