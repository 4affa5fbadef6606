"""The tables of benchmarks/peers/peers.py: runs folded into medians with spread, token agreement, the
memory-bandwidth bound's arithmetic, and KL against bf16 beside the speed of each quantization.

Every figure of a race is measured --runs times (each run: every engine once, back to back);
the tables quote the median and the min-max over those runs, and a ratio is the ratio of the
medians. The raw per-run rows stay in --json.
"""

from __future__ import annotations

import json
import statistics
import struct
import sys
from pathlib import Path

from engine.api.lab import bytes_to_unicode
from tuner.probe.memory import measure_memory_bandwidth

QUANT_PAIRS = {"int8": "Q8_0", "int4-g32": "Q4_0", "int4-g64": "Q4_K_M"}
PEERS = ("llama-bench", "llama-simple", "transformers+accelerate", "transformers")


# --- token agreement -----------------------------------------------------------------------

def token_bytes(tokenizer_json: Path) -> dict[int, bytes]:
    u2b = {u: b for b, u in bytes_to_unicode().items()}
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    return {i: bytes(u2b[c] for c in tok) if all(c in u2b for c in tok) else tok.encode() for tok, i in vocab.items()}


def agreement(ref_ids: list[int] | None, row: dict, pieces: dict[int, bytes]) -> str:
    if not ref_ids:
        return "-"
    if row.get("output_ids") is not None:
        other = row["output_ids"]
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, other)) if a != b), min(len(ref_ids), len(other)))
        return f"{same}/{len(other)}"
    if row.get("text") is not None:
        # Bytes, not ids: llama-simple prints pieces. A token that ends inside a multi-byte
        # character only matches once the next one completes it, hence the largest matching k.
        target = row["text"]
        decoded = [b"".join(pieces[t] for t in ref_ids[:k]).decode("utf-8", "replace") for k in range(len(ref_ids) + 1)]
        same = max(k for k, text in enumerate(decoded) if target.startswith(text))
        n = row.get("tokens") or len(ref_ids)
        return f"{min(same, n)}/{n}" + (" (same text)" if target == decoded[-1] else "")
    return "-"


# --- runs folded into medians --------------------------------------------------------------

def _spread(values) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(rows: list[dict]) -> list[dict]:
    """One entry per (mode, weights, engine), in first-seen order: the spread of decode tok/s,
    TTFT, load and wall time over its ok runs, the largest cgroup peak, every run's status and
    token agreement."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r.get("quant", "bf16"), r["engine"]), []).append(r)
    out = []
    for (mode, quant, engine), runs in groups.items():
        ok = [r for r in runs if r["status"] == "ok"]
        statuses = sorted({r["status"] for r in runs})
        agrees = sorted({str(r.get("agree", "-")) for r in runs})
        peaks = [r.get("peak_bytes") for r in ok if r.get("peak_bytes") is not None]
        out.append({
            "mode": mode, "quant": quant, "engine": engine, "runs": len(runs), "ok": len(ok),
            "status": statuses[0] if len(statuses) == 1 else "/".join(statuses),
            "tokens": ok[0].get("tokens") if ok else None, "capped": any(r.get("capped") for r in ok),
            "decode_tok_s": _spread(r.get("decode_tok_s") for r in ok),
            "ttft_s": _spread(r.get("ttft_s") for r in ok), "load_s": _spread(r.get("load_s") for r in ok),
            "wall_s": _spread(r.get("wall_s") for r in ok), "peak_bytes": max(peaks) if peaks else None,
            "limit_bytes": runs[0].get("limit_bytes"), "agree": " ".join(agrees),
            "threads": runs[0].get("threads"),
        })
    return out


def median_of(summary: list[dict], mode: str, quant: str, engine: str) -> float | None:
    s = next((e["decode_tok_s"] for e in summary if (e["mode"], e["quant"], e["engine"]) == (mode, quant, engine)), None)
    return s["median"] if s else None


def fmt_spread(s: dict | None, digits: int = 2) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def race_table(summary: list[dict]) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
    lines = ["| mode | weights | engine | runs ok | tokens | load s | TTFT s | decode tok/s median (min-max) | "
             "cgroup peak MiB | limit MiB | wall s | tokens = ours |", "|" + "---|" * 12]
    for e in summary:
        theirs = e["engine"].startswith("llama") and e["quant"] in QUANT_PAIRS
        weights = QUANT_PAIRS[e["quant"]] if theirs else e["quant"]  # the file each engine ran
        lines.append(
            f"| {e['mode']} | {weights} | {e['engine']} | {e['ok']}/{e['runs']}"
            f"{'' if e['status'] == 'ok' else ' ' + e['status']}{' (capped)' if e['capped'] else ''} | "
            f"{e['tokens'] if e['tokens'] is not None else '-'} | {fmt_spread(e['load_s'])} | {fmt_spread(e['ttft_s'], 3)} | "
            f"{fmt_spread(e['decode_tok_s'])} | {mib(e['peak_bytes'])} | {mib(e['limit_bytes'])} | "
            f"{fmt_spread(e['wall_s'], 0)} | {e['agree']} |")
    return "\n".join(lines)


def ratio_lines(summary: list[dict], modes: list[str]) -> list[str]:
    out = []
    for mode in modes:
        for quant in ["bf16", *QUANT_PAIRS]:
            ours = median_of(summary, mode, quant, "ours")
            for peer in PEERS:
                theirs = median_of(summary, mode, quant, peer)
                if ours and theirs:
                    name = "" if quant == "bf16" else f" ({QUANT_PAIRS[quant]})"
                    out.append(f"- {mode} {quant}: ours / {peer}{name} decode = {ours / theirs:.3g}x (medians)")
    return out


# --- the memory-bandwidth bound ------------------------------------------------------------

def safetensors_sizes(model_dir: Path) -> dict[str, int]:
    """Tensor name -> bytes, from the safetensors headers of a model directory (no data read)."""
    sizes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                begin, end = meta["data_offsets"]
                sizes[name] = end - begin
    return sizes


def active_bytes(sizes: dict[str, int], experts_per_token: int, experts: int, vocab: int,
                 is_expert, is_embedding) -> dict:
    """Weight bytes one decode token reads: every tensor once, except the routed experts (K of E
    per layer) and the embedding (one row). The KV cache (a few dozen positions here) is left out."""
    expert = sum(b for n, b in sizes.items() if is_expert(n))
    embed = sum(b for n, b in sizes.items() if is_embedding(n))
    dense = sum(sizes.values()) - expert - embed
    active = dense + expert * experts_per_token / experts + embed / vocab
    return {"dense_bytes": dense, "expert_bytes": expert, "embedding_bytes": embed, "active_bytes": active,
            "fraction": f"{experts_per_token}/{experts}"}


def ours_active_bytes(model_dir: Path) -> dict:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return active_bytes(safetensors_sizes(model_dir), cfg["num_experts_per_tok"], cfg["num_experts"],
                        cfg["vocab_size"], lambda n: ".mlp.experts." in n, lambda n: "embed_tokens" in n)


def gguf_active_bytes(tensor_sizes: dict[str, int], config: dict) -> dict:
    """The same count for a GGUF (llama.cpp's names: blk.N.ffn_{gate,up,down}_exps, token_embd)."""
    return active_bytes(tensor_sizes, config["num_experts_per_tok"], config["num_experts"], config["vocab_size"],
                        lambda n: "_exps" in n, lambda n: n.startswith("token_embd"))


def bound_lines(bandwidth: float, threads: int, entries: list[tuple[str, str, dict, float | None]]) -> list[str]:
    """The bound's arithmetic, one line per (engine, weights): active bytes / bandwidth."""
    out = [f"- memory bandwidth (tuner.probe.memory, read of a 256 MiB array, {threads} threads, median of 5): "
           f"{bandwidth / 1e9:.1f} GB/s"]
    for engine, weights, act, measured in entries:
        bound = bandwidth / act["active_bytes"]
        frac = f", measured {measured:.1f} tok/s = {measured / bound:.2f} of it" if measured else ""
        out.append(f"- {engine} {weights}: {act['dense_bytes'] / 1e6:.0f} MB dense + {act['expert_bytes'] / 1e6:.0f} MB "
                   f"experts x {act['fraction']} + embedding row = {act['active_bytes'] / 1e6:.0f} MB/token; "
                   f"bound {bandwidth / 1e9:.1f} GB/s / {act['active_bytes'] / 1e6:.0f} MB = {bound:.1f} tok/s{frac}")
    return out


def gguf_tensor_sizes(llama_dir: Path, gguf: Path) -> dict[str, int]:
    """Tensor name -> bytes of a GGUF, read by llama.cpp's own gguf-py (from the built tree;
    imported here because only this step needs it and it is not a dependency of the project)."""
    sys.path.insert(0, str(Path(llama_dir) / "src" / "gguf-py"))
    from gguf import GGUFReader
    return {t.name: int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors}


def bandwidth_bound(args, variants, summary: list[dict], lock) -> list[str]:
    """The bound's arithmetic: the probe's memory read bandwidth at --threads, and each file's
    active bytes per decode token (measured here, after the races, under the same lock)."""
    import torch  # the probe's measurement runs on torch's thread pool, as the engine's matmuls do
    torch.set_num_threads(args.threads)
    with lock:
        points = measure_memory_bandwidth([args.threads], 256 << 20, 5)
    bandwidth = next(p.bandwidth.value for p in points if p.op == "read")
    config = json.loads((variants[0][1] / "config.json").read_text())
    entries = []
    for quant, ours_model, their_gguf, names in variants:
        entries.append(("ours", quant, ours_active_bytes(ours_model), median_of(summary, "resident", quant, "ours")))
        theirs = QUANT_PAIRS.get(quant, "bf16")
        entries.append(("llama.cpp", theirs, gguf_active_bytes(gguf_tensor_sizes(args.llama_dir, their_gguf), config),
                        median_of(summary, "resident", quant, "llama-bench")))
    return bound_lines(bandwidth, args.threads, entries)


# --- quality beside speed --------------------------------------------------------------------

def quality_table(quality: list[dict], summary: list[dict], mode: str = "resident") -> str:
    """KL / top-1 against bf16 of each pair, both tools, beside the pair's decode speed (medians)."""
    lines = ["| ours | KL mean | KL p99 | top-1 | decode tok/s | theirs | KL mean (±) | KL p99 | top-1 | "
             "decode tok/s | speed ours/theirs |", "|" + "---|" * 11]
    for q in quality:
        o, t = q["ours"], q["llama"]
        ours_v, theirs_v = (median_of(summary, mode, q["quant"], e) for e in ("ours", "llama-bench"))
        lines.append(
            f"| {q['quant']} | {o['kl_mean']:.6f} | {o['kl_p99']:.5f} | {100 * o['top1_agreement']:.2f}% | "
            f"{'-' if ours_v is None else f'{ours_v:.1f}'} | {q['theirs']} | {t['kl_mean']:.6f} ± {t['kl_mean_unc']:.6f} | "
            f"{t['kl_p99']:.5f} | {100 * t['top1_agreement']:.2f}% | {'-' if theirs_v is None else f'{theirs_v:.1f}'} | "
            f"{'-' if not (ours_v and theirs_v) else f'{ours_v / theirs_v:.2f}x'} |")
    return "\n".join(lines)
