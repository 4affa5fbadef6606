"""Full-scale checkpoints without the disk space: DeepSeek-V3 671B and GLM-5 744B as sparse files.

A test-side builder (not shipped behaviour): it writes a Hugging Face directory with the tensor
names, shapes, dtypes and shard layout of the published checkpoint — real safetensors headers
and a real model.safetensors.index.json — where every tensor's bytes are a hole (the file is
truncated to its size), so ~700 GB-1.5 TB of apparent size costs a few MB of disk. The engine's
metadata path (header parsing and validation, the tensor index, the expert layout, the memory
plan) then meets real scale: 61-78 layers x 256 experts, ~160-300 shards, ~90-120k tensors.

What is written, per model (geometry from engine/presets/<name>.json):
  * deepseek-v3: as deepseek-ai/DeepSeek-V3 publishes it. `--dtype fp8`: every linear weight
    F8_E4M3 with an F32 `weight_scale_inv` of 128x128 blocks ([ceil(out/128), ceil(in/128)]),
    embeddings, norms, router and lm_head BF16, e_score_correction_bias F32,
    quantization_config {quant_method fp8, fmt e4m3, weight_block_size [128, 128], dynamic
    activations}; the multi-token-prediction layer 61 (a full MoE layer plus enorm, hnorm,
    eh_proj, shared_head, embed_tokens); 163 shards. `--dtype bf16`: the same geometry, names
    and layer 61 in bf16 (what the engine opens before the FP8 reader lands).
  * glm-5: glm_moe_dsa (MLA + the DSA indexer on its layers), MTP layer 78, bf16 by default.
  * `--dtype int4`: our own int4-g128 container (`colibri convert --scope all`, docs/FORMAT.md)
    of the same geometry, stamped: the one form whose dense part (~11 GiB) fits a 16 GiB budget,
    so a decode step on holes can run at full scale.
Within a shard, tensors are ordered as the safetensors library writes them (dtype, then name);
one expert's tensors never straddle two shards.

Measurements (`measure`; each step in a fresh interpreter so its RSS is its own):
  open    Checkpoint(dir): wall time, RSS growth; and in a run of its own the Python heap
          (tracemalloc) of the index
  layout  + ExpertLayout (every routed expert's spans): time, RSS growth
  plan    + make_plan under --budget: time, and what the plan says (or its one-line refusal)
  cli     `colibri plan --model DIR --budget B --json`: wall time of the whole command
  decode  Engine(dir, ram_budget) and one token after a one-token prompt, in a fresh memory cgroup
          of --budget: load and step time, RSS after each, VmHWM, the cgroup's peak and its split
          (anon, shmem = the expert arena, page cache) beside the plan; one decode step on holes
          (needs a `--decodable` build: zero scales are refused as corrupt; the written router
          biases route every layer to experts 0..K-1, whose scales are the ones written)

    quiet test .venv/bin/python benchmarks/formats/fullscale.py build deepseek-v3 --dtype bf16 --out /tmp/fs-dsv3
        [--decodable]   # also the scales and router biases a decode step reads (int4: ~1 GiB on disk)
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py measure /tmp/fs-dsv3 [--budget 16GiB]
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py decode /tmp/fs-dsv3 --budget 16GiB [--cgroup 16GiB]
    quiet bench .venv/bin/python benchmarks/formats/fullscale.py all [--dtype bf16] [--decode]   # build each, measure, delete

measure, decode and all take --json: one colibri.bench/1 document (benchkit.emit) whose rows are
the same table's rows (keyed by its header; `all` tags each with the model and its build), and
--lock FILE: benchkit.bench_lock around each measured checkpoint (instead of `quiet bench`).
build prints its own one-line JSON (what it wrote) and _step its child's (the wire format).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = "fullscale"
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from engine.api import CONFIG_KEY, EngineConfig, format_size, parse_size, synth  # noqa: E402
from engine.api.lab import FORMAT_NAME, FORMAT_VERSION  # noqa: E402
from benchmarks.benchkit import Tables, add_output_flags, bench_lock, run_conditions, table_rows  # noqa: E402

BLOCK = 128  # FP8 weight_block_size of the published checkpoints
# The safetensors library writes a shard's tensors sorted by dtype (its enum, larger first), then name.
DTYPE_RANK = {"F32": 0, "BF16": 1, "F8_E4M3": 2, "U8": 3}
ITEMSIZE = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}
INT4_GROUP = 128
MODELS = {"deepseek-v3": {"shards": 163, "dtype": "fp8"}, "glm-5": {"shards": 282, "dtype": "bf16"}}
PRESET_ONLY = ("name", "description", "materializable", "source", "published_total_params", "published_active_params")
DEFAULT_PROFILE = str(ROOT / "profiles" / "amd-epyc-virtio-2a91f032.json")  # this machine class, bundled
# No real source: the sha256 of the builder's name, a well-formed stamp that says where it came from.
FINGERPRINT = hashlib.sha256(b"sparse-fullscale-builder").hexdigest()
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


# --- the tensor plan ---------------------------------------------------------------------------

def _linear(name: str, out: int, inp: int, fmt: str) -> list[tuple[str, str, tuple]]:
    """One linear layer's weight: BF16; F8_E4M3 with its F32 block scales; or our int4-g128
    container's codes and scales (docs/FORMAT.md), where `colibri convert --scope all` would
    quantize it (a `_proj.weight`)."""
    if fmt == "fp8":
        return [(name, "F8_E4M3", (out, inp)),
                (name + "_scale_inv", "F32", (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)))]
    if fmt == "int4" and name.endswith("_proj.weight"):
        base = name.removesuffix(".weight")
        return [(f"{base}.qweight", "U8", (out, inp // 2)), (f"{base}.qscale", "BF16", (inp // INT4_GROUP, out, 2))]
    return [(name, "BF16", (out, inp))]


def _attention(cfg: dict, p: str, indexer: bool, fmt: str) -> list:
    H, N = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    a = f"{p}.self_attn"
    t = [*_linear(f"{a}.q_a_proj.weight", q_rank, H, fmt), (f"{a}.q_a_layernorm.weight", "BF16", (q_rank,)),
         *_linear(f"{a}.q_b_proj.weight", N * (nope + rope), q_rank, fmt),
         *_linear(f"{a}.kv_a_proj_with_mqa.weight", kv_rank + rope, H, fmt),
         (f"{a}.kv_a_layernorm.weight", "BF16", (kv_rank,)),
         *_linear(f"{a}.kv_b_proj.weight", N * (nope + v), kv_rank, fmt),
         *_linear(f"{a}.o_proj.weight", H, N * v, fmt)]
    if indexer:  # GLM-5's DSA indexer (engine/arch/mla.py names it as transformers does)
        i, heads, dim = f"{a}.indexer", cfg["index_n_heads"], cfg["index_head_dim"]
        t += [*_linear(f"{i}.wq_b.weight", heads * dim, q_rank, fmt), *_linear(f"{i}.wk.weight", dim, H, fmt),
              (f"{i}.k_norm.weight", "BF16", (dim,)), (f"{i}.k_norm.bias", "BF16", (dim,)),
              *_linear(f"{i}.weights_proj.weight", heads, H, "int4" if fmt == "int4" else "bf16")]
    return t


def _mlp(p: str, inter: int, H: int, fmt: str) -> list:
    return [*_linear(f"{p}.gate_proj.weight", inter, H, fmt), *_linear(f"{p}.up_proj.weight", inter, H, fmt),
            *_linear(f"{p}.down_proj.weight", H, inter, fmt)]


def tensor_groups(cfg: dict, fmt: str, indexer_layers: set[int]) -> list[list[tuple[str, str, tuple]]]:
    """Every tensor of the checkpoint, in groups that stay in one shard (a layer's dense tensors,
    one expert), in the order the published files go: embeddings, layers 0..L-1, the MTP
    layers, the final norm and lm_head."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    E, MI = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    mtp = cfg.get("num_nextn_predict_layers", 0)
    groups = [[("model.embed_tokens.weight", "BF16", (V, H))]]
    for i in range(L + mtp):
        p = f"model.layers.{i}"
        dense = [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,)),
                 *_attention(cfg, p, i in indexer_layers, fmt)]
        if i < cfg["first_k_dense_replace"]:
            groups.append(dense + _mlp(f"{p}.mlp", cfg["intermediate_size"], H, fmt))
            continue
        dense += [(f"{p}.mlp.gate.weight", "BF16", (E, H)), (f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,)),
                  *_mlp(f"{p}.mlp.shared_experts", MI * cfg["n_shared_experts"], H, fmt)]
        if i >= L:  # multi-token prediction: its own embedding, norms, projection and head
            dense += [(f"{p}.enorm.weight", "BF16", (H,)), (f"{p}.hnorm.weight", "BF16", (H,)),
                      (f"{p}.eh_proj.weight", "BF16", (H, 2 * H)), (f"{p}.shared_head.norm.weight", "BF16", (H,)),
                      (f"{p}.shared_head.head.weight", "BF16", (V, H)), (f"{p}.embed_tokens.weight", "BF16", (V, H))]
        groups.append(dense)
        groups += [_mlp(f"{p}.mlp.experts.{e}", MI, H, fmt) for e in range(E)]
    head = _linear("lm_head.weight", V, H, "bf16")
    if fmt == "int4":  # `--scope all` quantizes the output head too (engine/format/convert.quantizable)
        head = [("lm_head.qweight", "U8", (V, H // 2)), ("lm_head.qscale", "BF16", (H // INT4_GROUP, V, 2))]
    groups.append([("model.norm.weight", "BF16", (H,)), *head])
    return groups


def _nbytes(t) -> int:
    return math.prod(t[2]) * ITEMSIZE[t[1]]


def hf_config(name: str, fmt: str, layers: int | None = None) -> dict:
    """layers: keep only the first N decoder layers (the same widths, experts and shard size), so a
    memory question about the full model can be asked of a few layers and scaled by the layer count."""
    cfg = {k: v for k, v in synth.load_preset(name).items() if k not in PRESET_ONLY}
    if layers is not None:
        if not cfg["first_k_dense_replace"] < layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"--layers must be in ({cfg['first_k_dense_replace']}, {cfg['num_hidden_layers']}]")
        cfg["num_hidden_layers"] = layers
    if fmt == "fp8":
        cfg["quantization_config"] = dict(FP8_CONFIG)
    if fmt == "int4":
        cfg[CONFIG_KEY] = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "quant": "int4",
                           "group_size": INT4_GROUP, "scope": "all", "source_fingerprint": FINGERPRINT}
    return cfg


def indexer_layers_of(cfg: dict) -> set[int]:
    """Layers whose attention runs the DSA indexer, as the engine's parser decides them."""
    from engine.api import model_args
    mla = model_args(cfg).attention_impl
    indexer = getattr(mla, "indexer", None)
    return set(indexer.full_layers) if indexer is not None else set()


# --- writing ---------------------------------------------------------------------------------

# The few bytes written for real, so that a decode step on holes runs (the engine refuses zero
# scales as corrupt, and all-equal router scores would route to whichever experts ties pick):
#   * every scale the decode step reads: FP8 scale_inv 1.0; int4 (scale 2^-10, zero 8 * 2^-10),
#     so a hole's codes (0) dequantize to exactly 0 (engine/weights/quantized.py: (code - 8) * s + z);
#   * e_score_correction_bias = -e * 2^-10: the router's scores all tie at sigmoid(0) on holes,
#     the bias then picks experts 0..K-1 in every layer, so only their scales need writing
#     (K = num_experts_per_tok; ~0.6 GiB of int4 scales for DeepSeek-V3 instead of 20 GiB).
SCALE_FILL = {"F32": struct.pack("<f", 1.0), "BF16": struct.pack("<HH", 0x3A80, 0x3C00)}  # bf16 2^-10, 2^-7
BIAS_STEP = 2.0 ** -10


def _real_bytes(name: str, tag: str, shape: tuple, routed_k: int) -> bytes | None:
    """The bytes a tensor gets instead of a hole (see SCALE_FILL), or None for a hole."""
    if name.endswith("e_score_correction_bias"):
        return struct.pack(f"<{shape[0]}f", *(-e * BIAS_STEP for e in range(shape[0])))
    if not name.endswith(("_scale_inv", ".qscale")):
        return None
    if ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= routed_k:
        return None  # an expert the biased router never picks: its scales stay a hole
    return SCALE_FILL[tag] * (math.prod(shape) * ITEMSIZE[tag] // len(SCALE_FILL[tag]))


def _write_shard(path: Path, tensors: list, fmt: str, routed_k: int | None) -> int:
    """Header for real, data as a hole: the file is truncated to its full size, and only the
    scales and router biases a decode step reads are written (`_real_bytes`). Published
    formats in the safetensors library's order; our container keeps each expert's six tensors
    in one range (docs/FORMAT.md), its data 4 KiB-aligned, its stamp in __metadata__."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    if fmt == "int4":
        header["__metadata__"] = {"colibri_format": FORMAT_NAME, "format_version": str(FORMAT_VERSION),
                                  "quant": "int4", "group_size": str(INT4_GROUP), "scope": "all",
                                  "source_fingerprint": FINGERPRINT, "source_sha256": FINGERPRINT}
    ordered = tensors if fmt == "int4" else sorted(tensors, key=lambda t: (DTYPE_RANK[t[1]], t[0]))
    for name, tag, shape in ordered:
        n = math.prod(shape) * ITEMSIZE[tag]
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    align = 4096 if fmt == "int4" else 8  # the library aligns to 8; our container to 4 KiB
    raw += b" " * (-(8 + len(raw)) % align)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
        for name, tag, shape in ordered if routed_k is not None else ():
            data = _real_bytes(name, tag, shape, routed_k)
            if data is not None:
                f.seek(8 + len(raw) + header[name]["data_offsets"][0])
                f.write(data)
    return 8 + len(raw) + offset


def build(name: str, out: Path, dtype: str, shards: int | None = None, decodable: bool = False,
          layers: int | None = None) -> dict:
    """decodable: also write the scales and router biases a decode step reads (`_real_bytes`;
    ~1 GiB for an int4 container), else every tensor is a hole (the metadata figures).
    layers: the first N layers only (hf_config), in as many shards as keep the published shard size."""
    cfg = hf_config(name, dtype, layers)
    groups = tensor_groups(cfg, dtype, indexer_layers_of(cfg))
    total = sum(_nbytes(t) for g in groups for t in g)
    full_layers = synth.load_preset(name)["num_hidden_layers"]
    count = shards or max(1, round(MODELS[name]["shards"] * cfg["num_hidden_layers"] / full_layers))
    target = total / count
    assigned: list[list] = [[]]
    size = 0
    for g in groups:  # greedy, in file order: a shard closes when the next group would pass the target
        gb = sum(_nbytes(t) for t in g)
        if assigned[-1] and size + gb > target * 1.001 and len(assigned) < count:
            assigned.append([])
            size = 0
        assigned[-1].extend(g)
        size += gb
    out.mkdir(parents=True, exist_ok=False)
    weight_map, n = {}, len(assigned)
    for k, tensors in enumerate(assigned, 1):
        file = f"model-{k:05d}-of-{n:06d}.safetensors"
        _write_shard(out / file, tensors, dtype, cfg["num_experts_per_tok"] if decodable else None)
        weight_map.update({t[0]: file for t in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"model": name, "dtype": dtype, "shards": n, "tensors": len(weight_map), "apparent_bytes": total,
            "disk_bytes": sum(os.stat(p).st_blocks * 512 for p in out.iterdir())}


# --- measuring ---------------------------------------------------------------------------------

def _rss() -> int:
    return psutil.Process().memory_info().rss


def measure_step(model: Path, step: str, budget: int) -> dict:
    """One step in this (fresh) interpreter: what it costs beyond the imports."""
    import torch
    from engine.api import ColibriError
    from engine.api import model_args
    from engine.api import Checkpoint
    from engine.api import ExpertLayout
    from engine.api import make_plan
    base = _rss()
    if step == "heap":  # tracing slows the open several-fold and costs memory itself: its own run
        tracemalloc.start()
        ckpt = Checkpoint(model)
        return {"index_heap_bytes": tracemalloc.get_traced_memory()[0], "tensors": len(ckpt.tensors)}
    t0 = time.perf_counter()
    ckpt = Checkpoint(model)
    result = {"open_s": time.perf_counter() - t0, "tensors": len(ckpt.tensors), "open_rss_bytes": _rss() - base}
    if step in ("layout", "plan"):
        t0 = time.perf_counter()
        args = model_args(ckpt.config)
        layout = ExpertLayout(ckpt, args)
        result.update(layout_s=time.perf_counter() - t0, routed_experts=layout.num_routed,
                      expert_disk_bytes=layout.expert_nbytes, layout_rss_bytes=_rss() - base)
    if step == "plan":
        t0 = time.perf_counter()
        try:
            plan = make_plan(ckpt, args, layout, EngineConfig(ram_budget=budget), torch.bfloat16, torch.bfloat16)
            result["plan"] = plan.describe()
        except ColibriError as exc:
            result["plan"] = f"refused: {exc}"
        result.update(plan_s=time.perf_counter() - t0, plan_rss_bytes=_rss() - base)
    return result


def _cgroup_memory() -> dict:
    """This process's memory cgroup (v1) as the kernel counts it: usage, peak, and its split into
    anonymous memory, shmem (the expert arena), page cache and mapped file pages."""
    own = [line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line]
    d = Path("/sys/fs/cgroup/memory" + own[0]) if own and own[0] != "/" else None
    if d is None or not (d / "memory.stat").exists():
        return {}
    stat = dict(line.split() for line in (d / "memory.stat").read_text().splitlines())
    return {"usage": int((d / "memory.usage_in_bytes").read_text()),
            "peak": int((d / "memory.max_usage_in_bytes").read_text()),
            **{k: int(stat.get(k, 0)) for k in ("rss", "shmem", "cache", "mapped_file")}}


def decode_step(model: Path, budget: int) -> dict:
    """Open the engine under `budget` and decode one token after a one-token prompt, in this
    interpreter (run inside a memory cgroup by `measure --decode`): what the plan counts beside
    what the process and its cgroup hold after load and after the step."""
    import torch
    from engine.api import Sampler, generate
    from engine.api import peak_rss_bytes
    from engine.api import Engine
    t0 = time.perf_counter()
    engine = Engine(model, EngineConfig(ram_budget=budget))
    loaded = {"load_s": time.perf_counter() - t0, "rss": _rss(), "cgroup": _cgroup_memory()}
    print(json.dumps({"loaded": loaded, "describe": engine.plan.describe()}), file=sys.stderr, flush=True)  # kept if the step is killed
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = generate(engine, [1], 1, Sampler())
    stepped = {"step_s": time.perf_counter() - t0, "rss": _rss(), "peak_rss": peak_rss_bytes(),
               "cgroup": _cgroup_memory()}
    return {"plan": engine.plan.to_dict(), "describe": engine.plan.describe(), "kernel": engine.kernel_name,
            "loaded": loaded, "stepped": stepped, "tokens": out.output_ids}


def _child(model: Path, step: str, budget: int) -> dict:
    argv = [sys.executable, __file__, "_step", str(model), step, "--budget", str(budget)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=_env())
    if done.returncode != 0:
        raise RuntimeError(f"{step}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def _cli(argv: list[str], timeout: float) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "colibri.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=_env(), cwd=ROOT)
    tail = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return time.perf_counter() - t0, done.returncode, (tail[-1] if tail else "")[:300]


def decode_row(model: Path, budget: int, limit: int) -> str:
    """One decode step (`_step decode`) inside a fresh memory cgroup of `limit`, as a table row:
    the plan's parts, then what the process and the cgroup held after load and after the step."""
    from tuner.sandbox.limited import run_limited
    argv = [sys.executable, __file__, "_step", str(model), "decode", "--budget", str(budget)]
    run = run_limited(argv, limit, timeout=1500, env=_env(), require=True)
    head = f"| decode step, budget {format_size(budget)}, cgroup {format_size(limit)} | {run.wall_seconds:.1f} |"
    if run.returncode != 0:
        why = "OOM-killed" if run.oom_killed else f"exit {run.returncode}"
        return f"{head} - | {why}; cgroup peak {format_size(run.peak_bytes or 0)}; {run.stderr.strip()[-1500:]} |"
    r = json.loads(run.stdout.strip().splitlines()[-1])
    plan, after = r["plan"], r["stepped"]
    held = plan["budget"] - plan["prefill_bytes"]  # a one-token prompt fills no prefill chunk
    cg = after["cgroup"]
    split = (f"anon {format_size(cg['rss'])}, shmem {format_size(cg['shmem'])}, page cache "
             f"{format_size(cg['cache'] - cg['shmem'])}" if cg else "no cgroup stat")
    return (f"{head} {format_size(after['peak_rss'])} peak | load {r['loaded']['load_s']:.1f} s, step "
            f"{after['step_s']:.2f} s; RSS after load {format_size(r['loaded']['rss'])}, after the step "
            f"{format_size(after['rss'])}; plan without prefill {format_size(held)}, peak RSS over it "
            f"{(after['peak_rss'] - held) / 2**20:+.0f} MiB ({r['describe']}); cgroup "
            f"peak {format_size(run.peak_bytes or 0)} ({split}); kernel {r['kernel']} |")


MEASURE_HEADER = ["| step | wall s | RSS growth | notes |", "|---|---|---|---|"]


def measure(model: Path, budget: int, decode: bool, profile: str = DEFAULT_PROFILE) -> list[str]:
    rows = list(MEASURE_HEADER)
    opened, heap = _child(model, "open", budget), _child(model, "heap", budget)
    rows.append(f"| open (Checkpoint index, {opened['tensors']:,} tensors) | {opened['open_s']:.2f} | "
                f"{format_size(opened['open_rss_bytes'])} | Python heap of the index "
                f"{format_size(heap['index_heap_bytes'])} (tracemalloc, a run of its own) |")
    laid = _child(model, "layout", budget)
    rows.append(f"| + expert layout ({laid['routed_experts']:,} experts) | {laid['layout_s']:.2f} | "
                f"{format_size(laid['layout_rss_bytes'])} (with the index) | one expert "
                f"{format_size(laid['expert_disk_bytes'])} on disk |")
    planned = _child(model, "plan", budget)
    rows.append(f"| + make_plan at {format_size(budget)} | {planned['plan_s']:.2f} | "
                f"{format_size(planned['plan_rss_bytes'])} (with index, layout) | {planned['plan']} |")
    size = format_size(budget).replace(" ", "")
    wall, rc, line = _cli(["plan", "--model", str(model), "--profile", profile, "--budget", size], 1800)
    rows.append(f"| `colibri plan` (whole command: open, geometry, cost-model search) | {wall:.2f} | - | "
                f"exit {rc}: {line} |")
    if decode:
        rows.append(decode_row(model, budget, budget))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write one sparse checkpoint")
    b.add_argument("model", choices=sorted(MODELS))
    b.add_argument("--dtype", choices=("fp8", "bf16", "int4"))
    b.add_argument("--shards", type=int)
    b.add_argument("--layers", type=int, help="the first N decoder layers only (same widths; a reduced-layer "
                   "variant for memory questions)")
    b.add_argument("--out", required=True)
    b.add_argument("--decodable", action="store_true", help="write the scales and router biases a decode step "
                   "reads, so `measure --decode` runs (int4: ~1 GiB on disk)")
    m = sub.add_parser("measure", help="open, layout, plan (and decode) figures of a checkpoint")
    m.add_argument("dir")
    m.add_argument("--budget", default="16GiB")
    m.add_argument("--decode", action="store_true", help="also one decode step under a cgroup of --budget")
    m.add_argument("--profile", default=DEFAULT_PROFILE, help="hardware profile for `colibri plan`")
    add_output_flags(m)
    dc = sub.add_parser("decode", help="only the decode step of `measure --decode` (one cgroup run)")
    dc.add_argument("dir")
    dc.add_argument("--budget", default="16GiB")
    dc.add_argument("--cgroup", help="the cgroup's limit (default: the budget)")
    add_output_flags(dc)
    al = sub.add_parser("all", help="build each model in a temp dir, measure it, delete it")
    al.add_argument("--dtype", choices=("fp8", "bf16", "int4"), help="default: each model's published dtype")
    al.add_argument("--budget", default="16GiB")
    al.add_argument("--decode", action="store_true")
    al.add_argument("--scratch", default="/tmp")
    add_output_flags(al)
    s = sub.add_parser("_step")
    s.add_argument("dir")
    s.add_argument("step", choices=("open", "heap", "layout", "plan", "decode"))
    s.add_argument("--budget", type=int, required=True)
    a = ap.parse_args()
    if a.cmd == "build":
        t0 = time.perf_counter()
        info = build(a.model, Path(a.out), a.dtype or MODELS[a.model]["dtype"], a.shards, a.decodable, a.layers)
        info["build_s"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(info))
        return 0
    if a.cmd == "_step":
        step = decode_step if a.step == "decode" else lambda d, b: measure_step(d, a.step, b)
        print(json.dumps(step(Path(a.dir), a.budget)))
        return 0
    out = Tables(a.json)
    if a.cmd == "decode":
        budget = parse_size(a.budget)
        with bench_lock(a.lock):
            row = decode_row(Path(a.dir), budget, parse_size(a.cgroup) if a.cgroup else budget)
        out.rows += table_rows(MEASURE_HEADER + [row], table="measure")
        out.line(row)
        out.done(TOOL, run_conditions(a, model=a.dir))
        return 0
    if a.cmd == "all":
        from engine.api import git_commit
        out.line(f"# full-scale metadata {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} commit {git_commit()}")
        for name in MODELS:
            tmp = Path(tempfile.mkdtemp(prefix=f"colibri-fullscale-{name}-", dir=a.scratch))
            try:
                t0 = time.perf_counter()
                info = build(name, tmp / "model", a.dtype or MODELS[name]["dtype"], decodable=a.decode)
                out.line(f"\n## {name} {info['dtype']}: {info['shards']} shards, {info['tensors']:,} tensors, "
                         f"{format_size(info['apparent_bytes'])} apparent, {format_size(info['disk_bytes'])} on disk "
                         f"(built in {time.perf_counter() - t0:.1f} s)\n")
                with bench_lock(a.lock):
                    out.table("measure", measure(tmp / "model", parse_size(a.budget), a.decode), model=name,
                              dtype=info["dtype"], shards=info["shards"], tensors=info["tensors"],
                              apparent_bytes=info["apparent_bytes"], disk_bytes=info["disk_bytes"])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        out.done(TOOL, run_conditions(a, model=", ".join(MODELS)))
        return 0
    with bench_lock(a.lock):
        out.table("measure", measure(Path(a.dir), parse_size(a.budget), a.decode, a.profile))
    out.done(TOOL, run_conditions(a, model=a.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
