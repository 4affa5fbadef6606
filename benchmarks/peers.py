"""Race our engine against llama.cpp and transformers + accelerate disk offload, on one model.

    python benchmarks/peers.py --work-dir /work/scratch/peers --lock /tmp/colibri-bench.lock

One command does everything, each step skipped when its output already exists:
  1. builds llama.cpp from the llama-cpp-python sdist (scripts/build_llama_cpp.sh) into --llama-dir;
  2. synthesizes the model (`--preset`, default demo: 3.2 GiB bf16) into WORK/<preset>, with
     synth's trained byte-level BPE tokenizer;
  3. converts it to GGUF (bf16, no quantization) with llama.cpp's own convert_hf_to_gguf.py,
     through benchmarks/peers_convert.py (maps the unknown pre-tokenizer hash to gpt-2);
  4. checks that llama.cpp's tokenizer gives our prompt ids for the prompt text;
  5. runs, for each mode and engine, the same text prompt, greedy, --tokens new tokens:
       cold:     each engine in a fresh memory cgroup of --cgroup bytes (page cache counts),
                 the model's pages dropped first (posix_fadvise DONTNEED on every file);
       resident: the weights in RAM (ours: ram_budget 0; llama.cpp: mmap over a page cache
                 read in beforehand; transformers: plain CPU model, no offload), in a cgroup of
                 --resident-cgroup bytes so the figure still has a peak;
  6. prints one table (load, TTFT, decode tok/s, cgroup peak, whether tokens agree) and the
     conditions; --json FILE writes every figure.

Engines: `ours` (`colibri run`, io_mode direct), `llama-simple` (its generation loop: greedy,
GGML_DEFAULT_N_THREADS = 4 threads, which it does not let us change), `llama-bench`
(tg --tokens at -t --threads; cold: 1 repetition, no warm-up; resident: --repeats with warm-up,
mean ± sd as it reports them), `accelerate` (benchmarks/peers_hf.py). A peer slower than
--cap-seconds is stopped and its figures cover the tokens it made in that time (transformers
stops itself at the cap; llama-simple is asked for fewer tokens when llama-bench, run just
before it, says --tokens would not fit in the cap; the tokens column says how many).
Token agreement: transformers' ids are compared with ours; llama-simple prints text, so its
bytes are compared with the bytes of our tokens (N/M = tokens of ours that it reproduced).

--quant int8,int4-g32,int4-g64 adds quantized rows: each side quantizes the bf16 model with its
own tool (`colibri convert --quant int8|int4 --group-size G` into WORK/<preset>-<quant>;
`llama-quantize` of the bf16 GGUF to the counterpart: int8 ↔ Q8_0, int4-g32 ↔ Q4_0 (both 32
per group), int4-g64 ↔ Q4_K_M), then ours and llama-bench race on them, in every --modes, with
the same prompt and tokens. Quality (KL against bf16) is not measured here: `colibri quality`
for ours; llama-perplexity is not built by scripts/build_llama_cpp.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.synth.bpe_tokenizer import bytes_to_unicode  # noqa: E402
from tuner.sandbox import detect_memory_cgroup, run_limited  # noqa: E402
from engine.base.config import parse_size  # noqa: E402
from benchmarks.benchkit import bench_lock  # noqa: E402

PROMPT = "The history of the city begins with a small river crossing, where traders from the north met"
GiB = 1 << 30


def drop_pages(paths: list[Path]) -> int:
    """posix_fadvise(DONTNEED) on every file under paths; returns the bytes covered."""
    total = 0
    for root in paths:
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages cannot be dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def read_into_page_cache(paths: list[Path]) -> None:
    for root in paths:
        for f in ([root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())):
            with open(f, "rb", buffering=0) as fh:
                while fh.read(16 << 20):
                    pass


# --- preparation -----------------------------------------------------------------------------

def prepare(args) -> tuple[Path, Path]:
    llama = Path(args.llama_dir)
    if not (llama / "READY").exists():
        env = {**os.environ, "PYTHON": sys.executable, **({"BUILD_LOCK": args.lock} if args.lock else {})}
        subprocess.run([str(REPO / "scripts" / "build_llama_cpp.sh"), str(llama)], check=True, env=env)
    work = Path(args.work_dir).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    model = work / args.preset
    if not (model / "config.json").exists():
        from engine import synth
        print(f"peers: synthesizing {args.preset} into {model}", file=sys.stderr)
        with bench_lock(args.lock):
            synth.synthesize(synth.load_preset(args.preset), model, seed=0, progress=True)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    if "colibri_tokenizer" not in cfg:
        raise SystemExit(f"error: {model} has the old merge-less tokenizer; delete it so it is re-synthesized")
    gguf = work / f"{args.preset}-bf16.gguf"
    if not gguf.exists():
        print(f"peers: converting to {gguf} with llama.cpp's convert_hf_to_gguf.py", file=sys.stderr)
        tmp = gguf.with_suffix(".gguf.partial")
        with bench_lock(args.lock):
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers_convert.py"), "--llama-src",
                            str(llama / "src"), str(model), "--outfile", str(tmp), "--outtype", "bf16"],
                           check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        os.replace(tmp, gguf)
    return model, gguf


def llama_prompt_ids(args, gguf: Path, prompt: str) -> list[int]:
    out = subprocess.run([str(Path(args.llama_dir) / "build/bin/llama-tokenize"), "-m", str(gguf), "-p", prompt,
                          "--ids", "--log-disable", "--no-bos"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


QUANT_PAIRS = {"int8": "Q8_0", "int4-g32": "Q4_0", "int4-g64": "Q4_K_M"}


def quantized_pair(args, model: Path, gguf: Path, quant: str) -> tuple[Path, Path]:
    """(our container, their GGUF) for one --quant entry, each made by its own tool (once)."""
    if quant not in QUANT_PAIRS:
        raise SystemExit(f"error: --quant {quant!r}: expected one of {', '.join(QUANT_PAIRS)}")
    work = Path(args.work_dir).expanduser()
    ours = work / f"{args.preset}-{quant}"
    if not (ours / "config.json").exists():
        kind, _, group = quant.partition("-g")
        argv = [sys.executable, "-m", "tuner.cli", "convert", str(model), "-o", str(ours), "--quant", kind,
                "--force"] + (["--group-size", group] if group else [])
        print(f"peers: {' '.join(argv[1:])}", file=sys.stderr)
        with bench_lock(args.lock):
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "PYTHONPATH": str(Path(args.ours_src).resolve())})
    theirs = work / f"{args.preset}-{QUANT_PAIRS[quant]}.gguf"
    if not theirs.exists():
        tmp = theirs.with_suffix(".gguf.partial")
        argv = [str(Path(args.llama_dir) / "build/bin/llama-quantize"), str(gguf), str(tmp), QUANT_PAIRS[quant]]
        print(f"peers: {' '.join(argv)}", file=sys.stderr)
        with bench_lock(args.lock):
            subprocess.run(argv, check=True, capture_output=True)
        os.replace(tmp, theirs)
    return ours, theirs


# --- the engines -----------------------------------------------------------------------------

def _result(engine, mode, run, **fields) -> dict:
    status = "ok"
    if run.timed_out:
        status = "timeout"
    elif run.oom_killed:
        status = "oom"
    elif run.returncode != 0:
        status = f"exit {run.returncode}: {run.stderr.strip().splitlines()[-1][:120] if run.stderr.strip() else ''}"
    return {"engine": engine, "mode": mode, "status": status, "wall_s": run.wall_seconds,
            "peak_bytes": run.peak_bytes, "limit_bytes": run.limit_bytes, "limited": run.limited,
            "cgroup_reason": run.reason, **fields}


def run_ours(args, model: Path, mode: str, limit: int) -> dict:
    argv = [sys.executable, "-m", "tuner.cli", "run", "--model", str(model), "--prompt", args.prompt,
            "--max-new-tokens", str(args.tokens), "--threads", str(args.threads), "--ctx-size", "256", "--json"]
    if args.ours_config:
        argv += ["--config", args.ours_config]
    argv += ["--ram-budget", "0"] if mode == "resident" else ["--ram-budget", str(args.ours_budget or limit),
                                                              "--io-mode", "direct"]
    run = run_limited(argv, limit, timeout=args.cap_seconds + 120,
                      env={**os.environ, "PYTHONPATH": str(Path(args.ours_src).resolve())})
    fields = {}
    if run.returncode == 0 and not run.timed_out:
        out = json.loads(run.stdout)
        fields = {"load_s": out.get("load_seconds"), "ttft_s": out["ttft_s"], "decode_tok_s": out["decode_tok_s"],
                  "tokens": out["generated_tokens"], "prompt_ids": out["prompt_ids"],
                  "output_ids": out["output_ids"], "bytes_read": out.get("bytes_read")}
    return _result("ours", mode, run, **fields)


_PERF = re.compile(r"(load|prompt eval|eval) time =\s*([\d.]+) ms(?: /\s*(\d+) (?:tokens|runs))?")


def run_llama_simple(args, gguf: Path, mode: str, limit: int, bench_rate: float | None) -> dict:
    # llama-simple cannot stop itself at a time limit and prints its timings only at the end, so
    # when llama-bench (run first) says the cap would not hold --tokens, ask for fewer.
    n = args.tokens
    if bench_rate:
        n = max(4, min(n, int(0.6 * args.cap_seconds * bench_rate)))
    argv = [str(Path(args.llama_dir) / "build/bin/llama-simple"), "-m", str(gguf), "-n", str(n), args.prompt]
    run = run_limited(argv, limit, timeout=args.cap_seconds)
    fields: dict = {"threads": 4}
    perf = {m.group(1): (float(m.group(2)) / 1e3, int(m.group(3) or 0)) for m in _PERF.finditer(run.stderr)}
    if "eval" in perf:
        eval_s, runs = perf["eval"]
        fields.update(load_s=perf["load"][0], ttft_s=perf["prompt eval"][0], tokens=runs + 1,
                      decode_tok_s=runs / eval_s if eval_s else None)
    text = run.stdout
    fields["text"] = text[len(args.prompt):].rstrip("\n") if text.startswith(args.prompt) else None
    fields["prompt_echo_ok"] = text.startswith(args.prompt)
    return _result("llama-simple", mode, run, **fields)


def run_llama_bench(args, gguf: Path, mode: str, limit: int, prompt_len: int) -> dict:
    argv = [str(Path(args.llama_dir) / "build/bin/llama-bench"), "-m", str(gguf), "-t", str(args.threads),
            "-n", str(args.tokens), "-o", "json"]
    argv += ["-p", "0", "-r", "1", "--no-warmup"] if mode == "cold" else ["-p", str(prompt_len), "-r",
                                                                            str(args.repeats)]
    run = run_limited(argv, limit, timeout=args.cap_seconds)
    fields: dict = {"threads": args.threads}
    try:
        rows = json.loads(run.stdout)
    except ValueError:
        rows = []
    for row in rows:
        if row.get("n_gen"):
            fields.update(decode_tok_s=row["avg_ts"], decode_sd=row.get("stddev_ts"), tokens=row["n_gen"],
                          repeats=len(row.get("samples_ts", [])), build_commit=row.get("build_commit"),
                          cpu=row.get("cpu_info"), model_type=row.get("model_type"))
        elif row.get("n_prompt"):
            fields.update(prefill_tok_s=row["avg_ts"])
    return _result("llama-bench", mode, run, **fields)


def run_accelerate(args, model: Path, mode: str, limit: int, offload: Path) -> dict:
    argv = [sys.executable, str(REPO / "benchmarks" / "peers_hf.py"), "--model", str(model), "--prompt",
            args.prompt, "--tokens", str(args.tokens), "--threads", str(args.threads),
            "--cap-seconds", str(args.cap_seconds)]
    argv += ["--resident"] if mode == "resident" else ["--offload-dir", str(offload)]
    # The cap stops generation; loading (which writes the fused experts to the offload folder) is extra.
    run = run_limited(argv, limit, timeout=args.cap_seconds + args.load_cap_seconds)
    fields = {"threads": args.threads}
    if run.returncode == 0 and not run.timed_out:
        out = json.loads(run.stdout.strip().splitlines()[-1])
        fields.update(load_s=out["load_s"], ttft_s=out["ttft_s"], decode_tok_s=out["decode_tok_s"],
                      tokens=len(out["output_ids"]), output_ids=out["output_ids"], prompt_ids=out["prompt_ids"],
                      capped=out["stopped_at_cap"])
    return _result("transformers+accelerate" if mode == "cold" else "transformers", mode, run, **fields)


# --- agreement and the table -----------------------------------------------------------------

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


def fmt(v, spec="{:.2f}"):
    return "-" if v is None else spec.format(v)


def print_table(rows: list[dict], conditions: dict) -> None:
    print("\n## peers\n")
    for k, v in conditions.items():
        print(f"- {k}: {v}")
    print("\n| mode | weights | engine | status | tokens | load s | TTFT s | decode tok/s | cgroup peak MiB | "
          "limit MiB | wall s | tokens = ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dec = fmt(r.get("decode_tok_s"))
        if r.get("decode_sd") is not None:
            dec += f" ± {r['decode_sd']:.2f}"
        mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"  # noqa: E731
        print(f"| {r['mode']} | {r.get('quant', 'bf16')} | {r['engine']} | {r['status']}{' (capped)' if r.get('capped') else ''} | "
              f"{r.get('tokens', '-')} | {fmt(r.get('load_s'))} | {fmt(r.get('ttft_s'))} | {dec} | "
              f"{mib(r.get('peak_bytes'))} | {mib(r.get('limit_bytes'))} | {fmt(r.get('wall_s'), '{:.0f}')} | "
              f"{r.get('agree', '-')} |")
    by = {(r["mode"], r.get("quant", "bf16"), r["engine"]): r.get("decode_tok_s") for r in rows if r["status"] == "ok"}
    print()
    for mode in ("cold", "resident"):
        for quant in ["bf16", *QUANT_PAIRS]:
            ours = by.get((mode, quant, "ours"))
            for peer in ("llama-bench", "llama-simple", "transformers+accelerate", "transformers"):
                if ours and by.get((mode, quant, peer)):
                    theirs = "" if quant == "bf16" else f" ({QUANT_PAIRS[quant]})"
                    print(f"- {mode} {quant}: ours / {peer}{theirs} decode = {ours / by[(mode, quant, peer)]:.3g}x")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.environ.get("COLIBRI_PEERS_DIR", "~/.cache/colibri/peers"))
    p.add_argument("--llama-dir", default=os.environ.get("LLAMA_CPP_DIR", "/work/tools/llama.cpp"))
    p.add_argument("--preset", default="demo")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cgroup", default="1.5GiB", help="memory cgroup limit of the cold runs (page cache counts)")
    p.add_argument("--resident-cgroup", default="10GiB", help="cgroup limit of the resident runs")
    p.add_argument("--ours-budget", help="our engine's ram_budget when cold (default: the cgroup limit)")
    p.add_argument("--ours-config", help="engine config TOML for our engine (e.g. a tune's recommended.toml)")
    p.add_argument("--ours-src", default=str(REPO), help="checkout whose engine is measured (PYTHONPATH)")
    p.add_argument("--engines", default="ours,llama-bench,llama-simple,accelerate")
    p.add_argument("--modes", default="cold,resident")
    p.add_argument("--repeats", type=int, default=3, help="llama-bench repetitions when resident")
    p.add_argument("--cap-seconds", type=float, default=300.0, help="wall-time cap of one peer's generation")
    p.add_argument("--load-cap-seconds", type=float, default=600.0, help="extra time for transformers' load")
    p.add_argument("--quant", default="", help="also race quantized: comma list of int8, int4-g32, int4-g64 "
                   "(against Q8_0, Q4_0, Q4_K_M); --quant-only skips the bf16 rows")
    p.add_argument("--quant-only", action="store_true")
    p.add_argument("--lock", help="flock this file around each measured step (shared machines)")
    p.add_argument("--json", help="write all rows and conditions to this file")
    args = p.parse_args(argv)
    engines = args.engines.split(",")
    cold_limit, resident_limit = parse_size(args.cgroup), parse_size(args.resident_cgroup)
    if args.ours_budget:
        args.ours_budget = str(parse_size(args.ours_budget))
    support = detect_memory_cgroup()
    if not support.available:
        print(f"peers: warning: runs are not memory-limited: {support.reason}", file=sys.stderr)

    model, gguf = prepare(args)
    offload = Path(args.work_dir).expanduser() / f"{args.preset}-offload"
    from tokenizers import Tokenizer
    prompt_ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(args.prompt).ids
    llama_ids = llama_prompt_ids(args, gguf, args.prompt)
    pieces = token_bytes(model / "tokenizer.json")
    info = dict(line.split("=", 1) for line in (Path(args.llama_dir) / "BUILD_INFO").read_text().splitlines() if "=" in line)
    conditions = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} GiB RAM, {platform.platform()}",
        "ours": f"{args.ours_src} @ {git_commit(args.ours_src)}",
        "llama.cpp": f"llama-cpp-python {info.get('llama_cpp_python_version')} sdist, commit {info.get('llama_cpp_commit')}, {info.get('cmake_flags')}",
        "model": f"{model} ({sum(f.stat().st_size for f in model.glob('*.safetensors')) / GiB:.2f} GiB {json.loads((model / 'config.json').read_text()).get('dtype')}, synth preset {args.preset} seed 0); GGUF {gguf.name} ({gguf.stat().st_size / GiB:.2f} GiB, bf16, converted by llama.cpp)",
        "prompt": f"{args.prompt!r} = {len(prompt_ids)} tokens; llama.cpp tokenizes it identically: {llama_ids == prompt_ids}",
        "generation": f"greedy, {args.tokens} new tokens, {args.threads} threads (llama-simple: 4, fixed)",
        "cold": f"fresh cgroup limited to {cold_limit / GiB:.2f} GiB (page cache counts), files' pages dropped (fadvise DONTNEED) before each run",
        "resident": f"weights in RAM (ours ram_budget 0; llama.cpp mmap over a warm page cache; transformers without offload), cgroup {resident_limit / GiB:.0f} GiB",
        "cap": f"{args.cap_seconds:.0f} s of generation per peer run (a capped row covers the tokens made in that time)",
        "cgroup": support.reason if not support.available else f"v{support.version}",
    }
    quants = [q for q in args.quant.split(",") if q]
    variants = ([] if args.quant_only else [("bf16", model, gguf, engines)]) + [
        (q, *quantized_pair(args, model, gguf, q), [e for e in engines if e in ("ours", "llama-bench")])
        for q in quants]
    if quants:
        conditions["quantized"] = ("ours: `colibri convert --quant` of the bf16 model (routed experts); theirs: "
                                   "`llama-quantize` of the bf16 GGUF (every tensor it quantizes by default): "
                                   + ", ".join(f"{q} vs {QUANT_PAIRS[q]}" for q in quants))
    rows: list[dict] = []
    for quant, ours_model, their_gguf, names in variants:
        runners = {
            "ours": lambda mode, lim: run_ours(args, ours_model, mode, lim),
            "llama-simple": lambda mode, lim: run_llama_simple(args, their_gguf, mode, lim, next(
                (r.get("decode_tok_s") for r in rows if r["mode"] == mode and r["engine"] == "llama-bench"
                 and r["quant"] == quant), None)),
            "llama-bench": lambda mode, lim: run_llama_bench(args, their_gguf, mode, lim, len(prompt_ids)),
            "accelerate": lambda mode, lim: run_accelerate(args, ours_model, mode, lim, offload),
        }
        for mode in args.modes.split(","):
            limit = cold_limit if mode == "cold" else resident_limit
            # One lock hold per mode (about 10 min cold, 5 resident on the demo): short enough for a
            # shared box, and the engines of one mode are measured back to back under the same load.
            with bench_lock(args.lock):
                for name in names:
                    files = [ours_model, their_gguf] + ([offload] if offload.exists() else [])
                    if mode == "cold":
                        drop_pages(files)
                    else:
                        read_into_page_cache([their_gguf] if name.startswith("llama") else [ours_model])
                    print(f"peers: {mode} {quant} {name} ...", file=sys.stderr, flush=True)
                    row = {**runners[name](mode, limit), "quant": quant}
                    print(f"peers: {mode} {quant} {name}: {row['status']}, decode {fmt(row.get('decode_tok_s'))} "
                          f"tok/s, wall {row['wall_s']:.0f} s", file=sys.stderr, flush=True)
                    rows.append(row)
    for quant, *_ in variants:
        for mode in args.modes.split(","):
            same = [r for r in rows if r["mode"] == mode and r["quant"] == quant]
            ref = next((r.get("output_ids") for r in same if r["engine"] == "ours"), None)
            for r in same:
                r["agree"] = "ref" if r["engine"] == "ours" else agreement(ref, r, pieces)
    print_table(rows, conditions)
    if args.json:
        tmp = Path(args.json + ".tmp")
        tmp.write_text(json.dumps({"conditions": conditions, "rows": rows}, indent=1))
        os.replace(tmp, args.json)
    return 0


def git_commit(src: str) -> str:
    try:
        return subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    from engine.base.errors import ConfigError
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except subprocess.CalledProcessError as exc:
        print(f"error: {Path(exc.cmd[0]).name} failed with exit code {exc.returncode}", file=sys.stderr)
        sys.exit(2)
