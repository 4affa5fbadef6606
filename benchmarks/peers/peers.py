"""Race our engine against llama.cpp and transformers + accelerate disk offload, on one model.

    python benchmarks/peers/peers.py --work-dir /work/scratch/peers --lock /tmp/colibri-bench.lock

One command does everything, each step skipped when its output already exists:
  1. builds llama.cpp from the llama-cpp-python sdist (scripts/build_llama_cpp.sh) into --llama-dir;
  2. synthesizes the model (`--preset`, default demo: 3.2 GiB bf16) into WORK/<preset>, with
     synth's trained byte-level BPE tokenizer;
  3. converts it to GGUF (bf16, no quantization) with llama.cpp's own convert_hf_to_gguf.py,
     through benchmarks/peers/peers_convert.py (maps the unknown pre-tokenizer hash to gpt-2);
  4. checks that llama.cpp's tokenizer gives our prompt ids for the prompt text;
  5. runs, for each mode and engine, the same text prompt, greedy, --tokens new tokens:
       cold:     each engine in a fresh memory cgroup of --cgroup bytes (page cache counts),
                 the model's pages dropped first (posix_fadvise DONTNEED on every file);
       resident: the weights in RAM (ours: ram_budget 0; llama.cpp: mmap over a page cache
                 read in beforehand; transformers: plain CPU model, no offload), in a cgroup of
                 --resident-cgroup bytes so the figure still has a peak;
  6. prints one table (load, TTFT, decode tok/s, cgroup peak, whether tokens agree) and the
     conditions; --json FILE writes every figure: one colibri.bench/1 document (benchkit.emit)
     whose rows are the race's per-run rows, whose conditions are benchkit's block with this
     script's own (below) beside it, and whose notes hold the summary, the bound and the KL rows.
     It stays a file (the text report is the stdout), rewritten after every run.

Engines (each run by benchmarks/peers/peers_engines.py): `ours` (`colibri run`, io_mode direct),
`llama-simple` (its generation loop: greedy, GGML_DEFAULT_N_THREADS = 4 threads, which it does not
let us change), `llama-bench`
(tg --tokens at -t --threads; cold: 1 repetition, no warm-up; resident: --repeats with warm-up,
mean ± sd as it reports them), `accelerate` (benchmarks/peers/peers_hf.py). A peer slower than
--cap-seconds is stopped and its figures cover the tokens it made in that time (transformers
stops itself at the cap; llama-simple is asked for fewer tokens when llama-bench, run just
before it, says --tokens would not fit in the cap; the tokens column says how many).
Token agreement: transformers' ids are compared with ours; llama-simple prints text, so its
bytes are compared with the bytes of our tokens (N/M = tokens of ours that it reproduced).

--quant int8,int4-g32,int4-g64 adds quantized rows: each side quantizes the bf16 model with its
own tool (`colibri convert --quant int8|int4 --group-size G` into WORK/<preset>-<quant>;
`llama-quantize` of the bf16 GGUF to the counterpart: int8 ↔ Q8_0, int4-g32 ↔ Q4_0 (both 32
per group), int4-g64 ↔ Q4_K_M), then ours and llama-bench race on them, in every --modes, with
the same prompt and tokens, and each pair's KL divergence / top-1 agreement against bf16 is
measured by both tools on the same text (benchmarks/peers/peers_quality.py: llama-perplexity
--kl-divergence for theirs, `colibri quality` for ours) and printed beside its speed.
--quality only measures just that (no timing: it may run on a shared lock); --quality-from FILE
takes it from such a run's --json.

Measurement rules (issue 22): every race figure is measured --runs times (default 3; each run
every engine once, back to back), quoted as the median with its min-max; the bound's arithmetic
(the probe's memory-bandwidth measurement, active weight bytes per token of each file) is
printed under the table (benchmarks/peers/peers_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tuner.sandbox import detect_memory_cgroup  # noqa: E402
from engine.api import parse_size  # noqa: E402
from benchmarks.benchkit import bench_lock, emit  # noqa: E402
from benchmarks import benchkit  # noqa: E402
from benchmarks.peers import peers_quality  # noqa: E402
from benchmarks.peers.peers_engines import run_accelerate, run_llama_bench, run_llama_simple, run_ours  # noqa: E402
from benchmarks.io.page_cache import cached_bytes, drop_pages, read_into_page_cache  # noqa: E402
from benchmarks.peers.peers_report import (QUANT_PAIRS, agreement, bandwidth_bound, quality_table,  # noqa: E402
                                     race_table, ratio_lines, summarize, token_bytes)

TOOL = "peers"
PROMPT = "The history of the city begins with a small river crossing, where traders from the north met"
GiB = 1 << 30


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
        from engine.api import synth
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
            subprocess.run([sys.executable, str(REPO / "benchmarks" / "peers" / "peers_convert.py"), "--llama-src",
                            str(llama / "src"), str(model), "--outfile", str(tmp), "--outtype", "bf16"],
                           check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        os.replace(tmp, gguf)
    return model, gguf


def llama_prompt_ids(args, gguf: Path, prompt: str) -> list[int]:
    out = subprocess.run([str(Path(args.llama_dir) / "build/bin/llama-tokenize"), "-m", str(gguf), "-p", prompt,
                          "--ids", "--log-disable", "--no-bos"], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def quantized_pair(args, model: Path, gguf: Path, quant: str) -> tuple[Path, Path]:
    """(our container, their GGUF) for one --quant entry, each made by its own tool (once)."""
    if quant not in QUANT_PAIRS:
        raise SystemExit(f"error: --quant {quant!r}: expected one of {', '.join(QUANT_PAIRS)}")
    work = Path(args.work_dir).expanduser()
    ours = work / (f"{args.preset}-{quant}" + ("-all" if args.scope == "all" else ""))
    if not (ours / "config.json").exists():
        kind, _, group = quant.partition("-g")
        argv = [sys.executable, "-m", "colibri.cli", "convert", str(model), "-o", str(ours), "--quant", kind,
                "--scope", args.scope, "--force"] + (["--group-size", group] if group else [])
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


# --- the bound and the tables ----------------------------------------------------------------

def print_report(rows: list[dict], conditions: dict, modes: list[str], bound: list[str], quality: list[dict]) -> None:
    print("\n## peers\n")
    for k, v in conditions.items():
        print(f"- {k}: {v}")
    summary = summarize(rows)
    if rows:
        print("\n" + race_table(summary) + "\n")
        print("\n".join(ratio_lines(summary, modes)))
    if bound:
        print("\nThe memory-bandwidth bound (resident decode):\n")
        print("\n".join(bound))
    if quality:
        print("\nKL divergence and top-1 agreement against bf16, beside resident decode speed (medians):\n")
        print(quality_table(quality, summary))


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
    p.add_argument("--scope", choices=("experts", "all"), default="experts",
                   help="what `colibri convert` quantizes in our containers: the routed experts (WORK/<preset>-<quant>) "
                        "or every linear but embeddings and routers (WORK/<preset>-<quant>-all), as llama-quantize does")
    p.add_argument("--bench-prompt-tokens", type=int, default=None,
                   help="llama-bench's -p when resident (default: the prompt's length; 0 = decode only, for a build "
                        "whose prompt path fails, such as the AMX one on Q8_0/Q4_0 here)")
    p.add_argument("--runs", type=int, default=3, help="runs of every race figure (median and min-max quoted)")
    p.add_argument("--quality", choices=("auto", "only", "off"), default="auto",
                   help="KL / top-1 against bf16 of the --quant pairs, both tools (auto: after the races; "
                        "only: no races, nothing timed)")
    p.add_argument("--quality-from", help="take the KL rows from this earlier --json instead of measuring them")
    p.add_argument("--rows-from", help="take the race rows from this earlier --json instead of racing (the "
                   "report, the bound and the KL table over a finished race)")
    p.add_argument("--kl-tokens", type=int, default=4096, help="tokens of the KL text (whole chunks of --kl-ctx)")
    p.add_argument("--kl-ctx", type=int, default=512, help="chunk length of the KL measurement")
    p.add_argument("--lock", help="flock this file around each measured step (shared machines)")
    p.add_argument("--json", help="write all rows and conditions to this file")
    args = p.parse_args(argv)
    if args.bench_prompt_tokens is not None and args.bench_prompt_tokens < 0:
        raise SystemExit("error: --bench-prompt-tokens must be >= 0")
    if args.runs < 1 or args.kl_ctx < 4 or args.kl_tokens < 2 * args.kl_ctx:
        raise SystemExit("error: --runs must be >= 1, --kl-ctx >= 4 and --kl-tokens >= 2 x --kl-ctx "
                         "(llama-perplexity needs two chunks)")
    engines = args.engines.split(",")
    modes = [] if args.quality == "only" else [m for m in args.modes.split(",") if m]
    cold_limit, resident_limit = parse_size(args.cgroup), parse_size(args.resident_cgroup)
    if args.ours_budget:
        args.ours_budget = str(parse_size(args.ours_budget))
    support = detect_memory_cgroup()
    if not support.available:
        print(f"peers: warning: runs are not memory-limited: {support.reason}", file=sys.stderr)

    model, gguf = prepare(args)
    offload = Path(args.work_dir).expanduser() / f"{args.preset}-offload"
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt_ids = tokenizer.encode(args.prompt).ids
    llama_ids = llama_prompt_ids(args, gguf, args.prompt)
    pieces = token_bytes(model / "tokenizer.json")
    info = dict(line.split("=", 1) for line in (Path(args.llama_dir) / "BUILD_INFO").read_text().splitlines() if "=" in line)
    conditions = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / GiB:.0f} GiB RAM, {platform.platform()}",
        "load average at start": f"{os.getloadavg()[0]:.2f}",
        "ours": f"{args.ours_src} @ {git_commit(args.ours_src)}",
        "llama.cpp": f"llama-cpp-python {info.get('llama_cpp_python_version')} sdist, commit {info.get('llama_cpp_commit')}, {info.get('cmake_flags')}",
        "model": f"{model} ({sum(f.stat().st_size for f in model.glob('*.safetensors')) / GiB:.2f} GiB {json.loads((model / 'config.json').read_text()).get('dtype')}, synth preset {args.preset} seed 0); GGUF {gguf.name} ({gguf.stat().st_size / GiB:.2f} GiB, bf16, converted by llama.cpp)",
        "prompt": f"{args.prompt!r} = {len(prompt_ids)} tokens; llama.cpp tokenizes it identically: {llama_ids == prompt_ids}",
        "generation": f"greedy, {args.tokens} new tokens, {args.threads} threads (llama-simple: 4, fixed)",
        "runs": f"{args.runs} per figure, every engine once per run, back to back; medians with min-max",
        "cold": f"fresh cgroup limited to {cold_limit / GiB:.2f} GiB (page cache counts), every file's pages dropped "
                "(fsync + fadvise DONTNEED, then checked with mincore) before each run of each engine; llama-bench "
                "cold is tg only (-p 0 -r 1 --no-warmup: a pp test first would page the model in), llama-simple "
                "runs the prompt",
        "resident": f"weights in RAM (ours ram_budget 0; llama.cpp mmap over a warm page cache, llama-bench -r "
                    f"{args.repeats} after its warm-up"
                    + (f", -p {args.bench_prompt_tokens}" if args.bench_prompt_tokens is not None else "")
                    + f"; transformers without offload), cgroup {resident_limit / GiB:.0f} GiB",
        "cap": f"{args.cap_seconds:.0f} s of generation per peer run (a capped row covers the tokens made in that time)",
        "cgroup": support.reason if not support.available else f"v{support.version}",
    }
    quants = [q for q in args.quant.split(",") if q]
    variants = ([] if args.quant_only else [("bf16", model, gguf, engines)]) + [
        (q, *quantized_pair(args, model, gguf, q), [e for e in engines if e in ("ours", "llama-bench")])
        for q in quants]
    if quants:
        conditions["quantized"] = (f"ours: `colibri convert --quant --scope {args.scope}` of the bf16 model ("
                                   + ("routed experts" if args.scope == "experts" else "every linear but embeddings and routers")
                                   + "); theirs: "
                                   "`llama-quantize` of the bf16 GGUF (every tensor it quantizes by default): "
                                   + ", ".join(f"{q} vs {QUANT_PAIRS[q]}" for q in quants))
    rows: list[dict] = json.loads(Path(args.rows_from).read_text())["rows"] if args.rows_from else []
    if args.rows_from:
        conditions["races"] = f"from {args.rows_from} ({json.loads(Path(args.rows_from).read_text())['conditions']['date']})"
    for run in range(args.runs if modes and not args.rows_from else 0):
        rows += race(args, run, variants, modes, (cold_limit, resident_limit), len(prompt_ids), offload, pieces)
        write_json(args.json, conditions, rows)  # each run kept as soon as it is measured
    bound = bandwidth_bound(args, variants, summarize(rows), bench_lock(args.lock)) if "resident" in modes else []
    quality, quality_conditions = measure_quality(args, model, gguf, variants, tokenizer)
    conditions.update(quality_conditions)
    print_report(rows, conditions, modes, bound, quality)
    write_json(args.json, conditions, rows, bound=bound, quality=quality)
    return 0


def json_conditions(conditions: dict) -> dict:
    """benchkit's conditions block with this script's own beside it (its machine line as
    "platform"; its date and cgroup are benchkit's own keys, which say the same)."""
    own = {k: v for k, v in conditions.items() if k not in ("date", "machine", "cgroup")}
    return benchkit.conditions(platform=conditions.get("machine"), **own)


def write_json(path: str | None, conditions: dict, rows: list[dict], **more) -> None:
    """The --json FILE: one colibri.bench/1 document (rows: every run's; notes: summary, bound, quality)."""
    if path:
        tmp = Path(path + ".tmp")
        with open(tmp, "w") as f:
            emit(TOOL, rows, json_conditions(conditions), True, [], notes={"summary": summarize(rows), **more}, out=f)
        os.replace(tmp, path)


def race(args, run: int, variants, modes: list[str], limits: tuple[int, int], prompt_len: int, offload: Path,
         pieces) -> list[dict]:
    """One run of every race: each variant, each mode, each engine once; rows tagged with the run."""
    rows: list[dict] = []
    for quant, ours_model, their_gguf, names in variants:
        runners = {
            "ours": lambda mode, lim: run_ours(args, ours_model, mode, lim),
            "llama-simple": lambda mode, lim: run_llama_simple(args, their_gguf, mode, lim, next(
                (r.get("decode_tok_s") for r in rows if r["mode"] == mode and r["engine"] == "llama-bench"
                 and r["quant"] == quant), None)),
            "llama-bench": lambda mode, lim: run_llama_bench(args, their_gguf, mode, lim, prompt_len),
            "accelerate": lambda mode, lim: run_accelerate(args, ours_model, mode, lim, offload),
        }
        for mode in modes:
            limit = limits[0] if mode == "cold" else limits[1]
            # One lock hold per mode (about 10 min cold, 5 resident on the demo): short enough for a
            # shared box, and the engines of one mode are measured back to back under the same load.
            with bench_lock(args.lock):
                for name in names:
                    files = [ours_model, their_gguf] + ([offload] if offload.exists() else [])
                    cached = None
                    if mode == "cold":
                        drop_pages(files)
                        cached = cached_bytes(files)
                    else:
                        read_into_page_cache([their_gguf] if name.startswith("llama") else [ours_model])
                    print(f"peers: run {run + 1}/{args.runs} {mode} {quant} {name} ...", file=sys.stderr, flush=True)
                    row = {**runners[name](mode, limit), "quant": quant, "run": run + 1, "cached_at_start": cached}
                    dec = row.get("decode_tok_s")
                    print(f"peers: run {run + 1} {mode} {quant} {name}: {row['status']}, decode "
                          f"{'-' if dec is None else f'{dec:.2f}'} tok/s, wall {row['wall_s']:.0f} s", file=sys.stderr,
                          flush=True)
                    rows.append(row)
        for mode in modes:
            same = [r for r in rows if r["mode"] == mode and r["quant"] == quant]
            ref = next((r.get("output_ids") for r in same if r["engine"] == "ours"), None)
            for r in same:
                r["agree"] = "ref" if r["engine"] == "ours" else agreement(ref, r, pieces)
    return rows


def measure_quality(args, model: Path, gguf: Path, variants, tokenizer) -> tuple[list[dict], dict]:
    pairs = [(q, QUANT_PAIRS[q], ours, theirs) for q, ours, theirs, _ in variants if q in QUANT_PAIRS]
    if not pairs or args.quality == "off":
        return [], {}
    if args.quality_from:
        doc = json.loads(Path(args.quality_from).read_text())
        keep = ("text", "token stream", "llama-perplexity", "colibri quality")
        return doc.get("notes", doc)["quality"], {f"quality ({k})": f"{doc['conditions'][k]} [from {args.quality_from}, "
                                                  f"{doc['conditions']['date']}]" for k in keep}
    rows, conditions = peers_quality.measure(
        Path(args.work_dir).expanduser(), Path(args.llama_dir), model, gguf, pairs, args.kl_tokens, args.kl_ctx,
        args.threads, str(Path(args.ours_src).resolve()), tokenizer,
        log=lambda m: print(m, file=sys.stderr, flush=True))
    return rows, conditions


def git_commit(src: str) -> str:
    try:
        return subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    from engine.api import ConfigError
    try:
        sys.exit(main())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except subprocess.CalledProcessError as exc:
        print(f"error: {Path(exc.cmd[0]).name} failed with exit code {exc.returncode}", file=sys.stderr)
        sys.exit(2)
