"""GGUF import against the real llama.cpp: convert_hf_to_gguf.py + llama-quantize → `colibri convert`.

    python benchmarks/formats/gguf_roundtrip.py [--llama-dir DIR] [--work DIR] [--archs qwen3_moe,mixtral,...] [--json]

For each architecture a tiny bf16 model is made ("synth": `colibri synth`'s qwen3_moe, 256-wide
so every K-quant applies; "gpt_oss-mxfp4": synth's gpt_oss with MXFP4 experts as published; the
others: transformers' own random classes as tests/colibri_hf_models.py builds them, qwen3_moe
256-wide too, with synth's tokenizer copied in, plus GLM's special tokens for the GLM models),
converted by llama.cpp's own converter (tests/gguf_llama.py: one process per architecture, with
benchmarks/peers/peers_convert.py's fallback that only names synth's pre-tokenizer) to F16, BF16 and Q8_0 (gpt-oss's MXFP4 experts stay MXFP4 in all three), and
the bf16 GGUF quantized by llama-quantize to Q4_0, Q4_K_M, Q5_K_M, Q6_K and MXFP4_MOE. Each GGUF
is imported with `colibri convert`, and for each the table says:
- exact: our dequantization of every tensor equals llama.cpp's own, bit for bit (llama-quantize
  --allow-requantize to F32 is ggml's to_float; only for the quantized types);
- tokens: 16 greedy tokens from a 32-token prompt identical to the original model's (fp32 compute);
- KL / top-1: `colibri quality` of the import against the original (fp32, --tokens/--ctx).
llama.cpp is built by scripts/build_llama_cpp.sh (EXTRA_TARGETS=llama-quantize) into --llama-dir
(default $LLAMA_CPP_DIR or ~/.cache/colibri/llama.cpp) if it is not built there yet, so the
table is reproducible from a clean clone; the output's first line is the command that made it.
--json prints the same rows as one colibri.bench/1 document (benchkit.emit), the llama.cpp build
and the command in its conditions. Nothing here is timed, so there is no --lock.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import torch  # noqa: E402

from engine.api import Engine, EngineConfig, Sampler, generate, measure_quality, synth  # noqa: E402
from engine.api.lab import GGUFModel, dequantize, import_gguf  # noqa: E402
from gguf_llama import convert_all, write_glm_tokenizer  # noqa: E402
from benchmarks.benchkit import add_output_flags, emit, run_conditions  # noqa: E402

TOOL = "gguf_roundtrip"

PROMPT = [(7 * i + 3) % 256 for i in range(32)]
# Where scripts/build_llama_cpp.sh builds llama.cpp (the pinned llama-cpp-python sdist) when no
# --llama-dir is given: the user's cache, as benchmarks/peers/peers.py keeps its models; never the repo.
DEFAULT_LLAMA_DIR = "~/.cache/colibri/llama.cpp"
QWEN3_GEOMETRY = {**synth.load_preset("tiny"), "hidden_size": 256, "moe_intermediate_size": 256,
                  "intermediate_size": 512, "num_hidden_layers": 4, "head_dim": 64, "num_experts": 8,
                  "dtype": "bfloat16", "max_shard_size": 1 << 30}
CONVERTER_TYPES = ("f16", "bf16", "q8_0")
QUANTIZE_TYPES = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "MXFP4_MOE")
# gpt_oss (transformers' class: plain bf16 experts, which the converter splits and transposes) and
# gpt_oss-mxfp4 (`colibri synth`'s, experts in MXFP4 as published, which the converter keeps);
# the GLM models get synth's tokenizer with GLM's special tokens, which llama.cpp's GLM vocab path
# (conversion/base.py _set_vocab_glm) looks up by name (tests/gguf_llama.py).
ALL_ARCHS = ("synth", "qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "glm4_moe", "glm_moe_dsa",
             "glm_moe_dsa-synth", "gpt_oss", "gpt_oss-mxfp4")
GLM_ARCHS = ("glm4_moe", "glm_moe_dsa", "glm_moe_dsa-synth")
# synth's glm_moe_dsa (as tests/test_gguf_llama_cpp.py): structured weights, where transformers'
# random ones (init std 0.2) make logits chaotic in the weights, the indexer's top-k most of all.
GLM_DSA_SYNTH = {**synth.load_preset("glm-5-small"), "hidden_size": 64, "num_hidden_layers": 3,
                 "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                 "qk_rope_head_dim": 8, "v_head_dim": 12, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 6,
                 "vocab_size": 300, "max_shard_size": 1 << 30}
GPT_OSS_MXFP4 = {**synth.load_preset("gpt-oss-small"), "hidden_size": 64, "num_hidden_layers": 2,
                 "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 8, "vocab_size": 300,
                 "max_position_embeddings": 4096, "max_shard_size": 1 << 30,
                 "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128}}
KQUANT_ARCHS = ("synth", "qwen3_moe")  # 256-wide: the others are 64-wide (their test geometry), where
# llama-quantize's K-quants would fall back to other types; they get the converter's types only.
HF_OVERRIDES = {"qwen3_moe": {"hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 512,
                              "head_dim": 64, "num_hidden_layers": 4, "mlp_only_layers": [],
                              "initializer_range": 0.05},"deepseek_v3": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 128, "mscale": 0.707,
                                                    "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}},
                "glm4_moe": {"num_nextn_predict_layers": 0}}


def run(argv: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    if rc:
        raise SystemExit(f"error: {' '.join(map(str, argv[:3]))} ... failed (exit {rc}); see {log}")


def make_model(arch: str, out: Path, tokenizer_src: Path) -> Path:
    if (out / "config.json").exists():
        return out
    if arch == "synth":  # `colibri synth`'s own qwen3_moe (structured attention, calibrated routing)
        return synth.synthesize(QWEN3_GEOMETRY, out, progress=False)
    if arch == "gpt_oss-mxfp4":
        return synth.synthesize(GPT_OSS_MXFP4, out, progress=False)
    if arch == "glm_moe_dsa-synth":
        synth.synthesize(GLM_DSA_SYNTH, out, progress=False)
        write_glm_tokenizer(out, GLM_DSA_SYNTH["vocab_size"])
        return out
    from colibri_hf_models import build
    model = build(arch, out, vocab_size=300, **HF_OVERRIDES.get(arch, {}))
    with torch.no_grad():  # bf16 weights, as published checkpoints are
        model.to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_src / name, out / name)
    if arch in GLM_ARCHS:
        write_glm_tokenizer(out, 300)
    return out


def greedy(d: Path) -> list[int]:
    with Engine(d, EngineConfig(ctx_size=64, dtype="fp32", threads=1)) as e:
        return generate(e, PROMPT, 16, Sampler()).output_ids


def same_as_llama(gguf: Path, llama_bin: Path, work: Path) -> bool:
    f32 = work / (gguf.stem + "-f32.gguf")
    run([str(llama_bin / "llama-quantize"), "--allow-requantize", str(gguf), str(f32), "F32"], work / "requant.log")
    ours, theirs = GGUFModel(gguf), GGUFModel(f32)
    # Values, not shapes: llama-quantize writes qwen2moe's [1, hidden] ffn_gate_inp_shexp back as 1-D.
    same = all(torch.equal(dequantize(t).flatten(), dequantize(theirs.tensors[n]).flatten())
               for n, t in ours.tensors.items())
    f32.unlink()
    return same


def one_arch(arch: str, args, llama: Path) -> list[dict]:
    work = Path(args.work) / arch
    work.mkdir(parents=True, exist_ok=True)
    tok = Path(args.work) / "tokenizer-src"
    if not (tok / "config.json").exists():
        synth.synthesize({**synth.load_preset("tiny"), "num_hidden_layers": 1}, tok, progress=False)
    src = make_model(arch, work / "src", tok)
    want = greedy(src)
    ggufs = {t.upper(): work / f"m-{t}.gguf" for t in CONVERTER_TYPES}
    todo = [(src, g, t.lower()) for t, g in ggufs.items() if not g.exists()]
    if todo:  # one converter process for the arch's types (tests/gguf_llama.py)
        try:
            convert_all(todo, work / "convert.log", llama / "src")
        except AssertionError:
            raise SystemExit(f"error: llama.cpp's converter failed on {arch}; see {work / 'convert.log'}") from None
    if arch in KQUANT_ARCHS:
        for t in QUANTIZE_TYPES:
            ggufs[t] = work / f"m-{t}.gguf"
            if not ggufs[t].exists():
                run([str(llama / "build/bin/llama-quantize"), str(ggufs["BF16"]), str(ggufs[t]), t],
                    work / f"quantize-{t}.log")
    rows = []
    for label, g in ggufs.items():
        out = work / f"out-{label}"
        s = import_gguf(g, out, force=True)
        types = ", ".join(f"{k}x{v}" for k, v in s["source"]["types"].items())
        q = measure_quality(out, src, tokens=args.tokens, ctx=args.ctx, dtype="fp32", threads=1)
        quantized = any(k not in ("F32", "F16", "BF16") for k in s["source"]["types"])  # gpt-oss: MXFP4 in all
        rows.append({"arch": arch, "gguf": label, "types": types,
                     "exact": same_as_llama(g, llama / "build/bin", work) if quantized else None,
                     "tokens_same": greedy(out) == want, "kl_mean": q["kl_mean"], "top1": q["top1_agreement"],
                     "tokenizer": s["tokenizer"].split(",")[0]})
        print(f"  {arch} {label}: done", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-dir", default=os.environ.get("LLAMA_CPP_DIR", DEFAULT_LLAMA_DIR),
                   help="llama.cpp built by scripts/build_llama_cpp.sh (built there if missing; default "
                        f"$LLAMA_CPP_DIR or {DEFAULT_LLAMA_DIR})")
    p.add_argument("--work", default="/tmp/colibri-gguf-roundtrip")
    p.add_argument("--archs", default=",".join(ALL_ARCHS))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=256)
    add_output_flags(p, lock=False)
    args = p.parse_args(argv)
    llama = Path(args.llama_dir).expanduser()
    if not ((llama / "READY").exists() and (llama / "build/bin/llama-quantize").exists()):
        subprocess.run([str(REPO / "scripts" / "build_llama_cpp.sh"), str(llama)], check=True,
                       env={**os.environ, "PYTHON": sys.executable, "EXTRA_TARGETS": "llama-quantize"})
    rows = [r for arch in args.archs.split(",") for r in one_arch(arch, args, llama)]
    info = (llama / "BUILD_INFO").read_text().split() if (llama / "BUILD_INFO").exists() else []
    command = " ".join(["python benchmarks/formats/gguf_roundtrip.py", *(argv if argv is not None else sys.argv[1:])])
    build = " ".join(i for i in info if i.startswith(("llama_cpp_python_version", "llama_cpp_commit")))
    if args.json:
        emit(TOOL, rows, run_conditions(args, command=command, llama_cpp=build, compute="fp32",
                                        greedy="16 tokens from a 32-token prompt"), True, [])
        return 0
    print("command: " + command)
    print(f"llama.cpp: {build} "
          f"(scripts/build_llama_cpp.sh into {llama})")
    print(f"quality: {args.tokens} tokens, ctx {args.ctx}, fp32 compute; tokens: 16 greedy from a 32-token prompt\n")
    print("| arch | GGUF | tensor types | dequant = llama.cpp | greedy tokens = original | KL mean | same top-1 | tokenizer |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        exact = "-" if r["exact"] is None else ("yes" if r["exact"] else "NO")
        print(f"| {r['arch']} | {r['gguf']} | {r['types']} | {exact} | {'yes' if r['tokens_same'] else 'no'} "
              f"| {r['kl_mean']:.2e} | {100 * r['top1']:.1f}% | {r['tokenizer']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
