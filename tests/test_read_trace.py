"""The read-trace recorder (engine/movement/io/trace.py) and its replays (benchmarks/io/io_jobs.py, io_bound.py)."""

import json
import os
import shutil
import subprocess
import sys

import psutil
import pytest

import engine.movement.io.trace as trace_mod
from benchmarks.io import io_bound
from benchmarks.io.io_jobs import IOLOG_HEADER, iolog_bytes, job_iologs, outstanding_fraction, replay, split_window
from engine.run.bench import run_bench
from engine.base.config import EngineConfig
from engine.movement.io import ReadPool
from engine.movement.io.trace import read_trace, write_trace
from engine.movement.plan import ACTIVATION_MARGIN
from engine.run.runtime import Engine
from colibri_hf_models import build
from colibri_requirements import needs

LAYERS = 3
FIO = shutil.which("fio")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace")
    build("qwen3_moe", d, num_hidden_layers=LAYERS, moe_intermediate_size=128, hidden_size=64, mlp_only_layers=[],
          max_shard_size="200KB")
    return d


def streaming_config(model_dir, **kw) -> EngineConfig:
    """A budget that streams (the dense part and a few experts fit; most experts do not)."""
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, cpu_cache_ratio=0.3, **kw)
    with Engine(model_dir, config.replace(ram_budget=0)) as resident:
        plan = resident.plan
    fixed = (plan.dense_bytes + plan.kv_bytes + plan.buffer_bytes + psutil.Process().memory_info().rss
             + ACTIVATION_MARGIN + plan.prefill_bytes)
    return config.replace(ram_budget=fixed + int(4 * plan.expert_bytes / 0.3) + (1 << 20))


@pytest.mark.parametrize("io_mode,chunk", [("direct", 65536), ("buffered", 1 << 20), ("mmap", 65536)])
def test_trace_holds_exactly_the_reads_the_engine_counted(model_dir, tmp_path, io_mode, chunk):
    config = streaming_config(model_dir, io_mode=io_mode, chunk_size=chunk)
    path = tmp_path / "trace.jsonl"
    result = run_bench(model_dir, config, tokens=4, repeats=2, cold=True, prompt_tokens=4, read_trace=str(path))
    assert result["plan"]["streaming"]
    head, records = read_trace(path)
    assert (head["io_mode"], head["io_threads"], head["chunk_size"], head["tokens"]) == (io_mode, 2, chunk, 4)
    assert result["read_trace"]["reads"] == len(records)
    shards = {str(p) for p in model_dir.glob("*.safetensors")}
    for rep, run in enumerate(result["runs"]):
        mine = [r for r in records if r["repeat"] == rep]
        assert mine, "a cold repeat reads experts"
        # Every byte the pool counted is in the trace, and nothing else.
        assert sum(r["nbytes"] for r in mine) == run["bytes_read"]
        # Split as the pool splits: one trace record's pieces are exactly the pool's requests.
        pieces = sum(len(split_window(r["offset"], r["nbytes"], 2, chunk, io_mode == "direct")) for r in mine)
        assert pieces == run["read_requests"]
        for r in mine:
            assert r["file"] in shards
            assert 0 <= r["token"] < 4 and 0 <= r["layer"] < LAYERS
            assert r["complete_s"] >= r["submit_s"]
            assert r["offset"] <= r["span_offset"] and r["span_offset"] + r["span_length"] <= r["offset"] + r["nbytes"]
        assert 0 < outstanding_fraction(mine, head["window_s"][rep]) <= 1
    assert head["bytes_read"] == [run["bytes_read"] for run in result["runs"]]


def test_tracing_off_adds_no_recorder(model_dir, monkeypatch):
    class Refused:
        def __init__(self, *a, **k):
            raise AssertionError("a recorder was built with tracing off")

    monkeypatch.setattr(trace_mod, "ReadTrace", Refused)
    config = streaming_config(model_dir, io_mode="buffered")
    result = run_bench(model_dir, config, tokens=2, repeats=1, cold=True, prompt_tokens=4)
    assert "read_trace" not in result and result["runs"][0]["bytes_read"] > 0
    with Engine(model_dir, config) as engine:
        assert engine.store.streams and engine.store.tracer is None


@pytest.mark.parametrize("size", [4096, 65536, 65536 + 4096, 3 << 20, (3 << 20) + 12288])
def test_split_window_is_the_pools_split(size):
    with ReadPool("buffered", io_threads=3, chunk_size=1 << 20) as pool:
        expected = [(lo, hi - lo) for lo, hi in pool._pieces(8192, 8192 + size)]
    assert split_window(8192, size, 3, 1 << 20, direct=False) == expected


def records_of(path, reads: int, nbytes: int, tokens: int):
    return [{"file": str(path), "offset": i * nbytes, "nbytes": nbytes, "token": i * tokens // reads,
             "submit_s": i * 1e-3} for i in range(reads)]


def test_iologs_are_fio_v3_lines(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(8 << 20))
    logs = job_iologs(records_of(f, 8, 1 << 20, tokens=2), jobs=2, io_threads=2, chunk_size=4 << 20, direct=True,
                      gap_s=0.01)
    assert len(logs) == 2
    for text in logs:
        lines = text.splitlines()
        assert lines[0] == IOLOG_HEADER
        reads = [line.split() for line in lines if " read " in line]
        assert len(reads) == 4  # dealt round-robin
        stamps = [int(line.split()[0]) for line in lines[1:]]
        assert stamps == sorted(stamps) and stamps[0] >= 1
        for t, name, act, off, length in reads:
            assert name == str(f) and int(off) % 4096 == 0 and int(length) == 1 << 20
        # Two tokens: each job's first read of a token waits the 10 ms gap (fio's delays are in us).
        assert sorted({int(r[0]) for r in reads}) == [1 + 10_000, 1 + 20_000]


@pytest.mark.skipif(FIO is None, reason=needs("fio", "fio is not installed (scripts/setup.sh installs it)"))
@pytest.mark.parametrize("no_stall", [False, True])
def test_fio_replays_the_iologs(tmp_path, no_stall):
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom((4 << 20) + 1000))  # a shard's end is not block aligned
    tokens, gap = 5, 0.02
    # The last expert's O_DIRECT window runs past the end of the file: cut at the last whole block.
    tail = {"file": str(f), "offset": (4 << 20) - 4096, "nbytes": 8192, "token": tokens - 1, "submit_s": 1.0}
    logs = job_iologs(records_of(f, 10, 256 << 10, tokens) + [tail], jobs=2, io_threads=2, chunk_size=4 << 20,
                      direct=True, gap_s=0.0 if no_stall else gap, passes=2)
    out = replay(FIO, logs, "direct", None, [f], no_stall=no_stall)
    assert out["bytes"] == iolog_bytes(logs) == 2 * (10 * (256 << 10) + 4096)  # every read of both passes
    if not no_stall:  # fio sleeps each token's gap: the replay cannot be shorter than the gaps
        assert out["seconds"] >= 0.9 * 2 * tokens * gap


def test_a_bad_trace_is_one_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"format": "something else"}) + "\n")
    with pytest.raises(ValueError, match="not a colibri-read-trace"):
        read_trace(bad)
    good = tmp_path / "t.jsonl"
    write_trace(good, {"tokens": 1}, [{"file": "x"}])
    with pytest.raises(ValueError, match="line 2 is not a read record"):
        read_trace(good)
    for command in ("replay", "pool"):  # refused before anything runs, fio installed or not
        assert io_bound.main([command, str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("io_bound: error:") and "not a colibri-read-trace" in err


def test_bench_refuses_an_unwritable_trace_path(tmp_path):
    run = subprocess.run([sys.executable, "-m", "colibri.cli", "bench", "--model", str(tmp_path), "--read-trace",
                          str(tmp_path / "missing" / "t.jsonl")], capture_output=True, text=True)
    assert run.returncode == 2 and "--read-trace" in run.stderr and "Traceback" not in run.stderr


def _small_trace(tmp_path):
    """A direct-mode trace of 8 unaligned spans of one file, 4 tokens."""
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(2 << 20))
    spans = [(i * 196608 + 100, 150000) for i in range(8)]  # unaligned, as expert spans are
    records = [{"file": str(f), "offset": off - off % 4096, "nbytes": -(-(off + n) // 4096) * 4096 - off + off % 4096,
                "span_offset": off, "span_length": n, "submit_s": i * 1e-3, "complete_s": i * 1e-3 + 1e-4,
                "token": i // 2, "layer": 0, "repeat": 0} for i, (off, n) in enumerate(spans)]
    path = tmp_path / "t.jsonl"
    write_trace(path, {"io_mode": "direct", "io_mode_effective": "direct", "io_threads": 2, "chunk_size": 65536,
                       "tokens": 4, "window_s": [0.01]}, records)
    return path, spans, records


def test_pool_replay_reads_every_traced_byte_through_the_engine_reader(tmp_path):
    from benchmarks.io.io_jobs import pool_replay
    path, spans, records = _small_trace(tmp_path)
    out = pool_replay(path, gap_s=0.01, passes=2)
    assert out["span_bytes"] == 2 * sum(n for _, n in spans)
    assert out["bytes"] == 2 * sum(r["nbytes"] for r in records)  # the O_DIRECT windows, as the engine counts
    assert out["seconds"] >= 0.9 * 2 * 4 * 0.01  # each token waited its gap


def test_io_bound_pool_prints_the_bench_document(tmp_path, capsys):
    path, _, records = _small_trace(tmp_path)
    assert io_bound.main(["pool", str(path), "--passes", "1", "--repeats", "2", "--gap-s", "0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "colibri.bench/1" and doc["tool"] == "io_bound" and doc["conditions"]["repeats"] == 2
    assert [r["reader"] for r in doc["rows"]] == ["engine pool", "engine pool"]
    assert all(r["bytes"] == sum(x["nbytes"] for x in records) for r in doc["rows"])
    assert "8 reads" in doc["notes"]["trace"]
