"""mmap io_mode: how cold each tree's "cold" is, and what the disk really delivered per token.

The engine's own byte counter counts what it asked to fault in, not what came from the disk:
in mmap mode a page still resident from the warm-up is "read" again for free. So two trees
whose cold start differs (the old one only dropped the page cache with posix_fadvise, which
leaves mapped pages resident; the new one unmaps them first) report the same MiB/token while
one of them reads less from the disk. This runs the same mmap config in each tree, in a
cgroup of the budget, with each cold method:

    tree      the tree's own make-cold (engine.bench._make_cold)
    fadvise   caches emptied, posix_fadvise DONTNEED only (what the old tree did)
    unmap     caches emptied, madvise DONTNEED on every mapping, then posix_fadvise DONTNEED

and prints decode tok/s with the disk bytes per token (/proc/self/io read_bytes: what the
process caused to be fetched from storage, page faults and MADV_POPULATE_READ included) and
the major faults (getrusage) of the decode tokens.

    python benchmarks/mmap_cold.py --tree /work/wt/base --tree . [--colds tree fadvise unmap]
        [--budget 1GiB] [--tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _mappings(store) -> list:
    files = getattr(store.pool, "files", None)
    return files.mappings() if files is not None else list(store.pool._maps.values())  # old tree: one io module


def _cold(engine, how: str) -> None:
    # Written out here rather than borrowed from fio_bound.drop_pages or the pool's
    # drop_page_cache: this runs inside the measured tree, whose engine may predate both, and
    # importing this tree's benchmarks would put this tree's engine on sys.path first.
    import gc
    import mmap

    from engine.run.bench import _make_cold
    store = engine.store
    if how == "tree":
        _make_cold(engine)
        return
    store.clear_caches()
    gc.collect()
    if how == "unmap":
        for mapping in _mappings(store):
            mapping.madvise(mmap.MADV_DONTNEED)
    paths = {s.path for key in store.layout.keys() for s in store.layout.location(*key).spans} \
        if hasattr(store, "layout") else set()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(a) -> dict:
    from engine.base.config import EngineConfig, parse_size
    from engine.run.generate import Sampler, generate, random_prompt_ids
    from engine.run.runtime import Engine

    cfg = EngineConfig(ram_budget=parse_size(a.budget), ctx_size=512, io_mode="mmap", prefetch_depth=1,
                       cpu_cache_ratio=0.6, chunk_size=1 << 20, threads=a.threads)
    eng = Engine(a.model, cfg)
    prompt = random_prompt_ids(a.prompt_tokens, eng.args.vocab_size, 0)
    generate(eng, prompt, 2, Sampler())  # warm-up, as bench does
    _cold(eng, a.cold)
    mark = {}

    def after_first(_token):
        if not mark:  # decode starts here: the prefill token touched nearly every expert
            mark.update(bytes=_read_bytes(), majflt=resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
            eng.store.reset_stats()

    gen = generate(eng, prompt, a.tokens + 1, Sampler(), on_token=after_first)
    n = len(gen.token_seconds)
    disk = _read_bytes() - mark["bytes"]
    majflt = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - mark["majflt"]
    st = eng.io_stats()
    out = {"decode_tok_s": n / sum(gen.token_seconds), "engine_mib_per_token": st["bytes_read"] / n / 2**20,
           "disk_mib_per_token": disk / n / 2**20, "major_faults_per_token": majflt / n,
           "io_stall_fraction": st.get("io_stall_fraction"), "output_ids": gen.output_ids}
    eng.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cold", default="tree", help=argparse.SUPPRESS)
    ap.add_argument("--tree", action="append", help="source tree to measure (repeatable; default: this one)")
    ap.add_argument("--colds", nargs="+", default=["tree", "fadvise", "unmap"], choices=["tree", "fadvise", "unmap"])
    ap.add_argument("--model", default=str(Path.home() / ".cache/colibri/models/demo"))
    ap.add_argument("--budget", default="1GiB")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.child:
        json.dump(child(a), sys.stdout)
        return 0
    sys.path.insert(0, str(ROOT))
    from engine.base.config import parse_size
    from tuner.sandbox.limited import run_limited

    rows = []
    for tree in [Path(t).resolve() for t in (a.tree or [str(ROOT)])]:
        for cold in a.colds:
            print(f"measuring {tree} cold={cold} ...", file=sys.stderr)
            argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--cold", cold, "--model", a.model,
                    "--budget", a.budget, "--tokens", str(a.tokens), "--prompt-tokens", str(a.prompt_tokens),
                    "--threads", str(a.threads)]
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            run = run_limited(argv, parse_size(a.budget), timeout=900, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)})
            if run.returncode != 0:
                print(f"mmap_cold: error: {tree} cold={cold} failed: {run.stderr.strip()[-400:]}", file=sys.stderr)
                return 1
            rows.append({"tree": str(tree), "cold": cold, "load_avg_1m": load, "wall_s": time.perf_counter() - t0,
                         "cgroup_limited": run.limited, "cgroup_peak": run.peak_bytes, **json.loads(run.stdout)})
    if a.json:
        json.dump(rows, sys.stdout, indent=2)
        return 0
    print(f"demo mmap pf1 cache0.6 chunk 1MiB, budget {a.budget} (cgroup), {a.tokens} decode tokens, {a.threads} threads\n")
    print("| tree | cold | decode tok/s | engine MiB/token | disk MiB/token | major faults/token | I/O stall | "
          "tokens = first row | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "ref" if r is rows[0] else ("yes" if r["output_ids"] == rows[0]["output_ids"] else "NO")
        stall = r["io_stall_fraction"]
        print(f"| {r['tree']} | {r['cold']} | {r['decode_tok_s']:.3f} | {r['engine_mib_per_token']:.0f} | "
              f"{r['disk_mib_per_token']:.0f} | {r['major_faults_per_token']:.0f} | "
              f"{'-' if stall is None else f'{stall:.0%}'} | {same} | {r['load_avg_1m']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
