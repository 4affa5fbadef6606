"""Quantized containers: the math, the kernels, convert, the engine on containers, bad containers."""

import json
import struct
import subprocess
import sys

import pytest
import torch

from engine import native
from engine.format.checkpoint import Checkpoint
from engine.base.config import EngineConfig
from engine.format.container import container_spec
from engine.format.convert import Converter, convert
from engine.run.generate import Sampler, generate
from engine.weights.quantized import (
    INT4_MID, KERNEL_INT4_STRIPS, QuantWeight, dequantize_int4, dequantize_int8, kernel_works, pack_int4, quantize_int4,
    quantize_int8, stored_int4_is_native, unpack_int4,
)
from engine.run.runtime import Engine
from test_streaming import PLACEMENTS, budget_for_cache, model_dir  # noqa: F401 (a fixture)

PROMPT = [(5 * i + 11) % 256 for i in range(12)]
NEW_TOKENS = 8


def _weights(n=256, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[::17, ::13] *= 12  # outliers, as trained weights have: they stretch their groups' range
    return w


# --- quantize / dequantize ------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_round_trip_within_half_a_step_per_group(group):
    w = _weights()
    packed, sz = quantize_int4(w, group)
    assert packed.dtype == torch.uint8 and packed.shape == (256, 256)
    assert sz.dtype == torch.bfloat16 and sz.shape == (512 // group, 256, 2)
    err = (dequantize_int4(packed, sz, group) - w).abs().reshape(256, -1, group).amax(-1)  # [N, G]
    scale, zero = sz.float()[..., 0].T, sz.float()[..., 1].T
    # Bound: half a quantization step, plus what rounding the zero point to bf16 can shift the
    # grid by (2^-8 relative) at the clamped ends of a group.
    bound = 0.5 * scale + zero.abs() * 2.0 ** -8 + 1e-7
    assert bool((err <= bound).all()), float((err - bound).max())
    # Coarser groups have wider ranges, so a larger mean error: the group size really is used.
    assert err.mean() > 0


def test_int4_error_grows_with_group_size():
    w = _weights()
    errs = [(dequantize_int4(*quantize_int4(w, g), g) - w).pow(2).mean() for g in (32, 64, 128)]
    assert errs[0] < errs[1] < errs[2]


def test_int8_round_trip_within_half_a_step_per_row():
    w = _weights()
    codes, scale = quantize_int8(w)
    assert codes.dtype == torch.int8 and scale.shape == (256,)
    err = (dequantize_int8(codes, scale) - w).abs().amax(1)
    assert bool((err <= 0.5 * scale.float() + 1e-7).all())
    assert int(codes.abs().max()) == 127  # the row's absmax maps to the end of the range


@pytest.mark.parametrize("n", [128, 96, 32])
def test_int4_blocked_layout_round_trips_and_is_torch_avx512_layout(n):
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    packed = pack_int4(codes)
    assert packed.shape == (n, 32)
    assert torch.equal(unpack_int4(packed), codes)
    if stored_int4_is_native():  # the stored bytes are the kernel's operand on this CPU
        native = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
        assert torch.equal(native, packed)


# --- kernels vs the dequantized reference ---------------------------------------------------

@pytest.mark.parametrize("quant,group", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_equals_dequantized_matmul(quant, group, dtype):
    w = _weights()
    stored = quantize_int8(w) if quant == "int8" else quantize_int4(w, group)
    packed = QuantWeight.prepare(*stored, quant, group, dtype)
    fallback = QuantWeight.prepare(*stored, quant, group, dtype, packed_kernel=False)
    assert fallback.kernel == "dequantize+linear"
    if quant == "int4" and native.load() is None and native.int_ready:
        assert packed.kernel == KERNEL_INT4_STRIPS  # engine/native's, for decode and prefill alike
    elif kernel_works(quant, 256, 512, group, dtype):
        assert packed.kernel.startswith("aten._weight_int")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ (dequantize_int8(*stored) if quant == "int8" else dequantize_int4(*stored, group)).double().T
    # Tolerance: fp32 accumulation order (1e-5 of the output's scale); bf16 activations and
    # outputs carry 8 bits of mantissa, so 2^-7 of the scale. The strips quantize x to int8 per
    # 32 inputs (Q8_0's activations): <= max|x_b| / 254 an element, ~5e-3 of the scale.
    for qw in (packed, fallback):
        tol = 1.2e-2 if qw.kernel == KERNEL_INT4_STRIPS else 1e-5 if dtype == torch.float32 else 2.0 ** -7
        assert float((qw.linear(x).double() - ref).abs().max()) <= tol * float(ref.abs().max()), qw.kernel


# --- convert ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def src(model_dir):
    """The streaming tests' model (3 layers, 8 experts of 128x64, sharded so experts straddle shards)."""
    return model_dir


@pytest.fixture(scope="module")
def containers(src, tmp_path_factory):
    root = tmp_path_factory.mktemp("qdst")
    return {label: convert(src, root / label, q, g)["path"] for label, q, g in
            [("int8", "int8", 0), ("int4-g32", "int4", 32), ("int4-g64", "int4", 64)]}


def _files(d):
    return {p.name: p.read_bytes() for p in sorted(__import__("pathlib").Path(d).iterdir())}


def test_convert_is_deterministic(src, containers, tmp_path):
    again = convert(src, tmp_path / "again", "int4", 32)["path"]
    assert _files(again) == _files(containers["int4-g32"])


def test_container_is_stamped_and_each_expert_is_one_range(containers):
    ckpt = Checkpoint(containers["int4-g64"])
    spec = container_spec(ckpt)
    assert (spec.quant, spec.group_size, spec.scope) == ("int4", 64, "experts")
    with Engine(containers["int4-g64"], EngineConfig(threads=1, ctx_size=64)) as engine:
        locations = [engine.layout.location(*k) for k in engine.layout.keys()]
        assert all(len(loc.spans) == 1 for loc in locations)
        # 3 x (codes + scales_zeros): gate/up [128x64] and down [64x128] at 4 bits, g64
        assert engine.layout.expert_nbytes == 2 * (128 * 32 + 1 * 128 * 2 * 2) + (64 * 64 + 2 * 64 * 2 * 2)
        # The plan and the cache count what an expert takes in RAM: codes as stored, scales in
        # the compute dtype (fp32 here, twice the stored bf16); the int4 strips (engine/native's,
        # where its int kernels load) hold the bytes as stored, bf16 scales inside.
        scales = 512 if native.load() is None and native.int_ready else 2 * 512
        assert engine.plan.expert_bytes == 3 * 4096 + 3 * scales


def test_convert_resumes_keeping_checked_shards(src, containers, tmp_path, monkeypatch):
    dst = tmp_path / "resumed"
    real = Converter.write_shard
    calls = []

    def interrupted(self, path, items, progress=None):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(path.name)
        return real(self, path, items, progress)

    monkeypatch.setattr(Converter, "write_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, "int4", 32)
    assert not dst.exists()  # nothing half-written where the result goes
    partial = tmp_path / "resumed.partial"
    done = sorted(p.name for p in partial.glob("*.safetensors"))
    assert len(done) == 3
    # Damage one finished shard: the check must catch it and rewrite just that one.
    victim = partial / done[0]
    victim.write_bytes(victim.read_bytes()[:-1] + b"\x01")
    monkeypatch.setattr(Converter, "write_shard", real)
    events = []
    summary = convert(src, dst, "int4", 32, progress=lambda e, **f: events.append((e, f)))
    assert summary["shards_kept"] == 2
    assert ("check", {"name": done[0], "ok": False}) in events
    assert _files(dst) == _files(containers["int4-g32"])


def test_convert_discards_partial_made_with_other_options(src, tmp_path, monkeypatch):
    dst = tmp_path / "other"
    real = Converter.write_shard
    monkeypatch.setattr(Converter, "write_shard", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt)
                        if list((tmp_path / "other.partial").glob("*.safetensors")) else real(*a, **k))
    with pytest.raises(KeyboardInterrupt):
        convert(src, dst, "int8")
    monkeypatch.setattr(Converter, "write_shard", real)
    events = []
    summary = convert(src, dst, "int4", 64, progress=lambda e, **f: events.append(e))
    assert "discard" in events and summary["shards_kept"] == 0


# --- the engine on containers ---------------------------------------------------------------

@pytest.mark.parametrize("label", ["int8", "int4-g32", "int4-g64"])
def test_engine_on_container_equals_dequantized_experts(containers, label):
    with Engine(containers[label], EngineConfig(threads=1, ctx_size=64)) as engine:
        strips = label.startswith("int4") and native.int_ready
        # prefill: torch's packed kernels, decode may be native (engine/native); int4: the strips for both
        assert (KERNEL_INT4_STRIPS if strips else "aten._weight_int") in engine.kernel
        logits = engine.forward(PROMPT, 0)
        store = engine.experts._experts
        for key, ws in store.items():  # dequantized, or the strips' float64 reference (their int8 activations)
            store[key] = tuple(w.reference() for w in ws)
        reference = engine.forward(PROMPT, 0)
    assert float((logits - reference).abs().max()) <= 1e-4 * float(reference.abs().max())


def test_scope_all_quantizes_dense_linears(src, tmp_path):
    out = convert(src, tmp_path / "all", "int8", scope="all")["path"]
    ckpt = Checkpoint(out)
    assert "model.layers.0.self_attn.q_proj.qweight" in ckpt and "lm_head.qweight" in ckpt
    assert "model.embed_tokens.weight" in ckpt and "model.layers.0.mlp.gate.weight" in ckpt
    with Engine(out, EngineConfig(threads=1, ctx_size=64)) as engine, \
            Engine(src, EngineConfig(threads=1, ctx_size=64)) as plain:
        assert engine.plan.dense_bytes < plain.plan.dense_bytes / 2
        q, r = engine.forward(PROMPT, 0), plain.forward(PROMPT, 0)
    # int8 per-row on every linear: close to the fp32 model, not equal.
    assert 0 < float((q - r).abs().max()) < 0.1 * float(r.abs().max())


@pytest.fixture(scope="module")
def container_reference(containers):
    out = {}
    for label in ("int8", "int4-g64"):
        with Engine(containers[label], EngineConfig(threads=1, ctx_size=64)) as engine:
            out[label] = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
    return out


QUANT_PLACEMENTS = PLACEMENTS[::7]  # every io mode, chunk size, prefetch depth, ratio and policy appear


@pytest.mark.parametrize("label", ["int8", "int4-g64"])
@pytest.mark.parametrize("placement", QUANT_PLACEMENTS, ids=lambda p: "-".join(str(v) for v in p.values()))
def test_placement_never_changes_tokens_on_containers(containers, container_reference, label, placement,
                                                      tmp_path_factory):
    model = containers[label]
    hist = tmp_path_factory.getbasetemp() / f"hist-{label}.json"
    if not hist.exists():
        from engine.run.bench import run_bench
        run_bench(model, EngineConfig(threads=1, ctx_size=64), tokens=4, repeats=1, cold=False,
                  record_routing=str(hist))
    config = EngineConfig(threads=1, ctx_size=64, io_threads=2, routing_histogram=str(hist), **placement)
    config = config.replace(ram_budget=budget_for_cache(model, config, cache_experts=6))
    with Engine(model, config) as engine:
        assert engine.plan.streaming
        # The cache counts quantized bytes: the plan's expert size is the container's, not fp32's.
        assert engine.plan.expert_bytes < 3 * 64 * 128 * 4 / 2
        tokens = generate(engine, PROMPT, NEW_TOKENS, Sampler()).output_ids
        stats = engine.io_stats()
    assert tokens == container_reference[label]
    assert stats["bytes_read"] > 0


# --- bad containers: one line, exit code 2 ----------------------------------------------------

def _rewrite_shard(path, edit):
    """Rewrite a safetensors file after edit(header, data) changes entries or metadata."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    data = {k: raw[base + v["data_offsets"][0]: base + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}
    edit(header, data)
    out, offset, blobs = {"__metadata__": header.get("__metadata__", {})}, 0, []
    for k in sorted(data, key=lambda k: header[k]["data_offsets"][0]):
        out[k] = {"dtype": header[k]["dtype"], "shape": header[k]["shape"], "data_offsets": [offset, offset + len(data[k])]}
        offset += len(data[k])
        blobs.append(data[k])
    js = json.dumps(out).encode()
    path.write_bytes(struct.pack("<Q", len(js)) + js + b"".join(blobs))


def _copy(container, tmp_path):
    import shutil
    dst = tmp_path / "bad"
    shutil.copytree(container, dst)
    return dst


def _shard_with(d, name):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    return d / index["weight_map"][name], index


def _run_cli(model):
    proc = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(model), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "1"], capture_output=True, text=True)
    return proc.returncode, proc.stderr.strip()


EXPERT = "model.layers.1.mlp.experts.3.up_proj"


def _drop_scales(d):
    shard, index = _shard_with(d, EXPERT + ".qscale")
    _rewrite_shard(shard, lambda h, data: (h.pop(EXPERT + ".qscale"), data.pop(EXPERT + ".qscale")))
    del index["weight_map"][EXPERT + ".qscale"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _misshape_scales(d):
    shard, _ = _shard_with(d, EXPERT + ".qscale")

    def edit(h, data):
        e = h[EXPERT + ".qscale"]
        e["shape"] = [e["shape"][1], e["shape"][0], 2]  # [N, G, 2] instead of [G, N, 2]: same bytes
    _rewrite_shard(shard, edit)


def _stamp(field, value):
    def apply(d):
        for shard in d.glob("*.safetensors"):
            _rewrite_shard(shard, lambda h, data: h["__metadata__"].update({field: value}))
        config = json.loads((d / "config.json").read_text())
        config["colibri_quant"][field] = int(value) if value.isdigit() else value
        (d / "config.json").write_text(json.dumps(config))
    return apply


def _one_shard_stamp(d):
    shard, _ = _shard_with(d, EXPERT + ".qscale")
    _rewrite_shard(shard, lambda h, data: h["__metadata__"].update({"quant": "int8", "group_size": "0"}))


def _unstamped(d):
    for shard in d.glob("*.safetensors"):
        _rewrite_shard(shard, lambda h, data: h.__setitem__("__metadata__", {"format": "pt"}))
    config = json.loads((d / "config.json").read_text())
    del config["colibri_quant"]
    (d / "config.json").write_text(json.dumps(config))


BAD = {
    "missing scales": (_drop_scales, "missing scales"),
    "mis-shaped scales": (_misshape_scales, "qscale is BF16 [128, 1, 2]"),
    "group size does not divide": (_stamp("group_size", "128"), "group size 128 does not divide the input dimension 64"),
    "unknown format version": (_stamp("format_version", "99"), "format version 99 is not supported"),
    "unknown quant": (_stamp("quant", "int3"), "unknown quant 'int3'"),
    "unknown format": (_stamp("colibri_format", "gguf"), "unknown quantization stamp"),
    "shards disagree": (_one_shard_stamp, "stamped int8/experts, but config.json says int4-g64"),
    "quantized without stamp": (_unstamped, "no quantization stamp"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_container_is_one_line_exit_2(containers, tmp_path, case):
    damage, message = BAD[case]
    d = _copy(containers["int4-g64"], tmp_path)
    damage(d)
    code, err = _run_cli(d)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert message in err, err


def test_convert_group_not_dividing_source_is_one_line(src, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "colibri.cli", "convert", str(src), "-o", str(tmp_path / "x"),
                           "--group-size", "128"], capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "group size 128 does not divide the input dimension 64" in proc.stderr
    assert not (tmp_path / "x").exists()
